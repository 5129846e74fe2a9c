"""What a seal records per layer, and the per-reload work on one layer: snapshot, restore, verify.

This is the only code that mutates a model during reload (copies into captured storage, rebinds paths).

Per reload the work is a compiled plan: at seal every slot gets its path compiled into a getter and a setter
(:mod:`graphsafe.contract._access`), its expected layout as one comparable tuple and its copy group; a reload
then compares cheap fields first and falls back to the full geometry comparison only when they differ.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.contract._copy import CopyBatch, copy_group
from graphsafe.outcome import (
    Finding,
    FindingKind,
    Fingerprint,
    Origin,
    fingerprint,
    geometry_key,
    inner_tensors,
    memory_tensors,
    tensor_kind,
)
from graphsafe.paths import MISSING, Getter, Setter, SlotPath, compile_getter, compile_setter
from graphsafe.registry import Declaration

__all__ = ["LayerSnapshot", "SealedLayer", "SealedSlot"]

_MISSING: Any = MISSING


def _view(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The cheap layout tuple of a tensor as it is now (compared with :attr:`SealedSlot.layout`): everything that
    changes how its bytes are read, the class included."""
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.is_conj(), tensor.is_neg(), type(tensor))


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
    key: tuple[Any, ...] = field(init=False)
    # The compiled plan (derived from the fields above at construction):
    get: Getter = field(init=False, repr=False)
    set: Setter = field(init=False, repr=False)
    #: ``_view`` as sealed: (shape, stride, dtype, device, conj bit, neg bit, class).
    layout: tuple[Any, ...] = field(init=False, repr=False)
    #: A wrapper subclass: its memory is its inner tensors', restored and verified one by one (never fast paths).
    wrapped: bool = field(init=False, repr=False)
    group: tuple[Any, ...] = field(init=False, repr=False)  # the copy group of the captured tensor
    nbytes: int = field(init=False, repr=False)
    tracks_freshness: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fp = self.fp
        self.key = fp.key
        self.get = compile_getter(self.path)
        self.set = compile_setter(self.path)
        tensor = self.tensor_ref()
        # The raw class of the sealed object (a Parameter stays a Parameter), so that the in-place check matches it.
        cls = type(tensor) if tensor is not None else fp.kind
        self.layout = (fp.shape, fp.stride, fp.dtype, fp.device, fp.conj, fp.neg, cls)
        self.wrapped = bool(fp.inner)
        self.group = (fp.device, fp.dtype, tensor.layout if tensor is not None else torch.strided)
        self.nbytes = fp.nbytes
        declaration = self.declaration
        self.tracks_freshness = self.origin is Origin.DECLARED and declaration is not None and not declaration.static

    def captured(self) -> torch.Tensor | None:
        """The captured tensor: the original object, or a new view on the captured storage, or ``None`` if freed."""
        tensor = self.tensor_ref()
        if tensor is not None:
            return tensor
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
    #: Whether two slots share a captured storage (only then can an alias break, or a copy pair repeat).
    shares_storage: bool = field(init=False)
    #: Whether a captured storage of this layer is also tracked by another layer (set by the contract).
    shared_across_layers: bool = field(init=False, default=False)
    known_paths: frozenset[str] = field(init=False)
    atoms: tuple[str, ...] = field(init=False)  # the qualified name, split (to check the layer is still there)

    def __post_init__(self) -> None:
        self.atoms = tuple(self.qualname.split(".")) if self.qualname else ()
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


# What a declared slot and its inputs looked like before PWAL, to tell a skipped rebuild (``stale``):
# (tensor at the path, its version, the declared sources, the inputs' state). A tuple: one is made per slot and
# reload.
_Freshness = tuple[torch.Tensor, int, "tuple[str, ...] | None", "_InputState"]


def _own_parameters(layer: nn.Module) -> list[torch.Tensor]:
    """``[p for _, p in layer.named_parameters(recurse=False)]``, read directly unless a class overrides it."""
    cls = type(layer)
    if cls.named_parameters is not _NAMED_PARAMETERS or cls._named_members is not _NAMED_MEMBERS:
        return [p for _, p in layer.named_parameters(recurse=False)]
    own: list[torch.Tensor] = []
    for p in layer._parameters.values():
        if p is not None and not any(p is q for q in own):  # named_parameters drops repeats
            own.append(p)
    return own


_NAMED_PARAMETERS: Any = nn.Module.named_parameters
_NAMED_MEMBERS: Any = nn.Module._named_members


def _input_tensors(layer: nn.Module, sources: tuple[str, ...] | None) -> list[torch.Tensor]:
    if sources is None:
        own = _own_parameters(layer)
        return own if own else list(layer.parameters())
    found = []
    for source in sources:
        value = SlotPath(source).resolve_or(layer, None)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


_SIGNATURE_ELEMENTS = 256


def _signature(tensor: torch.Tensor) -> torch.Tensor:
    # A strided sample of the values: loaders commonly write through ``param.data.copy_``, which does not move the
    # parameter's version counter, so the values themselves are the only witness. Sampling keeps this a tiny
    # kernel; a change confined to unsampled elements can escape it (documented in docs/fault-matrix.md).
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // _SIGNATURE_ELEMENTS)
    return flat[: step * _SIGNATURE_ELEMENTS : step].clone()  # == flat[::step][:_SIGNATURE_ELEMENTS], one view


@dataclass(frozen=True, slots=True)
class _InputState:
    identity: tuple[tuple[int, int], ...]
    samples: tuple[torch.Tensor, ...]

    def same_as(self, other: _InputState) -> bool:
        return self.identity == other.identity and all(
            torch.equal(a, b) for a, b in zip(self.samples, other.samples, strict=True)
        )


def _input_state(layer: nn.Module, sources: tuple[str, ...] | None) -> _InputState:
    # A weight load either replaces the inputs (storage changes), writes them through the parameter (version
    # moves) or writes them through ``.data`` (only the values change).
    # A wrapper input (a quantized weight) is read through its inner tensors.
    tensors = [part for t in _input_tensors(layer, sources) if t.device.type != "meta" for part in memory_tensors(t)]
    return _InputState(
        tuple((id(t.untyped_storage()), t._version) for t in tensors), tuple(_signature(t) for t in tensors)
    )


@dataclass(slots=True)
class LayerSnapshot:
    """One layer's state for one reload: strong references to every captured tensor until restore is done."""

    sealed: SealedLayer
    layer: nn.Module
    slots: list[SealedSlot]
    captured: list[torch.Tensor | None]
    findings: list[Finding] = field(default_factory=list)
    freshness: dict[int, _Freshness] = field(default_factory=dict)
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
        input_cache: dict[tuple[str, ...] | None, _InputState] = {}
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
                    sources = slot.declaration.derived_from  # type: ignore[union-attr]
                    inputs = input_cache.get(sources)
                    if inputs is None:
                        inputs = input_cache[sources] = _input_state(layer, sources)
                    freshness[index] = (current, current._version, sources, inputs)
        shared = sealed.shares_storage or len(slots) > len(sealed.slots)
        return cls(sealed, layer, slots, captured, findings, freshness, shared=shared)

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
        after_inputs: dict[tuple[str, ...] | None, bool] = {}
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
            inner_pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
            if slot.wrapped or _is_wrapper(current):
                # A wrapper subclass: its inner tensors are what is copied. Settled here; a match goes on below
                # (walker gate, rebind) with the inner pairs in place of the one pair.
                problem = self._wrapper_pairs(slot, captured, current)
                if isinstance(problem, Finding):
                    self.findings.append(problem)
                    continue
                if not problem:
                    self._check_fresh(index, slot, current, batch, after_inputs)
                    continue  # every inner tensor in place
                inner_pairs = problem
                exact = False
            elif current.untyped_storage() is captured.untyped_storage():
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
            else:
                # Cheap fields first: both tensors exactly as sealed (the common case) settles it; anything else
                # gets the full comparison (size-1 dimensions may carry any stride).
                layout = slot.layout
                exact = (
                    _view(current) == layout
                    and current.storage_offset() == slot.fp.storage_offset
                    and _view(captured) == layout
                )
            if (
                inner_pairs is None
                and not exact
                and (
                    geometry_key(current) != geometry_key(captured)
                    or current.storage_offset() != slot.fp.storage_offset
                )
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
            if inner_pairs is not None:
                for dst, src in inner_pairs:
                    pairs.append((dst, src))
                    sizes.append((copy_group(dst), dst.numel() * dst.element_size()))
                continue
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
            if dst.data_ptr() != sealed_part.data_ptr or dst.untyped_storage() is not sealed_part.storage_ref():
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

    def _check_fresh(
        self,
        index: int,
        slot: SealedSlot,
        current: torch.Tensor,
        batch: CopyBatch,
        after_inputs: dict[tuple[str, ...] | None, bool],
    ) -> None:
        """Flag a declared slot PWAL neither rebuilt nor wrote in place although its inputs changed."""
        before = self.freshness.get(index)
        if before is None:
            return
        tensor, version, sources, inputs_before = before
        if current is not tensor or current._version != version:
            return
        unchanged = after_inputs.get(sources)  # the inputs do not change during restore: once per layer
        if unchanged is None:
            batch.flush()  # the signature reads values: earlier layers' copies land first (this layer's wait)
            unchanged = after_inputs[sources] = _input_state(self.layer, sources).same_as(inputs_before)
        if unchanged:
            return  # a partial reload that did not touch this slot's inputs
        inputs = ", ".join(sources) if sources else "the layer's parameters"
        self.findings.append(
            self.sealed.finding(
                FindingKind.STALE,
                slot,
                after=fingerprint(current),
                detail=f"its inputs ({inputs}) changed but PWAL neither rebuilt it nor wrote it in place; the graph "
                "would read old values at the right address. Rebuild it in PWAL, or declare it static=True if "
                "its contents do not depend on the weights",
            )
        )

    def check_aliases(self, rebinds: list[tuple[int, torch.Tensor]]) -> None:
        """After copying: slots sharing a captured storage must all read their new values (else alias-broken).

        Call with the copies of :attr:`pairs` done (the batch flushed).
        """
        if not self.shared:
            return  # every captured storage is tracked by one slot: no two slots can disagree
        pairs = self.pairs
        # By storage: (slot index, which of the slot's memory tensors) -- a wrapper reads several storages.
        by_storage: dict[int, list[tuple[int, int]]] = {}
        for index, captured in rebinds:
            for part, memory in enumerate(memory_tensors(captured)):
                by_storage.setdefault(id(memory.untyped_storage()), []).append((index, part))
        new_of = {id(dst): src for dst, src in pairs}
        for entries in by_storage.values():
            if len(entries) < 2:
                continue
            for index, part in entries:
                whole = self.captured[index]
                assert whole is not None
                held = memory_tensors(whole)[part]
                source: Any = self.slots[index].get(self.layer)
                if isinstance(source, torch.Tensor):
                    parts = memory_tensors(source)
                    source = parts[part] if len(parts) == len(memory_tensors(whole)) else None
                else:
                    source = new_of.get(id(held))
                if isinstance(source, torch.Tensor) and not torch.equal(held, source):
                    indices = {i for i, _ in entries}
                    others = ", ".join(repr(self.slots[i].path.text) for i in sorted(indices) if i != index)
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
                and not slot.wrapped
                and current.data_ptr() == slot.fp.data_ptr
                and _view(current) == slot.layout
            ):
                continue  # the captured object on its captured memory (``.data =``, ``set_`` or a storage
                # ``resize_`` can move the same object elsewhere)
            try:
                after = fingerprint(current)
            except (TypeError, RuntimeError) as exc:  # no storage and no flattenable inner tensors
                self.findings.append(
                    self.sealed.finding(FindingKind.MOVED, slot, detail=f"cannot read the tensor's memory ({exc})")
                )
                continue
            if after.key != slot.key or not after.same_storage(slot.fp):
                self.findings.append(
                    self.sealed.finding(
                        FindingKind.MOVED, slot, after=after, detail="not at its captured storage after restore"
                    )
                )
