"""Restoring one layer's slots after the load (``LayerSnapshot.restore``): which slots keep their captured tensor
(a copy into it, in place, or nothing to do), which are left to the fast tier or to a rebind, and which are a
finding. Functions of a :class:`~graphsafe.contract._snapshot.LayerSnapshot`, bound there as its methods."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from graphsafe.contract._attributes import _LOADED
from graphsafe.contract._copy import copy_group
from graphsafe.contract._memory import (
    _NOTHING,
    _memory_lost,
    address_range,
    held_outside,
    reads_as_captured,
    repointed_inference,
    storage_covers,
)
from graphsafe.contract._plan import RestorePlan
from graphsafe.contract._samples import version_of
from graphsafe.contract._slots import _MISSING, SealedSlot, _describe_geometry_change, _is_wrapper, _leaf_names, _view
from graphsafe.outcome import Finding, FindingKind, Origin, fingerprint, geometry_key, memory_tensors

if TYPE_CHECKING:
    from graphsafe.contract._snapshot import LayerSnapshot

__all__: list[str] = []


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


def restore(self: LayerSnapshot, *, auto_restore: bool, plan: RestorePlan) -> list[tuple[int, torch.Tensor]]:
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
            if slot.wrapped or _is_wrapper(current):
                # A wrapper owns no storage: its inner tensors' memory is what the graph reads.
                problem = self._wrapper_pairs(slot, captured, current) if isinstance(current, tensor_type) else []
                if not problem and isinstance(current, tensor_type):
                    if index in freshness:
                        self._note_fresh(index, slot, current)
                    continue  # every inner tensor in place
                if isinstance(problem, Finding):
                    self.findings.append(problem)
                    continue
            elif (
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
            if (
                isinstance(current, tensor_type)
                and not (slot.wrapped or _is_wrapper(current))
                and current.untyped_storage() is captured.untyped_storage()
            ):
                # Moved within its captured storage (an arena's other half): the storage is still held, so the
                # manifest's check (storage identity) is satisfied, while the graph reads the bytes it left.
                self._respecified(slot, current, "moved within its captured storage: ")
                continue
            if isinstance(current, tensor_type):
                self.kept.append(current)  # its new values: no copy may overwrite what it reads
            # Moved or gone: its memory is abandoned (see the contract's _doubt_abandoned). Let go of the
            # captured tensor: where nothing else holds it, the manifest must see it freed.
            self.gone.extend((index, *address_range(part)) for part in memory_tensors(captured))
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
                self.findings.append(sealed.finding(FindingKind.MOVED, slot, after=fingerprint(current), detail=why))
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
    self: LayerSnapshot, slot: SealedSlot, captured: torch.Tensor, current: torch.Tensor
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


def _note_fresh(self: LayerSnapshot, index: int, slot: SealedSlot, current: torch.Tensor) -> None:
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
