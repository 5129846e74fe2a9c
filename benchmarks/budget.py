"""The performance budget: fails when the contract's cost, as a ratio measured in one process against what it guards,
grows past the recorded budget (``benchmarks/budget.json``) by more than its margin.

Ratios only, never absolute times (the machines CI runs on differ and are shared): each figure is taken by
``benchmarks/run.py``'s own sections, the methods interleaved round-robin, medians over the repeats:

* ``small_restore_vs_loop``: 2,000 small declared slots (100 layers x 20), the restore of ``declared-only``
  against an upstream per-slot ``copy_`` loop's (higher is better);
* ``engine_contract_pct``: the engine-shaped model (32 layers, 832 tracked tensors), the contract's own time as a %
  of the load + PWAL it guards, whole-model ``declared-only`` (lower is better).

    PYTHONPATH=src python benchmarks/budget.py            # check (exit 1 past the budget), ~1 minute on 2 cores
    PYTHONPATH=src python benchmarks/budget.py --record   # print the figures to record as the new budget

A new rule that makes the reload slower has to fit in the margin, or record a new budget in the same change (the
figure and the reason in ``benchmarks/RESULTS.md``'s changelog).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET = os.path.join(HERE, "budget.json")


def _run_module() -> Any:
    sys.path.insert(0, HERE)
    spec = importlib.util.spec_from_file_location("graphsafe_benchmarks_run", os.path.join(HERE, "run.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(repeats: int) -> dict[str, float]:
    """The budgeted figures, measured now on the CPU."""
    torch.set_num_threads(1)
    run = _run_module()
    cpu = torch.device("cpu")
    args = argparse.Namespace(repeats=repeats, small_layers=100, small_k=20, engine_size="cpu", engine_layers=None)
    small = run.section_small(args, cpu)
    row = next(r for r in small["rows"] if r["method"] == "graphsafe declared-only")
    engine = run.section_engine(args, cpu)
    engine_row = next(r for r in engine["rows"] if r["method"] == "graphsafe declared-only whole-model")
    return {"small_restore_vs_loop": row["vs_loop"], "engine_contract_pct": engine_row["contract_pct"]}


def check(figures: dict[str, float], budget: dict[str, Any]) -> list[str]:
    """What is past the budget: a higher-is-better figure below its recorded value divided by the margin, a
    lower-is-better one above its recorded value times the margin."""
    margin = float(budget["margin"])
    past: list[str] = []
    for name, entry in budget["figures"].items():
        value, recorded, better = figures[name], float(entry["recorded"]), entry["better"]
        if better == "higher" and value < recorded / margin:
            past.append(f"{name} = {value:.3g}, below the budget {recorded:.3g} / {margin:g}")
        elif better == "lower" and value > recorded * margin:
            past.append(f"{name} = {value:.3g}, above the budget {recorded:.3g} x {margin:g}")
    return past


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="print the figures as a budget; check nothing")
    args = parser.parse_args(argv)
    figures = measure(args.repeats)
    if args.record:
        print(json.dumps(figures, indent=2))
        return 0
    with open(BUDGET) as handle:
        budget = json.load(handle)
    past = check(figures, budget)
    shown = ", ".join(f"{name} {value:.3g}" for name, value in figures.items())
    if past:
        print(f"graphsafe performance budget: past the budget ({shown}): " + "; ".join(past), file=sys.stderr)
        return 1
    print(f"graphsafe performance budget: within ({shown}; margin {budget['margin']}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
