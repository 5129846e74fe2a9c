"""The fast tier of a restore step (``contract._fast``): taken on the common whole-model reload, handed over to the
rule engine on any doubt, with the engine's outcome either way.

The differential fuzzer (``tests/fuzz/test_fuzz_fast_tier.py``) holds the two tiers to one verdict and the same bytes
over generated reloads; these pin the cases a user meets first: an engine-shaped layer whose PWAL rebuilds every
derived tensor (two of them views of one new tensor) is planned by the fast tier at every reload, and a captured
tensor PWAL hands to an attribute the contract does not track makes the step the engine's, which refuses to
write into it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import graphsafe.contract._steps as steps_module
from graphsafe import FindingKind, GraphContract, Status, register_derived
from graphsafe.errors import DeclaredDriftError


class Packed(nn.Module):
    """A layer whose PWAL re-creates its derived tensors as new tensors: a transposed copy, a scale, and two stride
    tables that are views of one new tensor (vLLM's CUTLASS MoE packs them so)."""

    def __init__(self, seed: int, spare: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))
        self.spare = spare  # PWAL keeps the old transposed copy at an attribute the contract does not track
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        if self.spare and hasattr(self, "weight_t"):
            self.old_t = self.weight_t
        w = self.weight.detach()
        self.weight_t = w.t().contiguous()
        self.scale = w.abs().amax(dim=1)
        strides = torch.tensor([[6, 1], [4, 1]], dtype=torch.int64) * (1 + int(w.sum() > 0))
        self.ab_strides, self.c_strides = strides[0], strides[1]
        for path in ("weight_t", "scale", "ab_strides", "c_strides"):
            register_derived(self, path)

    def forward(self) -> torch.Tensor:
        return self.weight_t.sum() * self.scale.sum() + self.ab_strides.sum() + self.c_strides.sum()


class Model(nn.Module):
    def __init__(self, layers: int = 3, spare: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Packed(seed, spare) for seed in range(layers))


def reload(contract: GraphContract, model: Model, seed: int) -> Any:
    try:
        with contract.reload():
            for index, layer in enumerate(model.layers):
                with torch.no_grad():
                    layer.weight.copy_(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 10 + index)))
                layer.process_weights_after_loading()
    except DeclaredDriftError:
        pass  # strict: the outcome says what
    return contract.last_outcome


@pytest.fixture
def fast_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    taken: list[bool] = []
    plan_common = steps_module.plan_common

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = plan_common(*args, **kwargs)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(steps_module, "plan_common", spy)
    return taken


def addresses(model: Model) -> list[int]:
    return [
        getattr(layer, path).data_ptr()
        for layer in model.layers
        for path in ("weight", "weight_t", "scale", "ab_strides", "c_strides")
    ]


@pytest.mark.parametrize("detect", ["declared-only", "sealed-paths"])
def test_the_fast_tier_plans_every_common_reload_and_keeps_every_address(fast_steps: list[bool], detect: str) -> None:
    model = Model()
    contract = GraphContract(model, "strict", detect=detect).seal()  # type: ignore[arg-type]
    sealed = addresses(model)
    for seed in (1, 2, 3):
        outcome = reload(contract, model, seed)
        assert outcome.status is Status.COMMITTED, outcome.summary()
        assert addresses(model) == sealed
        cold = Packed(0)
        for index, layer in enumerate(model.layers):  # values a cold build on the same weights has
            cold.weight.data.copy_(layer.weight)
            cold.process_weights_after_loading()
            for path in ("weight_t", "scale", "ab_strides", "c_strides"):
                assert torch.equal(getattr(layer, path), getattr(cold, path)), (seed, index, path)
    assert fast_steps == [True, True, True]


def test_a_captured_tensor_pwal_keeps_elsewhere_hands_the_step_to_the_rule_engine(fast_steps: list[bool]) -> None:
    outcomes = []
    for fast in (True, False):
        model = Model(layers=2, spare=True)
        contract = GraphContract(model, "strict", detect="declared-only")
        contract.fast_tier = fast
        contract.seal()
        kept = model.layers[1].weight_t
        outcome = reload(contract, model, 1)
        assert model.layers[1].old_t is kept
        outcomes.append((outcome.status, sorted((f.kind, f.layer, f.path) for f in outcome.findings)))
    assert fast_steps == [False]  # asked once (the fast run), and it handed over
    assert outcomes[0] == outcomes[1]
    status, findings = outcomes[0]
    assert status is Status.FAILED
    assert (FindingKind.ALIAS_BROKEN, "layers.1", "weight_t") in findings
