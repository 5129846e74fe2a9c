"""Minimal reproducers of the lies the differential fuzzer (``tests/fuzz``) found, one named test each.

Each scenario was shrunk by hypothesis from a fuzzer failure, then trimmed by hand; the docstring says what the
reload does and why the outcome is a lie. Every test runs the scenario through the same harness and independent
oracle as the fuzzer (:func:`fuzz.harness.run`) and asserts the verdict is ``ok``: no silent success (committed
while a replay reads wrong memory, or graphsafe writing values the reload did not produce) and no crash. The
failure message names the verdict, its reason and the scenario. A scenario reads
``d0=t*1@attr [graph_visible]:neg``: slot ``d0`` holds ``weight.t()`` (times 1) at attribute ``d0``, declared with
``@graph_visible``, and the reload's PWAL applies the ``neg`` mutation (see ``tests/fuzz/models.py``).
"""

from __future__ import annotations

import pytest

from fuzz import oracle
from fuzz.harness import run
from fuzz.models import LayerSpec, Scenario, SlotSpec


def _assert_honest(scenario: Scenario) -> None:
    result = run(scenario)
    assert result.verdict in (oracle.OK, oracle.FALSE_ALARM), (
        f"{result.verdict}: {result.reason} {result.detail}\n{scenario.describe()}"
    )


def _one_layer(*slots: SlotSpec, mode: str = "strict", detect: str = "every-reload", **layer: object) -> Scenario:
    return Scenario(
        layers=(LayerSpec(rows=2, cols=3, slots=slots, **layer),),  # type: ignore[arg-type]
        mode=mode,
        detect=detect,
        manifest=detect == "declared-only",
    )


MODES = ("strict", "recapture", "migrate")


# ----------------------------------------------------------------------------------------------------
# Restore order: captured tensors permuted among slots


@pytest.mark.parametrize("mode", MODES)
def test_rotated_captured_tensors_are_not_committed_with_crossed_values(mode: str) -> None:
    """PWAL rotates the captured tensor objects of three declared slots of one geometry (d0 gets d1's tensor, d1
    gets d2's, d2 gets d0's), then writes each slot's new values in place. The model's values are right. Restore
    copies slot by slot: d0's captured storage <- the tensor now at d0 (d1's captured storage), ...; the last copy
    reads d0's captured storage, already overwritten by the first, so d2's captured storage gets d0's values and the
    reload commits. A graph replaying d2 reads d0's values (found as ``rotate``, shrunk from three layers)."""
    slots = (
        SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
        SlotSpec("d1", source="t", factor=2, declare="graph_visible"),
        SlotSpec("d2", source="t", factor=3, declare="graph_visible"),
    )
    _assert_honest(_one_layer(*slots, mode=mode, cycle=(0, 1, 2)))


@pytest.mark.parametrize("mode", MODES)
def test_swapped_captured_tensors_keep_the_values_pwal_wrote(mode: str) -> None:
    """PWAL swaps the captured tensor objects of a declared slot d0 and an undeclared d1 of one geometry, then
    writes each one's new values in place (the model is right). Under ``declared-only`` (with the capture-time
    manifest) restore copies d0's new values into d0's captured storage, which PWAL had handed to d1: d1's values,
    which PWAL got right, are overwritten with d0's. graphsafe wrote into a tensor values the reload did not produce
    for it (found as ``swap``)."""
    slots = (
        SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
        SlotSpec("d1", source="t", factor=2),
    )
    _assert_honest(_one_layer(*slots, mode=mode, detect="declared-only", cycle=(0, 1)))


# ----------------------------------------------------------------------------------------------------
# Fingerprint: conj and neg bits


@pytest.mark.parametrize("mode", MODES)
def test_a_negative_view_of_the_captured_storage_is_not_committed(mode: str) -> None:
    """PWAL writes ``-new`` into the captured storage of d0 and binds ``torch._neg_view`` of it: torch computes
    with the right values, but the memory a captured kernel reads holds their negation. Same storage, pointer,
    shape, stride and dtype as sealed, so the reload commits (found as ``neg``)."""
    _assert_honest(_one_layer(SlotSpec("d0", source="t", declare="graph_visible", mutation="neg"), mode=mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_conjugate_view_of_the_captured_storage_is_not_committed(mode: str) -> None:
    """As the negative view, with a complex slot: ``conj(new)`` written into the captured storage, bound as its
    ``.conj()`` view. The memory holds the conjugate; the reload commits (found as ``conj``)."""
    _assert_honest(_one_layer(SlotSpec("d0", source="complex", declare="graph_visible", mutation="conj"), mode=mode))


# ----------------------------------------------------------------------------------------------------
# Coverage: storage the graph reads beyond the declared view


@pytest.mark.parametrize("mode", MODES)
def test_an_undeclared_base_of_a_declared_view_is_not_committed_stale(mode: str) -> None:
    """d0 (``weight.t()``, undeclared) and d1 (``d0.view(-1)[1:]``, declared) share a storage; PWAL rebuilds both.
    Under ``declared-only`` with the capture-time manifest, restore copies d1's new values into the captured
    storage from offset 1; element 0 (read by the graph through d0) keeps the old value. The manifest sees the
    storage still held by a tracked path and the reload commits (found as ``tail``)."""
    slots = (SlotSpec("d0", source="t"), SlotSpec("d1", kind="tail", of=0, declare="graph_visible"))
    _assert_honest(_one_layer(*slots, mode=mode, detect="declared-only"))


# ----------------------------------------------------------------------------------------------------
# Freshness of undeclared tensors (documented limit in docs/fault-matrix.md, "stale value")


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
def test_an_undeclared_tensor_pwal_skips_is_not_committed_stale(detect: str) -> None:
    """PWAL's "already processed" guard skips rebuilding the undeclared d0 although the weight changed. The slot is
    at its captured storage with the old values: the reload commits and a replay reads stale values. The fault
    matrix documents this as a limit (freshness is checked for declared slots only); the fuzzer counts it as a
    silent success because the promise is absolute (found as ``skip``)."""
    _assert_honest(_one_layer(SlotSpec("d0", source="t", mutation="skip"), detect=detect))
