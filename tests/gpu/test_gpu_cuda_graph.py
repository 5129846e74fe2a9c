"""The capture drop-in on a real GPU: ``graphsafe.cuda_graph`` records what ``record_capture(graph=g,
backend="kernel")`` records, a ``torch.compile``'d forward captures through it the kernels it captures without
graphsafe, and a reload after such a capture commits and replays the new weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _graph_models import Mlp, warm

import graphsafe
from graphsafe import GraphContract, Status
from graphsafe.adapters.torch import run_reload
from graphsafe.collectors import Manifest, kernel_scan_unavailable, record_capture, scan_graph
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.errors import GraphSafeError

pytestmark = pytest.mark.gpu

# Replay against an eager forward: the same kernels for an eager model, Inductor's fused Triton kernels (another
# reduction order) for a compiled one.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _needs_the_kernel_scan() -> None:
    why = kernel_scan_unavailable()
    if why is not None:
        pytest.skip(why)


def _model(device: torch.device, seed: int = 0) -> Mlp:
    torch.manual_seed(seed)
    return Mlp().to(device).eval()


def _names(graph: torch.cuda.CUDAGraph) -> list[str]:
    """The kernel names of a captured keep_graph graph, read from its nodes (cuGraphGetNodes)."""
    return scan_graph(kscan.raw_graph(graph), kscan.driver()).kernel_names


def _facts(manifest: Manifest, capture: str) -> list[tuple[Any, ...]]:
    return sorted(
        (e.data_ptr, e.nbytes, e.lo, e.hi, e.op, e.backend, e.access, tuple(h.where for h in e.holders))
        for e in manifest.entries(capture)
    )


def _replay(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> torch.Tensor:
    out.fill_(float("nan"))  # a replay that did not run cannot pass
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


# -- the drop-in records what the explicit kernel-scan capture records ----------------------------------------------
def test_the_drop_in_records_what_record_capture_with_the_kernel_scan_records(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    warm(model, x)
    contract = GraphContract(model, "recapture").seal()

    dropped = Manifest()
    with torch.no_grad(), graphsafe.cuda_graph(contract, name="g", ignore=[x], manifest=dropped) as graph:
        out = model(x)
    explicit = Manifest()
    kept = torch.cuda.CUDAGraph(keep_graph=True)
    with (
        torch.no_grad(),
        record_capture(contract, name="g", graph=kept, backend="kernel", ignore=[x], manifest=explicit),
        torch.cuda.graph(kept),
    ):
        model(x)

    assert dropped.backends() == explicit.backends() == {"g": "kernel-scan"}
    assert dropped.complete and explicit.complete
    assert _facts(dropped, "g") and _facts(dropped, "g") == _facts(explicit, "g")
    assert _names(graph) == _names(kept)
    assert {h.where for e in dropped.entries("g") for h in e.holders} >= {"up:weight", "down:weight"}

    x.copy_(torch.randn_like(x))
    got = _replay(graph, out)
    with torch.no_grad():
        assert torch.allclose(got, model(x), rtol=RTOL, atol=ATOL)


# -- a compiled forward captures the same kernels with graphsafe as without ------------------------------------------
def test_a_compiled_forward_captures_the_same_kernels_through_the_drop_in_as_without_graphsafe(
    device: torch.device, gpu_notes: list[str]
) -> None:
    model = _model(device)
    compiled = torch.compile(model)
    x = torch.randn(8, 64, device=device)
    warm(compiled, x)

    plain = torch.cuda.CUDAGraph(keep_graph=True)  # kept only to read its nodes; captured without graphsafe
    with torch.no_grad(), torch.cuda.graph(plain):
        compiled(x)
    contract = GraphContract(model, "recapture").seal()
    with torch.no_grad(), graphsafe.cuda_graph(contract, name="compiled", ignore=[x]) as graph:
        out = compiled(x)

    off, on = _names(plain), _names(graph)
    gpu_notes.append(f"cuda_graph drop-in, compiled forward: kernels without graphsafe {off}, through it {on}")
    assert any("triton" in name for name in off), off
    assert on == off
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.backends() == {"compiled": "kernel-scan"}

    x.copy_(torch.randn_like(x))
    got = _replay(graph, out)
    with torch.no_grad():
        assert torch.allclose(got, model(x), rtol=RTOL, atol=ATOL)


# -- a reload after a drop-in capture ----------------------------------------------------------------------------------
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_reload_after_a_drop_in_capture_commits_and_replays_the_new_weights(
    device: torch.device, mode: str, compiled: bool
) -> None:
    model = _model(device, seed=0)
    fn: Any = torch.compile(model) if compiled else model
    x = torch.randn(8, 64, device=device)
    warm(fn, x)
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    with torch.no_grad(), graphsafe.cuda_graph(contract, name="serve", ignore=[x]) as graph:
        out = fn(x)
    before = _replay(graph, out)

    fresh = _model(device, seed=1)  # the new weights, and the oracle: an eager forward of a model built on them
    state = {name: value.detach().clone() for name, value in fresh.state_dict().items()}
    outcome = run_reload(contract, lambda: model.load_state_dict(state, assign=True))
    assert outcome.status is Status.COMMITTED, outcome.summary()

    got = _replay(graph, out)
    with torch.no_grad():
        want = fresh(x)
    assert not torch.allclose(before, want, rtol=RTOL, atol=ATOL), "the new weights must change the output"
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL)


# -- torch.cuda.graph's arguments pass through -------------------------------------------------------------------------
def test_two_drop_in_captures_share_a_pool_and_a_stream_and_each_replays_equal_eager(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    warm(model, x)
    contract = GraphContract(model, "recapture").seal()
    with torch.no_grad(), graphsafe.cuda_graph(contract, name="first", ignore=[x], stream=stream) as first:
        out_first = model(x)
    with (
        torch.no_grad(),
        graphsafe.cuda_graph(
            contract, name="second", ignore=[x], pool=first.pool(), stream=stream, capture_error_mode="thread_local"
        ) as second,
    ):
        out_second = model(x) * 2
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert manifest.backends() == {"first": "kernel-scan", "second": "kernel-scan"}
    x.copy_(torch.randn_like(x))
    with torch.no_grad():
        want = model(x)
    assert torch.allclose(_replay(first, out_first), want, rtol=RTOL, atol=ATOL)
    assert torch.allclose(_replay(second, out_second), want * 2, rtol=RTOL, atol=ATOL)


# -- torch's real graphs, refused before capture -----------------------------------------------------------------------
def test_a_real_graph_without_keep_graph_or_already_captured_is_refused(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    warm(model, x)
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.raises(GraphSafeError, match=r"needs a graph made with torch.cuda.CUDAGraph\(keep_graph=True\)"),
        graphsafe.cuda_graph(contract, torch.cuda.CUDAGraph()),
    ):
        pass
    with torch.no_grad(), graphsafe.cuda_graph(contract, name="once", ignore=[x]) as graph:
        model(x)
    with (
        pytest.raises(GraphSafeError, match="got a graph that already holds a capture"),
        graphsafe.cuda_graph(contract, graph),
    ):
        pass
    assert contract.captures == 1


# -- the perturbing recorder is never taken silently -------------------------------------------------------------------
def test_record_capture_around_torch_cuda_graph_without_a_graph_warns_and_names_the_drop_in(
    device: torch.device,
) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    warm(model, x)
    contract = GraphContract(model, "recapture").seal()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.warns(UserWarning, match=r"recorded by the dispatch recorder, .*graphsafe\.cuda_graph\(contract\)"),
        torch.no_grad(),
        record_capture(contract, name="omitted", ignore=[x]) as manifest,
        torch.cuda.graph(graph),
    ):
        model(x)
    assert manifest.backends() == {"omitted": "dispatch"}
