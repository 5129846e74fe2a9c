"""``GraphContract(unread="skip")`` on CPU: the kernel scan's truth comes from recorded node tables (a fake driver
and allocator view, as in tests/collectors/test_kernelscan.py), so every branch of the skip rule runs without a GPU.

The ways the skip could lie come first: each test below is one (report COMMITTED while a graph reads memory
without the reload's values, or write values a tensor was not given), with the rule that closes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from graphsafe import GraphContract, graph_visible, register_derived
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.collectors import record_capture
from graphsafe.outcome import Status


def _word(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _kernel(*tensors: torch.Tensor, name: str = "fused") -> dict[str, Any]:
    params = [_word(t.data_ptr()).hex() for t in tensors]
    return {"type": "kernel", "name": name, "layout": [[8 * i, 8] for i in range(len(tensors))], "params": params}


def _table(*rows: dict[str, Any]) -> dict[str, Any]:
    return {"root": 1, "graphs": {"1": list(rows)}}


class FakeGraph:
    """A keep_graph CUDAGraph stand-in whose raw graph is the recorded table's root."""

    def raw_cuda_graph(self) -> int:
        return 1


def _capture(
    contract: GraphContract, table: dict[str, Any], name: str = "g", ignore: tuple[torch.Tensor, ...] = ()
) -> None:
    state = _STATE[0]
    state["table"] = table
    with record_capture(contract, name=name, graph=FakeGraph(), ignore=list(ignore)):
        pass


_STATE: list[dict[str, Any]] = []


@pytest.fixture(autouse=True)
def _state(fake_cuda: dict[str, Any]) -> Iterator[None]:
    _STATE.append(fake_cuda)
    yield
    _STATE.pop()


# -- the model: one slot the graph reads, one it does not ---------------------------------------------------------
class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    @graph_visible("read_t", "unread_t")
    def process_weights_after_loading(self) -> None:
        self.read_t = (self.weight * 2).contiguous()  # a NEW tensor on every load
        self.unread_t = (self.weight + 1).contiguous()


def _load(layer: Layer, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
        layer.process_weights_after_loading()


def _sealed(unread: str = "skip", mode: str = "strict") -> tuple[Layer, GraphContract]:
    layer = Layer()
    _load(layer, 0)
    contract = GraphContract(layer, mode, unread=unread).seal()  # type: ignore[arg-type]
    return layer, contract


def _reads_read_t(layer: Layer) -> dict[str, Any]:
    return _table(_kernel(layer.read_t))


def test_skip_leaves_the_unread_slot_on_its_new_tensor_and_frees_the_captured_one() -> None:
    layer, contract = _sealed()
    _capture(contract, _reads_read_t(layer))
    read_ptr = layer.read_t.data_ptr()
    old = weakref.ref(layer.unread_t.untyped_storage())
    with contract.reload() as txn:
        _load(layer, 1)
        new_unread = layer.unread_t
    outcome = txn.outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    assert outcome.slots_skipped == 1 and outcome.skip_refused is None and outcome.skip_notes == ()
    assert outcome.bytes_copied == layer.read_t.nbytes  # only the slot a graph reads
    assert layer.read_t.data_ptr() == read_ptr and torch.equal(layer.read_t, layer.weight * 2)
    assert layer.unread_t is new_unread and torch.equal(layer.unread_t, layer.weight + 1)
    assert old() is None  # the captured storage was let go
    assert "1 unread slot(s) not copied" in outcome.summary()

    # The adopted tensor is the slot's sealed memory now: the next reload compares against it and skips again
    # (once this test lets go of it: a reference kept elsewhere keeps it restored).
    del new_unread
    adopted = weakref.ref(layer.unread_t.untyped_storage())
    with contract.reload() as txn:
        _load(layer, 2)
    assert txn.outcome is not None and txn.outcome.committed and txn.outcome.slots_skipped == 1
    assert adopted() is None and torch.equal(layer.unread_t, layer.weight + 1)
    assert layer.read_t.data_ptr() == read_ptr


def test_restore_is_the_default_and_copies_the_unread_slot_back() -> None:
    layer, contract = _sealed(unread="restore")
    _capture(contract, _reads_read_t(layer))
    unread_ptr = layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0
    assert outcome.slots_unread == 2  # unread_t and the parameter (loaded in place)
    assert outcome.bytes_copied == layer.read_t.nbytes + layer.unread_t.nbytes
    assert layer.unread_t.data_ptr() == unread_ptr and torch.equal(layer.unread_t, layer.weight + 1)
    assert GraphContract(layer).unread == "restore"


def test_an_unknown_unread_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown unread policy 'always'"):
        GraphContract(Layer(), unread="always")  # type: ignore[arg-type]


# -- incomplete truth: nothing is skipped, and the outcome says which capture ----------------------------------------
def _refused(contract: GraphContract, layer: Layer) -> str:
    unread_ptr = layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0
    assert layer.unread_t.data_ptr() == unread_ptr  # restored
    assert outcome.skip_refused is not None
    assert outcome.skip_refused in outcome.summary()
    return outcome.skip_refused


def test_no_capture_refuses_the_skip() -> None:
    layer, contract = _sealed()
    assert "no capture manifest" in _refused(contract, layer)


def test_a_dispatch_recorded_capture_refuses_the_skip_for_the_whole_contract() -> None:
    layer, contract = _sealed()
    _capture(contract, _reads_read_t(layer), name="scanned")
    with torch.no_grad(), record_capture(contract, name="eager", backend="dispatch"):
        layer.read_t.sum()
    reason = _refused(contract, layer)
    assert "capture 'eager' was recorded by the dispatch recorder" in reason


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"type": "kernel", "name": "packed", "layout": [[0, 8]], "params": None}, "kernel packed: parameters passed"),
        (
            {"type": "kernel", "name": "odd", "layout": [], "params": [], "undecoded": "cuFuncGetParamInfo failed"},
            "kernel odd: cuFuncGetParamInfo failed",
        ),
        ({"type": "host"}, "a host node is not read"),
        ({"type": "conditional"}, "a conditional node is not read"),
    ],
)
def test_a_node_the_scan_could_not_read_refuses_the_skip(row: dict[str, Any], expected: str) -> None:
    layer, contract = _sealed()
    table = _reads_read_t(layer)
    table["graphs"]["1"].append(row)
    _capture(contract, table, name="partial")
    reason = _refused(contract, layer)
    assert "capture 'partial'" in reason and expected in reason


def test_cuda_driver_marks_a_kernel_whose_parameter_info_cannot_be_read() -> None:
    class Result:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_NOT_SUPPORTED = 801

    class FakeCu:
        CUresult = Result

        def __init__(self, error: int) -> None:
            self.error = error

        def cuFuncGetParamInfo(self, func: int, index: int) -> tuple[int, int, int]:
            return (self.error, 0, 0) if index >= 1 else (0, 0, 8)

        def cuFuncGetName(self, func: int) -> tuple[int, bytes]:
            return 0, b"k"

    def layout_of(error: int) -> tuple[Any, ...]:
        drv = object.__new__(kscan.CudaDriver)
        drv._cu, drv._success, drv._end, drv._layouts = FakeCu(error), 0, 1, {}
        return drv._layout(7)

    assert layout_of(Result.CUDA_ERROR_INVALID_VALUE) == (((0, 8),), "k", "")  # past the last parameter: complete
    layout, _, why = layout_of(Result.CUDA_ERROR_NOT_SUPPORTED)
    assert layout == ((0, 8),) and "cuFuncGetParamInfo failed with 801" in why


# -- aliases move together or the skip is not taken ------------------------------------------------------------------
class Aliased(Layer):
    def __init__(self, *, follow: bool) -> None:
        super().__init__()
        self.follow = follow

    @graph_visible("read_t", "unread_t")
    def process_weights_after_loading(self) -> None:
        self.read_t = (self.weight * 2).contiguous()
        self.unread_t = (self.weight + 1).contiguous()
        if self.follow or not hasattr(self, "unread_view"):
            self.unread_view = self.unread_t[:2]  # an undeclared view: the walker's alias path of unread_t


@pytest.mark.parametrize("follow", [True, False])
def test_an_alias_path_moves_with_its_slot_or_blocks_the_skip(follow: bool) -> None:
    layer = Aliased(follow=follow)
    _load(layer, 0)
    contract = GraphContract(layer, "strict", unread="skip").seal()
    assert {i.path: i.origin.value for i in contract.slots()}["unread_view"] == "alias"
    _capture(contract, _reads_read_t(layer))
    unread_ptr = layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed, outcome.summary()
    assert torch.equal(layer.unread_t, layer.weight + 1) and torch.equal(layer.unread_view, layer.unread_t[:2])
    if follow:
        assert outcome.slots_skipped == 2  # the slot and its alias path, onto one new storage
        assert layer.unread_view.untyped_storage() is layer.unread_t.untyped_storage()
    else:
        # The view stayed on the captured storage: skipping would leave it on the old values. Restored instead.
        assert outcome.slots_skipped == 0 and layer.unread_t.data_ptr() == unread_ptr
        (note,) = outcome.skip_notes
        assert "another path to its captured storage is left on it" in note and note in outcome.summary()


def test_a_captured_storage_held_outside_the_contract_is_restored_not_skipped() -> None:
    layer, contract = _sealed()
    _capture(contract, _reads_read_t(layer))
    kept = layer.unread_t  # a reference the contract does not know of (a loader's dict, a user variable)
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0
    assert layer.unread_t is kept and torch.equal(kept, layer.weight + 1)  # it reads the reload's values
    (note,) = outcome.skip_notes
    assert "still held outside the contract" in note


def test_a_captured_storage_another_tensor_holds_is_restored_into_the_captured_object_itself() -> None:
    layer, contract = _sealed()
    _capture(contract, _reads_read_t(layer))
    tail = torch.empty(0).set_(layer.unread_t.untyped_storage(), 8, (2, 4), (4, 1))  # the storage, not the object
    captured = weakref.ref(layer.unread_t)
    ptr = layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0, outcome.summary()
    assert layer.unread_t.data_ptr() == ptr and torch.equal(tail, (layer.weight + 1)[2:])
    # Seen held before letting go (the storage's use count): the restore is the plain one, into the same object.
    assert layer.unread_t is captured()
    assert "still held outside the contract" in outcome.skip_notes[0]


def test_a_captured_view_whose_base_is_held_elsewhere_is_restored_through_a_rebuilt_view() -> None:
    layer = Layer()
    _load(layer, 0)
    arena = torch.zeros(32)  # held by this test: the captured view's base
    layer.unread_t = arena[:16].view(4, 4)
    layer.unread_t.copy_(layer.weight + 1)
    contract = GraphContract(layer, "strict", unread="skip").seal()
    _capture(contract, _reads_read_t(layer))
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0, outcome.summary()
    assert layer.unread_t.data_ptr() == arena.data_ptr()  # rebound to a view rebuilt on the captured storage
    assert torch.equal(arena[:16].view(4, 4), layer.weight + 1)
    assert "still held outside the contract" in outcome.skip_notes[0]


class Holder(nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.table = table


def test_a_reader_of_the_captured_storage_outside_the_step_blocks_the_skip() -> None:
    # A table two layers share (tied); the loader replaces one of the layers, so only the other is restored.
    model = nn.Module()
    shared = torch.ones(4)
    model.a, model.b = Holder(shared), Holder(shared)
    del shared
    register_derived(model.a, "table")
    register_derived(model.b, "table")
    contract = GraphContract(model, "recapture", unread="skip").seal()
    _capture(contract, _table(_kernel(model.a.weight)))
    with contract.reload() as txn:
        model.a.table = torch.full((4,), 2.0)
        model.b = Holder(torch.full((4,), 2.0))
    outcome = txn.outcome
    assert outcome is not None and outcome.slots_skipped == 0
    assert any(
        "b:table reads the same captured storage and is not restored in this step" in n for n in outcome.skip_notes
    ), outcome.skip_notes


class Arena(Layer):
    """A slot whose storage is its own object over part of a buffer's memory (from_blob, DLPack, a carved arena)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("arena", torch.zeros(64))

    @graph_visible("read_t", "unread_t", "carved")
    def process_weights_after_loading(self) -> None:
        Layer.process_weights_after_loading(self)
        values = self.weight.flatten()[:16] + 3
        if not hasattr(self, "carved"):
            self.carved = torch.from_numpy(self.arena.numpy()[16:32])  # its own storage, inside the arena's bytes
            self.carved.copy_(values)
        else:
            self.carved = values.clone()


def test_a_storage_inside_memory_a_graph_reads_is_read() -> None:
    layer = Arena()
    _load(layer, 0)
    contract = GraphContract(layer, "strict", unread="skip").seal()
    assert layer.carved.untyped_storage() is not layer.arena.untyped_storage()
    _capture(contract, _table(_kernel(layer.read_t, layer.arena)))  # the kernel reads the whole arena
    unread = contract.manifest.unread(contract)  # type: ignore[union-attr]
    assert unread is not None and "carved" not in {i.path for i in unread}
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 1, outcome.summary()  # unread_t
    assert torch.equal(layer.arena[16:32], layer.weight.flatten()[:16] + 3)  # what the graph reads there: new values


# -- the new tensor: on memory a graph reads, or another slot's captured storage -----------------------------------
class Rotating(Layer):
    """PWAL hands the unread slot the captured tensor of the read one (a rotation), and the read one a new tensor."""

    @graph_visible("read_t", "unread_t")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "read_t"):
            super().process_weights_after_loading()
            return
        old_read = self.read_t
        self.read_t = (self.weight * 2).contiguous()
        old_read.copy_(self.weight + 1)
        self.unread_t = old_read


def test_a_new_tensor_on_another_slots_captured_storage_is_not_adopted() -> None:
    layer = Rotating()
    _load(layer, 0)
    contract = GraphContract(layer, "strict", unread="skip").seal()
    _capture(contract, _reads_read_t(layer))
    read_ptr, unread_ptr = layer.read_t.data_ptr(), layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0, outcome.summary()
    assert layer.read_t.data_ptr() == read_ptr and torch.equal(layer.read_t, layer.weight * 2)
    assert layer.unread_t.data_ptr() == unread_ptr and torch.equal(layer.unread_t, layer.weight + 1)
    assert any("another slot's captured storage" in note for note in outcome.skip_notes), outcome.skip_notes


def test_a_new_tensor_on_memory_a_graph_reads_is_not_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, contract = _sealed()
    # The graph reads a free allocator block; PWAL's new tensor lands there (the allocator reused it).
    landing = torch.zeros(4, 4)
    address = landing.untyped_storage().data_ptr()
    free = {"address": address, "total_size": 64, "blocks": [{"address": address, "size": 64, "state": "inactive"}]}
    base = kscan.allocator_segments
    monkeypatch.setattr(kscan, "allocator_segments", lambda: [*base(), free])
    _capture(contract, _table(_kernel(layer.read_t), {"type": "memset", "pointers": [address]}))
    unread_ptr = layer.unread_t.data_ptr()
    with contract.reload() as txn, torch.no_grad():
        layer.weight.copy_(torch.randn(4, 4))
        layer.read_t = (layer.weight * 2).contiguous()
        landing.copy_(layer.weight + 1)
        layer.unread_t = landing
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0
    assert layer.unread_t.data_ptr() == unread_ptr
    assert any("a captured graph reads memory its new tensor is on" in n for n in outcome.skip_notes)


# -- pointer arrays: a storage a graph reads that points into a slot's storage ----------------------------------------
class Grouped(Layer):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ptrs", torch.zeros(2, dtype=torch.int64))

    def point_at(self, tensor: torch.Tensor) -> None:
        self.ptrs.copy_(torch.tensor([tensor.data_ptr(), 0]))


def test_a_slot_a_pointer_array_points_into_is_read() -> None:
    layer = Grouped()
    _load(layer, 0)
    layer.point_at(layer.unread_t[1:])  # an address inside the storage, not its start
    contract = GraphContract(layer, "strict", unread="skip").seal()
    _capture(contract, _table(_kernel(layer.read_t, layer.ptrs)))  # the kernel sees only the array
    facts = contract.manifest._scans["g"]  # type: ignore[union-attr]
    # Every small storage the kernel points at is read for pointers (read_t too, whose float bits point nowhere).
    assert facts.arrays == 2 and facts.indirect == 1
    unread = contract.manifest.unread(contract)  # type: ignore[union-attr]
    assert unread is not None and "unread_t" not in {i.path for i in unread}
    unread_ptr = layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0
    assert layer.unread_t.data_ptr() == unread_ptr and torch.equal(layer.unread_t, layer.weight + 1)


def test_a_pointer_array_pointing_elsewhere_leaves_the_slot_unread() -> None:
    layer = Grouped()
    _load(layer, 0)
    layer.point_at(layer.read_t)
    contract = GraphContract(layer, "strict", unread="skip").seal()
    _capture(contract, _table(_kernel(layer.ptrs)))
    with contract.reload() as txn:
        _load(layer, 1)
    assert txn.outcome is not None and txn.outcome.committed and txn.outcome.slots_skipped == 1


# -- a later capture that reads the adopted tensor ----------------------------------------------------------------
def test_an_adopted_tensor_a_later_capture_reads_is_restored_from_then_on() -> None:
    layer, contract = _sealed()
    _capture(contract, _reads_read_t(layer))
    with contract.reload() as txn:
        _load(layer, 1)
    assert txn.outcome is not None and txn.outcome.slots_skipped == 1
    _capture(contract, _table(_kernel(layer.read_t, layer.unread_t)))  # the graph, captured again: it reads it now
    adopted = layer.unread_t.data_ptr()
    with contract.reload() as txn:
        _load(layer, 2)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 0
    assert layer.unread_t.data_ptr() == adopted and torch.equal(layer.unread_t, layer.weight + 1)


# -- layerwise reloads ---------------------------------------------------------------------------------------------
class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])


def test_layerwise_reload_skips_per_layer() -> None:
    model = Stack()
    for i, layer in enumerate(model.layers):
        _load(layer, i)
    contract = GraphContract(model, "strict", unread="skip").seal()
    _capture(contract, _table(_kernel(*(layer.read_t for layer in model.layers))))
    read_ptrs = [layer.read_t.data_ptr() for layer in model.layers]
    olds = [weakref.ref(layer.unread_t.untyped_storage()) for layer in model.layers]
    with contract.reload(layerwise=True) as txn:
        for i, layer in enumerate(model.layers):
            txn.before_layer(layer)
            _load(layer, 10 + i)
            txn.after_layer(layer)
            assert olds[i]() is None  # let go at its own after_layer
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 2, outcome.summary()
    for layer, ptr in zip(model.layers, read_ptrs, strict=True):
        assert layer.read_t.data_ptr() == ptr and torch.equal(layer.read_t, layer.weight * 2)
        assert torch.equal(layer.unread_t, layer.weight + 1)


def test_layerwise_tied_slots_are_skipped_together_at_finish() -> None:
    # A table two layers share (tied): restored at finish(), when both are loaded; both paths moved to one new tensor.
    model = nn.Module()
    model.a, model.b = Holder(torch.ones(4)), Holder(torch.zeros(1))
    model.b.table = model.a.table
    register_derived(model.a, "table")
    register_derived(model.b, "table")
    contract = GraphContract(model, "strict", unread="skip").seal()
    _capture(contract, _table(_kernel(model.a.weight)))
    old = weakref.ref(model.a.table.untyped_storage())
    with contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        model.a.table = torch.full((4,), 2.0)
        txn.after_layer(model.a)
        assert old() is not None  # tied: waits for finish()
        txn.before_layer(model.b)
        model.b.table = model.a.table
        txn.after_layer(model.b)
    outcome = txn.outcome
    assert outcome is not None and outcome.committed and outcome.slots_skipped == 2, outcome.summary()
    assert old() is None and model.b.table is model.a.table and torch.equal(model.a.table, torch.full((4,), 2.0))


# -- the oracle: no stale read reported COMMITTED ---------------------------------------------------------------
#: Old tensors the oracle's "rebuild-held" plan keeps alive outside the model (a loader's dict, a user variable).
_KEPT: list[torch.Tensor] = []


class Many(nn.Module):
    """``n`` derived slots ``d{i}``, a view ``v`` of ``d0`` (an alias that moves with it) and a one-word pointer array
    ``ptrs``; PWAL rebuilds each ``d{i}``, writes it in place, or rebuilds it while the old one is kept elsewhere, as
    ``plan`` says."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.zeros(n, 8), requires_grad=False)
        self.register_buffer("ptrs", torch.zeros(1, dtype=torch.int64))
        self.plan: list[str] = ["rebuild"] * n
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        for i, how in enumerate(self.plan):
            value = self.weight[i] * (i + 2)
            old = getattr(self, f"d{i}", None)
            if how == "inplace" and old is not None:
                old.copy_(value)
                continue
            if how == "rebuild-held" and old is not None:
                _KEPT.append(old)
            setattr(self, f"d{i}", value.clone())
        if self.plan[0] != "inplace" or not hasattr(self, "v"):
            self.v = self.d0[:4]


def _oracle(model: Many, reads: dict[str, int]) -> None:
    """Independent of the contract: what PWAL computes from the weights as loaded must be what every path holds,
    and every path a graph reads (directly or through the pointer array) must be at the address it captured."""
    for i in range(model.n):
        produced = model.weight[i] * (i + 2)
        held = getattr(model, f"d{i}")
        if f"d{i}" in reads:
            assert held.data_ptr() == reads[f"d{i}"], f"d{i}: a graph reads @{reads[f'd{i}']:x}, the model moved it"
        assert torch.equal(held, produced), f"d{i}: not the reload's values (a graph reads it: {f'd{i}' in reads})"
    assert model.v.untyped_storage() is model.d0.untyped_storage() and torch.equal(model.v, model.d0[:4])
    if "v" in reads:
        assert model.v.data_ptr() == reads["v"], "v: a graph reads it, the model moved it"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(2, 5),
    data=st.data(),
)
def test_oracle_every_storage_a_graph_reads_holds_the_reloads_values_at_its_captured_address(
    n: int, data: st.DataObject
) -> None:
    model = Many(n)
    with torch.no_grad():
        model.weight.copy_(torch.randn(n, 8, generator=torch.Generator().manual_seed(0)))
        model.process_weights_after_loading()
    for i in range(n):
        register_derived(model, f"d{i}")
    register_derived(model, "v")
    contract = GraphContract(model, "recapture", unread="skip").seal()
    reads: dict[str, int] = {}  # path -> the address the graph captured
    names = [*(f"d{i}" for i in range(n)), "v"]

    def capture() -> None:
        chosen = sorted(data.draw(st.sets(st.sampled_from(names)), label="graph reads"))
        pointed = data.draw(st.sampled_from([None, *names[:-1]]), label="pointer array points at")
        reads.clear()
        reads.update({name: getattr(model, name).data_ptr() for name in chosen})
        tensors = [getattr(model, name) for name in chosen]
        if pointed is not None:  # the graph reads the array, and through it what it points at
            model.ptrs.fill_(getattr(model, pointed).data_ptr())
            reads[pointed] = getattr(model, pointed).data_ptr()
            tensors.append(model.ptrs)
        _capture(contract, _table(_kernel(*tensors)) if tensors else _table({"type": "empty"}))

    capture()
    for step in range(data.draw(st.integers(1, 4), label="reloads")):
        if data.draw(st.booleans(), label="recapture first"):
            capture()
        model.plan = [
            data.draw(st.sampled_from(["rebuild", "inplace", "rebuild-held"]), label=f"d{i}") for i in range(n)
        ]
        seed = 100 + step
        with contract.reload() as txn, torch.no_grad():
            model.weight.copy_(torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)))
            model.process_weights_after_loading()
        _KEPT.clear()
        outcome = txn.outcome
        assert outcome is not None
        if outcome.status is Status.COMMITTED:
            _oracle(model, reads)  # in a function of its own: its locals do not keep a slot's tensor alive
            read = {name for name in reads} | ({"d0"} if "v" in reads else set())
            skipped = sum((2 if i == 0 else 1) for i in range(n) if f"d{i}" not in read and model.plan[i] == "rebuild")
            assert outcome.slots_skipped == skipped, outcome.summary()
        else:
            contract.reseal(recaptured=True)
            capture()
