"""Skipping the restore copies of slots no captured graph reads (``GraphContract(unread="skip")``).

One step, run at the start of every restore step (``finish()``, each ``after_layer()``) before the copies are
planned. Where it is taken, a slot's new tensor (what PWAL made) stays at its path and becomes the slot's sealed
memory; the rest of the restore then sees the slot in place, so every other check (freshness, alias agreement,
verify, the manifest's check) runs unchanged.

**The rule.** A group of slots (every sealed slot whose captured memory is one storage ``S``) is skipped only when
all of these hold; otherwise it is restored as in ``unread="restore"`` (with a note saying why, when ``S`` was
unread):

1. what the graphs read is fully known (:meth:`~graphsafe.collectors.Manifest.truth`): at least one capture, every
   capture read by the kernel scan, every node of every scanned graph read in full. Else nothing is skipped in the
   whole reload and the outcome's ``skip_refused`` names the capture;
2. no captured graph reads any byte of ``S``: no node's word, and no aligned word of a storage a node points into
   (a pointer table, read or searched at scan time), falls in any storage, allocator block or address overlapping it;
3. every sealed slot reading ``S`` is in this restore step, each would be restored by a copy (a plain strided
   tensor, not a wrapper, not in place, same layout and offset as captured; an undeclared slot only where
   ``migrate`` restores it), and all of them now hold views of one new storage ``S'`` ("aliases move together");
4. ``S'`` is no sealed slot's captured storage, no other group's ``S'``, and no captured graph reads any byte of it;
5. once the contract lets go of ``S`` (its snapshot's references), ``S`` is freed: nothing else in the process holds
   it, so no path the contract does not know of (an alias under ``detect="declared-only"``, a loader's dict, an
   autograd edge) is left reading its old values. Where ``S`` survives, the contract takes it back and restores it;
   where its use count already shows another tensor on it, it is not let go at all (:func:`_held_elsewhere`).

The precondition, the user's to keep: every graph that reads the model is captured through graphsafe (the torch
adapter, ``cuda_graph``, ``record_capture(graph=...)``, the vLLM plugin) with the kernel scan. A graph captured any
other way is not in the manifest; once a slot is skipped its memory is freed, and such a graph would read freed memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphsafe.contract._memory import _NOTHING
from graphsafe.contract._samples import version_of
from graphsafe.contract._slots import SealedSlot, _is_wrapper, _view
from graphsafe.contract._snapshot import LayerSnapshot
from graphsafe.contract._tensorref import TensorRef
from graphsafe.outcome import Origin, SlotRef, fingerprint

if TYPE_CHECKING:
    from graphsafe.contract._contract import GraphContract

__all__ = ["UNREAD_POLICIES", "SkipState", "skip_unread"]

#: ``GraphContract(unread=...)``: ``"restore"`` copies every slot (the default), ``"skip"`` skips slots no graph reads.
UNREAD_POLICIES: tuple[str, ...] = ("restore", "skip")


@dataclass(slots=True)
class SkipState:
    """What the skip step did in one reload transaction (the outcome's ``slots_skipped``, ``skip_refused``,
    ``skip_notes``)."""

    skipped: int = 0
    refused: str | None = None
    notes: list[str] = field(default_factory=list)
    #: The manifest's read test, built once per transaction (the captures do not change during a reload).
    reads: Callable[[Any], bool] | None = None


# A member of a group: (snapshot, slot index, the new tensor at its path).
_Member = tuple[LayerSnapshot, int, torch.Tensor]


@dataclass(slots=True)
class _Group:
    """Every slot of one restore step whose captured memory is one storage, as the step found them."""

    storage_ref: weakref.ReferenceType[Any]
    members: list[_Member] = field(default_factory=list)
    #: Why the group cannot be skipped (the first reason found), or ``""``.
    blocked: str = ""


def _where(snapshot: LayerSnapshot, index: int) -> str:
    return str(SlotRef(snapshot.sealed.qualname, snapshot.slots[index].path.text))


def _candidate(snapshot: LayerSnapshot, index: int, migrate: bool) -> tuple[torch.Tensor | None, str]:
    """The new tensor a copy would restore slot ``index`` from, or ``None`` and why the slot is no candidate
    (``""``: a slot left on its captured memory, which keeps the group on it)."""
    slot = snapshot.slots[index]
    captured = snapshot.captured[index]
    assert captured is not None
    current = slot.get(snapshot.layer)
    if current is captured:
        return None, "another path to its captured storage is left on it"
    if not isinstance(current, torch.Tensor) or current.layout is not torch.strided or _is_wrapper(current):
        return None, "a slot on its captured storage is not a plain tensor now"
    if current.untyped_storage() is captured.untyped_storage():
        return None, "another path to its captured storage is left on it"
    if slot.origin is Origin.WALKER and not (migrate and slot.restorable):
        return None, "an undeclared path to its captured storage moved (a finding, not restored)"
    if _view(current) != _view(captured) or current.storage_offset() != slot.fp.storage_offset:
        return None, "a path to its captured storage changed its layout (a finding, not restored)"
    return current, ""


def _groups(contract: GraphContract, group: list[LayerSnapshot]) -> list[_Group]:
    """The restore step's slots, grouped by captured storage, with what blocks each group. Holds no strong reference
    to a captured storage once it returns."""
    migrate = contract.mode == "migrate"
    groups: dict[int, _Group] = {}
    members: set[tuple[int, int]] = set()  # (id(sealed layer), slot index) of every candidate
    for snapshot in group:
        for index in range(len(snapshot.sealed.slots)):  # sealed slots only: walker extras found now are not skipped
            slot = snapshot.slots[index]
            captured = snapshot.captured[index]
            if captured is None or slot.watch_only or slot.wrapped:
                continue
            storage = slot.fp.storage_ref()
            if storage is None or captured.untyped_storage() is not storage:
                continue  # the captured object moved itself (.data =, set_): restore reports it
            entry = groups.get(id(storage))
            if entry is None:
                entry = groups[id(storage)] = _Group(slot.fp.storage_ref)
            current, why = _candidate(snapshot, index, migrate)
            if current is None:
                entry.blocked = entry.blocked or f"{_where(snapshot, index)}: {why}"
                continue
            entry.members.append((snapshot, index, current))
            members.add((id(snapshot.sealed), index))
    for key, entry in groups.items():
        if entry.blocked or not entry.members:
            continue
        for sealed, position in contract._shared.get(key, ()):
            if (id(sealed), position) not in members:
                entry.blocked = (
                    f"{SlotRef(sealed.qualname, sealed.slots[position].path.text)} reads the same captured storage "
                    "and is not restored in this step with it"
                )
                break
    return list(groups.values())


def _sealed_storages(contract: GraphContract) -> set[int]:
    """ids of every sealed slot's captured storages (live ones; a dead one's id names nothing)."""
    out: set[int] = set()
    for sealed in contract._layers:
        for slot in sealed.slots:
            for part in slot.fp.memory():
                storage = part.storage_ref()
                if storage is not None:
                    out.add(id(storage))
    return out


def skip_unread(contract: GraphContract, group: list[LayerSnapshot], state: SkipState) -> None:
    """Skip the restore copies of this step's slots no captured graph reads, where the rule (module docs) allows:
    adopt each one's new tensor as its sealed memory. ``group`` are the step's snapshots still in the model."""
    if contract.unread != "skip" or not group or state.refused is not None:
        return
    manifest = contract.manifest
    truth = getattr(manifest, "truth", None)
    read_test = getattr(manifest, "read_test", None)
    if manifest is None or not callable(truth) or not callable(read_test):
        state.refused = (
            "no capture manifest says what the graphs read: capture them with graphsafe.capture, "
            "graphsafe.cuda_graph(contract) (where torch.cuda.graph was) or the vLLM plugin"
        )
        return
    if state.reads is None:
        why = truth()
        if why is not None:
            state.refused = f"what the captured graphs read is not fully known: {why}"
            return
        state.reads = read_test()
    groups = _groups(contract, group)
    if not groups:
        return
    reads_storage = state.reads
    # ids of the sealed slots' captured storages, once per step (a declaration made since joins the seal meanwhile)
    sealed: set[int] | None = None
    for entry in groups:
        if not entry.members:
            continue
        storage = entry.storage_ref()
        if storage is None or reads_storage(storage):
            continue  # read by a graph: restored, nothing to say
        del storage
        first = _where(entry.members[0][0], entry.members[0][1])
        if entry.blocked:
            state.notes.append(f"{first}: no graph reads it, but {entry.blocked}")
            continue
        new_storage = entry.members[0][2].untyped_storage()
        if any(current.untyped_storage() is not new_storage for _, _, current in entry.members):
            state.notes.append(
                f"{first}: no graph reads it, but its paths no longer share one storage (aliases must move together)"
            )
            continue
        if sealed is None:
            sealed = _sealed_storages(contract)
        if id(new_storage) in sealed:  # another slot's, or another group's adopted one
            state.notes.append(f"{first}: no graph reads it, but its new tensor is on another slot's captured storage")
            continue
        if reads_storage(new_storage):
            state.notes.append(f"{first}: no graph reads it, but a captured graph reads memory its new tensor is on")
            continue
        if (_held_elsewhere(entry) or 0) <= 0 and _let_go(contract, entry, new_storage):
            sealed.add(id(new_storage))  # a captured storage of the seal from now on
            state.skipped += len(entry.members)
        else:
            state.notes.append(
                f"{first}: no graph reads it, but its captured storage is still held outside the contract (a path it "
                "does not track, or a reference kept elsewhere), which would keep the old values: restored"
            )


def _held_elsewhere(entry: _Group) -> int | None:
    """How many references to the group's captured storage the snapshot's do not account for, by the storage's use
    count (``None``: it cannot tell: a captured view whose base no member holds, or no use count on this torch).

    Asked before letting go, so that a storage clearly held elsewhere is restored exactly as ``"restore"`` would
    (the let-go check takes the captured tensors back otherwise, and a view only the snapshot held comes back as a
    new view). It only ever avoids letting go: whether the storage is freed is still decided by its weak reference.
    torch counts one use per tensor on the storage and one for the storage's Python object (torch's own CUDA graph
    trees rely on the same).
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = entry.storage_ref()
    if storage is None or not callable(use_count):
        return None
    ours: dict[int, torch.Tensor] = {}
    for snapshot, index, _ in entry.members:
        before = snapshot.freshness.get(index)
        for tensor in (snapshot.captured[index], before[0] if before is not None else None):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage() is storage:
                ours[id(tensor)] = tensor
    if any(t._base is not None and id(t._base) not in ours for t in ours.values()):
        return None  # the base holds the storage too, and whether anything but the view holds the base is unknown
    return int(use_count(storage._cdata)) - len(ours) - 1


def _let_go(contract: GraphContract, entry: _Group, new_storage: Any) -> bool:
    """Drop the snapshot's references to the group's captured storage; adopt the new tensors where it was freed
    (True), else take the captured tensors back for the restore (False)."""
    old_id = id(entry.storage_ref())
    # Per member, whether the reload wrote the captured tensor before now (its version counter moved since the
    # snapshot): what the restore asks of a captured tensor's counter, kept for a view rebuilt below.
    moved: list[bool] = []
    # The captured objects, held weakly only while this step runs (no user code runs in between, so no
    # torch.utils.swap_tensors can meet the weak reference; the contract keeps none: see TensorRef).
    originals: list[weakref.ReferenceType[torch.Tensor] | None] = []
    held = contract._active._originals if contract._active is not None else {}  # the transaction's, by id
    for snapshot, index, _ in entry.members:
        captured = snapshot.captured[index]
        version = snapshot.versions[index] if index < len(snapshot.versions) else -1
        moved.append(captured is not None and 0 <= version != version_of(captured))
        originals.append(weakref.ref(captured) if captured is not None else None)
        if captured is not None and held.get(id(captured)) is captured:
            del held[id(captured)]
        del captured
        snapshot.captured[index] = None
        before = snapshot.freshness.get(index)
        if before is not None:  # what PWAL left at the path before: the captured tensor; keep the rest
            snapshot.freshness[index] = (_NOTHING, *before[1:])
        del before
    alive = entry.storage_ref()
    if alive is not None:  # someone else holds it: restore as usual, into the captured tensor (or a view on it)
        for (snapshot, index, _), written, original in zip(entry.members, moved, originals, strict=True):
            slot = snapshot.slots[index]
            tensor = original() if original is not None else None
            if tensor is not None and slot.tensor_ref.holds(tensor):
                held[id(tensor)] = tensor
            if tensor is None:  # only the snapshot held that object: a new view on the captured storage
                tensor = slot.captured()
                if tensor is not None and index < len(snapshot.versions) and snapshot.versions[index] >= 0:
                    # Its counter starts afresh: keep "written since the snapshot" as the original's counter said.
                    now = version_of(tensor)
                    snapshot.versions[index] = -1 if now < 0 else now + (1 if written else 0)
            snapshot.captured[index] = tensor
            before = snapshot.freshness.get(index)
            if before is not None and tensor is not None:
                snapshot.freshness[index] = (tensor, *before[1:])
        return False
    for snapshot, index, current in entry.members:
        old = snapshot.slots[index]
        slot = SealedSlot(
            old.path,
            fingerprint(current),
            TensorRef.of(current),
            old.origin,
            old.declaration,
            restorable=old.restorable,
            reason=old.reason,
            alias_of=old.alias_of,
        )
        slot.inputs, slot.unrecorded = old.inputs, old.unrecorded
        snapshot.sealed.slots[index] = slot
        snapshot.slots[index] = slot
        snapshot.captured[index] = current
        if index < len(snapshot.versions):
            snapshot.versions[index] = version_of(current)
    if old_id in contract._shared:  # the seal's index of storages several slots read: the group reads the new one now
        shared = dict(contract._shared)
        shared[id(new_storage)] = shared.pop(old_id)
        contract._shared = shared
    return True
