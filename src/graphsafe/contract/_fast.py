"""The fast tier of a restore step: the common reload planned in one lean pass, or "cannot decide".

A whole-model restore usually finds every slot either in place (the captured object at its path: parameters a
loader copied into, scratch PWAL reused) or rebuilt by PWAL as a new plain tensor laid out exactly as sealed, on
memory no other slot reads. For such a step the rule engine (:meth:`LayerSnapshot.restore` and the checks of
:class:`RestorePlan`: order, aliasing, foreign holders, crossing storages) has nothing to find, yet pays its
per-slot generality on every reload. :func:`plan_common` recognises that step and plans it as the rule engine
would, with the same side effects on the snapshots (what is noted for freshness, which slots were left in place,
what is rebound, what is swapped) and the same moves; the copies then go through the same batch.

It decides nothing itself and never guesses: every condition under which a rule of the engine could act is a
reason to answer ``None`` ("cannot decide"), before anything was written or noted, and the caller runs the rule
engine on the whole step. The differential test (``tests/fuzz``: every generated reload through both tiers) holds
the two to one verdict and the same bytes.

What it reads per reload: one path lookup, one identity check and, for a rebuilt slot, the new tensor's layout
tuple, storage, offset and reference counts; the sealed layout, span and copy group come from the seal.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe.contract._memory import _STORAGE_USE_COUNT, _hits, _sorted_ranges, repointed_inference
from graphsafe.contract._plan import RestorePlan, SharedIndex, _Move
from graphsafe.contract._slots import SealedLayer, _view
from graphsafe.contract._snapshot import LayerSnapshot
from graphsafe.outcome import Origin, geometry_key

__all__ = ["Rebinds", "plan_common", "step_conditions"]

#: Per snapshot of the step: the snapshot and its rebinds ``(slot index, captured tensor)``.
Rebinds = list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]]

_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
_RULED_ORIGINS = (Origin.WALKER, Origin.ALIAS)  # migrate's auto-restore, alias paths: the rule engine's


def plan_common(
    group: Sequence[LayerSnapshot],
    plan: RestorePlan,
    *,
    shared: SharedIndex,
    still_in_model: Callable[[SealedLayer, nn.Module], bool],
) -> Rebinds | None:
    """Plan ``group``'s restore into the empty ``plan`` as :meth:`LayerSnapshot.restore` would, or return ``None``
    (nothing noted, planned or written) where a rule of the engine could act. The caller has checked the step-wide
    conditions (whole model, no skip, no crossing storages, no byte ranges, nothing kept or abandoned before)."""
    # Pass 1, read-only: classify every slot; any doubt hands the whole step over.
    work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor, bool]]]] = []
    in_place_layers: list[LayerSnapshot] = []
    moves: list[_Move] = []
    for snapshot in group:
        sealed = snapshot.sealed
        if snapshot.findings or snapshot.overrides or len(snapshot.slots) != len(sealed.slots):
            return None  # (walker extras make a snapshot longer than its seal: the engine's)
        if not still_in_model(sealed, snapshot.layer):
            return None
        if snapshot.in_place():
            in_place_layers.append(snapshot)
            continue
        classified = _classify(snapshot, shared, moves)
        if classified is None:
            return None
        work.append((snapshot, *classified))
    # Order: no source may read bytes a copy writes (a swap, a rotation, a view into another slot's memory, by
    # storage object or by address). The engine would clone such sources first; here it is a reason to hand over.
    if moves:
        written = {move.storage for move in moves}
        if any(move.src_storage in written for move in moves):
            return None
        if not _only_writers(moves, shared) or not _held_only_by_step(moves, group, work):
            return None
        ranges = _sorted_ranges(move.memory for move in moves)
        sources: set[int | None] = set()
        for move in moves:  # by each source's whole storage: a superset of what it reads, one look per storage
            if move.src_storage in sources:
                continue
            sources.add(move.src_storage)
            storage = move.src.untyped_storage()
            start = storage.data_ptr()
            if start and _hits(ranges, (move.src.device, start, start + storage.nbytes())):
                return None
        plan.moves = moves
        # Copies writing overlapping memory under two storage objects (the engine takes them back): only where any
        # two destinations overlap at all, which the sorted ranges show in one pass.
        if _any_overlap(ranges) and plan.crossing():
            plan.moves = []
            return None
    # Pass 2: what the engine's restore leaves on each snapshot.
    for snapshot in in_place_layers:
        snapshot.confirmed = [True] * len(snapshot.slots)
    for move in moves:
        spans = plan._dst_spans.get(move.storage)
        if spans is None:
            spans = plan._dst_spans[move.storage] = []
        spans.append(move.snapshot.slots[move.index].span)
        move.snapshot.swapped[move.index] = move.new
    result: Rebinds = []
    for snapshot, rebinds, stayed in work:
        for index, current, fresh in stayed:
            if fresh:
                snapshot._note_fresh(index, snapshot.slots[index], current)
            if current.__dict__:
                snapshot.attributed.append(current)
        left = [False] * len(snapshot.slots)
        for index, _, _ in stayed:
            left[index] = True
        snapshot.left = left
        result.append((snapshot, rebinds))
    return result


def _classify(
    snapshot: LayerSnapshot, shared: SharedIndex, moves: list[_Move]
) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor, bool]]] | None:
    """One layer's slots: the rebinds and the slots left in place, with its copies appended to ``moves``; ``None``
    where a rule of the engine could act. A (captured, new) pair repeated within the layer is copied once, as the
    engine does. (A function of its own so that none of its locals outlives it: the
    holder look counts references.)

    The layout of the new and of the captured tensor is compared field by field with the sealed one (what
    :func:`_view` builds, without the tuple): the sealed slot is a plain, unquantized tensor (a quantized or nested
    one is the engine's), so a new tensor of its dtype is one too."""
    layer = snapshot.layer
    freshness = snapshot.freshness
    rebinds: list[tuple[int, torch.Tensor]] = []
    seen_pairs: set[tuple[int, int]] = set()
    stayed: list[tuple[int, torch.Tensor, bool]] = []  # (index, tensor at the path, noted for freshness)
    strided = torch.strided
    append_move = moves.append
    for index, (slot, captured) in enumerate(zip(snapshot.slots, snapshot.captured, strict=True)):
        if captured is None or slot.watch_only or slot.wrapped or slot.origin in _RULED_ORIGINS:
            return None
        current = slot.get(layer)
        if current is captured:
            if index in freshness and repointed_inference(current):
                return None  # the engine's finding (LayerSnapshot._note_fresh)
            stayed.append((index, current, index in freshness))
            continue
        kind = type(current)
        if kind not in _PLAIN_TYPES or current.layout is not strided or current.is_nested:
            return None
        new_storage = current.untyped_storage()
        captured_storage = captured.untyped_storage()
        fp = slot.fp
        if new_storage is captured_storage:
            # Another Python object on the captured bytes, read exactly as captured (PWAL re-made the view): in
            # place, as the engine judges it. Read any other way, it is the engine's (respecified).
            if (
                current.data_ptr() != fp.data_ptr
                or _view(current) != _view(captured)
                or geometry_key(current) != geometry_key(captured)
            ):
                return None
            if index in freshness and repointed_inference(current):
                return None
            stayed.append((index, current, index in freshness))
            continue
        shape, stride, dtype, device, conj, neg, sealed_kind, quantized = slot.layout
        offset = fp.storage_offset
        if (
            quantized is not None
            or captured_storage is not fp.storage_ref()
            or current.dtype is not dtype
            or current.shape != shape
            or current.stride() != stride
            or current.storage_offset() != offset
            or current.device != device
            or kind is not sealed_kind
            or current.is_conj() is not conj
            or current.is_neg() is not neg
            or type(captured) is not sealed_kind
            or captured.dtype is not dtype
            or captured.shape != shape
            or captured.stride() != stride
            or captured.storage_offset() != offset
            or captured.is_conj() is not conj
            or captured.is_neg() is not neg
            or captured.data_ptr() != fp.data_ptr
            or (index in freshness and current.data_ptr() == fp.data_ptr)
            or captured_storage.nbytes() < slot.span[1]  # shrunk in place (laid out as sealed: the sealed span)
            or current.__dict__
            or captured.__dict__
        ):
            return None
        rebinds.append((index, captured))
        key = id(captured_storage)
        copy = True
        if key in shared:  # several slots read this storage: the engine copies a repeated pair once
            pair = (id(captured), id(current))
            copy = pair not in seen_pairs
            seen_pairs.add(pair)
        base = captured_storage.data_ptr()
        span = slot.span
        append_move(
            _Move(
                snapshot,
                index,
                captured,
                current,
                current,
                slot.group,
                slot.nbytes,
                copy,
                key,
                slot.plain,
                id(new_storage),
                (device, base + span[0], base + span[1]),
            )
        )
    return rebinds, stayed


def _any_overlap(ranges: dict[Any, tuple[list[int], list[int]]]) -> bool:
    """Whether two of the ranges :func:`_sorted_ranges` sorted share a byte: one starts before an earlier one ends."""
    for starts, furthest in ranges.values():
        for index in range(1, len(starts)):
            if starts[index] < furthest[index - 1]:
                return True
    return False


def _only_writers(moves: Sequence[_Move], shared: SharedIndex) -> bool:
    """Whether every storage several slots read is written by moves of this step alone, at disjoint bytes (or one
    pair repeated): then no slot is left reading it and every copy lands whole, so the engine's watch and check
    have nothing to find. Anything else (a slot left in place on it, two copies into the same bytes) is theirs."""
    by_storage: dict[int, list[_Move]] = {}
    for move in moves:
        if move.storage in shared:
            by_storage.setdefault(move.storage, []).append(move)
    for key, writers in by_storage.items():
        moving = {(id(move.snapshot.sealed), move.index) for move in writers}
        if any((id(sealed), position) not in moving for sealed, position in shared[key]):
            return False
        ends: list[tuple[int, int, int, int]] = sorted(
            (move.memory[1], move.memory[2], id(move.dst), id(move.new)) for move in writers
        )
        for (start, end, dst, new), (next_start, next_end, next_dst, next_new) in itertools.pairwise(ends):
            if next_start < end and not (
                dst == next_dst and new == next_new and (start, end) == (next_start, next_end)
            ):
                return False
    return True


def _held_only_by_step(moves: Sequence[_Move], group: Sequence[LayerSnapshot], work: Sequence[Any]) -> bool:
    """Whether nothing besides this step holds a captured tensor planned for a copy, its base or its storage: the
    engine's holder look (:func:`held_outside`), with the references of the whole step counted exactly (several
    slots can read one tensor or one storage). Where anything else holds one, the engine searches who."""
    own = _own_references(moves, group, work)
    refcount = sys.getrefcount
    users: dict[int, set[int]] = {}  # storage id -> the distinct tensors (captured, and their bases) on it
    storages: dict[int, Any] = {}
    checked: set[int] = set()
    for move in moves:
        dst = move.dst
        ident = id(dst)
        if ident in checked:
            continue
        checked.add(ident)
        # getrefcount's argument and this frame's local name ``dst`` are the two references beyond the step's.
        if refcount(dst) - 2 > own[ident]:
            return False
        key = move.storage
        tensors = users.get(key)
        if tensors is None:
            tensors = users[key] = set()
            storages[key] = dst.untyped_storage()
        tensors.add(ident)
        if dst._base is not None:  # (no local name for it: the engine's exact look, see held_outside)
            if id(dst._base) in own or refcount(dst._base) > 2:
                return False
            tensors.add(id(dst._base))
    del dst
    for key in storages:  # (not items(): its iterator's pair would be one more reference)
        storage = storages[key]
        # The storage's one Python object: this dict's entry, the local, the argument and torch's own.
        if refcount(storage) > 4:
            return False
        # One use per tensor on it and one for its Python object.
        if _STORAGE_USE_COUNT is not None and int(_STORAGE_USE_COUNT(storage._cdata)) > len(users[key]) + 1:
            return False
    return True


def _own_references(moves: Sequence[_Move], group: Sequence[LayerSnapshot], work: Sequence[Any]) -> Counter[int]:
    """id -> how many references the step itself holds to each captured tensor: the snapshots' lists, freshness
    entries, the planned rebinds (a tuple each), the moves and the transaction's table of captured objects. Counted
    with C-level iteration (``id(None)`` is counted too, harmlessly: no tensor has it). (Its own function: no loop
    name outlives it.)"""
    own: Counter[int] = Counter()
    tables: dict[int, dict[int, torch.Tensor]] = {}  # the transaction's table of captured objects: counted once
    for snapshot in group:
        own.update(map(id, snapshot.captured))
        own.update(map(id, map(_first, snapshot.freshness.values())))
        tables[id(snapshot.originals)] = snapshot.originals
    for _, rebinds, _ in work:
        own.update(map(id, map(_second, rebinds)))
    own.update(map(id, map(_destination, moves)))
    for table in tables.values():  # keyed by id: one more reference to each tensor the step already counts
        own.update(filter(own.__contains__, table))
    return own


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_destination = operator.attrgetter("dst")


def step_conditions(txn: Any) -> bool:
    """Whether a whole-model restore step of ``txn`` (a :class:`ReloadTransaction`) is one the fast tier may plan:
    the rule engine's step-wide rules (skipping unread slots, crossing storages, tensors kept or memory abandoned by
    earlier steps, layers still pending) have nothing to act on. (Byte ranges a manifest recorded are checked after
    the copies, by the same rule, either way.)"""
    contract = txn.contract
    if (
        not contract.fast_tier
        or txn.layerwise
        or contract.unread == "skip"
        or contract._cross
        or contract._owned is not None
    ):
        return False
    return not (txn._kept or txn._abandoned or txn._moved or txn._closed)
