"""An RL-style loop in plain PyTorch: capture once, then reload new weights every step and keep replaying.

Each step loads DIFFERENT weights (a new seed, as a trainer would publish), replays the captured graph on a
fresh batch, and checks it against an eager forward of a model built cold on those weights. graphsafe's adapter
does the rest: it restores derived tensors into the captured storage, or captures again when it must.

    python examples/rl_loop.py                                  # every zoo example, CUDA graphs if available
    python examples/rl_loop.py --example marlin_workspace --variant legacy --mode recapture --steps 20
    python examples/rl_loop.py --device cpu                     # no-graph fallback (same control flow)

Exits non-zero if any replay differs from the eager forward.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from graphsafe import ContractViolation, GraphContract
from graphsafe.adapters.torch import capture, run_reload
from graphsafe.testing.zoo import EXAMPLES, Example


def run(ex: Example, variant: str, mode: str, steps: int, device: torch.device) -> bool:
    model = ex.build(variant, device=device, seed=0)  # type: ignore[arg-type]
    static_x = ex.example_input(model)
    contract = GraphContract(model, mode)  # type: ignore[arg-type]
    graph = capture(contract, model, static_x)  # warm-up, seal, capture (records what the graph reads)
    statuses: dict[str, int] = {}
    ok = True
    start = time.perf_counter()
    for step in range(1, steps + 1):
        weights = ex.make_weights(model, seed=step)  # the trainer's new weights
        try:
            outcome = run_reload(contract, lambda weights=weights: ex.load_weights(model, weights))
        except ContractViolation as violation:  # strict mode: no replay after a reload it could not keep
            print(f"{ex.name:22s} {variant:8s} {mode:9s} step {step}: refused ({type(violation).__name__})")
            print("  " + str(violation).replace("\n", "\n  "))
            return False
        statuses[outcome.status.value] = statuses.get(outcome.status.value, 0) + 1

        static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator().manual_seed(step)).to(device))
        got = graph.replay()

        reference = ex.build(variant, device=device, seed=step)  # type: ignore[arg-type]
        with torch.no_grad():
            want = reference(static_x)
        if not torch.equal(got, want):
            ok = False
            diff = (got - want).abs().max().item()
            print(f"  step {step}: replay differs from eager (max |diff| {diff:.3g})")
    elapsed = time.perf_counter() - start
    kind = "cuda graph" if graph.uses_graph else "eager fallback"
    print(
        f"{ex.name:22s} {variant:8s} {mode:9s} {kind:14s} steps={steps} captures={graph.captures} "
        f"{statuses} {'OK' if ok else 'MISMATCH'} ({elapsed:.2f}s)"
    )
    return ok


def _default_mode(ex: Example, variant: str) -> str:
    """``migrate`` for legacy layers (graphsafe restores what their PWAL re-creates), ``strict`` for migrated ones
    (every migrated layer keeps what the graph reads at a declared path, a module-level cache's entry too)."""
    return "migrate" if variant == "legacy" else "strict"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--example", choices=sorted(EXAMPLES), help="one example (default: all)")
    parser.add_argument("--variant", choices=["legacy", "migrated"], default=None, help="default: both")
    parser.add_argument("--mode", choices=["strict", "recapture", "migrate"], default=None,
                        help="default: migrate for legacy, strict for migrated")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    names = [args.example] if args.example else list(EXAMPLES)
    variants = [args.variant] if args.variant else ["legacy", "migrated"]
    ok = True
    for name in names:
        for variant in variants:
            mode = args.mode or _default_mode(EXAMPLES[name], variant)
            ok &= run(EXAMPLES[name], variant, mode, args.steps, device)
    print("all replays equal eager" if ok else "SOME REPLAYS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
