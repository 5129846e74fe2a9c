"""A registered graph input or output (``record_capture(..., ignore=[...])``) is never a finding, whatever else
claims its address: a model path that also holds it (a layer caching its last input), or an index built from
what an address held before the input was allocated there.

The kernel scan locates each word it reads by address; the registered inputs' own bytes are looked up first, so
a reload that drops the model's other reference to the input leaves no ``orphaned`` storage behind.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from _graph_tables import FakeGraph, kernel_row
from graphsafe import GraphContract, Status
from graphsafe.collectors import record_capture


class CachesInput(nn.Module):
    """A layer that keeps the last input it saw (a debug hook, a prefix cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x
        return x @ self.weight


def _table(*tensors: torch.Tensor) -> dict[str, Any]:
    return {"root": 1, "graphs": {"1": [kernel_row(*tensors, name="mul")]}}


def test_a_registered_input_a_model_path_also_holds_is_no_finding_once_the_path_lets_go(
    fake_cuda: dict[str, Any],
) -> None:
    model = CachesInput()
    x = torch.randn(2, 4)
    model(x)  # model.last is the static input
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    out = model(x)
    fake_cuda["table"] = _table(x, model.weight, out)
    fake_cuda["tensors"] = [x, model.weight, out]
    with record_capture(contract, name="g", graph=FakeGraph(), ignore=[x, out]):
        pass

    def load() -> None:
        with torch.no_grad():
            model.weight.copy_(torch.randn(4, 4))
        model(torch.randn(2, 4))  # an eager forward: the layer now caches another tensor

    with contract.reload():
        load()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
