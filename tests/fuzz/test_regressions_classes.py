"""The freshness of tensors no slot path names (``contract._unnamed``), through the fuzzer's harness and its
independent oracle (:func:`fuzz.harness.run`): a ContextVar-held tensor and a module-level cache entry the graph
reads. PWAL skipping their rebuild while the weight changed must never be recaptured as it is (``stale``, FAILED);
PWAL making a new one, or writing it in place, must still get the recapture (or commit), not a false alarm, where
graphsafe can see it (a ContextVar read where the walk finds it)."""

from __future__ import annotations

import pytest

import fuzz.classes  # noqa: F401  (registers the classes' model makers)
from fuzz import oracle
from fuzz.harness import Result, run
from fuzz.models import LayerSpec, Scenario, SlotSpec

MODES = ("strict", "recapture", "migrate")
LAYER = LayerSpec(rows=2, cols=2, slots=(SlotSpec("d0", declare="register_derived"),))


def _run(scenario: Scenario) -> Result:
    result = run(scenario)
    assert result.verdict in (oracle.OK, oracle.FALSE_ALARM), (
        f"{result.verdict}: {result.reason} {result.detail}\n{scenario.describe()}"
    )
    return result


@pytest.mark.parametrize("manifest", [False, True], ids=["walk", "manifest"])
@pytest.mark.parametrize("variant", ["default", "value"])
@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_contextvar_held_tensor_pwal_skips_is_stale(mode: str, variant: str, manifest: bool) -> None:
    """PWAL's guard skips rebuilding the tensor a ContextVar holds (its default, or the value set in the context)
    although the weight changed. No slot path names it, and a recapture would read it as it is: ``stale``."""
    scenario = Scenario(
        layers=(LAYER,), mode=mode, manifest=manifest, klass="contextvar", variant=variant, fault="skip"
    )
    result = _run(scenario)
    assert result.status == "FAILED", result


@pytest.mark.parametrize("manifest", [False, True], ids=["walk", "manifest"])
@pytest.mark.parametrize("fault", ["new_var", "set", "inplace"])
@pytest.mark.parametrize("variant", ["default", "value"])
def test_a_contextvar_held_tensor_pwal_rebuilds_is_recaptured(variant: str, fault: str, manifest: bool) -> None:
    """PWAL makes a new variable, sets a new value (the old default stays alive in the variable) or writes the held
    tensor in place: the walk finds the new tensor there, or the old one written, so no false ``stale``: the reload
    asks for a recapture (which reads the fresh values)."""
    scenario = Scenario(
        layers=(LAYER,), mode="recapture", manifest=manifest, klass="contextvar", variant=variant, fault=fault
    )
    result = _run(scenario)
    assert result.verdict == oracle.OK, result
    assert result.status == "NEEDS_RECAPTURE", result


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_module_level_cache_entry_pwal_skips_is_stale(mode: str) -> None:
    """PWAL's guard skips rebuilding a module-level cache entry the graph reads although the weight changed. The
    capture manifest finds the read unowned and its bytes unwritten: a recapture would read them, ``stale``."""
    scenario = Scenario(
        layers=(LAYER,), mode=mode, manifest=True, klass="external_cache", variant="plain", fault="skip"
    )
    result = _run(scenario)
    assert result.status == "FAILED", result


@pytest.mark.parametrize(("fault", "status"), [("replace", "NEEDS_RECAPTURE"), ("inplace", "NEEDS_RECAPTURE")])
def test_a_module_level_cache_entry_pwal_writes_or_drops_is_recaptured(fault: str, status: str) -> None:
    """A cache entry PWAL writes in place (bytes changed), or replaces while nothing keeps the old one (freed:
    ``dead``): the recapture reads fresh values, and graphsafe asks for it."""
    scenario = Scenario(
        layers=(LAYER,), mode="recapture", manifest=True, klass="external_cache", variant="plain", fault=fault
    )
    result = _run(scenario)
    assert result.verdict == oracle.OK, result
    assert result.status == status, result


def test_a_module_level_cache_entry_replaced_while_the_old_stays_alive_fails_closed() -> None:
    """PWAL replaces the entry and a rollback list keeps the old one alive, unwritten: nothing graphsafe can see
    tells it from a skip, so the reload fails where a recapture would have read the new entry (documented in
    docs/fault-matrix.md; the oracle counts only a needless failure of a reload that could commit as a false
    alarm)."""
    scenario = Scenario(
        layers=(LAYER,), mode="recapture", manifest=True, klass="external_cache", variant="plain", fault="replace_keep"
    )
    result = _run(scenario)
    assert result.status == "FAILED", result


@pytest.mark.parametrize("fault", ["noop", "inplace_same", "replace_keep"])
def test_a_vouched_fixed_table_is_never_stale(fault: str) -> None:
    """A table vouched for as fixed (``Manifest.vouch_fixed``) is not judged by its bytes: no false ``stale``."""
    scenario = Scenario(
        layers=(LAYER,), mode="recapture", manifest=True, klass="external_cache", variant="vouched", fault=fault
    )
    result = _run(scenario)
    assert result.status != "FAILED", result
