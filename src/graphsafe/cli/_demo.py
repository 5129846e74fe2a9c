"""The demo job behind ``graphsafe demo``.

For every example of the zoo (:mod:`graphsafe.testing.zoo`), in both variants and under each mode: build (first
load and PWAL), warm up, seal a contract, record a capture of one forward (a CPU stand-in for CUDA graph capture:
:func:`~graphsafe.collectors.record_capture`), reload with new weights, and check the result against what
graphsafe promises. Beside it, the same reload without a contract (upstream behaviour) shows which addresses a
captured graph would have lost.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO, get_args

import torch
from torch import nn

from graphsafe.cli._exit import EXIT_CLEAN, EXIT_FINDINGS
from graphsafe.collectors import record_capture
from graphsafe.contract import GraphContract, Mode
from graphsafe.errors import ContractViolation, UndeclaredDriftError
from graphsafe.outcome import Status
from graphsafe.report import FixKind, MigrationReport, migration_report
from graphsafe.testing.zoo import EXAMPLES, VARIANTS, Example, Variant

__all__ = ["FIRST_SEED", "NEW_SEED", "Case", "run_case", "run_demo", "upstream_moves"]

#: Seed of the first load, and of the reload: different values, so staleness cannot hide.
FIRST_SEED = 0
NEW_SEED = 1

_MODE_BLURBS: dict[Mode, str] = {
    "strict": "any drift raises; the contract stays unsafe until reseal()",
    "recapture": "drift a new capture fixes gives needs_recapture",
    "migrate": "undeclared drift is restored like declared slots where it can be (auto-restored)",
}

#: Table cells of reloads that did not commit (the demo's own words; every decision uses the enum).
_UNCOMMITTED_CELLS: dict[Status, str] = {Status.NEEDS_RECAPTURE: "needs_recapture", Status.FAILED: "failed"}


# ----------------------------------------------------------------------------------------------------------------
# One example, one variant, one mode.


@dataclass(frozen=True)
class Case:
    """What graphsafe did for one (example, variant, mode), and whether that is what it promises."""

    example: str
    variant: Variant
    mode: Mode
    #: How the reload ended (``None``: no outcome was recorded).
    status: Status | None
    #: The violation the reload raised (strict mode), if any.
    raised: type[ContractViolation] | None
    #: Undeclared slots that migrate mode restored.
    auto_restored: int
    problems: int
    report: MigrationReport
    #: Every derived tensor is at its sealed address after the reload.
    kept: bool
    #: The output equals a cold build on the new weights (checked when the reload committed).
    fresh: bool | None
    #: ``None`` when as expected, else what was expected.
    unexpected: str | None

    @property
    def committed(self) -> bool:
        """Whether the reload committed without raising."""
        return self.raised is None and self.status is Status.COMMITTED

    @property
    def label(self) -> str:
        """The table cell: ``restored``, ``auto-restored``, ``needs_recapture``, ``failed`` or ``raised``."""
        if self.raised is not None:
            return "raised"
        if self.status is None:
            return "no outcome"
        if self.status is Status.COMMITTED:
            return "auto-restored" if self.auto_restored else "restored"
        return _UNCOMMITTED_CELLS[self.status]


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


def _expectation(case: Case) -> str | None:
    """What graphsafe promises for this case, or ``None`` when the case keeps the promise."""
    committed_ok = case.kept and case.fresh is True
    if case.variant == "migrated":
        restored = case.committed and not case.auto_restored
        if restored and case.problems == 0 and not case.report.entries and committed_ok:
            return None
        return "restored in place, no finding, an empty report"
    found = not case.report.clean
    needs_recapture = case.raised is None and case.status is Status.NEEDS_RECAPTURE
    if case.mode == "strict":
        ok = case.raised is UndeclaredDriftError and found
        return None if ok else "raised UndeclaredDriftError with a non-empty report"
    if case.mode == "recapture":
        return None if needs_recapture and found else "needs_recapture with a non-empty report"
    auto = case.committed and case.auto_restored > 0 and committed_ok and bool(case.report.entries)
    if auto or (needs_recapture and found):
        return None
    return "auto-restored (addresses kept, values fresh) or needs_recapture"


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
    raised: type[ContractViolation] | None = None
    try:
        with contract.reload():
            ex.load_weights(model, ex.make_weights(model, NEW_SEED))
    except ContractViolation as exc:
        raised = type(exc)
    outcome = contract.last_outcome
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
        status=outcome.status if outcome is not None else None,
        raised=raised,
        auto_restored=len(outcome.auto_restored) if outcome is not None else 0,
        problems=len(outcome.problems) if outcome is not None else 0,
        report=migration_report(contract),
        kept=kept,
        fresh=fresh,
        unexpected=None,
    )
    return dataclasses.replace(case, unexpected=_expectation(case))


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
        for variant in VARIANTS:
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
            rows.append([ex.name, legacy.label, migrated.label, _report_cell(legacy.report), ok])
        write("\n".join(_table(rows)) + "\n")

    write("\nmigration report of each legacy example (migrate mode), fixes grouped by owner:\n")
    for case in cases:
        if case.variant != "legacy" or case.mode != "migrate":
            continue
        write(f"  {case.example}\n")
        for fix in case.report.fixes:
            where = "on" if fix.kind is FixKind.GRAPH_VISIBLE else "in"
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
                f"  {case.example} [{case.variant}, mode={case.mode}]: got {case.label}"
                f"{f' ({case.raised.__name__})' if case.raised else ''}, kept={case.kept}, fresh={case.fresh}, "
                f"report: {_report_cell(case.report)}; expected {case.unexpected}\n"
            )
        return EXIT_FINDINGS
    write(f"\nall {len(cases)} results as expected ({elapsed:.1f} s). `graphsafe report` prints the full report.\n")
    return EXIT_CLEAN
