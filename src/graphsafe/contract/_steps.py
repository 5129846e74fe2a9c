"""A transaction's restore steps: snapshot the layers, plan a group's copies (the fast tier, else the rules),
launch them, and check what no copy reached. Functions of a
:class:`~graphsafe.contract._transaction.ReloadTransaction`, bound there as its methods."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.collectors import UNTRACKABLE_ADVICE
from graphsafe.contract._access import submodule_is
from graphsafe.contract._attributes import _LOADED
from graphsafe.contract._copy import CopyBatch, byte_span
from graphsafe.contract._fast import Rebinds, plan_common, step_conditions
from graphsafe.contract._freshness import ClosedLayer, check_freshness, judge_noted
from graphsafe.contract._holders import keepers, new_ties
from graphsafe.contract._memory import address_range
from graphsafe.contract._order import loaded_early, moved_since, note_digests
from graphsafe.contract._owned import take_back_reasons
from graphsafe.contract._plan import RestorePlan
from graphsafe.contract._samples import SLOT_ELEMENTS, signature, version_of
from graphsafe.contract._slots import SealedLayer, SealedSlot
from graphsafe.contract._snapshot import LayerSnapshot
from graphsafe.contract._unnamed import note_unnamed
from graphsafe.contract._unread import skip_unread
from graphsafe.errors import hide_frames_in_pytest
from graphsafe.outcome import Finding, FindingKind, memory_tensors, storage_ids

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

from graphsafe.contract._landing import _Covered, _covered_on, _fills_span, _Landing, _same_as_new

if TYPE_CHECKING:
    from graphsafe.contract._transaction import ReloadTransaction

__all__: list[str] = []


def _reads_no_copy_reached(self: ReloadTransaction, plan: RestorePlan) -> list[Finding]:
    """``stale`` for captured storages this step copied into whose recorded reads reach bytes neither a copy nor
    a model path covers (a kernel handed a slot's view reads the whole buffer PWAL packed it in): the copy wrote
    the slot's bytes and the rest keep the old values, which a recapture through the same path reads too. Bytes
    equal to those at the same offsets of the storage PWAL's new tensor lies in (alignment padding) are not."""
    manifest = self.contract.manifest
    ranges = getattr(manifest, "byte_ranges", None)
    if manifest is None or ranges is None or not plan.moves:
        return []
    if self._byte_ranges is None:  # once per reload: what was recorded does not change during it
        self._byte_ranges = ranges()
    if not self._byte_ranges:
        return []
    written = [(str(m.memory[0]), m.memory[1], m.memory[2], m) for m in plan.moves]
    landed = _Landing(written)
    # Each recorded storage this step copied into, with the copies that landed on its recorded bytes.
    entries = [
        (entry, sources)
        for entry in self._byte_ranges
        if (sources := landed.on(str(entry.device), entry.data_ptr + entry.lo, entry.data_ptr + entry.hi))
    ]
    if not entries:
        return []
    # Only a tensor whose elements fill its address span covers that span: a strided view (``packed[:, ::2]``)
    # leaves the bytes between its elements as they were (the copy wrote only its elements).
    covered = [(device, start, end) for device, start, end, move in written if _fills_span(move.dst)]
    nothing = _Covered(())
    # Bytes the copies alone cover need no model path: only storages with bytes left over ask the held ones.
    by_copies = _covered_on(covered)
    entries = [
        (entry, sources)
        for entry, sources in entries
        if by_copies.get(str(entry.device), nothing).gaps(entry.data_ptr + entry.lo, entry.data_ptr + entry.hi)
    ]
    if not entries:
        return []
    for _, _, tensor in manifest.held(self.contract):
        try:
            # a wrapper: its inner ones
            covered.extend(address_range(part) for part in memory_tensors(tensor) if _fills_span(part))
        except (TypeError, RuntimeError):
            continue  # no memory of its own to cover anything
    findings: list[Finding] = []
    covered_on = _covered_on(covered)
    for entry, sources in entries:
        device, base = str(entry.device), entry.data_ptr
        gaps = [
            gap
            for gap in covered_on.get(device, nothing).gaps(base + entry.lo, base + entry.hi)
            if not _same_as_new(entry.storage_ref(), gap[0] - base, gap[1] - base, sources)
        ]
        if not gaps:
            continue
        holder = entry.holders[0] if entry.holders else None
        findings.append(
            Finding(
                FindingKind.STALE,
                layer=holder.layer if holder is not None else "",
                layer_class=holder.layer_class if holder is not None else "",
                path=holder.path if holder is not None else "",
                declared=holder is not None and holder.declared,
                before=entry.first_view,
                detail=f"the captured graph reads bytes {gaps[0][0] - base}..{gaps[0][1] - base} of its storage, "
                "which no slot covers and which differ from what PWAL left there in its new tensor: the restore "
                "copied the slot's own bytes and left those with their old values, and a recapture through "
                "this path reads them too. Declare the whole buffer the kernel reads (the tensor PWAL packed it "
                "in), not a view of part of it",
            )
        )
    return findings


# -- per layer ---------------------------------------------------------------------------------------------
def _snapshot(self: ReloadTransaction, sealed: SealedLayer, *, flush: bool = True) -> LayerSnapshot | None:
    """Snapshot one sealed layer; its value samples are taken at once, or (``flush=False``) by the caller's
    ``self._samples.flush()`` before the load."""
    layer = sealed.layer_ref()
    contract = self.contract
    if id(sealed) in self._gone:
        return None  # reported when the reload began; finish() must not report it again
    if layer is None or not self._still_in_model(sealed, layer):
        self._gone.add(id(sealed))
        for slot in sealed.slots:
            self._findings.append(
                sealed.finding(FindingKind.VANISHED, slot, detail="the layer itself was replaced, moved or removed")
            )
        if layer is None or all(module is not layer for module in contract.model.modules()):
            return None
        # Moved within the model (a reordered ModuleList): still snapshotted and restored, so that a stale value
        # in it is found before a recapture would read it.
        self._moved.add(id(sealed))
    contract._adopt_late_declarations(sealed, layer)
    self._closed.pop(id(sealed), None)  # reloaded again in this transaction: this snapshot's restore decides
    extras, exhausted, untrackable, unnamed = contract._walker_extras(sealed, layer)
    extras += self._manifest_extras(sealed)
    outer = functools.partial(contract._outer, sealed.qualname)
    snapshot = LayerSnapshot.take(
        sealed,
        layer,
        extras,
        samples=self._samples,
        recorded=contract._recorded,
        outer=outer,
        scratch=self._graph_writes,
        originals=self._originals,
    )
    if self._dataflow is not None:  # a layerwise snapshot during the recording: its slots' in-place writes counted
        self._dataflow.watch(entry[0] for entry in snapshot.freshness.values())
    if unnamed and id(sealed) not in self._unnamed:  # (the first snapshot's: the state before the load)
        # memory a slot path also reaches (a closure cell, a weight) is that slot's to judge
        slots = {ident for t in snapshot.captured if t is not None for ident in _storage_ids(t)}
        note = note_unnamed(
            sealed, layer, unnamed, snapshot.inputs, self._samples, lambda: self._weight_storages() | slots, outer
        )
        if note is not None:
            self._unnamed[id(sealed)] = note
    # Untrackable at the seal or now: no check can tell whether the graph still reads their memory.
    for where in dict.fromkeys(sealed.untrackable + untrackable):
        snapshot.findings.append(
            sealed.layer_finding(FindingKind.UNTRACKABLE, f"{where}; {UNTRACKABLE_ADVICE}", declared=False)
        )
    if exhausted or sealed.walk_exhausted:
        snapshot.findings.append(
            sealed.layer_finding(
                FindingKind.BUDGET_EXHAUSTED,
                (exhausted or sealed.walk_exhausted or "")
                + "; undeclared tensors past it are unchecked: raise max_depth/max_objects or declare them",
                declared=False,
            )
        )
    before = self._stamps.pop(id(sealed), None)
    if before is not None:
        if moved_since(before, layer):
            snapshot.findings.append(loaded_early(sealed))
        else:  # bytes written through .data move no stamp: compared when the reload finishes (_order)
            self._order_digests.append((sealed, note_digests(before, self._samples)))
    self._snapshots[id(sealed)] = snapshot
    if flush:
        self._samples.flush()
    return snapshot


def _memory_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``tensor``'s memory (a wrapper's inner ones), none where it has no memory of its own."""
    try:
        return list(memory_tensors(tensor))
    except (TypeError, RuntimeError):
        return []


def _storage_ids(tensor: torch.Tensor) -> list[int]:
    """:func:`~graphsafe.outcome.storage_ids`, none where the tensor has no memory of its own."""
    try:
        return storage_ids(tensor)
    except (TypeError, RuntimeError):
        return []


def _weight_storages(self: ReloadTransaction) -> set[int]:
    """ids of the storages of the model's parameters and buffers (read once per reload, where asked)."""
    if self._weights is None:
        model = self.contract.model
        self._weights = {ident for t in (*model.parameters(), *model.buffers()) for ident in _storage_ids(t)}
    return self._weights


def _graph_writes(self: ReloadTransaction, tensor: torch.Tensor) -> bool:
    """Whether a recorded capture wrote ``tensor``'s storage: scratch the graph overwrites at every replay, so
    its values before a reload are not the graph's input (read once per reload from the manifest)."""
    if self._written is None:
        entries = getattr(self.contract.manifest, "entries", None)
        self._written = {}
        for entry in entries() if callable(entries) else ():
            storage = entry.storage_ref() if entry.written else None
            if storage is not None:
                self._written[id(storage)] = storage
    if not self._written or tensor.layout is not torch.strided or tensor.device.type == "meta":
        return False
    storage = tensor.untyped_storage()
    return self._written.get(id(storage)) is storage


def _still_in_model(self: ReloadTransaction, sealed: SealedLayer, layer: nn.Module) -> bool:
    """Whether the model still holds ``layer`` at its qualified name, and at every other name it had at seal
    (a submodule shared at two paths: a module bound at either leaves the graph reading the captured one)."""
    if not sealed.qualname:
        return layer is self.contract.model
    also = self.contract._also.get(id(layer), ())
    return all(self._holds_at(atoms, layer) for atoms in (sealed.atoms, *also))


def _held_anywhere(self: ReloadTransaction, layer: nn.Module) -> bool:
    """Whether the model holds ``layer`` at any path (one of a shared submodule's names may be left)."""
    return any(module is layer for module in self.contract.model.modules())


def _holds_at(self: ReloadTransaction, atoms: tuple[str, ...], layer: nn.Module) -> bool:
    known = submodule_is(self.contract.model, atoms, layer)
    if known is not None:
        return known
    try:
        return self.contract.model.get_submodule(".".join(atoms)) is layer
    except AttributeError:
        return False


def _quarantine(self: ReloadTransaction, snapshot: LayerSnapshot) -> None:
    """Keep the snapshot's captured tensors alive until the next seal (see ``GraphContract._quarantine``)."""
    self.contract._quarantine.extend(t for t in snapshot.captured if t is not None)


def _quarantine_all(self: ReloadTransaction) -> None:
    for snapshot in self._snapshots.values():
        self._quarantine(snapshot)


def _restore_group(self: ReloadTransaction, group: list[LayerSnapshot], *, close: bool = False) -> None:
    """Restore ``group`` (the whole model, or one ``after_layer``) as one plan: plan every copy, clone the sources
    a copy would overwrite, launch, check every slot reading a written storage, then rebind and verify.
    ``close``: the reload goes on after this step (``after_layer``), so each layer is kept to be checked again
    when it finishes (:class:`ClosedLayer`)."""
    if self.contract.unread == "skip":  # before planning: a skipped slot is in place from here on
        skip_unread(self.contract, [s for s in group if self._still_in_model(s.sealed, s.layer)], self._skip)
    plan = RestorePlan(self.contract._shared)
    common = self._plan_common(group, plan) if not close else None
    if common is not None:
        work, untracked = common
        self._launch_common(work, plan, untracked)
    else:
        work = self._plan_by_rules(group, plan)
    if work:
        # New tensors left at their paths read what they read now; a later after_layer must not write it.
        self._kept.extend(t for s, _ in work for t in s.kept)
    if close and plan.moves:  # what PWAL wrote as those slots' new values: foreign to a later step's slots
        self._note_earlier_new(plan)
    check_freshness([snapshot for snapshot, _ in work])
    seen: dict[int, Any] = {}
    for snapshot, rebinds in work:
        snapshot.conflicting_attributes(rebinds, seen)
    if any(snapshot.attributes for snapshot, _ in work):
        kept_at_paths = {id(t) for snapshot, rebinds in work for t in snapshot.kept_tensors(rebinds)}
        for snapshot, rebinds in work:
            snapshot.carry_attributes(rebinds, kept_at_paths)
    pairs = [(snapshot, *bound) for snapshot, rebinds in work for bound in snapshot.bound_instead(rebinds)]
    swapped = {id(new): held for _, _, new, held in pairs}
    for snapshot, rebinds in work:
        snapshot.rebind(rebinds, swapped)
    if plan.moves and any(f.kind is FindingKind.MOVED for snapshot, _ in work for f in snapshot.findings):
        with plan.writing():
            plan.unbound()  # a rebind that failed: its path must not read what a copy wrote there
    if not any(f.kind.is_problem for snapshot, _ in work for f in snapshot.findings):
        # (Only when every copy of the step landed: a failed step leaves what PWAL made where it was.)
        for snapshot, _ in work:
            if snapshot.attributed:
                snapshot.remap_attributes(swapped)
    self._note_rebound(pairs, close)
    del pairs
    if self._closed_rebinds:  # a loader's write since into a tensor an earlier after_layer() replaced
        self._findings.extend(written_after_close(self._closed_rebinds, final=False))
    for snapshot, _ in work:  # after every rebind: two layers' paths can reach one place (nested layers)
        snapshot.verify()
    if close:  # paths left on new tensors: a later step's copy must not tie another path to what they read
        for snapshot, _ in work:
            confirmed = snapshot.confirmed
            self._keepers.extend(keepers(snapshot, {i for i, ok in enumerate(confirmed or ()) if ok}))
    self._doubt_abandoned(work, plan)
    for snapshot in group:
        snapshot.done = True
        self._restored += snapshot.restored
        self._findings.extend(snapshot.findings)
        if any(f.kind.is_problem for f in snapshot.findings):
            self._quarantine(snapshot)
        if close:  # (one with findings too: a weight written again after it would make a recapture stale)
            self._closed[id(snapshot.sealed)] = ClosedLayer.of(snapshot, self._samples)
        # Drop the strong references now: the new derived tensors of this layer can be freed before the next.
        snapshot.captured = [None] * len(snapshot.captured)
        snapshot.overrides, snapshot.kept, snapshot.keep, snapshot.attributes = {}, [], {}, {}
        snapshot.swapped, snapshot.carried, snapshot.attributed = {}, {}, []
    del work


def _note_rebound(
    self: ReloadTransaction, pairs: list[tuple[LayerSnapshot, int, torch.Tensor, torch.Tensor]], close: bool
) -> None:
    """Keep a weak reference to each new tensor the step replaced at its path (the path holds what replaced it,
    whatever else the step found), for what the reload's end asks of those something else keeps alive: their
    attributes elsewhere in the model follow (``remap_held_elsewhere``), and after ``after_layer()`` (``close``)
    no write may land in one (:func:`written_after_close`)."""
    for snapshot, index, new, held in pairs:
        slot = snapshot.slots[index]
        if slot.get(snapshot.layer) is not held:  # not rebound (a holder refused it): the path keeps its new tensor
            continue
        ref = weakref.ref(new)
        self._rebound.append((ref, held))
        # A tensor bound again at a later path (a loader's scratch Parameter reused) answers to that one only.
        self._closed_rebinds.pop(id(new), None)
        if close and slot.origin in _LOADED:  # (a derived one may become another slot's, written legitimately)
            self._closed_rebinds[id(new)] = (ref, version_of(new), held, snapshot.sealed, slot)


#: id() of a tensor ``after_layer()`` replaced -> (it, weakly; its version then, -1 for none; what replaced it; where).
ClosedRebinds = dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor, SealedLayer, SealedSlot]]


def written_after_close(rebinds: ClosedRebinds, *, final: bool) -> list[Finding]:
    """The new tensors ``after_layer()`` replaced by their captured ones that something still holds (a loader's
    ``params`` dict), written since: that write (a later shard) reached the orphan, never the captured tensor the
    graph reads (``stale``). Asked at each later restore step (its version counter moved: then its value sample
    against the captured one's) and at the reload's end (``final``: every one still held, by value sample, which
    sees a write through ``.data`` or under inference mode too). Found ones leave ``rebinds``."""
    findings = []
    for ident, (ref, version, held, sealed, slot) in list(rebinds.items()):
        new = ref()
        if new is None:
            del rebinds[ident]
            continue
        if not final and version >= 0 and version_of(new) == version:
            continue
        if _agrees_with_captured(new, held):  # (written again with the values it had: the captured one has them)
            rebinds[ident] = (ref, version_of(new), held, sealed, slot)
            continue
        del rebinds[ident]
        findings.append(
            sealed.finding(
                FindingKind.STALE,
                slot,
                detail="the tensor the load bound here was written after its layer's after_layer() put the captured "
                "one back, through a reference the loader kept (its params dict): the graph reads the captured "
                "tensor, which never got that write. Load a layer's weights completely before its after_layer(), "
                "or write them through the model's path",
            )
        )
    return findings


def _agrees_with_captured(new: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether a replaced tensor still holds what its captured replacement does: their value samples where both are
    laid out alike, else every value (on the captured tensor's device and dtype)."""
    with torch.no_grad():
        if new.dtype == held.dtype and new.shape == held.shape:
            return torch.equal(signature(new, SLOT_ELEMENTS).to(held.device), signature(held, SLOT_ELEMENTS))
        try:
            return torch.equal(new.detach().to(device=held.device, dtype=held.dtype).reshape(held.shape), held)
        except RuntimeError:  # nothing to compare it with: what it holds cannot be said to be the captured values
            return False


def _plan_common(
    self: ReloadTransaction, group: list[LayerSnapshot], plan: RestorePlan
) -> tuple[Rebinds, list[torch.Tensor]] | None:
    """The fast tier (``contract._fast``): the step planned in one lean pass where no rule of the engine can
    act, with the untracked holders it looked at; ``None`` hands the step to the rule engine unchanged."""
    if not step_conditions(self):
        return None
    in_group = {id(snapshot) for snapshot in group}
    if any(not s.done and id(s) not in in_group for s in self._snapshots.values()):
        return None  # layers still pending (the engine protects what their new tensors read)
    untracked = self._untracked_holders([])
    if untracked:
        return None  # readers at paths the contract does not track: the engine watches them
    work = plan_common(group, plan, shared=self.contract._shared, still_in_model=self._still_in_model)
    return None if work is None else (work, untracked)


def _launch_common(self: ReloadTransaction, work: Rebinds, plan: RestorePlan, kept: list[torch.Tensor]) -> None:
    """Launch a step the fast tier planned: what the rule engine does for it, less the checks that cannot act
    (no source reads a destination, no other slot or kept tensor reads one, every storage has one writer)."""
    judge_noted([snapshot for snapshot, _ in work])  # before any copy lands: the values PWAL left
    _note_pwal_writes(work, [*kept, *(move.new for move in plan.moves), *self._earlier_new(work)])
    batch = CopyBatch()
    try:
        if plan.moves:
            with plan.writing():
                plan.launch(batch)
            if self.contract.manifest is not None:  # the recorded bytes no copy reached: the engine's rule
                self._findings.extend(self._reads_no_copy_reached(plan))
    finally:
        self._bytes += batch.written


def _plan_by_rules(self: ReloadTransaction, group: list[LayerSnapshot], plan: RestorePlan) -> Rebinds:
    """The rule engine's planning and copies of a restore step (every rule of the snapshot's steps), for any step."""
    auto_restore = self.contract.mode == "migrate"
    work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]] = []
    for snapshot in group:
        if not self._still_in_model(snapshot.sealed, snapshot.layer) and id(snapshot.sealed) not in self._moved:
            # Replaced after the snapshot: the loader filled the new layer, so restoring the orphaned one would
            # commit captured storage that keeps the old values.
            snapshot.findings.extend(
                snapshot.sealed.finding(FindingKind.VANISHED, slot, detail="the layer was replaced during the reload")
                for slot in snapshot.slots
            )
            if not self._held_anywhere(snapshot.layer):
                continue
            # Still held at another of its names (a shared submodule replaced at one): checked like a moved
            # layer, so that a stale value there is found before a recapture would read it.
        if not snapshot.in_place():
            work.append((snapshot, snapshot.restore(auto_restore=auto_restore, plan=plan)))
        else:  # in_place() saw what verify() would confirm: every slot its captured object, as sealed
            snapshot.confirmed = [True] * len(snapshot.slots)
    judge_noted([snapshot for snapshot, _ in work])  # before any copy lands: the values PWAL left
    if any(snapshot.suspects for snapshot, _ in work):
        work = self._block_foreign_holders(work, plan)
    cross = self.contract._cross
    if cross and plan.moves:
        shared = (
            "its captured memory also lies under another storage object (a DLPack import, say), where the "
            "contract cannot check that every slot reading it agrees"
        )
        crossed = [m for m in plan.moves if (id(m.snapshot.sealed), m.index) in cross]
        work = self._take_back(work, plan, {(id(m.snapshot), m.index): shared for m in crossed})
    owned = self.contract._owned
    if owned is not None and plan.moves:  # memory an import's owner, or an arena tracked as an alias, may use
        work = self._take_back(work, plan, take_back_reasons(owned, plan.moves, self._captured_of, self._version_of))
    if plan.moves:
        work = self._take_back(work, plan, new_ties(work, plan, self._keepers))
    crossing = plan.crossing()  # the same, for memory two copies write (ties made after the seal too)
    if crossing:
        both = (
            "another copy of this reload writes the same memory under another storage object (a DLPack import, "
            "say), so the slots sharing it cannot be checked to agree"
        )
        work = self._take_back(work, plan, {(id(m.snapshot), m.index): both for m in crossing})
    batch = CopyBatch()
    local = [s for s, _ in work if len(s.slots) > len(s.sealed.slots)]
    kept = [*self._kept, *(t for s, _ in work for t in s.kept), *self._untracked_holders(local)]
    _note_pwal_writes(work, [*kept, *(move.new for move in plan.moves), *self._earlier_new(work)])
    try:
        if plan.moves:
            plan.protect()
            kept.extend(self._protect_pending(plan, group))
            plan.watch(self._captured_of, self._version_of, local, kept, self._changed_inputs)
            with plan.writing():
                plan.launch(batch)
                plan.check()
            self._findings.extend(plan.findings)
            if self.contract.manifest is not None:
                self._findings.extend(self._reads_no_copy_reached(plan))
    finally:
        # No flush here: launch() flushes its copies; after a failure the copies still pending are dropped, not
        # launched over what the failed step left (fail closed).
        self._bytes += batch.written
    return work


def _note_earlier_new(self: ReloadTransaction, plan: RestorePlan) -> None:
    """Note the memory of the new tensors this step's copies read (PWAL wrote each slot's new values there), by
    storage and byte span, no reference to the tensors (a loader may ``swap_tensors`` them): a slot of a later step
    left on that memory (a tie to a tensor PWAL rotated into another slot) holds another slot's values."""
    for move in plan.moves:
        for part in _memory_of(move.new):
            if part.layout is torch.strided and part.device.type != "meta":
                storage = part.untyped_storage()
                start, end = byte_span(part)  # what _overlap compares the later step's slots by
                self._earlier.setdefault(id(storage), []).append((weakref.ref(storage), start, end - start))


def _earlier_new(self: ReloadTransaction, work: Rebinds) -> list[torch.Tensor]:
    """Byte views of the memory :func:`_note_earlier_new` noted on the captured storages of ``work`` that is still
    alive (what this step's slots may still read), for :func:`_note_pwal_writes`. A lookup per captured tensor."""
    if not self._earlier:
        return []
    views: list[torch.Tensor] = []
    asked: set[int] = set()
    for snapshot, _ in work:
        for captured in snapshot.captured:
            if captured is None or captured.layout is not torch.strided or captured.device.type == "meta":
                continue
            ident = id(captured.untyped_storage())
            if ident not in asked:
                asked.add(ident)
                views.extend(_views(self._earlier.get(ident, ()), captured.untyped_storage()))
    return views


def _views(noted: Iterable[tuple[Any, int, int]], storage: Any) -> list[torch.Tensor]:
    """Byte views of the noted spans of ``storage`` (a noted storage by the same id that is another one: none)."""
    views: list[torch.Tensor] = []
    for ref, offset, nbytes in noted:
        if ref() is storage and offset + nbytes <= storage.nbytes():
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device)
            views.append(raw.set_(storage, offset, (nbytes,), (1,)))
    return views


def _note_pwal_writes(work: Rebinds, foreign: list[torch.Tensor]) -> None:
    """Before the plan's own copies and rebinds (either tier): flag slots left in place whose memory another
    path's new tensor (``foreign``) wrote, and note per slot whether PWAL wrote its captured memory (its version
    counter moved; see ``_doubt_abandoned``; restore noted what it left on its captured memory)."""
    for snapshot, _ in work:
        snapshot.doubt_foreign_writes(foreign)
        snapshot.written = [
            captured is not None and 0 <= version != version_of(captured)
            for captured, version in zip(snapshot.captured, snapshot.versions, strict=False)
        ]
