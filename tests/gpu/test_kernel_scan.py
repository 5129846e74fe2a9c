"""The kernel scan on a real GPU: what a captured graph's kernel nodes point into, for ATen/cuBLAS, Triton (both
torch.compile's and a user kernel) and a CuPy RawKernel; the dispatch recorder beside it as the cross-check."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _graph_models import Mlp, warm
from torch import nn

from graphsafe import GraphContract, ReloadFailedError
from graphsafe.adapters.torch import capture, run_reload
from graphsafe.collectors import Manifest, RecordedDriver, record_capture, record_table, scan_graph
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.outcome import FindingKind, Status

#: Read only by the compiled forwards below; no model path holds it.
_CACHE: dict[str, torch.Tensor] = {}


def _names(graph: torch.cuda.CUDAGraph) -> list[str]:
    return scan_graph(kscan.raw_graph(graph), kscan.driver()).kernel_names


def _model(device: torch.device) -> Mlp:
    torch.manual_seed(0)
    return Mlp().to(device).eval()


# -- the graph checked is the graph that serves ---------------------------------------------------------------------
def test_compiled_forward_captures_the_same_kernels_with_the_manifest_on(
    device: torch.device, gpu_notes: list[str]
) -> None:
    model = _model(device)
    compiled = torch.compile(model)
    x = torch.randn(8, 64, device=device)
    warm(compiled, x)

    plain = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.no_grad(), torch.cuda.graph(plain):
        compiled(x)
    contract = GraphContract(model, "recapture").seal()
    scanned = torch.cuda.CUDAGraph(keep_graph=True)
    with (
        torch.no_grad(),
        record_capture(contract, name="scanned", graph=scanned, ignore=[x]),
        torch.cuda.graph(scanned),
    ):
        compiled(x)
    assert contract.manifest is not None and contract.manifest.backends() == {"scanned": "kernel-scan"}
    off, on = _names(plain), _names(scanned)
    assert any("triton" in name for name in off), off
    assert on == off

    dispatched = torch.cuda.CUDAGraph(keep_graph=True)
    with (
        torch.no_grad(),
        record_capture(contract, name="dispatch", backend="dispatch", ignore=[x]),
        torch.cuda.graph(dispatched),
    ):
        compiled(x)
    gpu_notes.append(f"kernel names, plain capture:     {off}")
    gpu_notes.append(f"kernel names, kernel scan on:    {on}")
    gpu_notes.append(f"kernel names, dispatch recorder: {_names(dispatched)}")


# -- a module-level cache only compiled code reads ------------------------------------------------------------------
def _triton_add() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def add_kernel(x_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(
            out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(c_ptr + offsets, mask=mask), mask=mask
        )

    def add(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        n = x.numel()
        add_kernel[(triton.cdiv(n, 256),)](x, cache, out, n, BLOCK=256)
        return out

    return add


def test_module_cache_read_only_by_compiled_triton_is_flagged_by_the_scan_and_missed_by_dispatch(
    device: torch.device, gpu_notes: list[str]
) -> None:
    model = _model(device)
    _CACHE["bias"] = torch.randn(8, 64, device=device)
    add = _triton_add()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return add(model(x), _CACHE["bias"])

    compiled = torch.compile(forward)
    x = torch.randn(8, 64, device=device)
    warm(compiled, x)
    cache_storage = _CACHE["bias"].untyped_storage()

    contract = GraphContract(model, "recapture").seal()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.no_grad(), record_capture(contract, name="kernel", graph=graph, ignore=[x]), torch.cuda.graph(graph):
        out = compiled(x)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    scan_unowned = [e for e in manifest.unowned() if e.storage_ref() is cache_storage]
    assert len(scan_unowned) == 1, [e.describe() for e in manifest.unowned()]
    assert scan_unowned[0].backend == "kernel-scan"
    assert [id(e.storage_ref()) for e in manifest.unowned()] == [id(cache_storage)], "the output is the graph's own"

    cross = Manifest()
    dgraph = torch.cuda.CUDAGraph(keep_graph=True)
    with (
        torch.no_grad(),
        record_capture(None, name="dispatch", manifest=cross, backend="dispatch", ignore=[x]),
        torch.cuda.graph(dgraph),
    ):
        compiled(x)
    assert not [e for e in cross.entries() if e.storage_ref() is cache_storage], "the dispatch recorder saw it"
    gpu_notes.append(
        f"module cache: kernel scan flags {scan_unowned[0].describe()}; dispatch recorder saw "
        f"{len(cross.entries())} storage(s), not the cache"
    )

    # The finding at reload: alive, unowned and unwritten, so a recapture would read the same bytes.
    with contextlib.suppress(ReloadFailedError):
        run_reload(contract, lambda: None)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.FAILED
    assert [f.kind for f in outcome.problems] == [FindingKind.STALE]
    assert "capture manifest (kernel scan): unowned captured storage" in outcome.problems[0].detail
    del out


# -- unread slots, inputs and outputs --------------------------------------------------------------------------------
def test_a_held_but_unread_tensor_is_reported_as_not_read(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest) and manifest.backends() == {graph.name: "kernel-scan"}
    unread = manifest.unread(contract)
    assert unread is not None and [(i.layer, i.path) for i in unread] == [("", "held_unread")]
    outcome = run_reload(contract, lambda: model.up.weight.data.add_(1.0))
    assert outcome.committed and outcome.slots_unread == 1, outcome.summary()


def test_graph_inputs_and_outputs_are_never_unowned(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    contract = GraphContract(model, "strict")
    graph = capture(contract, model, x)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert manifest.unowned() == [], [e.describe() for e in manifest.unowned()]
    facts = manifest._scans[graph.name]
    assert facts.counts.get("ignored", 0) >= 2, facts.counts  # x read, the static output written
    outcome = run_reload(contract, lambda: model.down.weight.data.mul_(0.5))
    assert outcome.committed, outcome.summary()
    got = graph.replay().clone()
    with torch.no_grad():
        assert torch.allclose(got, model(x))


# -- coverage by kernel family --------------------------------------------------------------------------------------
def _covered(contract: GraphContract, graph_name: str, *tensors: torch.Tensor) -> list[str]:
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    read = {id(e.storage_ref()): e for e in manifest.entries(graph_name)}
    for tensor in tensors:
        assert id(tensor.untyped_storage()) in read, f"not found: {tuple(tensor.shape)}"
    return [read[id(t.untyped_storage())].op for t in tensors]


def test_cublas_gemm_reads_are_found(device: torch.device, gpu_notes: list[str]) -> None:
    model = nn.Linear(256, 256, bias=False).to(device)
    x = torch.randn(64, 256, device=device)
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    names = scan_graph(kscan.raw_graph(graph.graph), kscan.driver()).kernel_names
    ops = _covered(contract, graph.name, model.weight)
    gpu_notes.append(f"cuBLAS: {names} -> weight read by {ops}")
    assert any("gemm" in n.lower() or "sm90" in n.lower() or "cutlass" in n.lower() for n in names), names


def test_tensor_info_parameters_are_read_at_their_data_pointer_only(device: torch.device) -> None:
    # ATen's legacy index kernels take TensorInfo by value; the launch leaves the unused dims of its size and stride
    # arrays as the host stack held them. The layout the scan assumes must be torch's own.
    src = torch.randn(4, 16, 16, device=device)
    ids = torch.tensor([2, 0, 3, 1], device=device)
    out = torch.empty(4, 16, 16, device=device)
    torch.index_select(src, 0, ids, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        torch.index_select(src, 0, ids, out=out)
    scan = scan_graph(kscan.raw_graph(graph), kscan.driver())
    (node,) = [n for n in scan.nodes if "indexSelect" in n.name]
    types = kscan.parameter_types(node.name)
    assert types is not None and len(types) == len(node.layout), (node.name, types)
    infos = [i for i, name in enumerate(types) if name.startswith("at::cuda::detail::TensorInfo<")]
    assert len(infos) == 3, types
    limits = kscan.pointer_limits(node.name, node.layout)
    assert [limits[i] for i in infos] == [kscan.POINTER_SIZE] * 3, (node.layout, limits)
    assert node.params is not None
    data = {int.from_bytes(node.params[i][: kscan.POINTER_SIZE], "little") for i in infos}
    assert data == {out.data_ptr(), src.data_ptr(), ids.data_ptr()}
    assert data <= set(node.words())


def test_torch_compile_triton_reads_are_found(device: torch.device, gpu_notes: list[str]) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(1024, device=device), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x * self.scale + 1.0)

    model = Scale()
    compiled = torch.compile(model)
    x = torch.randn(16, 1024, device=device)
    contract = GraphContract(model, "recapture")
    graph = capture(contract, compiled, x)
    ops = _covered(contract, graph.name, model.scale)
    gpu_notes.append(f"Triton (torch.compile): scale read by {ops}")
    assert all("triton" in op for op in ops), ops


def test_cupy_raw_kernel_reads_are_found(device: torch.device, gpu_notes: list[str]) -> None:
    cupy = pytest.importorskip("cupy")
    kernel = cupy.RawKernel(
        r"""
        extern "C" __global__ void scale_rows(const float* x, const float* w, float* out, int n) {
            int i = blockDim.x * blockIdx.x + threadIdx.x;
            if (i < n) out[i] = x[i] * w[i % 128];
        }
        """,
        "scale_rows",
    )

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, device=device), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            n = x.numel()
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel(((n + 255) // 256,), (256,), (cupy.asarray(x), cupy.asarray(self.w), cupy.asarray(out), n))
            return out

    model = Raw()
    x = torch.randn(4, 128, device=device)
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    ops = _covered(contract, graph.name, model.w)
    gpu_notes.append(f"CuPy RawKernel: w read by {ops}")
    assert ops == ["scale_rows"]
    with torch.no_grad():
        model.w.mul_(2.0)
    assert torch.equal(graph.replay(), x * model.w)


# -- limits ----------------------------------------------------------------------------------------------------------
def test_graph_without_keep_graph_falls_back_with_a_note(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    warm(model, x)
    contract = GraphContract(model, "recapture").seal()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.warns(UserWarning, match="keep_graph=True"),
        torch.no_grad(),
        record_capture(contract, name="foreign", graph=graph, ignore=[x]) as manifest,
        torch.cuda.graph(graph),
    ):
        model(x)
    assert manifest.backends() == {"foreign": "dispatch"}
    assert {h.where for e in manifest.storages() for h in e.holders} >= {"up:weight", "down:weight"}


def test_pointer_array_is_seen_only_as_the_array(device: torch.device) -> None:
    cupy = pytest.importorskip("cupy")
    kernel = cupy.RawKernel(
        r"""
        extern "C" __global__ void gather_first(const float* const* ptrs, float* out, int n) {
            int i = threadIdx.x;
            if (i < n) out[i] = ptrs[i][0];
        }
        """,
        "gather_first",
    )

    class Grouped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(4, device=device), requires_grad=False)
            self.b = nn.Parameter(torch.randn(4, device=device), requires_grad=False)
            self.register_buffer(
                "ptrs", torch.tensor([self.a.data_ptr(), self.b.data_ptr()], dtype=torch.int64, device=device)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(2, device=device)
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel((1,), (32,), (cupy.asarray(self.ptrs), cupy.asarray(out), 2))
            return out + x

    model = Grouped()
    x = torch.zeros(2, device=device)
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    paths = {h.path for e in manifest.entries(graph.name) for h in e.holders}
    assert "ptrs" in paths and not {"a", "b"} & paths, paths  # the array, not what it points to
    # For what no graph reads, the array's words count: read to host once at scan time (a small int64 storage),
    # they point into a and b, so neither is unread (an unread="skip" contract keeps restoring them).
    facts = manifest._scans[graph.name]
    assert facts.arrays >= 1 and facts.indirect >= 2, (facts.arrays, facts.indirect)
    unread = manifest.unread(contract)
    assert unread is not None, manifest.truth()
    assert not {"a", "b"} & {i.path for i in unread}, [i.path for i in unread]


# -- a pointer table over 1 MiB is searched on its own device ------------------------------------------------------
def test_a_large_table_is_searched_on_its_device(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 workspace of 32 MiB holding device pointers among weight-like values: ``search_words`` finds on the
    GPU exactly the words in the spans that a host copy of the table finds, at a step's first and last word too."""
    targets = [torch.zeros(256, device=device) for _ in range(3)]
    table = torch.randn(8 << 20, device=device)
    words = table.view(torch.int64)
    for at, target in zip((0, (1 << 20) - 1, words.numel() - 1), targets, strict=True):
        words[at] = target.data_ptr() + 8
    spans = kscan._merged((t.data_ptr(), t.data_ptr() + 1024) for t in targets[:2])
    monkeypatch.setattr(kscan, "SEARCH_CHUNK_WORDS", 1 << 20)
    found = kscan.search_words(table, spans)
    assert found == sorted(t.data_ptr() + 8 for t in targets[:2])
    on_host = {w for w in kscan.pointer_array_words(table) if any(start <= w < end for start, end in spans)}
    assert found == sorted(on_host)


def test_searching_a_large_weight_finds_nothing_and_is_bandwidth_bound(
    device: torch.device, gpu_notes: list[str]
) -> None:
    """A 2 GiB bf16 weight searched against every allocator segment (all unread): its values are no addresses, and
    the search costs about two reads of it (the time per GiB is noted)."""
    weight = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
    view = kscan.StorageView.from_allocator([])
    spans = view.unread_spans(kscan.ReadRanges())
    assert spans
    kscan.search_words(weight, spans)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    found = kscan.search_words(weight, spans)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert found == []
    gpu_notes.append(f"search_words over a 2 GiB weight: {seconds * 1e3 / 2:.2f} ms per GiB ({len(spans)} spans)")


# -- recorded tables for the CPU tests -------------------------------------------------------------------------------
def test_recorded_table_replays_the_real_walk(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(8, 64, device=device)
    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, x)
    drv = kscan.driver()
    raw = kscan.raw_graph(graph.graph)
    table = record_table(raw, drv)
    replay = RecordedDriver(json.loads(json.dumps(table)))
    assert scan_graph(replay.root, replay).nodes == scan_graph(raw, drv).nodes
    out = os.environ.get("GRAPHSAFE_TABLE_OUT")
    if out:
        Path(out).write_text(json.dumps(table, indent=1), encoding="utf-8")
