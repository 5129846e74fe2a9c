"""The contract's CPU goals, measured in process CPU time: robust where the machine is shared.

    PYTHONPATH=src python benchmarks/cpu_goals.py              # both goals, ~1 minute on 2 cores
    PYTHONPATH=src python benchmarks/cpu_goals.py --json out.json

Two figures, each as its goal defines it:

* **declared slots**: 10,000 small declared slots on one layer (``_models.Shape("small", 1, 10000)``), a strict
  ``declared-only`` contract: the contract's own time per slot (``begin()`` + ``finish()``), beside the upstream
  per-slot ``copy_`` loop on an identical model (goal: at most 15 us per slot);
* **engine-shaped**: ``_engine.py``'s CPU shape (32 layers, 832 tracked tensors), whole-model ``declared-only``: the
  contract's time as a % of its load + PWAL (goal: at most 50 %).

Every reload loads other weights than the one before and must commit. Times are the process's CPU time
(``time.process_time``) around each phase: on a busy machine, wall time counts the other processes' turns, CPU time
only this one's work (one thread: ``torch.set_num_threads(1)``). Medians over the timed reloads; the phase split
(``begin``, load + PWAL, ``finish``) is printed too. Compare two trees by running this from each, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _engine
from _models import Shape, assign_derived, build, load_weights, make_weights, read_derived

from graphsafe import GraphContract, Status

SLOTS = 10_000


def _phases(contract: GraphContract, load: Callable[[int], None], reloads: int, warmup: int) -> list[tuple[float, ...]]:
    """CPU seconds of ``begin()``, the load and ``finish()`` for each timed reload."""
    timed: list[tuple[float, ...]] = []
    for index in range(warmup + reloads):
        start = time.process_time()
        txn = contract.reload()
        txn.begin()
        begun = time.process_time()
        load(index)
        loaded = time.process_time()
        txn.finish()
        done = time.process_time()
        outcome = contract.last_outcome
        assert outcome is not None and outcome.status is Status.COMMITTED, outcome
        if index >= warmup:
            timed.append((begun - start, loaded - begun, done - loaded))
    return timed


def declared_slots(reloads: int) -> dict[str, Any]:
    """10,000 declared slots on one layer: the contract's and the per-slot loop's CPU time per slot."""
    device = torch.device("cpu")
    shape = Shape("small", 1, SLOTS, 32, 32)
    model = build(shape, device, declare=True)
    weights = [make_weights(model, seed, device) for seed in (1, 2)]
    contract = GraphContract(model, "strict", detect="declared-only")
    contract.seal()
    phases = _phases(contract, lambda i: load_weights(model, weights[i % 2], True), reloads, warmup=2)
    begin, load, finish = (statistics.median(column) / SLOTS * 1e6 for column in zip(*phases, strict=True))
    loop_model = build(shape, device, declare=False)
    targets = [(layer, i, read_derived(layer, i)) for layer in loop_model.layers for i in range(shape.k)]
    loop: list[float] = []
    for index in range(reloads + 2):
        load_weights(loop_model, weights[index % 2], declare=False)
        start = time.process_time()
        with torch.no_grad():
            for layer, i, old in targets:
                old.copy_(read_derived(layer, i))
                assign_derived(layer, i, old)
        if index >= 2:
            loop.append(time.process_time() - start)
    return {
        "slots": SLOTS,
        "contract_us_per_slot": begin + finish,
        "begin_us_per_slot": begin,
        "finish_us_per_slot": finish,
        "load_us_per_slot": load,
        "loop_us_per_slot": statistics.median(loop) / SLOTS * 1e6,
        "goal_us_per_slot": 15.0,
    }


def engine_shaped(reloads: int) -> dict[str, Any]:
    """The engine-shaped model, whole-model: the contract's CPU time as a % of its load + PWAL."""
    device = torch.device("cpu")
    model = _engine.EngineModel(_engine.CPU_SHAPE, device)
    weights = [_engine.make_weights(model, seed, device) for seed in (1, 2)]
    _engine.load_weights(model, weights[0], declare=True)
    contract = GraphContract(model, "strict", detect="declared-only")
    contract.seal()
    phases = _phases(
        contract, lambda i: _engine.load_weights(model, weights[(i + 1) % 2], declare=True), reloads, warmup=3
    )
    begin, load, finish = (statistics.median(column) * 1e3 for column in zip(*phases, strict=True))
    return {
        "tracked": sum(len(layer.slots) for layer in contract._layers),
        "contract_ms": begin + finish,
        "begin_ms": begin,
        "finish_ms": finish,
        "load_ms": load,
        "contract_pct_of_load": (begin + finish) / load * 100,
        "goal_pct": 50.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reloads", type=int, default=9)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    figures = {
        "torch": torch.__version__,
        "declared_slots": declared_slots(args.reloads),
        "engine_shaped": engine_shaped(2 * args.reloads),
    }
    slots, engine = figures["declared_slots"], figures["engine_shaped"]
    print(
        f"declared slots ({slots['slots']:,} on one layer): contract {slots['contract_us_per_slot']:.1f} us/slot "
        f"(begin {slots['begin_us_per_slot']:.1f}, finish {slots['finish_us_per_slot']:.1f}; goal <= 15), "
        f"per-slot loop {slots['loop_us_per_slot']:.1f} us/slot"
    )
    print(
        f"engine-shaped ({engine['tracked']} tracked): contract {engine['contract_ms']:.1f} ms "
        f"(begin {engine['begin_ms']:.1f}, finish {engine['finish_ms']:.1f}) on a load + PWAL of "
        f"{engine['load_ms']:.1f} ms: {engine['contract_pct_of_load']:.0f} % (goal <= 50 %)"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
