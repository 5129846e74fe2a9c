"""The capture manifest's per-reload cost on the engine-shaped model (``_engine.py``), two contracts interleaved in
one process: the same model twice, one contract with a manifest (``record_capture`` around one forward), one
without, reloaded alternately so both see the same machine load.

    PYTHONPATH=src python benchmarks/manifest_ab.py --reloads 20            # medians of outcome.seconds
    PYTHONPATH=src python benchmarks/manifest_ab.py --reloads 20 --profile  # cProfile of the manifest side

Every reload loads different weights and must commit. It prints, per side, the median transaction wall time
(``outcome.seconds``) and the median process CPU time of the whole reload (load + PWAL + contract: on a shared
machine CPU time counts only this process's work; the load is the same on both sides), and the manifest's cost;
``--profile`` prints the manifest side's top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _engine

from graphsafe import GraphContract, Status, record_capture


def _build(manifest: bool, detect: str) -> tuple[GraphContract, list[dict[str, torch.Tensor]], torch.nn.Module]:
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = _engine.EngineModel(_engine.CPU_SHAPE, device)
    weights = [_engine.make_weights(model, seed, device) for seed in (1, 2)]
    _engine.load_weights(model, weights[0], declare=True)
    contract = GraphContract(model, "strict", detect=detect)  # type: ignore[arg-type]
    contract.seal()
    if manifest:  # what a graph capture records (the dispatch recorder on CPU)
        x = torch.randn(4, _engine.CPU_SHAPE.hidden, device=device, dtype=_engine.DTYPE)
        with record_capture(contract, ignore=[x]), torch.no_grad():
            model(x)
    return contract, weights, model  # the contract holds its model weakly


def _reload(contract: GraphContract, weights: list[dict[str, torch.Tensor]], index: int) -> tuple[float, float]:
    """``(transaction wall seconds, process CPU seconds of the whole reload)``."""
    cpu = time.process_time()
    with contract.reload():
        _engine.load_weights(contract.model, weights[(index + 1) % 2], declare=True)
    cpu = time.process_time() - cpu
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome
    return outcome.seconds, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reloads", type=int, default=20)
    parser.add_argument("--detect", default="declared-only")
    parser.add_argument("--profile", action="store_true", help="cProfile the manifest side's reloads")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sides = {"no manifest": _build(False, args.detect), "manifest": _build(True, args.detect)}
    for index in range(3):  # warm-up: the first reload records what PWAL reads
        for contract, weights, _ in sides.values():
            _reload(contract, weights, index)
    if args.profile:
        contract, weights, _ = sides["manifest"]
        profiler = cProfile.Profile()
        profiler.enable()
        for index in range(args.reloads):
            _reload(contract, weights, index)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
        return 0
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(args.reloads):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        for name in order:
            contract, weights, _ = sides[name]
            seconds, used = _reload(contract, weights, index)
            wall[name].append(seconds)
            cpu[name].append(used)
    for label, figures in (("transaction wall", wall), ("reload CPU", cpu)):
        plain, recorded = (statistics.median(figures[name]) * 1e3 for name in ("no manifest", "manifest"))
        print(
            f"{label} median: no manifest {plain:.2f} ms, manifest {recorded:.2f} ms, "
            f"manifest cost {recorded - plain:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
