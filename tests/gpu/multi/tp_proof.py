"""Multi-rank proof worker: a tensor-parallel toy model whose captured graph contains an all-reduce.

Run by ``torchrun --nproc-per-node 2 tests/gpu/multi/tp_proof.py SCENARIO`` (NCCL on GPUs), or with
``--device cpu`` (gloo, eager fallback) to exercise the control flow without GPUs. Each rank prints one line
``RESULT rank=<r> scenario=<s> ok=<bool> detail=<...>`` and exits 0 only when its checks passed.

Scenarios:
* ``clean``: declared derived tensors on every rank; a reload with new weights is COMMITTED on both ranks and the
  replayed graph equals an eager forward of a freshly built model.
* ``drift``: rank 1's layer declares nothing and its PWAL re-creates a derived tensor; mode ``recapture``: both
  ranks end NEEDS_RECAPTURE, both re-capture together (no deadlock in the all-reduce), replay equals eager.
* ``raise``: rank 1's PWAL raises; both ranks raise (rank 0 a RankAgreementError naming rank 1) and neither
  replays.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import graphsafe
from graphsafe.adapters.distributed import agreement
from graphsafe.adapters.torch import capture, run_reload

HIDDEN, FFN, TOKENS = 64, 128, 8


class TPBlock(nn.Module):
    """Column-parallel then row-parallel linear with the all-reduce inside the forward."""

    def __init__(self, world: int, declared: bool, device: torch.device) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(FFN // world, HIDDEN, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(HIDDEN, FFN // world, device=device), requires_grad=False)
        self.declared = declared
        self.fail_next_pwal = False

    def process_weights_after_loading(self) -> None:
        if self.fail_next_pwal:
            raise RuntimeError("simulated PWAL failure on this rank")
        # Derived tensors re-created on every reload: a transposed copy and a per-shard scale.
        self.w2_t = self.w2.t().contiguous()
        self._w1_scale = self.w1.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
        if self.declared:
            graphsafe.register_derived(self, "w2_t", derived_from="w2")
            graphsafe.register_derived(self, "_w1_scale", derived_from="w1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ (self.w1 / self._w1_scale).t())
        y = h @ self.w2_t
        dist.all_reduce(y)
        return y


def weights(seed: int, rank: int, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(FFN, HIDDEN, generator=gen)
    w2 = torch.randn(HIDDEN, FFN, generator=gen)
    rows = FFN // world
    return {
        "w1": w1[rank * rows : (rank + 1) * rows].to(device),
        "w2": w2[:, rank * rows : (rank + 1) * rows].contiguous().to(device),
    }


def load(block: TPBlock, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        block.w1.data.copy_(state["w1"])
        block.w2.data.copy_(state["w2"])
    block.process_weights_after_loading()


def build(seed: int, rank: int, world: int, declared: bool, device: torch.device) -> TPBlock:
    block = TPBlock(world, declared, device)
    load(block, weights(seed, rank, world, device))
    return block


def run(scenario: str, device_kind: str, timeout: float) -> tuple[bool, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_kind == "cuda":
        device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    declared = not (scenario == "drift" and rank == 1)
    mode = "recapture" if scenario == "drift" else "strict"
    block = build(0, rank, world, declared, device)
    contract = graphsafe.GraphContract(block, mode)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7)).to(device)
    graph = capture(contract, block, x, warmup=3, use_graph=device.type == "cuda")
    first = graph.replay().clone()
    eager0 = block(x.clone())
    if not torch.equal(first, eager0):
        return False, "replay before any reload differs from eager"

    if scenario == "raise":
        block.fail_next_pwal = rank == 1
        try:
            run_reload(
                contract, lambda: load(block, weights(1, rank, world, device)), agreement=agreement(timeout=timeout)
            )
        except graphsafe.RankAgreementError as exc:
            ok = rank == 0 and "rank" in str(exc) and "1" in str(exc)
            refused = _replay_refused(graph)
            first_line = str(exc).splitlines()[0]
            return ok and refused, f"rank 0 raised RankAgreementError: {first_line}; replay refused={refused}"
        except RuntimeError as exc:
            refused = _replay_refused(graph)
            return rank == 1 and "simulated" in str(exc) and refused, f"raised {exc!r}; replay refused={refused}"
        return False, "the reload did not raise"

    captures_before = graph.captures
    outcome = run_reload(
        contract, lambda: load(block, weights(1, rank, world, device)), agreement=agreement(timeout=timeout)
    )
    expected = graphsafe.Status.COMMITTED if scenario == "clean" else graphsafe.Status.NEEDS_RECAPTURE
    # rank_statuses holds each rank's LOCAL status; the agreed one is the worst of them, the same on every rank.
    statuses = dict(outcome.rank_statuses)
    local_expected = {r: graphsafe.Status.COMMITTED for r in range(world)}
    if scenario == "drift":
        local_expected[1] = graphsafe.Status.NEEDS_RECAPTURE
    if outcome.status is not expected or statuses != local_expected:
        return False, f"agreed {outcome.status}, local {statuses}; expected {expected}, local {local_expected}"
    recaptured = graph.captures - captures_before
    if scenario == "clean" and recaptured:
        return False, "a clean reload recaptured"
    if scenario == "drift" and recaptured != 1:
        return False, f"expected one recapture, saw {recaptured}"
    graph.output.fill_(float("nan"))  # poison: the replay must overwrite every element
    replayed = graph.replay().clone()
    fresh = build(1, rank, world, True, device)
    eager = fresh(x.clone())
    if not torch.equal(replayed, eager):
        return False, f"replay differs from eager on new weights (max err {(replayed - eager).abs().max().item()})"
    if torch.equal(replayed, first):
        return False, "the new weights did not change the output (test could not fail)"
    return True, f"{outcome.status.value} on ranks {sorted(statuses)}, recaptures={recaptured}, replay == eager"


def _replay_refused(graph: object) -> bool:
    try:
        graph.replay()  # type: ignore[attr-defined]
    except graphsafe.NotServingSafeError:
        return True
    return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["clean", "drift", "raise"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    start = time.monotonic()
    try:
        ok, detail = run(args.scenario, args.device, args.timeout)
    except Exception as exc:  # report, never hang
        ok, detail = False, f"unexpected {exc!r}"
    # One write per line, so the ranks' results cannot interleave within a line.
    line = f"RESULT rank={dist.get_rank()} scenario={args.scenario} ok={ok} seconds={time.monotonic() - start:.2f} "
    os.write(1, (line + f"detail={detail}\n").encode())
    # A store barrier (no NCCL op after a failed reload), then a hard exit: tearing down NCCL communicators
    # that captured graphs still reference can block at interpreter exit, and the proof is already reported.
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + 30
    try:
        store.add("graphsafe-proof-done", 1)
        while int(store.add("graphsafe-proof-done", 0)) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # rank 0 hosts the store and leaves only once every rank has arrived
        pass
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
