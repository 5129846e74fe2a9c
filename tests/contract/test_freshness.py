"""Derived-value freshness: a declared slot that PWAL did not refresh while its inputs changed is ``stale``.

An address check alone cannot see this fault: the slot is still at its captured storage, it just holds values
derived from the OLD weights. The contract samples each declared, non-static slot before and after PWAL (a new
storage or changed values is a refresh; a version bump alone is not), and the slot's inputs by storage identity,
version counter and a strided value sample. The inputs are what the first reload's dataflow recording saw PWAL
read (plus ``derived_from``); before a recording, ``derived_from`` or the whole layer (parameters, buffers, tensor
attributes). Every test reloads DIFFERENT weights unless it is about the same-weights case, and checks values
against a model built cold on the new weights."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import (
    DeclarationError,
    FindingKind,
    GraphContract,
    GraphSafeError,
    NotServingSafeError,
    ReloadFailedError,
    ReloadOutcome,
    SlotRef,
    Status,
    UnloadedInputWarning,
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


def test_a_value_only_write_confined_to_unsampled_elements_is_caught_by_the_digest() -> None:
    # Through ``.data`` the version counter stays; the value sample skips element 1 (stride 16). The digest of every
    # byte of the weight sees it (it escaped before digests: docs/fault-matrix.md, "stale value").
    layer = WideLinear()
    contract = seal(layer)
    with pytest.raises(ReloadFailedError), contract.reload():
        layer.weight.data[0, 1] += 1.0
        layer.process_weights_after_loading()
    assert stale(contract.last_outcome) == {("", "w_t")}


def test_the_same_unsampled_write_through_the_parameter_is_caught() -> None:
    layer = WideLinear()
    contract = seal(layer)
    with pytest.raises(ReloadFailedError), contract.reload():
        with torch.no_grad():
            layer.weight[0, 1] += 1.0
        layer.process_weights_after_loading()
    assert stale(contract.last_outcome) == {("", "w_t")}


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 5000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex64]),
    offset=st.integers(0, 3),
    data=st.data(),
)
def test_a_digest_changes_with_any_one_element_and_not_otherwise(
    numel: int, dtype: torch.dtype, offset: int, data: st.DataObject
) -> None:
    """Any single element changed (any position, any dtype, any byte alignment of the view): another digest; the
    same bytes in another tensor: the same digest."""
    from graphsafe.contract._samples import digest, same_digests

    base = (torch.arange(numel + offset) % 7).to(dtype)
    tensor = base[offset:]
    before = digest(tensor)
    assert before is not None
    twin = tensor.clone()
    assert same_digests([(before, digest(twin))]) == [True]
    index = data.draw(st.integers(0, numel - 1))
    with torch.no_grad():
        tensor[index] = ~tensor[index] if dtype == torch.bool else tensor[index] + 1
    assert same_digests([(before, digest(tensor))]) == [False]
    assert base[:offset].equal((torch.arange(offset) % 7).to(dtype))  # nothing but the view was read or written


@settings(max_examples=40, deadline=None)
@given(
    picks=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    sizes=st.lists(st.integers(1, 300_000), min_size=4, max_size=4),
    batches=st.integers(1, 3),
)
def test_a_batch_digests_each_tensor_as_it_was_at_its_flush(picks: list[int], sizes: list[int], batches: int) -> None:
    """A tensor noted several times in one batch (a weight that is a layer's own and a derived slot's input) is
    read once and every handle holds :func:`digest` of it as at that flush; written between flushes, the next
    batch's handles hold the new bytes (small and over-1-MiB tensors)."""
    from graphsafe.contract._samples import SampleBatch, digest, same_digests

    tensors = [torch.arange(n, dtype=torch.float32) * (k + 1) for k, n in enumerate(sizes)]
    batch = SampleBatch()
    for round_ in range(batches):
        handles = [(pick, batch.digest(tensors[pick])) for pick in picks]
        expected = [digest(t) for t in tensors]
        batch.flush()
        for pick, handle in handles:
            got, want = handle.get(), expected[pick]
            assert got is not None and want is not None
            assert same_digests([(got, want)]) == [True], (round_, pick)
        with torch.no_grad():
            for tensor in tensors:
                tensor[-1] += 1  # the next batch must see this write


# ----------------------------------------------------------------------------------------------------
# Freshness from what PWAL really reads
# ----------------------------------------------------------------------------------------------------
# ``Kept`` holds its weight somewhere other than an own parameter (a GPTQ-style buffer, a plain attribute, a child
# module) next to an own parameter (``norm``) that reloads keep: the old default inputs (the layer's own parameters)
# then never see the weight change. ``w_t`` is declared without ``derived_from``.

Where = Literal["buffer", "attribute", "child"]
WHERES: tuple[Where, ...] = ("buffer", "attribute", "child")
KeptPolicy = Literal["rebuild", "in_place", "skip", "noop"]


class Kept(nn.Module):
    w_t: torch.Tensor

    def __init__(self, where: Where) -> None:
        super().__init__()
        self.where = where
        self.norm = nn.Parameter(torch.ones(OUT), requires_grad=False)  # an own parameter no reload changes
        if where == "buffer":
            self.register_buffer("qweight", torch.zeros(OUT, IN))
        elif where == "attribute":
            self.qweight = torch.zeros(OUT, IN)
        else:
            self.inner = nn.Linear(IN, OUT, bias=False)
        self.policy: KeptPolicy = "rebuild"

    def raw(self) -> torch.Tensor:
        return self.inner.weight if self.where == "child" else self.qweight

    def process_weights_after_loading(self) -> None:
        current = getattr(self, "w_t", None)
        if current is None or self.policy == "rebuild":
            self.w_t = (self.raw().detach().t() * 2.0).contiguous()
        elif self.policy == "in_place":
            current.copy_(self.raw().detach().t() * 2.0)
        elif self.policy == "noop":
            current.clamp_(-math.inf, math.inf)  # bumps the version counter, keeps the old values
        register_derived(self, "w_t")


class KeptModel(nn.Module):
    def __init__(self, where: Where) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Kept(where) for _ in range(2)])


def load_kept(model: KeptModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        layer.raw().data.copy_(torch.randn(OUT, IN, generator=generator))  # type: ignore[operator]
    for layer in model.layers:
        layer.process_weights_after_loading()  # type: ignore[operator]


def build_kept(where: Where, seed: int) -> KeptModel:
    model = KeptModel(where)
    load_kept(model, seed)
    return model


def assert_kept_matches_cold(model: KeptModel, seed: int) -> None:
    cold = build_kept(model.layers[0].where, seed)  # type: ignore[arg-type]
    for layer, reference in zip(model.layers, cold.layers, strict=True):
        assert torch.equal(layer.w_t, reference.w_t)


def reload_kept(contract: GraphContract, model: KeptModel, seed: int) -> ReloadOutcome:
    try:
        with contract.reload():
            load_kept(model, seed)
    except ReloadFailedError:
        pass
    assert contract.last_outcome is not None
    return contract.last_outcome


@pytest.mark.parametrize("where", WHERES)
@pytest.mark.parametrize("recorded", [False, True], ids=["first-reload", "after-recording"])
def test_a_skipped_rebuild_of_a_weight_held_outside_the_own_parameters_is_stale(where: Where, recorded: bool) -> None:
    model = build_kept(where, 0)
    contract = seal(model, "recapture")
    if recorded:  # a first reload that rebuilds records what PWAL reads; the next reload uses that record
        assert reload_kept(contract, model, 1).committed
    old = model.layers[1].w_t.clone()
    model.layers[1].policy = "skip"
    outcome = reload_kept(contract, model, 2)
    assert outcome.status is Status.FAILED
    assert stale(outcome) == {("layers.1", "w_t")}
    (finding,) = outcome.problems
    raw = "inner.weight" if where == "child" else "qweight"
    assert raw in finding.detail  # names the input that changed
    assert torch.equal(model.layers[1].w_t, old)  # the premise: really old values


@pytest.mark.parametrize("where", WHERES)
@pytest.mark.parametrize("policy", ["rebuild", "in_place"])
def test_a_pwal_that_rebuilds_a_weight_held_outside_the_own_parameters_commits(where: Where, policy: str) -> None:
    model = build_kept(where, 0)
    contract = seal(model, "strict")
    for layer in model.layers:
        layer.policy = policy
    for seed in (1, 2, 3):  # the recording reload, then reloads that use the recording
        assert reload_kept(contract, model, seed).committed, contract.last_outcome
        assert_kept_matches_cold(model, seed)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recorded", [False, True], ids=["first-reload", "after-recording"])
def test_an_in_place_no_op_write_is_not_a_refresh(mode: str, recorded: bool) -> None:
    # ``w_t.clamp_(-inf, inf)`` moves the version counter and leaves the old values: stale, not written.
    model = build_kept("buffer", 0)
    contract = seal(model, mode)
    if recorded:
        assert reload_kept(contract, model, 1).committed
    model.layers[0].policy = "noop"
    outcome = reload_kept(contract, model, 2)
    assert outcome.status is Status.FAILED and stale(outcome) == {("layers.0", "w_t")}
    # Fixed, reloaded outside the contract and resealed: a no-op write is still caught at the next reload (the
    # recording never learned "w_t reads nothing" from the no-op).
    model.layers[0].policy = "rebuild"
    load_kept(model, 2)
    contract.reseal(recaptured=True)  # no graph in this test: nothing to recapture
    model.layers[0].policy = "noop"
    outcome = reload_kept(contract, model, 3)
    assert outcome.status is Status.FAILED and stale(outcome) == {("layers.0", "w_t")}


class ViewProperty(nn.Module):
    """``w_t`` is a property that returns a fresh view of ``_w_t`` at every access."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(OUT, IN), requires_grad=False)
        self.skip = False

    @property
    def w_t(self) -> torch.Tensor:
        return self._w_t.view(IN, OUT)

    def process_weights_after_loading(self) -> None:
        if getattr(self, "_w_t", None) is None:
            self._w_t = torch.empty(IN, OUT)
        if not self.skip:
            self._w_t.copy_(self.weight.detach().t())  # in place: the captured storage itself
        register_derived(self, "w_t")


@pytest.mark.parametrize("skip", [True, False])
def test_a_property_returning_a_fresh_view_is_checked_by_its_memory(skip: bool) -> None:
    layer = ViewProperty()
    layer.weight.data.copy_(torch.randn(OUT, IN))
    layer.process_weights_after_loading()
    contract = seal(layer)
    layer.skip = skip
    new = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(5))
    try:
        with contract.reload():
            layer.weight.data.copy_(new)
            layer.process_weights_after_loading()
    except ReloadFailedError:
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    if skip:
        assert outcome.status is Status.FAILED and stale(outcome) == {("", "w_t")}
    else:
        assert outcome.committed and torch.equal(layer.w_t, new.t())


def test_derived_from_that_names_nothing_is_refused_at_registration() -> None:
    layer = FreshLinear()
    layer.w_t = torch.zeros(IN, OUT)
    with pytest.raises(DeclarationError, match=r"'w_t' on FreshLinear.*derived_from 'wieght'") as info:
        register_derived(layer, "w_t", derived_from="wieght")
    assert "\n" not in str(info.value)

    @graph_visible("w_t", derived_from=("weight", "scales"))
    def pwal(layer: FreshLinear) -> None:
        layer.w_t = layer.weight.detach().t().contiguous()

    with pytest.raises(DeclarationError, match=r"'w_t'.*derived_from 'scales'"):
        pwal(layer)


def test_derived_from_that_no_longer_resolves_is_refused_at_seal() -> None:
    model = build(0)
    layer = model.layers[1]
    layer.scales = torch.ones(OUT)
    register_derived(layer, "bias_scaled", derived_from=("bias", "scales"))
    del layer.scales
    contract = GraphContract(model)
    with pytest.raises(DeclarationError) as info:
        contract.seal()
    message = str(info.value)
    assert "\n" not in message
    assert "layers.1" in message and "'bias_scaled'" in message and "'scales'" in message
    assert "derived_from" in message
    assert not contract.serving_safe


# -- the recording itself ---------------------------------------------------------------------------------


def _modes_active() -> int:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return len(_get_current_dispatch_mode_stack())


def _modes_over_three_reloads(contract: GraphContract, model: nn.Module) -> list[int]:
    """Three committed reloads of new weights; how many dispatch modes were active during each one's load."""
    seen: list[int] = []

    def loader(model: nn.Module, new: Mapping[str, torch.Tensor]) -> None:
        seen.append(_modes_active())
        load_data_copy(model, new)

    for seed in (1, 2, 3):
        reload(contract, model, weights(model, seed), loader)
        assert contract.last_outcome is not None and contract.last_outcome.committed
    return seen


def test_the_first_reload_records_what_pwal_reads_and_later_reloads_do_not_pay_for_it() -> None:
    model = build(0)
    contract = seal(model)
    contract.record_reloads = "first"
    assert contract.recorded_inputs() == {}
    assert _modes_over_three_reloads(contract, model) == [1, 0, 0]
    recorded = {(str(s), tuple(sorted(str(i) for i in inputs))) for s, inputs in contract.recorded_inputs().items()}
    assert recorded == {
        (f"layers.{i}:{path}", inputs)
        for i in (0, 1)
        for path, inputs in (
            ("w_t", (f"layers.{i}:weight",)),
            ("bias_scaled", (f"layers.{i}:bias",)),
            ("row_norm", (f"layers.{i}:bias", f"layers.{i}:weight")),
        )
    }
    contract.reseal()  # the recording belongs to the layers, not to one seal
    assert contract.recorded_inputs().keys() == {SlotRef(f"layers.{i}", p) for i in (0, 1) for p in DERIVED[:3]}


class TiedHead(nn.Module):
    """No parameters of its own: ``w_t`` is derived from the sibling embedding's weight (tied weights)."""

    w_t: torch.Tensor


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(OUT, IN)
        self.head = TiedHead()
        self.skip = False

    def pwal(self) -> None:
        if getattr(self.head, "w_t", None) is None or not self.skip:
            self.head.w_t = self.embed.weight.detach().t().contiguous()
        register_derived(self.head, "w_t")


def load_tied(model: Tied, seed: int) -> None:
    model.embed.weight.data.copy_(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)))
    model.pwal()


@pytest.mark.parametrize("how", ["first-reload", "record_inputs"])
def test_an_input_in_another_layer_is_known_from_the_recording(how: str) -> None:
    model = Tied()
    contract = GraphContract(model, "recapture")
    if how == "record_inputs":
        with contract.record_inputs():  # the initial load, recorded
            load_tied(model, 0)
        contract.seal()
    else:
        load_tied(model, 0)
        contract.seal()
        with contract.reload():
            load_tied(model, 1)
        assert contract.last_outcome is not None and contract.last_outcome.committed
    assert {str(i) for i in contract.recorded_inputs()[SlotRef("head", "w_t")]} == {"embed:weight"}
    model.skip = True
    with pytest.raises(ReloadFailedError), contract.reload():
        load_tied(model, 2)
    assert stale(contract.last_outcome) == {("head", "w_t")}
    assert "embed" in contract.last_outcome.problems[0].detail  # type: ignore[union-attr]


class PrivateCopy(nn.Module):
    """PWAL derives ``w_t`` from a private copy of the FIRST weights: the loader updates ``weight``, never ``_w0``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(OUT, IN), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        if getattr(self, "_w0", None) is None:
            self._w0 = self.weight.detach().clone()
        self.w_t = self._w0.t().contiguous()
        register_derived(self, "w_t")


def test_a_pwal_reading_tensors_the_loader_never_updates_is_flagged() -> None:
    """The private copy ``_w0`` is a tensor the walker finds: the weights changed and nothing rewrote it, so it is
    ``stale`` itself (fail closed), and the reload fails instead of committing ``w_t`` rebuilt from old weights."""
    layer = PrivateCopy()
    layer.weight.data.copy_(torch.randn(OUT, IN))
    layer.process_weights_after_loading()
    contract = seal(layer)
    with pytest.raises(ReloadFailedError), contract.reload():
        layer.weight.data.copy_(torch.randn(OUT, IN))
        layer.process_weights_after_loading()
    assert stale(contract.last_outcome) == {("", "_w0")}
    assert [str(i) for i in contract.recorded_inputs()[SlotRef("", "w_t")]] == ["<model>:_w0"]


def test_a_pwal_reading_a_static_private_tensor_is_noted_not_failed() -> None:
    """Declared static, the private copy is no finding: the reload commits with the unloaded-input note."""
    layer = PrivateCopy()
    layer.weight.data.copy_(torch.randn(OUT, IN))
    layer.process_weights_after_loading()
    register_derived(layer, "_w0", static=True)
    contract = seal(layer)
    with pytest.warns(UnloadedInputWarning, match=r"'w_t'.*'_w0'") as record, contract.reload():
        layer.weight.data.copy_(torch.randn(OUT, IN))
        layer.process_weights_after_loading()
    assert len(record) == 1
    # A note, not a finding: the slot was rebuilt, so by addresses and by what PWAL read it is fresh.
    assert contract.last_outcome is not None and contract.last_outcome.committed


def test_a_pwal_that_reads_what_the_loader_wrote_is_not_flagged() -> None:
    model = build(0)
    contract = seal(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnloadedInputWarning)
        reload(contract, model, weights(model, 1))
    assert contract.last_outcome is not None and contract.last_outcome.committed


_PRIVATE: dict[int, torch.Tensor] = {}


def test_known_limit_a_private_copy_no_path_reaches_is_undetectable() -> None:
    # docs/fault-matrix.md ("stale value"): PWAL computing from a copy of the first weights that the model does not
    # hold (a module-level dict) reads nothing the contract can see, so it neither warns nor fails.
    layer = nn.Linear(IN, OUT, bias=False)

    def pwal() -> None:
        first = _PRIVATE.setdefault(id(layer), layer.weight.detach().clone())
        layer.w_t = first.t().contiguous()
        register_derived(layer, "w_t")

    pwal()
    contract = seal(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnloadedInputWarning)
        with contract.reload():
            layer.weight.data.copy_(torch.randn(OUT, IN))
            pwal()
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert not torch.equal(layer.w_t, layer.weight.detach().t())  # stale, unseen
    _PRIVATE.clear()


# -- a property: the stale verdict from an independent model of what each slot reads ----------------------

SOURCES = ("p", "b", "a", "c")  # a parameter, a buffer, a plain attribute, a child module's parameter
SLOTS = ("d0", "d1", "d2")


class Graph(nn.Module):
    """Three derived slots, each computed from a chosen subset of four inputs living in four kinds of places."""

    def __init__(self, reads: Mapping[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.register_buffer("b", torch.zeros(4))
        self.a = torch.zeros(4)
        self.c = nn.Linear(4, 1, bias=False)
        self.reads = dict(reads)
        self.policy: dict[str, KeptPolicy] = {}

    def source(self, name: str) -> torch.Tensor:
        return self.c.weight.detach().reshape(4) if name == "c" else getattr(self, name).detach()

    def compute(self, slot: str) -> torch.Tensor:
        value = torch.full((4,), float(SLOTS.index(slot)))
        for name in self.reads[slot]:
            value = value + self.source(name) * (SOURCES.index(name) + 2)
        return value

    def pwal(self) -> None:
        for slot in SLOTS:
            current = getattr(self, slot, None)
            policy = self.policy.get(slot, "rebuild")
            if current is None or policy == "rebuild":
                setattr(self, slot, self.compute(slot))
            elif policy == "in_place":
                current.copy_(self.compute(slot))
            elif policy == "noop":
                current.clamp_(-math.inf, math.inf)
            register_derived(self, slot)

    def load(self, changed: Mapping[str, int]) -> None:
        for name, seed in changed.items():
            value = torch.randn(4, generator=torch.Generator().manual_seed(seed)) + 10.0 * seed
            self.source(name).copy_(value)
        self.pwal()


@settings(max_examples=80, deadline=None)
@given(
    reads=st.fixed_dictionaries({s: st.lists(st.sampled_from(SOURCES), unique=True).map(tuple) for s in SLOTS}),
    policy=st.fixed_dictionaries({s: st.sampled_from(["rebuild", "in_place", "skip", "noop"]) for s in SLOTS}),
    changed=st.lists(st.sampled_from(SOURCES), unique=True),
    recorded=st.booleans(),
)
def test_stale_exactly_when_a_slot_pwal_did_not_refresh_reads_a_changed_input(
    reads: Mapping[str, tuple[str, ...]], policy: Mapping[str, KeptPolicy], changed: list[str], recorded: bool
) -> None:
    model = Graph(reads)
    model.load(dict.fromkeys(SOURCES, 1))
    contract = GraphContract(model, "recapture").seal()
    if recorded:
        with contract.reload():  # records what each slot reads
            model.load(dict.fromkeys(SOURCES, 2))
        assert contract.last_outcome is not None and contract.last_outcome.committed
    model.policy.update(policy)
    try:
        with contract.reload():
            model.load(dict.fromkeys(changed, 3))
    except ReloadFailedError:
        pass
    # The oracle: a slot is stale when it reads an input this reload changed and its PWAL did not recompute it.
    expected = {("", s) for s in SLOTS if policy[s] in ("skip", "noop") and set(reads[s]) & set(changed)}
    outcome = contract.last_outcome
    assert outcome is not None
    if recorded:  # exact: no stale value missed, no false alarm
        assert stale(outcome) == expected
    else:  # before any recording the inputs are the whole layer: no stale value missed, maybe a false alarm
        assert stale(outcome) >= expected
        # a false alarm only where PWAL left the old values: not rebuilt, and not written with other values
        kept = {s for s in SLOTS if policy[s] in ("skip", "noop") or not set(reads[s]) & set(changed)}
        allowed = {("", s) for s in kept if policy[s] != "rebuild" and changed}
        # The plain attribute ``a`` is a tensor only the walker finds: before any recording nothing says it is a
        # weight and not a derived tensor, so a reload that changes other inputs and leaves it as it was fails
        # closed on it (docs/fault-matrix.md, "undeclared tensor, stale").
        if "a" not in changed and changed:
            allowed.add(("", "a"))
        assert stale(outcome) <= allowed
    assert outcome.committed is (not stale(outcome))
    if outcome.committed:  # and a committed reload holds the values a cold build on the same inputs computes
        for slot in SLOTS:
            assert torch.equal(getattr(model, slot), model.compute(slot)), slot


# -- more of the recording ------------------------------------------------------------------------------------


def test_a_layerwise_first_reload_records_too() -> None:
    model = build_kept("buffer", 0)
    contract = seal(model, "recapture")

    def layerwise(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        txn = contract.reload(layerwise=True)
        with txn:
            for layer in model.layers:
                txn.before_layer(layer)
                layer.qweight.copy_(torch.randn(OUT, IN, generator=generator))
                layer.process_weights_after_loading()
                txn.after_layer(layer)

    layerwise(1)
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert_kept_matches_cold(model, 1)
    assert {k: tuple(map(str, v)) for k, v in contract.recorded_inputs().items()} == {
        SlotRef(f"layers.{i}", "w_t"): (f"layers.{i}:qweight",) for i in (0, 1)
    }
    model.layers[0].policy = "skip"
    with pytest.raises(ReloadFailedError):
        layerwise(2)
    assert stale(contract.last_outcome) == {("layers.0", "w_t")}


def test_the_same_values_loaded_through_the_parameter_and_rewritten_in_place_is_not_a_false_alarm() -> None:
    # The version counters of the input (param.copy_) and of the slot (copy_) move, every value stays the same:
    # a same-weights reload with a PWAL that writes in place, which must commit.
    model = build(0)
    contract = seal(model)
    for layer in model.layers:
        layer.policy.update(dict.fromkeys(("w_t", "bias_scaled", "row_norm"), "in_place"))
    for _ in range(2):  # before and after the recording
        reload(contract, model, weights(model, 0), load_param_copy)
        assert contract.last_outcome is not None and contract.last_outcome.committed, contract.last_outcome
    assert_matches_cold(model, 0)


def test_record_inputs_is_for_the_initial_load() -> None:
    model = build(0)
    contract = seal(model)
    with pytest.raises(GraphSafeError, match="before seal"), contract.record_inputs():
        pass


def test_a_reload_can_opt_out_of_the_recording() -> None:
    model = build(0)
    contract = seal(model)
    contract.record_reloads = "none"
    seen: list[int] = []

    def loader(model: nn.Module, new: Mapping[str, torch.Tensor]) -> None:
        seen.append(_modes_active())
        load_data_copy(model, new)

    reload(contract, model, weights(model, 1), loader)
    assert seen == [0] and contract.recorded_inputs() == {}
    model.layers[0].policy["w_t"] = "skip"
    with pytest.raises(ReloadFailedError):  # the fallback inputs still see the skipped rebuild
        reload(contract, model, weights(model, 2))
    assert stale(contract.last_outcome) == {("layers.0", "w_t")}


@pytest.mark.parametrize("policy", ["every", "first"])
def test_record_reloads_decides_which_reloads_run_under_the_recording(policy: str) -> None:
    model = build(0)
    contract = seal(model)
    contract.record_reloads = policy  # type: ignore[assignment]
    assert _modes_over_three_reloads(contract, model) == ([1, 1, 1] if policy == "every" else [1, 0, 0])


def test_an_unknown_record_reloads_policy_is_refused_with_the_choices() -> None:
    model = build(0)
    with pytest.raises(ValueError, match=r"record_reloads policy 'always'.*'every'.*'first' or 'none'"):
        GraphContract(model, record_reloads="always")  # type: ignore[arg-type]
    contract = seal(model)
    with pytest.raises(ValueError, match="record_reloads policy"):
        contract.record_reloads = "all"  # type: ignore[assignment]
    assert contract.record_reloads == "every"


def test_a_first_reload_whose_pwal_ran_in_another_thread_learns_nothing_and_stays_checked() -> None:
    # Dispatch modes are per thread: the recording sees none of a worker thread's ops, so the rebuilt w_t looks
    # computed from nothing. Learning that would turn the freshness check off for good.
    import threading

    model = build_kept("buffer", 0)
    contract = seal(model, "recapture")
    with contract.reload():
        worker = threading.Thread(target=load_kept, args=(model, 1))
        worker.start()
        worker.join()
    assert contract.last_outcome is not None and contract.last_outcome.committed
    model.layers[1].policy = "skip"
    outcome = reload_kept(contract, model, 2)
    assert outcome.status is Status.FAILED and stale(outcome) == {("layers.1", "w_t")}


# -- the value sample: its fast path reads the same elements as the plain definition ----------------------------


def _reference_sample(tensor: torch.Tensor, elements: int) -> torch.Tensor:
    """The sample by its definition: every ``step``-th element of the flattened values (all of a small tensor),
    or a grid of about ``elements`` points of a strided one, as bytes."""
    value = tensor.detach()
    if value.is_contiguous():
        flat = value.reshape(-1)
        step = max(1, math.ceil(flat.numel() / elements))  # spread over all of it: the tail is sampled too
        sample = flat[::step]
        last = (sample.numel() - 1) * step  # the last sampled element: within the last ``step`` of them
        assert sample.numel() <= elements and (not flat.numel() or flat.numel() - 1 - last < step)
    else:
        per_dim = max(1, int(elements ** (1 / max(1, value.dim()))))
        sample = value[tuple(slice(None, None, max(1, n // per_dim)) for n in value.shape)].reshape(-1)
    return sample.clone(memory_format=torch.contiguous_format).view(torch.uint8)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 7, 64, 129]), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool]),
    view=st.sampled_from(["whole", "tail", "transposed", "parameter"]),
    elements=st.sampled_from([1, 4, 16, 256, 4096]),
)
def test_the_value_sample_is_the_defined_elements_whatever_the_layout(
    shape: list[int], dtype: torch.dtype, view: str, elements: int
) -> None:
    from graphsafe.contract._samples import SampleBatch, signature, unchanged

    tensor = (torch.randn(*shape) * 10).to(dtype) if shape else torch.tensor(3.0).to(dtype)
    if view == "tail" and tensor.dim() and tensor.shape[0] > 1:
        tensor = tensor[1:]  # a storage offset
    elif view == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif view == "parameter" and dtype.is_floating_point:
        tensor = nn.Parameter(tensor, requires_grad=True)
    sample = signature(tensor, elements)
    expected = _reference_sample(tensor, elements)
    assert sample.dim() == 1 and sample.shape == expected.shape and torch.equal(sample, expected)
    assert not sample.requires_grad
    # Taken in a batch with others (joined into one copy), alone in its batch, or twice: the same bytes, a copy.
    other = torch.arange(5).to(dtype)
    for company in ([], [other], [tensor, other]):
        batch = SampleBatch()
        taken = batch.take(tensor, elements)
        for extra in company:
            batch.take(extra, elements)
        batch.flush()
        assert torch.equal(taken.get(), expected)
        assert unchanged([(taken, tensor)], elements) == [True]
        if tensor.numel():  # the first element is always sampled
            first = (0,) * tensor.dim()
            kept = tensor[first].clone()
            with torch.no_grad():
                tensor[first] = ~kept if dtype == torch.bool else kept + 1
            assert torch.equal(taken.get(), expected)  # a copy, not a view of the tensor
            assert unchanged([(taken, tensor)], elements) == [False]
            with torch.no_grad():
                tensor[first] = kept


class _InPlaceTrio(nn.Module):
    """Three small derived slots of one dtype (their samples are taken and compared together); PWAL writes each in
    place, ``d0`` changing only the lowest byte of one element (``whole``: all of it), or (``skip``) leaves ``d0``
    alone."""

    def __init__(self, flip: tuple[int, int] = (2, 0)) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.skip = False
        self.whole = False
        self.flip = flip  # (element, bit) changed in d0

    @graph_visible("d0", "d1", "d2")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "d0"):
            self.d0, self.d1, self.d2 = (self.weight + i for i in range(3))
            return
        if self.whole:
            self.d0.copy_(self.weight)
        elif not self.skip:
            bits = self.d0.view(torch.int32)
            element, bit = self.flip
            bits[element] ^= 1 << bit  # one bit of one element: a real write that changes one byte of the sample
        self.d1.copy_(self.weight + 1)
        self.d2.copy_(self.weight + 2)


@pytest.mark.parametrize("flip", [(2, 0), (0, 0), (3, 30)], ids=["middle", "first-byte", "last-byte"])
@pytest.mark.parametrize("skip", [False, True])
def test_a_write_that_changes_one_byte_of_a_jointly_sampled_slot_is_a_refresh(
    skip: bool, flip: tuple[int, int]
) -> None:
    layer = _InPlaceTrio(flip)
    layer.process_weights_after_loading()
    # Value samples judge the second reload (unrecorded): a recording would see the one-bit write as partial.
    contract = GraphContract(layer, "recapture", detect="declared-only", record_reloads="first").seal()
    layer.whole = True  # the recording reload, which sees a write of part of a slot as partial
    with contract.reload(), torch.no_grad():
        layer.weight.copy_(torch.full((4,), 1.0))
        layer.process_weights_after_loading()
    layer.whole, layer.skip = False, skip
    try:
        with contract.reload(), torch.no_grad():
            layer.weight.copy_(torch.full((4,), 2.0))
            layer.process_weights_after_loading()
    except ReloadFailedError:
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    assert stale(outcome) == ({("", "d0")} if skip else set())


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    asked=st.data(),
    dtype=st.sampled_from([torch.float32, torch.int8, torch.int64]),
)
def test_samples_compared_in_a_batch_agree_with_each_compared_alone(
    sizes: list[int], asked: st.DataObject, dtype: torch.dtype
) -> None:
    """Any subset of a batch's samples (a few of many are compared as slices, most of them as the whole joined
    tensor), some tensors written after the batch was taken: the batch verdict is each pair's own."""
    from graphsafe.contract._samples import SampleBatch, signature, unchanged

    tensors = [(torch.arange(n) * 3 + i).to(dtype) for i, n in enumerate(sizes)]
    batch = SampleBatch()
    samples = [batch.take(t, 16) for t in tensors]
    before = [signature(t, 16) for t in tensors]
    batch.flush()
    chosen = asked.draw(st.lists(st.sampled_from(range(len(tensors))), unique=True))
    for index in asked.draw(st.lists(st.sampled_from(range(len(tensors))), unique=True)):
        if tensors[index].numel():
            tensors[index][0] += 1  # the first element is always sampled
    verdicts = unchanged([(samples[i], tensors[i]) for i in chosen], 16)
    assert verdicts == [torch.equal(before[i], signature(tensors[i], 16)) for i in chosen]


def test_the_digest_of_a_one_element_tensor_with_any_stride_reads_its_bytes() -> None:
    """A one-element input is contiguous whatever its stride, and a digest that views it flat as bytes crashes: torch
    refuses that for stride 2. The digest reads the element's
    bytes: the same as a copy's, other than another value's."""
    from graphsafe.contract._samples import digest

    one = torch.arange(10.0)[::2][3:4]  # the element 6.0, stride 2
    assert one.is_contiguous() and one.stride() == (2,)
    same, other = digest(one), digest(one.clone())
    assert same is not None and other is not None and torch.equal(same, other)
    changed = digest(torch.tensor([7.0]))
    assert changed is not None and not torch.equal(same, changed)


class EmptySlotLinear(nn.Linear):
    """A layer with a declared derived slot on an empty storage (a placeholder, as an unbound cache: no bytes)."""

    def __init__(self) -> None:
        super().__init__(IN, OUT)
        self.placeholder = torch.empty(0)
        register_derived(self, "placeholder", derived_from="weight")


@pytest.mark.parametrize("mode", MODES)
def test_a_slot_with_no_memory_is_never_stale(mode: str) -> None:
    """A slot without bytes holds no value a change of its inputs could leave old: PWAL leaving it is fresh."""
    layer = EmptySlotLinear()
    contract = GraphContract(layer, mode)  # type: ignore[arg-type]
    contract.seal()
    with contract.reload(), torch.no_grad():
        layer.weight.add_(1.0)  # new weights; the placeholder stays as it is
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome
    assert not [f for f in outcome.findings if f.kind is FindingKind.STALE]
