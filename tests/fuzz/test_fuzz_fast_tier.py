"""The fast tier (``contract._fast``) against the rule engine: one verdict and the same bytes.

A whole-model restore step the fast tier recognises is planned in one lean pass; every other step goes through the
rule engine. Each generated reload here runs twice, once with ``GraphContract.fast_tier`` on and once off, on
models built from the same seeds: the outcome (status, every finding with its detail, counts), the bytes a replay
reads at every captured address and the bytes the reloaded model's forward reads (and whether at its captured
address) must be equal. The fuzzer's oracle judges the fast run too: no silent success, no crash.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphsafe.contract._steps as steps_module
from fuzz import oracle
from fuzz.harness import run
from fuzz.models import Scenario
from fuzz.strategies import base_scenarios
from graphsafe import Status

PROFILE = os.environ.get("GRAPHSAFE_FUZZ_PROFILE", "graphsafe-fuzz-ci")
EXAMPLES = int(os.environ.get("GRAPHSAFE_FAST_TIER_EXAMPLES", 400))


#: What a tamed derived slot's PWAL does: mostly the common rebuild or rewrite, sometimes one of the faults each
#: condition of the fast tier exists for (the old tensor kept by PWAL, copied aside, re-viewed, rewritten unseen).
TAME_MUTATIONS = st.sampled_from(("rebind", "inplace") * 6 + ("stash_ref", "stash", "view_old"))
#: What a tamed dependent slot (alias, tail, weight view, tie) does: follow its referent, or now and then stay.
TAME_DEPENDENT = st.sampled_from(("rebind",) * 5 + ("skip",))


@st.composite
def whole_model_scenarios(draw: Any) -> Scenario:
    """Whole-model reloads (the only steps the fast tier plans). A third are the fuzzer's scenarios as drawn; the
    rest are tamed toward the common reload (declared slots, PWAL rebuilding or rewriting them, no cycles or
    attributes) with a few of the drawn faults left in, so that both tiers see many steps the
    fast tier plans and many near misses it must hand over."""
    scenario = replace(draw(base_scenarios()), layerwise="none", touch=0)
    if draw(st.integers(0, 2)) == 0:
        return scenario
    # Without a manifest, declared-only trusts the declarations alone (docs/design.md): every slot declared.
    declare_all = scenario.detect == "declared-only"
    layers = []
    for layer in scenario.layers:
        slots = []
        for slot in layer.slots:
            keep = draw(st.integers(0, 11)) == 0  # about one slot in twelve keeps the drawn fault
            if slot.kind == "derived" and not keep:
                slot = replace(slot, mutation=draw(TAME_MUTATIONS), subclass=False, attr="none")
            elif not keep:
                slot = replace(slot, mutation=draw(TAME_DEPENDENT))
            if slot.declare == "none" and (declare_all or (slot.kind == "derived" and not keep)):
                slot = replace(slot, declare="register_derived")
            if declare_all:
                slot = replace(slot, attr="none")  # an attribute's tensor is undeclared
            slots.append(slot)
        layers.append(replace(layer, slots=tuple(slots), cycle=(), meta="none"))
    # Half with a capture manifest (its recorded byte ranges are checked after the copies, in both tiers).
    return replace(scenario, layers=tuple(layers), manifest=draw(st.booleans()), inference="none")


@pytest.fixture
def fast_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per restore step planned while the fixture is active: whether the fast tier planned it."""
    taken: list[bool] = []
    plan_common = steps_module.plan_common

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = plan_common(*args, **kwargs)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(steps_module, "plan_common", spy)
    return taken


def test_the_fast_tier_gives_the_rule_engines_verdict_and_bytes(fast_steps: list[bool]) -> None:
    mismatches: list[str] = []
    lies: list[str] = []
    runs = 0

    @settings(settings.get_profile(PROFILE), max_examples=EXAMPLES)
    @given(whole_model_scenarios())
    def one(scenario: Scenario) -> None:
        nonlocal runs
        fast = run(scenario, fast_tier=True, keep_evidence=True)
        ruled = run(scenario, fast_tier=False, keep_evidence=True)
        runs += 1
        if fast.verdict in (oracle.SILENT, oracle.CRASH):
            lies.append(f"{fast.verdict}: {fast.reason} {fast.detail}\n{scenario.describe()}")
        if not _same(fast.evidence, ruled.evidence):
            mismatches.append(_difference(scenario, fast.evidence, ruled.evidence))

    one()
    taken = sum(fast_steps)
    assert runs > 0
    assert not lies, "\n".join(lies[:3])
    assert not mismatches, f"{len(mismatches)} of {runs} reloads differ between the tiers:\n" + "\n".join(
        mismatches[:3]
    )
    # The comparison means something only where the fast tier planned steps: a fair share of these reloads (alias
    # paths and walker-found slots, which most drawn layers have, are the engine's).
    assert taken >= runs // 20, f"the fast tier planned {taken} of {len(fast_steps)} steps in {runs} reloads"


def _same(fast: tuple[Any, ...], ruled: tuple[Any, ...]) -> bool:
    """Equal evidence; where the reload did not commit, a replay one run found freed and the other alive is not a
    difference (what an uncommitted reload leaves unreferenced is freed when the collector gets to it)."""
    if not fast or not ruled or fast[0][0] is Status.COMMITTED:
        return fast == ruled
    counts, findings, replays, reads = fast
    if (counts, findings, reads) != (ruled[0], ruled[1], ruled[3]) or len(replays) != len(ruled[2]):
        return False
    return all(
        a[0] == b[0] and (a[1] == b[1] or a[1] is None or b[1] is None) for a, b in zip(replays, ruled[2], strict=True)
    )


def _difference(scenario: Scenario, fast: tuple[Any, ...], ruled: tuple[Any, ...]) -> str:
    names = ("counts", "findings", "replays", "reads")
    parts: list[str] = []
    for name, a, b in zip(names, fast, ruled, strict=False):
        if a == b:
            continue
        if name in ("replays", "reads"):  # per read: only the ones that differ
            a_by, b_by = {entry[0]: entry[1:] for entry in a}, {entry[0]: entry[1:] for entry in b}
            for key in sorted(a_by.keys() | b_by.keys()):
                if a_by.get(key) != b_by.get(key):
                    parts.append(f"  {name} {key}: fast {a_by.get(key)!r:.200}\n      rules {b_by.get(key)!r:.200}")
        else:
            parts.append(f"  {name}: fast {a!r:.400}\n      rules {b!r:.400}")
    return scenario.describe() + "\n" + "\n".join(parts)
