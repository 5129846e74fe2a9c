"""Faulty reloads: ways a reload could report COMMITTED while a graph-visible address is wrong or stale.

Each test injects one fault and asserts the reload is not committed and the contract is not serving-safe; its
positive twin does the same reload the right way and asserts a commit whose slots are at their sealed storage
and hold the values of a model built cold on the new weights. Every reload loads DIFFERENT weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import (
    ContractViolation,
    FindingKind,
    GraphContract,
    NotServingSafeError,
    ReloadOutcome,
    Status,
    register_derived,
)
from graphsafe.collectors import record_capture
from graphsafe.contract import _copy
from graphsafe.errors import GraphSafeError
from graphsafe.paths import SlotPath

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

MODES = ("strict", "recapture", "migrate")
KEEP: list[torch.Tensor] = []  # stands for anything else that keeps an old storage alive (a cache, a view)


class Layer(nn.Module):
    """A layer whose PWAL derives ``w_t`` from ``weight``, in one of several (good or bad) ways."""

    def __init__(self, seed: int, how: str = "new", static: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(4, 4, generator=generator), requires_grad=False)
        self.how = how
        self.static = static
        self.armed = False
        self.w_t: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        new = self.weight.t().contiguous()
        w_t = self.w_t
        if w_t is None or self.how == "new":
            self.w_t = new
        elif self.how == "in-place":
            w_t.copy_(new)
        elif self.how == "repoint":  # the captured tensor object itself is moved to new memory
            KEEP.append(w_t.detach())
            w_t.data = new
        elif self.how == "reallocate":  # same storage object, new memory (an offload and back)
            storage = w_t.untyped_storage()
            nbytes = storage.nbytes()
            storage.resize_(0)
            storage.resize_(nbytes)
            w_t.copy_(new)
        register_derived(self, "w_t", static=self.static)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.w_t is not None
        return x @ self.w_t + x @ self.weight


class Armed(nn.Module):
    """A layer whose declared slot sits behind a property that raises once armed (user code in a path)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.armed = False
        self._w_t = self.weight.t().contiguous()
        register_derived(self, "w_t")

    @property
    def w_t(self) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("property raised")
        return self._w_t


def build(seed: int, how: str = "new", static: bool = False) -> nn.Sequential:
    model = nn.Sequential(Layer(seed, how, static), Layer(seed + 100, how, static))
    for layer in model:
        layer.process_weights_after_loading()
    return model


def load(model: nn.Sequential, seed: int) -> None:
    """The upstream way: copy new values into the existing parameters, then PWAL."""
    cold = build(seed)
    for layer, fresh in zip(model, cold, strict=True):
        with torch.no_grad():
            layer.weight.copy_(fresh.weight)
        layer.process_weights_after_loading()


def assert_graph_reads_the_new_weights(contract: GraphContract, model: nn.Module, seed: int) -> None:
    """Every sealed slot is at its sealed storage and address, holding what a cold build on ``seed`` holds."""
    cold = dict(build(seed).named_modules())
    layers = dict(model.named_modules())
    checked = 0
    for info in contract.slots():
        tensor = SlotPath(info.path).resolve(layers[info.layer])
        storage = info.fingerprint.storage_ref()
        assert storage is not None and tensor.untyped_storage() is storage, f"{info.layer}:{info.path} moved"
        assert tensor.data_ptr() == info.fingerprint.data_ptr, f"{info.layer}:{info.path} reallocated"
        expected = SlotPath(info.path).resolve(cold[info.layer])
        assert torch.equal(tensor, expected), f"{info.layer}:{info.path} holds stale values"
        checked += 1
    assert checked >= 2


def reload(contract: GraphContract, fn: Callable[[], Any]) -> Status | None:
    """Run one reload; return its status (``None`` when it raised before an outcome)."""
    before = contract.last_outcome
    try:
        with contract.reload():
            fn()
    except Exception:
        pass
    after = contract.last_outcome
    return after.status if after is not None and after is not before else None


# ----------------------------------------------------------------------------------------------------
# The captured tensor object moved to new memory (`.data =`, storage resize_): identity is more than the object
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
@pytest.mark.parametrize("how", ["repoint", "reallocate"])
def test_a_captured_tensor_object_moved_to_new_memory_is_not_committed(mode: str, detect: str, how: str) -> None:
    model = build(0, how, static=True)  # static: the freshness check cannot catch it by accident
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    sealed = {info.layer: info.fingerprint.data_ptr for info in contract.slots() if info.path == "w_t"}
    status = reload(contract, lambda: load(model, 1))
    assert model[0].w_t.data_ptr() != sealed["0"]  # the fault happened: the graph's address is not the model's
    assert status in (Status.FAILED, Status.NEEDS_RECAPTURE)
    assert not contract.serving_safe
    outcome = contract.last_outcome
    assert outcome is not None
    assert {(f.layer, f.path) for f in outcome.problems} == {("0", "w_t"), ("1", "w_t")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["in-place", "new"])
def test_a_pwal_that_keeps_or_rebuilds_its_tensor_commits_with_new_values(mode: str, how: str) -> None:
    model = build(0, how, static=True)
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    for seed in (1, 2):
        assert reload(contract, lambda seed=seed: load(model, seed)) is Status.COMMITTED
        assert_graph_reads_the_new_weights(contract, model, seed)


def test_the_manifest_sees_a_parameter_reallocated_in_its_own_storage_object() -> None:
    model = build(0, "in-place")
    contract = GraphContract(model, "strict").seal()
    with record_capture(contract):
        model(torch.randn(2, 4))

    def offload_and_back() -> None:
        storage = model[1].weight.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        load(model, 1)

    assert reload(contract, offload_and_back) is Status.FAILED
    outcome = contract.last_outcome
    assert outcome is not None
    # The contract tracks the parameter itself: same object, new memory (the manifest's finding for the same
    # path is then not repeated).
    assert [(f.kind.value, f.layer, f.path) for f in outcome.problems] == [("moved", "1", "weight")]
    # The manifest alone sees it too: the recorded storage object was reallocated under the graph.
    assert contract.manifest is not None
    manifest = [(f.kind.value, f.layer, f.path) for f in contract.manifest.check(contract)]
    assert manifest == [("dead", "1", "weight")]
    assert "reallocated" in contract.manifest.check(contract)[0].detail


def test_the_manifest_commits_a_parameter_loaded_in_place() -> None:
    model = build(0, "in-place")
    contract = GraphContract(model, "strict").seal()
    with record_capture(contract):
        model(torch.randn(2, 4))
    assert reload(contract, lambda: load(model, 1)) is Status.COMMITTED
    assert_graph_reads_the_new_weights(contract, model, 1)


# ----------------------------------------------------------------------------------------------------
# Exceptions inside the contract's own work must not leave it serving-safe (or stuck)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_inside_the_restore_leaves_the_contract_unsafe(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(0)
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    flush = _copy.CopyBatch.flush

    def failing_flush(self: _copy.CopyBatch) -> None:
        if self.pending:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        flush(self)

    def load_then_break_copies() -> None:
        load(model, 1)
        monkeypatch.setattr(_copy.CopyBatch, "flush", failing_flush)

    with pytest.raises(RuntimeError, match="illegal memory access"), contract.reload():
        load_then_break_copies()
    monkeypatch.setattr(_copy.CopyBatch, "flush", flush)
    assert not contract.serving_safe
    assert "half-restored" in (contract.unsafe_reason or "")
    with pytest.raises(NotServingSafeError), contract.reload():
        load(model, 2)


def test_a_restore_without_exceptions_leaves_the_contract_serving_safe() -> None:
    model = build(0)
    contract = GraphContract(model, "strict").seal()
    with contract.reload():
        load(model, 1)
    assert contract.serving_safe
    assert_graph_reads_the_new_weights(contract, model, 1)


def test_a_failed_rank_agreement_leaves_the_contract_unsafe() -> None:
    model = build(0)
    contract = GraphContract(model, "strict").seal()

    def broken(local: ReloadOutcome) -> ReloadOutcome:
        raise TimeoutError("store timed out (simulated)")

    with pytest.raises(TimeoutError), contract.reload(agreement=broken):
        load(model, 1)
    assert not contract.serving_safe


def test_a_slot_path_that_raises_is_a_finding_not_a_raw_error() -> None:
    # A path whose user code raises no longer escapes the snapshot as a RuntimeError;
    # the slot does not resolve, which is a `vanished` finding naming the error (fail closed, no raw exception).
    model = nn.Sequential(Armed())
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    model[0].armed = True
    with pytest.raises(ContractViolation) as info, contract.reload():
        pass
    outcome = info.value.outcome
    assert outcome is not None and outcome.status is Status.FAILED
    (finding,) = outcome.problems
    assert finding.kind is FindingKind.VANISHED and finding.path == "w_t"
    assert "RuntimeError: property raised" in finding.detail
    assert not contract.serving_safe  # failed closed; the reload below shows no transaction was left open
    model[0].armed = False
    contract.reseal(recaptured=True)  # nothing moved: the captured graphs still read the right memory
    with contract.reload():
        pass
    assert contract.last_outcome is not None and contract.last_outcome.committed


# ----------------------------------------------------------------------------------------------------
# Layerwise: a layer restored without a snapshot taken before its load
# ----------------------------------------------------------------------------------------------------


class Guarded(Layer):
    """PWAL with an "already processed" guard: after the first run it leaves ``w_t`` stale."""

    def process_weights_after_loading(self) -> None:
        if self.w_t is None:
            super().process_weights_after_loading()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call_before", [True, False])
def test_a_stale_slot_is_caught_in_a_layerwise_reload(mode: str, call_before: bool) -> None:
    model = nn.Sequential(Guarded(0), Guarded(100))
    for layer in model:
        layer.process_weights_after_loading()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    cold = build(1)
    txn = contract.reload(layerwise=True)
    with pytest.raises(GraphSafeError), txn:
        for layer, fresh in zip(model, cold, strict=True):
            if call_before:
                txn.before_layer(layer)
            with torch.no_grad():
                layer.weight.copy_(fresh.weight)
            layer.process_weights_after_loading()
            txn.after_layer(layer)
    assert txn.outcome is not None and txn.outcome.status is Status.FAILED
    assert not contract.serving_safe
    kinds = {f.kind.value for f in txn.outcome.problems}
    assert kinds == ({"stale"} if call_before else {"reload-error"})


@pytest.mark.parametrize("mode", MODES)
def test_a_paired_layerwise_reload_commits_with_new_values(mode: str) -> None:
    model = build(0)
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    cold = build(1)
    with contract.reload(layerwise=True) as txn:
        for layer, fresh in zip(model, cold, strict=True):
            txn.before_layer(layer)
            with torch.no_grad():
                layer.weight.copy_(fresh.weight)
            layer.process_weights_after_loading()
            txn.after_layer(layer)
    assert txn.outcome is not None and txn.outcome.committed
    assert_graph_reads_the_new_weights(contract, model, 1)
