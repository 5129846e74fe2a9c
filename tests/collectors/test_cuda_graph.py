"""The capture drop-in (``graphsafe.cuda_graph``) without a GPU: what it refuses before any capture, and its steps
(keep_graph graph, capture with nothing active, kernel scan, instantiate) on a fake graph, a fake ``torch.cuda.graph``
and a recorded node table. The real capture is tests/gpu/test_gpu_cuda_graph.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import graphsafe
from graphsafe import GraphContract
from graphsafe.collectors import Manifest, ScanUnavailable, cuda_graph, record_capture
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.errors import GraphSafeError

_TABLE: dict[str, torch.Tensor] = {}


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.register_buffer("held_unread", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class FakeGraph:
    """Stands for ``torch.cuda.CUDAGraph`` on CPU: torch's refusals of ``raw_cuda_graph``, and a log of its calls."""

    made: ClassVar[list[FakeGraph]] = []

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self.captured = False
        self.calls: list[str] = []
        FakeGraph.made.append(self)

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("capture_begin")

    def capture_end(self) -> None:
        self.calls.append("capture_end")
        self.captured = True

    def instantiate(self) -> None:
        self.calls.append("instantiate")

    def raw_cuda_graph(self) -> int:
        if not self.keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized "
                               "with keep_graph=true")  # fmt: skip
        if not self.captured:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance until capture_end() has been called")
        return 1


class FakeCapture:
    """Stands for ``torch.cuda.graph``: begins and ends the capture, and keeps what it was called with."""

    seen: ClassVar[list[dict[str, Any]]] = []

    def __init__(
        self, cuda_graph: FakeGraph, pool: Any = None, stream: Any = None, capture_error_mode: str = "global"
    ) -> None:
        self.graph = cuda_graph
        FakeCapture.seen.append({"pool": pool, "stream": stream, "capture_error_mode": capture_error_mode})

    def __enter__(self) -> None:
        self.graph.capture_begin()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.graph.capture_end()


@pytest.fixture
def fake_torch_graph(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A CUDA device that is a fake ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``."""
    FakeGraph.made.clear()
    FakeCapture.seen.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    yield


def _word(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _table(*tensors: torch.Tensor) -> dict[str, Any]:
    params = [_word(t.untyped_storage().data_ptr()).hex() for t in tensors]
    layout = [[8 * i, 8] for i in range(len(tensors))]
    return {"root": 1, "graphs": {"1": [{"type": "kernel", "name": "gemm", "layout": layout, "params": params}]}}


def _facts(manifest: Manifest, capture: str) -> list[tuple[Any, ...]]:
    return sorted(
        (e.data_ptr, e.nbytes, e.lo, e.hi, e.op, e.backend, e.access, tuple(h.where for h in e.holders))
        for e in manifest.entries(capture)
    )


# -- what it refuses before any capture -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"capture_error_mode": "loose"}, r"cuda_graph\(capture_error_mode='loose'\) is not a capture mode; use"),
        ({"fallback": "eager"}, r"cuda_graph\(fallback='eager'\) is not a fallback; use 'error'"),
        (
            {"graph": object()},
            r"cuda_graph\(graph=\.\.\.\) got a 'object', not a torch.cuda.CUDAGraph; pass "
            r"torch.cuda.CUDAGraph\(keep_graph=True",
        ),
        (
            {"graph": "no-keep"},
            r"cuda_graph\(graph=\.\.\.\) needs a graph made with torch.cuda.CUDAGraph\(keep_graph=True\)",
        ),
        ({"graph": "captured"}, r"cuda_graph\(graph=\.\.\.\) got a graph that already holds a capture; pass a new"),
    ],
)
def test_arguments_it_cannot_capture_with_are_refused_before_the_block_runs(
    fake_torch_graph: None, kwargs: dict[str, Any], message: str
) -> None:
    if kwargs.get("graph") == "no-keep":
        kwargs["graph"] = FakeGraph(keep_graph=False)
    elif kwargs.get("graph") == "captured":
        kwargs["graph"] = FakeGraph(keep_graph=True)
        kwargs["graph"].captured = True
    model = Linear()
    contract = GraphContract(model, "recapture").seal()
    ran = []
    with pytest.raises(GraphSafeError, match=f"^collectors: {message}"), cuda_graph(contract, **kwargs):
        ran.append(True)
    assert ran == [] and contract.manifest is None and contract.captures == 0
    assert all(g.calls == [] for g in FakeGraph.made), "nothing was captured"


def test_nowhere_to_record_is_refused(fake_torch_graph: None) -> None:
    with (
        pytest.raises(GraphSafeError, match=r"^collectors: cuda_graph\(None\) has nowhere to record; pass"),
        cuda_graph(None),
    ):
        pass


def test_without_cuda_it_refuses_and_names_the_cpu_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = Linear()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.raises(
            GraphSafeError, match=r"^collectors: cuda_graph: CUDA is not available.*record_capture\(contract\)"
        ),
        cuda_graph(contract),
    ):
        pass
    assert contract.manifest is None and contract.captures == 0


def test_without_the_kernel_scan_it_refuses_unless_told_to_fall_back(
    fake_torch_graph: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_driver() -> Any:
        raise ScanUnavailable("kernel scan unavailable: cuda-bindings is not installed")

    monkeypatch.setattr(kscan, "driver", no_driver)
    model = Linear()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.raises(
            GraphSafeError,
            match=r"^collectors: cuda_graph: kernel scan unavailable: cuda-bindings is not installed; .*"
            r"fallback='dispatch'",
        ),
        cuda_graph(contract),
    ):
        pass
    assert FakeGraph.made == [] and contract.manifest is None  # no graph made, nothing captured or recorded


def test_the_dispatch_fallback_is_explicit_and_says_so(fake_torch_graph: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> Any:
        raise ScanUnavailable("kernel scan unavailable: cuda-bindings is not installed")

    monkeypatch.setattr(kscan, "driver", no_driver)
    model = Linear()
    contract = GraphContract(model, "recapture").seal()
    x = torch.randn(2, 4)
    with (
        pytest.warns(UserWarning, match=r"kernel scan unavailable: .*; recorded by the dispatch recorder instead"),
        torch.no_grad(),
        cuda_graph(contract, name="g", fallback="dispatch", ignore=[x]) as graph,
    ):
        assert _get_current_dispatch_mode() is not None  # the recorder is active: what the fallback means
        model(x)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.backends() == {"g": "dispatch"}
    assert {h.where for e in manifest.storages() for h in e.holders} == {"<model>:weight"}
    assert isinstance(graph, FakeGraph) and graph.calls == ["capture_begin", "capture_end", "instantiate"]


class OldGraph(FakeGraph):
    """A torch without ``keep_graph``: its graphs cannot be kept, have no raw graph and no ``instantiate``."""

    def __init__(self) -> None:
        super().__init__(keep_graph=False)

    def __getattribute__(self, name: str) -> Any:
        if name in ("raw_cuda_graph", "instantiate"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_torch_without_keep_graph_is_refused_unless_told_to_fall_back(
    fake_torch_graph: None, fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", OldGraph)
    model = Linear()
    fake_cuda["table"] = _table(model.weight)  # the driver is there: only torch cannot keep the graph
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.raises(
            GraphSafeError, match=r"^collectors: cuda_graph: torch .* has no torch.cuda.CUDAGraph\(keep_graph"
        ),
        cuda_graph(contract),
    ):
        pass
    assert contract.manifest is None
    with (
        pytest.warns(UserWarning, match=r"keep_graph=True\); recorded by the dispatch recorder instead"),
        torch.no_grad(),
        cuda_graph(contract, name="g", fallback="dispatch") as graph,
    ):
        model(torch.randn(2, 4))
    assert isinstance(graph, OldGraph) and graph.calls == ["capture_begin", "capture_end"]  # torch instantiated it
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.backends() == {"g": "dispatch"}


# -- its steps, on a fake graph and a recorded node table ------------------------------------------------------------
def test_it_makes_a_kept_graph_captures_with_nothing_active_then_scans_and_instantiates(
    fake_torch_graph: None, fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Linear()
    x, out = torch.randn(2, 4), torch.zeros(2, 4)
    fake_cuda["table"] = _table(model.weight, x, out)
    fake_cuda["tensors"] = [model.weight, model.held_unread, x, out]
    contract = GraphContract(model, "recapture").seal()
    scans: list[list[str]] = []
    scan = kscan.scan_graph

    def logged_scan(root: int, drv: Any) -> Any:
        scans.append(list(FakeGraph.made[-1].calls))  # what the graph had been through when it was scanned
        return scan(root, drv)

    monkeypatch.setattr(kscan, "scan_graph", logged_scan)
    stream, pool = object(), (0, 7)
    with (
        torch.no_grad(),
        graphsafe.cuda_graph(
            contract,
            name="g",
            ignore=[x, out],
            pool=pool,
            stream=stream,
            capture_error_mode="relaxed",  # type: ignore[arg-type]
        ) as graph,
    ):
        assert _get_current_dispatch_mode() is None  # nothing perturbs what the capture captures
        out.copy_(model(x))
    assert isinstance(graph, FakeGraph) and graph.keep_graph
    assert FakeCapture.seen == [{"pool": pool, "stream": stream, "capture_error_mode": "relaxed"}]
    assert scans == [["capture_begin", "capture_end"]]  # scanned after capture_end, before instantiate
    assert graph.calls == ["capture_begin", "capture_end", "instantiate"]
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.backends() == {"g": "kernel-scan"} and manifest.complete
    assert contract.captures == 1

    # The same manifest as record_capture(graph=, backend="kernel") around torch.cuda.graph on the same graph nodes.
    reference = Manifest()
    kept = FakeGraph(keep_graph=True)
    with (
        record_capture(contract, name="g", graph=kept, ignore=[x, out], manifest=reference, backend="kernel"),
        torch.cuda.graph(kept),  # type: ignore[arg-type]
    ):
        out.copy_(model(x))
    assert _facts(manifest, "g") == _facts(reference, "g")
    assert [h for e in manifest.entries("g") for h in e.holders] != []  # the weight's read is held at its path


def test_a_graph_passed_in_is_the_graph_captured(fake_torch_graph: None, fake_cuda: dict[str, Any]) -> None:
    model = Linear()
    fake_cuda["table"] = _table(model.weight)
    fake_cuda["tensors"] = [model.weight]
    manifest = Manifest()
    mine = FakeGraph(keep_graph=True)
    with cuda_graph(None, mine, manifest=manifest) as graph:  # type: ignore[arg-type]
        pass
    assert graph is mine and mine.calls == ["capture_begin", "capture_end", "instantiate"]
    assert list(manifest.backends().values()) == ["kernel-scan"]


def test_an_error_in_the_block_records_nothing_and_instantiates_nothing(
    fake_torch_graph: None, fake_cuda: dict[str, Any]
) -> None:
    model = Linear()
    fake_cuda["table"] = _table(model.weight)
    fake_cuda["tensors"] = [model.weight]
    contract = GraphContract(model, "recapture").seal()
    with pytest.raises(ValueError, match="boom"), cuda_graph(contract, name="g") as graph:
        raise ValueError("boom")
    assert isinstance(graph, FakeGraph) and graph.calls == ["capture_begin", "capture_end"]
    assert contract.manifest is None and contract.captures == 0


# -- record_capture around a CUDA capture without graph= -----------------------------------------------------------
@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op runs while a CUDA stream is capturing (as inside ``torch.cuda.graph``)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_record_capture_around_a_cuda_capture_without_a_graph_is_never_silent(capturing: None) -> None:
    model = Linear()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.warns(UserWarning, match=r"^graphsafe: capture 'g': recorded by the dispatch recorder, a .*cuda_graph"),
        torch.no_grad(),
        record_capture(contract, name="g") as manifest,
    ):
        model(torch.randn(2, 4))
    assert manifest.backends() == {"g": "dispatch"}
    assert [n for n in manifest.notes if "graphsafe.cuda_graph(contract)" in n] == [manifest.notes[-1]]


@pytest.mark.parametrize("where", ["explicit dispatch", "no capture"])
def test_record_capture_chosen_explicitly_or_around_no_capture_does_not_warn(
    where: str, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    if where == "explicit dispatch":
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    model = Linear()
    contract = GraphContract(model, "recapture").seal()
    backend = "dispatch" if where == "explicit dispatch" else "auto"
    with torch.no_grad(), record_capture(contract, name="g", backend=backend) as manifest:
        model(torch.randn(2, 4))
    assert manifest.notes == [] and [str(w.message) for w in recwarn] == []
    assert {h.where for e in manifest.storages() for h in e.holders} == {"<model>:weight"}
