"""A tensor that is not there yet at seal (an uninitialised lazy parameter, a meta tensor) cannot be fingerprinted:
the seal would track the rest of the model and let a later rebind of it commit. Sealing such a model is refused in
one line that names the path and says to seal after the first forward (or load)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, GraphSafeError, Status


def lazy_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(4))


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
def test_a_lazy_module_before_its_first_forward_is_refused_at_seal(detect: str) -> None:
    model = lazy_model()
    contract = GraphContract(model, "recapture", detect=detect)  # type: ignore[arg-type]
    with pytest.raises(GraphSafeError) as raised:
        contract.seal()
    message = str(raised.value)
    assert "\n" not in message and "'1.weight'" in message and "first forward" in message
    assert not contract.serving_safe


def test_a_lazy_module_sealed_after_its_first_forward_is_tracked() -> None:
    model = lazy_model()
    model(torch.randn(2, 3))
    captured = model[1].weight
    contract = GraphContract(model, "recapture").seal()
    new = torch.randn(4, 3)
    with contract.reload():
        model[1].weight = nn.Parameter(new.clone())
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    assert model[1].weight is captured and torch.equal(captured, new)  # restored into what the graph reads


def test_a_meta_parameter_at_seal_is_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 4, device="meta"))
    with pytest.raises(GraphSafeError, match=r"'1\.weight'.*meta"):
        GraphContract(model, "recapture").seal()
