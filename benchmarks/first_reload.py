"""The recorded reload of an engine-shaped model: what recording what PWAL reads and refreshes costs.

    PYTHONPATH=src python3 benchmarks/first_reload.py [--models 5] [--device cuda] [--layerwise]

Each model is built, sealed (``declared-only``, strict) and reloaded with other weights. A recorded reload runs the
load and PWAL under a dispatch mode (``collectors.Dataflow``): every reload under ``record_reloads="every"`` (the
default), only the first after a seal under ``"first"``. Prints the median over fresh models of the first reload,
and of later reloads under ``"first"`` (unrecorded) and ``"every"`` (recorded), taken in turns on one model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine

from graphsafe import GraphContract
from graphsafe.collectors import Dataflow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (the CPU engine shape) or cuda (the GPU one)")
    parser.add_argument("--layerwise", action="store_true", help="one before_layer()/after_layer() per layer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    shape = _engine.CUDA_SHAPE if device.type == "cuda" else _engine.CPU_SHAPE
    template = _engine.EngineModel(shape, torch.device("meta"))
    initial, new = (_engine.make_weights(template, seed, device) for seed in (0, 1))
    Dataflow.prepare()  # torch's one-time dispatch set-up, outside the timing
    first: list[float] = []
    later: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.models):
        model = _engine.build(shape, device, declare=True, weights=initial)
        contract = GraphContract(model, "strict", detect="declared-only").seal()
        first.append(_reload(contract, model, new, args.layerwise))
        for turn in range(4):
            every = turn % 2 == 1
            contract.record_reloads = "every" if every else "first"
            later[every].append(_reload(contract, model, initial if turn % 2 else new, args.layerwise))
    how = "layerwise" if args.layerwise else "whole model"
    print(f"{shape.name} on {device}, {how}, medians over {args.models} models:")
    print(f"  the first (recorded) reload            {statistics.median(first) * 1e3:7.1f} ms")
    plain, every = (statistics.median(later[flag]) * 1e3 for flag in (False, True))
    print(f"  a later reload, record_reloads='first' {plain:7.1f} ms  (unrecorded)")
    print(f"  a later reload, record_reloads='every' {every:7.1f} ms  ({every / plain:.2f}x, the default)")


def _reload(
    contract: GraphContract, model: _engine.EngineModel, weights: list[list[torch.Tensor]], layerwise: bool
) -> float:
    _sync(weights)
    start = time.perf_counter()
    if layerwise:
        with contract.reload(layerwise=True) as txn:
            for layer, values in zip(model.layers, weights, strict=True):
                txn.before_layer(layer)
                _engine.load_layer(layer, values, declare=True)
                txn.after_layer(layer)
    else:
        with contract.reload():
            _engine.load_weights(model, weights, declare=True)
    _sync(weights)
    return time.perf_counter() - start


def _sync(weights: list[list[torch.Tensor]]) -> None:
    if weights and weights[0] and weights[0][0].is_cuda:
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
