"""Which copies of a restore step landed on a recorded byte range (:class:`_Landing`), and the byte-range helpers
the manifest's per-reload check and the foreign-holder rules read."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe.contract._memory import address_range
from graphsafe.errors import hide_frames_in_pytest

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

__all__: list[str] = []


def _overlapping(spans: list[tuple[str, int, int, int]], tensor: torch.Tensor) -> list[int]:
    """The keys of ``spans`` (device, first address, end, key) whose memory ``tensor`` reads any byte of."""
    if not tensor.numel():
        return []
    device, start, end = address_range(tensor)
    return [key for where, first, last, key in spans if where == device and first < end and start < last]


class _Landing:
    """The copies of a step by address, to ask which landed on a range: per device, sorted by first address with the
    running maximum of their ends, so a question costs a search and the copies it finds (not a pass over all)."""

    def __init__(self, written: Sequence[tuple[str, int, int, Any]]) -> None:
        by_device: dict[str, list[tuple[int, int, int, Any]]] = {}
        for position, (device, start, end, move) in enumerate(written):
            by_device.setdefault(device, []).append((start, end, position, move))
        self._on: dict[str, tuple[list[int], list[int], list[tuple[int, int, int, Any]]]] = {}
        for device, items in by_device.items():
            items.sort(key=lambda item: (item[0], item[2]))
            furthest: list[int] = []
            reach = -1
            for _, end, _, _ in items:
                reach = max(reach, end)
                furthest.append(reach)
            self._on[device] = ([item[0] for item in items], furthest, items)

    def on(self, device: str, first: int, end: int) -> list[Any]:
        """The copies on ``device`` whose ``[start, end)`` overlaps ``[first, end)``, in the order written."""
        found = self._on.get(device)
        if found is None:
            return []
        starts, furthest, items = found
        hits: list[tuple[int, Any]] = []
        index = bisect.bisect_left(starts, end) - 1  # every copy from here back starts before ``end``
        while index >= 0 and furthest[index] > first:
            _, stop, position, move = items[index]
            if stop > first:
                hits.append((position, move))
            index -= 1
        hits.sort(key=lambda hit: hit[0])
        return [move for _, move in hits]


def _gaps(first: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[first, end)`` that no span of ``spans`` (sorted by start) covers."""
    gaps: list[tuple[int, int]] = []
    at = first
    for start, stop in spans:
        if at >= end:
            break
        if start > at:
            gaps.append((at, min(start, end)))
        at = max(at, stop)
    if at < end:
        gaps.append((at, end))
    return gaps


class _Covered:
    """Spans sorted by start with the running maximum of their ends: the parts of a range no span covers are found
    by one search and a walk over the spans that start inside the range (not a pass over all of them)."""

    def __init__(self, spans: Iterable[tuple[int, int]]) -> None:
        self.spans = sorted(span for span in spans if span[1] > span[0])  # an empty span covers nothing
        self.starts = [start for start, _ in self.spans]
        self.furthest: list[int] = []
        reach = -1
        for _, stop in self.spans:
            reach = max(reach, stop)
            self.furthest.append(reach)

    def gaps(self, first: int, end: int) -> list[tuple[int, int]]:
        """:func:`_gaps` of ``[first, end)``: the spans starting at or before ``first`` only move its start on."""
        below = bisect.bisect_right(self.starts, first)
        at = max(first, self.furthest[below - 1]) if below else first
        return _gaps(at, end, self.spans[below:]) if at < end else []


def _covered_on(covered: Iterable[tuple[str, int, int]]) -> dict[str, _Covered]:
    """Per device, the address spans ``(device, first, end)`` as a :class:`_Covered` (empty spans left out)."""
    spans_on: dict[str, list[tuple[int, int]]] = {}
    for where, start, stop in covered:
        if stop > start:
            spans_on.setdefault(where, []).append((start, stop))
    return {device: _Covered(spans) for device, spans in spans_on.items()}


def _fills_span(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements occupy every byte of its address span (a broadcast dimension repeats bytes
    and leaves none out): dense once dimensions of size 1 or stride 0 are set aside."""
    if tensor.is_contiguous() and tensor.numel() and not tensor.is_nested:
        return True  # row-major dense: every dimension's stride the product of the sizes after it (one call)
    dims = sorted(
        (stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1 and stride
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected = stride * size
    return True


def _same_as_new(storage: Any, lo: int, hi: int, moves: Iterable[Any]) -> bool:
    """Whether bytes ``[lo, hi)`` of the captured ``storage`` equal the bytes at the same offsets of the one new
    storage every move into it copied from (each new tensor at its captured tensor's offset): the buffer PWAL
    packed the slots in. Several new storages, or none, and the bytes are not known to be fresh."""
    if storage is None:
        return False
    sources: dict[int, Any] = {}
    for move in moves:
        new = move.new
        if type(new) not in (torch.Tensor, nn.Parameter) or new.storage_offset() != move.dst.storage_offset():
            return False  # laid out elsewhere: its bytes say nothing about these offsets
        source = new.untyped_storage()
        sources[id(source)] = source
    if len(sources) != 1:
        return False  # the slots on the captured storage came from several new storages: none of them is the buffer
    (source,) = sources.values()
    if source.nbytes() < hi or source.device != storage.device:
        return False
    old = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[lo:hi]
    return torch.equal(torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)[lo:hi], old)
