"""The dataflow recorder's account of which bytes in-place writes covered (``Dataflow.unwritten_bytes``), against an
independent oracle: a mask of the elements each write reached, made by writing ones through the same views."""

from __future__ import annotations

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
    with dataflow:
        for start, stop, step in writes:
            target[start:stop:step].add_(1)
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
    gappy = any(s > 1 and len(range(a, b, s)) > 1 for a, b, s in writes)
    if not writes:
        assert found is None  # never written in place: nothing to say
    elif gappy:
        assert found is None  # a strided write with gaps: what it covered is unknown
    else:
        assert found == int((~reached).sum()) * target.element_size()


def test_a_view_of_the_written_storage_is_judged_on_its_own_bytes() -> None:
    flat = torch.zeros(32)
    dataflow = _record([(0, 16, 1)], flat)
    assert dataflow.unwritten_bytes(flat[:16]) == 0
    assert dataflow.unwritten_bytes(flat[8:24]) == 8 * 4
    assert dataflow.unwritten_bytes(flat) == 16 * 4


def test_a_tensor_allocated_while_recording_has_no_account() -> None:
    Dataflow.prepare()
    dataflow = Dataflow()
    with dataflow:
        made = torch.zeros(8)
        made[:4].add_(1)
    assert dataflow.unwritten_bytes(made) is None
