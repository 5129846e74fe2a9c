"""Derived-value freshness: a declared slot that PWAL skipped while its inputs changed is ``stale``.

An address check alone cannot see this fault: the slot is still at its captured storage, it just holds values
derived from the OLD weights. The contract compares each declared, non-static slot's tensor object and version
counter before and after PWAL, and the slot's inputs (``derived_from``, default: the layer's own parameters) by
storage identity, version counter and a strided value sample. Every test reloads DIFFERENT weights unless it is
about the same-weights case, and checks values against a model built cold on the new weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import pytest
import torch
from torch import nn

from graphsafe import (
    FindingKind,
    GraphContract,
    NotServingSafeError,
    ReloadFailedError,
    ReloadOutcome,
    Status,
    graph_visible,
    register_derived,
    stable_empty,
)

MODES = ("strict", "recapture", "migrate")
IN, OUT = 6, 4

Policy = Literal["rebuild", "in_place", "skip"]


# ----------------------------------------------------------------------------------------------------
# A layer with one derived slot per kind of input, and a PWAL whose behaviour each test picks per slot
# ----------------------------------------------------------------------------------------------------


@graph_visible("w_t", derived_from="weight")
def derive_w_t(layer: FreshLinear) -> None:
    """``w_t`` depends on ``weight`` only."""
    _derive(layer, "w_t", lambda: layer.weight.detach().t() * 2.0)


@graph_visible("bias_scaled", derived_from="bias")
def derive_bias_scaled(layer: FreshLinear) -> None:
    """``bias_scaled`` depends on ``bias`` only."""
    _derive(layer, "bias_scaled", lambda: layer.bias.detach() * 3.0)


@graph_visible("row_norm")
def derive_row_norm(layer: FreshLinear) -> None:
    """No ``derived_from``: its inputs are the layer's own parameters (``weight`` and ``bias``)."""
    _derive(layer, "row_norm", lambda: layer.weight.detach().abs().sum(1) + layer.bias.detach())


@graph_visible("lut", static=True)
def make_lut(layer: FreshLinear) -> None:
    """A lookup table that does not depend on the weights: built once, never touched again."""
    if getattr(layer, "lut", None) is None:
        layer.lut = torch.arange(OUT, dtype=torch.float32)


def _derive(layer: FreshLinear, name: str, compute: Callable[[], torch.Tensor]) -> None:
    policy = layer.policy.get(name, "rebuild")
    current = getattr(layer, name, None)
    if current is None or policy == "rebuild":
        setattr(layer, name, compute().contiguous())  # a NEW tensor: the contract copies it into the captured one
    elif policy == "in_place":
        current.copy_(compute())  # writes the captured tensor itself
    # policy == "skip": the "already processed, don't rebuild on reload" guard -- the bug under test


class FreshLinear(nn.Module):
    """``y = x @ w_t + bias_scaled + row_norm + lut``: every derived slot reaches the output."""

    weight: nn.Parameter
    bias: nn.Parameter
    w_t: torch.Tensor
    bias_scaled: torch.Tensor
    row_norm: torch.Tensor
    lut: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(OUT, IN), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(OUT), requires_grad=False)
        self.policy: dict[str, Policy] = {}

    def process_weights_after_loading(self) -> None:
        derive_w_t(self)
        derive_bias_scaled(self)
        derive_row_norm(self)
        make_lut(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_t + self.bias_scaled + self.row_norm + self.lut


class Model(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([FreshLinear() for _ in range(n_layers)])


DERIVED = ("w_t", "bias_scaled", "row_norm", "lut")


def weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}


# Loaders: how the new values reach the parameters. All of them then run PWAL on every layer.
Loader = Callable[[nn.Module, Mapping[str, torch.Tensor]], None]


def load_data_copy(model: nn.Module, new: Mapping[str, torch.Tensor]) -> None:
    """The upstream way: ``param.data.copy_`` (does NOT move the parameter's version counter)."""
    params = dict(model.named_parameters())
    for name, value in new.items():
        params[name].data.copy_(value)
    _pwal(model)


def load_param_copy(model: nn.Module, new: Mapping[str, torch.Tensor]) -> None:
    """``param.copy_`` under ``no_grad`` (moves the version counter)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in new.items():
            params[name].copy_(value)
    _pwal(model)


def load_replace(model: nn.Module, new: Mapping[str, torch.Tensor]) -> None:
    """Replace each parameter object (new storage)."""
    for name, value in new.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(value.clone(), requires_grad=False))
    _pwal(model)


def _pwal(model: nn.Module) -> None:
    for layer in model.layers:  # type: ignore[union-attr]
        layer.process_weights_after_loading()


def build(seed: int, n_layers: int = 2) -> Model:
    model = Model(n_layers)
    load_data_copy(model, weights(model, seed))
    return model


def values(model: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, name): getattr(layer, name).clone() for i, layer in enumerate(model.layers) for name in DERIVED}


def ptrs(model: nn.Module) -> dict[tuple[int, str], int]:
    return {(i, name): getattr(layer, name).data_ptr() for i, layer in enumerate(model.layers) for name in DERIVED}


def assert_matches_cold(model: nn.Module, seed: int) -> None:
    cold = values(build(seed, len(model.layers)))
    for key, tensor in values(model).items():
        assert torch.equal(tensor, cold[key]), f"{key} does not hold the values derived from seed {seed}"


def seal(model: nn.Module, mode: str = "strict") -> GraphContract:
    return GraphContract(model, mode).seal()  # type: ignore[arg-type]


def reload(
    contract: GraphContract, model: nn.Module, new: Mapping[str, torch.Tensor], loader: Loader = load_data_copy
) -> None:
    with contract.reload():
        loader(model, new)


def stale(outcome: ReloadOutcome | None) -> set[tuple[str, str]]:
    assert outcome is not None
    return {(f.layer, f.path) for f in outcome.findings if f.kind is FindingKind.STALE}


# ----------------------------------------------------------------------------------------------------
# Skipped rebuild: stale, FAILED in every mode
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_rebuild_is_stale_and_fails_in_every_mode(mode: str) -> None:
    model = build(0)
    contract = seal(model, mode)
    recaptures: list[ReloadOutcome] = []
    contract.on_recapture(recaptures.append)
    before = values(model)
    model.layers[1].policy["w_t"] = "skip"

    with pytest.raises(ReloadFailedError) as info:
        reload(contract, model, weights(model, 1))

    outcome = info.value.outcome
    assert outcome is contract.last_outcome and outcome is not None
    assert outcome.status is Status.FAILED
    assert {f.kind for f in outcome.problems} == {FindingKind.STALE}
    assert stale(outcome) == {("layers.1", "w_t")}
    (finding,) = outcome.problems
    assert finding.declared and finding.layer_class == "FreshLinear"
    assert "weight" in finding.detail  # names the inputs that changed
    assert "stale" in str(info.value) and "layers.1" in str(info.value) and "'w_t'" in str(info.value)
    # Not a recapture: a new capture would read the same stale tensor.
    assert recaptures == []
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError), contract.reload():
        pass
    # The slot really is stale (old values, right address); every other slot is fresh.
    assert torch.equal(model.layers[1].w_t, before[(1, "w_t")])
    cold = values(build(1))
    assert not torch.equal(model.layers[1].w_t, cold[(1, "w_t")])
    assert all(torch.equal(t, cold[k]) for k, t in values(model).items() if k != (1, "w_t"))


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
def test_staleness_is_found_under_every_detect_policy(detect: str) -> None:
    model = build(0)
    contract = GraphContract(model, "recapture", detect=detect).seal()  # type: ignore[arg-type]
    for layer in model.layers:
        layer.policy.update({"w_t": "skip", "row_norm": "skip"})
    with pytest.raises(ReloadFailedError):
        reload(contract, model, weights(model, 1))
    assert stale(contract.last_outcome) == {(f"layers.{i}", p) for i in (0, 1) for p in ("w_t", "row_norm")}


def test_a_skipped_rebuild_is_stale_in_a_layerwise_reload() -> None:
    model = build(0)
    contract = seal(model, "migrate")
    model.layers[0].policy["bias_scaled"] = "skip"
    new = weights(model, 1)
    params = dict(model.named_parameters())
    txn = contract.reload(layerwise=True)
    with pytest.raises(ReloadFailedError), txn:
        for i, layer in enumerate(model.layers):
            txn.before_layer(layer)
            for name in ("weight", "bias"):
                params[f"layers.{i}.{name}"].data.copy_(new[f"layers.{i}.{name}"])
            layer.process_weights_after_loading()
            txn.after_layer(layer)
    assert stale(txn.outcome) == {("layers.0", "bias_scaled")}


# ----------------------------------------------------------------------------------------------------
# What is NOT stale
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["in_place", "rebuild"])
def test_pwal_that_rebuilds_or_writes_in_place_is_fresh(mode: str, policy: Policy) -> None:
    model = build(0)
    contract = seal(model, mode)
    sealed = ptrs(model)
    for layer in model.layers:
        layer.policy.update(dict.fromkeys(("w_t", "bias_scaled", "row_norm"), policy))
    reload(contract, model, weights(model, 1))
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED and outcome.findings == ()
    # rebuild: 3 new tensors per layer copied back; in place: nothing to copy
    assert outcome.slots_restored == (6 if policy == "rebuild" else 0)
    assert ptrs(model) == sealed
    assert contract.serving_safe
    assert_matches_cold(model, 1)


def test_a_static_slot_pwal_never_touches_is_not_stale() -> None:
    model = build(0)
    contract = seal(model)
    lut = model.layers[0].lut
    version = lut._version
    reload(contract, model, weights(model, 1))
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert model.layers[0].lut is lut and lut._version == version  # really untouched, and not flagged
    assert_matches_cold(model, 1)


def test_a_stable_empty_slot_is_exempt() -> None:
    # stable_empty without zero=True hands back the same tensor untouched on every PWAL: static by construction.
    model = build(0)

    def scratch(layer: FreshLinear) -> None:
        layer.scratch = stable_empty(layer, "scratch", (OUT,), torch.float32, "cpu")

    for layer in model.layers:
        scratch(layer)
    contract = seal(model)
    with contract.reload():
        load_data_copy(model, weights(model, 1))
        for layer in model.layers:
            scratch(layer)
    assert contract.last_outcome is not None and contract.last_outcome.committed


def test_derived_from_limits_the_inputs_to_the_named_slots() -> None:
    # w_t is derived_from="weight"; every layer skips its rebuild.
    model = build(0)
    contract = seal(model)
    for layer in model.layers:
        layer.policy["w_t"] = "skip"
    only_bias = {k: v for k, v in weights(model, 1).items() if k.endswith("bias")}

    reload(contract, model, only_bias)  # only bias changed: w_t is still right
    assert contract.last_outcome is not None and contract.last_outcome.committed
    reference = build(0)
    load_data_copy(reference, only_bias)
    for key, tensor in values(model).items():
        assert torch.equal(tensor, values(reference)[key])

    only_weight = {k: v for k, v in weights(model, 2).items() if k.endswith("weight")}
    with pytest.raises(ReloadFailedError):
        reload(contract, model, only_weight)  # weight changed: w_t is stale
    assert stale(contract.last_outcome) == {("layers.0", "w_t"), ("layers.1", "w_t")}


def test_default_inputs_are_the_layers_own_parameters() -> None:
    # row_norm declares no derived_from: a change to either parameter makes a skipped rebuild stale.
    for changed in ("weight", "bias"):
        model = build(0)
        contract = seal(model)
        model.layers[0].policy["row_norm"] = "skip"
        new = {k: v for k, v in weights(model, 1).items() if k == f"layers.0.{changed}"}
        with pytest.raises(ReloadFailedError):
            reload(contract, model, new)
        assert stale(contract.last_outcome) == {("layers.0", "row_norm")}, changed


def test_a_partial_reload_does_not_flag_layers_it_did_not_touch() -> None:
    model = build(0)
    contract = seal(model)
    model.layers[1].policy.update(dict.fromkeys(("w_t", "bias_scaled", "row_norm"), "skip"))
    new = {k: v for k, v in weights(model, 1).items() if k.startswith("layers.0.")}
    reload(contract, model, new)
    assert contract.last_outcome is not None and contract.last_outcome.committed
    reference = build(0)
    load_data_copy(reference, new)
    for key, tensor in values(model).items():
        assert torch.equal(tensor, values(reference)[key]), key


# ----------------------------------------------------------------------------------------------------
# How inputs change: every loader is seen
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", [load_data_copy, load_param_copy, load_replace], ids=lambda f: f.__name__)
def test_every_way_a_loader_writes_the_inputs_is_seen(loader: Loader) -> None:
    model = build(0)
    contract = seal(model)
    weight = model.layers[0].weight
    version, storage = weight._version, weight.untyped_storage()
    model.layers[0].policy["w_t"] = "skip"
    loaded: list[nn.Parameter] = []  # what the loader left, before the contract restores anything

    def load_and_look(model: nn.Module, new: Mapping[str, torch.Tensor]) -> None:
        loader(model, new)
        loaded.append(model.layers[0].weight)

    new = weights(model, 1)
    with pytest.raises(ReloadFailedError):
        reload(contract, model, new, load_and_look)
    assert stale(contract.last_outcome) == {("layers.0", "w_t")}
    # The premise of each case: what the loader did (or did not) leave as evidence besides the values.
    now = loaded[0]
    if loader is load_data_copy:
        assert now is weight and now._version == version  # only the values witness the change
    elif loader is load_param_copy:
        assert now is weight and now._version > version
    else:
        assert now is not weight and now.untyped_storage() is not storage
        # The contract put the captured parameter back, holding the new values (the parameter is not the fault).
        assert model.layers[0].weight is weight and weight.untyped_storage() is storage
        assert torch.equal(weight, new["layers.0.weight"])
        assert {f.kind for f in contract.last_outcome.problems} == {FindingKind.STALE}  # type: ignore[union-attr]


def test_a_replaced_parameter_is_fresh_when_pwal_rebuilds() -> None:
    model = build(0)
    contract = seal(model)
    reload(contract, model, weights(model, 1), load_replace)
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert_matches_cold(model, 1)


# ----------------------------------------------------------------------------------------------------
# Same weights again, and the documented limit of the value sample
# ----------------------------------------------------------------------------------------------------


def test_a_same_weights_reload_with_a_skipped_rebuild_is_not_flagged() -> None:
    # Inputs did not change, so the skipped slot still holds the values PWAL would compute: replay is correct.
    model = build(0)
    contract = seal(model)
    sealed = ptrs(model)
    for layer in model.layers:
        layer.policy.update(dict.fromkeys(("w_t", "bias_scaled", "row_norm"), "skip"))
    reload(contract, model, weights(model, 0))
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED and outcome.findings == ()
    assert ptrs(model) == sealed
    assert_matches_cold(model, 0)
    # ... and the very next reload with different values is caught: the guard is still a bug.
    with pytest.raises(ReloadFailedError):
        reload(contract, model, weights(model, 1))
    assert len(stale(contract.last_outcome)) == 6


def test_a_same_weights_write_that_moves_the_version_counter_is_flagged() -> None:
    # Fail closed: a version bump is evidence of a write, and the contract does not compare full values.
    model = build(0)
    contract = seal(model)
    model.layers[0].policy["w_t"] = "skip"
    with pytest.raises(ReloadFailedError):
        reload(contract, model, weights(model, 0), load_param_copy)
    assert stale(contract.last_outcome) == {("layers.0", "w_t")}


class WideLinear(nn.Module):
    """A weight big enough (4096 elements) that the 256-element value sample is strided."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64), requires_grad=False)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        if getattr(self, "w_t", None) is None:  # the skip guard
            self.w_t = self.weight.detach().t().contiguous()
            register_derived(self, "w_t", derived_from="weight")


def test_known_limit_a_value_only_write_confined_to_unsampled_elements_escapes() -> None:
    # docs/fault-matrix.md ("stale value") documents this: through ``.data`` the sample is the only witness.
    layer = WideLinear()
    contract = seal(layer)
    with contract.reload():
        layer.weight.data[0, 1] += 1.0  # element 1 is between two sampled elements (stride 16)
        layer.process_weights_after_loading()
    assert contract.last_outcome is not None and contract.last_outcome.committed
    # The same write through the parameter moves the version counter and is caught.
    with pytest.raises(ReloadFailedError), contract.reload():
        with torch.no_grad():
            layer.weight[0, 1] += 1.0
        layer.process_weights_after_loading()
    assert stale(contract.last_outcome) == {("", "w_t")}
