"""GPU proof for slots read through a lazy bit (a negative or conjugate view): a PWAL that hands such slots each
other's captured tensors, or new ones, keeps a captured CUDA graph equal to the eager forward.

The restore used to clone its sources without the bit, and torch's grouped copy refuses a destination with the bit
and a source without it: the reload raised from inside the restore, with no outcome (the CPU twin is
tests/contract/test_unusual_tensors.py). Oracle: the eager forward of the model after the same reload; the
graph's output is poisoned with NaN before each replay.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, Status, register_derived

pytestmark = pytest.mark.gpu


def _lazy(values: torch.Tensor, bit: str) -> torch.Tensor:
    if bit == "neg":
        return torch._neg_view(values.clone())
    return values.to(torch.complex64).conj()


class LazySlots(nn.Module):
    """``n`` static slots read through a lazy bit; the forward sums ``x * s_i`` with a different weight per slot."""

    def __init__(self, bit: str, n: int, device: torch.device) -> None:
        super().__init__()
        self.n = n
        for i in range(n):
            setattr(self, f"s{i}", _lazy(torch.arange(8.0, device=device) + 10 * i, bit))
            register_derived(self, f"s{i}", static=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for i in range(self.n):
            out = out + (i + 1) * x * getattr(self, f"s{i}")
        return out


def _capture(model: nn.Module, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(x)
    return graph, out


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("bit", ["neg", "conj"])
@pytest.mark.parametrize("plan", ["swap", "rotate", "rotate-and-fresh"])
def test_a_permutation_of_lazy_bit_slots_replays_as_the_eager_forward(
    device: torch.device, bit: str, plan: str, layerwise: bool
) -> None:
    n = 3
    model = LazySlots(bit, n, device)
    x = torch.randn(8, device=device).to(torch.complex64 if bit == "conj" else torch.float32)
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    graph, out = _capture(model, x)
    captured = [getattr(model, f"s{i}") for i in range(n)]
    order = (1, 0, 2) if plan == "swap" else (1, 2, 0)
    new = [captured[j] for j in order]
    if plan == "rotate-and-fresh":  # a value the reload produced, not a captured tensor
        new[2] = _lazy(torch.arange(8.0, device=device) * -3 + 1, bit)
    with contract.reload(layerwise=layerwise) as txn:
        if layerwise:
            txn.before_layer(model)
        for i in range(n):
            setattr(model, f"s{i}", new[i])
        if layerwise:
            txn.after_layer(model)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome
    for i in range(n):
        assert getattr(model, f"s{i}").data_ptr() == captured[i].data_ptr(), f"s{i} left its captured memory"
    with torch.no_grad():
        want = model(x)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), (out, want)
