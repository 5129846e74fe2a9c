"""The kernel scan without a GPU: the node walk and the parameter decoding on recorded node tables, the address
classification against a fake allocator view, the manifest built from a fake driver, and the fallback paths."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, ReloadFailedError
from graphsafe.adapters.vllm import _hooks as vllm_hooks
from graphsafe.collectors import (
    GraphNode,
    Manifest,
    RecordedDriver,
    ScanUnavailable,
    StorageView,
    pointer_words,
    record_capture,
    record_table,
    scan_graph,
)
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.errors import GraphSafeError
from graphsafe.outcome import FindingKind, Status


def _word(value: int) -> bytes:
    return value.to_bytes(8, "little")


# -- decoding ------------------------------------------------------------------------------------------------------
def test_pointer_words_take_aligned_pointer_sized_words_of_each_parameter() -> None:
    layout = [(0, 8), (8, 4), (12, 4), (16, 24), (40, 8)]
    params = [
        _word(0x7F0000001000),
        (7).to_bytes(4, "little"),  # an int: too small to be a pointer
        (9).to_bytes(4, "little"),
        _word(0x7F0000002000) + _word(0) + _word(0x7F0000002100),  # a struct: two pointers and a null
        _word(0),  # a null pointer
    ]
    assert pointer_words(layout, params) == [0x7F0000001000, 0x7F0000002000, 0x7F0000002100]


def test_pointer_words_skip_misaligned_bytes_of_a_struct() -> None:
    # A 16-byte struct at offset 4 (packed after an int): only its word at buffer offset 8 is pointer-aligned.
    layout = [(0, 4), (4, 16)]
    params = [(1).to_bytes(4, "little"), b"\x11" * 4 + _word(0x7F00DEAD0000) + b"\x22" * 4]
    assert pointer_words(layout, params) == [0x7F00DEAD0000]


def test_pointer_words_refuse_a_short_parameter_buffer() -> None:
    with pytest.raises(ValueError, match="kernel scan: parameter at offset 0 has 4 bytes, expected 8"):
        pointer_words([(0, 8)], [b"\0" * 4])
    with pytest.raises(ValueError, match="2 parameter offsets but 1 parameter buffers"):
        pointer_words([(0, 8), (8, 8)], [_word(1)])


# -- the node walk on a recorded table ------------------------------------------------------------------------------
TABLE: dict[str, Any] = {
    "root": 100,
    "graphs": {
        "100": [
            {"type": "kernel", "name": "gemm", "layout": [[0, 8], [8, 8], [16, 4]],
             "params": [_word(0x1000).hex(), _word(0x2008).hex(), "05000000"]},
            {"type": "memset", "pointers": [0x3000]},
            {"type": "graph", "graph": 200},
            {"type": "kernel", "name": "packed", "layout": [[0, 8]], "params": None},
            {"type": "host"},
            {"type": "empty"},
        ],
        "200": [
            {"type": "memcpy", "pointers": [0x4000, 0x5000]},
            {"type": "kernel", "name": "triton_fused", "layout": [[0, 8]], "params": [_word(0x6000).hex()]},
        ],
    },
}  # fmt: skip


def test_node_walk_reads_kernels_copies_and_child_graphs() -> None:
    drv = RecordedDriver(TABLE)
    scan = scan_graph(drv.root, drv)
    assert scan.kernel_names == ["gemm", "packed", "triton_fused"]
    assert scan.counts() == {"kernel": 3, "memset": 1, "memcpy": 1}
    words = sorted(w for node in scan.nodes for w in node.words())
    assert words == [0x1000, 0x2008, 0x3000, 0x4000, 0x5000, 0x6000]


def test_node_walk_notes_extra_parameters_and_unread_node_types() -> None:
    drv = RecordedDriver(TABLE)
    scan = scan_graph(drv.root, drv)
    assert scan.notes == [
        "kernel packed: parameters passed through 'extra' are not read by the kernel scan",
        "a host node is not read by the kernel scan",
    ]
    packed = next(n for n in scan.nodes if n.name == "packed")
    assert packed.words() == []


def test_recorded_table_round_trips() -> None:
    drv = RecordedDriver(TABLE)
    again = RecordedDriver(record_table(drv.root, drv))
    assert scan_graph(again.root, again).nodes == scan_graph(drv.root, drv).nodes


def test_unknown_graph_is_unavailable() -> None:
    with pytest.raises(ScanUnavailable, match="no recorded graph 7"):
        scan_graph(7, RecordedDriver(TABLE))


# -- addresses to storages -----------------------------------------------------------------------------------------
def _segments() -> list[dict[str, Any]]:
    return [
        {"address": 0x10000, "total_size": 0x4000, "segment_pool_id": (0, 0), "blocks": [
            {"address": 0x10000, "size": 0x1000, "state": "active_allocated"},  # model weight
            {"address": 0x11000, "size": 0x1000, "state": "active_allocated"},  # a module-level cache
            {"address": 0x12000, "size": 0x1000, "state": "inactive"},  # freed
            {"address": 0x13000, "size": 0x1000, "state": "active_allocated"},  # a library's workspace
        ]},
        {"address": 0x20000, "total_size": 0x2000, "segment_pool_id": (1, 0), "blocks": [
            {"address": 0x20000, "size": 0x1000, "state": "active_allocated"},
            {"address": 0x21000, "size": 0x1000, "state": "inactive"},
        ]},
        {"address": 0x30000, "total_size": 0x1000, "segment_pool_id": (0, 0), "blocks": [
            {"address": 0x30000, "size": 0x1000, "state": "active_allocated"},  # a static input
        ]},
    ]  # fmt: skip


def test_storage_view_says_what_each_address_is() -> None:
    weight, cache, static_input = object(), object(), torch.zeros(2)
    view = StorageView(
        [(0x10000, 0x1000, weight)],
        [],
        _segments(),
        others=[(0x11000, 0x1000, cache)],
    )
    view._ignored = kscan._Intervals([(0x30000, 0x1000, static_input)])
    got = {hex(a): view.locate(a).what for a in (0x10010, 0x11000, 0x12040, 0x13000, 0x20010, 0x21010, 0x30008, 0x99)}
    assert got == {
        "0x10010": "model",
        "0x11000": "unowned",
        "0x12040": "freed",
        "0x13000": "foreign",  # allocated, but no Python tensor holds it (a library's workspace)
        "0x20010": "private",
        "0x21010": "private",  # a graph pool's free block still backs that graph's intermediates
        "0x30008": "ignored",
        "0x99": "foreign",  # the allocator never handed it out (NCCL's, cuBLAS's own)
    }
    assert view.locate(0x10010).offset == 0x10 and view.locate(0x10010).storage is weight


class _NoMemory(torch.Tensor):
    """Stands for the FakeTensors compiling leaves on the heap: asking for their memory raises."""

    def untyped_storage(self) -> torch.UntypedStorage:
        raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)")


def test_live_tensors_without_memory_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = torch.Tensor._make_subclass(_NoMemory, torch.zeros(4))
    cache = torch.zeros(4)
    address = cache.untyped_storage().data_ptr()
    monkeypatch.setattr(kscan, "live_tensors", lambda: iter([fake, cache]))
    segment = {"address": address, "total_size": 16, "blocks": [{"address": address, "size": 16, "state": "active"}]}
    view = StorageView([], [], [segment])
    assert view.locate(address).what == "unowned" and view.locate(address).storage is cache


def test_views_of_one_storage_share_a_range_without_comparing_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.zeros(4, 4)
    address = cache.untyped_storage().data_ptr()
    monkeypatch.setattr(kscan, "live_tensors", lambda: iter([cache, cache.t(), cache[1:]]))
    segment = {"address": address, "total_size": 64, "blocks": [{"address": address, "size": 64, "state": "active"}]}
    view = StorageView([(address, 64, cache), (address, 64, cache.view(16))], [], [segment])
    assert view.locate(address + 8).what == "model"
    assert StorageView([], [], [segment]).locate(address + 8).what == "unowned"


def test_a_range_nested_in_a_larger_one_does_not_hide_it() -> None:
    # A storage made over part of another's memory (from_blob, DLPack): an address past the inner one, inside the
    # outer one, is still the outer one's, even with a disjoint range after the inner one.
    outer, inner, after = object(), object(), object()
    ranges = kscan._Intervals([(0x1000, 0x1000, outer), (0x1100, 0x100, inner), (0x1400, 0x100, after)])
    assert ranges.find(0x1180) == (0x1100, 0x1200, inner)
    assert ranges.find(0x1300) == (0x1000, 0x2000, outer)
    assert ranges.find(0x1480) == (0x1400, 0x1500, after)
    assert ranges.find(0x1500) == (0x1000, 0x2000, outer)
    assert ranges.find(0x2000) is None and ranges.find(0xFFF) is None


def test_attribute_keeps_the_lowest_offset_and_first_kernel() -> None:
    weight, cache = torch.zeros(4), torch.zeros(4)
    view = StorageView([(0x10000, 0x1000, weight)], [], _segments(), others=[(0x11000, 0x1000, cache)])
    scan = kscan.GraphScan(
        nodes=[
            GraphNode("kernel", "a", ((0, 8), (8, 8)), (_word(0x10100), _word(0x12000))),
            GraphNode("kernel", "b", ((0, 8), (8, 8)), (_word(0x10008), _word(0x11000))),
        ]
    )
    facts = kscan.attribute(scan, view)
    (model_fact,) = facts.model.values()
    assert model_fact[1:] == (0x8, "a")
    assert [fact[0] is cache for fact in facts.unowned.values()] == [True]
    assert facts.freed == [(0x12000, 0x1000, "a")]
    assert facts.counts == {"model": 2, "freed": 1, "unowned": 1}


# -- the manifest from a fake driver --------------------------------------------------------------------------------
_CACHE: dict[str, torch.Tensor] = {}


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.register_buffer("held_unread", torch.randn(4))
        _CACHE["table"] = torch.randn(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + _CACHE["table"]


class FakeGraph:
    """A keep_graph CUDAGraph stand-in whose raw graph is a recorded table's root."""

    def __init__(self, root: int | None) -> None:
        self.root = root

    def raw_cuda_graph(self) -> int:
        if self.root is None:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized "
                               "with keep_graph=true")  # fmt: skip
        return self.root


def _table(*tensors: torch.Tensor) -> dict[str, Any]:
    params = [_word(t.untyped_storage().data_ptr()).hex() for t in tensors]
    layout = [[8 * i, 8] for i in range(len(tensors))]
    return {"root": 1, "graphs": {"1": [{"type": "kernel", "name": "fused", "layout": layout, "params": params}]}}


def test_kernel_scan_manifest_flags_unowned_alive_storage_and_counts_unread_slots(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    x, out = torch.randn(2, 4), torch.zeros(2, 4)
    fake_cuda["table"] = _table(model.weight, _CACHE["table"], x, out)
    fake_cuda["tensors"] = [model.weight, model.held_unread, _CACHE["table"], x, out]
    contract = GraphContract(model, "recapture").seal()
    with record_capture(contract, name="g", graph=FakeGraph(1), ignore=[x, out]) as manifest:
        pass
    assert manifest.backends() == {"g": "kernel-scan"} and manifest.complete
    (unowned,) = manifest.unowned()
    assert unowned.storage_ref() is _CACHE["table"].untyped_storage()
    held = {h.where for e in manifest.storages() for h in e.holders}
    assert held == {"<model>:weight"}  # inputs and outputs are registered, never unowned; held_unread is not read
    assert all(e.backend == "kernel-scan" and e.op == "fused" for e in manifest.storages())

    with contextlib.suppress(ReloadFailedError), contract.reload(), torch.no_grad():
        model.weight.copy_(torch.randn(4, 4))
    outcome = contract.last_outcome
    # read by the graph, held at no model path and unwritten by the reload: a recapture would read the same bytes
    assert outcome is not None and outcome.status is Status.FAILED
    (finding,) = outcome.problems
    assert finding.kind is FindingKind.STALE and finding.path == ""
    assert "capture manifest (kernel scan): unowned captured storage" in finding.detail
    assert outcome.slots_unread == 1  # held_unread

    contract.reseal(recaptured=True)  # as if recaptured (the same table is read again)
    with contextlib.suppress(ReloadFailedError), contract.reload(), torch.no_grad():
        _CACHE["table"].add_(1)  # written in place: a recapture reads what PWAL left there
    outcome = contract.last_outcome
    assert outcome is not None and [f.kind for f in outcome.problems] == [FindingKind.ORPHANED]


def test_dispatch_recorded_captures_leave_unread_unknown(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with torch.no_grad(), record_capture(contract, name="eager", backend="dispatch") as manifest:
        model(torch.randn(2, 4))
    assert manifest.backends() == {"eager": "dispatch"} and not manifest.complete
    assert manifest.unread(contract) is None


def test_a_word_into_a_free_block_is_noted_and_a_scanned_storage_freed_later_is_dead(
    fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Cached()
    fake_cuda["table"] = _table(model.weight, _CACHE["table"])
    contract = GraphContract(model, "recapture").seal()
    free = torch.randn(8)
    address = free.untyped_storage().data_ptr()
    fake_cuda["table"]["graphs"]["1"].append({"type": "memset", "pointers": [address]})
    fake_cuda["tensors"] = [model.weight, _CACHE["table"]]
    base = kscan.allocator_segments
    block = {"address": address, "total_size": 32, "blocks": [{"address": address, "size": 32, "state": "inactive"}]}
    monkeypatch.setattr(kscan, "allocator_segments", lambda: [*base(), block])
    with record_capture(contract, name="g", graph=FakeGraph(1)) as manifest:
        pass
    (note,) = manifest.notes
    assert "1 parameter word(s) point into free allocator blocks" in note and "not attributed" in note
    with contextlib.suppress(ReloadFailedError), contract.reload():
        pass
    outcome = contract.last_outcome
    # alive, unowned and unwritten
    assert outcome is not None and [f.kind for f in outcome.problems] == [FindingKind.STALE]
    contract.reseal(recaptured=True)  # as if recaptured (the same table is read again)

    # The cache the graph reads (no model path holds it) is replaced and freed: replay reads freed memory.
    fake_cuda["tensors"] = []  # the fake allocator view held it too
    with contract.reload():
        _CACHE["table"] = torch.randn(4)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE
    (dead,) = outcome.problems
    assert dead.kind is FindingKind.DEAD and "capture manifest (kernel scan): unowned" in dead.detail


# -- fallbacks -----------------------------------------------------------------------------------------------------
def test_graph_without_keep_graph_falls_back_to_the_dispatch_recorder_with_a_note(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.warns(UserWarning, match=r"capture 'g': kernel scan unavailable: .*keep_graph=True.*dispatch recorder"),
        torch.no_grad(),
        record_capture(contract, name="g", graph=FakeGraph(None)) as manifest,
    ):
        model(torch.randn(2, 4))
    assert manifest.backends() == {"g": "dispatch"}
    assert len(manifest.notes) == 1 and "keep_graph" in manifest.notes[0]
    assert {h.where for e in manifest.storages() for h in e.holders} == {"<model>:weight"}


def test_kernel_backend_refuses_what_it_cannot_scan(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.raises(GraphSafeError, match="collectors: capture 'g': kernel scan unavailable"),
        record_capture(contract, name="g", graph=FakeGraph(None), backend="kernel"),
    ):
        pass
    with (
        pytest.raises(GraphSafeError, match=r"backend='kernel'\) for capture 'h' needs graph="),
        record_capture(contract, name="h", backend="kernel"),
    ):
        pass
    with (
        pytest.raises(GraphSafeError, match="record_capture\\(backend='cupti'\\) is not a backend"),
        record_capture(contract, backend="cupti"),
    ):
        pass


def test_missing_cuda_bindings_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setattr(kscan, "_DRIVER", None)
    with pytest.raises(ScanUnavailable, match=r"pip install 'cuda-bindings>=12.4'"):
        kscan.driver()


def test_missing_bindings_fall_back_in_auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setattr(kscan, "_DRIVER", None)
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.warns(UserWarning, match="cuda-bindings is not installed"),
        torch.no_grad(),
        record_capture(contract, name="g", graph=FakeGraph(1)) as manifest,
    ):
        model(torch.randn(2, 4))
    assert isinstance(manifest, Manifest) and manifest.backends() == {"g": "dispatch"}


# -- a node table recorded on the H200 (tests/gpu/test_kernel_scan.py writes it) ------------------------------------
def test_a_table_recorded_on_the_gpu_decodes_to_the_storages_the_graph_reads() -> None:
    # Mlp(64): up = Linear(64, 256), gelu, down = Linear(256, 64), a held but unread buffer; x is 8 x 64. Captured by
    # the torch adapter: cuBLAS gemv, ATen's gelu, cuBLAS gemv, the copy into the static output.
    table = json.loads(
        (Path(__file__).resolve().parents[1] / "data" / "h200_mlp_graph.json").read_text(encoding="utf-8")
    )
    drv = RecordedDriver(table)
    scan = scan_graph(drv.root, drv)
    assert [n.kind for n in scan.nodes] == ["kernel", "kernel", "kernel", "memcpy"]
    assert "cublas" in scan.nodes[0].name and "Gelu" in scan.nodes[1].name
    base, private = 0x7F9B27E00000, 0x7F9B1AA00000
    model = {
        "up.weight": (base, 0x10000),
        "up.bias": (base + 0x10000, 0x400),
        "down.weight": (base + 0x10400, 0x10000),
        "down.bias": (base + 0x20400, 0x100),
        "held_unread": (base + 0x20500, 0x100),
    }
    segments = [
        {"address": base, "total_size": 0x200000, "segment_pool_id": (0, 0), "blocks": [
            *({"address": a, "size": n, "state": "active_allocated"} for a, n in model.values()),
            {"address": base + 0x21000, "size": 0x800, "state": "active_allocated"},  # x
            {"address": base + 0x21800, "size": 0x800, "state": "active_allocated"},  # the static output
        ]},
        {"address": private, "total_size": 0x200000, "segment_pool_id": (1, 0), "blocks": [
            {"address": private, "size": 0x200000, "state": "inactive"},
        ]},
    ]  # fmt: skip
    view = StorageView([(a, n, name) for name, (a, n) in model.items()], [], segments, others=[])
    view._ignored = kscan._Intervals([(base + 0x21000, 0x800, "x"), (base + 0x21800, 0x800, "out")])
    facts = kscan.attribute(scan, view)
    assert sorted(payload for payload, _, _ in facts.model.values()) == [
        "down.bias",
        "down.weight",
        "up.bias",
        "up.weight",
    ]  # held_unread: not read
    assert facts.unowned == {} and facts.freed == []
    assert facts.counts["ignored"] == 2  # x read by the first gemv, the output written by the copy
    assert facts.counts["private"] == 8  # the intermediates, chained through the graph's pool
    # cuBLAS's parameter struct also holds host pointers (alpha, beta) and packed integers: not device memory.
    assert facts.counts["foreign"] == 18


# -- the vLLM runner's capture (no vLLM needed: the hook's recording step with a fake runner) --------------------------
class FakeTorchGraph:
    """Stands for torch.cuda.CUDAGraph on CPU: scannable only when made with keep_graph=True."""

    def __new__(cls, keep_graph: bool = False) -> FakeTorchGraph:
        graph = super().__new__(cls)
        graph.keep_graph = keep_graph
        return graph

    def raw_cuda_graph(self) -> int:
        if not self.keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized "
                               "with keep_graph=true")  # fmt: skip
        return 1


def test_vllm_capture_hook_scans_every_graph_the_runner_makes(
    fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Cached()
    input_ids, kv_cache = torch.zeros(8), torch.zeros(16)
    runner = SimpleNamespace(model=model, input_ids=SimpleNamespace(gpu=input_ids), kv_caches=[kv_cache])
    fake_cuda["table"] = _table(model.weight, _CACHE["table"], input_ids, kv_cache)
    fake_cuda["tensors"] = [model.weight, _CACHE["table"], input_ids, kv_cache]
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeTorchGraph)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    contract = GraphContract(model, "recapture").seal()
    state = SimpleNamespace(config=SimpleNamespace(record_manifest=True))
    with vllm_hooks._maybe_record(state, contract, runner):  # type: ignore[arg-type]
        graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]  # what vLLM's capture does
    assert all(g.keep_graph for g in graphs) and torch.cuda.CUDAGraph is FakeTorchGraph
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert manifest.backends() == {"vllm-0": "kernel-scan", "vllm-1": "kernel-scan"}
    contract.reseal()  # what the capture wrapper does next: it ties the scanned storages to model paths
    # the runner's input buffer and KV cache are registered: only the module-level cache is unowned
    assert [id(e.storage_ref()) for e in manifest.unowned()] == [id(_CACHE["table"].untyped_storage())]
    assert {h.where for e in manifest.storages() for h in e.holders} == {"<model>:weight"}


def test_vllm_capture_hook_falls_back_to_the_dispatch_recorder_without_the_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    state = SimpleNamespace(config=SimpleNamespace(record_manifest=True))
    with torch.no_grad(), vllm_hooks._maybe_record(state, contract, None):  # type: ignore[arg-type]
        model(torch.randn(2, 4))
    assert isinstance(contract.manifest, Manifest) and contract.manifest.backends() == {"vllm": "dispatch"}


def test_read_ranges_take_words_near_the_top_of_the_address_space() -> None:
    """A kernel word like 0xffff_ffff_ffff_fff8 (a sentinel, -8) plus its span passes 2**64: the ranges keep it,
    bounded, instead of failing the whole scan (seen on the H200 with a Marlin-style workspace kernel)."""
    top = (1 << 64) - 8
    ranges = kscan.ReadRanges([(top, top + 64), (0x1000, 0x2000)])
    assert ranges.overlaps(top, top + 8)
    assert ranges.overlaps(0x1800, 0x1801)
    assert not ranges.overlaps(0x3000, 0x4000)
