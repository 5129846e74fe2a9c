"""``GraphContract(model, devices=[...])``: a device list that matches none of the model's tensors (a rank and
local-rank mix-up, ``cuda:1`` for a model on ``cuda:0``) is refused at seal with one line, instead of sealing only
the declared slots and committing reloads that rebind the parameters the graphs read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, GraphSafeError, graph_visible


class Declared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.process_weights_after_loading()

    @graph_visible("w_t")
    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight.t().contiguous()


@pytest.mark.parametrize("devices", [["cuda:1"], ["cuda"], "meta"])
def test_a_device_list_matching_no_tensor_of_the_model_is_refused_at_seal(devices: list[str] | str) -> None:
    model = Declared()
    contract = GraphContract(model, "strict", devices=devices)
    with pytest.raises(GraphSafeError) as raised:
        contract.seal()
    message = str(raised.value)
    assert "\n" not in message
    assert "devices=" in message and "cpu" in message and "Declared" in message


def test_a_device_list_matching_the_model_seals() -> None:
    layer = Declared()
    contract = GraphContract(layer, "strict", devices=["cpu"]).seal()
    assert contract.serving_safe
