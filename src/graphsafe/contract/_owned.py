"""Captured memory that belongs to something besides the slot: copies into it are taken back.

A restore copies a moved slot's new values into its captured memory. Two kinds of owner can still use that memory
without the contract seeing them as holders, and the copy would write values the reload never produced for them:

* an **import**: the captured storage does not own its bytes (``torch.from_dlpack``, ``from_numpy``,
  ``frombuffer``, ``from_blob``: torch makes such a storage not resizable). Its owner (an arena, an extension's
  buffer) is no tensor the contract tracks, and no walk reaches through a DLPack capsule or a numpy base. Where no
  other tracked storage covers the bytes (that is a tie or a carve of a weight, judged elsewhere), a copy into it is
  taken back (``alias-broken``: declare the owner, or write the slot's new values in place).
* a **holder tracked as an alias**: a walker path on a derived slot's bytes (an arena, ``self.arena`` with
  ``self.a = self.arena[:4]`` declared; a pool row, ``self.pools[0]`` with ``self.cur = self.pools[0][0]``) is
  sealed as an alias of that slot, and an alias follows its slot. When PWAL gives the slot a new tensor while the
  alias path still holds its captured tensor and that memory was written in place during the reload (its version
  counter moved: a ping-pong spare, an arena reused), the alias is a holder with values of its own: the copy is
  taken back; except where another slot took that memory as its new tensor (PWAL permuted the captured tensors:
  a swap, a rotation), whose own copy restores the values written there.

Both are found at seal (:func:`owned_memory`); a contract with neither pays nothing per reload (the fast tier is
kept; :func:`take_back_reasons` runs only when the seal found one), and one with either pays a dict lookup per
planned copy, and one path read per such arena alias.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphsafe.contract._samples import version_of
from graphsafe.outcome import Origin, storage_ids

if TYPE_CHECKING:
    from graphsafe.contract._slots import SealedLayer

__all__ = ["OwnedMemory", "owned_memory", "take_back_reasons"]

_LOADED = (Origin.PARAMETER, Origin.BUFFER)
Entry = tuple["SealedLayer", int]

_IMPORTED = (
    "its captured memory belongs to another object (an import through DLPack, from_numpy or frombuffer: its "
    "storage does not own its bytes) that the contract does not track and that may still use it; declare that "
    "owner, or write the new values in place"
)


@dataclass(frozen=True, slots=True)
class OwnedMemory:
    """What the seal found: slots on imported memory, and derived slots with an alias path on their bytes."""

    #: ``(id(sealed layer), slot index)`` of derived slots whose captured storage is an import no tracked storage
    #: covers.
    imported: frozenset[tuple[int, int]]
    #: ``(id(sealed layer), slot index)`` of a derived slot -> the alias slots on its captured bytes.
    arenas: Mapping[tuple[int, int], tuple[Entry, ...]]


def owned_memory(
    readers: Mapping[int, Sequence[Entry]], storages: Mapping[int, Any], sharing: Iterable[tuple[int, int]]
) -> OwnedMemory | None:
    """From the seal's index (storage id -> the slots reading it; storage id -> storage; pairs of storage ids on
    overlapping memory): what :class:`OwnedMemory` describes, or ``None`` when there is nothing."""
    covered = {key for pair in sharing for key in pair}
    imported = frozenset(
        (id(sealed), index)
        for key, entries in readers.items()
        if key not in covered and not storages[key].resizable()
        for sealed, index in entries
        if sealed.slots[index].origin not in _LOADED
        and sealed.slots[index].origin is not Origin.ALIAS
        and not sealed.slots[index].wrapped
    )
    arenas: dict[tuple[int, int], list[Entry]] = {}
    for entries in readers.values():
        if len(entries) < 2:
            continue
        aliases = [(s, i) for s, i in entries if s.slots[i].origin is Origin.ALIAS and not s.slots[i].wrapped]
        for sealed, index in entries:
            slot = sealed.slots[index]
            if slot.origin in _LOADED or slot.origin is Origin.ALIAS or slot.wrapped:
                continue
            start, end = slot.span
            for other, position in aliases:
                first, last = other.slots[position].span
                if first < end and start < last:
                    arenas.setdefault((id(sealed), index), []).append((other, position))
    if not imported and not arenas:
        return None
    return OwnedMemory(imported, {key: tuple(found) for key, found in arenas.items()})


def take_back_reasons(
    owned: OwnedMemory,
    moves: Iterable[Any],
    captured_of: Callable[[SealedLayer, int], torch.Tensor | None],
    version_at_begin: Callable[[SealedLayer, int], int | None],
) -> dict[tuple[int, int], str]:
    """``(id(snapshot), slot index)`` -> why, for each planned copy (a ``_Move``) into memory an owner may use."""
    reasons: dict[tuple[int, int], str] = {}
    moves = list(moves)
    # Storages another slot took as its new tensor (PWAL permuted the captured tensors: a swap, a rotation): a write
    # there is that slot's new values, which its own copy restores, not an owner's. (The moves hold the tensors, so
    # the ids name live storages.)
    taken = {key for move in moves for key in _storage_ids(move.new)}
    for move in moves:
        key = (id(move.snapshot.sealed), move.index)
        if key in owned.imported:
            reasons[(id(move.snapshot), move.index)] = _IMPORTED
            continue
        for sealed, position in owned.arenas.get(key, ()):
            alias, layer = sealed.slots[position], sealed.layer_ref()
            captured, before = captured_of(sealed, position), version_at_begin(sealed, position)
            if captured is None or layer is None or before is None or before < 0:
                continue
            if not taken.isdisjoint(_storage_ids(captured)):
                continue
            if alias.get(layer) is captured and version_of(captured) != before:
                where = f"{sealed.qualname}.{alias.path.text}" if sealed.qualname else alias.path.text
                reasons[(id(move.snapshot), move.index)] = (
                    f"{where!r}, a tensor on its memory (tracked as its alias: an arena, a pool), was written "
                    "during the reload and would lose those values; declare it, or write the slot's new values in "
                    "place"
                )
                break
    return reasons


def _storage_ids(tensor: torch.Tensor) -> set[int]:
    """:func:`~graphsafe.outcome.storage_ids` as a set; none where the tensor has no storage to name."""
    try:
        return set(storage_ids(tensor))
    except (TypeError, RuntimeError, NotImplementedError):
        return set()
