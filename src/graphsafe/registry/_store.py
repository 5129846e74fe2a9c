"""The one weak per-layer store of declarations.

Keyed weakly by layer, so a layer that is garbage-collected leaves nothing behind. Everything else graphsafe
tracks hangs off a :class:`~graphsafe.GraphContract` instance. A layer with an entry also holds a
:class:`CopyHook` in its ``__dict__``, so that ``copy.deepcopy`` of it (or of a model holding it) gives the copy
the same declarations.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from graphsafe.paths import SlotPath

__all__ = [
    "COPY_HOOK_ATTR",
    "CopyHook",
    "Declaration",
    "LayerDeclarations",
    "declarations_generation",
    "declarations_of",
    "declared_layers",
    "iter_declared_layers",
    "layer_store",
]


@dataclass(frozen=True, slots=True)
class Declaration:
    """One declared graph-visible slot of a layer."""

    path: SlotPath
    source: str
    derived_from: tuple[str, ...] | None = None
    static: bool = False


@dataclass(slots=True)
class LayerDeclarations:
    """Declarations and stable storages of one layer."""

    slots: dict[str, Declaration] = field(default_factory=dict)
    stable: dict[str, torch.Tensor] = field(default_factory=dict)
    generation: int = 0

    def put(self, declaration: Declaration) -> None:
        existing = self.slots.get(declaration.path.text)
        if existing != declaration:
            self.slots[declaration.path.text] = declaration
            self.generation += 1

    def drop(self, path: str) -> bool:
        if self.slots.pop(path, None) is None:
            return False
        self.generation += 1
        return True


_STORE: weakref.WeakKeyDictionary[nn.Module, LayerDeclarations] = weakref.WeakKeyDictionary()


#: The ``__dict__`` key of a declaring layer's :class:`CopyHook`.
COPY_HOOK_ATTR = "_graphsafe_declarations"


class CopyHook:
    """Declarations travel with ``copy.deepcopy``: the store is keyed by the layer object, so a copy would
    otherwise declare nothing (and its undeclared tensors fail strict, or worse, its stable storage is shared).

    ``copy.deepcopy`` registers the copy of a layer in its memo before copying the layer's ``__dict__``, so this
    hook (one of the values copied) finds the copy there and gives it a copy of the entry: the same declarations,
    and stable storage taken through the same memo (the copy's own tensors). It holds the layer weakly, and the
    walker takes it for a leaf. Pickled, it is ``None``: no graphsafe is needed to unpickle a model, and an
    unpickled model declares nothing until its code declares again.
    """

    __slots__ = ("_owner",)

    def __init__(self, owner: nn.Module) -> None:
        self._owner = weakref.ref(owner)

    def __deepcopy__(self, memo: dict[int, object]) -> CopyHook | None:
        owner = self._owner()
        entry = _STORE.get(owner) if owner is not None else None
        twin = memo.get(id(owner)) if owner is not None else None
        if entry is None or not isinstance(twin, nn.Module) or twin is owner:
            return None
        copied = LayerDeclarations(dict(entry.slots), copy.deepcopy(entry.stable, memo), entry.generation)
        _STORE[twin] = copied
        return CopyHook(twin)

    def __copy__(self) -> CopyHook:
        return self

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return (type(None), ())


def layer_store(layer: nn.Module, *, create: bool = True) -> LayerDeclarations | None:
    """The store entry of ``layer`` (created on first use when ``create``)."""
    entry = _STORE.get(layer)
    if entry is None and create:
        entry = LayerDeclarations()
        _STORE[layer] = entry
        layer.__dict__[COPY_HOOK_ATTR] = CopyHook(layer)  # not through Module.__setattr__: no submodule logic
    return entry


def declarations_of(layer: nn.Module) -> Mapping[str, Declaration]:
    """The declared slots of ``layer`` by path text (empty when it declares nothing)."""
    entry = _STORE.get(layer)
    return entry.slots if entry is not None else {}


def declarations_generation(layer: nn.Module) -> int:
    """A counter that moves whenever ``layer``'s declarations change (0 for a layer that never declared).

    The contract compares it with the value it saw at seal to adopt declarations made after the seal cheaply.
    """
    entry = _STORE.get(layer)
    return entry.generation if entry is not None else 0


def declared_layers() -> list[nn.Module]:
    """Every live layer that has declarations or stable storage (the store holds layers weakly)."""
    return list(_STORE.keys())


def iter_declared_layers() -> Iterator[tuple[nn.Module, LayerDeclarations]]:
    """Every live layer that has an entry, with the entry (for diagnostics)."""
    return iter(list(_STORE.items()))
