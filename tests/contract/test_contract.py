"""The fail-closed reload contract: seal, restore, verify, findings and modes (CPU, declared slots).

Every reload loads DIFFERENT weights (another seed) and is compared with a model built cold on those weights:
a same-weights reload would hide a stale slot.
"""

from __future__ import annotations

import gc
import re
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from graphsafe import (
    ContractViolation,
    DeclaredDriftError,
    FindingKind,
    GraphContract,
    NotServingSafeError,
    RecaptureError,
    ReloadOutcome,
    Status,
    graph_visible,
)
from graphsafe.errors import GraphSafeError
from graphsafe.outcome import Origin

if TYPE_CHECKING:
    from conftest import Tiny

MODES = ("strict", "recapture", "migrate")


def _contract(model: nn.Module, mode: str = "strict") -> GraphContract:
    return GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]


def _ptrs(tiny: Tiny, model: nn.Module) -> dict[tuple[str, str], int]:
    return {key: t.data_ptr() for key, t in tiny.declared(model).items()}


def _tracked_ptrs(tiny: Tiny, model: nn.Module) -> dict[tuple[str, str], int]:
    """Declared slots plus every layer's own parameters and buffers: what a seal tracks with ``declared-only``."""
    found = _ptrs(tiny, model)
    for qualname, layer in model.named_modules():
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            found.setdefault((qualname, name), tensor.data_ptr())
    return found


def _assert_matches_cold(tiny: Tiny, model: nn.Module, seed: int, quant: Callable[[], Any] | None = None) -> None:
    cold = tiny.declared(tiny.build(seed, quant or tiny.Derived))
    warm = tiny.declared(model)
    assert warm.keys() == cold.keys()
    for key, tensor in warm.items():
        assert torch.equal(tensor, cold[key]), f"{key} holds stale or wrong values"


# ----------------------------------------------------------------------------------------------------
# Seal and a clean reload
# ----------------------------------------------------------------------------------------------------


def test_seal_fingerprints_every_declared_slot(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = GraphContract(model, detect="declared-only")
    assert not contract.serving_safe  # not before seal
    contract.seal()
    assert contract.serving_safe
    declared = tiny.declared(model)
    sealed = {(s.layer, s.path): s for s in contract.slots() if s.origin is Origin.DECLARED}
    assert sealed.keys() == declared.keys()
    # The layers' parameters are tracked too, as what the loader writes, not as undeclared finds.
    parameters = {(s.layer, s.path): s for s in contract.slots() if s.origin is Origin.PARAMETER}
    assert parameters.keys() == _tracked_ptrs(tiny, model).keys() - declared.keys()
    assert {path for _, path in parameters} == {"weight"}
    for (layer, path), info in parameters.items():
        assert info.fingerprint.data_ptr == model.get_submodule(layer).get_parameter(path).data_ptr()
    assert len(list(contract.slots())) == len(sealed) + len(parameters)
    assert {layer for layer, _ in sealed} == {"layers.0", "layers.1"}
    for key, info in sealed.items():
        assert info.origin is Origin.DECLARED
        assert info.fingerprint.data_ptr == declared[key].data_ptr()
        assert info.fingerprint.shape == tuple(declared[key].shape)


def test_without_a_contract_pwal_moves_derived_tensors(tiny: Tiny) -> None:
    """The control: the fixture's PWAL really re-allocates, so the address checks below can fail."""
    model = tiny.build(0)
    before = _ptrs(tiny, model)
    tiny.reload(model, 1)
    after = _ptrs(tiny, model)
    moved = {key for key in before if before[key] != after[key]}
    assert ("layers.0", "weight_t") in moved and ("layers.1", "packed") in moved
    assert ("layers.0", "quant_method.kernel.workspace") not in moved  # stable_empty keeps its storage


def test_reload_keeps_every_declared_address_and_delivers_new_values(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model)
    before = _ptrs(tiny, model)
    old_weight_t = model.layers[0].weight_t.clone()
    with contract.reload() as txn:
        tiny.reload(model, 1)
    assert txn.outcome is not None and txn.outcome.status is Status.COMMITTED
    assert _ptrs(tiny, model) == before
    assert not torch.equal(model.layers[0].weight_t, old_weight_t)
    _assert_matches_cold(tiny, model, 1)
    # A second reload, to other values again, still commits in place.
    with contract.reload():
        tiny.reload(model, 2)
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert _ptrs(tiny, model) == before
    _assert_matches_cold(tiny, model, 2)
    assert contract.serving_safe


def test_aliases_are_restored_and_still_aliased(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model)
    with contract.reload():
        tiny.reload(model, 1)
        assert model.layers[0].ab_strides1 is model.layers[0].c_strides2  # PWAL's own aliasing, new tensor
    for layer in model.layers:
        assert layer.ab_strides1 is layer.c_strides2
        assert layer.scale is layer.quant_method.kernel.scale
    _assert_matches_cold(tiny, model, 1)


def test_view_relation_holds_after_restore(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model)
    with contract.reload():
        tiny.reload(model, 1)
    for layer in model.layers:
        packed, tail = layer.packed, layer.packed_tail
        assert tail.untyped_storage() is packed.untyped_storage()
        split = layer.weight.shape[1]  # packed_tail starts after the in_features column sums
        assert tail.storage_offset() == packed.storage_offset() + split
        packed[split] = 123.0  # a write through the base shows through the view
        assert tail[0].item() == 123.0


def test_in_place_pwal_copies_nothing(tiny: Tiny) -> None:
    model = tiny.build(0, tiny.InPlace)
    contract = _contract(model)
    before = _ptrs(tiny, model)
    with contract.reload() as txn:
        tiny.reload(model, 1)
    assert txn.outcome is not None
    assert txn.outcome.committed
    assert txn.outcome.bytes_copied == 0
    assert txn.outcome.slots_restored == 0
    assert _ptrs(tiny, model) == before
    _assert_matches_cold(tiny, model, 1, tiny.InPlace)


def test_outcome_counts_each_moved_slot_and_copies_each_view_once(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model)
    sealed = tiny.declared(model)
    with contract.reload() as txn:
        tiny.reload(model, 1)
        fresh = tiny.declared(model)
        moved = {key for key in sealed if fresh[key] is not sealed[key]}
        # One copy per distinct new view: alias paths to one tensor are copied once.
        views = {
            (id(fresh[k].untyped_storage()), fresh[k].storage_offset(), tuple(fresh[k].shape)): fresh[k] for k in moved
        }
        expected_bytes = sum(t.numel() * t.element_size() for t in views.values())
        del fresh, views
    outcome = txn.outcome
    assert outcome is not None and outcome is contract.last_outcome
    assert isinstance(outcome, ReloadOutcome)
    assert outcome.slots_restored == len(moved) == 14  # 7 moved slots per layer; the stable workspace stays
    assert outcome.bytes_copied == expected_bytes
    aliased_bytes = sum(sealed[(q, p)].nbytes for q, p in moved)
    assert outcome.bytes_copied < aliased_bytes  # the aliases were not copied twice
    assert outcome.findings == ()
    assert outcome.seconds > 0.0
    assert outcome.layers == 2


# ----------------------------------------------------------------------------------------------------
# Faults: each finding kind, in each mode
# ----------------------------------------------------------------------------------------------------

FAULTY = 1  # the faults hit model.layers[1], so findings must say "layers.1"


def _nothing(model: nn.Module) -> None:
    del model


@dataclass(frozen=True)
class Fault:
    """A fault: ``before`` runs before the reload, ``during`` after the new weights' PWAL inside it."""

    kind: FindingKind
    path: str | None  # None: every slot of the layer
    during: Callable[[nn.Module, dict[str, torch.Tensor]], None] = lambda model, captured: None
    before: Callable[[nn.Module], None] = _nothing
    also: frozenset[str] = field(default_factory=frozenset)  # other paths that may be named
    also_kinds: frozenset[FindingKind] = field(default_factory=frozenset)  # other kinds those paths may get
    persistent: bool = False  # PWAL now always does this (a new layout), rather than a one-off accident


def _layer(model: nn.Module) -> Any:
    return model.layers[FAULTY]


def _shrink_weight_t(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    _layer(model).weight_t = _layer(model).weight_t[:3]


def _widen_weight_t(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    _layer(model).weight_t = _layer(model).weight_t.double()


def _transpose_weight_t(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    _layer(model).weight_t = _layer(model).weight.detach().clone().t()  # same shape, column-major


def _tail_through_another_view(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    _layer(model).packed_tail = captured["packed"][1:5]  # the captured storage, at another offset


def _delete_weight_t(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    del _layer(model).weight_t


def _kernel_scale_to_none(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    _layer(model).quant_method.kernel.scale = None


def _split_strides(model: nn.Module, captured: dict[str, torch.Tensor]) -> None:
    _layer(model).c_strides2 = _layer(model).ab_strides1 + 1  # two new tensors where there was one


def _free_captured_weight_t(model: nn.Module) -> None:
    del _layer(model).weight_t  # the only reference: the captured storage dies
    gc.collect()


def _replace_layer(model: nn.Module, *_: Any) -> None:
    old = _layer(model)
    replacement = type(old)(type(old.quant_method)())
    with torch.no_grad():
        replacement.weight.copy_(old.weight)
    replacement.quant_method.process_weights_after_loading(replacement)
    model.layers[FAULTY] = replacement


FAULTS = {
    "respecified-shape": Fault(FindingKind.RESPECIFIED, "weight_t", _shrink_weight_t, persistent=True),
    "respecified-dtype": Fault(FindingKind.RESPECIFIED, "weight_t", _widen_weight_t, persistent=True),
    "respecified-stride": Fault(FindingKind.RESPECIFIED, "weight_t", _transpose_weight_t, persistent=True),
    # packed_tail keeps its new tensor, a view into packed's captured storage: restoring packed there would change
    # what packed_tail reads, so packed keeps its new tensor too (alias-broken), and packed_tail keeps its values.
    "respecified-same-storage-other-view": Fault(
        FindingKind.RESPECIFIED,
        "packed_tail",
        _tail_through_another_view,
        also=frozenset({"packed"}),
        also_kinds=frozenset({FindingKind.ALIAS_BROKEN}),
        persistent=True,
    ),
    "vanished-deleted": Fault(FindingKind.VANISHED, "weight_t", _delete_weight_t),
    "vanished-none": Fault(FindingKind.VANISHED, "quant_method.kernel.scale", _kernel_scale_to_none),
    "dead": Fault(FindingKind.DEAD, "weight_t", before=_free_captured_weight_t),
    "alias-broken": Fault(FindingKind.ALIAS_BROKEN, "ab_strides1", _split_strides, also=frozenset({"c_strides2"})),
    "layer-replaced-before": Fault(FindingKind.VANISHED, None, before=_replace_layer),
    "layer-replaced-during": Fault(FindingKind.VANISHED, None, _replace_layer),
}


def _reload_with_fault(tiny: Tiny, model: nn.Module, contract: GraphContract, fault: Fault) -> Any:
    """Reload to seed 1 with ``fault`` injected; returns the transaction."""
    fault.before(model)
    captured = {"packed": _layer(model).packed}
    txn = contract.reload()
    with txn:
        tiny.reload(model, 1)
        fault.during(model, captured)
    return txn


def _check_findings(outcome: ReloadOutcome, fault: Fault, sealed: dict[tuple[str, str], Any]) -> None:
    problems = outcome.problems
    assert problems, "the fault went unnoticed"
    kinds = {f.kind for f in problems}
    assert fault.kind in kinds and kinds <= {fault.kind} | fault.also_kinds
    assert {f.layer for f in problems} == {"layers.1"}
    assert {f.layer_class for f in problems} == {"QuantLinear"}
    paths = {f.path for f in problems}
    if fault.path is None:
        assert paths == {p for q, p in sealed if q == "layers.1"}
    else:
        assert fault.path in paths and paths <= {fault.path} | fault.also
    for finding in problems:
        assert finding.declared
        assert finding.before is not None
        assert finding.before.data_ptr == sealed[(finding.layer, finding.path)].data_ptr
        assert finding.kind.value in finding.describe() and "layers.1" in finding.describe()
        if fault.kind is FindingKind.RESPECIFIED:
            assert finding.after is not None and finding.after.key != finding.before.key


@pytest.mark.parametrize("name", list(FAULTS))
def test_strict_raises_carrying_the_outcome_and_refuses_until_reseal(tiny: Tiny, name: str) -> None:
    fault = FAULTS[name]
    model = tiny.build(0)
    contract = _contract(model, "strict")
    sealed = {(s.layer, s.path): s.fingerprint for s in contract.slots()}
    with pytest.raises(DeclaredDriftError) as info:
        _reload_with_fault(tiny, model, contract, fault)
    outcome = info.value.outcome
    assert outcome is not None and outcome is contract.last_outcome
    assert outcome.status is Status.FAILED
    _check_findings(outcome, fault, sealed)
    assert fault.path is None or fault.path in str(info.value)
    assert not contract.serving_safe
    ran = []
    with pytest.raises(NotServingSafeError), contract.reload():
        ran.append(True)
    assert ran == []  # the refused reload's body never ran
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError, match="recapture the graphs"):
        contract.reseal()  # the graphs still read the storage of before the failed reload
    assert not contract.serving_safe
    tiny.reload(model, 1)  # the remedy: a full reload, a recapture, then reseal()
    contract.note_capture()
    contract.reseal()
    assert contract.serving_safe
    before = _ptrs(tiny, model)
    with contract.reload() as txn:
        tiny.reload(model, 2)
    assert txn.outcome is not None and txn.outcome.committed
    assert _ptrs(tiny, model) == before
    _assert_matches_cold(tiny, model, 2)


# A recapture re-reads the model's current tensors. It fixes these only when it is able to reseal afterwards:
# a vanished declared slot still has a declaration that resolves to nothing.
RESEALABLE = [name for name, fault in FAULTS.items() if not name.startswith("vanished")]


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
@pytest.mark.parametrize("name", RESEALABLE)
def test_recapture_modes_run_callbacks_and_reseal(tiny: Tiny, mode: str, name: str) -> None:
    fault = FAULTS[name]
    model = tiny.build(0)
    contract = _contract(model, mode)
    sealed = {(s.layer, s.path): s.fingerprint for s in contract.slots()}
    calls: list[tuple[ReloadOutcome, bool]] = []
    contract.on_recapture(lambda outcome: calls.append((outcome, contract.serving_safe)))
    txn = _reload_with_fault(tiny, model, contract, fault)
    outcome = txn.outcome
    assert outcome is not None and outcome is contract.last_outcome
    assert outcome.status is Status.NEEDS_RECAPTURE
    _check_findings(outcome, fault, sealed)
    assert [c[0] for c in calls] == [outcome]
    assert calls[0][1] is False  # not serving-safe while the graphs are being captured again
    assert contract.serving_safe  # resealed itself after the callback
    # The resealed fingerprints are what the model holds now, and the next reload commits in place.
    assert {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots()} == _tracked_ptrs(tiny, model)
    before = _ptrs(tiny, model)
    with contract.reload() as next_txn:
        tiny.reload(model, 2)
        if fault.persistent:
            fault.during(model, {"packed": _layer(model).packed})
    assert next_txn.outcome is not None and next_txn.outcome.committed
    assert _ptrs(tiny, model) == before
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
@pytest.mark.parametrize("name", RESEALABLE)
def test_recapture_modes_leave_the_values_pwal_produced(tiny: Tiny, mode: str, name: str) -> None:
    """What a recapture will read must be the new weights' values, slot for slot, faults included."""
    fault = FAULTS[name]
    model, reference = tiny.build(0), tiny.build(0)
    contract = _contract(model, mode)
    contract.on_recapture(lambda outcome: None)
    _reload_with_fault(tiny, model, contract, fault)
    # The same reload and fault on a model nobody restores.
    fault.before(reference)
    captured = {"packed": _layer(reference).packed}
    tiny.reload(reference, 1)
    fault.during(reference, captured)
    expected = tiny.declared(reference)
    for key, tensor in tiny.declared(model).items():
        assert torch.equal(tensor, expected[key]), f"{key} would be captured with wrong values"


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_recapture_without_a_callback_waits_for_reseal(tiny: Tiny, mode: str) -> None:
    model = tiny.build(0)
    contract = _contract(model, mode)
    txn = _reload_with_fault(tiny, model, contract, FAULTS["respecified-dtype"])
    assert txn.outcome is not None and txn.outcome.status is Status.NEEDS_RECAPTURE
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError), contract.reload():
        pass
    with pytest.raises(NotServingSafeError, match="recapture the graphs"):
        contract.reseal()  # no capture since the reload
    contract.note_capture()  # the caller captured again
    contract.reseal()
    assert contract.serving_safe
    with contract.reload() as again:
        tiny.reload(model, 2)
        _widen_weight_t(model, {})  # PWAL's new layout, as the recapture saw it
    assert again.outcome is not None and again.outcome.committed


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
@pytest.mark.parametrize("name", ["vanished-deleted", "vanished-none"])
def test_recapture_modes_stay_unsafe_when_a_vanished_slot_blocks_the_reseal(tiny: Tiny, mode: str, name: str) -> None:
    fault = FAULTS[name]
    model = tiny.build(0)
    contract = _contract(model, mode)
    seen: list[ReloadOutcome] = []
    contract.on_recapture(seen.append)
    assert fault.path is not None
    with pytest.raises(GraphSafeError, match=re.escape(fault.path)):
        _reload_with_fault(tiny, model, contract, fault)
    assert len(seen) == 1 and seen[0].status is Status.NEEDS_RECAPTURE
    assert {f.kind for f in seen[0].problems} == {FindingKind.VANISHED}
    assert not contract.serving_safe  # fail closed: the old seal no longer describes the model
    with pytest.raises(NotServingSafeError), contract.reload():
        pass


def test_a_raising_recapture_callback_leaves_the_contract_unsafe(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model, "recapture")
    boom = RuntimeError("capture failed")

    def recapture(outcome: ReloadOutcome) -> None:
        raise boom

    contract.on_recapture(recapture)
    with pytest.raises(RecaptureError) as info:
        _reload_with_fault(tiny, model, contract, FAULTS["respecified-shape"])
    assert info.value.__cause__ is boom
    assert info.value.outcome is contract.last_outcome
    assert info.value.outcome is not None and info.value.outcome.status is Status.NEEDS_RECAPTURE
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError), contract.reload():
        pass


def test_a_removed_recapture_callback_is_not_called(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model, "recapture")
    calls: list[ReloadOutcome] = []
    contract.on_recapture(calls.append).remove()
    _reload_with_fault(tiny, model, contract, FAULTS["respecified-shape"])
    assert calls == []
    assert not contract.serving_safe  # no callback left: it waits for reseal()


# ----------------------------------------------------------------------------------------------------
# A reload that raises
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_inside_the_reload_fails_closed_and_propagates(tiny: Tiny, mode: str) -> None:
    model = tiny.build(0)
    contract = _contract(model, mode)
    callbacks: list[ReloadOutcome] = []
    contract.on_recapture(callbacks.append)
    boom = RuntimeError("PWAL failed halfway")

    def failing_pwal(layer: nn.Module) -> None:
        raise boom

    model.layers[1].quant_method.process_weights_after_loading = failing_pwal  # layer 0 reloads, layer 1 fails
    with pytest.raises(RuntimeError) as info, contract.reload() as txn:
        tiny.reload(model, 1)
    assert info.value is boom
    outcome = contract.last_outcome
    assert outcome is not None and outcome is txn.outcome
    assert outcome.status is Status.FAILED and not outcome.committed
    assert outcome.error is boom
    assert [f.kind for f in outcome.problems] == [FindingKind.RELOAD_ERROR]
    assert "PWAL failed halfway" in outcome.problems[0].detail
    assert callbacks == []  # a recapture cannot fix half-loaded weights
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError), contract.reload():
        pass


# ----------------------------------------------------------------------------------------------------
# Layerwise reload
# ----------------------------------------------------------------------------------------------------


def test_layerwise_restores_each_layer_and_frees_its_new_tensors_before_the_next(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model)
    before = _ptrs(tiny, model)
    weights = tiny.weights(model, 1)
    layers = list(model.layers)
    with contract.reload(layerwise=True) as txn:
        for index, layer in enumerate(layers):
            txn.before_layer(layer)
            with torch.no_grad():
                layer.weight.copy_(weights[f"layers.{index}.weight"])
            layer.quant_method.process_weights_after_loading(layer)
            new_weight_t = weakref.ref(layer.weight_t)
            assert layer.weight_t.data_ptr() != before[(f"layers.{index}", "weight_t")]
            txn.after_layer(layer)
            assert new_weight_t() is None  # freed now, before the next layer allocates its own
            assert layer.weight_t.data_ptr() == before[(f"layers.{index}", "weight_t")]
            if index == 0:
                # Layer 1 is untouched so far: still the sealed tensors with the old values.
                assert layers[1].weight_t.data_ptr() == before[("layers.1", "weight_t")]
    assert txn.outcome is not None and txn.outcome.committed
    assert txn.outcome.slots_restored == 14
    assert _ptrs(tiny, model) == before
    _assert_matches_cold(tiny, model, 1)


def test_layerwise_finds_a_fault_in_one_layer(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = _contract(model)
    weights = tiny.weights(model, 1)
    with pytest.raises(DeclaredDriftError) as info, contract.reload(layerwise=True) as txn:
        for index, layer in enumerate(model.layers):
            txn.before_layer(layer)
            with torch.no_grad():
                layer.weight.copy_(weights[f"layers.{index}.weight"])
            layer.quant_method.process_weights_after_loading(layer)
            if index == FAULTY:
                layer.weight_t = layer.weight_t.double()
            txn.after_layer(layer)
    outcome = info.value.outcome
    assert outcome is not None
    assert [(f.kind, f.layer, f.path) for f in outcome.problems] == [(FindingKind.RESPECIFIED, "layers.1", "weight_t")]


# ----------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------


def test_unknown_mode_or_detect_policy_is_rejected_naming_the_choices(tiny: Tiny) -> None:
    model = tiny.build(0)
    with pytest.raises(ValueError) as info:
        GraphContract(model, "warn")  # type: ignore[arg-type]
    for choice in MODES:
        assert choice in str(info.value)
    with pytest.raises(ValueError) as info:
        GraphContract(model, detect="sometimes")  # type: ignore[arg-type]
    for choice in ("every-reload", "sealed-paths", "declared-only"):
        assert choice in str(info.value)
    with pytest.raises(TypeError):
        GraphContract(object())  # type: ignore[arg-type]


def test_a_reload_before_seal_is_refused(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = GraphContract(model, detect="declared-only")
    with pytest.raises(NotServingSafeError, match="seal"), contract.reload():
        pass


# ----------------------------------------------------------------------------------------------------
# Default detect: the walker finds undeclared paths to declared storage, and they are rebound too
# ----------------------------------------------------------------------------------------------------


class _AliasKernel:
    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        self.args: tuple[Any, ...] = ()


class AliasingQuant:
    """Declares ``scale`` only; its kernel keeps the same tensor under two undeclared paths."""

    def __init__(self) -> None:
        self.kernel = _AliasKernel()

    @graph_visible("scale")
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight.detach().abs().amax(dim=1)
        layer.scale = scale
        self.kernel.scale = scale
        self.kernel.args = (scale, 3)  # a tuple: rebinding must rebuild it into its parent


ALIAS_PATHS = ("quant_method.kernel.scale", "quant_method.kernel.args[0]")


def test_walker_finds_undeclared_alias_paths_at_seal(tiny: Tiny) -> None:
    model = tiny.build(0, AliasingQuant)
    contract = GraphContract(model).seal()
    layer0 = {s.path: s for s in contract.slots() if s.layer == "layers.0"}
    assert layer0["scale"].origin is Origin.DECLARED
    for path in ALIAS_PATHS:
        assert layer0[path].origin is Origin.ALIAS
        assert layer0[path].alias_of == "scale"


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
def test_walker_found_aliases_are_rebound_to_the_captured_tensor(tiny: Tiny, detect: str) -> None:
    model = tiny.build(0, AliasingQuant)
    contract = GraphContract(model, detect=detect).seal()  # type: ignore[arg-type]
    sealed_ptr = {i: layer.scale.data_ptr() for i, layer in enumerate(model.layers)}
    with contract.reload() as txn:
        tiny.reload(model, 1)
    assert txn.outcome is not None and txn.outcome.committed
    cold = tiny.build(1, AliasingQuant)
    for i, layer in enumerate(model.layers):
        kernel = layer.quant_method.kernel
        assert layer.scale.data_ptr() == sealed_ptr[i]
        assert kernel.scale is layer.scale and kernel.args[0] is layer.scale
        assert kernel.args[1] == 3
        assert torch.equal(layer.scale, cold.layers[i].scale)
    assert txn.outcome.bytes_copied == sum(layer.scale.nbytes for layer in model.layers)  # once per layer


def test_declared_only_leaves_undeclared_aliases_behind(tiny: Tiny) -> None:
    """The control for the test above: without the walker the kernel keeps PWAL's new tensor."""
    model = tiny.build(0, AliasingQuant)
    contract = _contract(model)
    with contract.reload():
        tiny.reload(model, 1)
    layer = model.layers[0]
    assert layer.quant_method.kernel.scale is not layer.scale
    assert layer.quant_method.kernel.scale.data_ptr() != layer.scale.data_ptr()


def test_default_detect_commits_a_fully_declared_model(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = GraphContract(model).seal()
    before = _ptrs(tiny, model)
    with contract.reload() as txn:
        tiny.reload(model, 1)
    assert txn.outcome is not None and txn.outcome.committed, txn.outcome.summary() if txn.outcome else None
    assert _ptrs(tiny, model) == before
    _assert_matches_cold(tiny, model, 1)


# ----------------------------------------------------------------------------------------------------
# Parameters and buffers: a loader that binds a new tensor instead of copying into the captured one
# ----------------------------------------------------------------------------------------------------


def _replace_weights(tiny: Tiny, model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A loader that binds a NEW Parameter per weight (not the upstream in-place copy), then runs PWAL."""
    new = tiny.weights(model, seed)
    for name, value in new.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(value.clone(), requires_grad=False))
    for layer in model.layers:  # type: ignore[union-attr]
        layer.quant_method.process_weights_after_loading(layer)
    return new


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_parameter_is_copied_into_the_captured_one_and_rebound(tiny: Tiny, mode: str, detect: str) -> None:
    model = tiny.build(0)
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = [layer.weight for layer in model.layers]  # type: ignore[union-attr]
    ptrs = [p.data_ptr() for p in captured]
    before = _ptrs(tiny, model)
    replaced: list[nn.Parameter] = []
    with contract.reload() as txn:
        new = _replace_weights(tiny, model, 1)
        replaced = [layer.weight for layer in model.layers]  # type: ignore[union-attr]
    assert all(r is not c for r, c in zip(replaced, captured, strict=True))  # the premise: new objects
    outcome = txn.outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary() if outcome else None
    assert outcome.findings == ()
    for i, layer in enumerate(model.layers):  # type: ignore[arg-type]
        assert layer.weight is captured[i] and layer._parameters["weight"] is captured[i]
        assert layer.weight.data_ptr() == ptrs[i]
        assert torch.equal(layer.weight, new[f"layers.{i}.weight"])  # the new values, in the captured storage
    assert _ptrs(tiny, model) == before
    _assert_matches_cold(tiny, model, 1)
    assert contract.serving_safe
    # The next reload, upstream-style, commits in place as before.
    with contract.reload() as again:
        tiny.reload(model, 2)
    assert again.outcome is not None and again.outcome.committed
    assert [layer.weight.data_ptr() for layer in model.layers] == ptrs  # type: ignore[union-attr]


def test_parameters_are_sealed_as_parameter_slots_and_never_listed_as_undeclared(tiny: Tiny) -> None:
    from graphsafe.report import migration_report

    model = tiny.build(0)
    contract = GraphContract(model, "migrate").seal()
    origins = {(s.layer, s.path): s.origin.value for s in contract.slots()}
    assert origins[("layers.0", "weight")] == "parameter" and origins[("layers.1", "weight")] == "parameter"
    with contract.reload() as txn:
        _replace_weights(tiny, model, 1)
    assert txn.outcome is not None and txn.outcome.committed and not txn.outcome.auto_restored
    assert not any(entry.path == "weight" for entry in migration_report(contract).entries)


class _PlainLayer(nn.Module):
    """A layer with a weight parameter, an optional bias and a buffer; no PWAL, so only what the loader binds moves."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
        self.bias = None
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.offset


def _plain(mode: str, detect: str = "every-reload") -> tuple[nn.Sequential, GraphContract]:
    model = nn.Sequential(_PlainLayer(), _PlainLayer())
    return model, GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]


def test_a_replaced_buffer_is_restored(tiny: Tiny) -> None:
    model, contract = _plain("strict", "declared-only")
    layer = model[0]
    captured, ptr = layer.offset, layer.offset.data_ptr()
    assert {(s.path, s.origin.value) for s in contract.slots() if s.layer == "0"} == {
        ("weight", "parameter"),
        ("offset", "buffer"),  # `bias` is None and is not tracked
    }
    new = torch.randn(4)
    with contract.reload() as txn:
        layer.offset = new.clone()  # nn.Module keeps it a buffer, in new storage
        assert layer.offset is not captured
    assert txn.outcome is not None and txn.outcome.committed and txn.outcome.slots_restored == 1
    assert layer.offset is captured and layer._buffers["offset"] is captured and layer.offset.data_ptr() == ptr
    assert torch.equal(layer.offset, new)


REPLACEMENTS: dict[str, tuple[Callable[[nn.Module], None], FindingKind]] = {
    "respecified-shape": (
        lambda layer: setattr(layer, "weight", nn.Parameter(torch.randn(6, 4), requires_grad=False)),
        FindingKind.RESPECIFIED,
    ),
    "respecified-dtype": (
        lambda layer: setattr(layer, "weight", nn.Parameter(torch.randn(4, 6, dtype=torch.float64), False)),
        FindingKind.RESPECIFIED,
    ),
    "vanished": (lambda layer: delattr(layer, "weight"), FindingKind.VANISHED),
    "vanished-none": (lambda layer: setattr(layer, "weight", None), FindingKind.VANISHED),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(REPLACEMENTS))
def test_a_parameter_replaced_by_something_no_copy_can_restore_is_a_finding(mode: str, name: str) -> None:
    replace, kind = REPLACEMENTS[name]
    model, contract = _plain(mode)
    captured = model[1].weight
    txn = contract.reload()
    if mode == "strict":
        with pytest.raises(DeclaredDriftError) as info, txn:
            replace(model[1])
        assert "'weight' of 1 (_PlainLayer)" in str(info.value)
    else:
        with txn:
            replace(model[1])
    outcome = txn.outcome
    assert outcome is not None
    assert [(f.kind, f.layer, f.path, f.declared) for f in outcome.problems] == [(kind, "1", "weight", True)]
    assert "a parameter or buffer of the layer" in outcome.problems[0].detail
    expected = Status.FAILED if mode == "strict" else Status.NEEDS_RECAPTURE
    assert outcome.status is expected and not contract.serving_safe
    assert captured.untyped_storage().data_ptr() == outcome.problems[0].before.storage_ptr  # reported as sealed


def test_a_parameter_aliased_by_a_kernel_is_rebound_with_it() -> None:
    model, _ = _plain("strict")
    for layer in model:
        layer.kernel = types.SimpleNamespace(w=layer.weight)  # a quant method holding the layer's weight
    contract = GraphContract(model, "strict").seal()
    sealed = {(s.layer, s.path): s for s in contract.slots()}
    assert sealed[("0", "kernel.w")].origin is Origin.ALIAS and sealed[("0", "kernel.w")].alias_of == "weight"
    captured = model[0].weight
    new = torch.randn(4, 6)
    with contract.reload() as txn:
        model[0].weight = nn.Parameter(new.clone(), requires_grad=False)
        model[0].kernel.w = model[0].weight  # PWAL re-binds the kernel to the new weight
    assert txn.outcome is not None and txn.outcome.committed
    assert model[0].weight is captured and model[0].kernel.w is captured
    assert torch.equal(captured, new)


def test_an_alias_left_on_the_replaced_parameter_is_rebound_too() -> None:
    # The kernel keeps the captured parameter while the loader binds a new one: both paths end on the captured
    # storage holding the new values.
    model, _ = _plain("strict")
    model[0].kernel = types.SimpleNamespace(w=model[0].weight)
    contract = GraphContract(model, "strict").seal()
    captured = model[0].weight
    new = torch.randn(4, 6)
    with contract.reload() as txn:
        model[0].weight = nn.Parameter(new.clone(), requires_grad=False)
    assert txn.outcome is not None and txn.outcome.committed
    assert model[0].weight is captured and model[0].kernel.w is captured and torch.equal(captured, new)


def test_a_parameter_declared_after_the_seal_becomes_a_declared_slot() -> None:
    from graphsafe import register_derived

    model, contract = _plain("strict")
    sealed_fp = {(s.layer, s.path): s.fingerprint for s in contract.slots()}[("0", "weight")]
    register_derived(model[0], "weight")  # e.g. a kernel that declares the weight it reads on its first forward
    captured = model[0].weight
    with contract.reload() as txn:
        model[0].weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
    assert txn.outcome is not None and txn.outcome.committed
    assert model[0].weight is captured
    now = {(s.layer, s.path): s for s in contract.slots()}
    assert now[("0", "weight")].origin is Origin.DECLARED and now[("0", "weight")].fingerprint is sealed_fp
    assert sum(1 for s in contract.slots() if (s.layer, s.path) == ("0", "weight")) == 1


# ----------------------------------------------------------------------------------------------------
# on_outcome: one listener per reload, whatever the status
# ----------------------------------------------------------------------------------------------------


def test_on_outcome_sees_every_reload_and_its_handle_removes(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = GraphContract(model, "strict").seal()
    seen: list[ReloadOutcome] = []
    handle = contract.on_outcome(seen.append)
    assert handle.active
    with contract.reload() as txn:
        tiny.reload(model, 1)
    assert [o.status for o in seen] == [Status.COMMITTED] and seen[0] is txn.outcome
    # A strict failure: the listener hears it before the contract raises.
    layer = model.layers[0]
    with pytest.raises(ContractViolation), contract.reload():
        tiny.reload(model, 2)
        layer.quant_method.kernel.scale = torch.zeros(4, 4)  # respecified: a new shape
    assert [o.status for o in seen] == [Status.COMMITTED, Status.FAILED]
    assert seen[1] is contract.last_outcome
    handle.remove()
    assert not handle.active
    tiny.reload(model, 2)  # a full reload puts the layout back, and the graphs are captured again here
    contract.reseal(recaptured=True)
    with contract.reload():
        tiny.reload(model, 3)
    assert len(seen) == 2  # removed: not called again


def test_a_listener_that_raises_does_not_change_the_outcome(tiny: Tiny) -> None:
    model = tiny.build(0)
    contract = GraphContract(model, "strict").seal()
    heard: list[Status] = []

    def broken(outcome: ReloadOutcome) -> None:
        raise RuntimeError("listener bug")

    contract.on_outcome(broken)
    contract.on_outcome(lambda outcome: heard.append(outcome.status))  # later listeners still run
    with pytest.raises(RuntimeError, match="listener bug"), contract.reload() as txn:
        tiny.reload(model, 1)
    assert heard == [Status.COMMITTED]
    assert txn.outcome is not None and txn.outcome.committed
    assert contract.serving_safe  # the reload itself committed


@pytest.mark.parametrize("detect", ["declared-only", "sealed-paths", "every-reload"])
def test_a_declaration_made_after_the_seal_is_reported_once_per_path(detect: str) -> None:
    """A scratch declared by a forward after the seal (``stable_empty``) joins the seal as declared; a legacy PWAL
    that then drops it is one ``vanished`` finding, not also a walker copy of it ("alias of tracked slot")."""
    from graphsafe.testing.zoo.lazy_scratch import MigratedPermuteMoE

    class DropsScratch(MigratedPermuteMoE):
        def process_weights_after_loading(self) -> None:
            self._relayout()
            self._permute_scratch = None

    layer = DropsScratch(torch.device("cpu"))
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "migrate", detect=detect).seal()  # type: ignore[arg-type]
    layer(torch.randn(3, layer.w.shape[1]))  # declares the scratch after the seal
    with torch.no_grad(), contract.reload() as txn:
        layer.w.copy_(torch.randn_like(layer.w))
        layer.process_weights_after_loading()
    outcome = txn.outcome
    assert outcome is not None
    vanished = [f for f in outcome.findings if f.kind is FindingKind.VANISHED]
    assert [(f.path, f.declared) for f in vanished] == [("_permute_scratch", True)]


# -- the cyclic garbage collector: paused in the contract's own code only -----------------------------------------


@pytest.mark.parametrize("layerwise", [False, True])
def test_no_collection_runs_inside_the_contracts_own_code_and_the_collector_runs_elsewhere(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    """The contract's transient allocations must not trigger collections (they promote those objects, and the
    promotions trigger full collections over the whole heap); the loader, PWAL and listeners run with the
    collector as the caller had it, and it is back on after the reload."""
    from graphsafe.contract._snapshot import LayerSnapshot

    model = tiny.build(0, n_layers=3)
    contract = _contract(model)
    where = {"inside": False}
    inside_runs: list[int] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and where["inside"]:
            inside_runs.append(info["generation"])

    for name in ("take", "restore", "verify"):
        original = LayerSnapshot.__dict__[name]
        func = original.__func__ if isinstance(original, classmethod) else original

        def inside(*args: Any, _f: Any = func, **kwargs: Any) -> Any:
            where["inside"] = True
            try:
                return _f(*args, **kwargs)
            finally:
                where["inside"] = False

        monkeypatch.setattr(LayerSnapshot, name, classmethod(inside) if isinstance(original, classmethod) else inside)
    # the collector's switch and first threshold: the caller's (on, 1) outside the contract's own code
    enabled_in_pwal: list[tuple[bool, int]] = []
    enabled_in_listener: list[tuple[bool, int]] = []
    contract.on_outcome(lambda outcome: enabled_in_listener.append((gc.isenabled(), gc.get_threshold()[0])))
    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)  # a collection at every allocation: any left on inside the contract would run there
    try:
        txn = contract.reload(layerwise=layerwise)
        txn.begin()
        if layerwise:
            for layer in model.layers:
                txn.before_layer(layer)
        enabled_in_pwal.append((gc.isenabled(), gc.get_threshold()[0]))
        tiny.reload(model, 1)
        if layerwise:
            for layer in model.layers:
                txn.after_layer(layer)
        outcome = txn.finish()
        after = (gc.isenabled(), gc.get_threshold()[0])
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_collection)
    assert outcome.status is Status.COMMITTED
    assert inside_runs == []
    assert enabled_in_pwal == [(True, 1)] and enabled_in_listener == [(True, 1)] and after == (True, 1)


def test_a_restore_that_raises_leaves_the_collector_on_and_one_the_caller_disabled_stays_off(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphsafe.contract._snapshot import LayerSnapshot

    model = tiny.build(0)
    contract = _contract(model)

    def broken(self: Any) -> None:
        raise RuntimeError("a copy failed")

    monkeypatch.setattr(LayerSnapshot, "verify", broken)
    with pytest.raises(RuntimeError, match="a copy failed"), contract.reload():
        tiny.reload(model, 1)
    assert gc.isenabled()
    monkeypatch.undo()
    contract.reseal(recaptured=True)  # the test has no graphs: say they were captured again
    gc.disable()
    try:
        with contract.reload():
            tiny.reload(model, 2)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert contract.last_outcome is not None and contract.last_outcome.committed
