"""What the late-write check of a layer closed by ``after_layer()`` costs a layerwise reload: its own weights sampled
at the close and compared at ``finish()``, where PWAL left state no input judges (``ClosedLayer.opaque``).

    PYTHONPATH=src python3 benchmarks/closed_layers.py [--device cpu|cuda] [--layers 32] [--rounds 8]

A model of linear-shaped layers (a 1024x1024 weight and a bias each); PWAL keeps a fixed table per layer, declared
static, and where said a derived copy of the weight (declared: its inputs, the weight, are watched after the close
anyway). PWAL hangs a plain attribute on the table (the check watches the layer's weights) or not (it finds nothing
to watch and costs the scan alone). Every variant reloads layerwise with other weights, in rounds alternating;
reported: contract time per reload (the reload's wall time less the same load and PWAL run without a contract,
measured in the same round), median over rounds, and the difference per layer the attribute makes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from graphsafe import GraphContract, register_derived


class _Layer(nn.Module):
    def __init__(self, device: torch.device, flagged: bool, derived: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1024, 1024, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(1024, device=device), requires_grad=False)
        self.flagged = flagged
        self.derived = derived

    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "table"):
            self.table = torch.arange(256, dtype=torch.float32, device=self.weight.device)
            register_derived(self, "table", static=True)
        if self.flagged:
            self.table.fast = True
        if self.derived:
            if not hasattr(self, "scaled"):
                self.scaled = torch.empty_like(self.weight)
                register_derived(self, "scaled", derived_from=("weight", "bias"))
            with torch.no_grad():
                self.scaled.copy_(self.weight * 2 + self.bias)


def _model(device: torch.device, layers: int, flagged: bool, derived: bool) -> nn.Sequential:
    model = nn.Sequential(*[_Layer(device, flagged, derived) for _ in range(layers)])
    for layer in model:
        layer.process_weights_after_loading()
    return model


def _load(layer: nn.Module, step: int) -> None:
    with torch.no_grad():
        layer.weight.fill_(float(step))
        layer.bias.fill_(float(step))
    layer.process_weights_after_loading()


def _reload(model: nn.Sequential, contract: GraphContract | None, step: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if contract is None:
        for layer in model:
            _load(layer, step)
    else:
        with contract.reload(layerwise=True) as txn:
            for layer in model:
                txn.before_layer(layer)
                _load(layer, step)
                txn.after_layer(layer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    variants = [(flagged, derived) for derived in (False, True) for flagged in (False, True)]
    models = {variant: _model(device, args.layers, *variant) for variant in variants}
    contracts = {variant: GraphContract(model, "strict").seal() for variant, model in models.items()}
    costs: dict[tuple[bool, bool], list[float]] = {variant: [] for variant in variants}
    step = 1
    for index in range(args.rounds + 1):
        for variant in variants if index % 2 else variants[::-1]:
            step += 1
            plain = _reload(models[variant], None, step, device)
            step += 1
            guarded = _reload(models[variant], contracts[variant], step, device)
            outcome = contracts[variant].last_outcome
            assert outcome is not None and outcome.committed, outcome
            if index:  # the first round warms up
                costs[variant].append((guarded - plain) * 1e3)
    median = {variant: statistics.median(found) for variant, found in costs.items()}
    print(f"device {device}, {args.layers} layers, {args.rounds} rounds")
    print("| layer holds | contract ms per reload, no attribute | with the attribute | per layer watched |")
    print("|---|---|---|---|")
    for derived, label in ((False, "a static table"), (True, "a static table and a derived copy of the weight")):
        quiet, watched = median[(False, derived)], median[(True, derived)]
        print(f"| {label} | {quiet:.2f} | {watched:.2f} | {(watched - quiet) / args.layers * 1e3:+.1f} us |")


if __name__ == "__main__":
    main()
