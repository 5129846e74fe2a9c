"""The layerwise reload transaction, its error paths, ``unread="skip"`` and the torch adapter: what they must hold.

Every test reloads DIFFERENT weights and judges with an oracle that does not use graphsafe's reasoning: what a fresh
load + PWAL of the same final weights computes (``w(seed) * 2 + 1`` and friends, recomputed here), and whether the
tensor a captured graph reads (the object held at seal, or its data pointer) is still the one at its path. Each test
pins one way the promise it states could break.

Promise checked (absolute): a reload never reports COMMITTED while a captured address holds anything but the values a
fresh load + PWAL gives; graphsafe never leaves a model half-restored without saying so (the contract is unsafe, or
the outcome is not COMMITTED); a failure is reported as graphsafe's own error, not a raw crash.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from _graph_tables import FakeGraph, kernel_row
from graphsafe import GraphContract, GraphSafeError, Status, graph_visible, register_derived
from graphsafe.adapters.torch import capture
from graphsafe.collectors import record_capture
from graphsafe.errors import ContractViolation

MODES = ("strict", "recapture", "migrate")
DETECTS = ("every-reload", "sealed-paths", "declared-only")


def w(seed: int, n: int = 4) -> torch.Tensor:
    """Distinct values per seed, so a stale or foreign value can never pass by accident."""
    return torch.arange(n, dtype=torch.float32) + 100.0 * seed + 0.5


# ----------------------------------------------------------------------------------------------------------------
# A flat two-layer model: weight -> w_t = weight * 2 + 1 (a NEW tensor per PWAL), declared.


class Lin(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * 2.0 + 1.0


def _flat() -> nn.Module:
    net = nn.Module()
    net.layers = nn.ModuleList([Lin(1), Lin(2)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    return net


# ----------------------------------------------------------------------------------------------------------------
# 1. A layer changed after its own after_layer(), before finish().


@pytest.mark.parametrize("variant", ["pwal_again", "pwal_again_then_after_again", "weight_loaded_again"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_changed_after_its_after_layer_is_not_committed(mode: str, detect: str, variant: str) -> None:
    """A layerwise loader restores layer 0 (before_layer, load, PWAL, after_layer), then touches layer 0
    again before finish(): a second PWAL (a loader that runs PWAL once per shard, or a second weight file for the
    layer), optionally followed by a second after_layer() without a before_layer(), or a late weight write.

    Promise: COMMITTED only if the captured w_t storage holds weight*2+1 of the final weight and w_t is bound there.
    finish() never looks at a layer whose snapshot is already ``done``, and a second after_layer() skips it too, so
    the new PWAL tensor (or the late weight) goes unseen."""
    net = _flat()
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l0 = net.layers[0]
    captured = l0.w_t  # what the graph reads
    ptr = captured.data_ptr()
    with (
        contextlib.suppress(ContractViolation),
        contract.reload(layerwise=True) as txn,
        torch.no_grad(),
    ):
        for index, layer in enumerate(net.layers):
            txn.before_layer(layer)
            layer.weight.copy_(w(10 + index))
            layer.process_weights_after_loading()
            txn.after_layer(layer)
        # layer 0 again, after its restore
        l0.weight.copy_(w(50))
        if variant != "weight_loaded_again":
            l0.process_weights_after_loading()
        if variant == "pwal_again_then_after_again":
            txn.after_layer(l0)
    outcome = contract.last_outcome
    assert outcome is not None
    expected = w(50) * 2.0 + 1.0  # a fresh load of the final weight, then PWAL
    if outcome.status is Status.COMMITTED:
        assert l0.w_t.data_ptr() == ptr, (
            f"COMMITTED, but layers.0.w_t was rebound to a new tensor; the captured storage holds {captured.tolist()}"
        )
        assert torch.equal(captured, expected), (
            f"COMMITTED, but the captured layers.0.w_t holds {captured.tolist()}, "
            f"a fresh load gives {expected.tolist()}"
        )


# ----------------------------------------------------------------------------------------------------------------
# 2. Nested layers: a parent's PWAL rebuilds its child's declared slot after the child's after_layer().


class Child(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * 2.0 + 1.0


class Parent(nn.Module):
    """A composite layer (a fused MoE, an attention block with a quantized child): its PWAL folds its own scale into
    the child's derived tensor, as a new tensor."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(w(seed), requires_grad=False)
        self.child = Child(seed + 1)

    def process_weights_after_loading(self) -> None:
        self.child.w_t = self.child.weight * 2.0 + 1.0 + self.scale
        self.fused = self.scale * 3.0


def _nested() -> nn.Module:
    net = nn.Module()
    net.layers = nn.ModuleList([Parent(1), Parent(3)])
    for parent in net.layers:
        parent.child.process_weights_after_loading()
        parent.process_weights_after_loading()
        register_derived(parent.child, "w_t")
        register_derived(parent, "fused")
    return net


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_parent_pwal_that_rebuilds_its_childs_slot_after_the_childs_after_layer(mode: str, detect: str) -> None:
    """A recursive (post-order) loader: before_layer(parent), before_layer(child), load and PWAL the child,
    after_layer(child), load the parent's own weight, the parent's PWAL (which rebuilds ``child.w_t`` as a new
    tensor), after_layer(parent).

    Promise: COMMITTED only if the child's captured w_t holds child.weight*2+1+scale (final weights) and is bound at
    its path. after_layer(parent) skips the child's entry because its snapshot is ``done``: the child's captured
    storage keeps the child-PWAL values and the path holds a tensor no graph reads."""
    net = _nested()
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = [parent.child.w_t for parent in net.layers]
    ptrs = [t.data_ptr() for t in captured]
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn, torch.no_grad():
        for index, parent in enumerate(net.layers):
            txn.before_layer(parent)
            txn.before_layer(parent.child)
            parent.child.weight.copy_(w(20 + index))
            parent.child.process_weights_after_loading()
            txn.after_layer(parent.child)
            parent.scale.copy_(w(30 + index))
            parent.process_weights_after_loading()
            txn.after_layer(parent)
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        for index, parent in enumerate(net.layers):
            expected = w(20 + index) * 2.0 + 1.0 + w(30 + index)
            assert parent.child.w_t.data_ptr() == ptrs[index], (
                f"COMMITTED, but layers.{index}.child.w_t moved off its captured storage, which holds "
                f"{captured[index].tolist()} (fresh load: {expected.tolist()})"
            )
            assert torch.equal(captured[index], expected)


# ----------------------------------------------------------------------------------------------------------------
# 3. Property: random layerwise interleavings of before/after/load/PWAL over parents and children, judged by a fresh
#    model. Every module is before_layer()'d before its first load and PWAL runs after its last load: the documented
#    gaps (no before_layer, a PWAL before the last weight) are not drawn.

_NAMES = ("layers.0", "layers.0.child", "layers.1", "layers.1.child")
_FINAL = {name: 40 + i for i, name in enumerate(_NAMES)}


class PChild(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * 2.0 + 1.0


class PParent(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.child = PChild(seed + 1)

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * 3.0  # its own slot only: no cross-module dependency


def _expected(name: str) -> torch.Tensor:
    return w(_FINAL[name]) * 2.0 + 1.0 if name.endswith("child") else w(_FINAL[name]) * 3.0


@st.composite
def _interleavings(draw: st.DrawFn) -> list[tuple[str, str, int]]:
    scripts: dict[str, list[tuple[str, str, int]]] = {}
    for name in _NAMES:
        ops = [("before", name, 0)]
        if draw(st.booleans()):
            ops.append(("load", name, 90))  # an intermediate value first
        ops += [("load", name, _FINAL[name]), ("pwal", name, 0)]
        for extra in draw(st.lists(st.sampled_from(["after", "pwal+after", "reopen"]), max_size=2)):
            if extra == "after":
                ops.append(("after", name, 0))
            elif extra == "pwal+after":
                ops += [("pwal", name, 0), ("after", name, 0)]
            else:
                ops += [("before", name, 0), ("load", name, _FINAL[name]), ("pwal", name, 0)]
        if draw(st.booleans()):
            ops.append(("after", name, 0))
        scripts[name] = ops
    sequence: list[tuple[str, str, int]] = []
    while any(scripts.values()):
        name = draw(st.sampled_from([n for n in _NAMES if scripts[n]]))
        sequence.append(scripts[name].pop(0))
    return sequence


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=_interleavings(), mode=st.sampled_from(MODES), detect=st.sampled_from(DETECTS))
def test_oracle_random_layerwise_orders_never_commit_wrong_memory(
    sequence: list[tuple[str, str, int]], mode: str, detect: str
) -> None:
    """Any interleaving of before_layer/after_layer/load/PWAL over two parents and their children (a
    parent's after_layer covers its child; a module may be restored, then PWAL'd again, then restored again).

    Promise: COMMITTED only if every captured slot is still bound at its path, on its captured storage, holding what
    a fresh model loaded with the final weights computes."""
    net = nn.Module()
    net.layers = nn.ModuleList([PParent(1), PParent(3)])
    modules = {name: net.get_submodule(name) for name in _NAMES}
    for module in modules.values():
        module.process_weights_after_loading()
        register_derived(module, "w_t")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = {name: modules[name].w_t for name in _NAMES}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn, torch.no_grad():
        for op, name, seed in sequence:
            module = modules[name]
            if op == "before":
                txn.before_layer(module)
            elif op == "after":
                txn.after_layer(module)
            elif op == "load":
                module.weight.copy_(w(seed))
            else:
                module.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        for name in _NAMES:
            assert modules[name].w_t is captured[name], f"COMMITTED, but {name}.w_t is not the captured tensor"
            assert torch.equal(captured[name], _expected(name)), (
                f"COMMITTED, but the captured {name}.w_t holds {captured[name].tolist()}, "
                f"a fresh load gives {_expected(name).tolist()}"
            )


# ----------------------------------------------------------------------------------------------------------------
# 4. An interrupt (KeyboardInterrupt) while an on_outcome listener runs.


@pytest.mark.parametrize("fault", ["declared_drift", "loader_raised"])
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_an_interrupt_in_an_outcome_listener_leaves_a_failed_reload_serving_safe(mode: str, fault: str) -> None:
    """Ctrl-C lands while an ``on_outcome`` listener (logging, metrics) runs, on a reload that did NOT
    commit (a respecified declared slot; or the loader raised after half the weights were loaded).

    Promise: a reload that was not committed leaves the contract unsafe (replay and further reloads refused), or the
    error says the reload failed. The agreement and the restore guard BaseException; the listener call does not:
    ``_apply`` never runs, so the contract stays serving-safe, last_outcome is not updated, and the next reload is
    accepted on top of half-loaded weights."""
    net = _flat()
    contract = GraphContract(net, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    l0 = net.layers[0]

    def listener(outcome: Any) -> None:
        raise KeyboardInterrupt

    contract.on_outcome(listener)
    with pytest.raises(KeyboardInterrupt), contract.reload() as txn, torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(10 + index))
            if fault == "loader_raised":
                raise ValueError("the loader failed after loading layer 0")
            layer.process_weights_after_loading()
        l0.w_t = l0.w_t[:3].clone()  # respecified: no copy can restore it, the graph reads old values
    assert txn.outcome is not None and txn.outcome.status is not Status.COMMITTED
    assert not contract.serving_safe, (
        f"the reload's outcome is {txn.outcome.status.value}, yet the contract is serving-safe "
        f"(last_outcome={contract.last_outcome})"
    )


# ----------------------------------------------------------------------------------------------------------------
# 5. An explicit begin() whose finish() never runs: the loader raised mid-layer and the exception escaped.


def test_an_abandoned_layerwise_transaction_leaves_replay_allowed() -> None:
    """``txn = contract.reload(layerwise=True).begin()``, layer 0 restored by after_layer(), then the
    loader raises in layer 1 between before_layer and after_layer; the exception escapes the caller's loop, so
    finish() never runs (the begin()/finish() form, not the context manager).

    Promise: no half-restored model without saying so: layer 1's captured w_t holds the old values while its weight
    holds new ones. The contract must not call replay safe. Without the rule ``serving_safe`` stays True and the
    adapter's ``replay()`` goes ahead (only a later reload is refused, as "already open")."""
    net = _flat()
    contract = GraphContract(net, "recapture")
    graph = capture(contract, lambda x: net.layers[0].w_t * x + net.layers[1].w_t, torch.ones(4))
    stale = net.layers[1].w_t

    opened: list[Any] = []

    def reload_step() -> None:
        txn = contract.reload(layerwise=True).begin()
        opened.append(txn)
        with torch.no_grad():
            for index, layer in enumerate(net.layers):
                txn.before_layer(layer)
                layer.weight.copy_(w(10 + index))
                if index == 1:
                    raise OSError("shard 2 of the checkpoint is truncated")
                layer.process_weights_after_loading()
                txn.after_layer(layer)
        txn.finish()

    with pytest.raises(OSError):
        reload_step()
    assert not torch.equal(stale, net.layers[1].weight * 2.0 + 1.0)  # half-restored: layer 1 is stale
    assert not contract.serving_safe, "a reload broke off half-way and the contract still calls replay safe"
    assert "transaction is open" in str(contract.unsafe_reason)
    with pytest.raises(GraphSafeError):
        graph.replay()
    # The caller finishes it late, with the error: failed, and the first reload's recording (a dispatch mode on this
    # thread) ends with it.
    outcome = opened[0].finish(OSError("late"))
    assert outcome.status is Status.FAILED and not contract.serving_safe


# ----------------------------------------------------------------------------------------------------------------
# 6. unread="skip": a slot a graph reads through a pointer table the kernel scan does not read.


@pytest.fixture
def scan(fake_cuda: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield fake_cuda


class Grouped(nn.Module):
    """A grouped-GEMM style layer: the kernel gets a device-side table holding the address of ``expert_t`` (not
    ``expert_t`` itself)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.register_buffer("table", table)

    @graph_visible("read_t", "expert_t")
    def process_weights_after_loading(self) -> None:
        self.read_t = (self.weight * 2).contiguous()
        self.expert_t = (self.weight + 1).contiguous()


def _load_grouped(layer: Grouped, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
        layer.process_weights_after_loading()


@pytest.mark.parametrize(
    "table",
    ["uint8_workspace", "int64_over_1MiB"],
)
def test_skip_frees_a_slot_a_graph_reads_through_a_pointer_table(scan: dict[str, Any], table: str) -> None:
    """The captured kernel reads ``expert_t`` through a pointer table (a grouped-GEMM argument array)
    that is a byte workspace (uint8, the way fused-MoE workspaces lay out their pointer arrays) or an int64 array
    just over 1 MiB. The kernel scan read pointer arrays only when they were int64/uint64 and at most 1 MiB, and
    said nothing about the others: truth() was "fully known". It now reads a small table of any dtype on the host
    and searches a larger one on its device: the pointer is found and truth() stays "fully known".

    Promise: COMMITTED never while a graph reads freed or stale memory. With ``unread="skip"`` the slot the table
    points at is judged unread, its captured storage is let go (freed), and the reload commits."""
    if table == "uint8_workspace":
        buf = torch.zeros(64, dtype=torch.uint8)
    else:
        buf = torch.zeros((1 << 20) // 8 + 1, dtype=torch.int64)  # over POINTER_ARRAY_BYTES (_kernelscan.py)
    layer = Grouped(buf)
    _load_grouped(layer, 0)
    layer.table.view(torch.int64)[0] = layer.expert_t.data_ptr()  # the table the kernel dereferences
    contract = GraphContract(layer, "strict", unread="skip").seal()
    scan["table"] = {"root": 1, "graphs": {"1": [kernel_row(layer.read_t, layer.table)]}}
    with record_capture(contract, name="g", graph=FakeGraph()):
        pass
    assert contract.manifest is not None
    if table == "int64_over_1MiB":  # too large to copy to host: searched on its device, and the pointer found
        assert contract.manifest.truth() is None
        unread = contract.manifest.unread(contract)
        assert unread is not None and "expert_t" not in {i.path for i in unread}
    read_by_graph = weakref.ref(layer.expert_t.untyped_storage())
    with contract.reload() as txn:
        _load_grouped(layer, 1)
    outcome = txn.outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert read_by_graph() is not None, (
            f"COMMITTED (slots_skipped={outcome.slots_skipped}), but the storage of expert_t that the captured "
            "kernel reads through its pointer table was freed: replay reads freed memory"
        )


# ----------------------------------------------------------------------------------------------------------------
# 7. Tensors made under torch.inference_mode(): the reload crashes with torch's own error.


class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), requires_grad=False)

    @graph_visible("w_t")
    def process_weights_after_loading(self) -> None:
        self.w_t = (self.weight * 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scratch"):
            self.scratch = torch.zeros(16)  # lazily allocated on the first forward
        return x @ self.w_t


@pytest.mark.parametrize("where", ["pwal_under_inference_mode", "warmup_under_inference_mode"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_tensors_made_under_inference_mode_do_not_crash_the_reload(where: str, layerwise: bool) -> None:
    """The engine runs its warm-up forward (which allocates a scratch) or the initial PWAL under
    ``torch.inference_mode()``, as inference engines do; seal() accepts the model. Every reload then dies in the
    snapshot with torch's "Inference tensors do not track version counter." (the snapshot reads ``._version``), whether
    or not the reload itself runs under inference mode.

    Promise: a failure is graphsafe's own, helpful error (at seal, naming the tensor and inference mode) or the reload
    works; never a raw crash out of graphsafe's internals that no recapture or reseal can get past."""
    model = Lazy()
    if where == "pwal_under_inference_mode":
        with torch.inference_mode():
            model.process_weights_after_loading()
        model.scratch = torch.zeros(16)
    else:
        model.process_weights_after_loading()
        with torch.inference_mode():
            model(torch.ones(2, 4))  # the warm-up forward
    try:
        contract = GraphContract(model, "recapture").seal()
        ctx = torch.inference_mode() if where == "pwal_under_inference_mode" else torch.no_grad()
        with ctx, contract.reload(layerwise=layerwise) as txn:
            if layerwise:
                txn.before_layer(model)
            model.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))
            model.process_weights_after_loading()
            if layerwise:
                txn.after_layer(model)
    except GraphSafeError:
        return  # refused with graphsafe's own error: acceptable
    except RuntimeError as exc:
        pytest.fail(f"the reload crashed inside graphsafe with torch's raw error: {exc!r}")
    assert txn.outcome is not None and txn.outcome.status is not Status.FAILED


@pytest.mark.parametrize("reload_under", ["inference_mode", "no_grad"])
def test_a_derived_slot_made_under_inference_mode_is_restored_in_place(reload_under: str) -> None:
    """PWAL ran under ``torch.inference_mode()`` at the first load, so the captured ``w_t`` is an inference tensor,
    which torch lets no one write outside that mode. A reload, under inference mode or not, restores it in place:
    the restore writes inference tensors under inference mode (new values at the captured address, no raw torch
    error)."""
    model = Lazy()
    with torch.inference_mode():
        model.process_weights_after_loading()
    captured = model.w_t
    ptr = captured.data_ptr()
    contract = GraphContract(model, "recapture").seal()
    new = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    ctx = torch.inference_mode() if reload_under == "inference_mode" else torch.no_grad()
    with ctx, contract.reload() as txn:
        model.weight.copy_(new)
        model.process_weights_after_loading()
    outcome = txn.outcome
    assert outcome is not None
    assert outcome.status is Status.COMMITTED, outcome.findings
    assert model.w_t is captured and model.w_t.data_ptr() == ptr
    assert torch.equal(captured, new * 2)
