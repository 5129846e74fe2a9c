"""``graphsafe fix TARGET``: the report of ``graphsafe report``, written into the source of the classes it names.

Prints a unified diff on stdout and writes nothing; ``--write`` writes every file or none. What it cannot place
(and what the report finds that no line of code fixes: unowned storage, untrackable places) is listed on stderr
with the report's own text.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from graphsafe.cli._exit import EXIT_CLEAN, EXIT_FINDINGS, usage
from graphsafe.cli._report_command import prepare_and_reload
from graphsafe.fix import FixError, Patch, propose
from graphsafe.report import MigrationReport, migration_report

__all__ = ["left_by_hand", "run_fix"]


def left_by_hand(report: MigrationReport, patch: Patch) -> list[str]:
    """What the author still has to do, one item per line group: fixes not placed (the report's target, lines and
    note, and why), unowned storage and untrackable places."""
    items = [unplaced.describe() for unplaced in patch.unplaced]
    items += [f"  unowned captured storage: {u.description}" for u in report.unowned]
    items += [f"  untrackable at {u.where}: {u.detail}; fix: {u.fix}" for u in report.untrackable]
    return items


def run_fix(args: argparse.Namespace) -> int:
    """Run ``graphsafe fix`` with parsed ``args``; the exit status."""
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the diff (``graphsafe fix T | patch -p1``)
        prepared = prepare_and_reload(args)
    if isinstance(prepared, int):
        return prepared
    contract, model = prepared
    report = migration_report(contract)
    del model
    try:
        patch = propose(report.fixes)
        if args.write:
            patch.write()
    except FixError as exc:
        return usage(f"fix: {exc}")
    sys.stdout.write(patch.diff())
    todo = left_by_hand(report, patch)
    files = len(patch.files)
    done = f"wrote {files} file(s)" if args.write else f"{files} file(s) would change (--write applies)"
    print(f"graphsafe fix: {len(report.fixes)} fix(es) in the report; {done}", file=sys.stderr)
    if todo:
        print(f"graphsafe fix: {len(todo)} item(s) left to place by hand:", file=sys.stderr)
        print("\n".join(todo), file=sys.stderr)
    return EXIT_CLEAN if not patch.files and not todo else EXIT_FINDINGS
