"""The recorded (first) reload of an engine-shaped model: what recording what PWAL reads and refreshes costs.

    PYTHONPATH=src python3 benchmarks/first_reload.py [--models 5]

Each model is built, sealed (``declared-only``, strict) and reloaded once with other weights; the first reload after
a seal records the load and PWAL (``collectors.Dataflow``), later ones do not. Prints the median over fresh models.
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape, device = _engine.CPU_SHAPE, torch.device("cpu")
    template = _engine.EngineModel(shape, torch.device("meta"))
    initial, new = (_engine.make_weights(template, seed, device) for seed in (0, 1))
    Dataflow.prepare()  # torch's one-time dispatch set-up, outside the timing
    seconds = []
    for _ in range(args.models):
        model = _engine.build(shape, device, declare=True, weights=initial)
        contract = GraphContract(model, "strict", detect="declared-only").seal()
        start = time.perf_counter()
        with contract.reload():
            _engine.load_weights(model, new, declare=True)
        seconds.append(time.perf_counter() - start)
    print(f"{shape.name}: the recorded reload, median of {args.models}: {statistics.median(seconds) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
