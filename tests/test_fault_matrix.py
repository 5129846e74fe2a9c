"""The fault matrix (docs/fault-matrix.md): every fault kind, injected, in every mode, with the outcome it gets.

One test per row of the matrix, parametrized over the three modes; ``EXPECTED`` holds each cell's outcome and
:func:`test_the_doc_names_an_outcome_and_a_collected_test_in_every_cell` checks that the document says the same
thing and names test ids that exist, so the document cannot rot.

Every reload loads DIFFERENT weights (another seed). In ``recapture`` and ``migrate`` a recapture callback stands
in for the engine's capture, so ``NEEDS_RECAPTURE`` is followed through to the automatic reseal.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import (
    DeclarationError,
    DeclaredDriftError,
    FindingKind,
    GraphContract,
    NotServingSafeError,
    ReloadFailedError,
    ReloadOutcome,
    Status,
    UndeclaredDriftError,
    graph_visible,
    register_derived,
    stable_empty,
)
from graphsafe.collectors import record_capture
from graphsafe.devices import WalkBudget
from graphsafe.outcome import Origin
from graphsafe.paths import SlotPath
from graphsafe.testing.zoo import EXAMPLES, Example, ZooModel

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "fault-matrix.md"
MODES = ("strict", "recapture", "migrate")


# ----------------------------------------------------------------------------------------------------
# Expected outcome of every cell
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """A cell: the reload's status (``None``: refused before any reload began) and the exception it raises."""

    status: Status | None
    raises: type[BaseException] | None = None


COMMITTED = Expect(Status.COMMITTED)
RECAPTURE = Expect(Status.NEEDS_RECAPTURE)


def failed(error: type[BaseException]) -> Expect:
    return Expect(Status.FAILED, error)


def refused(error: type[BaseException]) -> Expect:
    return Expect(None, error)


def per_mode(strict: Expect, recapture: Expect, migrate: Expect) -> dict[str, Expect]:
    return {"strict": strict, "recapture": recapture, "migrate": migrate}


def same(expect: Expect) -> dict[str, Expect]:
    return per_mode(expect, expect, expect)


DRIFT = per_mode(failed(DeclaredDriftError), RECAPTURE, RECAPTURE)
UNDECLARED = per_mode(failed(UndeclaredDriftError), RECAPTURE, RECAPTURE)

#: Test function -> mode -> outcome. The document's table must agree cell by cell.
EXPECTED: dict[str, dict[str, Expect]] = {
    "test_moved_declared": same(COMMITTED),
    "test_moved_undeclared": per_mode(failed(UndeclaredDriftError), RECAPTURE, COMMITTED),
    "test_dead": DRIFT,
    "test_respecified_shape": DRIFT,
    "test_respecified_dtype": DRIFT,
    "test_respecified_stride": DRIFT,
    "test_respecified_offset": DRIFT,
    "test_respecified_read_bits": DRIFT,
    # A declared path that is gone blocks the automatic reseal too (it cannot be fingerprinted).
    "test_vanished": per_mode(
        failed(DeclaredDriftError),
        Expect(Status.NEEDS_RECAPTURE, DeclarationError),
        Expect(Status.NEEDS_RECAPTURE, DeclarationError),
    ),
    "test_alias_broken": DRIFT,
    "test_view_relation_broken": DRIFT,
    "test_object_replaced": same(COMMITTED),
    "test_parameter_replaced": same(COMMITTED),
    "test_stale_value": same(failed(ReloadFailedError)),
    "test_exception_mid_pwal": same(failed(RuntimeError)),
    "test_lazily_allocated": UNDECLARED,
    "test_module_level_cache": UNDECLARED,
    "test_walker_budget_exhausted": UNDECLARED,
    "test_untrackable": UNDECLARED,
    "test_tuple_keyed_cache": per_mode(failed(UndeclaredDriftError), RECAPTURE, COMMITTED),
    "test_declared_path_never_resolves": same(refused(DeclarationError)),
    "test_reload_when_not_serving_safe": same(refused(NotServingSafeError)),
    "test_pwal_again_after_after_layer": DRIFT,
    "test_weight_written_after_after_layer": same(failed(ReloadFailedError)),
}


@dataclass
class Run:
    """What one attempted reload did: the outcome the contract recorded and what was raised."""

    contract: GraphContract
    outcome: ReloadOutcome | None
    error: BaseException | None
    recaptures: list[ReloadOutcome]

    def check(self, test: str, mode: str) -> None:
        expect = EXPECTED[test][mode]
        if expect.raises is None:
            assert self.error is None, f"unexpected {self.error!r}"
        else:
            assert isinstance(self.error, expect.raises), f"expected {expect.raises.__name__}, got {self.error!r}"
        if expect.status is None:
            assert self.outcome is None, "a reload ran although it should have been refused"
            return
        assert self.outcome is not None
        assert self.outcome.status is expect.status, self.outcome.summary()
        assert self.outcome.mode == mode
        if expect.status is Status.COMMITTED:
            assert self.contract.serving_safe and self.recaptures == []
        elif expect.status is Status.NEEDS_RECAPTURE:
            assert [o.status for o in self.recaptures] == [Status.NEEDS_RECAPTURE]  # the callback ran once
            assert self.contract.serving_safe is (expect.raises is None)  # resealed, unless the reseal raised
        else:
            assert self.recaptures == [] and not self.contract.serving_safe
            with pytest.raises(NotServingSafeError), self.contract.reload():
                pass  # fail closed: no further reload until reseal()

    def kinds(self, layer: str | None = None) -> dict[str, FindingKind]:
        """``path -> kind`` of the problems (of one layer when given)."""
        assert self.outcome is not None
        return {f.path: f.kind for f in self.outcome.problems if layer is None or f.layer == layer}


#: Violations raised by the contract itself: each carries the outcome it recorded.
VIOLATIONS = (DeclaredDriftError, UndeclaredDriftError, ReloadFailedError)


def attempt(
    contract: GraphContract,
    body: Callable[[], Any],
    *,
    recapture: Callable[[], Any] | None = None,
    layerwise: Callable[[Any], Any] | None = None,
) -> Run:
    """Reload under ``contract`` running ``body`` (or ``layerwise(transaction)`` in a layerwise reload); record the
    outcome and the exception instead of raising."""
    recaptures: list[ReloadOutcome] = []

    def on_recapture(outcome: ReloadOutcome) -> None:
        recaptures.append(outcome)
        if recapture is not None:
            recapture()

    contract.on_recapture(on_recapture)
    before = contract.reloads
    error: BaseException | None = None
    try:
        if layerwise is not None:
            with contract.reload(layerwise=True) as transaction:
                layerwise(transaction)
        else:
            with contract.reload():
                body()
    except Exception as exc:
        error = exc
    outcome = contract.last_outcome if contract.reloads > before else None
    if isinstance(error, VIOLATIONS):
        assert error.outcome is outcome
    return Run(contract, outcome, error, recaptures)


# ----------------------------------------------------------------------------------------------------
# A layer with every kind of declared slot: plain, aliased, a view at an offset, on a rebuilt object, static
# ----------------------------------------------------------------------------------------------------

IN, OUT, WORKSPACE = 6, 4, 8
DECLARED = ("w_t", "scale", "quant_method.kernel.scale", "packed", "packed_tail", "quant_method.experts.w1_scale")


class Kernel:
    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None


class Experts:
    """Rebuilt by every PWAL (as vLLM rebuilds ``fused_experts``)."""

    def __init__(self, w1_scale: torch.Tensor) -> None:
        self.w1_scale = w1_scale


class SiteMethod:
    """The quant method: PWAL re-creates every derived tensor (and the experts object) on every load."""

    def __init__(self) -> None:
        self.kernel = Kernel()
        self.experts: Experts | None = None

    @graph_visible(*DECLARED, derived_from="weight")
    def process_weights_after_loading(self, layer: Site) -> None:
        w = layer.weight.detach()
        if layer.fault == "skip-w_t" and hasattr(layer, "w_t"):
            pass  # "already processed": the don't-rebuild-on-reload guard
        else:
            layer.w_t = w.t().contiguous()
        if layer.fault == "raise":
            raise RuntimeError(f"PWAL of {type(layer).__name__} failed halfway")
        scale = w.abs().amax(dim=1)
        layer.scale = scale
        self.kernel.scale = scale  # two declared paths, one tensor
        packed = torch.cat([w.sum(0), w.sum(1)])
        layer.packed = packed
        layer.packed_tail = packed[IN:]  # a view of `packed` at an offset
        self.experts = Experts(w.abs().sum(1))
        layer.workspace = stable_empty(layer, "workspace", (WORKSPACE,), w.dtype, w.device, zero=True)


class Site(nn.Module):
    w_t: torch.Tensor
    scale: torch.Tensor
    packed: torch.Tensor
    packed_tail: torch.Tensor
    workspace: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(OUT, IN), requires_grad=False)
        self.quant_method = SiteMethod()
        self.fault: str | None = None


class SiteModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Site(), Site()])


def load(model: SiteModel, seed: int) -> None:
    """Upstream reload: values into the existing parameters in place, then PWAL on every layer."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        layer.weight.data.copy_(torch.randn(OUT, IN, generator=generator))
    for layer in model.layers:
        layer.quant_method.process_weights_after_loading(layer)


def build(seed: int = 0) -> SiteModel:
    model = SiteModel()
    load(model, seed)
    return model


def slot_tensors(model: SiteModel) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, path): SlotPath(path).resolve(layer)
        for i, layer in enumerate(model.layers)
        for path in (*DECLARED, "workspace")
    }


def addresses(model: SiteModel) -> dict[tuple[int, str], int]:
    return {key: t.data_ptr() for key, t in slot_tensors(model).items()}


def assert_values(model: SiteModel, seed: int, *, except_: Callable[[tuple[int, str]], bool] = lambda k: False) -> None:
    cold = slot_tensors(build(seed))
    for key, tensor in slot_tensors(model).items():
        if not except_(key):
            assert torch.equal(tensor, cold[key]), f"{key} does not hold the values of seed {seed}"


def site_contract(mode: str, **options: Any) -> tuple[SiteModel, GraphContract]:
    model = build(0)
    return model, GraphContract(model, mode, **options).seal()  # type: ignore[arg-type]


def faulty_reload(model: SiteModel, seed: int, fault: Callable[[Site], None]) -> Callable[[], None]:
    """A reload whose loader, after PWAL, does something to ``layers.1`` (the faulty layer)."""

    def body() -> None:
        load(model, seed)
        fault(model.layers[1])

    return body


def only_layer1(findings: dict[str, FindingKind], run: Run, expected: dict[str, FindingKind]) -> None:
    assert findings == expected
    assert run.outcome is not None
    assert {f.layer for f in run.outcome.problems} == {"layers.1"}


# ----------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_moved_declared(mode: str) -> None:
    model, contract = site_contract(mode)
    sealed = addresses(model)
    run = attempt(contract, lambda: load(model, 1))
    run.check("test_moved_declared", mode)
    assert run.outcome is not None and run.outcome.findings == ()
    assert run.outcome.slots_restored == 2 * len(DECLARED)  # every declared slot moved; the workspace did not
    assert addresses(model) == sealed
    assert_values(model, 1)


def _zoo(name: str, variant: str, mode: str, **options: Any) -> tuple[Example, ZooModel, GraphContract]:
    example = EXAMPLES[name]
    model = example.build(variant, seed=0)  # type: ignore[arg-type]
    example.forward(model, example.example_input(model))  # warm-up, as before a capture
    return example, model, GraphContract(model, mode, **options)  # type: ignore[arg-type]


def _zoo_reload(example: Example, model: ZooModel, seed: int) -> Callable[[], None]:
    return lambda: example.load_weights(model, example.make_weights(model, seed))


def _assert_zoo_matches_cold(example: Example, model: ZooModel, variant: str, seed: int) -> None:
    cold = example.build(variant, seed=seed)  # type: ignore[arg-type]
    x = example.example_input(model)
    assert torch.equal(example.forward(model, x), example.forward(cold, x))


@pytest.mark.parametrize("mode", MODES)
def test_moved_undeclared(mode: str) -> None:
    example, model, contract = _zoo("underscore_scales", "legacy", mode)
    contract.seal()
    paths = {"_fc2_input_scale", "_w_scale_inv"}
    sealed = {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots() if s.origin is Origin.WALKER}
    assert {p for _, p in sealed} == paths
    # Nothing declared: besides the walker's finds the seal tracks only the layers' own parameters.
    others = {(s.origin.value, s.path) for s in contract.slots() if s.origin is not Origin.WALKER}
    assert others == {("parameter", p) for p in ("weight", "weight_scale", "input_scale")}
    run = attempt(contract, _zoo_reload(example, model, 1))
    run.check("test_moved_undeclared", mode)
    assert run.outcome is not None
    if mode == "migrate":
        assert {(f.layer, f.path) for f in run.outcome.auto_restored} == set(sealed)
        now = {(q, p): getattr(model.get_submodule(q), p).data_ptr() for q, p in sealed}
        assert now == sealed
    else:
        assert {(f.layer, f.path) for f in run.outcome.problems} == set(sealed)
        assert {f.kind for f in run.outcome.problems} == {FindingKind.MOVED}
        assert not any(f.declared for f in run.outcome.problems)
    _assert_zoo_matches_cold(example, model, "legacy", 1)  # every mode leaves PWAL's values in the model


@pytest.mark.parametrize("mode", MODES)
def test_dead(mode: str) -> None:
    model, contract = site_contract(mode)
    load(model, 1)  # a reload outside the contract: the captured tensors lose their last reference
    gc.collect()
    assert not all(s.fingerprint.alive for s in contract.slots())
    run = attempt(contract, lambda: load(model, 2))
    run.check("test_dead", mode)
    assert set(run.kinds().values()) == {FindingKind.DEAD}
    assert {(f.layer, f.path) for f in run.outcome.problems} == {  # type: ignore[union-attr]
        (f"layers.{i}", p) for i in (0, 1) for p in DECLARED
    }
    assert_values(model, 2)


def _respecified(mode: str, test: str, fault: Callable[[Site], None], path: str, change: str) -> None:
    model, contract = site_contract(mode)
    injected: list[torch.Tensor] = []

    def inject(layer: Site) -> None:
        fault(layer)
        injected.append(getattr(layer, path))

    run = attempt(contract, faulty_reload(model, 1, inject))
    run.check(test, mode)
    only_layer1(run.kinds(), run, {path: FindingKind.RESPECIFIED})
    (finding,) = run.outcome.problems  # type: ignore[union-attr]
    assert change in finding.detail
    assert finding.after is not None and finding.before is not None and finding.after.key != finding.before.key
    assert getattr(model.layers[1], path) is injected[0]  # never copied into a layout it does not fit
    assert_values(model, 1, except_=lambda key: key == (1, path))


@pytest.mark.parametrize("mode", MODES)
def test_respecified_shape(mode: str) -> None:
    def shrink(layer: Site) -> None:
        layer.w_t = layer.w_t[:3]

    _respecified(mode, "test_respecified_shape", shrink, "w_t", "shape [6, 4] -> [3, 4]")


@pytest.mark.parametrize("mode", MODES)
def test_respecified_dtype(mode: str) -> None:
    def widen(layer: Site) -> None:
        layer.w_t = layer.w_t.double()

    _respecified(mode, "test_respecified_dtype", widen, "w_t", "dtype torch.float32 -> torch.float64")


@pytest.mark.parametrize("mode", MODES)
def test_respecified_stride(mode: str) -> None:
    def column_major(layer: Site) -> None:
        layer.w_t = layer.weight.detach().clone().t()  # same shape and values, transposed layout

    _respecified(mode, "test_respecified_stride", column_major, "w_t", "stride [4, 1] -> [1, 6]")


@pytest.mark.parametrize("mode", MODES)
def test_respecified_offset(mode: str) -> None:
    def inside_a_bigger_buffer(layer: Site) -> None:
        buffer = torch.zeros(IN * OUT + 2)
        buffer[2:].copy_(layer.w_t.reshape(-1))
        layer.w_t = buffer[2:].view(IN, OUT)  # same shape, stride and values, storage offset 2

    _respecified(mode, "test_respecified_offset", inside_a_bigger_buffer, "w_t", "offset 0 -> 2")


@pytest.mark.parametrize("mode", MODES)
def test_respecified_read_bits(mode: str) -> None:
    def lazily_negated(layer: Site) -> None:
        layer.w_t = torch._neg_view(-layer.w_t)  # the same values, read through a neg bit from negated bytes

    _respecified(mode, "test_respecified_read_bits", lazily_negated, "w_t", "conj/neg bits none -> neg")


@pytest.mark.parametrize("mode", MODES)
def test_vanished(mode: str) -> None:
    model, contract = site_contract(mode)

    def drop(layer: Site) -> None:
        del layer.w_t

    run = attempt(contract, faulty_reload(model, 1, drop))
    run.check("test_vanished", mode)
    only_layer1(run.kinds(), run, {"w_t": FindingKind.VANISHED})
    if run.error is not None and mode != "strict":
        assert "w_t" in str(run.error) and "layers.1" in str(run.error)  # the reseal names what blocks it
    with pytest.raises(NotServingSafeError, match="recapture the graphs"):
        contract.reseal()  # no capture since the reload (or the automatic reseal) failed
    contract.note_capture()
    with pytest.raises(DeclarationError):
        contract.reseal()
    model.layers[1].quant_method.process_weights_after_loading(model.layers[1])  # PWAL puts it back
    with pytest.raises(NotServingSafeError):
        contract.reseal()  # the capture saw the model without it: capture the fixed model
    contract.note_capture()
    assert contract.reseal().serving_safe


@pytest.mark.parametrize("mode", MODES)
def test_alias_broken(mode: str) -> None:
    # scale and kernel.scale were one captured tensor; now PWAL gives them different values.
    model, contract = site_contract(mode)

    def split(layer: Site) -> None:
        layer.quant_method.kernel.scale = layer.scale * 2

    run = attempt(contract, faulty_reload(model, 1, split))
    run.check("test_alias_broken", mode)
    kinds = run.kinds()
    assert set(kinds.values()) == {FindingKind.ALIAS_BROKEN}
    assert set(kinds) <= {"scale", "quant_method.kernel.scale"} and len(kinds) == 1
    # Each path keeps the values PWAL produced for it (never the other alias's copy).
    cold = slot_tensors(build(1))
    layer = model.layers[1]
    assert torch.equal(layer.scale, cold[(1, "scale")])
    assert torch.equal(layer.quant_method.kernel.scale, cold[(1, "scale")] * 2)


@pytest.mark.parametrize("mode", MODES)
def test_view_relation_broken(mode: str) -> None:
    # packed_tail was a view into packed; now it is a view into another tensor with other values (same layout).
    model, contract = site_contract(mode)

    def other_base(layer: Site) -> None:
        w = layer.weight.detach()
        layer.packed_tail = torch.cat([w.sum(0), w.sum(1) + 1])[IN:]

    run = attempt(contract, faulty_reload(model, 1, other_base))
    run.check("test_view_relation_broken", mode)
    kinds = run.kinds()
    assert set(kinds.values()) == {FindingKind.ALIAS_BROKEN} and set(kinds) <= {"packed", "packed_tail"}
    cold = slot_tensors(build(1))
    assert torch.equal(model.layers[1].packed, cold[(1, "packed")])
    assert torch.equal(model.layers[1].packed_tail, cold[(1, "packed_tail")] + 1)


@pytest.mark.parametrize("mode", MODES)
def test_object_replaced(mode: str) -> None:
    # vLLM's CutlassExpertsFp8: PWAL builds a NEW fused_experts object; restore must go through the new object.
    example, model, contract = _zoo("cutlass_moe_strides", "migrated", mode)
    contract.seal()
    sealed = {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots()}
    experts = [layer.quant_method.moe_kernel.fused_experts for layer in example.layers(model)]
    run = attempt(contract, _zoo_reload(example, model, 1))
    run.check("test_object_replaced", mode)
    for i, layer in enumerate(example.layers(model)):
        assert layer.quant_method.moe_kernel.fused_experts is not experts[i]  # really rebuilt
        for path in example.slot_paths:
            assert SlotPath(path).resolve(layer).data_ptr() == sealed[(f"layers.{i}", path)]
    _assert_zoo_matches_cold(example, model, "migrated", 1)


@pytest.mark.parametrize("mode", MODES)
def test_parameter_replaced(mode: str) -> None:
    # A loader that binds a new Parameter (``layer.weight = nn.Parameter(new)``) instead of copying into the
    # captured one: the graph reads the old weight unless the contract copies the values back and rebinds it.
    model, contract = site_contract(mode)
    sealed = addresses(model)
    captured = model.layers[1].weight
    ptr = captured.data_ptr()

    def body() -> None:
        generator = torch.Generator().manual_seed(1)
        for layer in model.layers:
            value = torch.randn(OUT, IN, generator=generator)
            if layer is model.layers[1]:
                layer.weight = nn.Parameter(value, requires_grad=False)
                assert layer.weight is not captured
            else:
                layer.weight.data.copy_(value)
        for layer in model.layers:
            layer.quant_method.process_weights_after_loading(layer)

    run = attempt(contract, body)
    run.check("test_parameter_replaced", mode)
    assert run.outcome is not None and run.outcome.findings == ()
    assert run.outcome.slots_restored == 2 * len(DECLARED) + 1  # the declared slots, and the replaced weight
    assert model.layers[1].weight is captured and captured.data_ptr() == ptr
    assert addresses(model) == sealed
    assert_values(model, 1)  # the same values as the upstream in-place load of seed 1


def layer_by_layer(model: SiteModel, seed: int, after: Callable[[Site], None]) -> Callable[[Any], None]:
    """A layerwise reload of ``model`` (before, load, PWAL, after, per layer) that then does ``after`` to
    ``layers.1``, which its ``after_layer()`` restored already, before the reload finishes."""

    def body(transaction: Any) -> None:
        generator = torch.Generator().manual_seed(seed)
        for layer in model.layers:
            transaction.before_layer(layer)
            layer.weight.data.copy_(torch.randn(OUT, IN, generator=generator))
            layer.quant_method.process_weights_after_loading(layer)
            transaction.after_layer(layer)
        after(model.layers[1])

    return body


@pytest.mark.parametrize("mode", MODES)
def test_pwal_again_after_after_layer(mode: str) -> None:
    model, contract = site_contract(mode)
    sealed = addresses(model)

    def pwal_again(layer: Site) -> None:
        layer.quant_method.process_weights_after_loading(layer)

    run = attempt(contract, lambda: None, layerwise=layer_by_layer(model, 1, pwal_again))
    run.check("test_pwal_again_after_after_layer", mode)
    moved = {path: FindingKind.MOVED for path in DECLARED}
    only_layer1(run.kinds(), run, moved)
    assert {k: v for k, v in addresses(model).items() if k[0] == 0} == {k: v for k, v in sealed.items() if k[0] == 0}
    assert_values(model, 1)  # the model keeps PWAL's second tensors: a recapture reads the right values


@pytest.mark.parametrize("mode", MODES)
def test_weight_written_after_after_layer(mode: str) -> None:
    model, contract = site_contract(mode)
    sealed = addresses(model)

    def load_again(layer: Site) -> None:
        layer.weight.data.copy_(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(99)))

    run = attempt(contract, lambda: None, layerwise=layer_by_layer(model, 1, load_again))
    run.check("test_weight_written_after_after_layer", mode)
    only_layer1(run.kinds(), run, {path: FindingKind.STALE for path in DECLARED})
    assert addresses(model) == sealed  # the addresses are right; layer 1's values are the first load's


@pytest.mark.parametrize("mode", MODES)
def test_stale_value(mode: str) -> None:
    model, contract = site_contract(mode)
    sealed = addresses(model)
    old = model.layers[1].w_t.clone()
    model.layers[1].fault = "skip-w_t"
    run = attempt(contract, lambda: load(model, 1))
    run.check("test_stale_value", mode)
    only_layer1(run.kinds(), run, {"w_t": FindingKind.STALE})
    assert addresses(model) == sealed  # the address is right; the values are not
    assert torch.equal(model.layers[1].w_t, old)
    assert_values(model, 1, except_=lambda key: key == (1, "w_t"))


@pytest.mark.parametrize("mode", MODES)
def test_exception_mid_pwal(mode: str) -> None:
    model, contract = site_contract(mode)
    model.layers[1].fault = "raise"
    captured = [weakref.ref(t) for t in slot_tensors(model).values()]
    run = attempt(contract, lambda: load(model, 1))
    run.check("test_exception_mid_pwal", mode)
    assert "failed halfway" in str(run.error)  # the loader's own exception, not a wrapper
    assert run.outcome is not None and run.outcome.error is run.error
    assert [f.kind for f in run.outcome.problems] == [FindingKind.RELOAD_ERROR]
    gc.collect()
    assert all(ref() is not None for ref in captured)  # quarantined: a stray replay reads stale, not freed, memory


@pytest.mark.parametrize("mode", MODES)
def test_lazily_allocated(mode: str) -> None:
    # Sealed before the warm-up forward, so the scratch that forward allocates (and the graph reads) is unknown
    # at seal; the every-reload walk finds it at the next reload. Legacy PWAL drops it (None).
    example = EXAMPLES["lazy_permute_scratch"]
    model = example.build("legacy", seed=0)
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    assert "_permute_scratch" not in {s.path for s in contract.slots()}
    x = example.example_input(model)
    example.forward(model, x)  # allocates layers.*._permute_scratch
    run = attempt(contract, _zoo_reload(example, model, 1), recapture=lambda: example.forward(model, x))
    run.check("test_lazily_allocated", mode)
    for layer in ("layers.0", "layers.1"):
        kinds = run.kinds(layer)
        assert kinds["_permute_scratch"] is FindingKind.VANISHED
        # the relayout is an ordinary undeclared move (auto-restored in migrate)
        assert kinds.get("w_t") is (None if mode == "migrate" else FindingKind.MOVED)
    assert not any(f.declared for f in run.outcome.problems)  # type: ignore[union-attr]
    if mode != "strict":  # the recapture's forward allocated a new scratch, and the reseal tracks it
        assert {s.path for s in contract.slots()} >= {"_permute_scratch"}
    _assert_zoo_matches_cold(example, model, "legacy", 1)


@pytest.mark.parametrize("mode", MODES)
def test_module_level_cache(mode: str) -> None:
    # No path reaches the cached tensor: only the capture-time manifest (what the capture read) sees it go.
    example, model, contract = _zoo("module_cache", "legacy", mode)
    contract.seal()
    x = example.example_input(model)

    def capture() -> None:
        with record_capture(contract, name="main", ignore=[x]):
            example.forward(model, x)

    capture()
    run = attempt(contract, _zoo_reload(example, model, 1), recapture=capture)
    run.check("test_module_level_cache", mode)
    assert run.outcome is not None
    assert {f.kind for f in run.outcome.problems} == {FindingKind.DEAD}  # the old cache entry was freed
    assert len(run.outcome.problems) == 2  # one per layer
    assert all("capture manifest" in f.detail and not f.declared for f in run.outcome.problems)
    _assert_zoo_matches_cold(example, model, "legacy", 1)


@pytest.mark.parametrize("mode", MODES)
def test_walker_budget_exhausted(mode: str) -> None:
    # max_depth=1 stops the walk at quant_method: tensors deeper in it go unchecked, so the contract fails closed.
    model, contract = site_contract(mode, budget=WalkBudget(max_depth=1))
    sealed = addresses(model)
    run = attempt(contract, lambda: load(model, 1))
    run.check("test_walker_budget_exhausted", mode)
    assert run.outcome is not None
    assert {(f.layer, f.kind) for f in run.outcome.problems} == {
        ("layers.0", FindingKind.BUDGET_EXHAUSTED),
        ("layers.1", FindingKind.BUDGET_EXHAUSTED),
    }
    assert all("max_depth=1" in f.detail for f in run.outcome.problems)
    assert addresses(model) == sealed  # the declared slots were restored all the same
    assert_values(model, 1)


def _set_members(layer: Site) -> None:
    """What a legacy PWAL does: keep a derived tensor in a set the forward reads (no path can name a member)."""
    layer.members = {layer.weight.detach().sum(0)}


@pytest.mark.parametrize("mode", MODES)
def test_untrackable(mode: str) -> None:
    # layers.1 keeps a derived tensor in a set: nothing can tell whether the captured one is still what it reads.
    model, contract = build(0), None
    _set_members(model.layers[1])
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    (captured,) = model.layers[1].members
    run = attempt(contract, faulty_reload(model, 1, _set_members))
    run.check("test_untrackable", mode)
    assert run.outcome is not None
    assert {(f.layer, f.kind, f.path) for f in run.outcome.problems} == {("layers.1", FindingKind.UNTRACKABLE, "")}
    assert all("a member of a set" in f.detail and "declare" in f.detail for f in run.outcome.problems)
    (now,) = model.layers[1].members
    assert now is not captured and torch.equal(now, model.layers[1].weight.detach().sum(0))  # PWAL's values
    assert_values(model, 1)


_KEY = (8, torch.float32)


def _tuple_keyed(layer: Site) -> None:
    """A legacy PWAL: a per-(batch size, dtype) cache of a derived tensor, rebuilt on every load."""
    layer.cache = {_KEY: layer.weight.detach().sum(1).contiguous()}


@pytest.mark.parametrize("mode", MODES)
def test_tuple_keyed_cache(mode: str) -> None:
    # The walker names `cache[(8, torch.float32)]`, so the reload never commits quietly.
    model = build(0)
    _tuple_keyed(model.layers[1])
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    captured = model.layers[1].cache[_KEY]
    run = attempt(contract, faulty_reload(model, 1, _tuple_keyed))
    run.check("test_tuple_keyed_cache", mode)
    assert run.outcome is not None
    expected = FindingKind.AUTO_RESTORED if mode == "migrate" else FindingKind.MOVED
    assert {(f.layer, f.path, f.kind) for f in run.outcome.findings} == {
        ("layers.1", "cache[(8, torch.float32)]", expected)
    }
    fresh = model.layers[1].weight.detach().sum(1)
    if mode == "migrate":  # restored into the captured memory, and the path bound back to it
        assert model.layers[1].cache[_KEY] is captured and torch.equal(captured, fresh)
    else:
        assert torch.equal(model.layers[1].cache[_KEY], fresh) and not torch.equal(captured, fresh)
    assert_values(model, 1)


@pytest.mark.parametrize("mode", MODES)
def test_declared_path_never_resolves(mode: str) -> None:
    # At declaration: PWAL declares a path it never assigns.
    class Typo(Site):
        @graph_visible("w_tt")
        def process_weights_after_loading(self) -> None:
            self.w_t = self.weight.detach().t().contiguous()

    with pytest.raises(DeclarationError, match="'w_tt'"):
        Typo().process_weights_after_loading()

    # At seal: a declared slot removed before seal() (nothing to fingerprint, so no capture can be protected).
    model = build(0)
    model.layers[1].lut = torch.zeros(3)
    register_derived(model.layers[1], "lut", static=True)
    del model.layers[1].lut
    contract = GraphContract(model, mode)  # type: ignore[arg-type]
    try:
        contract.seal()
        error: BaseException | None = None
    except Exception as exc:
        error = exc
    Run(contract, None, error, []).check("test_declared_path_never_resolves", mode)
    assert re.search(r"layers\.1 \(Site\): declared slot 'lut' does not resolve", str(error))
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError), contract.reload():
        pass


@pytest.mark.parametrize("mode", MODES)
def test_reload_when_not_serving_safe(mode: str) -> None:
    model = build(0)
    loaded: list[int] = []

    def body() -> None:
        loaded.append(1)
        load(model, 1)

    # Before seal.
    run = attempt(GraphContract(model, mode), body)  # type: ignore[arg-type]
    run.check("test_reload_when_not_serving_safe", mode)
    assert isinstance(run.error, NotServingSafeError) and "seal" in str(run.error)

    # After a failed reload (stale is FAILED in every mode): refused, carrying the outcome that made it unsafe.
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    model.layers[1].fault = "skip-w_t"
    with pytest.raises(ReloadFailedError), contract.reload():
        load(model, 2)
    failed_outcome = contract.last_outcome
    run = attempt(contract, body)
    run.check("test_reload_when_not_serving_safe", mode)
    assert isinstance(run.error, NotServingSafeError) and run.error.outcome is failed_outcome
    assert loaded == []  # the body never ran: nothing was loaded into an unsafe model

    model.layers[1].fault = None
    load(model, 2)  # a full reload outside the contract, a recapture, then reseal: serving again
    with pytest.raises(NotServingSafeError, match="recapture the graphs"):
        contract.reseal()
    contract.note_capture()
    contract.reseal()
    assert attempt(contract, lambda: load(model, 3)).outcome.status is Status.COMMITTED  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------------------
# Supporting evidence for rows whose detection depends on a collector
# ----------------------------------------------------------------------------------------------------


def test_module_level_cache_is_invisible_without_the_manifest() -> None:
    example, model, contract = _zoo("module_cache", "legacy", "strict")
    contract.seal()
    run = attempt(contract, _zoo_reload(example, model, 1))
    assert run.outcome is not None and run.outcome.status is Status.COMMITTED  # blind: why the row needs it


def test_module_level_cache_written_in_place_commits_under_the_manifest() -> None:
    example, model, contract = _zoo("module_cache", "migrated", "strict")
    contract.seal()
    x = example.example_input(model)
    with record_capture(contract, ignore=[x]):
        example.forward(model, x)
    run = attempt(contract, _zoo_reload(example, model, 1))
    assert run.outcome is not None and run.outcome.status is Status.COMMITTED
    _assert_zoo_matches_cold(example, model, "migrated", 1)


def test_a_lazily_allocated_scratch_from_stable_empty_commits() -> None:
    example = EXAMPLES["lazy_permute_scratch"]
    model = example.build("migrated", seed=0)
    contract = GraphContract(model, "strict").seal()
    x = example.example_input(model)
    example.forward(model, x)
    scratch = [layer._permute_scratch.data_ptr() for layer in example.layers(model)]
    run = attempt(contract, _zoo_reload(example, model, 1))
    assert run.outcome is not None and run.outcome.status is Status.COMMITTED
    example.forward(model, x)
    assert [layer._permute_scratch.data_ptr() for layer in example.layers(model)] == scratch
    _assert_zoo_matches_cold(example, model, "migrated", 1)


def test_a_big_enough_budget_is_not_exhausted() -> None:
    model, contract = site_contract("strict", budget=WalkBudget(max_depth=3))
    run = attempt(contract, lambda: load(model, 1))
    assert run.outcome is not None and run.outcome.status is Status.COMMITTED


# ----------------------------------------------------------------------------------------------------
# The document
# ----------------------------------------------------------------------------------------------------

OUTCOME = re.compile(r"\b(COMMITTED|NEEDS_RECAPTURE|FAILED)\b")
RAISES = re.compile(r"raises `?(\w+)`?")
TEST_ID = re.compile(r"`(tests/[\w/]+\.py::\w+(?:\[[^\]`]+\])?)`")


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)


def _tables(text: str) -> Iterator[Table]:
    table: Table | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            if table is not None:
                yield table
            table = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if table is None:
            table = Table(cells)
        elif not all(set(c) <= set(":- ") for c in cells):
            table.rows.append(cells)
    if table is not None:
        yield table


def _matrix() -> Table:
    (table,) = [t for t in _tables(DOC.read_text()) if {"strict", "recapture", "migrate"} <= set(t.header)]
    return table


@pytest.fixture(scope="module")
def collected() -> set[str]:
    """Test ids pytest collects in this file and in the GPU replay tests (those are collected on CPU too)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", __file__,
         str(ROOT / "tests" / "gpu" / "test_gpu_replay.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return {line.strip() for line in result.stdout.splitlines() if "::" in line}


def test_the_doc_names_an_outcome_and_a_collected_test_in_every_cell(collected: set[str]) -> None:
    table = _matrix()
    column = {name: table.header.index(name) for name in MODES}
    gpu_column = next(i for i, name in enumerate(table.header) if "GPU" in name)
    covered: set[tuple[str, str]] = set()
    for row in table.rows:
        assert len(row) == len(table.header), f"malformed row {row[0]!r}"
        for mode, index in column.items():
            cell = row[index]
            where = f"row {row[0]!r}, column {mode!r}"
            assert "warn" not in cell.lower(), f"{where}: no cell may say 'warn'"
            ids = TEST_ID.findall(cell)
            assert ids, f"{where}: names no test"
            for test_id in ids:
                assert test_id in collected, f"{where}: {test_id} is not a collected test"
            own = [i for i in ids if i.startswith("tests/test_fault_matrix.py::")]
            assert len(own) == 1, f"{where}: must name exactly one fault-matrix test"
            name, param = re.fullmatch(r"tests/test_fault_matrix\.py::(\w+)\[(\w+)\]", own[0]).groups()  # type: ignore[union-attr]
            assert param == mode, f"{where}: names the {param} case"
            expect = EXPECTED[name][mode]
            statuses = set(OUTCOME.findall(cell))
            wanted = {expect.status.name} if expect.status is not None else set()
            assert statuses == wanted, f"{where}: says {statuses or 'no status'}, the test proves {wanted}"
            raised = RAISES.findall(cell)
            if expect.raises is None:
                assert not raised, f"{where}: says it raises {raised}, the test proves it does not"
            else:
                assert raised == [expect.raises.__name__], f"{where}: must say 'raises {expect.raises.__name__}'"
            covered.add((name, mode))
        for test_id in TEST_ID.findall(row[gpu_column]):
            assert test_id in collected, f"row {row[0]!r}, GPU column: {test_id} is not a collected test"
    assert covered == {(name, mode) for name in EXPECTED for mode in MODES}, "rows or cells missing from the doc"


def test_every_row_of_the_matrix_has_its_test() -> None:
    module = sys.modules[__name__]
    for name in EXPECTED:
        test = getattr(module, name, None)
        assert callable(test), f"EXPECTED names {name} but no such test exists"
    rows = {row[0] for row in _matrix().rows}
    assert len(rows) == len(EXPECTED)
