"""The JSON report the plugin keeps after each reload (and writes to ``GRAPHSAFE_REPORT`` when set)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

from graphsafe.adapters.vllm._state import AdapterState, Session
from graphsafe.outcome import ReloadOutcome

__all__ = ["REPORT_VERSION", "build_report", "write_report"]

REPORT_VERSION = 1


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except (RuntimeError, ValueError):
        return 0


def build_report(state: AdapterState, session: Session, outcome: ReloadOutcome) -> dict[str, Any]:
    """Outcome, migration report (what to declare, and how), and what the adapter itself did in this reload."""
    from graphsafe.report import migration_report

    model = session.model_ref()
    try:
        migration: dict[str, Any] | None = migration_report(outcome, model=model).to_dict()
    except Exception as exc:  # the report is an aid: a bug in it must not hide the outcome
        migration = {"error": repr(exc)}
    pack = state.pack
    return {
        "version": REPORT_VERSION,
        "rank": _rank(),
        "model": type(model).__name__ if model is not None else None,
        "mode": state.config.mode,
        "detect": session.contract.detect,
        "outcome": outcome.to_dict(),
        "migration": migration,
        "serving_safe": session.contract.serving_safe,
        "unsafe_reason": session.contract.unsafe_reason,
        "layers_processed": session.layers_processed,
        "deferred_to_finalize": list(session.deferred),
        "pack_stale": [entry.to_dict() for entry in pack.stale] if pack is not None else [],
    }


def write_report(path: str, report: dict[str, Any]) -> str:
    """Write ``report`` as JSON to ``path`` (``{rank}`` replaced by the rank), atomically; returns the path."""
    target = path.replace("{rank}", str(report.get("rank", 0)))
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".graphsafe-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(report, handle, indent=2, default=str)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a half-written report
        raise
    return target
