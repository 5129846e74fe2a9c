"""What torch's own hooks recompute before every forward is no undeclared drift.

``torch.nn.utils.weight_norm`` (and ``spectral_norm``) keep the layer's ``weight`` as a plain attribute that a
forward pre-hook recomputes from ``weight_g`` and ``weight_v`` before every forward, inside a captured graph too:
the graph writes it before it reads it. graphsafe knows the hook, so the attribute is a declared static slot
(declared by torch, say the findings): a reload that re-creates it (an eager forward) is restored by a copy in
every mode, and one that leaves it stale is right too (the next forward, eager or replayed, recomputes it).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, ReloadOutcome, Status
from graphsafe.outcome import Origin

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers


def reload(contract: GraphContract, body: Any) -> ReloadOutcome:
    with contract.reload():
        body()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def _normed(kind: str) -> nn.Linear:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old hook API is deprecated, still in use
        layer = nn.Linear(4, 4)
        layer = nn.utils.weight_norm(layer) if kind == "weight_norm" else nn.utils.spectral_norm(layer)
    layer.eval()
    layer(torch.randn(2, 4))
    return layer


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_weight_norm_by_product_re_created_by_a_forward_commits(kind: str, mode: str) -> None:
    layer = _normed(kind)
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    origins = {s.path: s.origin for s in contract.slots()}
    assert origins["weight"] is Origin.DECLARED
    x = torch.randn(2, 4)

    def load() -> None:
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(1)
        layer(x)  # the pre-hook binds a new weight

    outcome = reload(contract, load)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_weight_norm_reload_without_a_forward_commits(mode: str) -> None:
    layer = _normed("weight_norm")
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]

    def load() -> None:
        with torch.no_grad():
            layer.weight_v.add_(1)

    outcome = reload(contract, load)
    assert outcome.status is Status.COMMITTED, outcome.summary()


# ----------------------------------------------------------------------------------------------------
# A nested-tensor buffer (torch.nested, strided layout): its buffer is one storage
# ----------------------------------------------------------------------------------------------------


def _with_nested() -> nn.Linear:
    layer = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided nested layout is a prototype
        layer.register_buffer("table", torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)]))
    return layer


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_nested_buffer_left_in_place_commits(mode: str) -> None:
    layer = _with_nested()
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    assert {s.path: s.origin for s in contract.slots()}["table"] is Origin.BUFFER
    new = torch.randn(4, 4)

    def load() -> None:
        with torch.no_grad():
            layer.weight.copy_(new)
            layer.table.mul_(2)  # written in place: the captured buffer holds the new values

    outcome = reload(contract, load)
    assert outcome.status is Status.COMMITTED, outcome.summary()


def test_a_nested_buffer_replaced_is_respecified_not_committed() -> None:
    layer = _with_nested()
    contract = GraphContract(layer, "recapture").seal()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        new = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    outcome = reload(contract, lambda: setattr(layer, "table", new))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert [f.path for f in outcome.problems] == ["table"]
