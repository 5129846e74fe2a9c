"""Undeclared tensors (the walker, ``detect="sealed-paths"``/``"every-reload"``) and the capture manifest: a reload
never reports success, or leaves the model, on memory other than what a cold model built on the new weights holds.

Every reload loads DIFFERENT weights. The oracle is a second model built from scratch on the new weights (load +
PWAL); it never asks graphsafe anything.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, GraphContract, Status, register_derived
from graphsafe.collectors import record_capture

N = 8
MODES = ("strict", "recapture", "migrate")


def _reload(contract: GraphContract, load: object) -> None:
    try:
        with contract.reload():
            load()  # type: ignore[operator]
    except ContractViolation:
        pass  # strict: the outcome is in last_outcome


# -- 1. the manifest knows the graph reads bytes past a slot's view; the restore copies only the view ------------
class PackedLayer(nn.Module):
    """PWAL packs two derived halves into one buffer and keeps only a view of the first half; the kernel is
    handed that view's pointer and reads the whole packed buffer (both halves), as packed-weight kernels do."""

    def __init__(self, declared: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.declared = declared

    def pwal(self) -> None:
        w = self.weight.detach()
        packed = torch.cat([w * 2, w * 3])  # a NEW buffer every load
        self.lo = packed[:N]
        if self.declared:
            register_derived(self, "lo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.lo.as_strided((2 * N,), (1,), self.lo.storage_offset())  # the kernel reads 2N elements
        return x * full[:N] + full[N:]


class PackedModel(nn.Module):
    def __init__(self, declared: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PackedLayer(declared) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _load_packed(model: PackedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.copy_(torch.randn(N, generator=generator))
            layer.pwal()


def _storage_bytes(storage: torch.UntypedStorage, lo: int, hi: int) -> bytes:
    return bytes(storage)[lo:hi]


@pytest.mark.parametrize(
    ("declared", "mode", "detect"),
    [
        (False, "migrate", "sealed-paths"),
        (False, "migrate", "every-reload"),
        (True, "strict", "declared-only"),
        (True, "recapture", "every-reload"),
        (True, "migrate", "sealed-paths"),
    ],
)
def test_manifest_bytes_read_past_a_slots_view_are_not_committed_stale(declared: bool, mode: str, detect: str) -> None:
    """The layer holds ``lo``, a view of the first half of a packed buffer PWAL rebuilds every load; the
    captured kernel reads the whole buffer through ``lo``'s pointer. The capture runs under ``record_capture``, so
    the manifest records that the graph read bytes ``[0, 2N*4)`` of the captured storage, twice what ``lo`` spans.

    The restore copies ``lo`` (N elements) into the captured view and leaves the second half of the captured
    buffer as it was. Promise: a COMMITTED reload means every byte the graph reads holds what a cold model built on
    the new weights holds there; the manifest says which bytes the graph reads, so the reload must not commit while
    bytes it recorded and no slot covers keep the old values.
    """
    model = PackedModel(declared)
    _load_packed(model, 0)
    contract = GraphContract(model, mode=mode, detect=detect).seal()  # type: ignore[arg-type]
    x = torch.randn(N)
    with torch.no_grad(), record_capture(contract, ignore=[x]) as manifest:
        model(x)
    read = {id(e.storage_ref()): (e.lo, e.hi) for e in manifest.storages() if e.storage_ref() is not None}
    captured = [(layer.lo, layer.lo.untyped_storage(), layer.lo.data_ptr()) for layer in model.layers]
    for _, storage, _ in captured:
        assert read[id(storage)] == (0, 2 * N * 4)  # the manifest knows the graph reads the whole buffer

    _reload(contract, lambda: _load_packed(model, 1))
    outcome = contract.last_outcome
    assert outcome is not None

    cold = PackedModel(declared)
    _load_packed(cold, 1)
    if outcome.status is Status.COMMITTED:
        for (tensor, storage, ptr), cold_layer in zip(captured, cold.layers, strict=True):
            lo, hi = read[id(storage)]
            assert tensor.data_ptr() == ptr
            got = torch.frombuffer(bytearray(_storage_bytes(storage, lo, hi)), dtype=torch.float32)
            want = torch.frombuffer(
                bytearray(_storage_bytes(cold_layer.lo.untyped_storage(), lo, hi)), dtype=torch.float32
            )
            assert torch.equal(got, want), (
                f"COMMITTED ({outcome.summary()}) while the graph reads {got.tolist()} where the cold model holds "
                f"{want.tolist()}"
            )


# -- 2. rebinding a captured tensor object brings back the old tensors hung on it as attributes --------------------
class GidxLayer(nn.Module):
    """GPTQ style: PWAL hangs a derived tensor on a tensor object as an attribute: ``weight.g_idx`` on the
    parameter (``holder="parameter"``), or ``w_t.scale`` on a declared derived tensor (``holder="declared"``)."""

    def __init__(self, holder: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.holder = holder

    def pwal(self) -> None:
        w = self.weight.detach()
        if self.holder == "parameter":
            self.weight.g_idx = torch.argsort(w).to(torch.int32)
        else:
            w_t = w * 2
            w_t.scale = w.abs().amax().reshape(1)
            self.w_t = w_t
            register_derived(self, "w_t")

    def attribute(self) -> torch.Tensor:
        return self.weight.g_idx if self.holder == "parameter" else self.w_t.scale  # type: ignore[no-any-return]


class GidxModel(nn.Module):
    def __init__(self, holder: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GidxLayer(holder) for _ in range(2)])


def _load_gidx(model: GidxModel, seed: int, *, new_parameter: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            new = torch.randn(N, generator=generator)
            if new_parameter:  # a loader that binds a new Parameter (graphsafe restores and rebinds the captured one)
                layer.weight = nn.Parameter(new, requires_grad=False)
            else:
                layer.weight.copy_(new)
            layer.pwal()


@pytest.mark.parametrize(
    ("holder", "mode", "detect"),
    [
        ("parameter", "recapture", "sealed-paths"),
        ("parameter", "recapture", "every-reload"),
        ("parameter", "strict", "every-reload"),
        ("parameter", "migrate", "declared-only"),
        ("declared", "recapture", "every-reload"),
        ("declared", "strict", "declared-only"),
    ],
)
def test_rebinding_a_captured_tensor_does_not_bring_back_its_stale_attribute(
    holder: str, mode: str, detect: str
) -> None:
    """PWAL hangs a derived tensor on a tensor object (``weight.g_idx``, ``w_t.scale``) and the reload
    gives the holder a new object (the loader binds a new Parameter; PWAL builds a new declared ``w_t``). graphsafe
    restores the holder by copying into the captured object and binding the captured object back at its path; the
    captured object still carries the OLD attribute tensor, so after the reload ``weight.g_idx`` (``w_t.scale``)
    resolves to the old values and PWAL's new attribute tensor is dropped.

    Promise: graphsafe never leaves the model reading values other than the ones the reload produced. Where the
    outcome is not COMMITTED the docs promise "the model keeps the tensors PWAL produced, so the recapture reads the
    right values"; where it is COMMITTED, every captured address must hold the cold model's values. Either way the
    attribute the model resolves must hold the cold model's values.
    """
    model = GidxModel(holder)
    _load_gidx(model, 0, new_parameter=False)
    contract = GraphContract(model, mode=mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = [layer.attribute() for layer in model.layers]

    _reload(contract, lambda: _load_gidx(model, 1, new_parameter=True))
    outcome = contract.last_outcome
    assert outcome is not None

    cold = GidxModel(holder)
    _load_gidx(cold, 1, new_parameter=False)
    for index, (layer, cold_layer) in enumerate(zip(model.layers, cold.layers, strict=True)):
        want = cold_layer.attribute()
        assert torch.equal(layer.attribute(), want), (
            f"{outcome.status.name} ({outcome.summary()}): layers.{index} now resolves its attribute to "
            f"{layer.attribute().tolist()} (the captured object's old tensor), PWAL made {want.tolist()}"
        )
        if outcome.status is Status.COMMITTED and detect != "declared-only":
            # (declared-only tracks only what is declared: an undeclared tensor hung on a slot, like an undeclared
            # module attribute, is the walker's or the manifest's to find; the model must still read PWAL's.)
            assert torch.equal(captured[index], want)


# -- 3. sealed-paths + a capture manifest: a graph-read storage the model holds at a path no slot tracks ------------
class LazyLayer(nn.Module):
    """A declared derived ``w2`` (rebuilt by PWAL) and a weight-derived ``_cache`` the first forward computes lazily
    (the warm-up after ``seal()``, before the capture); PWAL does not touch ``_cache``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)

    def pwal(self) -> None:
        self.w2 = self.weight.detach() * 2
        register_derived(self, "w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_cache", None) is None:
            self._cache = self.weight.detach() * 3
        return x * self.w2 + self._cache


class LazyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LazyLayer() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _load_lazy(model: LazyModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.copy_(torch.randn(N, generator=generator))
            layer.pwal()


@pytest.mark.parametrize("mode", MODES)
def test_sealed_paths_with_a_manifest_does_not_commit_a_stale_graph_read_storage(mode: str) -> None:
    """Seal, then a warm-up forward lazily computes ``_cache`` from the weight, then the capture runs under
    ``record_capture``. The manifest records that the graph reads ``_cache``'s storage, which the model holds at
    ``layers.N._cache``; no slot tracks it (it appeared after the seal). The reload loads new weights and PWAL
    leaves ``_cache`` as it was.

    Under ``detect="declared-only"`` the same model fails (the manifest ties the storage to ``_cache`` and the
    contract watches it: ``stale``). Under ``"sealed-paths"`` the manifest does not walk (it leaves walking to the
    contract, which walks only at seal), so the storage is "unowned", the dispatch recorder's unowned storages give
    no finding, and the reload commits while the graph reads ``_cache``'s old values. Promise: a COMMITTED reload
    means every captured storage the graph reads holds what a cold model (load + PWAL + warm-up) holds there.
    """
    model = LazyModel()
    _load_lazy(model, 0)
    contract = GraphContract(model, mode=mode, detect="sealed-paths").seal()  # type: ignore[arg-type]
    x = torch.randn(N)
    with torch.no_grad():
        model(x)  # warm-up after the seal
    with torch.no_grad(), record_capture(contract, ignore=[x]) as manifest:
        model(x)
    captured = [layer._cache for layer in model.layers]
    recorded = {id(e.storage_ref()) for e in manifest.storages() if e.storage_ref() is not None}
    assert all(id(t.untyped_storage()) in recorded for t in captured)  # the manifest saw the graph read them

    _reload(contract, lambda: _load_lazy(model, 1))
    outcome = contract.last_outcome
    assert outcome is not None

    cold = LazyModel()
    _load_lazy(cold, 1)
    with torch.no_grad():
        cold(x)
    if outcome.status is Status.COMMITTED:
        for index, (tensor, cold_layer) in enumerate(zip(captured, cold.layers, strict=True)):
            assert torch.equal(tensor, cold_layer._cache), (
                f"COMMITTED ({outcome.summary()}) while the graph reads layers.{index}._cache = {tensor.tolist()}, "
                f"the cold model holds {cold_layer._cache.tolist()}"
            )
