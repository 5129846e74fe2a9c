"""On the GPU, a read no model path feeds is a finding under both backends, and a vouched fixed table is not:
the kernel scan and the dispatch recorder agree on a module-level cache entry PWAL replaced while a rollback list
keeps the old one alive, unwritten (``stale``: nothing tells it from an entry PWAL skipped, which a recapture would
read), on one PWAL writes in place (``orphaned``: a recapture reads it), and on a fixed external table vouched for
with ``vouch_fixed`` (commits)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, ReloadFailedError
from graphsafe.adapters.torch import run_reload
from graphsafe.collectors import record_capture
from graphsafe.outcome import FindingKind, Status

_CACHE: dict[int, torch.Tensor] = {}
_ROLLBACK: list[torch.Tensor] = []


class Cached(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64, device=device), requires_grad=False)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        old = _CACHE.get(id(self))
        if old is not None:
            _ROLLBACK.append(old)
        _CACHE[id(self)] = self.weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _CACHE[id(self)]


def _capture(contract: GraphContract, layer: nn.Module, x: torch.Tensor, backend: str) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.no_grad(), record_capture(contract, ignore=[x], graph=graph, backend=backend), torch.cuda.graph(graph):
        layer(x)
    return graph


@pytest.mark.parametrize("in_place", [False, True], ids=["replaced-kept-alive", "written-in-place"])
@pytest.mark.parametrize("backend", ["kernel", "dispatch"])
def test_an_unowned_cache_entry_is_stale_unless_the_reload_wrote_it_under_both_backends(
    device: torch.device, backend: str, in_place: bool
) -> None:
    layer = Cached(device)
    x = torch.randn(8, 64, device=device)
    contract = GraphContract(layer, "recapture").seal()
    _capture(contract, layer, x, backend)

    def load() -> None:
        with torch.no_grad():
            layer.weight.copy_(torch.randn(64, 64, device=device))
            if in_place:
                _CACHE[id(layer)].copy_(layer.weight.t())
            else:
                layer.process_weights_after_loading()

    with contextlib.suppress(ReloadFailedError):
        run_reload(contract, load)
    outcome = contract.last_outcome
    assert outcome is not None
    if in_place:
        assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
        assert FindingKind.ORPHANED in {f.kind for f in outcome.problems}
    else:
        assert outcome.status is Status.FAILED, outcome.summary()
        assert FindingKind.STALE in {f.kind for f in outcome.problems}


@pytest.mark.parametrize("backend", ["kernel", "dispatch"])
def test_a_vouched_fixed_table_commits_under_both_backends(device: torch.device, backend: str) -> None:
    layer = Cached(device)
    x = torch.randn(8, 64, device=device)
    contract = GraphContract(layer, "strict").seal()
    _capture(contract, layer, x, backend)
    contract.manifest.vouch_fixed(_CACHE[id(layer)])
    outcome = run_reload(contract, lambda: None)
    assert outcome.status is Status.COMMITTED, outcome.summary()
