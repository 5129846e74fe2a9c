"""Where an engine-shaped reload's contract time goes: cProfile of whole-model and layerwise reloads.

    PYTHONPATH=src python3 benchmarks/profile_engine.py --device cuda     # the full engine shape (~1 GiB)
    PYTHONPATH=src python3 benchmarks/profile_engine.py                  # CPU, the tiny shape

Each mode: three warm-up reloads, then ``--reloads`` profiled ones (different weights each time, ``declared-only``,
strict), and the top functions by own and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine
import run as bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reloads", type=int, default=6)
    parser.add_argument("--top", type=int, default=35)
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = _engine.CUDA_SHAPE if device.type == "cuda" else _engine.TINY_SHAPE
    batches = tuple(b for b in bench.ENGINE_BATCHES if b <= shape.max_tokens) if device.type == "cuda" else ()
    template = _engine.EngineModel(shape, torch.device("meta"))
    initial = _engine.make_weights(template, 0, device)
    weights = [_engine.make_weights(template, seed, torch.device("cpu")) for seed in (1, 2)]
    for layerwise in (False, True):
        method = bench.EngineContract(shape, device, initial, "declared-only", layerwise, batches)
        for round_ in range(3):
            method.cycle(weights[round_ % 2])
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for round_ in range(args.reloads):
            method.cycle(weights[round_ % 2])
        profile.disable()
        per = (time.perf_counter() - start) / args.reloads * 1e3
        print(f"=== {'layerwise' if layerwise else 'whole-model'}: {per:.1f} ms per reload cycle under the profiler")
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))
        del method


if __name__ == "__main__":
    main()
