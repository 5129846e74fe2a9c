"""What the departure hooks cost a module registration while a reload is open (a version read and a digest of every
departing captured parameter's bytes), beside the repack a PWAL does to make the new parameter.

    PYTHONPATH=src python3 benchmarks/departures.py [--device cpu|cuda] [--rounds 8]

Every captured parameter of a model of linear layers is replaced by a new one (``layer.weight = nn.Parameter(...)``:
what a repacking PWAL or a rebinding loader does), with a :class:`Departures` entered (a reload open) and without
(the hooks, installed at import, find no open reload), rounds alternating; then a repack of each parameter
(``w.t().contiguous()``, the least a repacking PWAL does per replaced parameter). Host time per registration (median
over rounds); on CUDA the digest and the repack are launches, timed to their host return as the hook and PWAL pay them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

from graphsafe.contract._departures import Departures
from graphsafe.contract._tensorref import TensorRef

SHAPES = (((64, 64), 2000), ((4096, 1024), 50))


def _per_registration(model: nn.Sequential, news: list[nn.Parameter], open_reload: bool) -> float:
    refs = {id(layer.weight): TensorRef.of(layer.weight) for layer in model}
    olds = [layer.weight for layer in model]
    departures = Departures(lambda: refs, contextlib.nullcontext)
    start = time.perf_counter()
    with departures if open_reload else contextlib.nullcontext():
        for layer, new in zip(model, news, strict=True):
            layer.weight = new
    seconds = time.perf_counter() - start
    for layer, old in zip(model, olds, strict=True):
        layer.weight = old
    return seconds / len(news) * 1e6


def _per_repack(model: nn.Sequential) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for layer in model:
            layer.weight.t().contiguous()
    return (time.perf_counter() - start) / len(model) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    print("| parameter | count | us/registration, no reload open | reload open (with the digest) | a repack each |")
    print("|---|---|---|---|---|")
    for (rows, cols), count in SHAPES:
        model = nn.Sequential(*[nn.Linear(cols, rows, bias=False, device=device) for _ in range(count)])
        model.requires_grad_(False)
        news = [nn.Parameter(torch.zeros(rows, cols, device=device), requires_grad=False) for _ in range(count)]
        timings: dict[bool, list[float]] = {True: [], False: []}
        repacks: list[float] = []
        for index in range(args.rounds):
            open_reload = index % 2 == 0
            timings[open_reload].append(_per_registration(model, news, open_reload))
            repacks.append(_per_repack(model))
        off, on, sample = (statistics.median(x) for x in (timings[False], timings[True], repacks))
        print(f"| {rows}x{cols} | {count} | {off:.1f} | {on:.1f} | {sample:.1f} |")


if __name__ == "__main__":
    main()
