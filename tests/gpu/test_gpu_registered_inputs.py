"""On a GPU, with the kernel scan: a registered static input is never a finding, whatever claimed its address.

The caching allocator hands a freed block of the same size straight back, so a static input allocated right after
a float8 tensor of the same byte size was freed lands on the float8 tensor's address; and a layer that caches the
last input it saw holds the static input at a model path. Neither may make a reload report the input
``orphaned`` (``ignore=`` wins over what else claims the address).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, Status
from graphsafe.collectors import kernel_scan_unavailable, record_capture


class CachesInput(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x
        return self.proj(x) * x


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_static_input_on_a_freed_float8_address_and_cached_by_the_model_is_no_finding(
    device: torch.device, mode: str
) -> None:
    why = kernel_scan_unavailable()
    if why is not None:
        pytest.skip(why)
    width = 256
    model = CachesInput(width).to(device=device, dtype=torch.bfloat16).eval()
    scratch = torch.empty(width, width, dtype=torch.float8_e4m3fn, device=device)  # 65,536 bytes
    address = scratch.data_ptr()
    del scratch
    static_input = torch.randn(width // 2, width, dtype=torch.bfloat16, device=device)  # 65,536 bytes
    if static_input.data_ptr() != address:
        pytest.skip("the allocator did not hand the freed block back")
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_input)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with (
        torch.no_grad(),
        record_capture(contract, name="g", graph=graph, backend="kernel", ignore=[static_input]),
        torch.cuda.graph(graph),
    ):
        out = model(static_input)
    graph.replay()
    with contract.reload(), torch.no_grad():
        model.proj.weight.copy_(torch.randn_like(model.proj.weight))
        model(torch.randn_like(static_input))  # eager: the layer now caches another tensor
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    static_input.normal_()
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        expected = model.proj(static_input) * static_input
    torch.testing.assert_close(out, expected)
