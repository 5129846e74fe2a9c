"""Scenarios of the fuzzer's classes (``fuzz.classes``) that are documented gaps, kept as strict xfails, each run
through the fuzzer's harness and independent oracle (:func:`fuzz.harness.run`). They are left out of the draws; a
fix turns its test green (and the strict xfail red), and the fault back on in ``fuzz.classes.FAULTS``."""

from __future__ import annotations

import pytest

from fuzz import oracle
from fuzz.harness import run
from fuzz.models import LayerSpec, Scenario, SlotSpec

MODES = ("strict", "recapture", "migrate")
LAYER = LayerSpec(rows=2, cols=2, slots=(SlotSpec("d0", declare="register_derived"),))


def _assert_honest(scenario: Scenario) -> None:
    result = run(scenario)
    assert result.verdict in (oracle.OK, oracle.FALSE_ALARM), (
        f"{result.verdict}: {result.reason} {result.detail}\n{scenario.describe()}"
    )


@pytest.mark.xfail(strict=True, reason="documented gap: a stale ContextVar-held tensor is untrackable, not stale")
@pytest.mark.parametrize("variant", ["default", "value"])
@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_contextvar_held_tensor_pwal_skips_is_not_recaptured_stale(mode: str, variant: str) -> None:
    """PWAL's guard skips rebuilding the tensor a ContextVar holds (its default, or the value set in the context)
    although the weight changed. No slot path names it (``untrackable``), so the reload asks for a recapture, which
    reads the stale tensor: it should fail (``stale``), as for any slot PWAL skipped."""
    _assert_honest(Scenario(layers=(LAYER,), mode=mode, klass="contextvar", variant=variant, fault="skip"))


@pytest.mark.xfail(strict=True, reason="documented gap: a stale module-level cache entry is orphaned, not stale")
@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_module_level_cache_entry_pwal_skips_is_not_recaptured_stale(mode: str) -> None:
    """PWAL's guard skips rebuilding a module-level cache entry the graph reads although the weight changed. The
    capture manifest finds the read unowned (``orphaned``) and the reload asks for a recapture, which reads the
    stale entry: it should fail (``stale``)."""
    scenario = Scenario(
        layers=(LAYER,), mode=mode, manifest=True, klass="external_cache", variant="plain", fault="skip"
    )
    _assert_honest(scenario)
