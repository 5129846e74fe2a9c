"""The plain-PyTorch adapter in its no-graph fallback (CPU): capture, replay, reload, recapture, refusal.

The fallback replays eagerly, so it cannot show staleness (tests/gpu does, with real CUDA graphs); what it shares
with the graph path is the control flow, which is what these tests pin: seal after warm-up, record the capture,
recapture on NEEDS_RECAPTURE, refuse to replay while the contract is unsafe, keep the static output.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import (
    ContractViolation,
    GraphContract,
    GraphSafeError,
    NotServingSafeError,
    RecaptureError,
    Status,
    stable_empty,
)
from graphsafe.adapters.torch import CapturedGraph, GraphRunner, capture, recapture_and_reseal, run_reload
from graphsafe.collectors import Manifest
from graphsafe.testing.zoo import EXAMPLES

N = 4


class Kernel:
    def __init__(self) -> None:
        self.w_t: torch.Tensor | None = None


class Layer(nn.Module):
    """PWAL derives ``kernel.w_t`` as a NEW tensor on every load; forward lazily allocates a declared scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N, N), requires_grad=False)
        self.kernel = Kernel()
        self.scratch: torch.Tensor | None = None
        self.forwards = 0

    def pwal(self) -> None:
        self.kernel.w_t = self.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.scratch is None:
            self.scratch = stable_empty(self, "scratch", (8, N), x.dtype, x.device)
        assert self.kernel.w_t is not None
        buf = self.scratch[: x.shape[0]]
        torch.matmul(x, self.kernel.w_t, out=buf)
        return buf * 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def load(model: Model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, Layer)
            layer.weight.copy_(torch.randn(N, N, generator=generator) / 2)
            layer.pwal()


def build(seed: int = 0) -> Model:
    model = Model()
    load(model, seed)
    return model


def eager(seed: int, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = build(seed)(x)
    return out


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(3, N, generator=torch.Generator().manual_seed(7))


def test_capture_falls_back_to_eager_on_cpu(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x, warmup=2)
    assert not graph.uses_graph and graph.graph is None and graph.captures == 1
    layer = model.layers[0]
    assert isinstance(layer, Layer) and layer.forwards == 3  # two warm-ups and the recorded capture
    assert contract.sealed and isinstance(contract.manifest, Manifest)
    assert contract.manifest.captures == (graph.name,)
    out = graph.output
    assert torch.equal(out, eager(0, x))
    x.copy_(torch.randn(3, N))
    assert graph.replay() is out
    assert torch.equal(out, eager(0, x))


def test_seal_happens_after_warm_up(x: torch.Tensor) -> None:
    # The scratch is allocated and declared by the first forward: a seal before warm-up would not track it.
    early = build()
    assert "scratch" not in {slot.path for slot in GraphContract(early, "recapture").seal().slots()}
    model = build()
    contract = GraphContract(model, "recapture")
    capture(contract, model, x)
    assert "scratch" in {slot.path for slot in contract.slots()}


def test_recapture_mode_recaptures_what_it_owns(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    out = graph.output
    outcome = run_reload(contract, lambda: load(model, seed=1))
    assert outcome.status is Status.NEEDS_RECAPTURE
    assert graph.captures == 2 and contract.serving_safe
    assert graph.replay() is out
    assert torch.equal(out, eager(1, x))
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.captures == (graph.name,)
    assert all(entry.alive for entry in manifest.entries())  # the old capture's entries were replaced


def test_committed_reload_does_not_recapture(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "migrate")
    graph = capture(contract, model, x)
    outcome = run_reload(contract, lambda: load(model, seed=1))
    assert outcome.status is Status.COMMITTED and outcome.auto_restored
    assert graph.captures == 1
    assert torch.equal(graph.replay(), eager(1, x))


def test_every_owned_graph_is_recaptured(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    whole = capture(contract, model, x, name="whole")
    first = capture(contract, model.layers[0], x, name="first")
    run_reload(contract, lambda: load(model, seed=1))
    assert (whole.captures, first.captures) == (2, 2)
    with torch.no_grad():
        want = build(1).layers[0](x)
    assert torch.equal(first.replay(), want)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and set(manifest.captures) == {"whole", "first"}


def test_strict_mode_raises_and_refuses_to_replay(x: torch.Tensor) -> None:
    model = build()
    with GraphRunner(model, mode="strict") as runner:
        graph = runner.capture(x)
        graph.output.fill_(float("nan"))
        with pytest.raises(ContractViolation):
            runner.run_reload(lambda: load(model, seed=1))
        with pytest.raises(NotServingSafeError, match=graph.name):
            graph.replay()
        assert torch.isnan(graph.output).all() and graph.captures == 1
        runner.recapture()  # the way back, with the new weights in place
        assert runner.contract.serving_safe and graph.captures == 2
        assert torch.equal(graph.replay(), eager(1, x))


def test_a_failing_load_is_reraised_and_replay_refused(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)

    def broken() -> None:
        raise OSError("checkpoint shard missing")

    with pytest.raises(OSError, match="shard"):
        run_reload(contract, broken)
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.FAILED
    with pytest.raises(NotServingSafeError):
        graph.replay()


def test_a_failing_recapture_leaves_the_contract_unsafe(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    calls = 0

    def fn(inp: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > 4:  # 3 warm-ups + 1 capture, then the recapture fails
            raise RuntimeError("capture failed")
        out: torch.Tensor = model(inp)
        return out

    graph = capture(contract, fn, x)
    with pytest.raises(RecaptureError, match="capture failed"):
        run_reload(contract, lambda: load(model, seed=1))
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError):
        graph.replay()


def test_closed_graph_is_not_recaptured_and_leaves_the_manifest(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    kept = capture(contract, model, x, name="kept")
    graph.close()
    graph.close()  # idempotent
    run_reload(contract, lambda: load(model, seed=1))
    assert graph.captures == 1 and kept.captures == 2
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.captures == ("kept",)
    with pytest.raises(GraphSafeError, match="closed"):
        graph.replay()


def test_a_dropped_graph_is_freed_at_once_and_forgotten(x: torch.Tensor) -> None:
    # No reference cycle through the contract: the graph dies by refcount (never inside some later capture's GC).
    model = build()
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x, name="dropped")
    ref = weakref.ref(graph)
    del graph
    assert ref() is None
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.captures == ()
    outcome = run_reload(contract, lambda: load(model, seed=1))
    assert outcome.status is Status.NEEDS_RECAPTURE and not contract.serving_safe  # nobody left to recapture


def test_without_owned_graphs_the_contract_waits_for_reseal(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    graph.close()
    outcome = run_reload(contract, lambda: load(model, seed=1))
    assert outcome.status is Status.NEEDS_RECAPTURE and not contract.serving_safe


def test_structured_output_is_kept(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")

    def fn(inp: torch.Tensor) -> dict[str, Any]:
        y = model(inp)
        return {"y": y, "pair": (y.sum(0), inp + 1)}

    graph = capture(contract, fn, [x])
    out = graph.output
    assert set(out) == {"y", "pair"} and isinstance(out["pair"], tuple)
    run_reload(contract, lambda: load(model, seed=1))
    assert graph.replay() is out
    assert torch.equal(out["y"], eager(1, x)) and torch.equal(out["pair"][1], x + 1)


def test_bad_arguments_are_refused(x: torch.Tensor) -> None:
    model = build()
    contract = GraphContract(model, "recapture")
    with pytest.raises(GraphSafeError, match="use_graph=True needs CUDA"):
        capture(contract, model, x, use_graph=True)
    with pytest.raises(GraphSafeError, match="must return tensors"):
        capture(contract, lambda inp: (model(inp), 3), x)
    with pytest.raises(ValueError, match="warmup"):
        capture(contract, model, x, warmup=-1)
    with pytest.raises(TypeError, match="static inputs must be tensors"):
        capture(contract, model, [x, 3])  # type: ignore[list-item]
    other = build()
    with pytest.raises(GraphSafeError, match="another model"):
        GraphRunner(model, GraphContract(other, "recapture"))


def test_runner_owns_its_graphs(x: torch.Tensor) -> None:
    model = build()
    runner = GraphRunner(model)
    assert runner.contract.mode == "recapture"
    graph = runner.capture(x, warmup=0)
    assert isinstance(graph, CapturedGraph) and runner.graphs == (graph,)
    outcome = runner.run_reload(lambda: load(model, seed=2))
    assert outcome.needs_recapture and graph.captures == 2
    assert torch.equal(graph.replay(), eager(2, x))
    runner.close()
    assert runner.graphs == ()
    with pytest.raises(GraphSafeError, match="closed"):
        graph.replay()


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_zoo_round_trip_in_fallback(name: str) -> None:
    # The CPU twin of tests/gpu: every example, legacy under recapture and migrated under strict.
    ex = EXAMPLES[name]
    for variant, mode, expected in (
        ("legacy", "recapture", Status.NEEDS_RECAPTURE),
        ("migrated", "strict", Status.COMMITTED),
    ):
        model = ex.build(variant, seed=0)
        inp = ex.example_input(model)
        contract = GraphContract(model, mode)
        graph = capture(contract, model, inp)
        first = graph.replay().clone()
        outcome = run_reload(contract, lambda model=model: ex.load_weights(model, ex.make_weights(model, 1)))
        assert outcome.status is expected, outcome.summary()
        fresh = ex.build(variant, seed=1)
        with torch.no_grad():
            assert torch.equal(graph.replay(), fresh(inp))
        run_reload(contract, lambda model=model: ex.load_weights(model, ex.make_weights(model, 0)))
        assert torch.equal(graph.replay(), first)


# ----------------------------------------------------------------------------------------------------------------
# Recovery after a failed reload.


def test_recovery_names_the_next_step_and_needs_a_recapture(x: torch.Tensor) -> None:
    """After a strict failure every refusal says "recapture, then reseal"; a reseal with no recapture is refused
    (the graph would replay freed memory); ``graph.recapture_and_reseal()`` is the one-call way back."""
    model = build()
    contract = GraphContract(model, "strict")
    graph = capture(contract, model, x)
    other = capture(contract, lambda t: model(t) + 1, x)
    with pytest.raises(ContractViolation):
        run_reload(contract, lambda: load(model, seed=1))
    with pytest.raises(NotServingSafeError, match=r"recapture.*then reseal") as replay_refused:
        graph.replay()
    assert "recapture_and_reseal()" in str(replay_refused.value)
    with pytest.raises(NotServingSafeError, match=r"refusing to reload: .*recapture the graphs, then reseal\(\)"):
        run_reload(contract, lambda: load(model, seed=1))
    with pytest.raises(NotServingSafeError, match="recapture the graphs, then reseal"):
        contract.reseal()  # no recapture: replay would read the storage of before the reload
    assert not contract.serving_safe

    assert graph.recapture_and_reseal() is contract
    assert contract.serving_safe and graph.captures == 2 and other.captures == 2  # every graph of the contract
    assert torch.equal(graph.replay(), eager(1, x))
    assert torch.equal(other.replay(), eager(1, x) + 1)


def test_recapture_and_reseal_needs_a_graph_of_the_adapter(x: torch.Tensor) -> None:
    model = build()
    graph = capture(GraphContract(model, "strict"), model, x)
    other_model = build()
    lone = GraphContract(other_model, "strict").seal()
    graph.close()
    with pytest.raises(GraphSafeError, match="was closed"):
        graph.recapture_and_reseal()
    with pytest.raises(GraphSafeError, match="no open graph"):
        recapture_and_reseal(lone)
