"""On a GPU, with the kernel scan: a tensor PWAL re-creates that no graph reads commits in every mode.

A debug copy of the weights, re-made by every PWAL and never read by the forward: the scan of the captured graph
is complete and none of its words points into the copy's memory, so its drift is an ``unread-drift`` record, not
``moved``. The replay after the reload reads the new weights (equal to eager).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, Status
from graphsafe.collectors import kernel_scan_unavailable, record_capture


class WithDebugCopy(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        self.debug = self.proj.weight.detach().clone()  # never read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_recreated_tensor_no_graph_reads_commits_and_replays_equal_eager(device: torch.device, mode: str) -> None:
    why = kernel_scan_unavailable()
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    model = WithDebugCopy(64).to(device).eval()
    model.process_weights_after_loading()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    x = torch.randn(8, 64, device=device)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with (
        torch.no_grad(),
        record_capture(contract, name="g", graph=graph, backend="kernel", ignore=[x]),
        torch.cuda.graph(graph),
    ):
        out = model(x)
    assert contract.manifest is not None and contract.manifest.complete, contract.manifest.truth()
    for _ in range(2):
        with contract.reload(), torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
            model.process_weights_after_loading()
        outcome = contract.last_outcome
        assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
        # migrate restores what it can, an unread tensor too (a harmless copy); the others report it
        expected = FindingKind.AUTO_RESTORED if mode == "migrate" else FindingKind.UNREAD_DRIFT
        assert [(f.path, f.kind) for f in outcome.findings] == [("debug", expected)]
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            torch.testing.assert_close(out, model(x))
