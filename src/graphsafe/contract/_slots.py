"""The plan compiled at seal: what a seal records per layer (:class:`SealedLayer`) and per slot (:class:`SealedSlot`).

Per reload the work is a compiled plan: at seal every slot gets its path compiled into a getter and a setter
(:mod:`graphsafe.contract._access`), its expected layout as one comparable tuple and its copy group; a reload
then compares cheap fields first and falls back to the full geometry comparison only when they differ. The
per-reload work on one layer is :class:`~graphsafe.contract._snapshot.LayerSnapshot`'s.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.contract._copy import plain_layout, span_of
from graphsafe.contract._tensorref import TensorRef
from graphsafe.outcome import (
    Finding,
    FindingKind,
    Fingerprint,
    Origin,
    SlotRef,
    inner_tensors,
    read_params,
    shape_and_stride,
    tensor_kind,
)
from graphsafe.paths import MISSING, Getter, Setter, SlotPath, compile_getter, compile_setter
from graphsafe.registry import Declaration

__all__ = ["InputRef", "SealedLayer", "SealedSlot"]

_MISSING: Any = MISSING


def _view(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The cheap layout tuple of a tensor as it is now (compared with :attr:`SealedSlot.layout`): everything that
    changes how its bytes are read, the class and a quantized tensor's scale included."""
    if tensor.is_nested:  # no sizes or strides: its flat buffer, and its components' layout (read_params)
        shape, stride = shape_and_stride(tensor)
        return (shape, stride, tensor.dtype, tensor.device, False, False, type(tensor), read_params(tensor))
    quantized = read_params(tensor) if tensor.is_quantized else None
    return (
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor.is_conj(),
        tensor.is_neg(),
        type(tensor),
        quantized,
    )


@dataclass(slots=True)
class SealedSlot:
    """One tracked slot: its path, its sealed fingerprint and the identity of the captured tensor object (no weak
    reference to it: ``torch.utils.swap_tensors`` refuses a tensor that has one; see :class:`TensorRef`)."""

    path: SlotPath
    fp: Fingerprint
    tensor_ref: TensorRef
    origin: Origin
    declaration: Declaration | None = None
    restorable: bool = True
    reason: str | None = None
    alias_of: str | None = None
    #: What PWAL was seen computing this slot from (a recorded reload), or ``None`` when never recorded.
    inputs: tuple[InputRef, ...] | None = None
    #: A walker-found slot that no recording classified (it came to be tracked after the initial load's recording,
    #: or a reload's PWAL left it, which a wrong skip guard does too): whether PWAL computes it is unknown, so it
    #: stays watched for freshness (see :meth:`LayerSnapshot.take`). Set for every walker slot at seal; only the
    #: initial load's recording (``record_inputs()``) or a recorded PWAL computing it clears it.
    unrecorded: bool = False
    #: Only its freshness is judged (a path the capture manifest saw holding captured storage under
    #: ``detect="declared-only"``): never restored nor verified here; where it moved, the manifest's check speaks.
    watch_only: bool = False
    #: A reload left it holding values not computed from the inputs its layer holds now (found ``stale``, or the
    #: reload raised after its inputs were written and before PWAL refreshed it), and a reseal keeps it so: until a
    #: reload rebuilds it or changes its values, leaving it as it is is ``stale``, whether its inputs change or not
    #: (a same-weights retry must not take it for fresh).
    owed: bool = False
    #: A freshness-tracked slot inside a parameter's or buffer's captured memory: that one's ``layer:path`` (set at
    #: seal by :func:`~graphsafe.contract._carved.mark_inside_loaded`); a change of its bytes is no proof of PWAL.
    inside: str | None = None
    #: With :attr:`inside`: the slot's tensor may share that parameter's version counter (an autograd view of it,
    #: or of a ``detach()`` of it), so a write through the slot cannot be told from the loader's write either.
    shares_version: bool = False
    key: tuple[Any, ...] = field(init=False)
    # The compiled plan (derived from the fields above at construction):
    get: Getter = field(init=False, repr=False)
    set: Setter = field(init=False, repr=False)
    #: ``_view`` as sealed: (shape, stride, dtype, device, conj bit, neg bit, class, quantization parameters).
    layout: tuple[Any, ...] = field(init=False, repr=False)
    #: A wrapper subclass: its memory is its inner tensors', restored and verified one by one (never fast paths).
    wrapped: bool = field(init=False, repr=False)
    group: tuple[Any, ...] = field(init=False, repr=False)  # the copy group of the captured tensor
    nbytes: int = field(init=False, repr=False)
    #: :func:`byte_span` of the captured tensor as sealed (what a copy into it writes, while it is laid out so).
    span: tuple[int, int] = field(init=False, repr=False)
    plain: bool = field(init=False, repr=False)  # see CopyBatch.add, for the captured tensor as sealed
    tracks_freshness: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fp = self.fp
        self.key = fp.key
        self.get = compile_getter(self.path)
        self.set = compile_setter(self.path)
        # The raw class of the sealed object (a Parameter stays a Parameter), so that the in-place check matches it.
        cls = self.tensor_ref.kind
        self.layout = (fp.shape, fp.stride, fp.dtype, fp.device, fp.conj, fp.neg, cls, None if fp.inner else fp.meta)
        self.wrapped = bool(fp.inner)
        self.group = (fp.device, fp.dtype, fp.layout)
        self.nbytes = fp.nbytes
        self.span = span_of(fp.shape, fp.stride, fp.storage_offset, fp.dtype.itemsize)
        self.plain = plain_layout(fp.conj, fp.neg, fp.stride)
        declaration = self.declaration
        # Declared derived slots, and tensors only the walker found (see LayerSnapshot.take for when those are
        # watched): a reload that changes the weights and leaves them as they were must not commit.
        self.tracks_freshness = (
            self.origin is Origin.DECLARED and declaration is not None and not self.static
        ) or self.origin is Origin.WALKER

    @property
    def static(self) -> bool:
        """Whether the author declared the slot's contents fixed: no weight they are computed from."""
        return self.declaration is not None and self.declaration.static

    def captured(self, current: Any = MISSING) -> torch.Tensor | None:
        """The captured tensor: the original object where ``current`` (what the path holds now) is it, else a new
        view on the captured storage, or ``None`` if freed."""
        if self.tensor_ref.holds(current):
            return current  # type: ignore[no-any-return]
        return _rebuild(self.fp)


def _rebuild(fp: Fingerprint) -> torch.Tensor | None:
    """A new view on the storage ``fp`` names, read as sealed (bits, class; a wrapper from its inner tensors), or
    ``None`` if freed or not rebuildable."""
    if fp.inner:
        inner: dict[str, torch.Tensor] = {}
        for name, part in fp.inner:
            value = _rebuild(part)
            if value is None:
                return None
            inner[name] = value
        try:  # the flatten metadata is kept in comparable form: a wrapper that cannot take it back is not rebuilt
            rebuilt = fp.kind.__tensor_unflatten__(inner, fp.meta, fp.shape, fp.stride)  # type: ignore[attr-defined]
        except Exception:
            return None
        return rebuilt if isinstance(rebuilt, torch.Tensor) else None
    storage = fp.storage_ref()
    if storage is None:
        return None
    view = torch.empty(0, dtype=fp.dtype, device=fp.device)
    view.set_(storage, fp.storage_offset, fp.shape, fp.stride)
    if fp.conj:
        view = view.conj()
    if fp.neg:
        view = torch._neg_view(view)
    if fp.kind is not torch.Tensor:
        view = view.as_subclass(fp.kind)
    return view


@dataclass(slots=True)
class SealedLayer:
    """Everything sealed for one layer."""

    layer_ref: weakref.ReferenceType[nn.Module]
    qualname: str
    layer_class: str
    slots: list[SealedSlot]
    declared_generation: int
    walk_exhausted: str | None = None
    #: Where the seal's walk found device tensors no slot path can name (each an ``untrackable`` finding per reload).
    untrackable: tuple[str, ...] = ()
    #: Whether two slots share a captured storage (only then can an alias break, or a copy pair repeat).
    shares_storage: bool = field(init=False)
    #: Whether a captured storage of this layer is also tracked by another layer (set by the contract).
    shared_across_layers: bool = field(init=False, default=False)
    known_paths: frozenset[str] = field(init=False)
    atoms: tuple[str, ...] = field(init=False)  # the qualified name, split (to check the layer is still there)

    def __post_init__(self) -> None:
        self.atoms = tuple(self.qualname.split(".")) if self.qualname else ()
        self.slots_changed()

    def slots_changed(self) -> None:
        """Recompute what is derived from :attr:`slots`; call after adding or replacing one (a late declaration)."""
        memory = [part for slot in self.slots for part in slot.fp.memory()]
        storages = {id(part.storage_ref()) for part in memory}  # all alive at seal: ids are distinct
        self.shares_storage = len(storages) < len(memory)
        self.known_paths = frozenset(slot.path.text for slot in self.slots)

    def layer_finding(self, kind: FindingKind, detail: str, *, declared: bool) -> Finding:
        """A finding about the layer as a whole (no slot path)."""
        return Finding(
            kind=kind, layer=self.qualname, layer_class=self.layer_class, path="", declared=declared, detail=detail
        )

    def finding(self, kind: FindingKind, slot: SealedSlot, **extra: Any) -> Finding:
        detail = extra.pop("detail", "")
        if slot.origin is Origin.ALIAS and slot.alias_of:
            detail = f"{detail}; alias of tracked slot {slot.alias_of!r}".lstrip("; ")
        elif slot.origin.is_state:
            detail = f"{detail}; a parameter or buffer of the layer".lstrip("; ")
        return Finding(
            kind=kind,
            layer=self.qualname,
            layer_class=self.layer_class,
            path=slot.path.text,
            declared=slot.origin.declared,
            before=extra.pop("before", slot.fp),
            after=extra.pop("after", None),
            detail=detail,
        )


def _describe_geometry_change(slot: SealedSlot, tensor: torch.Tensor) -> str:
    changes = []
    kind = tensor_kind(tensor)
    if kind is not slot.fp.kind:
        changes.append(f"class {slot.fp.kind.__name__} -> {kind.__name__}")
    elif slot.fp.inner:
        changes.append(f"the inner tensors or metadata of the {kind.__name__} wrapper")
    elif (tensor.is_conj(), tensor.is_neg()) != (slot.fp.conj, slot.fp.neg):
        now = _bits(tensor.is_conj(), tensor.is_neg())
        changes.append(f"conj/neg bits {_bits(slot.fp.conj, slot.fp.neg)} -> {now}")
    elif tensor.dtype == slot.fp.dtype and read_params(tensor) != slot.fp.meta:
        changes.append(f"quantization (scheme, scale, zero point) {slot.fp.meta} -> {read_params(tensor)}")
    if tuple(tensor.shape) != slot.fp.shape:
        changes.append(f"shape {list(slot.fp.shape)} -> {list(tensor.shape)}")
    if tensor.dtype != slot.fp.dtype:
        changes.append(f"dtype {slot.fp.dtype} -> {tensor.dtype}")
    if tensor.device != slot.fp.device:
        changes.append(f"device {slot.fp.device} -> {tensor.device}")
    if not changes and tensor.storage_offset() != slot.fp.storage_offset:
        changes.append(f"offset {slot.fp.storage_offset} -> {tensor.storage_offset()}")
    if not changes:
        changes.append(f"stride {list(slot.fp.stride)} -> {list(tensor.stride())}")
    return ", ".join(changes)


def _is_wrapper(tensor: torch.Tensor) -> bool:
    try:
        return inner_tensors(tensor) is not None
    except TypeError:
        return True  # a wrapper with a broken flatten protocol: still no storage of its own


def _leaf_names(fp: Fingerprint, prefix: str = "") -> list[tuple[str, Fingerprint]]:
    """``(dotted inner name, fingerprint)`` of every tensor whose storage ``fp`` reads (see ``Fingerprint.memory``)."""
    if not fp.inner:
        return [(prefix, fp)]
    return [leaf for name, part in fp.inner for leaf in _leaf_names(part, f"{prefix}.{name}" if prefix else name)]


def _bits(conj: bool, neg: bool) -> str:
    return "+".join(name for name, on in (("conj", conj), ("neg", neg)) if on) or "none"


# -- freshness ---------------------------------------------------------------------------------------------
#
# A declared, non-static slot is ``stale`` when one of its inputs changed during the reload and PWAL neither
# rebuilt it (a new storage at its path) nor really wrote it in place (its value sample changed). Its inputs are,
# in order of preference: what the recording of a first reload saw PWAL read (``SealedSlot.inputs``, plus any
# ``derived_from``); the declared ``derived_from``; else every parameter, buffer and plain tensor attribute of the
# layer and the modules under it (its own declared slots excepted).


@dataclass(frozen=True, slots=True)
class InputRef:
    """A tensor a derived slot was seen being computed from, as the model holds it: a module and a path on it."""

    module_ref: weakref.ReferenceType[nn.Module]
    path: SlotPath
    ref: SlotRef  # the module's qualified name and the path: how the input is named to users
    _get: Getter = field(init=False, repr=False, compare=False, hash=False)
    #: How a snapshot's inputs know this one: the module's identity and the path (used only while it resolves, so
    #: while that module is alive).
    key: tuple[int, str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Compiled once, read on every reload.
        object.__setattr__(self, "_get", _getter(self.path))
        object.__setattr__(self, "key", (id(self.module_ref()), self.path.text))

    def resolve(self) -> Any:
        module = self.module_ref()
        return _MISSING if module is None else self._get(module)

    def label(self, layer: str) -> str:
        """The input's name relative to ``layer`` where it lies under it (``inner.weight``), else ``owner:path``."""
        if self.ref.layer == layer:
            return self.path.text
        if not layer or self.ref.layer.startswith(layer + "."):
            return f"{self.ref.layer[len(layer) + 1 if layer else 0 :]}.{self.path.text}"
        return str(self.ref)


@functools.lru_cache(maxsize=65536)
def _path(text: str) -> SlotPath:
    return SlotPath(text)


@functools.lru_cache(maxsize=65536)
def _getter(path: SlotPath) -> Getter:
    return compile_getter(path)
