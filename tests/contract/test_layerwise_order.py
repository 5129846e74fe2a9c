"""Layerwise reloads: ``before_layer(layer)`` must come before the layer's load and PWAL. Called after them (out of
order), or not at all for a layer the reload changed, the snapshot would take the new state for the captured one: a
PWAL guard that skips the rebuild would then commit stale derived values. Both fail closed (``reload-error``),
whatever the loader (through ``.data`` too) and however small the change; a layer the reload leaves alone (no load,
no PWAL) needs no call."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import ContractViolation, FindingKind, GraphContract, ReloadOutcome, Status, register_derived


class Guarded(nn.Module):
    """PWAL derives ``w_t`` once; a guard skips the rebuild on later loads (the case that hides the load)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), float(seed)), requires_grad=False)
        self.built = False
        self.process_weights_after_loading()
        register_derived(self, "w_t")

    def process_weights_after_loading(self) -> None:
        if self.built:
            return
        self.w_t = self.weight * 2.0 + 1.0
        self.built = True


def model() -> nn.Module:
    net = nn.Module()
    net.layers = nn.ModuleList([Guarded(1), Guarded(2)])
    return net


def load(layer: nn.Module, value: float) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.full((4,), value))  # type: ignore[operator]


def rebuild(layer: nn.Module) -> None:
    """A PWAL that does rebuild (the guard lifted)."""
    layer.built = False
    layer.process_weights_after_loading()  # type: ignore[operator]


def reload_in_order(txn: object, layer: nn.Module, value: float) -> None:
    """One layer reloaded as it should be: before_layer, load, a PWAL that rebuilds, after_layer."""
    txn.before_layer(layer)  # type: ignore[attr-defined]
    load(layer, value)
    rebuild(layer)
    txn.after_layer(layer)  # type: ignore[attr-defined]


def finish(contract: GraphContract, body: object) -> ReloadOutcome:
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        body(txn)  # type: ignore[operator]
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_before_layer_after_the_layers_load_fails_closed(mode: str) -> None:
    net = model()
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]

    def body(txn: object) -> None:
        for index, layer in enumerate(net.layers):
            load(layer, 10.0 + index)
            txn.before_layer(layer)  # type: ignore[attr-defined]  # too late: the weights are loaded
            layer.process_weights_after_loading()  # type: ignore[operator]
            txn.after_layer(layer)  # type: ignore[attr-defined]

    outcome = finish(contract, body)
    assert outcome.status is Status.FAILED, outcome.summary()  # a recapture would read the stale values too
    assert {f.kind for f in outcome.problems} == {FindingKind.RELOAD_ERROR}
    assert "before_layer()" in outcome.problems[0].detail


@pytest.mark.parametrize("with_after", [True, False])
def test_a_layer_loaded_without_before_layer_fails_closed(with_after: bool) -> None:
    net = model()
    contract = GraphContract(net, "recapture").seal()

    def body(txn: object) -> None:
        first, second = net.layers
        reload_in_order(txn, first, 10.0)
        load(second, 11.0)  # no before_layer
        second.process_weights_after_loading()  # type: ignore[operator]  # the guard skips the rebuild
        if with_after:
            txn.after_layer(second)  # type: ignore[attr-defined]

    outcome = finish(contract, body)
    assert outcome.status is not Status.COMMITTED, outcome.summary()
    assert {f.layer for f in outcome.problems} == {"layers.1"}
    assert FindingKind.RELOAD_ERROR in {f.kind for f in outcome.problems}


def test_a_layer_the_reload_leaves_alone_needs_no_before_layer() -> None:
    net = model()
    contract = GraphContract(net, "strict").seal()

    def body(txn: object) -> None:
        first = net.layers[0]
        reload_in_order(txn, first, 10.0)

    assert finish(contract, body).status is Status.COMMITTED


def _write_one_element(layer: nn.Module, how: str, index: int, value: float) -> None:
    """Load one changed element into ``layer.weight`` the way a loader might: ``copy_`` under ``no_grad`` (moves the
    version counter), through ``.data`` (vLLM's default loader: moves neither version, identity nor pointer), or a
    new tensor bound at ``.data`` (moves the pointer)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    new = weight.detach().clone()
    new[index] = value
    if how == "copy":
        with torch.no_grad():
            weight.copy_(new)
    elif how == "data_copy":
        weight.data.copy_(new)
    else:
        weight.data = new


@settings(max_examples=40, deadline=None)
@given(
    how=st.sampled_from(["copy", "data_copy", "data_assign"]),
    calls=st.sampled_from(["late", "after_only", "neither"]),
    index=st.integers(0, 3),
    value=st.floats(-1e6, 1e6, allow_nan=False).filter(lambda v: v not in (1.0, 2.0)),
)
def test_a_late_or_missing_before_layer_fails_closed_whatever_the_loader_and_however_small_the_change(
    how: str, calls: str, index: int, value: float
) -> None:
    net = model()
    contract = GraphContract(net, "recapture").seal()

    def body(txn: object) -> None:
        layer = net.layers[0]
        _write_one_element(layer, how, index, value)
        if calls == "late":
            txn.before_layer(layer)  # type: ignore[attr-defined]  # too late: one element is loaded already
        layer.process_weights_after_loading()  # type: ignore[operator]  # the guard skips the rebuild
        if calls != "neither":
            txn.after_layer(layer)  # type: ignore[attr-defined]

    outcome = finish(contract, body)
    assert outcome.status is Status.FAILED, outcome.summary()
    assert any(f.kind is FindingKind.RELOAD_ERROR and "before_layer()" in f.detail for f in outcome.problems)


@pytest.mark.parametrize("how", ["copy", "data_copy"])
def test_a_before_layer_in_order_commits_with_an_in_place_loader(how: str) -> None:
    net = model()
    contract = GraphContract(net, "recapture").seal()

    def body(txn: object) -> None:
        for layer in net.layers:
            txn.before_layer(layer)  # type: ignore[attr-defined]
            _write_one_element(layer, how, 0, 7.0)
            rebuild(layer)
            txn.after_layer(layer)  # type: ignore[attr-defined]

    assert finish(contract, body).status is Status.COMMITTED


@pytest.mark.parametrize("pwal", ["rebuild", "in_place"])
def test_pwal_on_a_layer_whose_weights_did_not_change_needs_its_before_layer(pwal: str) -> None:
    """A layer the loader left alone but PWAL ran on: its snapshot, taken at the end, would see PWAL's tensors as
    the ones before the reload (a rotation or an in-place write PWAL got wrong goes unchecked). Fails closed."""
    net = model()
    contract = GraphContract(net, "recapture").seal()

    def body(txn: object) -> None:
        first, second = net.layers
        reload_in_order(txn, first, 10.0)
        if pwal == "rebuild":  # the second layer's weights are as they were; PWAL runs on it all the same
            rebuild(second)
        else:
            with torch.no_grad():
                second.w_t.mul_(1.0)  # type: ignore[operator]

    outcome = finish(contract, body)
    assert outcome.status is Status.FAILED, outcome.summary()
    assert [f.layer for f in outcome.problems if f.kind is FindingKind.RELOAD_ERROR] == ["layers.1"]
