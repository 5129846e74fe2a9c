"""``ClosedLayer``/``check_closed`` (layers ``after_layer()`` restored, checked again at
``finish()``), ``serving_safe`` around the outcome listeners, inference tensors, the kernel scan's integer pointer
tables, ``_reads_no_copy_reached``, the attribute transfer in ``LayerSnapshot.rebind`` and ``sealed-paths`` watching
graph-read paths that appeared after the seal: what each must hold.

Every reload loads DIFFERENT weights. The oracle never asks graphsafe: a cold model loaded with the final weights
(load every weight, then PWAL), the tensor a captured graph reads (the object held at seal, its data pointer), and
the values the model resolves at its paths.

The first group are lies (COMMITTED on wrong memory, a model left on values the reload did not produce); the second
group are false alarms on legitimate reloads (a reload refused, or a feature switched off, where nothing is wrong).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from _graph_tables import FakeGraph, kernel_row
from graphsafe import (
    ContractViolation,
    FindingKind,
    GraphContract,
    GraphSafeError,
    Status,
    graph_visible,
    register_derived,
)
from graphsafe.collectors import record_capture

MODES = ("strict", "recapture", "migrate")
DETECTS = ("every-reload", "sealed-paths", "declared-only")
N = 8


def w(seed: int, n: int = 4) -> torch.Tensor:
    """Distinct values per seed, so a stale value can never pass by accident."""
    return torch.arange(n, dtype=torch.float32) + 100.0 * seed + 0.5


# ================================================================================================================
# LIES
# ================================================================================================================


# -- 1. ClosedLayer on the first reload: an input from another layer, loaded after after_layer() -------------------
class CrossLin(nn.Module):
    """``w_t = weight * 2 + partner.weight``: layer 0's PWAL reads layer 1's weight (a tie, a shared scale, an
    absorbed projection that lives in a sibling)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.partner: Callable[[], nn.Module] | None = None

    def process_weights_after_loading(self) -> None:
        extra = self.partner().weight if self.partner is not None else 0.0  # type: ignore[union-attr]
        self.w_t = self.weight * 2.0 + extra


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_first_layerwise_reload_sees_an_input_from_a_later_layer_change_after_after_layer(
    mode: str, detect: str
) -> None:
    """Layer 0's PWAL reads layer 1's weight. A vLLM-style layerwise loader does before_layer, load, PWAL,
    after_layer for layer 0, then loads layer 1: layer 0's restored w_t was computed from layer 1's OLD weight.

    Promise: COMMITTED only if the captured layers.0.w_t holds what a cold model (all weights loaded, then PWAL)
    holds. ``ClosedLayer`` exists to catch exactly this ("its inputs unchanged since after_layer"), and does so from
    the second reload on; on the first reload (no recording before it) the closed layer watches only the inputs its
    snapshot took from the fallback (layer 0's own weight), not the inputs the first reload's dataflow just learned,
    so the first reload commits stale memory."""
    net = nn.Module()
    net.layers = nn.ModuleList([CrossLin(1), CrossLin(2)])
    l0, l1 = net.layers
    l0.partner = lambda: l1
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = l0.w_t
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn, torch.no_grad():
        for index, layer in enumerate(net.layers):
            txn.before_layer(layer)
            layer.weight.copy_(w(10 + index))
            layer.process_weights_after_loading()
            txn.after_layer(layer)
    outcome = contract.last_outcome
    assert outcome is not None
    expected = w(10) * 2.0 + w(11)  # cold model: every weight loaded, then PWAL
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, expected), (
            f"COMMITTED, but the captured layers.0.w_t holds {captured.tolist()} (computed from layer 1's old "
            f"weight); a cold model holds {expected.tolist()}"
        )


# -- 2. ClosedLayer: the layer itself replaced after its after_layer() ----------------------------------------------
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


@pytest.mark.parametrize("again", [False, True], ids=["no_after", "after_layer_on_new"])
@pytest.mark.parametrize("detect", DETECTS)
def test_a_layer_replaced_after_its_after_layer_is_not_committed(detect: str, again: bool) -> None:
    """Layer 0 is restored by after_layer(); then, before finish(), the loader re-materialises it (a new
    module object loaded with the final weights and PWAL'd: meta-device re-init, a module swapped in by a quant
    method), optionally followed by after_layer() on the new module.

    Promise: COMMITTED only if the graph's captured memory holds what the model computes. The same replacement
    before after_layer() is reported ``vanished`` ("the layer was replaced during the reload"); after it,
    ``ClosedLayer.check`` looks only at the old module object (``snapshot.layer``), which still holds the captured
    tensor, and never asks whether that module is still in the model: COMMITTED, while the graph reads values of
    the first pass and the model's layers.0 holds others at other addresses."""
    net = _flat()
    contract = GraphContract(net, "recapture", detect=detect).seal()  # type: ignore[arg-type]
    captured = net.layers[0].w_t
    with contract.reload(layerwise=True) as txn, torch.no_grad():
        for index, layer in enumerate(net.layers):
            txn.before_layer(layer)
            layer.weight.copy_(w(10 + index))
            layer.process_weights_after_loading()
            txn.after_layer(layer)
        fresh = Lin(50)
        fresh.process_weights_after_loading()
        net.layers[0] = fresh
        if again:
            txn.after_layer(fresh)
    outcome = txn.outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert net.layers[0].w_t is captured, "COMMITTED, but layers.0.w_t is not the tensor the graph reads"
        assert torch.equal(captured, w(50) * 2.0 + 1.0), (
            f"COMMITTED, but the captured layers.0.w_t holds {captured.tolist()}; the model's layers.0 computes "
            f"{(w(50) * 2.0 + 1.0).tolist()}"
        )


# -- 3. ClosedLayer: a layer whose slots were all in place at after_layer() is never checked again -----------------
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_only_layer_rebound_after_its_after_layer_is_not_committed(mode: str, detect: str) -> None:
    """Plain ``nn.Linear`` layers (parameters only, no derived slot: the most common layer there is). The
    layerwise loader copies layer 0's weight in place and calls after_layer(); then a late shard (or a loader that
    re-creates parameters) binds a NEW Parameter at layers.0.weight before finish().

    Promise: COMMITTED only if every captured tensor is still bound at its path with the values the model holds.
    The same rebind on a layer WITH a derived slot is reported ``moved``. Here the snapshot is ``in_place()`` at
    after_layer(), so restore/verify are skipped, ``snapshot.confirmed`` stays empty, ``ClosedLayer.of`` keeps no
    slot to check, and finish() commits while the graph reads the captured weight (old values) and the model holds
    another tensor."""
    net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = net[0].weight
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn, torch.no_grad():
        for index, layer in enumerate(net):
            txn.before_layer(layer)
            layer.weight.copy_(w(10 + index).expand(4, 4))
            txn.after_layer(layer)
        net[0].weight = nn.Parameter(w(50).expand(4, 4).clone(), requires_grad=False)
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert net[0].weight is captured, (
            f"COMMITTED, but 0.weight is a new Parameter; the captured one the graph reads holds "
            f"{captured[0].tolist()}, the model {net[0].weight[0].tolist()}"
        )


# -- 4. Kernel scan: a pointer table in a floating-point workspace --------------------------------------------------
class Grouped(nn.Module):
    """A grouped-GEMM style layer: the kernel gets a workspace holding the address of ``expert_t``."""

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_skip_never_frees_a_slot_a_graph_reads_through_a_float_workspace(
    fake_cuda: dict[str, Any], dtype: torch.dtype
) -> None:
    """The captured kernel reads ``expert_t`` through a pointer table laid out in a small workspace whose
    dtype is floating point (a generic scratch arena; half/bf16 workspaces are common). The scan now reads every
    integer/byte storage of at most 1 MiB for pointers, but a float one neither is read nor makes the scan
    incomplete (``_kernelscan.attribute``: ``_integer_storage_bytes`` returns None): ``truth()`` says "fully
    known".

    Promise: COMMITTED never while a graph reads freed memory. With ``unread="skip"`` ``expert_t`` is judged
    unread, its captured storage is let go (freed) and the reload commits."""
    layer = Grouped(torch.zeros(64, dtype=dtype))
    _load_grouped(layer, 0)
    layer.table.view(torch.int64)[0] = layer.expert_t.data_ptr()  # the table the kernel dereferences
    contract = GraphContract(layer, "strict", unread="skip").seal()
    fake_cuda["table"] = {"root": 1, "graphs": {"1": [kernel_row(layer.read_t, layer.table)]}}
    with record_capture(contract, name="g", graph=FakeGraph()):
        pass
    read_by_graph = weakref.ref(layer.expert_t.untyped_storage())
    with contract.reload() as txn:
        _load_grouped(layer, 1)
    outcome = txn.outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert read_by_graph() is not None, (
            f"COMMITTED (slots_skipped={outcome.slots_skipped}), but the storage of expert_t that the kernel reads "
            "through its workspace's pointer table was freed: replay reads freed memory"
        )


# -- 5. Attribute transfer: an attribute PWAL no longer hangs on the new tensor stays on the captured one ----------
class ZeroPointLayer(nn.Module):
    """PWAL hangs a zero point on ``w_t`` only for asymmetric weights (a data-dependent attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        weight = self.weight.detach()
        w_t = weight * 2
        if bool((weight < 0).any()):
            w_t.zero = weight.amin().reshape(1)
        self.w_t = w_t
        register_derived(self, "w_t")


def _load_zero(layer: ZeroPointLayer, values: torch.Tensor) -> None:
    with torch.no_grad():
        layer.weight.copy_(values)
        layer.process_weights_after_loading()


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_rebind_does_not_bring_back_an_attribute_pwal_no_longer_sets(mode: str, detect: str) -> None:
    """The first load's PWAL hangs ``w_t.zero`` on its derived tensor; the reload's weights are symmetric,
    so PWAL's new ``w_t`` carries no ``zero``. ``rebind`` transfers attributes with ``__dict__.update`` and only
    when the new tensor has any (``if current.__dict__``): the captured ``w_t`` is bound back still carrying the
    old ``zero``.

    Promise (the one tests/collectors/test_undeclared_tensors.py holds the transfer to): after the reload the model
    resolves, at every path, what a cold model built on the new weights holds; a cold model has no ``w_t.zero`` (a
    forward doing ``getattr(self.w_t, "zero", None)`` applies the stale zero point)."""
    layer = ZeroPointLayer()
    _load_zero(layer, torch.linspace(-1.0, 1.0, N))
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    new = torch.linspace(1.0, 2.0, N)
    with contextlib.suppress(ContractViolation), contract.reload():
        _load_zero(layer, new)
    outcome = contract.last_outcome
    assert outcome is not None
    cold = ZeroPointLayer()
    _load_zero(cold, new)
    assert getattr(cold.w_t, "zero", None) is None
    stale = getattr(layer.w_t, "zero", None)
    assert stale is None, (
        f"{outcome.status.name}: the model's w_t.zero resolves to {stale.tolist()} (the first load's), PWAL made no "
        "zero point for these weights"
    )


# -- 6. serving_safe while the outcome listeners run ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recapture", "strict"])
def test_serving_safe_is_false_for_a_failed_reload_while_its_listeners_run(mode: str) -> None:
    """An ``on_outcome`` listener (an eval hook, a metrics probe) asks ``contract.serving_safe`` before
    replaying the graph, on a reload that did NOT commit (a respecified declared slot).

    Promise: ``serving_safe`` is "whether replaying the captured graphs is known to read the right memory"; never
    True while a reload's memory is known to be wrong. ``_settle`` clears ``_active`` in its ``finally`` before the
    agreement and the listeners run, and ``_apply`` (which marks the contract unsafe) runs only after them: inside
    the listener the contract calls replay safe for an outcome that says it is not."""
    net = _flat()
    contract = GraphContract(net, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    heard: list[tuple[Status, bool]] = []
    contract.on_outcome(lambda outcome: heard.append((outcome.status, contract.serving_safe)))
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(10 + index))
            layer.process_weights_after_loading()
        net.layers[0].w_t = net.layers[0].w_t[:3].clone()  # respecified: no copy can restore it
    assert heard and heard[0][0] is not Status.COMMITTED
    assert not heard[0][1], f"the listener heard {heard[0][0].value} while contract.serving_safe was True"


# -- 7. Inference tensors inside a wrapper subclass: the refusal covers only plain tensors --------------------------
class _Quantized(torch.Tensor):
    """A torchao-style wrapper subclass: int8 ``qdata`` and a float ``scale``."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> _Quantized:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, qdata.shape, dtype=torch.float32, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata = qdata
        self.scale = scale

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> _Quantized:
        return _Quantized(inner["qdata"], inner["scale"])

    def __repr__(self) -> str:  # type: ignore[override]
        return "_Quantized()"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        if func is torch.ops.aten.detach.default:
            (self,) = args
            return _Quantized(self.qdata, self.scale)

        def plain(x: Any) -> Any:
            return x.qdata.float() * x.scale if isinstance(x, _Quantized) else x

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


class WrapperLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        weight = self.weight.detach()
        self.cur = _Quantized((weight.round().to(torch.int64) % 50).to(torch.int8), weight[:1] / 7.0)


def test_a_wrapper_whose_inner_tensors_are_inference_tensors_is_restored_not_crashed() -> None:
    """The engine ran the first PWAL under ``torch.inference_mode()``, so the captured wrapper's inner
    tensors are inference tensors; the reload runs under ``no_grad`` (as the plain-tensor test in
    tests/contract/test_layerwise.py does).

    Promise: never torch's raw error ("Inplace update to inference tensor outside InferenceMode") out of
    graphsafe's internals: the wrapper's inner tensors are restored in place (under inference mode), holding the new
    values at the captured addresses, or the outcome says why not."""
    model = WrapperLayer()
    with torch.inference_mode():
        model.process_weights_after_loading()
    assert model.cur.qdata.is_inference()
    captured = model.cur
    pointers = (captured.qdata.data_ptr(), captured.scale.data_ptr())
    contract = GraphContract(model, "recapture").seal()
    try:
        with contract.reload() as txn, torch.no_grad():
            model.weight.copy_(w(5))
            model.process_weights_after_loading()
    except RuntimeError as exc:
        if not isinstance(exc, GraphSafeError):
            pytest.fail(f"the reload crashed inside graphsafe with torch's raw error: {exc!r}")
        raise
    assert txn.outcome is not None
    if txn.outcome.status is Status.COMMITTED:
        cold = WrapperLayer()
        with torch.no_grad():
            cold.weight.copy_(w(5))
        cold.process_weights_after_loading()
        assert model.cur is captured and (captured.qdata.data_ptr(), captured.scale.data_ptr()) == pointers
        assert torch.equal(captured.qdata, cold.cur.qdata) and torch.equal(captured.scale, cold.cur.scale)


# ================================================================================================================
# FALSE ALARMS on legitimate reloads
# -- 3b. ClosedLayer: slots the restore left on their new tensors, permuted by PWAL run again ---------------------
class _Tagged(torch.Tensor):
    """A subclass: a tensor of it taking a plain slot's place cannot be copied into the captured one (respecified)."""


class RotatingLayer(nn.Module):
    """Each reload-time PWAL rotates the tensor objects of ``a``, ``b`` and ``c`` (``a`` takes ``b``'s, ``b``
    ``c``'s, ``c`` ``a``'s) and writes each one's own values in place (``a`` and ``b`` compute the same values, in
    two classes); ``b_view``, a view of ``b``, is made once (a "processed already" guard skips it afterwards)."""

    def __init__(self, inference: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.inference = inference
        self.built = False

    @graph_visible("a", "b_view")
    def process_weights_after_loading(self) -> None:
        with torch.inference_mode() if self.inference else contextlib.nullcontext(), torch.no_grad():
            if not self.built:
                self.a = self.weight * 3.0
                self.b = (self.weight * 3.0).as_subclass(_Tagged)
                self.c = self.weight * 4.0
                self.b_view = self.b.view(-1)
                self.built = True
            else:
                self.a, self.b, self.c = self.b, self.c, self.a
                self.a.copy_(self.weight * 3.0)
                self.b.copy_(self.weight * 3.0)
                self.c.copy_(self.weight * 4.0)
        register_derived(self, "c")


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("mode", MODES)
def test_slots_left_on_new_tensors_and_rotated_again_after_after_layer_are_not_left_to_a_recapture(
    mode: str, inference: bool
) -> None:
    """The first pass rotates the layer's tensors (``a`` takes ``b``'s subclass tensor: respecified, so
    the restore leaves all three on their new tensors, the layer a recapture; the weight is not reloaded, so ``b``'s
    memory got ``a``'s values, the same as its own, and ``b_view`` still reads right); PWAL runs again after
    ``after_layer()`` and rotates them once more, writing each in place. ``b_view`` still views the memory that
    ``b`` held at the capture, now ``c``'s tensor with ``c``'s values. Under inference mode no version counter shows
    the writes.

    Promise: NEEDS_RECAPTURE only if a recapture (of the model as it is) reads what a cold model computes: here
    ``b_view`` would read ``c``'s values, so the reload must fail."""
    model = RotatingLayer(inference)
    model.process_weights_after_loading()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=True) as txn:
        txn.before_layer(model)  # a partial reload: this layer's weight is not in the shard
        model.process_weights_after_loading()
        txn.after_layer(model)
        model.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is not Status.COMMITTED, "COMMITTED, but the layer's captured tensors were rotated"
    if outcome.status is Status.NEEDS_RECAPTURE:
        assert torch.equal(model.b_view, w(1) * 3.0), (
            f"NEEDS_RECAPTURE, but a recapture reads b_view = {model.b_view.tolist()}; a cold model's b is "
            f"{(w(1) * 3.0).tolist()}"
        )


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)

    @graph_visible("a", "b")
    def process_weights_after_loading(self) -> None:
        self.a = self.weight * 2
        self.b = self.weight * 3


@pytest.mark.parametrize("how", ["objects", "swap_tensors", "data"])
def test_two_restored_slots_whose_memory_is_swapped_after_after_layer_are_stale(how: str) -> None:
    """After ``after_layer()`` restored ``a`` and ``b``, their memory is exchanged (the objects, their
    memory through ``torch.utils.swap_tensors``, or ``.data``): each captured address now holds the other's values.
    A recapture would read the values of two passes, so the reload must fail, not ask for one."""
    layer = _Pair()
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture").seal()
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=True) as txn:
        txn.before_layer(layer)
        with torch.no_grad():
            layer.weight.copy_(w(2))
        layer.process_weights_after_loading()
        txn.after_layer(layer)
        if how == "objects":
            layer.a, layer.b = layer.b, layer.a
        elif how == "swap_tensors":
            torch.utils.swap_tensors(layer.a, layer.b)
        else:
            layer.a.data, layer.b.data = layer.b.data, layer.a.data
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.FAILED, [(f.kind.value, f.path) for f in outcome.problems]


# ================================================================================================================


# -- 8. Inference mode: the loader runs under inference_mode(), the transaction's restore does not ----------------
class InfLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), requires_grad=False)

    @graph_visible("w_t")
    def process_weights_after_loading(self) -> None:
        self.w_t = (self.weight * 2).contiguous()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_load_run_under_inference_mode_inside_the_transaction_commits(layerwise: bool) -> None:
    """Legitimate: the engine made its derived tensors under ``torch.inference_mode()`` (its load and warm-up run
    there), and the RL step wraps its load the same way, inside the reload transaction:
    ``with contract.reload(): with torch.inference_mode(): load()`` (or the adapter's after_layer hook runs outside
    the loader's inference-mode block).

    Expected: COMMITTED with the new values at the captured address. Observed: ``moved`` / NEEDS_RECAPTURE on every
    reload, because the copy happens in ``finish()``/``after_layer()``, outside inference mode, and
    ``LayerSnapshot.restore`` refuses instead of entering inference mode for the copy itself (a copy into an
    inference tensor is allowed under ``torch.inference_mode()``, and so is one into a normal tensor)."""
    model = InfLayer()
    with torch.inference_mode():
        model.process_weights_after_loading()
    captured = model.w_t
    contract = GraphContract(model, "recapture").seal()
    new = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    with contract.reload(layerwise=layerwise) as txn:
        if layerwise:
            txn.before_layer(model)
        with torch.inference_mode():
            model.weight.copy_(new)
            model.process_weights_after_loading()
        if layerwise:
            txn.after_layer(model)
    outcome = txn.outcome
    assert outcome is not None
    assert outcome.status is Status.COMMITTED, [f.detail for f in outcome.findings]
    assert model.w_t is captured and torch.equal(captured, new * 2)


# -- 9. Attribute transfer: an attribute that is another declared slot's tensor -----------------------------------
class ScaledLayer(nn.Module):
    """PWAL makes a scale (declared ``w_scale``) and hangs the same tensor on the declared ``w_t`` as ``w_t.scale``,
    which the forward reads (the scale travels with the weight, as quantized-tensor kernels expect)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        weight = self.weight.detach()
        scale = weight.abs().amax().reshape(1)
        w_t = weight * 2
        w_t.scale = scale
        self.w_t = w_t
        self.w_scale = scale
        register_derived(self, "w_t")
        register_derived(self, "w_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w_t * self.w_t.scale


def test_an_attribute_that_is_another_declared_slot_keeps_pointing_at_its_captured_tensor() -> None:
    """Legitimate: ``w_t.scale is w_scale``, both declared, the capture recorded (declared-only + manifest). Before
    the attribute transfer this committed (the captured ``w_t`` kept its attribute: the captured ``w_scale``, which
    the restore refreshed). Now ``rebind`` copies the NEW tensor's ``__dict__`` onto the captured ``w_t``, so
    ``w_t.scale`` becomes PWAL's new scale tensor (not the captured one the restore rebinds at ``w_scale``): the
    manifest sees the graph-read path leave its captured storage (``orphaned``) and the reload needs a recapture,
    and the model no longer has ``w_t.scale is w_scale`` as a cold model does."""
    layer = ScaledLayer()
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    x = torch.randn(N)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        layer(x)
    with contract.reload() as txn, torch.no_grad():
        layer.weight.copy_(torch.randn(N))
        layer.process_weights_after_loading()
    outcome = txn.outcome
    assert outcome is not None
    assert layer.w_t.scale is layer.w_scale, "w_t.scale no longer is the (captured) w_scale a cold model aliases"
    assert outcome.status is Status.COMMITTED, [(f.kind.value, f.path, f.detail[:100]) for f in outcome.findings]


# -- 10. Kernel scan: every int32/int8 weight over 1 MiB switches unread="skip" off ---------------------------------
class QuantLayer(nn.Module):
    """A GPTQ/AWQ/W8A8-style layer: a packed int32 weight (2 MiB) the kernel reads, plus two derived tensors, one
    of which no graph reads."""

    def __init__(self) -> None:
        super().__init__()
        self.qweight = nn.Parameter(torch.zeros(512, 1024, dtype=torch.int32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

    @graph_visible("read_t", "unread_t")
    def process_weights_after_loading(self) -> None:
        self.read_t = (self.scale * 2).contiguous()
        self.unread_t = (self.scale + 1).contiguous()


def test_a_quantized_int_weight_over_1mib_does_not_switch_skip_off(fake_cuda: dict[str, Any]) -> None:
    """Legitimate: a quantized model (int32 packed weights, a few MiB each: every GPTQ/AWQ/Marlin/int8 model) captured
    with the kernel scan and ``unread="skip"``. Before the last commits the scan read only int64/uint64 tables; now
    every integer storage over 1 MiB that a kernel points at makes the scan ``incomplete``, so ``truth()`` is never
    None for such a model and nothing is ever skipped (``skip_refused`` names the weight). A loaded weight is
    checkpoint data, never a pointer table: the feature is silently off for the models it targets."""
    layer = QuantLayer()
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "strict", unread="skip").seal()
    fake_cuda["table"] = {"root": 1, "graphs": {"1": [kernel_row(layer.read_t, layer.qweight)]}}
    with record_capture(contract, name="g", graph=FakeGraph()):
        pass
    with contract.reload() as txn, torch.no_grad():
        layer.scale.copy_(torch.full((4,), 3.0))
        layer.process_weights_after_loading()
    outcome = txn.outcome
    assert outcome is not None and outcome.status is Status.COMMITTED
    assert outcome.skip_refused is None, outcome.skip_refused
    assert outcome.slots_skipped == 1


# -- 11. _reads_no_copy_reached: bytes the graph reads past a slot that are the same in old and new --------------
class PaddedLayer(nn.Module):
    """PWAL writes the weight into a buffer with a zero tail (alignment padding a vectorised kernel reads past the
    logical tensor); the slot is the logical view, the kernel reads the whole aligned buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, N), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        buf = torch.zeros(4 * N + 16)
        buf[: 4 * N] = (self.weight.detach() * 2).flatten()
        self.w_t = buf[: 4 * N].view(4, N)
        register_derived(self, "w_t")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.w_t.reshape(-1).as_strided((4 * N + 16,), (1,), self.w_t.storage_offset())
        return x @ full[: 4 * N].view(4, N).t() + full[4 * N :].sum()


@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
def test_padding_a_kernel_reads_past_a_slot_that_no_reload_changes_is_not_stale(detect: str) -> None:
    """Legitimate: the graph reads 16 zero padding elements past the declared slot; every load writes the same
    zeros there, so the captured buffer holds exactly what a cold model's does. ``_reads_no_copy_reached`` flags any
    recorded byte no copy or path covers without looking at its values: ``stale`` and FAILED on every reload."""
    layer = PaddedLayer()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, N, generator=generator))
        layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture", detect=detect).seal()  # type: ignore[arg-type]
    x = torch.randn(2, N)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        layer(x)
    captured = layer.w_t  # (not its storage object: a caller holding that looks like a storage pool, fail closed)
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        layer.weight.copy_(torch.randn(4, N, generator=generator))
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None
    cold = torch.zeros(4 * N + 16)
    cold[: 4 * N] = (layer.weight.detach() * 2).flatten()
    held = torch.frombuffer(bytearray(bytes(captured.untyped_storage())), dtype=torch.float32)
    assert torch.equal(held, cold)  # every byte the graph reads is right
    assert outcome.status is Status.COMMITTED, [(f.kind.value, f.detail[:100]) for f in outcome.findings]


# -- 12. sealed-paths + manifest: a lazily built weight-independent table, initial load recorded -----------------
class RopeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.w2 = self.weight.detach() * 2
        register_derived(self, "w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_cos_sin", None) is None:
            self._cos_sin = torch.cos(torch.arange(N, dtype=torch.float32))  # built on first use, no weight in it
        return x * self.w2 + self._cos_sin


class RopeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RopeLayer(), RopeLayer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _load_rope(model: RopeModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.copy_(torch.randn(N, generator=generator))
            layer.process_weights_after_loading()


@pytest.mark.parametrize("detect", ["sealed-paths", "declared-only"])
def test_a_lazily_built_static_table_commits_once_declared_static(detect: str) -> None:
    """Legitimate: a rotary table built lazily by the warm-up forward (after seal, before capture), never touched
    by PWAL; the initial load is recorded with ``record_inputs()`` (the README's remedy for tables that are really
    fixed), but the table did not exist then, so no recording vouches for it. The first reload reports it
    ``stale``; the way out is the one its finding names, a ``static=True`` declaration.

    This test used to let the failed reload's own recording teach that ``_cos_sin`` is a
    fixed table, so that after a recapture and reseal reloads committed with no declaration. That recording cannot
    tell a fixed table from a tensor PWAL's skip guard wrongly left (the same reload reports both ``stale``), and
    the lesson made the guard bug commit its old values from then on
    (``tests/contract/test_transaction_sequences.py::test_a_reload_that_found_an_undeclared_tensor_stale_does_not_teach_that_it_is_a_fixed_table``)."""
    model = RopeModel()
    contract = GraphContract(model, "recapture", detect=detect)  # type: ignore[arg-type]
    with contract.record_inputs():
        _load_rope(model, 0)
    contract.seal()
    x = torch.randn(N)
    with torch.no_grad():
        model(x)  # warm-up
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        model(x)
    # The first reload after the warm-up: nothing recorded says PWAL never computes ``_cos_sin`` (it appeared after
    # the one recording), and the weights changed under it: fail closed, and record this reload's PWAL.
    with contextlib.suppress(ContractViolation), contract.reload():
        _load_rope(model, 1)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.FAILED
    assert {(f.kind, f.path) for f in outcome.problems} == {(FindingKind.STALE, "_cos_sin")}
    # The author checks it is a fixed table, declares it so, and takes the graphs again: reloads commit.
    for layer in model.layers:
        register_derived(layer, "_cos_sin", static=True)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        model(x)
    contract.reseal()
    for seed in (2, 3):
        with contextlib.suppress(ContractViolation), contract.reload():
            _load_rope(model, seed)
        outcome = contract.last_outcome
        assert outcome is not None
        assert outcome.status is Status.COMMITTED, (seed, [(f.kind.value, f.layer, f.path) for f in outcome.findings])
