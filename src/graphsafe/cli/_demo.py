"""The demo job behind ``graphsafe demo``, and the zoo targets of ``graphsafe report``.

For every example of the zoo (:mod:`graphsafe.testing.zoo`), in both variants and under each mode: build (first
load and PWAL), warm up, seal a contract, record a capture of one forward (a CPU stand-in for CUDA graph capture:
:func:`~graphsafe.collectors._manifest.record_capture`), reload with new weights, and check the result against
what graphsafe promises. Beside it, the same reload without a contract (upstream behaviour) shows which addresses
a captured graph would have lost.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TextIO, get_args

import torch
from torch import nn

from graphsafe.collectors._manifest import record_capture
from graphsafe.contract import GraphContract, ReloadOutcome
from graphsafe.contract._contract import Mode
from graphsafe.errors import ContractViolation, UndeclaredDriftError
from graphsafe.report import MigrationReport, migration_report
from graphsafe.testing.zoo import EXAMPLES, Example, Variant

__all__ = [
    "FIRST_SEED",
    "NEW_SEED",
    "Case",
    "ReloadTarget",
    "legacy_zoo",
    "migrated_zoo",
    "run_case",
    "run_demo",
    "upstream_moves",
    "zoo_target",
]

#: Seed of the first load, and of the reload: different values, so staleness cannot hide.
FIRST_SEED = 0
NEW_SEED = 1

_MODE_BLURBS = {
    "strict": "any drift raises; the contract stays unsafe until reseal()",
    "recapture": "drift a new capture fixes gives needs_recapture",
    "migrate": "undeclared drift is restored like declared slots where it can be (auto-restored)",
}


# ----------------------------------------------------------------------------------------------------------------
# Targets (the protocol of `graphsafe report TARGET`).


@dataclass(frozen=True)
class ReloadTarget:
    """What ``graphsafe report`` needs of a model: loaded, reloadable with other weights, and warmed up.

    ``reload(model, seed)`` loads weights made from ``seed`` into the model the way the engine does (in place,
    then PWAL). ``warmup(model)``, if given, runs a forward: the CLI seals right after the load, then warms up
    (as an engine does before capture), so tensors the first forward allocates show as allocated after PWAL.
    """

    model: nn.Module
    reload: Callable[[nn.Module, int], None]
    warmup: Callable[[nn.Module], None] | None = None


def zoo_target(variant: Variant, names: Iterable[str] | None = None) -> ReloadTarget:
    """Every example (or those in ``names``) of ``variant`` in one model: ``model[name]`` is that example's model."""
    examples = {name: EXAMPLES[name] for name in (names if names is not None else EXAMPLES)}
    model = nn.ModuleDict({name: ex.build(variant, seed=FIRST_SEED) for name, ex in examples.items()})

    def reload(model: nn.Module, seed: int) -> None:
        for name, ex in examples.items():
            sub = model.get_submodule(name)
            ex.load_weights(sub, ex.make_weights(sub, seed))

    def warmup(model: nn.Module) -> None:
        with torch.no_grad():
            for name, ex in examples.items():
                sub = model.get_submodule(name)
                ex.forward(sub, ex.example_input(sub))

    return ReloadTarget(model, reload, warmup)


def legacy_zoo() -> ReloadTarget:
    """The zoo as sites are written today (nothing declared): ``graphsafe report graphsafe.cli._demo:legacy_zoo``."""
    return zoo_target("legacy")


def migrated_zoo() -> ReloadTarget:
    """The zoo with graphsafe declarations added: its migration report is empty."""
    return zoo_target("migrated")


# ----------------------------------------------------------------------------------------------------------------
# One example, one variant, one mode.


@dataclass(frozen=True)
class Case:
    """What graphsafe did for one (example, variant, mode), and whether that is what it promises."""

    example: str
    variant: str
    mode: str
    #: ``restored``, ``auto-restored``, ``needs_recapture``, ``failed`` or ``raised``.
    status: str
    error: str | None
    problems: int
    report: MigrationReport
    #: Every derived tensor is at its sealed address after the reload.
    kept: bool
    #: The output equals a cold build on the new weights (checked when the reload committed).
    fresh: bool | None
    #: ``None`` when as expected, else what was expected.
    unexpected: str | None


Addresses = dict[tuple[int, str], int]


def _addresses(ex: Example, model: nn.Module) -> Addresses:
    return {
        (index, name): tensor.data_ptr()
        for index, layer in enumerate(ex.layers(model))
        for name, tensor in ex.derived(layer).items()
    }


def upstream_moves(ex: Example, variant: Variant) -> tuple[int, int]:
    """``(moved, total)`` derived tensors whose address a plain reload (no contract) changes or drops."""
    model = ex.build(variant, seed=FIRST_SEED)
    with torch.no_grad():
        ex.forward(model, ex.example_input(model))
    before = _addresses(ex, model)
    ex.load_weights(model, ex.make_weights(model, NEW_SEED))
    after = _addresses(ex, model)
    return sum(1 for key, ptr in before.items() if after.get(key) != ptr), len(before)


def _status(outcome: ReloadOutcome | None, error: BaseException | None) -> str:
    if error is not None:
        return "raised"
    if outcome is None:
        return "no outcome"
    if outcome.committed:
        return "auto-restored" if outcome.auto_restored else "restored"
    return outcome.status.value


def _expectation(case: Case) -> str | None:
    """What graphsafe promises for this case, or ``None`` when the case keeps the promise."""
    committed_ok = case.kept and case.fresh is True
    if case.variant == "migrated":
        if case.status == "restored" and case.problems == 0 and not case.report.entries and committed_ok:
            return None
        return "restored in place, no finding, an empty report"
    found = not case.report.clean
    if case.mode == "strict":
        ok = case.status == "raised" and case.error == UndeclaredDriftError.__name__ and found
        return None if ok else "raised UndeclaredDriftError with a non-empty report"
    if case.mode == "recapture":
        return None if case.status == "needs_recapture" and found else "needs_recapture with a non-empty report"
    auto = case.status == "auto-restored" and committed_ok and bool(case.report.entries)
    recapture = case.status == "needs_recapture" and found
    return None if auto or recapture else "auto-restored (addresses kept, values fresh) or needs_recapture"


def run_case(ex: Example, variant: Variant, mode: Mode) -> Case:
    """Build, warm up, seal, capture, reload with new weights under ``mode``; judge the result."""
    model = ex.build(variant, seed=FIRST_SEED)
    x = ex.example_input(model)
    # Seal right after the load and its PWAL, then warm up and capture: what the first forward allocates is then
    # known to come after PWAL (the report suggests register_derived for it, not a decorator on PWAL).
    contract = GraphContract(model, mode).seal()
    with torch.no_grad():
        ex.forward(model, x)
        with record_capture(contract, ignore=[x]):
            ex.forward(model, x)
    sealed = _addresses(ex, model)
    error: BaseException | None = None
    try:
        with contract.reload():
            ex.load_weights(model, ex.make_weights(model, NEW_SEED))
    except ContractViolation as exc:
        error = exc
    outcome = contract.last_outcome
    status = _status(outcome, error)
    kept = _addresses(ex, model) == sealed
    fresh: bool | None = None
    if outcome is not None and outcome.committed:
        reference = ex.build(variant, seed=NEW_SEED)
        with torch.no_grad():
            ex.forward(reference, x)
            fresh = torch.allclose(ex.forward(model, x), ex.forward(reference, x))
    case = Case(
        example=ex.name,
        variant=variant,
        mode=mode,
        status=status,
        error=type(error).__name__ if error is not None else None,
        problems=len(outcome.problems) if outcome is not None else 0,
        report=migration_report(contract),
        kept=kept,
        fresh=fresh,
        unexpected=None,
    )
    return Case(**{**case.__dict__, "unexpected": _expectation(case)})


# ----------------------------------------------------------------------------------------------------------------
# Output.


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _report_cell(report: MigrationReport) -> str:
    parts = []
    if report.entries:
        parts.append(f"{len(report.entries)} undeclared")
    if report.unowned:
        parts.append(f"{len(report.unowned)} unowned")
    return ", ".join(parts) or "empty"


def run_demo(out: TextIO | None = None, names: Iterable[str] | None = None) -> int:
    """Run the demo over the zoo (or the examples in ``names``); print tables; 0 when every result is expected."""
    stream = out if out is not None else sys.stdout
    examples = [EXAMPLES[name] for name in (names if names is not None else EXAMPLES)]
    start = time.perf_counter()
    write = stream.write
    write(
        f"graphsafe demo: {len(examples)} example(s) of the zoo, each a 2-layer model in a legacy (nothing declared) "
        f"and a migrated variant,\nloaded with seed {FIRST_SEED}, sealed, warmed up, captured (CPU stand-in), "
        f"then reloaded with seed {NEW_SEED}.\n\n"
    )
    write("upstream reload (no contract): derived tensors at a new address afterwards (a replay reads stale memory)\n")
    rows = [["example", "legacy", "migrated"]]
    for ex in examples:
        cells = [ex.name]
        for variant in ("legacy", "migrated"):
            moved, total = upstream_moves(ex, variant)
            cells.append(f"{moved}/{total} moved")
        rows.append(cells)
    write("\n".join(_table(rows)) + "\n")

    cases: list[Case] = []
    modes: tuple[Mode, ...] = get_args(Mode)
    for mode in modes:
        write(f"\nmode={mode}: {_MODE_BLURBS[mode]}\n")
        rows = [["example", "legacy", "migrated", "legacy report", "ok"]]
        for ex in examples:
            legacy = run_case(ex, "legacy", mode)
            migrated = run_case(ex, "migrated", mode)
            cases += [legacy, migrated]
            ok = "ok" if legacy.unexpected is None and migrated.unexpected is None else "UNEXPECTED"
            rows.append([ex.name, legacy.status, migrated.status, _report_cell(legacy.report), ok])
        write("\n".join(_table(rows)) + "\n")

    write("\nmigration report of each legacy example (migrate mode), fixes grouped by owner:\n")
    for case in cases:
        if case.variant != "legacy" or case.mode != "migrate":
            continue
        write(f"  {case.example}\n")
        for fix in case.report.fixes:
            where = "on" if fix.kind == "graph_visible" else "in"
            write(f"    {where} {fix.target}\n")
            for line in fix.lines:
                write(f"        {line}\n")
        if case.report.unowned:
            write(
                f"    {len(case.report.unowned)} unowned captured storage(s): the capture read memory no layer path "
                "holds; keep it on the layer and declare it, or update it in place\n"
            )
        if case.report.clean:
            write("    (nothing found)\n")

    wrong = [case for case in cases if case.unexpected is not None]
    elapsed = time.perf_counter() - start
    if wrong:
        write(f"\n{len(wrong)} of {len(cases)} result(s) NOT as expected:\n")
        for case in wrong:
            write(
                f"  {case.example} [{case.variant}, mode={case.mode}]: got {case.status}"
                f"{f' ({case.error})' if case.error else ''}, kept={case.kept}, fresh={case.fresh}, "
                f"report: {_report_cell(case.report)}; expected {case.unexpected}\n"
            )
        return 1
    write(f"\nall {len(cases)} results as expected ({elapsed:.1f} s). `graphsafe report` prints the full report.\n")
    return 0
