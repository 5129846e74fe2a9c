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
from graphsafe.paths import SlotPath
from graphsafe.report import FixKind, MigrationReport, migration_report
from graphsafe.testing.zoo import EXAMPLES, VARIANTS, Example, Variant

__all__ = ["FIRST_SEED", "NEW_SEED", "Case", "Harm", "run_case", "run_demo", "upstream_harm", "upstream_moves"]

#: Seed of the first load, and of the reload: different values, so staleness cannot hide.
FIRST_SEED = 0
NEW_SEED = 1

_MODE_BLURBS: dict[Mode, str] = {
    "strict": "any drift raises; replays are refused until you recapture, then reseal()",
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
    #: Relative error of the forward after a committed reload against a cold build on the new weights.
    replay_error: float | None = None

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


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` (Frobenius norms), the size of a wrong answer relative to the right one."""
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


@dataclass(frozen=True, slots=True)
class Harm:
    """What a plain reload (no contract) does to a captured graph of one example, measured on the CPU stand-in."""

    example: str
    #: Derived tensors at a new address after the reload, out of all of them.
    moved: int
    total: int
    #: Relative error of a replay of the captured forward against a model built cold on the new weights. The
    #: replay reads what the graph captured: the parameters (copied in place, so new) and the derived tensors the
    #: capture saw (kept alive here, so their old values: the best case; freed memory can hold anything).
    replay_error: float


def upstream_harm(ex: Example) -> Harm:
    """Load, warm up, "capture" (keep the derived tensors the forward read), reload with no contract, replay.

    The replay is the forward run on the derived tensors of the capture, put back at their slot paths: the memory a
    captured CUDA graph would still read. Derived tensors no slot path reaches (a module-level cache) are read by
    the forward itself, as the graph would.
    """
    model = ex.build("legacy", seed=FIRST_SEED)
    x = ex.example_input(model)
    with torch.no_grad():
        ex.forward(model, x)
        captured = [ex.derived(layer) for layer in ex.layers(model)]
        ex.load_weights(model, ex.make_weights(model, NEW_SEED))
        moved = 0
        for layer, before in zip(ex.layers(model), captured, strict=True):
            after = ex.derived(layer)
            for name, tensor in before.items():
                now = after.get(name)
                if now is None or now.data_ptr() != tensor.data_ptr():
                    moved += 1
                    if name in ex.slot_paths:
                        SlotPath(name).assign(layer, tensor)
        replay = ex.forward(model, x)
        reference = ex.build("legacy", seed=NEW_SEED)
        ex.forward(reference, x)
        error = _relative_error(replay, ex.forward(reference, x))
    return Harm(ex.name, moved, sum(len(before) for before in captured), error)


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
    replay_error: float | None = None
    if outcome is not None and outcome.committed:
        reference = ex.build(variant, seed=NEW_SEED)
        with torch.no_grad():
            ex.forward(reference, x)
            actual, expected = ex.forward(model, x), ex.forward(reference, x)
            fresh = torch.allclose(actual, expected)
            replay_error = _relative_error(actual, expected)
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
        replay_error=replay_error,
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


def run_demo(out: TextIO | None = None, names: Iterable[str] | None = None, *, verbose: bool = False) -> int:
    """Run the demo over the zoo (or the examples in ``names``); 0 when every result is the expected one.

    By default it prints one screen: the measured harm of a plain reload, what each mode did, where to go next.
    ``verbose`` prints the full matrix (every example under every mode, and each legacy example's fixes).
    """
    stream = out if out is not None else sys.stdout
    examples = [EXAMPLES[name] for name in (names if names is not None else EXAMPLES)]
    start = time.perf_counter()
    modes: tuple[Mode, ...] = get_args(Mode)
    cases = [run_case(ex, variant, mode) for mode in modes for ex in examples for variant in VARIANTS]
    if verbose:
        _write_matrix(stream, examples, cases)
    else:
        _write_summary(stream, examples, cases)
    return _write_verdict(stream, cases, time.perf_counter() - start)


def _percent(value: float) -> str:
    return f"{value * 100:.0f}%" if value >= 0.01 else f"{value * 100:.1g}%"


def _write_summary(stream: TextIO, examples: list[Example], cases: list[Case]) -> None:
    write = stream.write
    harms = sorted((upstream_harm(ex) for ex in examples), key=lambda h: h.replay_error)
    worst = harms[-1]
    median = harms[len(harms) // 2].replay_error
    write(
        f"graphsafe demo: {len(examples)} kernel(s) of the zoo, 2 layers each: load (seed {FIRST_SEED}), capture "
        f"(CPU stand-in), reload (seed {NEW_SEED}).\n\n"
    )
    write(
        f"Without graphsafe: the reload moves {sum(h.moved for h in harms)} of {sum(h.total for h in harms)} derived "
        "tensors; a replay of the captured graph reads the old ones\n"
        f"  and is off by {_percent(median)} (median relative error; worst {worst.example}: "
        f"{_percent(worst.replay_error)}), with no error raised.\n\n"
    )
    write("With graphsafe, per mode (legacy: the kernel as written today; migrated: with graphsafe declarations):\n")
    rows: list[list[str]] = []
    for mode in get_args(Mode):
        legacy = [c for c in cases if c.mode == mode and c.variant == "legacy"]
        migrated = [c for c in cases if c.mode == mode and c.variant == "migrated"]
        labels: dict[str, int] = {}
        for case in legacy:
            labels[case.label] = labels.get(case.label, 0) + 1
        legacy_cell = ", ".join(f"{count} {label}" for label, count in labels.items())
        errors = [c.replay_error for c in (*legacy, *migrated) if c.replay_error is not None]
        restored = sum(1 for c in migrated if c.label == "restored")
        rows.append(
            [
                mode,
                f"legacy: {legacy_cell}",
                f"migrated: {restored}/{len(migrated)} restored",
                f"error after commit {_percent(max(errors))}" if errors else "",
            ]
        )
    write("\n".join(_table(rows)) + "\n")
    for mode in get_args(Mode):
        write(f"  {mode}: {_MODE_BLURBS[mode]}\n")
    write(
        "\nNext: `graphsafe report MODULE:CALLABLE` lists what to declare in your model (docs/cli.md);\n"
        "  docs/making-a-kernel-reload-safe.md walks one kernel through it; `graphsafe demo --verbose` prints the "
        "full matrix.\n"
    )


def _write_matrix(stream: TextIO, examples: list[Example], cases: list[Case]) -> None:
    write = stream.write
    write(
        f"graphsafe demo: {len(examples)} example(s) of the zoo, each a 2-layer model in a legacy (nothing declared) "
        f"and a migrated variant,\nloaded with seed {FIRST_SEED}, sealed, warmed up, captured (CPU stand-in), "
        f"then reloaded with seed {NEW_SEED}.\n\n"
    )
    write("upstream reload (no contract): derived tensors at a new address afterwards (a replay reads stale memory)\n")
    rows = [["example", "legacy", "migrated", "legacy replay error"]]
    for ex in examples:
        cells = [ex.name]
        for variant in VARIANTS:
            moved, total = upstream_moves(ex, variant)
            cells.append(f"{moved}/{total} moved")
        cells.append(_percent(upstream_harm(ex).replay_error))
        rows.append(cells)
    write("\n".join(_table(rows)) + "\n")

    for mode in get_args(Mode):
        write(f"\nmode={mode}: {_MODE_BLURBS[mode]}\n")
        rows = [["example", "legacy", "migrated", "legacy report", "ok"]]
        for ex in examples:
            legacy, migrated = (
                next(c for c in cases if (c.example, c.variant, c.mode) == (ex.name, v, mode)) for v in VARIANTS
            )
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


def _write_verdict(stream: TextIO, cases: list[Case], elapsed: float) -> int:
    write = stream.write
    wrong = [case for case in cases if case.unexpected is not None]
    if wrong:
        write(f"\n{len(wrong)} of {len(cases)} result(s) NOT as expected (UNEXPECTED):\n")
        for case in wrong:
            write(
                f"  {case.example} [{case.variant}, mode={case.mode}]: got {case.label}"
                f"{f' ({case.raised.__name__})' if case.raised else ''}, kept={case.kept}, fresh={case.fresh}, "
                f"report: {_report_cell(case.report)}; expected {case.unexpected}\n"
            )
        return EXIT_FINDINGS
    write(f"All {len(cases)} results as expected ({elapsed:.1f} s).\n")
    return EXIT_CLEAN
