"""The performance budget's verdict (``benchmarks/budget.py``): a figure past its recorded value by more than the
margin, in the direction that is worse, fails; anything within passes. (The figures themselves are measured by the
budget script that ``make test`` runs after the suite, never by a timed unit test.)"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "budget.py")


@pytest.fixture(scope="module")
def budget_module() -> Any:
    spec = importlib.util.spec_from_file_location("graphsafe_benchmarks_budget", HERE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUDGET = {
    "margin": 2.0,
    "figures": {"speedup": {"recorded": 1.0, "better": "higher"}, "cost_pct": {"recorded": 100.0, "better": "lower"}},
}


@pytest.mark.parametrize(
    "figures, past",
    [
        ({"speedup": 1.0, "cost_pct": 100.0}, []),
        ({"speedup": 0.51, "cost_pct": 199.0}, []),
        ({"speedup": 0.49, "cost_pct": 100.0}, ["speedup"]),
        ({"speedup": 1.0, "cost_pct": 201.0}, ["cost_pct"]),
        ({"speedup": 0.1, "cost_pct": 900.0}, ["speedup", "cost_pct"]),
    ],
)
def test_a_figure_past_its_budget_by_more_than_the_margin_fails(
    budget_module: Any, figures: dict[str, float], past: list[str]
) -> None:
    found = budget_module.check(figures, BUDGET)
    assert [line.split(" = ")[0] for line in found] == past


def test_the_recorded_budget_names_every_figure_the_script_measures(budget_module: Any) -> None:
    import json

    with open(budget_module.BUDGET) as handle:
        recorded = json.load(handle)
    assert set(recorded["figures"]) == {"small_restore_vs_loop", "engine_contract_pct"}
    assert float(recorded["margin"]) > 1
