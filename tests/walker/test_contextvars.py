"""A ContextVar is read for what ``get()`` returns in the current context: the value set there, or else the default
the variable was made with. No path can name either, so a device tensor in one makes the layer untrackable."""

from __future__ import annotations

import contextvars

import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, Status
from graphsafe.collectors.walker import walk


class DefaultHeld(nn.Module):
    """A layer whose derived tensor lives only as the default of a ContextVar, which PWAL makes anew."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        self.cv = contextvars.ContextVar("w_t", default=self.weight.t().contiguous())  # noqa: B039  # the case


def test_the_walker_sees_a_tensor_held_as_a_contextvar_default() -> None:
    result = walk(DefaultHeld())
    assert any("ContextVar" in note for note in result.notes), result.notes


def test_a_contextvar_without_a_value_or_default_is_nothing_to_see() -> None:
    layer = nn.Module()
    layer.cv = contextvars.ContextVar("empty")
    assert walk(layer).notes == ()


def test_a_reload_that_replaces_a_contextvar_default_does_not_commit() -> None:
    layer = DefaultHeld()
    contract = GraphContract(layer, "recapture").seal()
    with contract.reload():
        with torch.no_grad():
            layer.weight.copy_(torch.randn(4, 4))
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert [f.kind for f in outcome.problems] == [FindingKind.UNTRACKABLE]
