"""Whole-model reloads of the engine-shaped model (``_engine.py``) under a strict contract, in a loop: a command to
time from outside (``/usr/bin/time -v``, or any A/B timer), one configuration per process.

    PYTHONPATH=src python benchmarks/reload_loop.py --reloads 30                      # the default contract
    PYTHONPATH=src python benchmarks/reload_loop.py --reloads 30 --rule-engine-only   # fast tier off
    PYTHONPATH=src python benchmarks/reload_loop.py --reloads 30 --no-contract        # load + PWAL alone
    PYTHONPATH=src python benchmarks/reload_loop.py --reloads 30 --manifest           # with a capture manifest

Every reload loads different weights and must commit. It prints the median milliseconds per reload, and with the
contract, the median of the transaction's own time (``outcome.seconds``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _engine

from graphsafe import GraphContract, Status, record_capture


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reloads", type=int, default=30)
    parser.add_argument("--size", choices=["cpu", "tiny", "full"], default="cpu")
    parser.add_argument("--detect", default="declared-only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--manifest", action="store_true", help="record a capture manifest around one forward")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--rule-engine-only", action="store_true", help="GraphContract.fast_tier = False")
    what.add_argument("--no-contract", action="store_true", help="load + PWAL without a contract")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    shape = {"cpu": _engine.CPU_SHAPE, "tiny": _engine.TINY_SHAPE, "full": _engine.CUDA_SHAPE}[args.size]
    model = _engine.EngineModel(shape, device)
    weights = [_engine.make_weights(model, seed, device) for seed in (1, 2)]
    _engine.load_weights(model, weights[0], declare=True)
    contract = None
    if not args.no_contract:
        contract = GraphContract(model, "strict", detect=args.detect)  # type: ignore[arg-type]
        contract.fast_tier = not args.rule_engine_only
        contract.seal()
        if args.manifest:  # what a graph capture records (the dispatch recorder on CPU)
            x = torch.randn(4, shape.hidden, device=device, dtype=_engine.DTYPE)
            with record_capture(contract, ignore=[x]), torch.no_grad():
                model(x)
    cycles: list[float] = []
    inside: list[float] = []
    for index in range(args.reloads):
        start = time.perf_counter()
        if contract is None:
            _engine.load_weights(model, weights[(index + 1) % 2], declare=True)
        else:
            with contract.reload():
                _engine.load_weights(model, weights[(index + 1) % 2], declare=True)
            outcome = contract.last_outcome
            assert outcome is not None and outcome.status is Status.COMMITTED, outcome
            inside.append(outcome.seconds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cycles.append(time.perf_counter() - start)
    line = f"reload {statistics.median(cycles) * 1e3:.2f} ms"
    if inside:
        line += f", transaction {statistics.median(inside) * 1e3:.2f} ms"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
