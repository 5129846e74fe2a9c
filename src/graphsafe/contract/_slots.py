"""What a seal records per layer, and the per-reload work on one layer: snapshot, restore, verify.

This is the only code that mutates a model during reload (copies into captured storage, rebinds paths).

Per reload the work is a compiled plan: at seal every slot gets its path compiled into a getter and a setter
(:mod:`graphsafe.contract._access`), its expected layout as one comparable tuple and its copy group; a reload
then compares cheap fields first and falls back to the full geometry comparison only when they differ.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.contract._copy import (
    CopyBatch,
    byte_span,
    clone_laid_out,
    copy_group,
    distinct_views,
    overlapping_pairs,
    plain_layout,
    span_of,
    spans_overlap,
)
from graphsafe.contract._samples import (
    INPUT_ELEMENTS,
    SLOT_ELEMENTS,
    Digest,
    Sample,
    SampleBatch,
    digests,
    flat_copy,
    same_digests,
    unchanged,
    version_of,
)
from graphsafe.contract._tensorref import TensorRef
from graphsafe.outcome import (
    Finding,
    FindingKind,
    Fingerprint,
    Origin,
    SlotRef,
    fingerprint,
    geometry_key,
    inner_tensors,
    memory_tensors,
    read_params,
    shape_and_stride,
    tensor_kind,
)
from graphsafe.paths import MISSING, Getter, Setter, SlotPath, compile_getter, compile_setter
from graphsafe.registry import Declaration, declarations_of

__all__ = [
    "ClosedLayer",
    "InputRef",
    "LayerSnapshot",
    "RestorePlan",
    "SealedLayer",
    "SealedSlot",
    "SharedIndex",
    "ValuesBefore",
    "check_freshness",
    "held_outside",
    "repointed_inference",
    "judge_noted",
]

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
            self.origin is Origin.DECLARED and declaration is not None and not declaration.static
        ) or self.origin is Origin.WALKER

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


def _strided(value: Any) -> bool:
    """Whether ``value`` is a tensor with strided storage whose values can be sampled (not sparse, mkldnn, meta, or
    nested: torch's nested tensors report a strided layout but have no sizes or strides to read)."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout is torch.strided
        and value.device.type != "meta"
        and not value.is_nested
    )


def written_unseen(entries: Sequence[tuple[torch.Tensor | None, int, Sample | None, Any]]) -> list[bool]:
    """For each ``(tensor at a slot's path before a recorded load or None, its version counter then, its value
    sample then, the value there now)`` that the recording saw neither made nor written: whether it was made or
    written all the same (another tensor, a moved version counter, another value sample).

    Then the recording was blind to it (PWAL on another thread, a write past torch's dispatcher: ``.numpy()``, a
    raw kernel launch) and says nothing about whether PWAL computes it: it must not make the slot a fixed table.
    """
    result = [True] * len(entries)
    asked: list[tuple[int, Sample, torch.Tensor]] = []
    for position, (before, version, sample, now) in enumerate(entries):
        if before is None or sample is None or not _strided(now) or not _strided(before):
            continue  # made (or given a tensor without storage) where the recording did not see it
        if now is not before and (
            now.untyped_storage() is not before.untyped_storage()
            or now.data_ptr() != before.data_ptr()
            or _view(now) != _view(before)
        ):
            continue
        if version_of(now) != version:
            continue
        asked.append((position, sample, now))
    if asked:
        same = unchanged([(sample, now) for _, sample, now in asked], SLOT_ELEMENTS)
        for (position, _, _), kept in zip(asked, same, strict=True):
            result[position] = not kept
    return result


@dataclass(slots=True)
class ValuesBefore:
    """The tensors found before a recorded initial load (``record_inputs()``), each by identity with its version
    counter and value sample: what :func:`written_unseen` checks a slot the recording did not see computed
    against, since the seal (and so the slot) comes only after that load."""

    taken: dict[int, tuple[TensorRef, int, Sample]]

    @classmethod
    def take(cls, tensors: Iterable[torch.Tensor]) -> ValuesBefore:
        batch = SampleBatch()
        taken: dict[int, tuple[TensorRef, int, Sample]] = {}
        for tensor in tensors:
            if _strided(tensor) and id(tensor) not in taken:
                taken[id(tensor)] = (TensorRef.of(tensor), version_of(tensor), batch.take(tensor, SLOT_ELEMENTS))
        batch.flush()
        return cls(taken)

    def written_unseen(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """:func:`written_unseen` for each tensor now at a slot's path (one that was not there before: made)."""
        entries: list[tuple[torch.Tensor | None, int, Sample | None, Any]] = []
        for tensor in tensors:
            entry = self.taken.get(id(tensor))
            if entry is None or not entry[0].holds(tensor):
                entries.append((None, -1, None, tensor))
            else:
                entries.append((tensor, entry[1], entry[2], tensor))
        return written_unseen(entries)


# An input before PWAL: (storage, version, value sample, digest of every byte or None), or None where the path held
# no tensor.
_InputBefore = tuple["weakref.ReferenceType[Any]", int, Sample, Digest] | None
# How an input changed: not at all; written with maybe the same values (its version counter moved, or another
# storage now holds the same values); or for sure (other values, gone).
_UNCHANGED, _MAYBE, _CHANGED = 0, 1, 2


def _input_before(value: Any, samples: SampleBatch) -> _InputBefore:
    # A tensor without strided storage to sample (sparse, mkldnn, nested, meta) is taken as no tensor before: where
    # it is one now, it counts as changed (fail closed: a slot left in place beside it is judged stale).
    if not _strided(value):
        return None
    sample, whole = samples.take(value, INPUT_ELEMENTS), samples.digest(value)
    return weakref.ref(value.untyped_storage()), version_of(value), sample, whole


def _reads_storage(before: _InputBefore, storage: Any) -> bool:
    return before is not None and storage is not None and before[0]() is storage


def _input_change(before: _InputBefore, value: Any) -> int:
    return _input_changes([(before, value)])[0]


def _input_changes(asked: Sequence[tuple[_InputBefore, Any]]) -> list[int]:
    """How each input ``(before, now)`` changed; the value samples, then the digests, of all compared in a batch."""
    changes: list[int] = []
    sampled: list[tuple[int, tuple[Any, int, Sample, Digest], torch.Tensor]] = []
    for position, (before, value) in enumerate(asked):
        change = _input_change_unsampled(before, value)
        changes.append(_CHANGED if change is None else change)
        if change is None:
            assert before is not None
            sampled.append((position, before, value))
    same = unchanged([(before[2], value) for _, before, value in sampled], INPUT_ELEMENTS)
    kept = [entry for entry, sampled_same in zip(sampled, same, strict=True) if sampled_same]
    for (position, _, _), change in zip(kept, _changes_of_same_samples([(b, v) for _, b, v in kept]), strict=True):
        changes[position] = change
    return changes


def _input_change_unsampled(before: _InputBefore, value: Any) -> int | None:
    """How an input changed where that is plain without comparing values; ``None`` where the values decide."""
    if before is None:
        return _UNCHANGED if not isinstance(value, torch.Tensor) else _CHANGED
    if not isinstance(value, torch.Tensor):
        return _CHANGED
    return None


def _changes_of_same_samples(asked: Sequence[tuple[Any, torch.Tensor]]) -> list[int]:
    """How inputs whose value sample is as it was changed: for sure where the digest of every byte differs (a change
    the sample skipped), else not at all or maybe (written again: the version counter or the storage)."""
    changes: list[int] = []
    compared: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, digest before, tensor now)
    for position, (before, value) in enumerate(asked):
        storage, version, _, old = before
        changes.append(_UNCHANGED if storage() is value.untyped_storage() and version_of(value) == version else _MAYBE)
        old_digest = old.get()
        if old_digest is not None:
            compared.append((position, old_digest, value))
    now = digests([value for _, _, value in compared])
    # no digest now (a layout without one): the sample alone decides
    pairs = [(position, (old, new)) for (position, old, _), new in zip(compared, now, strict=True) if new is not None]
    for (position, _), same in zip(pairs, same_digests([pair for _, pair in pairs]), strict=True):
        if not same:
            changes[position] = _CHANGED
    return changes


_Input = tuple[str, Callable[[], Any], _InputBefore]
# A declared slot before PWAL: (tensor at the path, its version, its value sample, the keys of its inputs).
_Freshness = tuple[torch.Tensor, int, Sample, tuple[Any, ...]]


def _attribute(module: nn.Module, name: str) -> Callable[[], Any]:
    module_ref = weakref.ref(module)

    def resolve() -> Any:
        owner = module_ref()
        return _MISSING if owner is None else getattr(owner, name, _MISSING)

    return resolve


def _layer_inputs(layer: nn.Module) -> list[tuple[Any, str, Callable[[], Any]]]:
    """The fallback inputs of ``layer``: ``(key, name, resolve)`` for every parameter, buffer and plain tensor
    attribute of the layer and the modules under it, except each module's own declared slots."""
    found: list[tuple[Any, str, Callable[[], Any]]] = []
    for prefix, module in layer.named_modules():
        declared = declarations_of(module)
        names: list[str] = [n for n, p in module._parameters.items() if p is not None]
        names += [n for n, b in module._buffers.items() if b is not None]
        names += [n for n, v in vars(module).items() if isinstance(v, torch.Tensor) and n not in declared]
        for name in names:
            found.append(((id(module), name), f"{prefix}.{name}" if prefix else name, _attribute(module, name)))
    return found


@dataclass(slots=True)
class _Inputs:
    """The inputs a layer's snapshot watches, each resolved and sampled once however many slots read it."""

    layer: nn.Module
    qualname: str
    samples: SampleBatch
    inputs: dict[Any, _Input] = field(default_factory=dict)
    fallback: tuple[Any, ...] | None = None  # the keys of _layer_inputs, computed on first need
    loaded: set[Any] = field(default_factory=set)  # the keys of those that are parameters or buffers
    live: dict[Any, bool] = field(default_factory=dict)  # recorded input key -> whether it resolves to a tensor
    #: The modules above the layer, nearest first, ``(qualified name, module)``: where a layer with no weights of
    #: its own (a child holding a cache) takes its fallback inputs from.
    outer: Callable[[], list[tuple[str, nn.Module]]] | None = None

    def _add(self, key: Any, name: str, resolve: Callable[[], Any]) -> Any:
        if key not in self.inputs:
            self.inputs[key] = (name, resolve, _input_before(resolve(), self.samples))
        return key

    def _outer_fallback(self) -> tuple[Any, ...]:
        """The fallback inputs of the nearest module above the layer that holds loaded state (parameters or
        buffers): a layer without weights of its own would otherwise never be stale."""
        for name, module in self.outer() if self.outer is not None else ():
            entries = _layer_inputs(module)
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                return tuple(
                    self._add(key, f"{name}:{label}" if name else label, resolve) for key, label, resolve in entries
                )
        return ()

    def _resolves(self, ref: InputRef) -> bool:
        """Whether a recorded input resolves to a tensor now (asked once per input and snapshot: slots share them)."""
        live = self.live.get(ref.key)
        if live is None:
            live = self.live[ref.key] = isinstance(ref.resolve(), torch.Tensor)
        return live

    def _recorded_keys(self, recorded: tuple[InputRef, ...]) -> tuple[Any, ...]:
        """The keys of recorded inputs, each resolved and sampled once per layer and reload (named only then)."""
        inputs = self.inputs
        keys: list[Any] = []
        for ref in recorded:
            key = ref.key
            if key not in inputs:
                self._add(key, ref.label(self.qualname), ref.resolve)
            if key not in keys:
                keys.append(key)
        return tuple(keys)

    def of(self, slot: SealedSlot) -> tuple[Any, ...]:
        """The keys of ``slot``'s inputs (see the section comment for which).

        A recorded input or a ``derived_from`` name that no longer resolves to a tensor (a module replaced, a
        tensor deleted) makes the slot fall back to the whole layer: an input that cannot be watched must not
        make the slot look fresh.
        """
        layer = self.layer
        sources = slot.declaration.derived_from if slot.declaration is not None else None
        recorded = slot.inputs
        if recorded is not None and not all(map(self._resolves, recorded)):
            recorded = None
        if recorded is not None and not sources:
            return self._recorded_keys(recorded)  # the common case after a recording
        paths = [_path(source) for source in sources or ()]
        if (recorded is None and sources is None) or not all(
            isinstance(_getter(path)(layer), torch.Tensor) for path in paths
        ):
            if self.fallback is None:
                self.fallback = tuple(self._add(*entry) for entry in _layer_inputs(layer))
                self.loaded = {(id(m), n) for _, m in layer.named_modules() for n in (*m._parameters, *m._buffers)}
            # An undeclared plain attribute is in the fallback, and so is any other plain path to its memory (an
            # alias): none of them is its own input. Loaded state is, even where it is a view of it (weight.t()).
            current = slot.get(layer)
            own = current.untyped_storage() if isinstance(current, torch.Tensor) else None
            others = tuple(
                key for key in self.fallback if key in self.loaded or not _reads_storage(self.inputs[key][2], own)
            )
            if any(key in self.loaded for key in others):
                return others
            # No loaded state in the layer (a child holding derived tensors): its tensors are computed from the
            # weights of a module above it; its plain tensors stay inputs too.
            return tuple(dict.fromkeys((*others, *self._outer_fallback())))
        keys = list(self._recorded_keys(recorded)) if recorded is not None else []
        for path in paths:
            keys.append(self._add((id(layer), path.text), path.text, functools.partial(_getter(path), layer)))
        return tuple(dict.fromkeys(keys))


@dataclass(slots=True)
class LayerSnapshot:
    """One layer's state for one reload: strong references to every captured tensor until restore is done."""

    sealed: SealedLayer
    layer: nn.Module
    slots: list[SealedSlot]
    captured: list[torch.Tensor | None]
    findings: list[Finding] = field(default_factory=list)
    freshness: dict[int, _Freshness] = field(default_factory=dict)
    inputs: _Inputs | None = None
    restored: int = 0
    bytes_copied: int = 0
    done: bool = False
    #: Whether slots may share captured storage (sealed so, or walker extras whose storage is unknown ahead).
    shared: bool = False
    #: Slot index -> (the new tensor at its path, a clone of its values): taken when another layer's restore was
    #: about to write into the memory that tensor reads, before this layer was restored (layerwise reloads).
    #: A wrapper's are clones of its inner tensors, in flatten order (see :func:`memory_tensors`).
    overrides: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    #: Freshness checks :func:`judge_noted` found due, run by :func:`check_freshness` once the plan's copies landed.
    fresh_due: list[tuple[int, SealedSlot, torch.Tensor, bool]] = field(default_factory=list)
    #: Slots :meth:`_note_fresh` found on their captured memory, with their samples, until :func:`judge_noted`.
    noted: list[tuple[int, SealedSlot, torch.Tensor, bool, Sample]] = field(default_factory=list)
    #: Slots :func:`judge_noted` found on their captured memory with another value sample than before the load.
    resampled: set[int] = field(default_factory=set)
    #: New tensors :meth:`restore` leaves at their paths (findings): the plan must not change what they read.
    kept: list[torch.Tensor] = field(default_factory=list)
    #: Slots planned for a copy whose captured tensor, its base or its storage something besides the snapshot still
    #: holds (see :func:`held_outside`), for the contract to look for who: ``(slot index, what, part)``. ``part`` is
    #: the position of a wrapper's inner tensor (in flatten order) whose
    #: storage is held, ``-1`` for every part of a wrapper held as a whole, ``None`` for a plain tensor. (Not the
    #: storage object itself: a reference to it would make the next slot on that storage look held.)
    suspects: list[tuple[int, str, int | None]] = field(default_factory=list)
    #: Slot index -> what an ``alias-broken`` slot keeps instead of its new tensor, whose memory a copy overwrote.
    keep: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Each captured tensor's version counter when the snapshot was taken (-1: none, or a view rebuilt from the
    #: storage, whose counter no write through the model's tensors moves).
    versions: list[int] = field(default_factory=list)
    #: Watch-only slots whose path left their captured memory: ``(slot index, device, first address, end)``.
    gone: list[tuple[int, str, int, int]] = field(default_factory=list)
    #: Per slot, whether the reload wrote its captured memory before the restore's copies (set at restore).
    written: list[bool] = field(default_factory=list)
    #: The transaction's captured objects by id (see :meth:`take`): one more reference of ours to each.
    originals: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Per slot, whether PWAL left it reading its captured memory as captured (set at restore, before copies).
    left: list[bool] = field(default_factory=list)
    #: Per slot, whether :meth:`verify` found the captured object at its path on its captured memory as sealed.
    confirmed: list[bool] = field(default_factory=list)
    #: Slot index -> the new tensor at its path, where it or the captured one carries Python attributes
    #: (``weight.g_idx`` hung on a parameter, a scale on a derived tensor): :meth:`rebind` gives the captured
    #: tensor the new one's.
    attributes: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Slot index -> the new tensor at its path, for every planned rebind (see :meth:`bound_instead`).
    swapped: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Slot index -> the attributes of :attr:`attributes`' tensor, read before any rebind of the step moved one.
    carried: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Tensors left in place that carry attributes (which may name a new tensor the step replaces).
    attributed: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def take(
        cls,
        sealed: SealedLayer,
        layer: nn.Module,
        extra: Iterable[SealedSlot] = (),
        *,
        samples: SampleBatch,
        recorded: bool = False,
        outer: Callable[[], list[tuple[str, nn.Module]]] | None = None,
        scratch: Callable[[torch.Tensor], bool] | None = None,
        originals: dict[int, torch.Tensor] | None = None,
    ) -> LayerSnapshot:
        """Snapshot ``layer`` before its load.

        ``originals``: the captured objects earlier snapshots of this transaction held, by ``id`` (the transaction
        keeps them alive, so an ``id`` names one object): a captured tensor a path no longer holds (PWAL ran again
        after its layer's ``after_layer()``) is found there rather than rebuilt as a new view; this snapshot adds
        its own.

        ``recorded``: a recording of PWAL (the first reload's, or the initial load's under ``record_inputs()``)
        exists. A tensor only the walker found is then watched for freshness if that recording saw PWAL compute it
        or classified nothing about it (``unrecorded``); one the initial load's recording saw PWAL leave alone is
        static (a table, a KV cache). Before any recording nothing says which it is, so it is watched: a weight
        change that leaves it as it was is ``stale`` (fail closed).
        ``outer`` lists the modules above the layer (see :attr:`_Inputs.outer`). Value samples are taken through
        ``samples``, which the caller flushes before the load. ``scratch``: whether a recorded capture wrote a
        captured tensor's storage (the graph overwrites it at every replay); a walker-found one is not watched.
        """
        slots = list(sealed.slots)
        slots.extend(extra)
        captured: list[torch.Tensor | None] = []
        versions: list[int] = []
        findings: list[Finding] = []
        freshness: dict[int, _Freshness] = {}
        inputs: _Inputs | None = None
        tensor_type = torch.Tensor
        for index, slot in enumerate(slots):
            held = slot.get(layer)
            if not slot.tensor_ref.holds(held) and originals:
                held = originals.get(slot.tensor_ref.ident, held)
            if slot.tensor_ref.holds(held):  # the sealed object, on its sealed implementation
                tensor = held
                versions.append(version_of(tensor))
                if originals is not None:
                    originals[id(tensor)] = tensor
            else:  # a new view on the captured storage, if it is still alive
                tensor = slot.captured()
                versions.append(-1)
            del held
            captured.append(tensor)
            if tensor is None:
                findings.append(
                    sealed.finding(
                        FindingKind.DEAD,
                        slot,
                        detail="the captured storage was freed before the reload began; replay reads freed memory",
                    )
                )
                continue
            if (
                slot.tracks_freshness
                and (slot.origin is not Origin.WALKER or not recorded or slot.inputs or slot.unrecorded or slot.owed)
                and not (slot.origin is Origin.WALKER and scratch is not None and scratch(tensor))
            ):
                current = slot.get(layer)
                if isinstance(current, tensor_type):
                    if inputs is None:
                        inputs = _Inputs(layer, sealed.qualname, samples, outer=outer)
                    sample = samples.take(current, SLOT_ELEMENTS)
                    freshness[index] = (current, version_of(current), sample, inputs.of(slot))
        shared = sealed.shares_storage or len(slots) > len(sealed.slots)
        return cls(
            sealed,
            layer,
            slots,
            captured,
            findings,
            freshness,
            inputs,
            shared=shared,
            versions=versions,
            originals=originals if originals is not None else {},
        )

    def learn_inputs(
        self, reads: Callable[[torch.Tensor], list[InputRef]], updated: Callable[[Any], bool], written: set[int]
    ) -> list[str]:
        """After a recorded PWAL, before restore: keep on each derived slot PWAL recomputed what it was computed
        from (``reads``, the dataflow as the model holds it).

        Returns a note per slot computed only from tensors this reload never wrote (``updated``) while the reload
        wrote weights of the layer (``written``, storage ids) that no slot read: the signature of a PWAL reading a
        private copy of earlier weights. A partial reload that leaves some inputs alone stays quiet, and so does a
        layer where PWAL skipped a slot (what it would read is unknown).

        A slot PWAL did not recompute keeps no record (it keeps the fallback inputs): a skipped rebuild says
        nothing about what a rebuild reads, and an in-place write that read nothing the model holds
        (``clamp_(-inf, inf)``) must not teach the contract that the slot has no inputs.
        """
        self._learn_recorded(updated)
        learned: list[tuple[SealedSlot, tuple[InputRef, ...]]] = []
        for index, (before, _, _, _) in self.freshness.items():
            slot = self.slots[index]
            current = slot.get(self.layer)
            if not isinstance(current, torch.Tensor):
                continue
            if not updated(current):
                continue  # the recording never saw it made or written (another thread, say): it says nothing
            found = tuple(reads(current))
            if not found and current.untyped_storage() is before.untyped_storage():
                continue
            slot.inputs = found
            learned.append((slot, found))
        if len(learned) < len(self.freshness):
            return []  # a slot PWAL skipped may be the one that reads what the reload wrote
        read = {id(t.untyped_storage()) for _, found in learned for t in map(InputRef.resolve, found) if _strided(t)}
        if not written - read:
            return []
        notes: list[str] = []
        for slot, found in learned:
            if found and not any(updated(ref.resolve()) for ref in found):
                names = ", ".join(repr(ref.label(self.sealed.qualname)) for ref in found)
                notes.append(f"{SlotRef(self.sealed.qualname, '')} slot {slot.path.text!r} from {names}")
        return notes

    def _learn_recorded(self, updated: Callable[[Any], bool]) -> None:
        """Which walker-found slots this recording tells about (``unrecorded`` cleared): one PWAL computed. One a
        reload's PWAL left tells nothing, whatever its inputs did: a skip guard that was wrong (this reload judges
        it ``stale``) looks exactly like a fixed table, and taking it for one would stop watching the very tensor
        just found stale (a recapture and reseal later, reloads with new weights committed its old values). It stays
        watched; a fixed table is declared ``static=True``, or seen in the initial load's recording
        (``record_inputs()``), where PWAL runs in full. Nor does one made or written where the recording could not
        see (another thread, a raw kernel)."""
        layer = self.layer
        for index in self.freshness:
            slot = self.slots[index]
            if slot.origin is not Origin.WALKER:
                continue
            current = slot.get(layer)
            slot.unrecorded = not (isinstance(current, torch.Tensor) and updated(current))

    def in_place(self) -> bool:
        """Whether every slot is its captured tensor on its captured memory: then restore and verify are no-ops.

        The common case for parameters (loaders copy into them) and for PWALs that write in place; one path lookup
        and a pointer and layout check per slot. Slots with a freshness check, or with findings already, take the
        full path.
        """
        if self.findings or self.freshness:
            return False
        layer = self.layer
        for slot, captured in zip(self.slots, self.captured, strict=True):
            if (
                captured is None
                or slot.wrapped
                or slot.get(layer) is not captured
                or captured.data_ptr() != slot.fp.data_ptr
                or _view(captured) != slot.layout
                or slot.fp.storage_ref() is None
            ):
                return False
        return True

    def _in_originals(self, tensor: torch.Tensor) -> int:
        """1 where the transaction's table of captured objects holds ``tensor`` (a reference of ours), else 0."""
        return int(self.originals.get(id(tensor)) is tensor)

    def _respecified(self, slot: SealedSlot, current: torch.Tensor, prefix: str, suffix: str = "") -> None:
        """A new tensor at the slot's path that no copy can restore: a finding, and the tensor stays (kept)."""
        self.kept.append(current)
        self.findings.append(
            self.sealed.finding(
                FindingKind.RESPECIFIED,
                slot,
                after=fingerprint(current),
                detail=prefix + _describe_geometry_change(slot, current) + suffix,
            )
        )

    def restore(self, *, auto_restore: bool, plan: RestorePlan) -> list[tuple[int, torch.Tensor]]:
        """Plan this layer's copies into ``plan`` (nothing is copied yet) and return the rebinds ``(slot index,
        captured)``.

        Problems become findings; nothing here raises for a bad slot. Freshness checks read input values, so they
        wait for the plan's copies (:meth:`check_freshness`).
        """
        sealed = self.sealed
        layer = self.layer
        rebinds: list[tuple[int, torch.Tensor]] = []
        seen_pairs: set[tuple[int, int]] | None = set() if self.shared else None
        overrides = self.overrides
        freshness = self.freshness
        tensor_type = torch.Tensor
        captured_list = self.captured
        # Whether PWAL left each slot reading its captured memory as captured (see ``left``): settled in the loop
        # where the branch tells (the object itself, another storage), otherwise asked once the loop is done.
        left: list[bool | None] = [None] * len(self.slots)
        for index, slot in enumerate(self.slots):
            captured = captured_list[index]
            if captured is None:
                continue
            current = slot.get(layer)
            if current is captured:
                left[index] = True
                if index in freshness:
                    self._note_fresh(index, slot, current)
                if current.__dict__:
                    self.attributed.append(current)  # its attributes may name tensors the step rebinds
                continue  # in place
            if slot.watch_only:
                if (
                    isinstance(current, tensor_type)
                    and current.untyped_storage() is captured.untyped_storage()
                    and current.data_ptr() == captured.data_ptr()
                ):
                    if _view(current) != _view(captured) or geometry_key(current) != geometry_key(captured):
                        # The captured memory read another way (conj, neg, dtype, stride): the graph reads the
                        # raw bytes as captured. Kept: it wrote that memory as it reads it.
                        self._respecified(slot, current, "same storage seen through another view: ")
                    elif index in freshness:
                        self._note_fresh(index, slot, current)
                    continue
                if isinstance(current, tensor_type) and current.untyped_storage() is captured.untyped_storage():
                    # Moved within its captured storage (an arena's other half): the storage is still held, so the
                    # manifest's check (storage identity) is satisfied, while the graph reads the bytes it left.
                    self._respecified(slot, current, "moved within its captured storage: ")
                    continue
                if isinstance(current, tensor_type):
                    self.kept.append(current)  # its new values: no copy may overwrite what it reads
                # Moved or gone: its memory is abandoned (see the contract's _doubt_abandoned). Let go of the
                # captured tensor: where nothing else holds it, the manifest must see it freed.
                self.gone.append((index, *address_range(captured)))
                if self._in_originals(captured):
                    del self.originals[id(captured)]
                captured_list[index] = None
                before = freshness.get(index)
                if before is not None:  # keep what it is computed from (a partner's doubt asks), not it
                    freshness[index] = (_NOTHING, *before[1:])
                continue
            if current is _MISSING or not isinstance(current, tensor_type):
                what = (
                    f"the path no longer resolves ({slot.path.why_missing(layer)})"
                    if current is _MISSING
                    else (f"the path now holds {type(current).__name__}, not a tensor")
                )
                self.findings.append(sealed.finding(FindingKind.VANISHED, slot, detail=what))
                continue
            inner_pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
            if slot.wrapped or _is_wrapper(current):
                # A wrapper subclass: its inner tensors are what is copied. Settled here; a match goes on below
                # (walker gate, rebind) with the inner pairs in place of the one pair.
                problem = self._wrapper_pairs(slot, captured, current)
                if isinstance(problem, Finding):
                    self.findings.append(problem)
                    continue
                if not problem:
                    if index in freshness:
                        self._note_fresh(index, slot, current)
                    continue  # every inner tensor in place
                inner_pairs = problem
                saved = overrides.get(index) if overrides else None
                if saved is not None and saved[0] is current:
                    # Its inner values before an earlier restore wrote into the memory they read (layerwise).
                    clones = dict(zip(map(id, memory_tensors(current)), saved[1], strict=True))
                    inner_pairs = [(dst, clones.get(id(src), src)) for dst, src in inner_pairs]
                exact = False
            elif current.layout is not torch.strided or current.is_nested:
                # Sparse, mkldnn, nested: no strided storage to ask about, and no copy can lay it out as captured.
                # Nothing reads captured memory through it, so it is not kept as a reader of the plan's writes.
                what = "nested" if current.is_nested else str(current.layout)
                self.findings.append(
                    sealed.finding(
                        FindingKind.RESPECIFIED,
                        slot,
                        detail=f"PWAL gave it a {what} tensor, which has no strided storage a copy into the "
                        "captured one could restore: keep the captured strided layout in PWAL, or recapture",
                    )
                )
                continue
            elif (new_storage := current.untyped_storage()) is (captured_storage := captured.untyped_storage()):
                if current.data_ptr() == slot.fp.data_ptr and geometry_key(current) == geometry_key(captured):
                    if index in freshness:
                        self._note_fresh(index, slot, current)
                    if current.__dict__:
                        self.attributed.append(current)
                    continue  # in place, through another Python object
                self._respecified(slot, current, "same storage seen through another view: ")
                continue
            else:
                left[index] = False  # another storage
                # Cheap fields first: both tensors exactly as sealed (the common case) settles it; anything else
                # gets the full comparison (size-1 dimensions may carry any stride).
                layout = slot.layout
                exact = (
                    _view(current) == layout
                    and current.storage_offset() == slot.fp.storage_offset
                    and _view(captured) == layout
                )
                if index in freshness and current.data_ptr() == captured.data_ptr():
                    # Another storage object on the captured bytes (PWAL re-imported its slot through DLPack or
                    # from_numpy): no new values, so judged as left in place (the copy below is of the same bytes).
                    self._note_fresh(index, slot, current)
                lost = _memory_lost(captured, captured_storage, slot)
                if lost is not None:
                    self.kept.append(current)
                    after = fingerprint(current)
                    self.findings.append(sealed.finding(FindingKind.DEAD, slot, after=after, detail=lost))
                    continue
            if inner_pairs is None and not exact and _copy_cannot_keep(slot, current, captured):
                self._respecified(slot, current, "", "; a copy cannot keep the captured layout: recapture")
                continue
            if slot.origin is Origin.WALKER:
                if not auto_restore or not slot.restorable:
                    why = "undeclared tensor moved to new storage"
                    if auto_restore:
                        why += f"; not restorable ({slot.reason})"
                    self.kept.append(current)
                    self.findings.append(
                        sealed.finding(FindingKind.MOVED, slot, after=fingerprint(current), detail=why)
                    )
                    continue
                self.findings.append(
                    sealed.finding(
                        FindingKind.AUTO_RESTORED,
                        slot,
                        after=fingerprint(current),
                        detail="copied into the captured storage and rebound (migrate mode); declare it",
                    )
                )
            rebinds.append((index, captured))
            if inner_pairs is not None:
                # A wrapper's inner tensors, each its own copy (no source override, no pair dedup: the wrapper
                # object is the slot's, its parts are not shared with a plain slot's pair). Each captured inner
                # tensor gets the holder look a plain slot gets (PWAL can hand the old wrapper, or one of its
                # inner tensors, to a spare): ours are the wrapper's attribute and the pairs list.
                before = freshness.get(index)
                ours = (3 if before is not None and before[0] is captured else 2) + self._in_originals(captured)
                if sys.getrefcount(captured) - 2 > ours:
                    self.suspects.append((index, "object", -1))  # the old wrapper itself is held elsewhere
                parts = {id(part): position for position, part in enumerate(memory_tensors(captured))}
                for dst, src in inner_pairs:
                    inner_storage = dst.untyped_storage()
                    held = held_outside(dst, own=2, storage=inner_storage)
                    if held is not None:
                        self.suspects.append((index, held, parts.get(id(dst), -1)))
                    nbytes = dst.numel() * dst.element_size()
                    plan.add(self, index, dst, current, src, copy_group(dst), nbytes, copy=True, storage=inner_storage)
                del inner_storage, parts
                continue
            before = freshness.get(index)
            # Ours: the snapshot's list, the rebind just planned, the freshness entry where it is the same object.
            # (and the transaction's table of captured objects, where it is one).
            own = (3 if before is not None and before[0] is captured else 2) + self._in_originals(captured)
            held = held_outside(captured, own=own, storage=captured_storage)
            if held == "object":  # maybe only this snapshot's other entries (two slots, one tensor): count them
                own = sum(t is captured for t in captured_list) + sum(t is captured for _, t in rebinds)
                own += sum(b[0] is captured for b in freshness.values()) + plan.holds(captured)
                own += self._in_originals(captured)
                held = held_outside(captured, own=own, storage=captured_storage)
            if held is not None:
                self.suspects.append((index, held, None))
            if current.__dict__ or captured.__dict__:
                self.attributes[index] = current
            self.swapped[index] = current
            source = current
            if overrides:
                saved = overrides.get(index)
                if saved is not None and saved[0] is current:
                    (source,) = saved[1]  # its values before an earlier restore wrote into the memory it reads
            copy = True
            if seen_pairs is not None:
                pair_key = (id(captured), id(current))
                copy = pair_key not in seen_pairs
                seen_pairs.add(pair_key)
            if exact:  # laid out as sealed: at the sealed offset, its span is the sealed one
                at_seal = captured.storage_offset() == slot.fp.storage_offset
                plan.add(
                    self,
                    index,
                    captured,
                    current,
                    source,
                    slot.group,
                    slot.nbytes,
                    copy=copy,
                    span=slot.span if at_seal else None,
                    plain=slot.plain,
                    storage=captured_storage,
                    source_storage=new_storage if source is current else None,
                )
            else:  # the captured tensor is not laid out as sealed: size and group from what it is now
                nbytes = captured.numel() * captured.element_size()
                plan.add(self, index, captured, current, source, copy_group(captured), nbytes, copy=copy)
        self.left = [
            known if known is not None else (captured is not None and reads_as_captured(slot.get(layer), captured))
            for known, slot, captured in zip(left, self.slots, captured_list, strict=True)
        ]
        return rebinds

    def _wrapper_pairs(
        self, slot: SealedSlot, captured: torch.Tensor, current: torch.Tensor
    ) -> Finding | list[tuple[torch.Tensor, torch.Tensor]]:
        """A wrapper subclass slot (sealed as one, or one now): a finding, or the inner copies ``(captured, new)``
        that restore it (empty: every inner tensor is in place)."""
        sealed = self.sealed
        try:
            after = fingerprint(current)
            same = slot.wrapped and _is_wrapper(current) and geometry_key(current) == geometry_key(captured)
            new_parts, held = memory_tensors(current), memory_tensors(captured)
        except (TypeError, RuntimeError) as exc:  # a wrapper whose flatten protocol does not give tensors
            return sealed.finding(
                FindingKind.RESPECIFIED, slot, detail=f"cannot read the tensor's memory ({exc}): recapture"
            )
        if not same:
            return sealed.finding(
                FindingKind.RESPECIFIED,
                slot,
                after=after,
                detail=_describe_geometry_change(slot, current) + "; a copy cannot keep the captured layout: recapture",
            )
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (name, sealed_part), dst, src in zip(_leaf_names(slot.fp), held, new_parts, strict=True):
            if (
                dst.data_ptr() != sealed_part.data_ptr
                or dst.untyped_storage() is not sealed_part.storage_ref()
                or not storage_covers(dst)
            ):
                # The captured wrapper object itself was given another inner tensor: its captured memory is no
                # longer reachable from it, so nothing can be copied there.
                return sealed.finding(
                    FindingKind.MOVED,
                    slot,
                    after=after,
                    detail=f"the captured {slot.fp.kind.__name__}'s inner tensor {name!r} was replaced in place",
                )
            if src.untyped_storage() is dst.untyped_storage():
                if src.data_ptr() == dst.data_ptr():
                    continue  # this inner tensor in place (the geometry matched above)
                return sealed.finding(
                    FindingKind.RESPECIFIED,
                    slot,
                    after=after,
                    detail=f"inner tensor {name!r} now reads another part of its captured storage: recapture",
                )
            pairs.append((dst, src))
        return pairs

    def _note_fresh(self, index: int, slot: SealedSlot, current: torch.Tensor) -> None:
        """Note a declared slot PWAL neither rebuilt nor really wrote in place, read now, as PWAL left it (before
        any copy of the plan lands): :func:`judge_noted`, then :func:`check_freshness` once every input is final.

        Called for a slot found on its captured memory after PWAL. A write counts only if it changed the slot's
        value sample (``clamp_(-inf, inf)`` moves the version counter and keeps the old values).
        """
        before = self.freshness.get(index)
        if before is None or self.inputs is None:
            return
        if repointed_inference(current):
            # An inference tensor repointed with ``.data =`` outside inference mode: torch refuses to read it.
            self.kept.append(current)
            self.findings.append(
                self.sealed.finding(
                    FindingKind.MOVED,
                    slot,
                    detail="PWAL repointed a tensor made under torch.inference_mode() (.data =) outside that mode, "
                    "and torch can no longer read it there: run PWAL under torch.inference_mode(), or recapture",
                )
            )
            return
        tensor, version, sample, _ = before
        if current.untyped_storage() is not tensor.untyped_storage() and (
            current.data_ptr() != tensor.data_ptr() or not current.data_ptr()
        ):
            # PWAL put another tensor at the path (restore copies it): rebuilt. A pointer of 0 is no memory (an
            # empty tensor, GPTQ's ``g_idx = torch.empty(0)``), so a new empty object is not a re-import of it.
            return
        if current.data_ptr() != slot.fp.data_ptr and not storage_covers(current):
            return  # PWAL freed or shrank its storage (a resize moves the pointer): nothing to read (verify flags it)
        self.noted.append((index, slot, current, version_of(current) != version, sample))

    def doubt_foreign_writes(self, foreign: Sequence[torch.Tensor]) -> None:
        """Flag a slot left on its captured memory whose bytes the reload wrote through another path's new tensor.

        ``foreign`` are new tensors left at other paths (respecified, moved and kept, untracked): when PWAL rebinds
        another slot onto this slot's memory (a rotation of captured tensors) and writes it there, this slot's
        version counter moves and its value sample changes, so it looks refreshed, but the values are the other
        slot's (found by the fuzzer as a ``skip`` of a view whose base was rotated away).
        """
        if not foreign:
            return
        layer = self.layer
        for index, slot in enumerate(self.slots):
            captured = self.captured[index]
            watched = slot.origin is Origin.ALIAS or (slot.tracks_freshness and index in self.freshness)
            if captured is None or not watched or slot.wrapped:
                continue
            version = self.versions[index] if index < len(self.versions) else -1
            # Its sample changed: written, also where the version counter did not move (a write through ``.data``).
            if index not in self.resampled and (version < 0 or version_of(captured) == version):
                continue  # nothing wrote its memory
            current = slot.get(layer)
            if current is not captured and not (
                isinstance(current, torch.Tensor)
                and current.untyped_storage() is captured.untyped_storage()
                and current.data_ptr() == captured.data_ptr()
            ):
                continue  # not left in place: restore judged it
            # Foreign tensors are other paths' new tensors, even the captured object itself (another path took it);
            # a new view object at this very path is its own.
            owners = [t for t in foreign if (t is not current or current is captured) and _overlap(t, captured)]
            if not owners:
                continue
            self.findings.append(
                self.sealed.finding(
                    FindingKind.STALE,
                    slot,
                    detail="PWAL left it on its captured memory, but the reload wrote that memory through another "
                    "path's new tensor: it holds that path's values, and a recapture would read them. Rebuild it "
                    "in PWAL",
                )
            )

    def left_stale(self) -> list[int]:
        """For a reload that raised (nothing checked): the watched slots PWAL left on their captured memory with
        their old value sample while an input changed, as :meth:`_check_fresh` would judge them (see
        :attr:`SealedSlot.owed`)."""
        left = [
            (index, sample, current)
            for index, (before, _, sample, _) in self.freshness.items()
            if isinstance(current := self.slots[index].get(self.layer), torch.Tensor)
            and current.layout is torch.strided
            and current.device.type != "meta"
            and current.untyped_storage() is before.untyped_storage()
            and self.changed_inputs(index)
        ]
        same = unchanged([(sample, current) for _, sample, current in left], SLOT_ELEMENTS)
        return [index for (index, _, _), kept in zip(left, same, strict=True) if kept]

    def changed_inputs(self, index: int) -> list[str]:
        """The names of slot ``index``'s freshness inputs that changed since the snapshot (none if unwatched)."""
        before = self.freshness.get(index)
        inputs = self.inputs
        if before is None or inputs is None:
            return []
        changed: list[str] = []
        for key in before[3]:
            name, resolve, input_before = inputs.inputs[key]
            if _input_change(input_before, resolve()) != _UNCHANGED:
                changed.append(name)
        return changed

    def _check_fresh(
        self, index: int, slot: SealedSlot, current: torch.Tensor, rewritten: bool, changes: Mapping[Any, int]
    ) -> None:
        """Flag a noted slot whose inputs changed.

        A slot rewritten in place with its old sampled values is still taken as refreshed when the inputs too were
        only maybe written (the same sampled values through the parameter or in a new tensor): a same-weights
        reload.
        """
        assert self.inputs is not None  # _note_fresh notes only slots with inputs
        changed: list[str] = []
        worst = _UNCHANGED
        for key in self.freshness[index][3]:
            change = changes[key]
            if change != _UNCHANGED:
                changed.append(self.inputs.inputs[key][0])
                worst = max(worst, change)
        fresh = worst == _UNCHANGED or (worst == _MAYBE and rewritten)
        if fresh and not slot.owed:
            return  # a partial reload that did not touch this slot's inputs, or the same values written again
        what = "kept the old values through an in-place write" if rewritten else "neither rebuilt it nor wrote it"
        cause = (
            "an earlier reload left it stale (or raised before PWAL refreshed it), a reseal kept it so,"
            if fresh
            else f"its input(s) {', '.join(changed)} changed"
        )
        if slot.origin is Origin.WALKER:
            # Undeclared: nothing recorded says PWAL does not compute it, so a weight change that leaves it is stale.
            fix = (
                "Rebuild it in PWAL; if its contents do not depend on the weights, declare it static=True or record "
                "the initial load (with contract.record_inputs(): load(), before seal())"
            )
        else:
            fix = "Rebuild it in PWAL, or declare it static=True if its contents do not depend on the weights"
        self.findings.append(
            self.sealed.finding(
                FindingKind.STALE,
                slot,
                after=fingerprint(current),
                detail=f"{cause} but PWAL {what}; the graph would read old values at the right address. {fix}",
            )
        )

    def broken_paths(self) -> set[str]:
        """The paths of this layer's ``alias-broken`` slots (they keep their new values: see :meth:`rebind`)."""
        return {f.path for f in self.findings if f.kind is FindingKind.ALIAS_BROKEN}

    def bound_instead(self, rebinds: list[tuple[int, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(new tensor, what its path will hold)`` for every rebind :meth:`rebind` will make: the captured
        tensor; an ``alias-broken`` slot's kept clone of its values (a slot that keeps its new tensor is left out).
        Ask after every copy of the step was taken back or not (the rebinds left are the ones made)."""
        broken = self.broken_paths() if self.findings else set()
        for index, captured in rebinds:
            new = self.swapped.get(index)
            if new is None:
                continue
            if self.slots[index].path.text not in broken:
                yield new, captured
            elif index in self.keep:
                yield new, self.keep[index]

    def carry_attributes(self, rebinds: list[tuple[int, torch.Tensor]], kept_at_paths: set[int]) -> None:
        """Before any rebind of the step: read the attributes each new tensor carries (:attr:`carried`); a slot
        whose captured tensor another path keeps (``kept_at_paths``: ids of tensors at paths the step does not
        rebind; PWAL swapped the two and the other's copy was taken back) is ``alias-broken``: one object cannot
        carry both paths' attributes, so it keeps its new tensor."""
        for index, captured in rebinds:
            carrier = self.attributes.get(index)
            if carrier is None:
                continue
            keep = self.slots[index].origin in _LOADED
            if carrier is not captured and id(captured) in kept_at_paths and _would_change(carrier, captured, keep):
                self.findings.append(
                    self.sealed.finding(
                        FindingKind.ALIAS_BROKEN,
                        self.slots[index],
                        detail="its captured tensor stays at another path this reload does not rebind, which PWAL "
                        "gave it with other Python attributes: it keeps its new tensor",
                    )
                )
                continue
            self.carried[index] = dict(carrier.__dict__)

    def kept_tensors(self, rebinds: list[tuple[int, torch.Tensor]]) -> Iterator[torch.Tensor]:
        """The tensors at this layer's paths that the step leaves there (slots it does not rebind)."""
        rebound = {index for index, _ in rebinds} - self._broken_indices()
        layer = self.layer
        for index, slot in enumerate(self.slots):
            if index not in rebound:
                current = slot.get(layer)
                if isinstance(current, torch.Tensor):
                    yield current

    def _broken_indices(self) -> set[int]:
        broken = self.broken_paths() if self.findings else set()
        return {index for index, slot in enumerate(self.slots) if slot.path.text in broken}

    def remap_attributes(self, swapped: Mapping[int, torch.Tensor]) -> None:
        """After the step's rebinds: an attribute of a tensor left in place that names a new tensor the step
        replaced (a kernel object keeping a reference to a rebound parameter) names what replaced it."""
        for tensor in self.attributed:
            for name, value in list(tensor.__dict__.items()):
                if isinstance(value, torch.Tensor) and id(value) in swapped:
                    tensor.__dict__[name] = swapped[id(value)]

    def conflicting_attributes(self, rebinds: list[tuple[int, torch.Tensor]], seen: dict[int, Any]) -> None:
        """Flag a slot whose captured tensor another slot of the step also rebinds (a tie) with other attributes:
        one object cannot carry both (``alias-broken``: it keeps its new tensor). ``seen``: id(captured tensor) ->
        the attributes the first slot gives it, shared across the step's snapshots."""
        for index, captured in rebinds:
            new = self.swapped.get(index)
            if new is None:
                continue
            attributes = new.__dict__
            first = seen.setdefault(id(captured), attributes)
            if first is attributes or _same_attributes(first, attributes):
                continue
            self.findings.append(
                self.sealed.finding(
                    FindingKind.ALIAS_BROKEN,
                    self.slots[index],
                    detail="it shares its captured tensor with another slot (a tie), and PWAL gave the two new "
                    "tensors other Python attributes, which one object cannot carry: it keeps its new tensor",
                )
            )

    def rebind(self, rebinds: list[tuple[int, torch.Tensor]], swapped: Mapping[int, torch.Tensor]) -> None:
        """Put the captured tensors back at their paths. ``swapped``: id() of each new tensor the restore step
        replaces by a captured one -> that captured tensor (for the attributes moved onto captured tensors)."""
        # A slot whose alias broke keeps its new tensor: the shared captured storage now holds another slot's
        # values, and rebinding would hand this path (and any recapture) the wrong ones.
        broken = self.broken_paths() if self.findings else set()
        layer = self.layer
        for index, captured in rebinds:
            slot = self.slots[index]
            if broken and slot.path.text in broken:
                kept = self.keep.get(index)
                if kept is not None:  # its new tensor reads memory a copy overwrote: it keeps its values instead
                    try:
                        slot.set(layer, kept)
                    except Exception as exc:
                        self.findings.append(
                            self.sealed.finding(
                                FindingKind.MOVED, slot, detail=f"could not bind its new values back: {exc}"
                            )
                        )
                continue
            carried = self.carried.get(index) if self.carried else None
            if carried is not None and self.attributes[index] is not captured:
                _move_attributes(carried, captured, swapped, keep=slot.origin in _LOADED)
            try:
                slot.set(layer, captured)
            except Exception as exc:  # a container that no longer takes assignment
                self.findings.append(
                    self.sealed.finding(FindingKind.MOVED, slot, detail=f"could not rebind the captured tensor: {exc}")
                )
                continue
            self.restored += 1

    def verify(self) -> None:
        """Every slot must again have its sealed fingerprint; anything else is a finding (once per slot)."""
        flagged = {f.path for f in self.findings if f.kind.is_problem} if self.findings else ()
        layer = self.layer
        captured = self.captured
        tensor_type = torch.Tensor
        confirmed = self.confirmed = [False] * len(self.slots)
        for index, slot in enumerate(self.slots):
            if (flagged and slot.path.text in flagged) or slot.watch_only:
                continue
            if slot.fp.storage_ref() is None:
                self.findings.append(
                    self.sealed.finding(FindingKind.DEAD, slot, detail="the captured storage was freed")
                )
                continue
            current = slot.get(layer)
            if not isinstance(current, tensor_type):
                self.findings.append(
                    self.sealed.finding(FindingKind.VANISHED, slot, detail="the path no longer resolves")
                )
                continue
            if (
                current is captured[index]
                and not slot.wrapped
                and current.data_ptr() == slot.fp.data_ptr
                and _view(current) == slot.layout
            ):
                # The captured object on its captured memory (``.data =``, ``set_`` or a storage ``resize_`` can
                # move the same object elsewhere).
                confirmed[index] = True
                continue
            try:
                after = fingerprint(current)
            except (TypeError, RuntimeError) as exc:  # no storage and no flattenable inner tensors
                self.findings.append(
                    self.sealed.finding(FindingKind.MOVED, slot, detail=f"cannot read the tensor's memory ({exc})")
                )
                continue
            if after.key != slot.key or not after.same_storage(slot.fp):
                detail = "not at its captured storage after restore"
                if after.data_ptr == slot.fp.data_ptr and after.same_storage(slot.fp) and not slot.wrapped:
                    # The captured memory, now read another way (a quantized tensor's scale changed in place).
                    detail = f"its captured memory is now read another way ({_describe_geometry_change(slot, current)})"
                self.findings.append(self.sealed.finding(FindingKind.MOVED, slot, after=after, detail=detail))


_LOADED = (Origin.PARAMETER, Origin.BUFFER)


def _copy_cannot_keep(slot: SealedSlot, current: torch.Tensor, captured: torch.Tensor) -> bool:
    """Whether copying ``current`` (another storage) into ``captured`` cannot restore the slot: ``respecified``.

    A parameter or buffer is judged by the captured layout: the loaded tensor carries values, and where the
    checkpoint laid them (an offset into a flat buffer, another stride order) is the loader's business; the copy
    writes them as the graph reads them. Not when the captured tensor broadcasts a dimension the new one does not
    (its distinct elements cannot hold the new values). Any other slot (derived, found by the walker) must also
    keep its significant stride and offset: PWAL may have laid its bytes out for a kernel that reads them raw.
    """
    now, then = geometry_key(current), geometry_key(captured)
    if slot.origin in _LOADED and (now[:1] + now[2:]) == (then[:1] + then[2:]):
        shape, stride = then[0], then[1]
        return any(
            step == 0 and size != 1 and new_step != 0
            for size, step, new_step in zip(shape, stride, now[1], strict=True)
        )
    return now != then or current.storage_offset() != slot.fp.storage_offset


def _would_change(new: torch.Tensor, captured: torch.Tensor, keep: bool) -> bool:
    """Whether giving ``captured`` the attributes of ``new`` (see :func:`_move_attributes`) changes any."""
    old = captured.__dict__
    if keep:
        return not _same_attributes({name: old.get(name, _MISSING) for name in new.__dict__}, new.__dict__)
    return not _same_attributes(old, new.__dict__)


def _same_attributes(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether two attribute dicts hold the same things: the same objects, or equal plain values."""
    if first.keys() != second.keys():
        return False
    for name, value in first.items():
        other = second[name]
        if value is other:
            continue
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            return False
        try:
            if not bool(value == other):
                return False
        except Exception:
            return False
    return True


def _move_attributes(
    new: Mapping[str, Any], captured: torch.Tensor, swapped: Mapping[int, torch.Tensor], *, keep: bool
) -> None:
    """Give ``captured`` (about to be bound back in place of ``new``) the attributes PWAL left on ``new``: those are
    the model's state now; the captured object still carries the last load's, which a rebind would bring back.

    A value that is another restored slot's new tensor becomes that slot's captured tensor (the one bound at its
    path; a slot under it, ``weight.g_idx`` tracked on its own, so ends up with its own captured tensor). ``keep``:
    a parameter or buffer keeps attributes the new object lacks (a loader's metadata set once, at construction:
    ``weight_loader``); any other tensor's attributes are the new one's exactly (an attribute PWAL no longer sets
    is gone). ``new``: the new tensor's attributes, read before any rebind of the step (a swap moves one captured
    object's attributes before the other reads them).
    """
    attributes = {
        name: swapped.get(id(value), value) if isinstance(value, torch.Tensor) else value for name, value in new.items()
    }
    if not keep:
        captured.__dict__.clear()
    captured.__dict__.update(attributes)


@dataclass(slots=True, eq=False)
class ClosedLayer:
    """A layer restored by ``after_layer()`` while the reload goes on: what must still hold when it finishes.

    Nothing looks at a restored layer again otherwise, so a loader that touches it afterwards (PWAL run again, a
    parent's PWAL rebuilding a child's slot, a weight written again) would commit captured memory that no longer
    holds what the model computes. Kept: each slot :meth:`LayerSnapshot.verify` confirmed, with its captured
    tensor; and each freshness input as it was right after the restore.
    """

    snapshot: LayerSnapshot
    #: ``(slot index, captured tensor)`` of every slot confirmed at its captured memory by the restore.
    confirmed: list[tuple[int, torch.Tensor]]
    #: Input key -> its state right after the restore (see ``_input_before``).
    inputs: dict[Any, _InputBefore]
    #: Slot index -> the keys of its inputs: the ones its restore was judged by, and the ones a recording of this
    #: PWAL saw it read (a weight of another layer, loaded later).
    keys: dict[int, tuple[Any, ...]]

    @classmethod
    def of(cls, snapshot: LayerSnapshot, samples: SampleBatch) -> ClosedLayer:
        """Close ``snapshot`` (restored and verified); input samples go through ``samples``, flushed by the caller
        before the load goes on."""
        confirmed = [
            (index, captured)
            for index, (captured, ok) in enumerate(zip(snapshot.captured, snapshot.confirmed, strict=False))
            if ok and captured is not None
        ]
        inputs: dict[Any, _InputBefore] = {}
        keys: dict[int, tuple[Any, ...]] = {}
        watched = snapshot.inputs
        if watched is not None and snapshot.freshness:
            for index, entry in snapshot.freshness.items():
                recorded = snapshot.slots[index].inputs
                learned = watched._recorded_keys(recorded) if recorded and all(map(watched._resolves, recorded)) else ()
                keys[index] = tuple(dict.fromkeys((*entry[3], *learned)))
            for key in {key for found in keys.values() for key in found}:
                inputs[key] = _input_before(watched.inputs[key][1](), samples)
        return cls(snapshot, confirmed, inputs, keys)

    def check(self, changes: Mapping[Any, int]) -> list[Finding]:
        """Findings for what changed since the layer was closed; ``changes`` says how each input changed."""
        snapshot = self.snapshot
        sealed, layer = snapshot.sealed, snapshot.layer
        findings: list[Finding] = []
        flagged: set[int] = set()
        for index, captured in self.confirmed:
            slot = snapshot.slots[index]
            current = slot.get(layer)
            if current is captured and captured.data_ptr() == slot.fp.data_ptr and _view(captured) == slot.layout:
                continue
            flagged.add(index)
            findings.append(
                sealed.finding(
                    FindingKind.MOVED,
                    slot,
                    detail="changed after its layer's after_layer() restored it (PWAL ran again, or another layer's "
                    "PWAL rebuilt it): the graph reads the captured memory, which holds the values of the first "
                    "pass. Call after_layer() once, when the layer is loaded and processed for the last time",
                )
            )
        if not snapshot.inputs or not self.inputs:
            return findings
        changed = {key for key in self.inputs if changes.get(key, _UNCHANGED) == _CHANGED}
        if not changed:
            return findings
        for index, found in self.keys.items():
            names = [snapshot.inputs.inputs[key][0] for key in found if key in changed]
            if not names or index in flagged:
                continue
            findings.append(
                sealed.finding(
                    FindingKind.STALE,
                    snapshot.slots[index],
                    detail=f"its input(s) {', '.join(names)} changed after its layer's after_layer() restored it; "
                    "the graph reads values computed from the earlier weights. Call after_layer() once the layer's "
                    "last weight is loaded and PWAL ran",
                )
            )
        return findings


def check_closed(closed: Iterable[ClosedLayer], in_model: Callable[[SealedLayer, nn.Module], bool]) -> list[Finding]:
    """Check every closed layer at the end of the reload; the inputs of all compared in one batch. A layer no longer
    in the model (``in_model``) was replaced after its restore: every slot of it ``vanished``."""
    findings: list[Finding] = []
    kept: list[ClosedLayer] = []
    for record in closed:
        snapshot = record.snapshot
        if in_model(snapshot.sealed, snapshot.layer):
            kept.append(record)
            continue
        findings.extend(
            snapshot.sealed.finding(
                FindingKind.VANISHED,
                slot,
                detail="the layer was replaced after its after_layer() restored it: the graph reads the old layer's "
                "captured memory",
            )
            for slot in snapshot.slots
            if not slot.watch_only
        )
    closed = kept
    asked: list[tuple[int, Any, _InputBefore, Any]] = []
    for position, record in enumerate(closed):
        inputs = record.snapshot.inputs
        assert inputs is not None or not record.inputs
        for key, before in record.inputs.items():
            asked.append((position, key, before, inputs.inputs[key][1]() if inputs is not None else None))
    verdicts: list[dict[Any, int]] = [{} for _ in closed]
    for (position, key, _, _), change in zip(asked, _input_changes([(b, v) for _, _, b, v in asked]), strict=True):
        verdicts[position][key] = change
    findings.extend(finding for record, known in zip(closed, verdicts, strict=True) for finding in record.check(known))
    return findings


def judge_noted(snapshots: Sequence[LayerSnapshot]) -> None:
    """Keep, of the slots :meth:`LayerSnapshot.restore` noted on their captured memory, those whose value sample
    PWAL left as it was: due for :func:`check_freshness` (a write that changed the sample is a refresh).

    Call once every snapshot of a restore step is restored and before any copy of its plan lands: the samples of
    every layer are compared in one batch (one host-device synchronisation per device, not one per layer or slot).
    """
    noted = [(snapshot, entry) for snapshot in snapshots for entry in snapshot.noted]
    if not noted:
        return
    for snapshot in snapshots:
        snapshot.noted = []
    same = unchanged([(entry[4], entry[2]) for _, entry in noted], SLOT_ELEMENTS)
    for (snapshot, entry), kept in zip(noted, same, strict=True):
        if kept:
            snapshot.fresh_due.append(entry[:4])
        else:
            snapshot.resampled.add(entry[0])


def check_freshness(snapshots: Sequence[LayerSnapshot]) -> None:
    """Judge the slots :func:`judge_noted` found due against their inputs (stale where an input changed); call with
    the plan's copies done. Each input is judged once per layer, the value samples of all in one batch."""
    due = [snapshot for snapshot in snapshots if snapshot.fresh_due]
    if not due:
        return
    changes: list[dict[Any, int]] = []
    asked: list[tuple[dict[Any, int], Any, _InputBefore, Any]] = []  # (per-layer verdicts, key, before, now)
    for snapshot in due:
        inputs = snapshot.inputs
        assert inputs is not None  # _note_fresh notes only slots with inputs
        known: dict[Any, int] = {}
        changes.append(known)
        for index, _, _, _ in snapshot.fresh_due:
            for key in snapshot.freshness[index][3]:
                if key not in known:
                    _, resolve, before = inputs.inputs[key]
                    known[key] = _UNCHANGED  # set below
                    asked.append((known, key, before, resolve()))
    for (known, key, _, _), change in zip(asked, _input_changes([(b, v) for _, _, b, v in asked]), strict=True):
        known[key] = change
    for snapshot, known in zip(due, changes, strict=True):
        entries, snapshot.fresh_due = snapshot.fresh_due, []
        for index, slot, current, rewritten in entries:
            snapshot._check_fresh(index, slot, current, rewritten, known)


#: Captured storage id -> ``(sealed layer, slot position)`` of every slot reading it, for storages two or more slots
#: read (in one layer or several). Built at seal (``GraphContract._index_layers``).
SharedIndex = Mapping[int, Sequence[tuple[SealedLayer, int]]]


@dataclass(slots=True, eq=False)
class _Move:
    """One planned copy into a captured storage, and the rebind that follows it."""

    snapshot: LayerSnapshot
    index: int
    dst: torch.Tensor  # the captured tensor
    new: torch.Tensor  # the tensor PWAL left at the path
    src: torch.Tensor  # what is copied: ``new``, or a clone of its values taken before anything was written
    group: tuple[Any, ...]
    nbytes: int
    copy: bool  # False for a repeat of a (captured, new) pair already planned
    storage: int  # id() of the captured tensor's storage (alive while the plan is: the move holds the tensor)
    plain: bool | None  # whether a plain copy_ writes every byte of dst (None: the batch finds out)
    #: id() of ``src``'s storage where the planner knew it (alive: the move holds ``src``); ``None``: ask ``src``.
    src_storage: int | None = None
    #: Where ``dst``'s bytes lie: ``(device, first address, end)`` (its storage's address plus its byte span).
    memory: tuple[Any, int, int] = (None, 0, 0)

    @property
    def ref(self) -> str:
        return str(SlotRef(self.snapshot.sealed.qualname, self.snapshot.slots[self.index].path.text))


@dataclass(slots=True, eq=False)
class _Reader:
    """A tensor the model keeps that reads bytes a plan writes (a slot left in place, a new tensor left at its
    path): the bytes it read before the copies, which it must read again after them."""

    view: torch.Tensor
    before: torch.Tensor  # a clone of its values, taken before any copy of the plan was launched
    #: The slot left in place that reads ``view`` (its captured tensor), or ``None`` for a new tensor.
    owner: tuple[SealedLayer, SealedSlot] | None = None
    #: Whether the reload wrote its memory (the captured tensor's version counter moved, or a loaded parameter or
    #: buffer): bytes nobody wrote are the old values, which a slot that shared them with a moved one may still
    #: need to follow.
    written: bool = True
    #: The names of the owner slot's freshness inputs that the reload changed (asked only when a copy changed it).
    changed_inputs: Callable[[], list[str]] | None = None
    #: Whether the captured tensor's version counter moved during the reload (some write reached its memory).
    versioned: bool = False


_NOTHING = torch.empty(0)  # stands in for a captured tensor the snapshot let go of


_STORAGE_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def repointed_inference(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an inference tensor repointed (``.data =``) outside inference mode: no longer an
    inference tensor, yet without a version counter; torch refuses to read it there."""
    return not tensor.is_inference() and version_of(tensor) < 0


def held_outside(tensor: torch.Tensor, *, own: int, storage: Any = None) -> str | None:
    """What besides ``own`` references of the caller's data (and the caller's one local name) holds the captured
    tensor: ``"object"`` (the tensor object itself), ``"base"`` (a view's base), ``"storage-object"`` (its storage's
    Python object: a storage pool), ``"storage"`` (another tensor on its storage), or ``None``. (A DLPack import
    holds the tensor object: ``"object"``; the search then matches its other storage object by address.)

    The cheap look before a copy into captured memory whose slot PWAL moved: normally the snapshot alone still
    holds the old captured tensor. An answer is only a reason to search (a ping-pong buffer kept at an untracked
    path, a storage pool, a caller's reference); the contract's search decides.
    """
    # sys.getrefcount counts its own argument and this function's parameter; the caller's local is one more.
    if sys.getrefcount(tensor) - 3 > own:
        return "object"
    view = tensor._base is not None
    # A view's base: the temporary from ``_base`` and the argument are all when nothing else holds it.
    if view and sys.getrefcount(tensor._base) > 2:
        return "base"
    passed = storage is not None  # the caller's local holds it too
    if storage is None:
        storage = tensor.untyped_storage()
    # The storage's one Python object (torch keeps one per storage): this local, the argument and torch's own.
    if sys.getrefcount(storage) > 3 + passed:
        return "storage-object"
    # One use per tensor on the storage (a view's base is one more) and one for the Python storage object.
    if _STORAGE_USE_COUNT is not None and int(_STORAGE_USE_COUNT(storage._cdata)) > 2 + view:
        return "storage"
    return None


def _memory_lost(captured: torch.Tensor, storage: Any, slot: SealedSlot) -> str | None:
    """Why a copy into ``captured`` (on ``storage``) would not land on the memory the graph reads, or ``None``.

    PWAL can free or shrink the old storage in place (``untyped_storage().resize_(0)``, as offloading code does)
    or point the captured object elsewhere (``.data =``, ``set_``): a copy then writes freed memory, past the end of
    an allocation, or into another tensor's storage. Nothing is copied; the graph's memory is gone.
    """
    if captured.data_ptr() != slot.fp.data_ptr:
        return (
            "PWAL moved or freed the captured tensor's memory during the reload (.data =, set_, or its storage "
            "resized); the graph reads memory no copy can reach: nothing copied, recapture"
        )
    if not storage_covers(captured, storage):
        return (
            f"PWAL shrank the captured storage to {storage.nbytes()} bytes during the reload (resize_); a copy "
            "would write past its end: nothing copied, recapture"
        )
    return None


def storage_covers(tensor: torch.Tensor, storage: Any = None) -> bool:
    """Whether ``tensor``'s storage (``storage``, where the caller has it) still holds every byte it spans (PWAL can
    ``resize_`` a storage in place)."""
    return (tensor.untyped_storage() if storage is None else storage).nbytes() >= byte_span(tensor)[1]


def address_range(tensor: torch.Tensor) -> tuple[str, int, int]:
    """``(device, first byte address, end address)`` of the memory a plain strided tensor spans."""
    shape, stride = shape_and_stride(tensor) if tensor.is_nested else (tensor.shape, tensor.stride())
    extent = sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1 if tensor.numel() else 0
    # From the storage: an empty tensor's data_ptr() is 0, but it still marks a place in its storage.
    start = tensor.untyped_storage().data_ptr() + int(tensor.storage_offset()) * tensor.element_size()
    return str(tensor.device), start, start + int(extent) * tensor.element_size()


def reads_as_captured(current: Any, captured: torch.Tensor) -> bool:
    """Whether the value at a slot's path reads its captured memory exactly as captured: the object, or a view at
    its pointer with its layout (another view of the same bytes, conjugate or negative, reads other values)."""
    if current is captured:
        return True
    return (
        isinstance(current, torch.Tensor)
        and current.layout is captured.layout  # (sparse, mkldnn: no storage to ask)
        and current.untyped_storage() is captured.untyped_storage()
        and current.data_ptr() == captured.data_ptr()
        and _view(current) == _view(captured)
        and geometry_key(current) == geometry_key(captured)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` (any tensor; a wrapper subclass reads its inner tensors) reads bytes of the plain tensor ``b``."""
    storage, span = b.untyped_storage(), byte_span(b)
    return any(part.untyped_storage() is storage and spans_overlap(byte_span(part), span) for part in memory_tensors(a))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` read the same bits element for element: +0.0 and -0.0 differ (a copy of one over the
    other changes what ``1 / x`` reads), a NaN agrees with the same NaN (scratch still agrees with itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_raw_bytes(a), _raw_bytes(b))


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s values as read (lazy bits resolved), flat."""
    return flat_copy(tensor.resolve_conj().resolve_neg()).view(torch.uint8)


def _sorted_ranges(ranges: Iterable[tuple[Any, int, int]]) -> dict[Any, tuple[list[int], list[int]]]:
    """``(device, start, end)`` ranges as, per device, their starts in order and the running maximum of their ends:
    a range ``[a, b)`` overlaps one of them iff, among those starting before ``b``, the furthest end is past ``a``."""
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for device, start, end in ranges:
        if end > start:
            by_device.setdefault(device, []).append((start, end))
    found: dict[Any, tuple[list[int], list[int]]] = {}
    for device, pairs in by_device.items():
        pairs.sort()
        ends: list[int] = []
        furthest = 0
        for _, end in pairs:
            furthest = max(furthest, end)
            ends.append(furthest)
        found[device] = ([start for start, _ in pairs], ends)
    return found


def _memory(tensor: torch.Tensor, span: tuple[int, int] | None = None) -> tuple[Any, int, int] | None:
    """``(device, first address, end)`` of the bytes a plain tensor spans (``span``: its :func:`byte_span`), or
    ``None`` where it spans none or has no memory of its own (a wrapper's is its inner tensors')."""
    if span is None:
        span = byte_span(tensor)
    if span[1] <= span[0] or _is_wrapper(tensor):
        return None
    start = tensor.data_ptr()  # the address of byte span[0]
    return (tensor.device, start, start + span[1] - span[0]) if start else None


def _hits(ranges: Mapping[Any, tuple[list[int], list[int]]], memory: tuple[Any, int, int] | None) -> bool:
    """Whether ``memory`` shares a byte with one of ``ranges`` (:func:`_sorted_ranges`)."""
    if memory is None:
        return False
    found = ranges.get(memory[0])
    if found is None:
        return False
    starts, ends = found
    below = bisect.bisect_left(starts, memory[2])  # the ranges that start before this one ends
    return below > 0 and ends[below - 1] > memory[1]


class RestorePlan:
    """Every copy of one restore step, planned before any is launched: the whole model in ``finish()``, the layers
    of one ``after_layer()``. One transaction over the storages of the whole model:

    * **order.** A source can be another slot's captured storage (a ping-pong swap ``cur, prev = prev, cur``,
      tensors exchanged between layers, a rotation) or a view into one. Copies launched one after another would
      overwrite sources still needed, so :meth:`protect` clones every source whose bytes overlap any destination of
      the plan before any copy is launched: then no order can be wrong. Where nothing overlaps (the common case)
      this costs one dict lookup per copy.
    * **aliasing.** Slots in any layers that read overlapping bytes of a destination's captured storage (a tied
      embedding and head, a workspace shared by layers, a view into a packed tensor) must all read their own new
      values after the copies (:meth:`watch` before launching, :meth:`check` after). A slot left in place keeps
      its bytes; a moved slot whose values the storage then does not hold is ``alias-broken`` and keeps its new
      values. Where the slot left in place cannot vouch for its bytes (nothing wrote them during the reload, or
      another slot's new tensor now owns them: PWAL re-derived its partner but not it), it is ``stale`` too: a
      recapture would read values nobody produced for it.
    """

    __slots__ = ("_dst_memory", "_dst_spans", "_held", "_readers", "_shared", "findings", "moves")

    def __init__(self, shared: SharedIndex) -> None:
        self.moves: list[_Move] = []
        self._dst_spans: dict[int, list[tuple[int, int]]] = {}  # storage id -> byte spans written
        #: device -> (starts, running max of ends) of the addresses written, sorted by start; built when first asked
        self._dst_memory: dict[Any, tuple[list[int], list[int]]] | None = None
        self._readers: list[_Reader] = []
        self._shared = shared
        #: id -> references the moves hold to it, with the list and length it counts (see :meth:`holds`)
        self._held: tuple[list[_Move], int, dict[int, int]] | None = None
        #: Findings on slots outside any move (a slot left in place that cannot vouch for its bytes).
        self.findings: list[Finding] = []

    def add(
        self,
        snapshot: LayerSnapshot,
        index: int,
        dst: torch.Tensor,
        new: torch.Tensor,
        src: torch.Tensor,
        group: tuple[Any, ...],
        nbytes: int,
        *,
        copy: bool,
        span: tuple[int, int] | None = None,
        plain: bool | None = None,
        storage: Any = None,
        source_storage: Any = None,
    ) -> None:
        """Plan ``dst.copy_(src)`` for slot ``index`` of ``snapshot`` (``new`` is the tensor at its path); ``span``
        (``byte_span(dst)``), ``plain`` (see :meth:`CopyBatch.add`) and the storages of ``dst`` and ``src`` where
        the caller knows them already."""
        if storage is None:
            storage = dst.untyped_storage()
        key = id(storage)
        source_key = None if source_storage is None else id(source_storage)
        if span is None:
            span = byte_span(dst)
        base = storage.data_ptr()
        memory = (dst.device, base + span[0], base + span[1])
        held = self._held
        self.moves.append(_Move(snapshot, index, dst, new, src, group, nbytes, copy, key, plain, source_key, memory))
        if held is not None and held[0] is self.moves and held[1] == len(self.moves) - 1:
            counts = held[2]
            for tensor in (dst, new, src):
                counts[id(tensor)] = counts.get(id(tensor), 0) + 1
            self._held = (self.moves, len(self.moves), counts)
        spans = self._dst_spans.get(key)
        if spans is None:
            spans = self._dst_spans[key] = []
        spans.append(span)
        self._dst_memory = None

    def crossing(self) -> list[_Move]:
        """The moves whose destination bytes overlap another move's under another storage object (a DLPack import, a
        tensor carved out of a parameter with ``from_numpy``): every check of shared memory here goes by storage
        identity, so these cannot be checked, and the last copy would win."""
        found: dict[int, _Move] = {}
        for first, second in overlapping_pairs((*move.memory, move) for move in self.moves):
            if first.storage != second.storage:
                found[id(first)], found[id(second)] = first, second
        return list(found.values())

    def holds(self, tensor: torch.Tensor) -> int:
        """How many references to ``tensor`` the planned copies hold (as destination, new tensor or source).

        Counted once per plan and kept up to date by :meth:`add` (a scan per call made planning quadratic); counted
        again where the moves changed otherwise (taken back, a source cloned)."""
        held = self._held
        if held is None or held[0] is not self.moves or held[1] != len(self.moves):
            counts: dict[int, int] = {}
            for move in self.moves:
                for part in (move.dst, move.new, move.src):
                    counts[id(part)] = counts.get(id(part), 0) + 1
            held = self._held = (self.moves, len(self.moves), counts)
        return held[2].get(id(tensor), 0)

    def overlaps_destination(self, tensor: torch.Tensor, storage: int | None = None) -> bool:
        """Whether ``tensor`` (on the storage whose id() is ``storage``, where known) reads bytes a copy of this
        plan writes."""
        spans = self._dst_spans.get(id(tensor.untyped_storage()) if storage is None else storage)
        span = byte_span(tensor)
        if spans is not None and any(spans_overlap(span, written) for written in spans):
            return True
        # By address too: another storage object on the same bytes (a DLPack or from_numpy import) is the same memory.
        memory = self._dst_memory
        if memory is None:
            memory = self._dst_memory = _sorted_ranges(move.memory for move in self.moves)
        return _hits(memory, _memory(tensor, span))

    def protect(self) -> None:
        """Clone every source that reads bytes some copy of the plan writes (before any copy is launched)."""
        clones: dict[int, torch.Tensor] = {}
        for move in self.moves:
            src = move.src
            if self.overlaps_destination(src, move.src_storage if src is move.new else None):
                clone = clones.get(id(src))
                if clone is None:
                    clone = clones[id(src)] = clone_laid_out(src)
                move.src = clone
                self._held = None

    def watch(
        self,
        captured_of: Callable[[SealedLayer, int], torch.Tensor | None],
        version_at_begin: Callable[[SealedLayer, int], int | None],
        local: Sequence[LayerSnapshot] = (),
        kept: Iterable[torch.Tensor] = (),
        changed_inputs: Callable[[SealedLayer, int], list[str]] | None = None,
    ) -> None:
        """Before launching: remember every reader of a written storage other than the move writing it.

        Readers are slots the plan does not move whose captured tensor overlaps a write, found through the seal's
        index (any layer) and ``local`` snapshots (walker extras, unknown at seal), and the ``kept`` tensors: new
        tensors left at their paths (a respecified slot, a path the contract does not track) that read memory a
        copy writes. ``version_at_begin`` gives a captured tensor's version counter when the reload began;
        ``changed_inputs`` the names of a slot's freshness inputs the reload changed.
        """
        moved = {(id(m.snapshot.sealed), m.index) for m in self.moves}
        seen: set[tuple[int, int]] = set()
        readers = self._readers

        def hold(
            view: torch.Tensor | None, owner: tuple[SealedLayer, SealedSlot, int | None, int] | None = None
        ) -> None:
            if view is None or not self.overlaps_destination(view) or not storage_covers(view):
                return  # (a storage PWAL freed or shrank has no bytes to keep: verify flags its slot)
            if owner is None:
                readers.append(_Reader(view, clone_laid_out(view)))
                return
            sealed, slot, version, position = owner
            # Loaded state (parameters, buffers) and static slots own their bytes whoever wrote them.
            versioned = version is not None and version >= 0 and version_of(view) != version
            written = not slot.tracks_freshness or versioned
            changed = functools.partial(changed_inputs, sealed, position) if changed_inputs is not None else None
            readers.append(_Reader(view, clone_laid_out(view), (sealed, slot), written, changed, versioned))

        def hold_slot(
            slot: SealedSlot,
            layer: nn.Module | None,
            view: torch.Tensor | None,
            owner: tuple[SealedLayer, SealedSlot, int | None, int],
        ) -> None:
            # Only a slot whose path still reads its captured tensor keeps bytes there (a vanished or respecified
            # one is a finding already). An alias path (the walker found the storage of a tracked slot) follows
            # its slot: "rebind every alias path", so it reads whatever that slot's new values are.
            if view is None or layer is None or slot.origin is Origin.ALIAS:
                return
            current = slot.get(layer)
            if slot.wrapped:  # a wrapper in place keeps the bytes of each of its inner tensors
                if current is view:
                    for part in memory_tensors(view):
                        hold(part)
                return
            if current is view or (
                isinstance(current, torch.Tensor)
                and current.untyped_storage() is view.untyped_storage()
                and current.data_ptr() == view.data_ptr()
                and geometry_key(current) == geometry_key(view)
            ):
                hold(view, owner)

        for key in self._dst_spans:
            for sealed, position in self._shared.get(key, ()):
                entry = (id(sealed), position)
                if entry in moved or entry in seen:
                    continue
                seen.add(entry)
                slot = sealed.slots[position]
                view = captured_of(sealed, position)
                if view is not None and (slot.wrapped or slot.fp.storage_ref() is view.untyped_storage()):
                    owner = (sealed, slot, version_at_begin(sealed, position), position)
                    hold_slot(slot, sealed.layer_ref(), view, owner)
        for snapshot in local:
            for position, view in enumerate(snapshot.captured):
                entry = (id(snapshot.sealed), position)
                if entry not in moved and entry not in seen:
                    seen.add(entry)
                    slot = snapshot.slots[position]
                    version = snapshot.versions[position] if position < len(snapshot.versions) else None
                    hold_slot(slot, snapshot.layer, view, (snapshot.sealed, slot, version, position))
        for tensor in kept:
            hold(tensor)

    def writing(self) -> contextlib.AbstractContextManager[Any]:
        """Where the plan writes (its copies, a reader's bytes written back) and compares what it wrote: with the
        ``__torch_function__`` of tensor subclasses off, so a class's own ``copy_`` (one that transforms what it
        is given, one that refuses) cannot turn a copy of bytes into another write; and under
        ``torch.inference_mode()`` when some destination is an inference tensor (made there: an engine's warm-up,
        a PWAL run there), which torch lets no one write outside it; plain tensors take the same writes either
        way."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch._C.DisableTorchFunctionSubclass())
        if torch.is_inference_mode_enabled():
            return stack
        if any(move.dst.is_inference() for move in self.moves) or any(r.view.is_inference() for r in self._readers):
            stack.enter_context(torch.inference_mode())
        return stack

    def launch(self, batch: CopyBatch) -> None:
        """Launch every planned copy through ``batch`` (grouped ``_foreach_copy_``) and flush it."""
        add = batch.add
        for move in self.moves:
            if move.copy:
                add(move.dst, move.src, move.group, move.nbytes, plain=move.plain)
        batch.flush()

    def check(self) -> None:
        """After the copies: every slot reading a written storage must read its own new values.

        A reader (a slot left in place, a new tensor left at its path) keeps its bytes: they are its values, and
        whoever reads it reads them there; if a copy changed them, they are written back. A moved slot whose
        captured tensor then does not hold its source is ``alias-broken`` (a finding on its snapshot) and keeps its
        new values: its new tensor, or a clone when a copy overwrote the memory that tensor reads. Its new tensor
        then becomes a reader in turn, so this runs to a fixed point (each round breaks at least one move).
        """
        by_storage: dict[int, list[_Move]] = {}
        for move in self.moves:
            by_storage.setdefault(move.storage, []).append(move)
        readers = self._readers
        broken: set[int] = set()
        flagged: set[int] = set()
        while True:
            changed = [r for r in readers if not _same_values(r.view, r.before)]
            if changed:
                for reader in changed:
                    if reader.owner is not None and id(reader) not in flagged:
                        flagged.add(id(reader))
                        self._doubt(reader)
                with torch.no_grad():
                    for reader in readers:  # byte for byte: a broadcast reader is written through its distinct elements
                        view, before = distinct_views(reader.view, reader.before)
                        view.copy_(before)
            read = {id(r.view.untyped_storage()) for r in readers}
            read_memory = _sorted_ranges(m for m in map(_memory, (r.view for r in readers)) if m is not None)
            fresh: list[_Move] = []
            for key, moves in by_storage.items():
                if len(moves) < 2 and key not in read and not _hits(read_memory, moves[0].memory):
                    continue  # one slot writes it, nobody else reads it (by address either): the copy is all there is
                for move in moves:
                    if id(move) not in broken and not _same_values(move.dst, move.src):
                        fresh.append(move)
            if not fresh:
                return
            for move in fresh:
                broken.add(id(move))
                self._break(move, by_storage[move.storage])
                if move.src is not move.new:  # its tensor reads memory the plan writes: it keeps the clone
                    readers.append(_Reader(move.src, clone_laid_out(move.src)))

    def unbound(self) -> None:
        """After the step's rebinds: a moved slot whose path could not be rebound (a holder refusing assignment)
        still holds its new tensor, and where that reads memory a copy of the plan wrote (PWAL handed it another
        slot's captured tensor: a ping-pong swap), it now reads that slot's values, which graphsafe wrote there.

        Its values (the clone :meth:`protect` took) are written back where no path rebound onto that memory reads
        it: the model is then as PWAL left it, which a recapture reads. Where one does (its partner was rebound),
        both cannot hold their values: ``stale``, since a recapture would read the wrong ones."""
        for move in self.moves:
            snapshot, new, src = move.snapshot, move.new, move.src
            slot = snapshot.slots[move.index]
            if src is new or _is_wrapper(new) or slot.get(snapshot.layer) is not new or _same_values(new, src):
                continue  # rebound, or nothing a copy wrote is read through its new tensor
            saved = snapshot.overrides.get(move.index)
            earlier = saved is not None and saved[0] is new  # an earlier step's copy wrote it: its slot reads it
            partners = [
                other.ref
                for other in self.moves
                if other is not move
                and _overlap(new, other.dst)
                and reads_as_captured(other.snapshot.slots[other.index].get(other.snapshot.layer), other.dst)
            ]
            if earlier or partners:
                why = f"{', '.join(map(repr, partners))} was rebound onto it" if partners else "another slot reads it"
                snapshot.findings.append(
                    snapshot.sealed.finding(
                        FindingKind.STALE,
                        slot,
                        detail=f"its captured tensor could not be bound back, and the new tensor it keeps reads "
                        f"memory the restore wrote with another slot's values, where {why}: this path reads wrong "
                        "values, and so would a recapture. Let PWAL's holder take assignment, then reload again",
                    )
                )
                continue
            with torch.no_grad():
                new.copy_(src)

    def _doubt(self, reader: _Reader) -> None:
        """A slot left in place whose bytes a copy would change: ``stale`` where nothing wrote it although its
        inputs changed.

        The restore's own copy into the shared memory would otherwise pass for PWAL's write (the freshness
        check compares values), and the reader's write-back then leaves its old values under a recapture.
        """
        assert reader.owner is not None
        sealed, slot = reader.owner
        view = reader.view
        if reader.written:
            if not (slot.tracks_freshness and reader.versioned):
                return  # loaded state or a static slot: its bytes are its own whoever wrote them
            # Written, but through another slot's new tensor (PWAL rebound that slot onto this memory and wrote
            # it): the values are that slot's, not this one's.
            owners = [m.ref for m in self.moves if _overlap(m.new, view)]
            if not owners:
                return  # written by the reload as itself: its own values (the moved slot breaks away)
            why = f"the reload wrote its bytes through the new tensor of {', '.join(map(repr, owners))}"
        else:
            changed = reader.changed_inputs() if reader.changed_inputs is not None else []
            # Or what its moved partner is computed from (a tie to another layer's slot reads that layer's weights).
            for move in self.moves:
                if not changed and _overlap(move.dst, view):
                    changed = move.snapshot.changed_inputs(move.index)
            if not changed:
                return  # nothing it or its partner is computed from changed: its old values are its values
            why = f"nothing wrote it although {', '.join(changed)} changed"
        partners = sorted({m.ref for m in self.moves if _overlap(m.dst, view)})
        self.findings.append(
            sealed.finding(
                FindingKind.STALE,
                slot,
                detail=f"it shares captured memory with {', '.join(map(repr, partners))}, which the reload gave "
                f"new values, but PWAL left it on that memory and {why}: its values are stale and a recapture "
                "would read them. Re-derive it in PWAL together with its partner",
            )
        )

    def _break(self, move: _Move, sharing: list[_Move]) -> None:
        snapshot = move.snapshot
        slot = snapshot.slots[move.index]
        others = [m.ref for m in sharing if m is not move]
        where = f"shared captured storage with {', '.join(map(repr, others))}" if others else "its captured storage"
        snapshot.findings.append(
            snapshot.sealed.finding(
                FindingKind.ALIAS_BROKEN,
                slot,
                after=fingerprint(move.new),
                detail=f"{where} is also read by another slot or tensor, but the reload produced values that no "
                "longer agree",
            )
        )
        if move.src is not move.new and not _is_wrapper(move.new):
            # The object PWAL made, on the clone's memory: its class (a Parameter subclass) and its Python
            # attributes (a loader's ``output_dim``, ``weight_loader``) are part of what the reload produced.
            new = move.new
            kept = move.src
            if type(kept) is torch.Tensor:  # a fresh object of PWAL's class (one clone can serve several moves)
                grad = new.requires_grad if isinstance(new, nn.Parameter) else kept.requires_grad
                kept = torch.Tensor._make_subclass(type(new), kept, grad)
            elif isinstance(new, nn.Parameter) and not isinstance(kept, nn.Parameter):
                kept = nn.Parameter(kept, requires_grad=new.requires_grad)
            if new.__dict__:
                kept.__dict__.update(new.__dict__)
            snapshot.keep[move.index] = kept
        else:
            snapshot.kept.append(move.new)  # left at its path: a later restore step must not write what it reads
