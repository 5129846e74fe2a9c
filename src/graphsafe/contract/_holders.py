"""Tensors held outside the model's paths during a reload: a captured tensor someone else still holds blocks its
copy, one the load abandoned is doubted, and the manifest's extra holders are tracked. Functions of a
:class:`~graphsafe.contract._transaction.ReloadTransaction`, bound there as its methods."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.collectors import walk
from graphsafe.contract._copy import clone_laid_out
from graphsafe.contract._memory import _hits, _memory, _sorted_ranges, address_range, reads_as_captured
from graphsafe.contract._plan import RestorePlan
from graphsafe.contract._samples import Digest, Sample, version_of
from graphsafe.contract._slots import SealedLayer, SealedSlot
from graphsafe.contract._snapshot import LayerSnapshot
from graphsafe.contract._tensorref import TensorRef
from graphsafe.contract._witness import changed_since, sampled_whole
from graphsafe.devices import WalkBudget
from graphsafe.errors import hide_frames_in_pytest
from graphsafe.outcome import FindingKind, Origin, SlotRef, fingerprint, geometry_key, memory_tensors
from graphsafe.paths import SlotPath

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

from graphsafe.contract._landing import _gaps, _overlapping

if TYPE_CHECKING:
    from graphsafe.contract._departures import Departures
    from graphsafe.contract._transaction import ReloadTransaction

__all__: list[str] = []


def _block_foreign_holders(
    self: ReloadTransaction, work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]], plan: RestorePlan
) -> list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]]:
    """Take back the planned copies into captured storage that something besides its slots holds.

    PWAL can hand a slot's captured tensor (or its base, a view of it, its raw storage) to another place (a
    ping-pong buffer swapped into an undeclared attribute, a storage pool) and give the slot a new one. Copying
    the slot's new values there would write values the reload never produced for that holder. Such a storage
    is not written: each slot planned into it keeps its new tensor and is ``alias-broken`` (the graph reads the
    holder's values there; recapture). Asked only when :func:`held_outside` saw another holder; then every
    module of the model is walked once. A storage is blocked when the walk finds it at a path the contract does
    not track, when the walk was cut short, or when its storage object is held (a storage pool). A tensor or
    view held outside every model path (a dict key, a table outside the model) is blocked where the reload wrote
    it (:func:`_written_since_left`); one nothing wrote is a caller's reference to the slot, which the slot's new
    values rightly reach.
    """
    contract = self.contract
    suspects: dict[int, Any] = {}
    seen: dict[int, set[str]] = {}  # per storage, what held_outside saw holding it
    for snapshot, _ in work:
        for index, held, which in snapshot.suspects:
            captured = snapshot.captured[index]
            if captured is None:
                continue
            # A wrapper held as a whole (-1): every storage under it is searched for; else one part's, or the
            # plain tensor's own.
            holders = memory_tensors(captured) if which is not None else [captured]
            if which is not None and which >= 0:
                holders = holders[which : which + 1]
            for storage in (holder.untyped_storage() for holder in holders):
                suspects.setdefault(id(storage), storage)
                seen.setdefault(id(storage), set()).add(held)
    tracked = {
        f"{sealed.qualname}.{slot.path.text}" if sealed.qualname else slot.path.text
        for sealed in contract._layers
        for slot in sealed.slots
    }
    why: dict[int, str] = {}
    at_tracked: set[int] = set()  # held at a tracked path: another slot's new tensor (a swap, a rotation)
    # The same memory can lie under another storage object (a DLPack import): matched by address too.
    spans = [
        (str(storage.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes(), key)
        for key, storage in suspects.items()
    ]
    budget = WalkBudget(max_depth=64, max_objects=max(1_000_000, contract.budget.max_objects))
    for qualname, module in contract.model.named_modules():
        result = walk(module, budget=budget, devices=contract.devices, units=contract._units)
        if result.exhausted is not None:
            for key in suspects:
                why.setdefault(key, f"the search for other holders was cut short ({result.exhausted})")
        for ref in result.refs:
            try:
                parts = memory_tensors(ref.tensor)  # a wrapper's inner tensors hold its memory
            except TypeError:
                continue
            for part in parts:
                if part.layout is not torch.strided:
                    continue
                key = id(part.untyped_storage())
                keys = [key] if key in suspects else _overlapping(spans, part)
                if not keys:
                    continue
                path = f"{qualname}.{ref.path}" if qualname else ref.path
                if path not in tracked:
                    for found in keys:
                        why.setdefault(found, f"{path!r}, which the contract does not track, holds it")
                else:
                    at_tracked.update(keys)
        for where, pool in result.storages:  # a raw storage (a pool), also one made over the bytes by an import
            key = id(pool)
            first = pool.data_ptr()
            keys = (
                [key]
                if key in suspects
                else [
                    k
                    for device, start, end, k in spans
                    if device == str(pool.device) and start < first + pool.nbytes() and first < end
                ]
            )
            path = f"{qualname}.{where}" if qualname else where
            for found in keys:
                why.setdefault(found, f"{path!r} holds it as a raw storage (a storage pool)")
    for key in suspects:
        if key not in why and "storage-object" in seen[key]:
            why[key] = "its storage object is held (a storage pool, or a reference outside every model path)"
    # Memory an earlier step's copies read as a slot's new tensor: the reload wrote it as that slot's values.
    earlier = {key for key in suspects if any(ref() is suspects[key] for ref, _, _ in self._earlier.get(key, ()))}
    unexplained = {key for key in suspects if key not in why and key not in at_tracked and key not in earlier}
    # Held at a tracked path too (an alias path: the flat tensor parameters are carved from): a parameter written
    # there after it left holds that path's values, which the parameter's copy would overwrite.
    departed = {key for key in at_tracked if key not in why and key not in earlier}
    if unexplained or departed:
        captured_memory = {
            (str(slot.fp.device), slot.fp.storage_ptr) for sealed in contract._layers for slot in sealed.slots
        }
        why.update(
            _written_since_left(work, plan, unexplained, captured_memory, self._departures, departed_only=departed)
        )
    del suspects, seen
    if not why:
        return work
    return self._take_back(
        work,
        plan,
        {
            (id(m.snapshot), m.index): f"its captured memory is still held elsewhere: {why[m.storage]}"
            for m in plan.moves
            if m.storage in why
        },
    )


def _written_since_left(
    work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]],
    plan: RestorePlan,
    unexplained: set[int],
    captured_memory: set[tuple[str, int]],
    departures: Departures,
    *,
    departed_only: AbstractSet[int] = frozenset(),
) -> dict[int, str]:
    """Of the captured storages held outside every walked path (``unexplained``: storage ids), the ones a
    slot left and something wrote during the reload; of those a tracked path holds (``departed_only``), the ones a
    parameter or buffer left and that path wrote afterwards (a parameter carved from a plain tensor the model holds).
    A derived slot's write shows in its version counter or in the witness of every byte :mod:`._witness` took at
    ``begin()`` (one it has none for is refused); a wrapper's in its inner tensors'.

    The walk cannot tell a holder outside the model (a dict key, an engine-level table) from a caller's own
    reference to the slot. A write to that memory during the reload can: a caller's reference to a derived slot
    is not written after PWAL gives the slot a new tensor, a ping-pong holder is. A loader writing the slot in
    place before PWAL replaces it leaves the same evidence, and is refused too: the copy would be safe there, but
    nothing tells the two apart (fail closed). A registered parameter or buffer is what a loader writes, so its
    write is evidence only after a registration replaced it (``departures``: the loader's write comes before);
    one that left with no registration seen (``del``, ``= None``) is refused (nothing tells when it left), and
    memory inside one keeps the walk's answer. So does a storage one of whose
    slots has a new tensor on a captured storage (``captured_memory``: device and storage address of every sealed
    slot; a swap or rotation of captured tensors): that memory's own restore writes it, so a slot taken back onto
    it would be left on another slot's values.
    """
    # Storages a move fills for a slot whose new tensor another slot's restore writes: not taken back.
    rotated = {
        m.storage
        for m in plan.moves
        if any(
            (str(part.device), part.untyped_storage().data_ptr()) in captured_memory for part in memory_tensors(m.new)
        )
    }
    unexplained = unexplained - rotated
    departed_only = departed_only - rotated
    written: dict[int, str] = {}
    asked: list[tuple[list[int], Sample | Digest, torch.Tensor]] = []  # (storage ids, witness, captured tensor)
    for snapshot, _ in work:
        for index, _held, which in snapshot.suspects:
            captured = snapshot.captured[index]
            slot = snapshot.slots[index]
            if captured is None or slot.inside is not None:
                continue
            parts = memory_tensors(captured) if which is not None else [captured]  # a wrapper's inner tensors
            if which is not None and which >= 0:
                parts = parts[which : which + 1]
            hit = [
                key
                for key in (id(part.untyped_storage()) for part in parts)
                if key in unexplained or key in departed_only
            ]
            if not hit or all(key in written for key in hit):
                continue
            through_alias = all(key in departed_only for key in hit)
            reason: str | None = None
            if slot.origin.is_state:
                # A parameter or buffer: the loader writes it; written after a registration replaced it, it was not
                # the loader. Held by a tracked alias path (the tensor it is carved from), that path wrote it.
                if departures.written_since_left(captured):
                    reason = _WRITTEN_THROUGH_AN_ALIAS if through_alias else _WRITTEN_AFTER_REPLACED
                elif departures.left_unseen(captured):
                    reason = _LEFT_UNSEEN
            elif through_alias:
                continue  # a derived slot's memory a tracked path holds: the walk's answer stands
            elif slot.origin is Origin.ALIAS:  # a path to a parameter's memory
                if departures.written_since_left(captured):
                    reason = _WRITTEN_AFTER_REPLACED
            else:
                before = snapshot.versions[index] if index < len(snapshot.versions) else -1
                if before >= 0 and version_of(captured) != before:
                    reason = _WRITTEN_SINCE_LEFT
                else:  # no counter (an inference tensor), or a write through ``.data``/``set_``: every byte
                    witness = snapshot.witnesses.get(index)
                    entry = snapshot.freshness.get(index)
                    if witness is None and entry is not None and entry[0] is captured and sampled_whole(captured):
                        witness = entry[2]  # a small tensor's value sample, all of it (the snapshot took no other)
                    if witness is None:
                        reason = _UNWITNESSED
                    else:
                        asked.append((hit, witness, captured))
            if reason is not None:
                for key in hit:
                    written.setdefault(key, reason)
    if asked:
        for (hit, _, _), changed in zip(asked, changed_since([(w, t) for _, w, t in asked]), strict=True):
            if changed:
                for key in hit:
                    written.setdefault(key, _WRITTEN_SINCE_LEFT)
    return written


_WRITTEN_SINCE_LEFT = (
    "no path the contract walks holds it (a dict key, a table outside the model, a caller's reference), and it "
    "was written during the reload although the slot left it (a ping-pong holder writes it; so does a loader "
    "writing the slot in place before PWAL replaces it, which nothing tells apart)"
)


_UNWITNESSED = (
    "no path the contract walks holds it (a table outside the model), and nothing witnessed its bytes when the "
    "reload began (a layout no witness reads), so nothing tells a holder's write from none"
)


_WRITTEN_THROUGH_AN_ALIAS = (
    "another path of the model holds its memory (the tensor it is carved from, say) and wrote it after the module "
    "took a new tensor in its place: the new tensor's values would overwrite that path's; give the parameter "
    "memory of its own, or leave the memory it left alone"
)


_LEFT_UNSEEN = (
    "no path the contract walks holds it (a table outside the model), and it left its module with no registration "
    "of a new tensor in its place (del, = None, a write into module._parameters), so nothing tells the loader's "
    "write from a holder's after it; give the module its new tensor by assignment (module.name = new), or let go "
    "of the old one before the reload ends"
)


_WRITTEN_AFTER_REPLACED = (
    "no path the contract walks holds it (a table outside the model), and it was written after the module took "
    "another tensor in its place (a loader writes a parameter before that, not after)"
)


@dataclass(frozen=True, slots=True)
class Keeper:
    """A path a restore step leaves on a tensor other than its captured one as sealed (respecified, its copy taken
    back): the memory that tensor reads, and the memory the slot read at the seal."""

    layer: nn.Module
    slot: SealedSlot
    tensor: torch.Tensor
    reads: Mapping[Any, tuple[list[int], list[int]]]  # (:func:`._memory._sorted_ranges`, asked by ``_hits``)
    sealed: Mapping[Any, tuple[list[int], list[int]]]
    ref: str


def keepers(snapshot: LayerSnapshot, skip: Container[int]) -> Iterator[Keeper]:
    """The paths of ``snapshot`` (but ``skip``) that hold a tensor other than their captured one as sealed."""
    layer = snapshot.layer
    for index, slot in enumerate(snapshot.slots):
        if index in skip:
            continue
        current = slot.get(layer)
        if not isinstance(current, torch.Tensor):
            continue
        captured = snapshot.captured[index]
        if current is captured and not slot.wrapped and current.data_ptr() == slot.fp.data_ptr:
            continue  # on its captured memory: it reads what it read at the seal
        reads = _ranges(current)
        if reads:
            sealed = _ranges(captured) if slot.wrapped and captured is not None else _sealed_range(slot)
            ref = str(SlotRef(snapshot.sealed.qualname, slot.path.text))
            yield Keeper(layer, slot, current, _sorted_ranges(reads), _sorted_ranges(sealed), ref)


def new_ties(
    work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]], plan: RestorePlan, earlier: Iterable[Keeper]
) -> dict[tuple[int, int], str]:
    """The moves whose copy lands on memory a path keeps reading as its new tensor (a path of the step not rebound,
    or one an earlier ``after_layer()`` left so: ``earlier``), where the seal had that path elsewhere ((id(snapshot),
    slot index) -> why). PWAL moved the captured tensor there (a rotation) and that path keeps it (respecified,
    say): copying and binding back would leave two paths on memory the model never shared, so the next in-place
    write through either changes both. A copy of equal values passes every value check, so the tie is refused by
    address (another storage object on the same bytes, an import, too), before any copy."""
    found = [k for snapshot, rebinds in work for k in keepers(snapshot, {index for index, _ in rebinds})]
    found.extend(k for k in earlier if k.slot.get(k.layer) is k.tensor)
    if not found:
        return {}
    reasons: dict[tuple[int, int], str] = {}
    for move in plan.moves:
        dst = move.memory
        for keeper in found:
            if _hits(keeper.reads, dst) and not _hits(keeper.sealed, dst):
                reasons.setdefault(
                    (id(move.snapshot), move.index),
                    f"its captured memory is what {keeper.ref} now reads as its new tensor (PWAL moved it there), "
                    "and binding it back here would tie the two paths",
                )
                break
    return reasons


def _ranges(tensor: torch.Tensor) -> tuple[tuple[Any, int, int], ...]:
    """``(device, first address, end)`` of the bytes ``tensor`` reads (a wrapper's inner tensors'); none for a
    tensor without memory of its own (sparse, meta, empty)."""
    found: list[tuple[Any, int, int]] = []
    for part in memory_tensors(tensor):
        try:
            memory = _memory(part)
        except (RuntimeError, NotImplementedError):
            continue
        if memory is not None:
            found.append(memory)
    return tuple(found)


def _sealed_range(slot: SealedSlot) -> tuple[tuple[Any, int, int], ...]:
    start, end = slot.span
    fp = slot.fp
    return ((fp.device, fp.storage_ptr + start, fp.storage_ptr + end),) if end > start else ()


def _take_back(
    self: ReloadTransaction,
    work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]],
    plan: RestorePlan,
    reasons: dict[tuple[int, int], str],
) -> list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]]:
    """Take back every planned copy of the slots in ``reasons`` ((id(snapshot), slot index) -> why): nothing is
    written into their captured memory, each keeps its new tensor and is ``alias-broken``. A slot is restored
    whole or not at all (a wrapper's inner copies go together)."""
    blocked = [move for move in plan.moves if (id(move.snapshot), move.index) in reasons]
    plan.moves = [move for move in plan.moves if (id(move.snapshot), move.index) not in reasons]
    reported: set[tuple[int, int]] = set()
    for move in blocked:
        entry = (id(move.snapshot), move.index)
        if entry in reported:
            continue
        reported.add(entry)
        snapshot, slot = move.snapshot, move.snapshot.slots[move.index]
        snapshot.kept.append(move.new)
        snapshot.findings.append(
            snapshot.sealed.finding(
                FindingKind.ALIAS_BROKEN,
                slot,
                after=fingerprint(move.new),
                detail=f"PWAL gave it a new tensor, and {reasons[entry]}. Restoring would write this slot's new "
                "values where something else reads them, so nothing is copied and the graph reads the old "
                "values there. Rebuild the holder as a new tensor in PWAL (or declare it); recapture",
            )
        )
    return [
        (snapshot, [(index, t) for index, t in rebinds if (id(snapshot), index) not in reported])
        for snapshot, rebinds in work
    ]


def _doubt_abandoned(
    self: ReloadTransaction, work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]], plan: RestorePlan
) -> None:
    """Memory a slot left for a new tensor no copy restored there (respecified, moved and kept, vanished, or
    read another way) is *abandoned*: the slot's new values are not in it. A path left on it stays on old
    values, and so would a recapture (``stale``):

    * an alias path (a walker path, or an untracked manifest path, reading a tracked slot's memory) follows
      its slot, so it is stale whatever its values;
    * a watched slot (declared derived, or found by the walker) that nothing wrote is stale when its inputs,
      or the abandoning slot's, changed (a tie to another layer's rebuilt tensor), or when an earlier
      ``after_layer()`` saw that memory abandoned (PWAL may have written it before this layer's snapshot).
    """
    abandoned = self._abandoned
    copied: list[tuple[str, int, int]] | None = None  # the copies by address, sorted once where first asked
    for snapshot, _ in work:
        layer = snapshot.layer
        confirmed = snapshot.confirmed
        # (all confirmed: verify saw every slot's captured object at its path, on its captured memory)
        for index, slot in enumerate(snapshot.slots if not all(confirmed) else ()):
            captured = snapshot.captured[index]
            if captured is None or slot.watch_only or slot.wrapped:
                continue
            if confirmed[index]:
                continue  # verify just saw the captured object at its path, on its captured memory
            fp = slot.fp
            if captured.data_ptr() != fp.data_ptr:  # the captured object itself moved (.data =, set_)
                abandoned.append((snapshot, index, str(fp.device), fp.data_ptr, fp.data_ptr + fp.nbytes))
            elif not reads_as_captured(slot.get(layer), captured):
                device, start, end = address_range(captured)
                if copied is None:
                    copied = sorted((str(m.memory[0]), m.memory[1], m.memory[2]) for m in plan.moves)
                spans = [(first, last) for where, first, last in copied if where == device]
                if slot.origin is Origin.ALIAS and not _gaps(start, end, spans):
                    continue  # an alias path that left memory its slot's copy rewrote: nothing is left old
                abandoned.append((snapshot, index, device, start, end))
        if snapshot.gone:
            abandoned.extend((snapshot, *entry) for entry in snapshot.gone)
    if not abandoned:
        return
    for snapshot, _ in work:
        layer = snapshot.layer
        for index, slot in enumerate(snapshot.slots):
            captured = snapshot.captured[index]
            if captured is None or slot.wrapped or not reads_as_captured(slot.get(layer), captured):
                continue
            alias = slot.origin is Origin.ALIAS
            if not alias and not (slot.tracks_freshness and index in snapshot.freshness):
                continue
            device, start, end = address_range(captured)
            partners = [
                (owner, at)
                for owner, at, where, first, last in abandoned
                if (owner, at) != (snapshot, index)
                and where == device
                # an empty span (a tail of nothing) still marks where its slot's memory was
                and ((first < end and start < last) or (first == last and start <= first <= end))
            ]
            if not partners:
                continue
            if alias:
                why = "it does not read that slot's new values, and neither would a recapture"
            else:
                # A captured tensor without a version counter (made under torch.inference_mode()) cannot show
                # that PWAL wrote it: it counts as unwritten, so changed inputs make it stale (fail closed).
                if index >= len(snapshot.written) or snapshot.written[index]:
                    continue  # written by PWAL: its own values
                if not snapshot.left[index]:
                    continue  # PWAL gave it a new tensor, which the restore copied: its new values
                changed = snapshot.changed_inputs(index)
                for owner, at in partners:
                    changed = changed or owner.changed_inputs(at)
                if changed:
                    why = f"nothing wrote it although {', '.join(changed)} changed, and a recapture would read it"
                elif any(owner.done for owner, _ in partners):
                    # Abandoned by an earlier after_layer(): PWAL may have written other values there (a swap)
                    # before this layer's snapshot, which then cannot vouch for its bytes. Fail closed.
                    why = "an earlier after_layer() saw it abandoned, so nothing here can vouch for its bytes"
                else:
                    continue
            snapshot.findings.append(
                snapshot.sealed.finding(
                    FindingKind.STALE,
                    slot,
                    detail=f"it reads the captured memory of a slot that now holds a new tensor no copy could "
                    f"restore there: {why}. Rebuild it in PWAL from that slot's new tensor",
                )
            )


def _protect_pending(self: ReloadTransaction, plan: RestorePlan, group: list[LayerSnapshot]) -> list[torch.Tensor]:
    """Layers snapshotted but not restored yet (``before_layer`` ran, ``after_layer`` has not): a new tensor of
    theirs that reads memory this plan writes is cloned first, so their restore copies the values PWAL left.
    One no copy can restore (another geometry, class or offset: it stays at its path) is returned, to be kept
    by the plan as a reader of that memory like this step's own kept tensors. Costs a path lookup per slot of
    such layers, which a plain ``before_layer``/``after_layer`` pairing has none of."""
    readers: list[torch.Tensor] = []
    migrate = self.contract.mode == "migrate"  # the restore's auto_restore
    in_group = {id(snapshot) for snapshot in group}
    tensor_type = torch.Tensor
    for snapshot in self._snapshots.values():
        if snapshot.done or id(snapshot) in in_group:
            continue
        layer = snapshot.layer
        for index, slot in enumerate(snapshot.slots):
            captured = snapshot.captured[index]
            if captured is None:
                continue
            current = slot.get(layer)
            if not isinstance(current, tensor_type) or current is captured:
                continue
            saved = snapshot.overrides.get(index)
            if saved is not None and saved[0] is current:
                continue
            try:
                parts = memory_tensors(current)  # a wrapper's memory is its inner tensors'
            except TypeError:
                continue  # no tensors to read: its restore says why
            if any(plan.overlaps_destination(part) for part in parts):
                snapshot.overrides[index] = (current, tuple(clone_laid_out(part) for part in parts))
                if (slot.origin is Origin.WALKER and (not migrate or not slot.restorable)) or (
                    len(parts) == 1
                    and parts[0] is current
                    and (
                        geometry_key(current) != geometry_key(captured)
                        or current.storage_offset() != captured.storage_offset()
                    )
                ):
                    # Its restore will leave it at its path (undeclared and not auto-restored: moved; or
                    # respecified), reading what this plan writes there.
                    readers.append(current)
    return readers


def _manifest_extras(self: ReloadTransaction, sealed: SealedLayer) -> list[SealedSlot]:
    """Under ``detect="declared-only"`` or ``"sealed-paths"`` with a capture manifest: the layer's paths the
    manifest saw holding a captured storage that no sealed slot tracks (a tensor that appeared after the seal,
    under ``sealed-paths``), as watch-only walker-found slots.

    The graph reads them, so their freshness is judged like the walker's finds (stale when the weights changed
    and PWAL left them as they were, until a recording shows PWAL never computes them) instead of being
    trusted as static. They are never restored: where PWAL moved one, the manifest's check reports it. A path
    whose storage a tracked slot also reads (a view of a declared slot) stays a reader of that slot's memory.
    """
    contract = self.contract
    if contract.manifest is None:
        return []
    if self._held is None:  # resolved once, at the first snapshot: before any layer of this reload loads
        self._held = {}
        sealed_names = {s.qualname for s in contract._layers}
        for name, path, tensor in contract.manifest.held(contract):
            qualname = self._sealed_name(name)
            if (qualname, path) not in contract._slot_keys:
                # A module no seal tracks (a child with no weights of its own) is watched from the nearest
                # sealed module above it, by the longer path.
                owner, prefix = qualname, ""
                while owner not in sealed_names and owner:
                    owner, _, last = owner.rpartition(".")
                    prefix = f"{last}.{prefix}"
                if owner in sealed_names:
                    self._held.setdefault(owner, []).append((prefix + path, tensor))
                self._held_before[(qualname, path)] = (id(tensor), version_of(tensor), tensor.data_ptr())
    found = self._held.pop(sealed.qualname, None)  # the snapshot holds them from here
    if contract.detect == "every-reload":
        return []  # its walk finds them
    if not found:
        return []
    tracked = {id(part.storage_ref()) for slot in sealed.slots for part in slot.fp.memory()}
    extras: list[SealedSlot] = []
    for path, tensor in found:
        # One that reads a tracked slot's memory follows that slot like an alias path (see
        # _untracked_holders and _doubt_abandoned); any other is watched like a walker find.
        origin = Origin.ALIAS if id(tensor.untyped_storage()) in tracked else Origin.WALKER
        key = (sealed.qualname, path)
        slot = contract._manifest_slots.get(key)
        if slot is None or not slot.tensor_ref.holds(tensor) or slot.origin is not origin:
            slot = SealedSlot(SlotPath(path), fingerprint(tensor), TensorRef.of(tensor), origin)
            if key in contract._recorded_extras:  # a recording saw PWAL run over this path (before a reseal)
                slot.inputs = contract._recorded_extras[key]
            else:
                slot.unrecorded = True  # no recording saw PWAL over it (see _sealed_slot)
            slot.watch_only = True
            # Watched even as an alias path: the copy into its slot's memory (or its slot's own write) changes
            # its values, so only a path nothing refreshed looks stale; its slot may be empty or gone.
            slot.tracks_freshness = True
            contract._manifest_slots[key] = slot
        extras.append(slot)
    return extras


def _sealed_name(self: ReloadTransaction, qualname: str) -> str:
    """``qualname`` as its module was sealed: a shared submodule's other name (``twin`` for ``layers.0``, and what
    lies under it) is the name it is sealed under, so the manifest's holders there are its slots' paths."""
    if self._aliases is None:
        self._aliases = {
            ".".join(atoms): sealed.qualname
            for sealed in self.contract._layers
            if (layer := sealed.layer_ref()) is not None
            for atoms in self.contract._also.get(id(layer), ())
        }
    for alias, primary in self._aliases.items():
        if qualname == alias or qualname.startswith(alias + "."):
            return primary + qualname[len(alias) :]
    return qualname


def _untracked_holders(self: ReloadTransaction, local: list[LayerSnapshot]) -> list[torch.Tensor]:
    """What the model holds now at the paths the capture-time manifest saw holding captured storage and the
    contract does not track (``detect="declared-only"`` seals declared slots only): a restore must not
    overwrite what those paths read (PWAL may have handed them a captured storage, a swap)."""
    manifest = self.contract.manifest
    if manifest is None:
        return []
    tracked = self.contract._slot_keys
    extra = {(s.sealed.qualname, slot.path.text) for s in local for slot in s.slots[len(s.sealed.slots) :]}
    before = self._held_before
    held = [(self._sealed_name(name), path, tensor) for name, path, tensor in manifest.held(self.contract)]
    return [
        tensor
        for layer, path, tensor in held
        if (layer, path) not in tracked
        and (layer, path) not in extra
        # The same tensor, unwritten: a view left on the memory it read follows it, like an alias path
        # (its old bytes are no values of its own; the cold model reads its partner's new ones there).
        and before.get((layer, path)) != (id(tensor), version_of(tensor), tensor.data_ptr())
    ]


def _changed_inputs(self: ReloadTransaction, sealed: SealedLayer, position: int) -> list[str]:
    """The freshness inputs of a slot that this reload changed (its layer's snapshot watched them)."""
    snapshot = self._snapshots.get(id(sealed))
    return snapshot.changed_inputs(position) if snapshot is not None else []


def _version_of(self: ReloadTransaction, sealed: SealedLayer, position: int) -> int | None:
    """The captured tensor's version counter when the reload began, where its snapshot kept one."""
    snapshot = self._snapshots.get(id(sealed))
    if snapshot is not None and position < len(snapshot.versions):
        return snapshot.versions[position]
    return None


def _captured_of(self: ReloadTransaction, sealed: SealedLayer, position: int) -> torch.Tensor | None:
    """The captured tensor of a sealed slot: its snapshot's strong reference, else from the seal."""
    snapshot = self._snapshots.get(id(sealed))
    if snapshot is not None and position < len(snapshot.captured):
        held = snapshot.captured[position]
        if held is not None:
            return held
    return sealed.slots[position].captured()
