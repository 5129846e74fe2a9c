"""The per-reload work on one layer: :class:`LayerSnapshot` takes what the layer holds before the load, then
restores, rebinds and verifies it. This is the only code that mutates a model during reload (copies into captured
storage, rebinds paths).

The class holds the state and the snapshot itself; its steps live with their rule: restoring a slot in
:mod:`~graphsafe.contract._restore`, rebinding and verifying in :mod:`~graphsafe.contract._rebind`, the freshness
of derived slots in :mod:`~graphsafe.contract._freshness` (each a function of the snapshot, bound as a method).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.contract import _freshness, _rebind, _restore
from graphsafe.contract._inputs import _Freshness, _Inputs, _strided
from graphsafe.contract._memory import reads_as_captured
from graphsafe.contract._samples import SLOT_ELEMENTS, Digest, Sample, SampleBatch, version_of
from graphsafe.contract._slots import InputRef, SealedLayer, SealedSlot, _describe_geometry_change, _view
from graphsafe.contract._witness import sampled_whole, witness_of
from graphsafe.outcome import Finding, FindingKind, Origin, SlotRef, fingerprint

__all__ = ["LayerSnapshot"]


def _reads_as(current: Any, before: torch.Tensor) -> bool:
    """:func:`reads_as_captured`, for a tensor a wrapper subclass may be (no storage of its own to ask)."""
    try:
        return reads_as_captured(current, before)
    except (RuntimeError, NotImplementedError):
        return current is before


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
    #: Slot index -> how many bytes of its captured tensor a recorded PWAL's in-place writes left out, for each slot
    #: PWAL wrote in place only in part (:meth:`note_partial_writes`): not refreshed, whatever its sample says.
    partly: dict[int, int] = field(default_factory=dict)
    #: Slots a recorded reload watched on their tensor and saw no write to (:meth:`note_partial_writes`): a value
    #: sample that changed anyway was changed where the recording could not see (a NumPy view, a raw kernel,
    #: another thread), and says nothing about how much of it.
    unseen: set[int] = field(default_factory=set)
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
    #: Slot index -> a witness of every byte its captured tensor spanned before the load (:func:`witness_of`), for
    #: each captured derived tensor (not a parameter or buffer, whose departures are witnessed when they leave; not
    #: a scratch the graph writes) whose value sample is not all of it already: a PWAL that hands it to a holder
    #: outside the model and writes it there through an alias that moves no version counter changes it.
    witnesses: dict[int, Sample | Digest] = field(default_factory=dict)

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
        witnesses: dict[int, Sample | Digest] = {}
        inputs: _Inputs | None = None
        tensor_type = torch.Tensor
        walker = Origin.WALKER
        for index, slot in enumerate(slots):
            at_path = slot.get(layer)  # what the path holds now (the freshness check's tensor before the load)
            ref = slot.tensor_ref
            if ref.holds(at_path):  # the sealed object, on its sealed implementation
                tensor = at_path
            else:
                held = originals.get(ref.ident) if originals else None
                tensor = held if held is not None and ref.holds(held) else None
                del held
            if tensor is not None:
                versions.append(version_of(tensor))
                if originals is not None:
                    originals[id(tensor)] = tensor
            else:  # a new view on the captured storage, if it is still alive
                tensor = slot.captured()
                versions.append(-1)
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
            written_by_graph = slot.origin is walker and scratch is not None and scratch(tensor)
            if (
                slot.tracks_freshness
                and (slot.origin is not walker or not recorded or slot.inputs or slot.unrecorded or slot.owed)
                and not written_by_graph
                and isinstance(at_path, tensor_type)
                and not _no_memory(at_path)
            ):
                if inputs is None:
                    inputs = _Inputs(layer, sealed.qualname, samples, outer=outer)
                sample = samples.take(at_path, SLOT_ELEMENTS)
                freshness[index] = (at_path, version_of(at_path), sample, inputs.of(slot))
                if at_path is tensor and sampled_whole(tensor):
                    continue  # its value sample is every byte of it
            if not written_by_graph and not slot.origin.is_state and slot.origin is not Origin.ALIAS:
                witness = witness_of(tensor, samples)
                if witness is not None:
                    witnesses[index] = witness
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
            witnesses=witnesses,
        )

    def note_partial_writes(self, unwritten_bytes: Callable[[torch.Tensor], int | None], *, saw_load: bool) -> None:
        """After a recorded PWAL, before restore: note each slot watched for freshness still on its tensor that the
        recording saw written in place only in part (``unwritten_bytes``: the bytes its in-place writes left out,
        ``None`` where it saw none), or not at all where it saw the layer's weights written (``saw_load``: else the
        recording is blind to this layer's load and PWAL, run on another thread). Its changed value sample then says
        nothing: part of it may keep the old values."""
        for index, (before, _, _, _) in self.freshness.items():
            current = self.slots[index].get(self.layer)
            # The same tensor, or a new view reading its memory as it did (``.view()``, ``.detach()``): judged by the
            # bytes of the tensor the slot held before the load.
            if _reads_as(current, before):
                left = unwritten_bytes(before)
                if left is None:
                    if saw_load and _on_captured(before, self.slots[index]):  # (not moved by .data =, set_)
                        self.unseen.add(index)
                elif left:
                    self.partly[index] = left

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
        try:
            after = fingerprint(current)
        except (TypeError, RuntimeError):  # no storage and no flattenable inner tensors: no memory to keep either
            after = None
        else:
            self.kept.append(current)
        self.findings.append(
            self.sealed.finding(
                FindingKind.RESPECIFIED,
                slot,
                after=after,
                detail=prefix + _describe_geometry_change(slot, current) + suffix,
            )
        )

    # Restoring the slots after the load (contract._restore).
    restore = _restore.restore
    _wrapper_pairs = _restore._wrapper_pairs
    _note_fresh = _restore._note_fresh

    # Freshness of the derived slots (contract._freshness).
    doubt_foreign_writes = _freshness.doubt_foreign_writes
    left_stale = _freshness.left_stale
    changed_inputs = _freshness.changed_inputs
    _check_fresh = _freshness._check_fresh

    # Rebinding the captured tensors and verifying the paths (contract._rebind).
    broken_paths = _rebind.broken_paths
    bound_instead = _rebind.bound_instead
    carry_attributes = _rebind.carry_attributes
    kept_tensors = _rebind.kept_tensors
    _broken_indices = _rebind._broken_indices
    remap_attributes = _rebind.remap_attributes
    conflicting_attributes = _rebind.conflicting_attributes
    rebind = _rebind.rebind
    verify = _rebind.verify


def _no_memory(tensor: torch.Tensor) -> bool:
    """Whether a plain tensor has no memory at all (its storage holds no byte: a placeholder such as an unbound
    cache): no value there for a change of its inputs to leave old. An empty view into a storage with bytes is not
    such a tensor: a kernel handed it gets a pointer into that storage, and it may be the only watched witness of
    the memory around it."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout is torch.strided
        and not tensor.is_nested
        and tensor.device.type != "meta"
        and tensor.untyped_storage().nbytes() == 0
    )


def _on_captured(tensor: torch.Tensor, slot: SealedSlot) -> bool:
    """Whether ``tensor`` still lies at the slot's captured address (an object PWAL gave new memory does not)."""
    try:
        return bool(tensor.data_ptr() == slot.fp.data_ptr)
    except RuntimeError:  # a wrapper subclass: no memory of its own
        return False
