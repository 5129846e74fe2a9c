"""What a layerwise recording learns each slot is computed from (``_recording.InputIndex``).

Every ``after_layer()`` step walks back from the slots its layer's PWAL recomputed to the tensors the model holds.
The index of where the model holds each tensor is built once per reload and each step reads its own layers again:
a tensor the reload bound elsewhere after that (a scale on the root module, rebound between two layers' steps) must
still be found as an input, or later reloads would stop watching it. Here the scale lives on a plain holder module
(no parameters or buffers: no layer of its own) and is rebound to a new tensor of the same values between two
layers' steps, so layers after it read the new tensor.

Every reload loads different weights; the oracle is what the PWAL below reads (by construction) and a cold model's
values.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, ReloadFailedError, SlotRef, Status, register_derived


class _Layer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(seed)), requires_grad=False)
        self.skip = False

    def pwal(self, scale: torch.Tensor) -> None:
        if self.skip:  # an "already processed" guard
            return
        self.d = self.weight.detach() * scale
        register_derived(self, "d")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(1), _Layer(2), _Layer(3)])
        self.holder = nn.Module()
        self.holder.scale = torch.full((8,), 2.0)  # a plain attribute of a module under no layer
        for layer in self.layers:
            layer.pwal(self.holder.scale)

    def scale_of(self) -> torch.Tensor:
        return self.holder.scale


def _status(contract: GraphContract) -> Status:
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome.status


def _layerwise(contract: GraphContract, model: nn.Module, seed: int, between: Callable[[int], object]) -> Status:
    """Layerwise: each layer loaded and processed in its window, reading ``model.scale_of()``; ``between(index)``
    runs after layer ``index``'s step."""
    g = torch.Generator().manual_seed(seed)
    try:
        with contract.reload(layerwise=True) as txn, torch.no_grad():
            for index, layer in enumerate(model.layers):
                txn.before_layer(layer)
                layer.weight.copy_(torch.randn(8, generator=g))
                layer.pwal(model.scale_of())
                txn.after_layer(layer)
                between(index)
    except ReloadFailedError:
        pass
    return _status(contract)


def _reload(contract: GraphContract, model: _Model, seed: int, *, rebind_scale_after: int) -> Status:
    """The holder's scale rebound (a new tensor, the same values) after the step of layer ``rebind_scale_after``."""

    def between(index: int) -> None:
        if index == rebind_scale_after:
            model.holder.scale = model.holder.scale * 1

    return _layerwise(contract, model, seed, between)


@pytest.mark.parametrize("rebind_scale_after", [-1, 0, 1])
def test_an_input_rebound_outside_every_layer_between_two_steps_is_learnt(rebind_scale_after: int) -> None:
    model = _Model()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    assert _reload(contract, model, 5, rebind_scale_after=rebind_scale_after) is Status.COMMITTED
    learnt = contract.recorded_inputs()
    for index in range(3):
        assert set(learnt[SlotRef(f"layers.{index}", "d")]) == {
            SlotRef(f"layers.{index}", "weight"),
            SlotRef("holder", "scale"),
        }, learnt


@pytest.mark.parametrize("rebind_scale_after", [0, 1])
def test_a_skipped_rebuild_after_the_rebound_input_changed_is_not_committed(rebind_scale_after: int) -> None:
    """The recorded inputs then watch the new scale: a later reload that changes only the scale while the last
    layer's PWAL skips its rebuild leaves ``d`` stale."""
    model = _Model()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    assert _reload(contract, model, 5, rebind_scale_after=rebind_scale_after) is Status.COMMITTED
    last = model.layers[2]
    weight = last.weight.detach().clone()
    last.skip = True
    try:
        with contract.reload(), torch.no_grad():  # only the scale changes, in place; the last layer skips its rebuild
            model.holder.scale.fill_(5.0)
            for layer in model.layers[:2]:
                layer.pwal(model.holder.scale)
    except ReloadFailedError:
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert torch.equal(last.d, weight * 5.0), "COMMITTED while layers.2's d keeps values of the old scale"
