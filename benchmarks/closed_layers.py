"""What a layerwise reload's contract costs per layer kind, for the closed layers' late-write check: every layer
``after_layer()`` closes has its own parameters and buffers sampled and digested at the close and compared when
the reload finishes (a weight written with other values after its close leaves what PWAL computed stale).

    PYTHONPATH=src python3 benchmarks/closed_layers.py [--device cpu|cuda] [--layers 32] [--rounds 8]
    python3 benchmarks/closed_layers.py --trees OLD NEW [...]     # the same, each tree's src/ in turn

A model of linear-shaped layers (a 1024x1024 weight and a bias each), in three kinds: PWAL computes nothing (the
check's whole cost: nothing else watched the weights); PWAL keeps a fixed table (declared static); PWAL keeps a
derived copy of the weight (declared: its inputs, the weight and the bias, were watched after the close already).
Each reloads layerwise with other weights, kinds in rounds alternating; reported: contract ms per reload (the
reload's wall time less the same load and PWAL run without a contract, in the same round), median over rounds.
With ``--trees``, each tree's ``src/`` runs this file in its own process, rounds alternating between the trees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

KINDS = {"none": "PWAL computes nothing", "static": "a static table", "derived": "a derived copy of the weight"}


class _Layer(nn.Module):
    def __init__(self, device: torch.device, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1024, 1024, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(1024, device=device), requires_grad=False)
        self.kind = kind

    def process_weights_after_loading(self) -> None:
        from graphsafe import register_derived

        if self.kind == "static" and not hasattr(self, "table"):
            self.table = torch.arange(256, dtype=torch.float32, device=self.weight.device)
            register_derived(self, "table", static=True)
        if self.kind == "derived":
            if not hasattr(self, "scaled"):
                self.scaled = torch.empty_like(self.weight)
                register_derived(self, "scaled", derived_from=("weight", "bias"))
            with torch.no_grad():
                self.scaled.copy_(self.weight * 2 + self.bias)


def _load(layer: nn.Module, step: int) -> None:
    with torch.no_grad():
        layer.weight.fill_(float(step))
        layer.bias.fill_(float(step))
    layer.process_weights_after_loading()


def _reload(model: nn.Sequential, contract: object | None, step: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if contract is None:
        for layer in model:
            _load(layer, step)
    else:
        with contract.reload(layerwise=True) as txn:  # type: ignore[attr-defined]
            for layer in model:
                txn.before_layer(layer)
                _load(layer, step)
                txn.after_layer(layer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(device: torch.device, layers: int, rounds: int) -> dict[str, float]:
    """Contract ms per reload for each kind, median over ``rounds`` (after one round of warm-up)."""
    from graphsafe import GraphContract

    models = {}
    for kind in KINDS:
        model = nn.Sequential(*[_Layer(device, kind) for _ in range(layers)])
        for layer in model:
            layer.process_weights_after_loading()
        models[kind] = model
    contracts = {kind: GraphContract(model, "strict").seal() for kind, model in models.items()}
    costs: dict[str, list[float]] = {kind: [] for kind in KINDS}
    order = list(KINDS)
    step = 1
    for index in range(rounds + 1):
        for kind in order if index % 2 else order[::-1]:
            step += 1
            plain = _reload(models[kind], None, step, device)
            step += 1
            guarded = _reload(models[kind], contracts[kind], step, device)
            outcome = contracts[kind].last_outcome
            assert outcome is not None and outcome.committed, outcome
            if index:
                costs[kind].append((guarded - plain) * 1e3)
    return {kind: statistics.median(found) for kind, found in costs.items()}


def _table(columns: list[tuple[str, dict[str, float]]]) -> None:
    print("| layer kind | " + " | ".join(f"{name}, contract ms per reload" for name, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for kind, label in KINDS.items():
        print(f"| {label} | " + " | ".join(f"{figures[kind]:.2f}" for _, figures in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one tree's figures, for --trees
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.json:
        print(json.dumps(measure(device, args.layers, args.rounds // 2 or 1)))
        return
    print(f"device {device}, {args.layers} layers, {args.rounds} rounds")
    if not args.trees:
        _table([("this tree", measure(device, args.layers, args.rounds))])
        return
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for index in range(2):  # two processes a tree, alternating which goes first
        for tree in args.trees if index % 2 == 0 else args.trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
            command = [sys.executable, __file__, "--json", "--device", args.device, "--layers", str(args.layers)]
            out = subprocess.run([*command, "--rounds", str(args.rounds)], env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{tree}: {out.stderr.strip()}")
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    merged = {tree: {kind: statistics.median(r[kind] for r in found) for kind in KINDS} for tree, found in runs.items()}
    old, new = args.trees
    _table([(f"OLD {old}", merged[old]), (f"NEW {new}", merged[new])])
    for kind, label in KINDS.items():
        print(
            f"{label}: NEW/OLD {merged[new][kind] / merged[old][kind]:.2f}, NEW-OLD per layer "
            f"{(merged[new][kind] - merged[old][kind]) / args.layers * 1e3:+.1f} us"
        )


if __name__ == "__main__":
    main()
