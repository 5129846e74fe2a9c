"""The differential fuzzer's CI slice and long run, and the oracle's own sanity tests.

``test_the_contract_never_lies_to_the_differential_fuzzer`` draws random scenarios (:mod:`fuzz.strategies`), runs
each under a ``GraphContract`` (:mod:`fuzz.harness`) and counts the independent oracle's verdicts
(:mod:`fuzz.oracle`). Scenarios are of one class each (:mod:`fuzz.classes`): the base one, or a base scenario
with one extra kind of state or call. It fails if any reload of any class was a silent success or a crash (the
counts by verdict, by class and by mutation kind and the first scenarios of each distinct failure in the message),
or if a class was drawn fewer than :data:`MIN_PER_CLASS` times. ``make fuzz`` runs the long profile and prints the
same tables; ``GRAPHSAFE_FUZZ_REPORT`` names a file for the per-class counts as JSON (see
``tests/fuzz/conftest.py`` and ``docs/fault-matrix.md``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, seed, settings

from fuzz import oracle
from fuzz.classes import CLASSES, close_mesh
from fuzz.harness import Result, Tally, run, run_all
from fuzz.models import FuzzLayer, FuzzModel, LayerSpec, Scenario, SlotSpec, forward, get_slot
from fuzz.strategies import scenarios

PROFILE = os.environ.get("GRAPHSAFE_FUZZ_PROFILE", "graphsafe-fuzz-ci")
#: Where the long run writes its per-class counts as JSON (``make fuzz GRAPHSAFE_FUZZ_REPORT=path``).
REPORT = os.environ.get("GRAPHSAFE_FUZZ_REPORT")
#: The fewest reloads each class must get in a run (the CI slice included), so none goes untried unnoticed.
MIN_PER_CLASS = 20


@pytest.fixture
def one_rank_mesh() -> Iterator[None]:
    """The ``dtensor`` class's one-rank process group is made on first use; destroyed when the test ends."""
    try:
        yield
    finally:
        close_mesh()


# The CI slice takes about a minute and a half on one core (a loaded runner is slower); the long profile runs as
# long as it is asked to (a marker's timeout would outrank `make fuzz`'s `-o timeout=0`).
@pytest.mark.timeout(0 if PROFILE == "graphsafe-fuzz-long" else 900)
@pytest.mark.usefixtures("one_rank_mesh")
def test_the_contract_never_lies_to_the_differential_fuzzer() -> None:
    tally = Tally()
    shrink = bool(os.environ.get("GRAPHSAFE_FUZZ_SHRINK"))
    started = time.monotonic()
    seconds = float(os.environ.get("GRAPHSAFE_FUZZ_SECONDS", "inf"))

    @settings(settings.get_profile(PROFILE))
    @given(scenarios())
    def one(scenario: Scenario) -> None:
        if time.monotonic() - started > seconds:
            return  # the run's time is up: the examples left are drawn, not run
        for result in run_all(scenario):
            tally.add(result)
            if shrink and result.verdict in (oracle.SILENT, oracle.CRASH):
                raise AssertionError(f"{result.verdict}: {result.reason} {result.detail}\n{scenario.describe()}")

    if os.environ.get("GRAPHSAFE_FUZZ_SEED"):
        one = seed(int(os.environ["GRAPHSAFE_FUZZ_SEED"]))(one)
    one()
    print("\n" + tally.report())  # shown by `make fuzz` (pytest -s)
    if REPORT:
        Path(REPORT).write_text(
            json.dumps(
                {
                    "reloads": tally.runs,
                    "seconds": round(time.monotonic() - started, 1),
                    "verdicts": dict(tally.verdicts),
                    "classes": tally.classes(),
                },
                indent=2,
            )
        )
    assert tally.runs > 0
    assert tally.failures == 0, tally.report()  # no silent success, no foreign exception, in any class
    untried = [k for k in CLASSES if sum(tally.by_class.get(k, {}).values()) < MIN_PER_CLASS]
    assert not untried, f"classes drawn fewer than {MIN_PER_CLASS} times: {untried}\n{tally.class_table()}"


# ----------------------------------------------------------------------------------------------------
# The oracle itself: a known lie must be flagged, a clean reload must not be.

CLEAN = Scenario(
    layers=(
        LayerSpec(
            rows=2,
            cols=3,
            slots=(
                SlotSpec("d0", source="t", declare="graph_visible"),
                SlotSpec("d1", source="scale", holder="dict", declare="register_derived"),
            ),
        ),
    ),
    mode="strict",
)


def _d0(model: FuzzModel) -> torch.Tensor:
    layer = model.layers[0]
    assert isinstance(layer, FuzzLayer)
    tensor = get_slot(layer, layer.fuzz_spec.slots[0], 0)
    assert isinstance(tensor, torch.Tensor)
    return tensor


def test_a_clean_declared_reload_commits_and_the_oracle_agrees() -> None:
    result = run(CLEAN)
    assert (result.status, result.verdict) == ("COMMITTED", oracle.OK), result


def test_the_oracle_flags_wrong_bytes_copied_into_a_captured_storage_after_a_commit() -> None:
    def lie(model: FuzzModel) -> None:
        _d0(model).add_(1.0)  # the captured tensor is bound back at d0: its bytes are what a replay reads

    result: Result = run(CLEAN, after_reload=lie)
    assert result.status == "COMMITTED"
    assert result.verdict == oracle.SILENT and "replay wrong: layers.0:d0" in result.reason, result


def test_the_oracle_flags_a_captured_storage_freed_after_a_commit() -> None:
    def free(model: FuzzModel) -> None:
        layer = model.layers[0]
        layer.d0 = _d0(model).clone()  # right values, new memory: the captured storage is freed

    result = run(CLEAN, after_reload=free)
    assert result.status == "COMMITTED"
    assert result.verdict == oracle.SILENT and "captured storage freed" in result.reason, result


def test_the_oracle_flags_a_negative_view_whose_memory_holds_other_values() -> None:
    def negate(model: FuzzModel) -> None:
        captured = _d0(model)
        captured.neg_()
        model.layers[0].d0 = torch._neg_view(captured)  # logically right, the memory a kernel reads is not

    result = run(CLEAN, after_reload=negate)
    assert result.verdict == oracle.SILENT and "replay wrong: layers.0:d0" in result.reason, result


def test_the_recorder_sees_model_state_and_not_the_input_or_intermediates() -> None:
    from fuzz.models import build, weights

    model = build(CLEAN, weights(CLEAN, (1,)))
    x = torch.ones(1)
    reads = oracle.record(lambda note: forward(model, x, note), (x,), values=False)
    assert sorted(reads) == [("layers.0:d0", 0), ("layers.0:d1", 0), ("layers.0:weight", 0)]
    d0 = reads[("layers.0:d0", 0)]
    assert d0.storage() is _d0(model).untyped_storage() and d0.data_ptr == _d0(model).data_ptr()


def test_in_place_tells_a_write_into_captured_memory_from_a_rebind() -> None:
    from fuzz.models import build, weights

    model = build(CLEAN, weights(CLEAN, (1,)))
    cold = build(CLEAN, weights(CLEAN, (2,)))
    x = torch.ones(1)

    def reads(m: FuzzModel, values: bool = True) -> dict[oracle.Key, oracle.Read]:
        return oracle.record(lambda note: forward(m, x, note), (x,), values=values)

    captured, truth = reads(model, values=False), reads(cold)
    layer, fresh = model.layers[0], cold.layers[0]
    with torch.no_grad():
        layer.weight.copy_(fresh.weight)
    _d0(model).copy_(_d0(cold))
    layer.cache["d1"].copy_(fresh.cache["d1"])
    assert oracle.in_place(reads(model), captured, truth)
    layer.d0 = _d0(model).clone()  # same values, another address: a replay would read the old storage
    assert not oracle.in_place(reads(model), captured, truth)
