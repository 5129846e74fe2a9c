"""Minimal scenarios of the differential fuzzer's (``tests/fuzz``) attribute, late-write and inference-mode draws
(Python attributes PWAL hangs on tensors, layerwise reloads with a touch after ``after_layer()``, PWAL under
``torch.inference_mode()``), each as small as the failure needs; the docstring says what the reload does and what the
promise requires. The scenario tests run through the fuzzer's harness and independent oracle (:func:`fuzz.harness.run`)
and assert the verdict is ``ok`` (or a false alarm); two are written against the public API alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fuzz import oracle
from fuzz.harness import run
from fuzz.models import LayerSpec, Scenario, SlotSpec
from graphsafe import GraphContract, GraphSafeError, graph_visible

MODES = ("strict", "recapture", "migrate")


def _assert_honest(scenario: Scenario) -> None:
    result = run(scenario)
    assert result.verdict in (oracle.OK, oracle.FALSE_ALARM), (
        f"{result.verdict} ({result.status}): {result.reason} {result.detail}\n{scenario.describe()}"
    )


# ----------------------------------------------------------------------------------------------------
# Python attributes on permuted tensors


class _Swapping(nn.Module):
    """Two derived tensors with a Python attribute each (``t.scale``, as a quant method hangs a scale on its
    kernel tensor); the reload's PWAL swaps the two tensor objects (ping-pong buffers), writes each its new values
    in place and sets each its new attribute."""

    a: torch.Tensor
    b: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3), requires_grad=False)


@graph_visible("a", "b")
def _first_pwal(layer: _Swapping) -> None:
    layer.a = layer.weight.detach().t().contiguous()
    setattr(layer.a, "scale", float(layer.weight.sum()))  # noqa: B010
    layer.b = (2 * layer.weight.detach()).t().contiguous()
    setattr(layer.b, "scale", float(2 * layer.weight.sum()))  # noqa: B010


@graph_visible("a", "b")
def _swap_pwal(layer: _Swapping) -> None:
    layer.a, layer.b = layer.b, layer.a
    with torch.no_grad():
        layer.a.copy_(layer.weight.t())
        layer.b.copy_(2 * layer.weight.t())
    setattr(layer.a, "scale", float(layer.weight.sum()))  # noqa: B010
    setattr(layer.b, "scale", float(2 * layer.weight.sum()))  # noqa: B010


def test_swapped_derived_tensors_keep_their_own_python_attributes_after_a_commit() -> None:
    """Two declared derived tensors ``a`` and ``b`` carry a Python attribute each (``scale``). The reload's PWAL
    swaps the two tensor objects, writes each its new values in place and sets each its new ``scale``: PWAL leaves
    ``a.scale == sum(w)`` and ``b.scale == 2 * sum(w)``, as a cold model has them. graphsafe rebinds the captured
    tensors back (each path's captured object) and moves the new tensor's attributes onto it, but reads each new
    tensor's ``__dict__`` at its rebind: ``a``'s captured object (``b``'s new tensor) is rewritten first, then
    copied from for ``b``. The reload commits with ``b.scale == a.scale``. The promise: after a commit each path's
    attributes are what PWAL left there (a cold model's). Found as ``committed, attribute wrong`` (cycle of two)."""
    torch.manual_seed(0)
    layer = _Swapping()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2, 3))
    _first_pwal(layer)
    contract = GraphContract(layer, "strict").seal()
    new = torch.randn(2, 3)
    with contract.reload():
        with torch.no_grad():
            layer.weight.copy_(new)
        _swap_pwal(layer)
    assert contract.last_outcome is not None
    if contract.last_outcome.status.name == "COMMITTED":
        assert getattr(layer.a, "scale") == pytest.approx(float(new.sum()))  # noqa: B009
        assert getattr(layer.b, "scale") == pytest.approx(float(2 * new.sum())), "b has a's attribute after the commit"  # noqa: B009


@pytest.mark.parametrize(("mode", "declare"), [*((mode, "graph_visible") for mode in MODES), ("migrate", "none")])
def test_swapped_slots_attributes_follow_their_paths(mode: str, declare: str) -> None:
    """The fuzzer's form of the test above: ``cycle(d0,d1)`` swaps two derived tensors that each carry a plain
    attribute (``.fz_attr=plain``); after the reload the model's ``d1.fz_attr`` is ``d0``'s."""
    slots = (SlotSpec("d0", attr="plain", declare=declare), SlotSpec("d1", factor=2, attr="plain", declare=declare))
    _assert_honest(Scenario(layers=(LayerSpec(rows=1, cols=1, slots=slots, cycle=(0, 1)),), mode=mode))


def test_a_swapped_tensor_attribute_is_not_overwritten_on_a_failed_reload() -> None:
    """``cycle(d0,d1)`` swaps two complex derived tensors; ``d0`` carries a tensor attribute computed from the weight
    (``.fz_attr=tensor``, the forward reads it), ``d1`` none. PWAL leaves ``d0.fz_attr`` with the right values (on
    the object now at ``d0``). The reload fails (strict), yet graphsafe has moved attributes between the swapped
    objects in the order it rebinds them: the model's ``d0.fz_attr`` then holds other values than PWAL computed. The
    promise: never a write of values the reload did not produce for it, whatever the status (found as ``FAILED, a
    value PWAL got right was overwritten``)."""
    slots = (
        SlotSpec("d0", source="complex", subclass=True, attr="tensor"),
        SlotSpec("d1", source="complex", subclass=True, declare="register_derived"),
    )
    _assert_honest(Scenario(layers=(LayerSpec(rows=1, cols=1, slots=slots, cycle=(0, 1)),), mode="strict"))


# ----------------------------------------------------------------------------------------------------
# Layerwise reloads: a layer touched again after its after_layer()


@pytest.mark.parametrize("mode", MODES)
def test_a_tied_layer_whose_weight_is_written_again_after_after_layer_is_not_committed(mode: str) -> None:
    """Layer 1 holds layer 0's derived tensor (a tie: embedding and head), both declared, so the captured storage is
    shared across sealed layers and its restore waits for ``finish()``. A layerwise reload: before_layer, load,
    PWAL, after_layer for each layer; then layer 0's weight is written again with other values (a late shard) and
    PWAL is not run again. The derived tensor PWAL made holds values of the superseded weight; a cold model on the
    final weight holds others. graphsafe commits: the deferred restore copies PWAL's stale tensor and no check
    looks at what changed after the layer's after_layer (layers restored there are checked, deferred ones are not).
    The promise: never committed while a captured address holds other values than a cold model's."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=2, cols=3, slots=(SlotSpec("d0", declare="graph_visible"),)),
            LayerSpec(rows=2, cols=3, slots=(SlotSpec("d0", kind="tie", of=0, declare="graph_visible"),)),
        ),
        mode=mode,
        layerwise="rewrite_new",
        touch=0,
    )
    _assert_honest(scenario)


def test_a_child_held_slot_whose_weight_is_written_again_after_after_layer_is_not_committed() -> None:
    """The same through one layer: ``d0`` is held by a child module (``sub.d0``, a sealed layer of its own) and
    ``d1`` is a view of it held by the parent, so the storage is shared across sealed layers and restored at
    ``finish()``. The weight is written again with other values after ``after_layer()``, PWAL not run again: the
    reload commits (migrate) with ``d0`` computed from the superseded weight."""
    slots = (SlotSpec("d0", holder="child", declare="graph_visible"), SlotSpec("d1", kind="tail", of=0))
    _assert_honest(Scenario(layers=(LayerSpec(rows=2, cols=3, slots=slots),), mode="migrate", layerwise="rewrite_new"))


def test_a_layer_with_findings_whose_weight_is_written_again_after_after_layer_is_not_needs_recapture() -> None:
    """Layerwise, migrate: PWAL keeps the old derived tensor itself at a new attribute and rebinds ``d0``
    (``stash_ref``), so ``after_layer()`` finds the captured tensor held elsewhere and leaves the layer with a
    finding (not closed). Then the weight is written again with other values and PWAL is not run again. The reload
    ends NEEDS_RECAPTURE, but the model holds ``d0`` computed from the superseded weight: a recapture reads wrong
    values. A layer left with findings is not watched after its after_layer() either. The promise: NEEDS_RECAPTURE
    only when the model's own values are right (else FAILED)."""
    slots = (SlotSpec("d0", mutation="stash_ref"),)
    _assert_honest(Scenario(layers=(LayerSpec(rows=1, cols=1, slots=slots),), mode="migrate", layerwise="rewrite_new"))


# ----------------------------------------------------------------------------------------------------
# PWAL under inference mode


class _Inference(nn.Module):
    wt: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3), requires_grad=False)


@graph_visible("wt")
def _pwal_inference(layer: _Inference) -> None:
    with torch.inference_mode():
        layer.wt = layer.weight.t().contiguous()


def test_a_pwal_that_repoints_an_inference_tensor_with_data_does_not_crash_the_reload() -> None:
    """The first load's PWAL runs under ``torch.inference_mode()`` (so ``wt`` is an inference tensor); the reload's
    PWAL, outside it, repoints the same object at new memory (``wt.data = new``). torch then refuses the object's
    version counter (``RuntimeError: Inference tensors do not track version counter``), and the reload raises that
    RuntimeError out of graphsafe's restore (``version_of``, graphsafe/contract/_samples.py:279). The promise:
    graphsafe raises only its own errors; a tensor it cannot read is a finding (fail closed), not a crash."""
    layer = _Inference()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2, 3))
    _pwal_inference(layer)
    contract = GraphContract(layer, "strict").seal()
    try:
        with contract.reload():
            with torch.no_grad():
                layer.weight.copy_(torch.randn(2, 3))
            layer.wt.data = layer.weight.t().contiguous()
    except GraphSafeError:
        pass
    assert (
        contract.last_outcome is None
        or contract.last_outcome.status.name != "COMMITTED"
        or torch.equal(layer.wt, layer.weight.t())
    )


@pytest.mark.parametrize("mode", MODES)
def test_an_attribute_naming_the_rebound_weight_follows_it_to_the_captured_parameter(mode: str) -> None:
    """The loader binds a new Parameter at ``weight`` (``layer.weight = nn.Parameter(new)``); PWAL writes ``d0``'s
    new values into its captured tensor in place and hangs the weight on it (``d0.fz_attr = layer.weight``, as a
    kernel object keeps a reference to its parameter), an attribute it did not carry at the seal (PWAL sets it only
    where a condition on the weights holds: false for the first load's, true for the reload's). graphsafe copies
    the new Parameter's values into the captured one and binds that back at ``weight``, but ``d0`` is not rebound,
    so its attribute is never remapped: after the commit ``d0.fz_attr`` is the orphaned new Parameter, not the
    tensor at ``weight`` (a later in-place load reaches one and not the other). The promise: after a commit an
    attribute naming another slot's new tensor names that slot's captured tensor, the one at its path (found as
    ``committed, attribute wrong``, no permutation)."""
    slots = (SlotSpec("d0", mutation="inplace", attr="peer", attr_of=-1, attr_when="cond"),)
    _assert_honest(Scenario(layers=(LayerSpec(rows=1, cols=1, slots=slots, loader="rebind"),), mode=mode))


# ----------------------------------------------------------------------------------------------------------------
# Shapes of docs/fault-matrix.md's "attributes on a tensor" and "changed after after_layer()", each in its
# smallest form.


def test_a_swapped_slot_carrying_an_attribute_that_names_its_partner() -> None:
    """cycle(d0, d1), ``d1.fz_attr`` names ``d0``'s tensor, strict. An alias-broken slot's kept clone carries the
    class and attributes of the object PWAL made (the take-back rule). The shape as a whole stays out of the fuzzer's
    draws."""
    slots = (
        SlotSpec("d0", source="t", factor=2, declare="graph_visible"),
        SlotSpec("d1", source="t", factor=1, declare="graph_visible", attr="peer", attr_of=0),
    )
    layer = LayerSpec(rows=1, cols=1, slots=slots, cycle=(0, 1))
    _assert_honest(Scenario(layers=(layer,), mode="strict", detect="every-reload", manifest=False))


def test_pwal_run_again_after_after_layer_on_a_layer_that_rotates_its_tensors() -> None:
    """Layerwise, layers.1 rotates d0, d1, d2 and its PWAL runs once more after its after_layer(): the reload
    must not ask for a recapture the model's values cannot give. A slot of a layer closed by
    ``after_layer()`` that holds, when the reload finishes, what another of its slots held at the close (a second
    PWAL permuted them) is ``stale``: FAILED, not a recapture."""
    layer0 = LayerSpec(rows=1, cols=1, slots=(SlotSpec("d0", source="t", factor=1, declare="graph_visible"),))
    slots = (
        SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
        SlotSpec("d1", source="t", factor=2, declare="graph_visible"),
        SlotSpec("d2", source="t", factor=2, declare="graph_visible", subclass=True),
    )
    layer1 = LayerSpec(rows=1, cols=1, slots=slots, cycle=(0, 2, 1))
    scenario = Scenario(
        layers=(layer0, layer1), mode="recapture", detect="every-reload", manifest=False, layerwise="repwal", touch=1
    )
    _assert_honest(scenario)


def test_a_layerwise_reload_with_a_tie_across_two_swapping_layers() -> None:
    """Layerwise, weights kept; layers.0 and layers.1 each swap d0 and d1; layers.1.d2 is a tie to layers.0's d0 that
    PWAL leaves (skip) (seed 733 of the fuzzer's long profile; it needs no attribute draws). layers.0's PWAL wrote d1's
    values into the captured d0 before layers.1's before_layer(), so a snapshot of layers.1 taken there saw them as the
    old state and the tie looked untouched: a recapture through it would read d1's values. A layer whose captured
    storage another layer reads is now snapshotted when the reload begins, as in a whole-model reload, which fails it
    (stale)."""
    layer0 = LayerSpec(
        rows=1,
        cols=1,
        loader="keep",
        cycle=(0, 1),
        slots=(
            SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
            SlotSpec("d1", source="t", factor=2, declare="graph_visible"),
        ),
    )
    layer1 = LayerSpec(
        rows=1,
        cols=1,
        loader="keep",
        cycle=(0, 1),
        slots=(
            SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
            SlotSpec("d1", source="t", factor=1, declare="graph_visible"),
            SlotSpec("d2", kind="tie", of=0, declare="graph_visible", mutation="skip"),
        ),
    )
    scenario = Scenario(
        layers=(layer0, layer1), mode="recapture", detect="every-reload", manifest=False, layerwise="plain"
    )
    _assert_honest(scenario)


def test_a_conditional_weight_attribute_on_a_subclass_view_at_a_child_follows_the_rebound_weight() -> None:
    """Strict, ``declared-only``, under a capture manifest: the loader binds a new Parameter at ``weight`` carrying
    loader metadata; PWAL keeps ``d0`` (a complex subclass at a child module) as a view of its old tensor and, where a
    condition on the new weights holds, hangs the weight on it (``d0.fz_attr``). The reload committed with
    ``d0.fz_attr`` naming the orphaned new Parameter: no slot path names ``d0`` under ``declared-only``, so no remap
    reached it (the attribute of any tensor naming a rebound one is remapped now)."""
    slot = SlotSpec(
        "d0",
        source="complex",
        subclass=True,
        holder="child",
        mutation="view_old",
        attr="peer",
        attr_of=-1,
        attr_when="cond",
    )
    layer = LayerSpec(rows=3, cols=1, slots=(slot,), loader="rebind", meta="load")
    _assert_honest(Scenario(layers=(layer,), mode="strict", detect="declared-only", manifest=True))
