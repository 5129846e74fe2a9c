"""The capture-time manifest on a plain forward pass (CPU): what it records, the paths it ties storages to, the
reload check (dead, orphaned), unowned storage, and the grading of the registry and the walker.

The model: ``layers.N`` each hold a frozen ``weight`` parameter, an ``offset`` buffer, a kernel object whose
``w_t`` PWAL derives from the weight (a NEW tensor every load unless ``in_place``), an optionally declared
``kernel.scale``, and a derived tensor only a module-level cache holds.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import (
    ContractViolation,
    FindingKind,
    GraphContract,
    GraphSafeError,
    ReloadFailedError,
    Status,
    UndeclaredDriftError,
    register_derived,
)
from graphsafe.collectors import Manifest, _classify, record_capture
from graphsafe.outcome import Origin
from graphsafe.testing import grade

N = 4
_CACHE: dict[int, torch.Tensor] = {}


class Kernel:
    def __init__(self) -> None:
        self.w_t: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None


class Layer(nn.Module):
    def __init__(self, *, in_place: bool = False, declare_scale: bool = False, use_cache: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N, N), requires_grad=False)
        self.register_buffer("offset", torch.zeros(N))
        self.kernel = Kernel()
        self.in_place = in_place
        self.declare_scale = declare_scale
        self.use_cache = use_cache

    def pwal(self) -> None:
        w = self.weight.detach()
        if self.in_place and self.kernel.w_t is not None:
            assert self.kernel.scale is not None
            self.kernel.w_t.copy_(w.t())
            self.kernel.scale.copy_(w.abs().amax(0))
            _CACHE[id(self)].copy_(w * 2)
            return
        self.kernel.w_t = w.t().contiguous()
        self.kernel.scale = w.abs().amax(0)
        _CACHE[id(self)] = w * 2
        if self.declare_scale:
            register_derived(self, "kernel.scale", self.kernel.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernel.w_t is not None and self.kernel.scale is not None
        y = (x @ self.kernel.w_t) * self.kernel.scale + self.offset
        return y + x @ _CACHE[id(self)] if self.use_cache else y


class Model(nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(**options) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def load(model: Model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, Layer)
            layer.weight.copy_(torch.randn(N, N, generator=generator))
            layer.offset.copy_(torch.randn(N, generator=generator))
            layer.pwal()


def build(seed: int = 0, **options: Any) -> Model:
    model = Model(**options)
    load(model, seed)
    return model


def layer(model: Model, index: int) -> Layer:
    found = model.layers[index]
    assert isinstance(found, Layer)
    return found


def record(model: Model, contract: GraphContract | None = None, **options: Any) -> tuple[Manifest, torch.Tensor]:
    x = torch.randn(3, N)
    manifest = None if contract is not None else Manifest()
    with torch.no_grad(), record_capture(contract, ignore=[x], manifest=manifest, **options) as recorded:
        model(x)
    return recorded, x


def storage_ids(*tensors: torch.Tensor) -> set[int]:
    return {id(t.untyped_storage()) for t in tensors}


def recorded_ids(manifest: Manifest) -> set[int]:
    ids = set()
    for entry in manifest.storages():
        storage = entry.storage_ref()
        assert storage is not None
        ids.add(id(storage))
    return ids


def model_state(model: Model) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for index in range(2):
        lay = layer(model, index)
        assert lay.kernel.w_t is not None and lay.kernel.scale is not None
        found += [lay.kernel.w_t, lay.kernel.scale, lay.offset, _CACHE[id(lay)]]
    return found


# -- recording -----------------------------------------------------------------------------------------------------
def test_records_exactly_the_storages_from_before_the_capture() -> None:
    model = build()
    manifest, _ = record(model)
    # weight itself is not read by forward (only its derived tensors), and temporaries are the graph's own.
    assert recorded_ids(manifest) == storage_ids(*model_state(model))


def test_static_inputs_are_recorded_unless_ignored() -> None:
    model = build()
    x = torch.randn(3, N)
    manifest = Manifest()
    with torch.no_grad(), record_capture(None, manifest=manifest):
        model(x)
    assert storage_ids(x) <= recorded_ids(manifest)
    assert recorded_ids(manifest) - storage_ids(x) == storage_ids(*model_state(model))


def test_tensors_created_inside_the_capture_are_not_recorded() -> None:
    table = torch.arange(10.0)
    manifest = Manifest()
    with record_capture(None, manifest=manifest):
        fresh = torch.zeros(10) + torch.tensor(2.0)  # factory op, and torch.tensor (lift_fresh) inside
        view = fresh[1:5]
        y = (view * 3).sum() + table.sum()
    assert y.item() == pytest.approx(8 * 3 + 45)
    assert recorded_ids(manifest) == storage_ids(table)


def test_byte_range_is_the_union_of_what_was_read() -> None:
    table = torch.arange(40.0).reshape(10, 4)  # float32, rows of 16 bytes
    manifest = Manifest()
    with record_capture(None, manifest=manifest):
        _ = table[2:4].sum()
    (entry,) = manifest.storages()
    assert entry.byte_range == (2 * 16, 4 * 16)
    assert entry.nbytes == 160 and entry.op.startswith("aten.")
    with record_capture(None, manifest=manifest, name="cols"):
        _ = table[5:, 1].sum()  # a strided column: from row 5 col 1 to row 9 col 1
    (cols,) = manifest.entries("cols")
    assert cols.byte_range == (5 * 16 + 4, 9 * 16 + 4 + 4)
    with record_capture(None, manifest=manifest, name="both"):
        _ = table[2:4].sum() + table[5:, 1].sum()
    (both,) = manifest.entries("both")
    assert both.byte_range == (2 * 16, 9 * 16 + 8)
    with record_capture(None, manifest=manifest, name="view"):
        view = table[3:]  # a view op reads nothing; the storage is still known as the model's, not the graph's
    (viewed,) = manifest.entries("view")
    assert viewed.access == "viewed" and viewed.byte_range == (0, 0)
    assert view.untyped_storage() is table.untyped_storage()


def test_writes_are_flagged() -> None:
    weight = torch.randn(4)
    scratch = torch.empty(4)
    manifest = Manifest()
    with record_capture(None, manifest=manifest):
        torch.mul(weight, 2, out=scratch)
        _ = scratch.sum()
    by_storage = {id(e.storage_ref()): e for e in manifest.storages()}
    assert by_storage[id(scratch.untyped_storage())].written
    assert not by_storage[id(weight.untyped_storage())].written


def test_only_ops_inside_a_cuda_capture_count_once_one_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's capture_begin fills its RNG seed/offset tensors just before the stream starts capturing; those
    # ops run inside the block but are not part of the graph. Simulate the capture state on the CPU.
    capturing = False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    rng_state, weight, scale = torch.zeros(1, dtype=torch.int64), torch.randn(4), torch.randn(4)
    manifest = Manifest()
    with record_capture(None, manifest=manifest, name="graph", backend="dispatch"):  # chosen: it warns by omission
        rng_state.fill_(7)
        _ = scale * 2  # read before the capture and inside it: kept
        capturing = True
        _ = weight * scale
        capturing = False
    assert recorded_ids(manifest) == storage_ids(weight, scale)
    with record_capture(None, manifest=manifest, name="eager"):  # no capture at all: everything counts
        rng_state.fill_(7)
        _ = weight * 2
    assert {id(e.storage_ref()) for e in manifest.entries("eager")} == storage_ids(rng_state, weight)


@pytest.mark.parametrize("backend", ["dispatch", "kernel"])
def test_garbage_collection_is_paused_while_recording_and_the_user_s_switch_stays(
    backend: str, fake_cuda: dict[str, Any]
) -> None:
    """No automatic collection while a capture records (the first threshold is 0), and the collector's switch is
    the user's: a ``gc.disable()`` or ``gc.enable()`` made by the forward inside stays after the capture."""
    import gc

    from _graph_tables import FakeGraph

    def capture() -> Any:
        graph = FakeGraph() if backend == "kernel" else None
        if backend == "kernel":
            fake_cuda["table"] = {"root": 1, "graphs": {"1": []}}
        return record_capture(None, manifest=Manifest(), graph=graph, backend=backend)

    found = gc.get_threshold()
    assert gc.isenabled() and found[0]
    try:
        with capture():
            assert gc.get_threshold()[0] == 0 and gc.isenabled()
            gc.disable()  # the user's forward turns the collector off for good
        assert not gc.isenabled() and gc.get_threshold() == found
        with capture():
            gc.enable()  # and on again
        assert gc.isenabled() and gc.get_threshold() == found
    finally:
        gc.enable()
        gc.set_threshold(*found)


def test_device_filter() -> None:
    model = build()
    manifest, _ = record(model, devices=["cuda"])
    assert len(manifest) == 0
    manifest, _ = record(model, devices=["cpu"])
    assert recorded_ids(manifest) == storage_ids(*model_state(model))


def test_an_exception_in_the_block_records_nothing() -> None:
    model = build()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    with pytest.raises(RuntimeError, match="boom"), record_capture(contract, name="broken"):
        model(torch.randn(3, N))
        raise RuntimeError("boom")
    assert contract.manifest is None


def test_recording_again_under_a_name_replaces_that_capture() -> None:
    model = build()
    contract = GraphContract(model, "recapture").seal()
    with torch.no_grad(), record_capture(contract, name="a"):
        layer(model, 0)(torch.randn(3, N))
    with torch.no_grad(), record_capture(contract, name="b"):
        layer(model, 1)(torch.randn(3, N))
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert manifest.captures == ("a", "b")
    assert len(manifest) == 8
    with torch.no_grad(), record_capture(contract, name="a"):
        layer(model, 1)(torch.randn(3, N))
    assert len(manifest.entries()) == 8 and len(manifest) == 4  # "a" now reads what "b" reads
    assert manifest.discard("b") and not manifest.discard("b")
    assert manifest.captures == ("a",)


def test_a_foreign_manifest_is_not_replaced() -> None:
    model = build()
    contract = GraphContract(model, "recapture").seal()

    class Other:
        def reindex(self, contract: GraphContract) -> None: ...

        def check(self, contract: GraphContract) -> list[Any]:
            return []

    contract.manifest = Other()
    with pytest.raises(GraphSafeError, match="already has a manifest"), record_capture(contract):
        pass


# -- index: who held each storage ----------------------------------------------------------------------------------
def test_storages_are_tied_to_the_paths_that_held_them() -> None:
    model = build(declare_scale=True)
    contract = GraphContract(model, "recapture").seal()
    manifest, _ = record(model, contract)
    holders = {(h.layer, h.path): h.origin for e in manifest.storages() for h in e.holders}
    assert holders[("layers.0", "offset")] is Origin.BUFFER
    assert holders[("layers.1", "kernel.w_t")] is Origin.WALKER
    assert holders[("layers.0", "kernel.scale")] is Origin.DECLARED
    unowned = manifest.unowned()
    assert storage_ids(*(_CACHE[id(layer(model, i))] for i in range(2))) == {id(e.storage_ref()) for e in unowned}


def test_declared_only_contract_still_names_walker_paths() -> None:
    model = build()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    manifest, _ = record(model, contract)
    paths = {h.where for e in manifest.storages() for h in e.holders}
    assert {"layers.0:kernel.w_t", "layers.1:kernel.scale", "layers.1:offset"} <= paths
    unwalked = Manifest(walk=False)
    with torch.no_grad(), record_capture(contract, manifest=unwalked):
        model(torch.randn(3, N))
    assert {h.origin for e in unwalked.storages() for h in e.holders} == {Origin.BUFFER}


# -- reload check --------------------------------------------------------------------------------------------------
def test_legacy_reload_is_dead_and_names_layer_and_path() -> None:
    model = build()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    record(model, contract)
    with contract.reload():
        load(model, seed=1)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE
    where = {(f.kind, f.where) for f in outcome.findings}
    assert (FindingKind.DEAD, "layers.0:kernel.w_t") in where
    assert (FindingKind.DEAD, "layers.1:kernel.scale") in where
    unowned = [f for f in outcome.findings if not f.path]
    assert len(unowned) == 2 and all(f.kind is FindingKind.DEAD for f in unowned)
    assert all("unowned" in f.detail for f in unowned)
    assert len(outcome.findings) == 6  # w_t, scale, cache per layer; the buffer was copied in place
    dead = next(f for f in outcome.findings if f.where == "layers.0:kernel.w_t")
    assert dead.before is not None and not dead.before.alive and "freed" in dead.describe()


def test_strict_mode_raises_on_manifest_findings() -> None:
    model = build()
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    record(model, contract)
    with pytest.raises(UndeclaredDriftError, match=r"kernel\.w_t' of layers\.0"), contract.reload():
        load(model, seed=1)
    assert not contract.serving_safe


def test_storage_kept_alive_but_no_longer_held_is_orphaned() -> None:
    model = build()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    record(model, contract)
    old = model_state(model)  # keeps every captured storage alive
    with contextlib.suppress(ReloadFailedError), contract.reload():
        load(model, seed=1)
    outcome = contract.last_outcome
    assert outcome is not None
    orphaned = {f.where: f for f in outcome.findings if f.kind is FindingKind.ORPHANED and f.path}
    assert set(orphaned) == {
        "layers.0:kernel.w_t",
        "layers.0:kernel.scale",
        "layers.1:kernel.w_t",
        "layers.1:kernel.scale",
    }
    finding = orphaned["layers.0:kernel.w_t"]
    assert finding.after is not None and finding.before is not None
    assert finding.after.data_ptr != finding.before.data_ptr
    assert not [f for f in outcome.findings if f.kind is FindingKind.DEAD]  # the unowned caches are alive
    # ... and read by the graph at no model path, unwritten by the reload (as a skipped rebuild leaves them): a
    # recapture would read the same bytes, so stale.
    assert len([f for f in outcome.findings if f.kind is FindingKind.STALE and not f.path]) == 2
    assert outcome.status is Status.FAILED
    del old


def test_in_place_reload_has_no_findings() -> None:
    model = build(in_place=True, use_cache=False)  # a module cache, even written in place, is a read no path feeds
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    before = model_state(model)
    record(model, contract)
    with contract.reload():
        load(model, seed=1)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED and not outcome.findings
    assert storage_ids(*before) == storage_ids(*model_state(model))


def test_migrate_mode_restores_so_the_manifest_sees_nothing() -> None:
    model = build(use_cache=False)  # the module cache is the one thing the walker cannot reach
    contract = GraphContract(model, "migrate").seal()
    manifest, _ = record(model, contract)
    with contract.reload():
        load(model, seed=1)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    assert outcome.auto_restored
    assert len(manifest) == 6


def test_check_does_not_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(in_place=True, use_cache=False)
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    record(model, contract)

    def no_walk(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the reload check walked the model")

    monkeypatch.setattr(_classify, "walk", no_walk)
    with contract.reload():
        load(model, seed=1)
    assert contract.last_outcome is not None and contract.last_outcome.committed


def test_reseal_without_recapture_keeps_reporting() -> None:
    model = build()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    record(model, contract)
    keep = model_state(model)
    with contextlib.suppress(ReloadFailedError), contract.reload():
        load(model, seed=1)
    # A caller who vouches wrongly (no recapture ran): the manifest must not hide that the graph still reads the
    # old storage.
    contract.reseal(recaptured=True)
    with contextlib.suppress(ReloadFailedError), contract.reload():
        load(model, seed=2)
    outcome = contract.last_outcome
    assert outcome is not None
    assert {f.where for f in outcome.findings if f.kind is FindingKind.ORPHANED} >= {"layers.0:kernel.w_t"}
    del keep


def test_replaced_layer_orphans_its_storage() -> None:
    model = build(in_place=True)
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    record(model, contract)
    old = model.layers[0]
    fresh = Layer(in_place=True)
    fresh.weight = nn.Parameter(torch.randn(N, N), requires_grad=False)
    fresh.pwal()
    model.layers[0] = fresh
    with contextlib.suppress(ReloadFailedError), contract.reload():  # the old layer's cache entry: unwritten
        load(model, seed=1)
    outcome = contract.last_outcome
    assert outcome is not None
    kinds = {f.where: f.kind for f in outcome.findings}
    assert kinds["layers.0:kernel.w_t"] is FindingKind.ORPHANED
    # The contract tracks the old layer's parameters and buffers itself: its own finding stands for them.
    assert kinds["layers.0:offset"] is FindingKind.VANISHED
    assert "layers.1:kernel.w_t" not in kinds
    # The manifest alone sees the buffer's captured storage orphaned too.
    assert contract.manifest is not None
    manifest = {f.where: f.kind for f in contract.manifest.check(contract)}
    assert manifest["layers.0:offset"] is FindingKind.ORPHANED
    assert manifest["layers.0:kernel.w_t"] is FindingKind.ORPHANED
    assert not any(where.startswith("layers.1:") for where in manifest)
    del old


def test_violation_error_names_the_capture() -> None:
    model = build()
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    record(model, contract, name="decode-bs4")
    with pytest.raises(ContractViolation) as info, contract.reload():
        load(model, seed=1)
    assert "decode-bs4" in str(info.value)


# -- grading -------------------------------------------------------------------------------------------------------
def test_grade_tells_registry_walker_and_neither_apart() -> None:
    model = build(declare_scale=True)
    manifest, _ = record(model)
    grading = grade(model, manifest)
    assert len(grading.storages) == 8 and not grading.dead

    def paths(items: tuple[Any, ...], source: str) -> set[str]:
        return {p for g in items for p in getattr(g, source)}

    assert paths(grading.registry_covered, "registry") == {"layers.0:kernel.scale", "layers.1:kernel.scale"}
    assert paths(grading.walker_covered, "walker") >= {"layers.0:kernel.w_t", "layers.0:kernel.scale"}
    assert paths(grading.state_covered, "state") == {"layers.0:offset", "layers.1:offset"}
    assert paths(grading.walker_only, "walker") == {"layers.0:kernel.w_t", "layers.1:kernel.w_t"}
    assert not grading.registry_only
    uncovered = {id(g.entry.storage_ref()) for g in grading.uncovered}
    assert uncovered == storage_ids(*(_CACHE[id(layer(model, i))] for i in range(2)))
    assert "neither 2" in grading.summary() and "unowned captured storage" in grading.summary()


def test_grade_accepts_a_contract_and_counts_dead_storage() -> None:
    model = build()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    manifest, _ = record(model, contract)
    load(model, seed=1)  # outside the contract: the old derived tensors are freed
    grading = grade(contract, manifest)
    assert len(grading.dead) == 6 and len(grading.storages) == 2
