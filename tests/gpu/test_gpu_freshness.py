"""Freshness on a real device: value samples taken in one batch per snapshot step and compared after one transfer.

A model of several layers whose PWAL writes its derived tensors in place (a kernel migrated to stable storage), in
four dtypes, one of them large enough to be sampled with a stride. Each reload loads other weights; PWAL refreshes
every slot except a chosen few, and each refresh may change a single bit of one element. The oracle is the choice
itself: exactly the slots left alone are ``stale``, whole-model and layer by layer, and a committed reload replays
the captured graph equal to eager.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadFailedError, Status, graph_visible

_DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.int8)
_LARGE = 4096 * 3 + 5  # elements of the large slot: sampled with a stride


class _Layer(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(64, device=device), requires_grad=False)
        self.leave: set[str] = set()  # slots the next PWAL leaves alone
        self.bit_only: set[str] = set()  # slots the next PWAL changes by one bit of one element

    @graph_visible("s0", "s1", "s2", "s3", "big")
    def process_weights_after_loading(self) -> None:
        w = self.weight
        fresh = {f"s{i}": (w * (i + 1)).to(dtype) for i, dtype in enumerate(_DTYPES)}
        fresh["big"] = w.repeat(_LARGE // 64 + 1)[:_LARGE] + 0.5
        if not hasattr(self, "s0"):
            for name, value in fresh.items():
                setattr(self, name, value)
            return
        for name, value in fresh.items():
            if name in self.leave:
                continue
            slot = getattr(self, name)
            if name in self.bit_only:
                raw = slot.view(torch.uint8)
                raw[0] ^= 1  # one bit of the first element (always sampled)
            else:
                slot.copy_(value)


class _Model(nn.Module):
    def __init__(self, device: torch.device, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(device) for _ in range(layers))

    def forward(self) -> torch.Tensor:
        total = torch.zeros((), device=self.layers[0].weight.device)
        for layer in self.layers:
            for name in ("s0", "s1", "s2", "s3", "big"):
                total = total + getattr(layer, name).float().sum()
        return total


def _reload(model: _Model, contract: GraphContract, value: float, *, layerwise: bool) -> Status:
    try:
        with torch.no_grad(), contract.reload(layerwise=layerwise) as txn:
            for layer in model.layers:
                if layerwise:
                    txn.before_layer(layer)
                layer.weight.fill_(value)
                layer.process_weights_after_loading()
                if layerwise:
                    txn.after_layer(layer)
    except ReloadFailedError:
        pass
    assert contract.last_outcome is not None
    return contract.last_outcome.status


def _capture(model: _Model, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        model()  # warm-up off the capture stream
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model()
    return graph, out


def _replays_eager(graph: torch.cuda.CUDAGraph, out: torch.Tensor, model: _Model, device: torch.device) -> bool:
    graph.replay()
    torch.cuda.synchronize(device)
    return torch.equal(out, model())


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-model", "layerwise"])
def test_exactly_the_slots_pwal_left_alone_are_stale_on_the_device(device: torch.device, layerwise: bool) -> None:
    rng = random.Random(7)
    model = _Model(device)
    for layer in model.layers:
        layer.process_weights_after_loading()
    graph, out = _capture(model, device)
    # Value samples judge every reload after the first (a recording would see a one-bit write as partial).
    contract = GraphContract(model, "recapture", detect="declared-only", record_reloads="first").seal()
    names = ("s0", "s1", "s2", "s3", "big")
    assert _reload(model, contract, 1.0, layerwise=layerwise) is Status.COMMITTED  # the recording reload
    stale_steps = 0
    for step in range(8):
        left: set[tuple[str, str]] = set()
        for index, layer in enumerate(model.layers):
            layer.leave = {n for n in names if rng.random() < 0.05}
            layer.bit_only = {n for n in names if n not in layer.leave and rng.random() < 0.3}
            left |= {(f"layers.{index}", n) for n in layer.leave}
        status = _reload(model, contract, 2.0 + step, layerwise=layerwise)
        outcome = contract.last_outcome
        assert outcome is not None
        found = {(f.layer, f.path) for f in outcome.findings if f.kind is FindingKind.STALE}
        assert found == left, (step, found ^ left)
        assert (status is Status.COMMITTED) == (not left)
        if not left:
            assert _replays_eager(graph, out, model, device)
            continue
        stale_steps += 1
        # Make the model whole again without the contract (every slot refreshed), recapture and reseal.
        with torch.no_grad():
            for layer in model.layers:
                layer.leave, layer.bit_only = set(), set()
                layer.weight.fill_(10.25 + step)
                layer.process_weights_after_loading()
        graph, out = _capture(model, device)
        contract.reseal(recaptured=True)
        assert _replays_eager(graph, out, model, device)
    assert 0 < stale_steps < 8  # both kinds of step were seen


class _Wide(nn.Module):
    """One large bf16 weight and a slot derived from it; PWAL can skip the recompute (``skip``)."""

    def __init__(self, device: torch.device, numel: int = 1 << 24) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16, device=device), requires_grad=False)
        self.skip = False

    @graph_visible("scaled")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "scaled"):
            self.scaled = self.weight * 2
        elif not self.skip:
            self.scaled.copy_(self.weight * 2)


def test_a_weight_change_the_sample_skips_is_seen_by_the_digest_without_a_copy_of_the_weight(
    device: torch.device,
) -> None:
    """A 32 MiB weight: its 256-element sample skips element 1. A loader that writes only element 1 through
    ``.data`` while PWAL skips the recompute is ``stale`` (the digest of every byte sees it); a reload that writes
    every element commits. The digest reads the weight in place: the reload's peak memory stays within the derived
    slot's new tensor and the digests (far below another copy of the weight)."""
    layer = _Wide(device)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    with torch.no_grad(), contract.reload():  # the recording reload
        layer.weight.fill_(1.0)
        layer.process_weights_after_loading()
    layer.skip = True
    with pytest.raises(ReloadFailedError), torch.no_grad(), contract.reload():
        layer.weight.data[1] = 5.0
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None
    assert {(f.layer, f.path) for f in outcome.findings if f.kind is FindingKind.STALE} == {("", "scaled")}
    contract.reseal(recaptured=True)  # no graph here: the reseal stands in for a recapture
    layer.skip = False
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    with torch.no_grad(), contract.reload():
        layer.weight.fill_(3.0)
        layer.process_weights_after_loading()
    torch.cuda.synchronize(device)
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.COMMITTED
    weight_bytes = layer.weight.numel() * layer.weight.element_size()
    # PWAL's temporary (weight * 2) is one weight's size; anything else the contract adds must be small.
    assert torch.cuda.max_memory_allocated(device) - start < weight_bytes * 1.2
    assert torch.equal(layer.scaled, layer.weight * 2)
