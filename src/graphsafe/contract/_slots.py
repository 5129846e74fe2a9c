"""What a seal records per layer, and the per-reload work on one layer: snapshot, restore, verify.

This is the only code that mutates a model during reload (copies into captured storage, rebinds paths).

Per reload the work is a compiled plan: at seal every slot gets its path compiled into a getter and a setter
(:mod:`graphsafe.contract._access`), its expected layout as one comparable tuple and its copy group; a reload
then compares cheap fields first and falls back to the full geometry comparison only when they differ.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.contract._copy import CopyBatch, copy_group
from graphsafe.outcome import Finding, FindingKind, Fingerprint, Origin, SlotRef, fingerprint, geometry_key
from graphsafe.paths import MISSING, Getter, Setter, SlotPath, compile_getter, compile_setter
from graphsafe.registry import Declaration, declarations_of

__all__ = ["InputRef", "LayerSnapshot", "SealedLayer", "SealedSlot"]

_MISSING: Any = MISSING


@dataclass(slots=True)
class SealedSlot:
    """One tracked slot: its path, its sealed fingerprint and a weak handle to the captured tensor."""

    path: SlotPath
    fp: Fingerprint
    tensor_ref: weakref.ReferenceType[torch.Tensor]
    origin: Origin
    declaration: Declaration | None = None
    restorable: bool = True
    reason: str | None = None
    alias_of: str | None = None
    #: What PWAL was seen computing this slot from (a recorded reload), or ``None`` when never recorded.
    inputs: tuple[InputRef, ...] | None = None
    key: tuple[Any, ...] = field(init=False)
    # The compiled plan (derived from the fields above at construction):
    get: Getter = field(init=False, repr=False)
    set: Setter = field(init=False, repr=False)
    layout: tuple[Any, ...] = field(init=False, repr=False)  # (shape, stride, dtype, device) as sealed
    group: tuple[Any, ...] = field(init=False, repr=False)  # the copy group of the captured tensor
    nbytes: int = field(init=False, repr=False)
    tracks_freshness: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fp = self.fp
        self.key = fp.key
        self.get = compile_getter(self.path)
        self.set = compile_setter(self.path)
        self.layout = (fp.shape, fp.stride, fp.dtype, fp.device)
        tensor = self.tensor_ref()
        self.group = (fp.device, fp.dtype, tensor.layout if tensor is not None else torch.strided)
        self.nbytes = fp.nbytes
        declaration = self.declaration
        self.tracks_freshness = self.origin is Origin.DECLARED and declaration is not None and not declaration.static

    def captured(self) -> torch.Tensor | None:
        """The captured tensor: the original object, or a new view on the captured storage, or ``None`` if freed."""
        tensor = self.tensor_ref()
        if tensor is not None:
            return tensor
        storage = self.fp.storage_ref()
        if storage is None:
            return None
        view = torch.empty(0, dtype=self.fp.dtype, device=self.fp.device)
        view.set_(storage, self.fp.storage_offset, self.fp.shape, self.fp.stride)
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
    #: Whether two slots share a captured storage (only then can an alias break, or a copy pair repeat).
    shares_storage: bool = field(init=False)
    #: Whether a captured storage of this layer is also tracked by another layer (set by the contract).
    shared_across_layers: bool = field(init=False, default=False)
    known_paths: frozenset[str] = field(init=False)
    atoms: tuple[str, ...] = field(init=False)  # the qualified name, split (to check the layer is still there)

    def __post_init__(self) -> None:
        self.atoms = tuple(self.qualname.split(".")) if self.qualname else ()
        storages = {id(slot.fp.storage_ref()) for slot in self.slots}  # all alive at seal: ids are distinct
        self.shares_storage = len(storages) < len(self.slots)
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

    def resolve(self) -> Any:
        module = self.module_ref()
        return _MISSING if module is None else _getter(self.path)(module)

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


_SIGNATURE_ELEMENTS = 256
# A derived slot's own sample is larger: a real in-place write that leaves every sampled element as it was would
# be taken for a no-op (stale), e.g. a requantization of a small weight delta that flips few packed values.
_SLOT_SIGNATURE_ELEMENTS = 4096


def _signature(tensor: torch.Tensor, elements: int = _SIGNATURE_ELEMENTS) -> torch.Tensor:
    # A strided sample of the values: loaders commonly write through ``param.data.copy_``, which does not move the
    # parameter's version counter, so the values themselves are the only witness. Sampling keeps this a tiny
    # kernel; a change confined to unsampled elements can escape it (documented in docs/fault-matrix.md).
    value = tensor.detach()
    if value.is_contiguous():
        flat = value.reshape(-1)
        step = max(1, flat.numel() // elements)
        sample = flat[: step * elements : step]  # == flat[::step][:elements], one view
    else:  # a grid of about ``elements`` points: ``reshape(-1)`` of the whole view would copy all of it
        per_dim = max(1, int(elements ** (1 / max(1, value.dim()))))
        index = tuple(slice(None, None, max(1, n // per_dim)) for n in value.shape)
        sample = value[index].reshape(-1)
    # Compared as bytes: NaN equals NaN, and -0.0 differs from 0.0 (a write that changes any bit is a write).
    return sample.clone().view(torch.uint8)


def _strided(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout is torch.strided and value.device.type != "meta"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


# An input before PWAL: (storage, version, value sample), or None where the path held no tensor.
_InputBefore = tuple["weakref.ReferenceType[Any]", int, torch.Tensor] | None
# How an input changed: not at all; written with maybe the same values (its version counter moved, or another
# storage now holds the same sampled values); or for sure (other sampled values, gone).
_UNCHANGED, _MAYBE, _CHANGED = 0, 1, 2


def _input_before(value: Any) -> _InputBefore:
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return None
    return weakref.ref(value.untyped_storage()), value._version, _signature(value)


def _input_change(before: _InputBefore, value: Any) -> int:
    if before is None:
        return _UNCHANGED if not isinstance(value, torch.Tensor) else _CHANGED
    if not isinstance(value, torch.Tensor):
        return _CHANGED
    storage, version, sample = before
    if not _same_values(sample, _signature(value)):
        return _CHANGED
    return _UNCHANGED if storage() is value.untyped_storage() and value._version == version else _MAYBE


# One input of a layer's snapshot: (name for messages, how to resolve it now, what it was before PWAL).
_Input = tuple[str, Callable[[], Any], _InputBefore]
# A declared slot before PWAL: (tensor at the path, its version, its value sample, the keys of its inputs).
_Freshness = tuple[torch.Tensor, int, torch.Tensor, tuple[Any, ...]]


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
    inputs: dict[Any, _Input] = field(default_factory=dict)
    fallback: tuple[Any, ...] | None = None  # the keys of _layer_inputs, computed on first need

    def _add(self, key: Any, name: str, resolve: Callable[[], Any]) -> Any:
        if key not in self.inputs:
            self.inputs[key] = (name, resolve, _input_before(resolve()))
        return key

    def of(self, slot: SealedSlot) -> tuple[Any, ...]:
        """The keys of ``slot``'s inputs (see the section comment for which).

        A recorded input or a ``derived_from`` name that no longer resolves to a tensor (a module replaced, a
        tensor deleted) makes the slot fall back to the whole layer: an input that cannot be watched must not
        make the slot look fresh.
        """
        layer = self.layer
        sources = slot.declaration.derived_from if slot.declaration is not None else None
        recorded = slot.inputs
        if recorded is not None and not all(isinstance(ref.resolve(), torch.Tensor) for ref in recorded):
            recorded = None
        paths = [_path(source) for source in sources or ()]
        if (recorded is None and sources is None) or not all(
            isinstance(_getter(path)(layer), torch.Tensor) for path in paths
        ):
            if self.fallback is None:
                self.fallback = tuple(self._add(*entry) for entry in _layer_inputs(layer))
            return self.fallback
        keys: list[Any] = []
        for ref in recorded or ():
            keys.append(self._add((id(ref.module_ref()), ref.path.text), ref.label(self.qualname), ref.resolve))
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
    #: Copies ``(captured, new)`` planned by :meth:`restore` (read by :meth:`check_aliases`).
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: Whether slots may share captured storage (sealed so, or walker extras whose storage is unknown ahead).
    shared: bool = False

    @classmethod
    def take(cls, sealed: SealedLayer, layer: nn.Module, extra: Iterable[SealedSlot] = ()) -> LayerSnapshot:
        slots = list(sealed.slots)
        slots.extend(extra)
        captured: list[torch.Tensor | None] = []
        findings: list[Finding] = []
        freshness: dict[int, _Freshness] = {}
        inputs: _Inputs | None = None
        tensor_type = torch.Tensor
        for index, slot in enumerate(slots):
            tensor = slot.tensor_ref()
            if tensor is None:
                tensor = slot.captured()  # a new view on the captured storage, if it is still alive
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
            if slot.tracks_freshness:
                current = slot.get(layer)
                if isinstance(current, tensor_type):
                    if inputs is None:
                        inputs = _Inputs(layer, sealed.qualname)
                    freshness[index] = (
                        current,
                        current._version,
                        _signature(current, _SLOT_SIGNATURE_ELEMENTS),
                        inputs.of(slot),
                    )
        shared = sealed.shares_storage or len(slots) > len(sealed.slots)
        return cls(sealed, layer, slots, captured, findings, freshness, inputs, shared=shared)

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
        learned: list[tuple[SealedSlot, tuple[InputRef, ...]]] = []
        for index, (before, _, _, _) in self.freshness.items():
            slot = self.slots[index]
            current = slot.get(self.layer)
            if not isinstance(current, torch.Tensor):
                continue
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
                or slot.get(layer) is not captured
                or captured.data_ptr() != slot.fp.data_ptr
                or (captured.shape, captured.stride(), captured.dtype, captured.device) != slot.layout
                or slot.fp.storage_ref() is None
            ):
                return False
        return True

    def restore(self, *, auto_restore: bool, batch: CopyBatch) -> list[tuple[int, torch.Tensor]]:
        """Plan copies (added to ``batch`` and to :attr:`pairs`) and return the rebinds ``(slot index, captured)``.

        Problems become findings; nothing here raises for a bad slot. As when layers were restored one at a time,
        the values read here (input signatures) see every earlier layer's copies and none of this layer's: the
        batch is flushed before such a read, and this layer's copies join it only once planning is done.
        """
        sealed = self.sealed
        layer = self.layer
        rebinds: list[tuple[int, torch.Tensor]] = []
        pairs = self.pairs
        sizes: list[tuple[tuple[Any, ...], int]] = []  # (copy group, bytes) of each pair
        seen_pairs: set[tuple[int, int]] | None = set() if self.shared else None
        after_inputs: dict[Any, int] = {}
        tensor_type = torch.Tensor
        captured_list = self.captured
        for index, slot in enumerate(self.slots):
            captured = captured_list[index]
            if captured is None:
                continue
            current = slot.get(layer)
            if current is captured:
                if index in self.freshness:
                    self._check_fresh(index, slot, current, batch, after_inputs)
                continue  # in place
            if current is _MISSING or not isinstance(current, tensor_type):
                what = (
                    "the path no longer resolves"
                    if current is _MISSING
                    else (f"the path now holds {type(current).__name__}, not a tensor")
                )
                self.findings.append(sealed.finding(FindingKind.VANISHED, slot, detail=what))
                continue
            if current.untyped_storage() is captured.untyped_storage():
                if current.data_ptr() == slot.fp.data_ptr and geometry_key(current) == geometry_key(captured):
                    self._check_fresh(index, slot, current, batch, after_inputs)
                    continue  # in place, through another Python object
                self.findings.append(
                    sealed.finding(
                        FindingKind.RESPECIFIED,
                        slot,
                        after=fingerprint(current),
                        detail="same storage seen through another view: " + _describe_geometry_change(slot, current),
                    )
                )
                continue
            # Cheap fields first: both tensors exactly as sealed (the common case) settles it; anything else gets
            # the full comparison (size-1 dimensions may carry any stride).
            layout = slot.layout
            exact = (
                (current.shape, current.stride(), current.dtype, current.device) == layout
                and current.storage_offset() == slot.fp.storage_offset
                and (captured.shape, captured.stride(), captured.dtype, captured.device) == layout
            )
            if not exact and (
                geometry_key(current) != geometry_key(captured) or current.storage_offset() != slot.fp.storage_offset
            ):
                self.findings.append(
                    sealed.finding(
                        FindingKind.RESPECIFIED,
                        slot,
                        after=fingerprint(current),
                        detail=_describe_geometry_change(slot, current)
                        + "; a copy cannot keep the captured layout: recapture",
                    )
                )
                continue
            if slot.origin is Origin.WALKER:
                if not auto_restore or not slot.restorable:
                    why = "undeclared tensor moved to new storage"
                    if auto_restore:
                        why += f"; not restorable ({slot.reason})"
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
            if seen_pairs is not None:
                pair_key = (id(captured), id(current))
                if pair_key in seen_pairs:
                    continue
                seen_pairs.add(pair_key)
            pairs.append((captured, current))
            if exact:
                sizes.append((slot.group, slot.nbytes))
            else:  # the captured tensor is not laid out as sealed: size and group from what it is now
                sizes.append((copy_group(captured), captured.numel() * captured.element_size()))
        add = batch.add
        for (dst, src), (group, nbytes) in zip(pairs, sizes, strict=True):
            add(dst, src, group, nbytes)
        return rebinds

    def _check_fresh(
        self, index: int, slot: SealedSlot, current: torch.Tensor, batch: CopyBatch, after_inputs: dict[Any, int]
    ) -> None:
        """Flag a declared slot PWAL neither rebuilt nor really wrote in place although an input changed.

        Called for a slot found on its captured memory after PWAL. Rebuilt means another storage at the path
        before restore; a write counts only if it changed the slot's value sample (``clamp_(-inf, inf)`` moves the
        version counter and keeps the old values). A write that moved the version counter but kept the sampled
        values is still taken as a refresh when the inputs too were only maybe written (the same sampled values
        through the parameter or in a new tensor), and PWAL wrote the slot again in place.
        """
        before = self.freshness.get(index)
        if before is None or self.inputs is None:
            return
        tensor, version, sample, keys = before
        if current.untyped_storage() is not tensor.untyped_storage():
            return  # PWAL put another tensor at the path (restore copied it): rebuilt
        batch.flush()  # samples read values: earlier layers' copies land first (this layer's wait)
        if not _same_values(sample, _signature(current, _SLOT_SIGNATURE_ELEMENTS)):
            return  # written in place with other values
        rewritten = current._version != version
        changed: list[str] = []
        worst = _UNCHANGED
        for key in keys:
            change = after_inputs.get(key)
            if change is None:  # the inputs do not change during restore: once per input and layer
                _, resolve, input_before = self.inputs.inputs[key]
                change = after_inputs[key] = _input_change(input_before, resolve())
            if change != _UNCHANGED:
                changed.append(self.inputs.inputs[key][0])
                worst = max(worst, change)
        if worst == _UNCHANGED or (worst == _MAYBE and rewritten):
            return  # a partial reload that did not touch this slot's inputs, or the same values written again
        what = "kept the old values through an in-place write" if rewritten else "neither rebuilt it nor wrote it"
        self.findings.append(
            self.sealed.finding(
                FindingKind.STALE,
                slot,
                after=fingerprint(current),
                detail=f"its input(s) {', '.join(changed)} changed but PWAL {what}; the graph would read old values "
                "at the right address. Rebuild it in PWAL, or declare it static=True if its contents do not depend "
                "on the weights",
            )
        )

    def check_aliases(self, rebinds: list[tuple[int, torch.Tensor]]) -> None:
        """After copying: slots sharing a captured storage must all read their new values (else alias-broken).

        Call with the copies of :attr:`pairs` done (the batch flushed).
        """
        if not self.shared:
            return  # every captured storage is tracked by one slot: no two slots can disagree
        pairs = self.pairs
        by_storage: dict[int, list[int]] = {}
        for index, captured in rebinds:
            by_storage.setdefault(id(captured.untyped_storage()), []).append(index)
        new_of = {id(dst): src for dst, src in pairs}
        for indices in by_storage.values():
            if len(indices) < 2:
                continue
            for index in indices:
                held = self.captured[index]
                assert held is not None
                source: Any = self.slots[index].get(self.layer)
                if not isinstance(source, torch.Tensor):
                    source = new_of.get(id(held))
                if isinstance(source, torch.Tensor) and not torch.equal(held, source):
                    others = ", ".join(repr(self.slots[i].path.text) for i in indices if i != index)
                    self.findings.append(
                        self.sealed.finding(
                            FindingKind.ALIAS_BROKEN,
                            self.slots[index],
                            after=fingerprint(source),
                            detail=f"shared captured storage with {others}, but the reload produced values that "
                            "no longer agree",
                        )
                    )

    def rebind(self, rebinds: list[tuple[int, torch.Tensor]]) -> None:
        """Put the captured tensors back at their paths."""
        # A slot whose alias broke keeps its new tensor: the shared captured storage now holds another slot's
        # values, and rebinding would hand this path (and any recapture) the wrong ones.
        broken = {f.path for f in self.findings if f.kind is FindingKind.ALIAS_BROKEN} if self.findings else ()
        layer = self.layer
        for index, captured in rebinds:
            slot = self.slots[index]
            if broken and slot.path.text in broken:
                continue
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
        for index, slot in enumerate(self.slots):
            if flagged and slot.path.text in flagged:
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
                and current.data_ptr() == slot.fp.data_ptr
                and (current.shape, current.stride(), current.dtype, current.device) == slot.layout
            ):
                continue  # the captured object on its captured memory (``.data =``, ``set_`` or a storage
                # ``resize_`` can move the same object elsewhere)
            after = fingerprint(current)
            if after.key != slot.key or not after.same_storage(slot.fp):
                self.findings.append(
                    self.sealed.finding(
                        FindingKind.MOVED, slot, after=after, detail="not at its captured storage after restore"
                    )
                )
