"""The dataflow recorder's account of which bytes of a watched tensor the recorded writes refreshed
(``Dataflow.unwritten_bytes``), against an independent oracle: a mask of the elements each write refreshed, made by the
same indexing on a boolean tensor outside the recording. An overwrite refreshes what it reaches; an op that reads the
values it writes, or writes values computed from unrefreshed elements of the same tensor, refreshes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsafe.collectors import Dataflow

SIZE = 64


@st.composite
def _writes(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """In-place writes ``(start, stop, step)`` into a tensor of :data:`SIZE` elements."""
    count = draw(st.integers(0, 6))
    writes = []
    for _ in range(count):
        start = draw(st.integers(0, SIZE - 1))
        stop = draw(st.integers(start, SIZE))
        step = draw(st.sampled_from([1, 1, 1, 2, 3]))
        writes.append((start, stop, step))
    return writes


def _record(writes: list[tuple[int, int, int]], target: torch.Tensor) -> Dataflow:
    Dataflow.prepare()
    dataflow = Dataflow()
    dataflow.watch([target])
    with dataflow:
        for start, stop, step in writes:
            target[start:stop:step].fill_(1)
    return dataflow


@settings(max_examples=300, deadline=None)
@given(_writes(), st.sampled_from([torch.float32, torch.int64, torch.bfloat16]))
def test_unwritten_bytes_matches_the_elements_the_writes_reached(
    writes: list[tuple[int, int, int]], dtype: torch.dtype
) -> None:
    target = torch.zeros(SIZE, dtype=dtype)
    dataflow = _record(writes, target)
    reached = torch.zeros(SIZE, dtype=torch.bool)
    for start, stop, step in writes:
        reached[start:stop:step] = True
    found = dataflow.unwritten_bytes(target)
    if not writes:
        assert found is None  # never written in place: nothing to say
    else:
        assert found == int((~reached).sum()) * target.element_size()


def test_a_view_of_the_written_storage_is_judged_on_its_own_bytes() -> None:
    flat = torch.zeros(32)
    dataflow = _record([(0, 16, 1)], flat)  # (the storage is watched through the whole tensor)
    assert dataflow.unwritten_bytes(flat[:16]) == 0
    assert dataflow.unwritten_bytes(flat[8:24]) == 8 * 4
    assert dataflow.unwritten_bytes(flat) == 16 * 4


def test_a_tensor_not_watched_has_no_account() -> None:
    Dataflow.prepare()
    dataflow = Dataflow()
    other = torch.zeros(8)
    with dataflow:
        other[:4].add_(1)
    assert dataflow.unwritten_bytes(other) is None


_INDEXED = {
    "index_copy_": lambda t, i: t.index_copy_(0, i, torch.ones(len(i), 8, dtype=t.dtype)),
    "index_fill_": lambda t, i: t.index_fill_(0, i, 1),
    "scatter_": lambda t, i: t.scatter_(0, i.unsqueeze(1).expand(-1, 8), 1.0),
    "index_put_": lambda t, i: t.index_put_((i,), torch.tensor(1.0)),
    "mask": lambda t, i: t.__setitem__(torch.zeros(16, dtype=torch.bool).index_fill_(0, i, True), 1.0),
    "masked_fill_": lambda t, i: t.masked_fill_(torch.zeros(16, 1, dtype=torch.bool).index_fill_(0, i, True), 1.0),
    "put_": lambda t, i: t.put_(i * 8, torch.ones(len(i))),
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(_INDEXED)), st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True))
def test_an_indexed_write_counts_the_rows_it_reached(how: str, rows: list[int]) -> None:
    target = torch.zeros(16, 8)
    index = torch.tensor(rows)
    Dataflow.prepare()
    dataflow = Dataflow()
    dataflow.watch([target])
    with dataflow:
        _INDEXED[how](target, index)
    reached = torch.zeros(16, 8, dtype=torch.bool)
    if how == "put_":
        reached.view(-1)[index * 8] = True
    else:
        reached[index] = True
    assert dataflow.unwritten_bytes(target) == int((~reached).sum()) * 4


def _watching(target: torch.Tensor, ops: Callable[[], object]) -> Dataflow:
    """A recording of ``ops`` with ``target`` watched."""
    Dataflow.prepare()
    dataflow = Dataflow()
    dataflow.watch([target])
    with dataflow:
        ops()
    return dataflow


def test_a_view_change_in_place_marks_nothing() -> None:
    target = torch.zeros(8, 8)
    dataflow = _watching(target, lambda: (target[:4].fill_(1), target.t_(), target.t_()))
    assert dataflow.unwritten_bytes(target) == 32 * 4


def test_an_accumulating_indexed_write_refreshes_nothing() -> None:
    """``index_add_`` reads the rows it writes, and is no elementwise op: where not all of what it reaches was
    refreshed, nothing it reaches is (rows 4-11 here); rows 0-3 stay refreshed, rows 12-15 were never written."""
    target = torch.zeros(16, 8)
    dataflow = _watching(
        target, lambda: (target[:8].fill_(1), target.index_add_(0, torch.arange(4, 12), torch.ones(8, 8)))
    )
    assert dataflow.unwritten_bytes(target) == 12 * 8 * 4


_OPS = ("fill", "scale", "copy-of-itself", "cumulative")


@st.composite
def _mixed_writes(draw: st.DrawFn) -> list[tuple[str, int, int, int]]:
    """Ops ``(kind, start, stop, source)`` on a tensor of :data:`SIZE` elements: ``fill`` overwrites ``[start:stop]``,
    ``scale`` multiplies it in place, ``copy-of-itself`` copies ``[source:source + stop - start]`` (times one) into it,
    ``cumulative`` takes its running sum in place."""
    ops = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(_OPS))
        start = draw(st.integers(0, SIZE - 1))
        stop = draw(st.integers(start, SIZE))
        source = draw(st.integers(0, SIZE - (stop - start)))
        ops.append((kind, start, stop, source))
    return ops


@settings(max_examples=400, deadline=None)
@given(_mixed_writes())
def test_only_writes_that_read_no_old_values_refresh(ops: list[tuple[str, int, int, int]]) -> None:
    """The oracle's rule, element by element: a fill refreshes; a scale keeps each element as it was; a copy of the
    tensor's own elements refreshes where every element it copies was fresh and unrefreshes otherwise; a running sum
    leaves its range as it was where all of the range was fresh and unrefreshes the range otherwise."""
    target = torch.zeros(SIZE)
    Dataflow.prepare()
    dataflow = Dataflow()
    dataflow.watch([target])
    fresh = torch.zeros(SIZE, dtype=torch.bool)
    with dataflow:
        for kind, start, stop, source in ops:
            length = stop - start
            if kind == "fill":
                target[start:stop].fill_(1)
                fresh[start:stop] = True
            elif kind == "scale":
                target[start:stop].mul_(1.0)
            elif kind == "copy-of-itself":
                copied = bool(fresh[source : source + length].all())
                target[start:stop].copy_(target[source : source + length] * 1.0)
                fresh[start:stop] = copied
            else:
                target[start:stop].cumsum_(0)
                if not bool(fresh[start:stop].all()):
                    fresh[start:stop] = False
    found = dataflow.unwritten_bytes(target)
    if not ops:
        assert found is None
    else:
        assert found == int((~fresh).sum()) * 4


def test_a_recorder_failure_leaves_nothing_provably_refreshed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the recorder cannot tell what an op read (its own failure), no later write proves a byte refreshed: the
    whole watched tensor counts as left out, never as unknown (which would let the value sample judge)."""
    from graphsafe.collectors import _dataflow

    def fail(self: object, tensor: torch.Tensor) -> bool:
        raise RuntimeError("the recorder's own failure")

    target = torch.zeros(16)
    monkeypatch.setattr(_dataflow._Coverage, "unrefreshed", fail)
    dataflow = _watching(target, lambda: (target * 1, target.fill_(1)))
    assert dataflow.unwritten_bytes(target) == 16 * 4
