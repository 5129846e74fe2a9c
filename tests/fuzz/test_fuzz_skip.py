"""The differential fuzzer with ``GraphContract(unread="skip")``: every scenario is captured by a fake kernel scan
whose graph reads a random part of what the forward reads (the oracle's own recording), so the rest is unread and
its slots' copies are skipped where the rule allows; the oracle judges a replay by what the graph reads, and the
model's own values by everything the forward reads. The oracle is the same independent one
(:mod:`fuzz.oracle`), run against the same scenario under ``unread="restore"``: the skip must add no silent success
and no crash. ``GRAPHSAFE_FUZZ_SKIP_EXAMPLES`` sets the count (default 300).
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from hypothesis import given, settings

from fuzz import oracle
from fuzz.harness import Tally, run
from fuzz.models import FuzzModel, Scenario, forward
from fuzz.strategies import base_scenarios
from graphsafe import GraphContract, record_capture
from graphsafe.collectors import RecordedDriver
from graphsafe.collectors import _kernelscan as kscan

EXAMPLES = int(os.environ.get("GRAPHSAFE_FUZZ_SKIP_EXAMPLES", "300"))


class _Graph:
    """A keep_graph CUDAGraph stand-in: its raw graph is the recorded table's root."""

    def raw_cuda_graph(self) -> int:
        return 1


@contextmanager
def _scan_of(reads: dict[oracle.Key, oracle.Read]) -> Iterator[None]:
    """The kernel scan over one kernel whose parameters are the pointers the forward read, each storage in an
    allocator block of its own (so a read storage no model path holds is unowned, as on a GPU)."""
    storages = {id(s): s for s in (read.storage() for read in reads.values()) if s is not None}
    views = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages.values()]
    words = [read.data_ptr for read in reads.values() if read.data_ptr]
    table = {
        "root": 1,
        "graphs": {
            "1": [
                {
                    "type": "kernel",
                    "name": "forward",
                    "layout": [[8 * i, 8] for i in range(len(words))],
                    "params": [w.to_bytes(8, "little").hex() for w in words],
                }
            ]
        },
    }
    segments = [
        {
            "address": v.untyped_storage().data_ptr(),
            "total_size": v.untyped_storage().nbytes(),
            "blocks": [
                {"address": v.untyped_storage().data_ptr(), "size": v.untyped_storage().nbytes(), "state": "active"}
            ],
        }
        for v in views
        if v.untyped_storage().nbytes()
    ]
    with (
        mock.patch.object(kscan, "driver", lambda: RecordedDriver(table)),
        mock.patch.object(kscan, "allocator_segments", lambda: segments),
        mock.patch.object(kscan, "live_tensors", lambda: iter(views)),
    ):
        yield
    views.clear()


def _capture(contract: GraphContract, model: FuzzModel, x: torch.Tensor) -> set[oracle.Key]:
    """The graph reads a random half of what the forward reads (fixed per model structure): the rest is unread."""
    reads = oracle.record(lambda note: forward(model, x, note), (x,), values=False)
    chooser = random.Random(zlib.crc32(repr(sorted(reads)).encode()) ^ len(reads))
    reads = {key: read for key, read in reads.items() if chooser.random() < 0.5}
    with _scan_of(reads), record_capture(contract, ignore=[x], graph=_Graph()):
        pass
    return set(reads)


def test_the_skip_adds_no_lie_to_the_differential_fuzzer() -> None:
    """Every scenario runs twice, ``unread="restore"`` and ``unread="skip"``, with the same capture: a silent
    success or a crash under the skip must be one the restore has too (the restore path's own, reported apart)."""
    skip, restore = Tally(), Tally()
    added: list[str] = []
    skipped = [0]

    @settings(settings.get_profile("graphsafe-fuzz-ci"), max_examples=EXAMPLES)
    @given(base_scenarios())
    def one(scenario: Scenario) -> None:
        before = run(scenario, unread="restore", capture=_capture)
        after = run(scenario, unread="skip", capture=_capture)
        restore.add(before)
        skip.add(after)
        bad = (oracle.SILENT, oracle.CRASH)
        if after.verdict in bad and (before.verdict, before.reason) != (after.verdict, after.reason):
            added.append(
                f"{after.verdict}: {after.reason} {after.detail} (restore: {before.verdict})\n{scenario.describe()}"
            )
            if os.environ.get("GRAPHSAFE_FUZZ_SHRINK"):
                raise AssertionError(added[-1])

    def count(outcome: Any) -> None:
        skipped[0] += outcome.slots_skipped

    with mock.patch.object(GraphContract, "_apply", _counting(count)):
        one()
    print(f"\nunread=skip: {skip.report()}\nslots skipped: {skipped[0]}\nunread=restore: {restore.report()}")
    assert skip.runs > 0
    assert skipped[0] > 0, "the fuzzer never reached a skip: the test proves nothing"
    assert not added, f"{len(added)} lie(s) the skip added:\n" + "\n".join(added[:5])


def _counting(count: Any) -> Any:
    original = GraphContract._apply

    def apply(self: GraphContract, outcome: Any, error: BaseException | None) -> None:
        count(outcome)
        original(self, outcome, error)

    return apply
