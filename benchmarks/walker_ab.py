"""The walker of two source trees in one process, interleaved: objects/s of a full walk and of a per-reload walk.

    python3 benchmarks/walker_ab.py OLD_SRC NEW_SRC [--rounds 15]

Each tree's ``graphsafe`` is imported in turn (the first one's modules are dropped from ``sys.modules`` before the
second is imported), so both walkers run on the same model objects in the same process. Every round times each
walker once per model and mode, the order alternating from round to round; medians are printed. Modes:

* ``full``: ``walk`` of every module (what a seal's classify does; fingerprints and refs made);
* ``reload``: the same with every path the full walk found skipped (what ``detect="every-reload"`` walks per
  reload when nothing new appeared: no ref, no fingerprint).

Times are this process's CPU time (``time.process_time``), not wall time: on a machine shared with other jobs the
wall clock also counts the time they took the CPU. ``gc.collect()`` runs before each timing, so a timing holds the
walk's own cost and its young-generation collections, but (almost never) a gen-2 collection over the whole heap:
both trees make the same objects per ref, so that cost is the same for both, and in one process it would fall on
whichever walk crosses the collector's threshold, in a pattern that can lock onto the alternation.
``benchmarks/compare.py`` (separate processes) shows the collector as it comes.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _models import DenseMoEModel, MoEModel, Shape, build


def _load(src: str) -> Callable[..., Any]:
    """``graphsafe.collectors.walker.walk`` of the tree at ``src`` (a fresh import of every graphsafe module)."""
    for name in [n for n in sys.modules if n == "graphsafe" or n.startswith("graphsafe.")]:
        del sys.modules[name]  # the previous tree's modules live on through the functions already taken from them
    sys.path.insert(0, src)
    try:
        walker = importlib.import_module("graphsafe.collectors.walker")
    finally:
        sys.path.remove(src)
    return walker.walk  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="src/ of the tree before the change")
    parser.add_argument("new", help="src/ of the tree after the change")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    walks = {"old": _load(os.path.abspath(args.old)), "new": _load(os.path.abspath(args.new))}
    device = torch.device("cpu")
    models = {
        "MoE-like 64 layers x 64 experts": MoEModel(64, 64, device),
        "tensor-dense MoE 64 x 64 experts x 3 tensors": DenseMoEModel(64, 64, device),
        "synthetic 500 x 20": build(Shape("s", 500, 20, 32, 32), device, declare=False),
    }
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.rounds} rounds, medians of process CPU time")
    print("| model | mode | objects | old objects/s | new objects/s | new/old |")
    print("|---|---|---|---|---|---|")
    for name, model in models.items():
        modules = [m for _, m in model.named_modules()]
        firsts = {which: [walk(m) for m in modules] for which, walk in walks.items()}
        objects = {which: sum(r.objects_visited for r in results) for which, results in firsts.items()}
        counts = {which: sum(len(r.refs) for r in results) for which, results in firsts.items()}
        assert objects["old"] == objects["new"] and counts["old"] == counts["new"], (objects, counts)
        # Same refs, in the same order, with the same fingerprints: the trees must agree before they are compared.
        found = {
            w: [(ref.path, ref.fingerprint.key, ref.restorable) for r in rs for ref in r.refs]
            for w, rs in firsts.items()
        }
        assert found["old"] == found["new"], name
        known = [frozenset(ref.path for ref in r.refs) for r in firsts["new"]]
        del firsts
        for mode in ("full", "reload"):
            times: dict[str, list[float]] = {"old": [], "new": []}
            kept: dict[str, Any] = {"old": None, "new": None}
            for round_ in range(args.rounds + 1):
                order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
                for which in order:
                    walk = walks[which]
                    kept[which] = None  # the previous round's results go now, as a caller replacing them
                    gc.collect()
                    t0 = time.process_time()
                    if mode == "full":
                        kept[which] = [walk(m) for m in modules]
                    else:
                        kept[which] = [walk(m, skip_paths=k) for m, k in zip(modules, known, strict=True)]
                    if round_:  # the first round warms up
                        times[which].append(time.process_time() - t0)
            old, new = (objects["old"] / statistics.median(times[w]) for w in ("old", "new"))
            print(f"| {name} | {mode} | {objects['old']} | {old:,.0f} | {new:,.0f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
