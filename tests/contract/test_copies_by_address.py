"""Which copies of a restore step landed on a recorded byte range (``contract._landing._Landing``), and which
recorded bytes no copy covers (``_Covered``): the same
copies, in the same order, as a pass over every copy, for any ranges (nested, overlapping, empty, touching, on
several devices). The manifest's per-reload check asks this once per recorded storage."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphsafe.contract._landing import _Covered, _Landing

DEVICES = ("cpu", "cuda:0")
ranges = st.tuples(st.sampled_from(DEVICES), st.integers(0, 200), st.integers(0, 60)).map(
    lambda r: (r[0], r[1], r[1] + r[2])
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ranges, max_size=40), st.lists(ranges, min_size=1, max_size=20))
def test_the_copies_found_by_address_are_those_a_full_pass_finds(
    copies: list[tuple[str, int, int]], asked: list[tuple[str, int, int]]
) -> None:
    written = [(device, start, end, f"move{index}") for index, (device, start, end) in enumerate(copies)]
    landing = _Landing(written)
    for device, first, end in asked:
        expected = [move for where, start, stop, move in written if where == device and start < end and first < stop]
        assert landing.on(device, first, end) == expected


def _uncovered_runs(first: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The oracle: every byte of ``[first, end)`` no span holds, as maximal runs."""
    covered = {byte for start, stop in spans for byte in range(start, stop)}
    runs: list[tuple[int, int]] = []
    for byte in range(first, end):
        if byte in covered:
            continue
        if runs and runs[-1][1] == byte:
            runs[-1] = (runs[-1][0], byte + 1)
        else:
            runs.append((byte, byte + 1))
    return runs


spans_st = st.tuples(st.integers(0, 200), st.integers(0, 60)).map(lambda s: (s[0], s[0] + s[1]))


@settings(max_examples=300, deadline=None)
@given(st.lists(spans_st, max_size=40), st.lists(spans_st, min_size=1, max_size=20))
def test_the_bytes_no_copy_covers_are_found_by_search(
    spans: list[tuple[int, int]], asked: list[tuple[int, int]]
) -> None:
    covered = _Covered(spans)
    for first, end in asked:
        assert covered.gaps(first, end) == _uncovered_runs(first, end, spans)
