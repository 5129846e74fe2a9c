"""The manifest's reload index: what its per-reload checks read that no reload changes, built once.

:meth:`~graphsafe.collectors.Manifest.held`, :meth:`~graphsafe.collectors.Manifest.check` and
:meth:`~graphsafe.collectors.Manifest.byte_ranges` run on every reload (``held`` several times). What they read of
the recorded storages (which are distinct, which are alive, which paths held each, the compiled getter of each
path, the layer names as a tree of module steps, the storages whose read bytes are known) changes only when a
capture is recorded, discarded or indexed again, or when a recorded storage is freed. :class:`ReloadIndex` holds it,
built for one generation of the manifest (bumped by every capture, discard, reindex and vouch) and one liveness of
its storages; :meth:`ReloadIndex.fits` tells, per call, whether it still describes the manifest.

What must be asked per reload is still asked per call: the layers are resolved again from the model (a module
replaced between reloads, or between two calls of one reload, is the new one), each path is read again through its
getter, and each storage's identity and address are compared again by the check.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from torch import nn

from graphsafe.paths import Getter, SlotPath, compile_getter, plain_child

if TYPE_CHECKING:
    from graphsafe.collectors._manifest import CapturedStorage, Holder

__all__: list[str] = []


@functools.lru_cache(maxsize=65536)
def _getter(path: SlotPath) -> Getter:
    """``path``'s compiled getter, one per distinct path (``root -> resolve_or(root, MISSING)``)."""
    return compile_getter(path)


def _child(module: nn.Module, atom: str) -> nn.Module | None:
    """One step of :meth:`torch.nn.Module.get_submodule`: the module at ``atom``, ``None`` where it raises
    ``AttributeError`` (no such attribute, or not a module)."""
    child = plain_child(module, atom)  # straight from ``_modules`` where provably the same
    if child is not None:
        return child
    if not hasattr(module, atom):
        return None
    found = getattr(module, atom)
    return found if isinstance(found, nn.Module) else None


class _LayerTree:
    """The layer names holders name, as a tree of module steps: node 0 is the model, every other node one atom
    below its parent (parents first), so a call resolves each module on the way once, not once per name."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, str]] = [(-1, "")]
        self._nodes: dict[str, int] = {"": 0}

    def node(self, qualname: str) -> int:
        found = self._nodes.get(qualname)
        if found is None:
            parent, _, atom = qualname.rpartition(".")
            step = (self.node(parent), atom)  # the parent's node first: parents come before their children
            found = len(self.steps)
            self.steps.append(step)
            self._nodes[qualname] = found
        return found

    def resolve(self, model: nn.Module) -> list[nn.Module | None]:
        """Every node's module as ``model.get_submodule`` finds it now (``None`` where it raises)."""
        modules: list[nn.Module | None] = [model]
        for parent, atom in self.steps[1:]:
            base = modules[parent]
            modules.append(None if base is None else _child(base, atom))
        return modules


_HOLDERS: Final = operator.attrgetter("holders")
_CALL: Final = weakref.ReferenceType.__call__

#: One holder as a call reads it: the holder, its layer's node in the tree, its path's getter.
Compiled = tuple["Holder", int, Getter]


class ReloadIndex:
    """What the manifest's reload checks read of the recorded storages, for one generation and liveness."""

    __slots__ = (
        "_dead",
        "_entries",
        "_holders",
        "_refs",
        "byte_ranges",
        "generation",
        "held",
        "layers",
        "read_unowned",
        "rows",
        "storages",
    )

    def __init__(self, generation: int, entries: Sequence[CapturedStorage], storages: list[CapturedStorage]) -> None:
        self.generation = generation
        # Every entry, with the holders and the storage references it was indexed with (what fits() compares).
        self._entries = list(entries)
        self._holders = [entry.holders for entry in self._entries]
        self._refs = [entry.storage_ref for entry in self._entries]
        self._dead = [ref() for ref in self._refs].count(None)
        #: One entry per distinct storage (``Manifest.storages``).
        self.storages = storages
        self.layers = _LayerTree()
        #: Per distinct storage: the entry and its holders compiled (dead ones: none needed).
        self.rows: list[tuple[CapturedStorage, tuple[Compiled, ...]]] = []
        #: Every path that held a live recorded storage, once, in the order ``Manifest.held`` yields them.
        self.held: list[Compiled] = []
        seen: set[tuple[str, str]] = set()
        for entry in storages:
            if entry.storage_ref() is None:
                self.rows.append((entry, ()))
                continue
            compiled = tuple((h, self.layers.node(h.layer), _getter(h.slot_path)) for h in entry.holders)
            self.rows.append((entry, compiled))
            for item in compiled:
                key = (item[0].layer, item[0].path)
                if key not in seen:
                    seen.add(key)
                    self.held.append(item)
        #: The live storages a capture read that no model path held (``Manifest.read_unowned``).
        self.read_unowned = [
            entry for entry in storages if not entry.holders and entry.read and entry.storage_ref() is not None
        ]
        #: The live storages whose read bytes the recorder knows exactly (``Manifest.byte_ranges``).
        self.byte_ranges = [
            entry
            for entry in storages
            if entry.backend == "dispatch" and entry.hi > entry.lo and entry.storage_ref() is not None
        ]

    def fits(self, generation: int) -> bool:
        """Whether this index still describes the manifest: the same generation, every entry with the holders it
        was indexed with, and no storage freed since (a freed one never comes back, so the same count of freed
        references is the same set). O(entries) in C loops, no path resolved."""
        if generation != self.generation:
            return False
        if not all(map(operator.is_, map(_HOLDERS, self._entries), self._holders)):
            return False
        return list(map(_CALL, self._refs)).count(None) == self._dead

    def resolve(self, model: nn.Module) -> list[nn.Module | None]:
        """The holders' layers as the model holds them now, by node (see :class:`_LayerTree`)."""
        return self.layers.resolve(model)
