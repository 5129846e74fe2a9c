"""Fail closed for real: configuration that tracks nothing, transaction misuse, threads, and the way back after a
failed reload (a reseal needs a new capture).

Every reload loads DIFFERENT values. The oracle is address identity: a "graph" here records the data pointers the
model's tensors had when it was captured, and a serving-safe contract must mean that those are still the addresses
the model holds (so a replay reads the reloaded values).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import (
    ContractViolation,
    GraphContract,
    GraphSafeError,
    NotServingSafeError,
    Status,
    graph_visible,
)
from graphsafe.adapters.torch import GraphRunner
from graphsafe.collectors import record_capture

MODES = ("strict", "recapture", "migrate")


class Quant:
    """PWAL that re-creates its derived tensor on every run (``bad``: with another stride, which is never copied
    into the captured storage)."""

    bad = False

    @graph_visible("w_t")
    def process_weights_after_loading(self, layer: Layer) -> None:
        w = layer.weight.detach()
        layer.w_t = w.clone().t() if self.bad else w.t().contiguous()


class Layer(nn.Module):
    w_t: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
        self.quant_method = Quant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_t


def build(seed: int = 0) -> nn.Sequential:
    model = nn.Sequential(Layer(), Layer())
    load(model, seed)
    return model


def load(model: nn.Module, seed: int, *, bad: bool = False) -> None:
    """The upstream reload: new values into the parameters in place, then PWAL (a NEW derived tensor)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model:
        layer.weight.data.copy_(torch.randn(3, 3, generator=generator))
        layer.quant_method.bad = bad
        layer.quant_method.process_weights_after_loading(layer)


def addresses(model: nn.Module) -> dict[str, int]:
    """What a graph captured now would read: every derived tensor's address."""
    return {f"{index}.w_t": layer.w_t.data_ptr() for index, layer in enumerate(model)}


def capture(model: nn.Module, contract: GraphContract) -> dict[str, int]:
    """A capture: a forward under the capture recorder; returns the addresses the graph now reads."""
    with record_capture(contract, name="graph"):
        model(torch.ones(1, 3))
    return addresses(model)


# ----------------------------------------------------------------------------------------------------------------
# A contract that tracks nothing.


class Undeclared(nn.Module):
    """Nothing declared: a weight, and a derived tensor only the walker finds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
        self.cache = [torch.zeros(3)]


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
@pytest.mark.parametrize("devices", [["cuda"], ["cuda:1"]])
def test_a_devices_filter_matching_no_tensor_is_refused_at_seal(detect: str, devices: list[str]) -> None:
    model = nn.Sequential(Undeclared(), Undeclared())
    contract = GraphContract(model, "strict", detect=detect, devices=devices)  # type: ignore[arg-type]
    with pytest.raises(GraphSafeError) as raised:
        contract.seal()
    reason = str(raised.value)
    assert "\n" not in reason and "devices=" in reason and devices[0] in reason and "cpu" in reason
    assert not contract.serving_safe
    ran: list[bool] = []
    with pytest.raises(NotServingSafeError), contract.reload():
        ran.append(True)
    assert ran == []  # refused before the loader ran
    # The remedy the error names: a filter that matches the model's device.
    contract.devices = GraphContract(model, devices=["cpu"]).devices
    assert contract.seal().serving_safe and len(list(contract.slots())) >= 2


def test_declared_only_on_a_model_whose_tensors_only_the_walker_finds_is_unsafe() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cache = [torch.zeros(2)]

    model = Holder()
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    assert not contract.serving_safe
    reason = contract.unsafe_reason or ""
    assert "declared-only" in reason and "no parameter or buffer" in reason
    with pytest.raises(NotServingSafeError), contract.reload():
        pass
    # The walker finds it: tracked, serving-safe.
    assert GraphContract(model, "strict", detect="sealed-paths").seal().serving_safe


def test_a_matching_devices_filter_is_serving_safe() -> None:
    model = build()
    contract = GraphContract(model, "strict", devices=["cpu"]).seal()
    assert contract.serving_safe
    with contract.reload():
        load(model, 1)
    assert contract.last_outcome is not None and contract.last_outcome.committed


# ----------------------------------------------------------------------------------------------------------------
# Transaction misuse.


def test_finish_without_begin_refuses_and_changes_nothing() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    txn = contract.reload()
    with pytest.raises(GraphSafeError, match=r"finish\(\) without begin\(\)"):
        txn.finish()
    assert txn.outcome is None and contract.last_outcome is None and contract.reloads == 0
    assert contract.serving_safe
    # The contract is not stuck: a proper reload still works.
    with contract.reload() as ok:
        load(model, 1)
    assert ok.outcome is not None and ok.outcome.committed


def test_a_second_finish_refuses() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    txn = contract.reload().begin()
    load(model, 1)
    first = txn.finish()
    assert first.committed and contract.reloads == 1
    with pytest.raises(GraphSafeError, match=r"finish\(\) twice|already finished"):
        txn.finish()
    assert contract.reloads == 1 and contract.last_outcome is first


def test_a_finished_transaction_cannot_begin_or_restore_again() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    txn = contract.reload(layerwise=True).begin()
    with pytest.raises(GraphSafeError, match="already open"):
        txn.begin()
    txn.finish()
    with pytest.raises(GraphSafeError, match="already finished"):
        txn.begin()
    for step in (txn.before_layer, txn.after_layer):
        with pytest.raises(GraphSafeError, match="already finished"):
            step(model[0])
    assert contract.serving_safe


def test_before_layer_without_begin_refuses() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    txn = contract.reload(layerwise=True)
    with pytest.raises(GraphSafeError, match="not open"):
        txn.before_layer(model[0])


class _SlowCheck(GraphContract):
    """Takes its time to say it is serving-safe: widens any gap between "is a transaction open?" and "open one"."""

    @property
    def serving_safe(self) -> bool:
        time.sleep(0.05)
        return bool(super().serving_safe)


def test_two_threads_cannot_both_open_a_transaction() -> None:
    model = build()
    contract = _SlowCheck(model, "strict").seal()
    start = threading.Barrier(2)
    results: list[Any] = [None, None]

    def run(index: int) -> None:
        txn = contract.reload()
        start.wait()
        try:
            results[index] = txn.begin()
        except GraphSafeError as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    opened = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, GraphSafeError)]
    assert len(opened) == 1 and len(refused) == 1, results
    assert "already open" in str(refused[0])
    opened[0].finish()
    assert contract.serving_safe


def test_a_second_begin_from_another_thread_raises_at_once() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    holder = contract.reload().begin()
    outcome: list[BaseException | None] = []

    def other() -> None:
        try:
            contract.reload().begin()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "a second begin() blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], GraphSafeError) and "already open" in str(outcome[0])
    load(model, 1)
    assert holder.finish().committed
    with contract.reload() as txn:  # released: the next reload opens
        load(model, 2)
    assert txn.outcome is not None and txn.outcome.committed


def test_a_refused_begin_does_not_keep_the_contract_locked() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    with pytest.raises(ContractViolation), contract.reload():
        load(model, 1, bad=True)
    for _ in range(2):  # refused for being unsafe, every time: never "already open"
        with pytest.raises(NotServingSafeError), contract.reload():
            pass
    capture(model, contract)
    contract.reseal()
    with contract.reload() as txn:
        load(model, 2, bad=True)  # the layout the recapture saw
    assert txn.outcome is not None and txn.outcome.committed


# ----------------------------------------------------------------------------------------------------------------
# The way back: a reseal needs a capture taken after the reload that made the contract unsafe.


@pytest.mark.parametrize("mode", MODES)
def test_reseal_after_a_failed_reload_needs_a_recapture(mode: str) -> None:
    model = build()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    graph = capture(model, contract)
    try:
        with contract.reload():
            load(model, 1, bad=True)
    except ContractViolation:
        pass
    assert contract.last_outcome is not None and contract.last_outcome.status is not Status.COMMITTED
    assert not contract.serving_safe
    assert addresses(model) != graph  # the graph reads the storage of before the reload
    with pytest.raises(NotServingSafeError, match=r"recapture the graphs, then reseal\(\)"):
        contract.reseal()
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError, match="recapture"):
        contract.seal()  # the same rule, whichever name is called
    graph = capture(model, contract)
    assert contract.reseal().serving_safe
    assert addresses(model) == graph
    with contract.reload():
        load(model, 2, bad=True)  # the layout the recapture saw: restored in place now
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert addresses(model) == graph


def test_a_capture_before_the_failure_is_no_evidence() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    capture(model, contract)
    contract.note_capture()
    with pytest.raises(ContractViolation), contract.reload():
        load(model, 1, bad=True)
    with pytest.raises(NotServingSafeError):
        contract.reseal()


def test_note_capture_and_an_explicit_vouch_both_allow_the_reseal() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    before = contract.captures
    with pytest.raises(ContractViolation), contract.reload():
        load(model, 1, bad=True)
    assert contract.note_capture() == before + 1 == contract.captures
    assert contract.reseal().serving_safe
    with pytest.raises(ContractViolation), contract.reload():
        load(model, 2)  # back to the first layout: respecified again
    assert contract.reseal(recaptured=True).serving_safe


def test_mark_unsafe_needs_a_recapture_too() -> None:
    model = build()
    contract = GraphContract(model, "strict").seal()
    contract.mark_unsafe("an adapter saw the graphs go stale")
    with pytest.raises(NotServingSafeError, match="an adapter saw"):
        contract.reseal()
    contract.note_capture()
    assert contract.reseal().serving_safe


def test_recapture_callbacks_are_the_recapture() -> None:
    model = build()
    contract = GraphContract(model, "recapture").seal()
    graphs: list[dict[str, int]] = [capture(model, contract)]
    contract.on_recapture(lambda outcome: graphs.append(capture(model, contract)))
    with contract.reload():
        load(model, 1, bad=True)
    assert contract.last_outcome is not None and contract.last_outcome.needs_recapture
    assert contract.serving_safe and len(graphs) == 2
    assert addresses(model) == graphs[-1]


def test_a_callback_that_does_not_capture_is_trusted_as_the_recapture() -> None:
    model = build()
    contract = GraphContract(model, "migrate").seal()
    contract.on_recapture(lambda outcome: None)  # registered: the caller says it recaptures
    with contract.reload():
        load(model, 1, bad=True)
    assert contract.serving_safe


def test_the_torch_adapter_reports_its_captures() -> None:
    model = build()
    runner = GraphRunner(model, GraphContract(model, "strict"))
    x = torch.ones(1, 3)
    graph = runner.capture(x)
    assert runner.contract.captures >= 1
    with pytest.raises(ContractViolation):
        runner.run_reload(lambda: load(model, 1, bad=True))
    with pytest.raises(NotServingSafeError):
        runner.contract.reseal()
    runner.recapture()  # captures every graph again, then reseals
    assert runner.contract.serving_safe
    runner.run_reload(lambda: load(model, 2, bad=True))
    assert torch.equal(graph.replay(), model(x))


# A sequence of steps against the oracle: whenever the contract calls itself serving-safe, the model holds every
# derived tensor at the address the last capture recorded.
_STEPS = st.lists(st.sampled_from(["good", "bad", "capture", "reseal", "note"]), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(MODES), steps=_STEPS)
def test_serving_safe_always_means_the_graph_reads_the_model(mode: str, steps: list[str]) -> None:
    model = build()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    graph = capture(model, contract)
    seed = 1
    for step in steps:
        seed += 1
        if step in ("good", "bad"):
            try:
                with contract.reload():
                    load(model, seed, bad=step == "bad")
            except ContractViolation:
                pass
        elif step == "capture":
            graph = capture(model, contract)
        elif step == "note":  # a capture some other tool made and reported
            graph = addresses(model)
            contract.note_capture()
        else:
            with contextlib.suppress(NotServingSafeError):
                contract.reseal()
        if contract.serving_safe:
            assert addresses(model) == graph, f"serving-safe after {steps} while the graph reads other memory"
