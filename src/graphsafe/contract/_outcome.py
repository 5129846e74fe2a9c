"""Findings and outcomes: the values one reload produces (rendered by reports, never parsed from logs)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from graphsafe.registry._fingerprint import Fingerprint

__all__ = ["Finding", "FindingKind", "ReloadOutcome", "Status"]


class Status(enum.Enum):
    """How a reload ended. Ordered: ``FAILED`` is worse than ``NEEDS_RECAPTURE``, which is worse than
    ``COMMITTED``."""

    COMMITTED = "committed"
    NEEDS_RECAPTURE = "needs_recapture"
    FAILED = "failed"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]

    @classmethod
    def worst(cls, *statuses: Status) -> Status:
        """The most severe of ``statuses`` (``COMMITTED`` when none)."""
        return max(statuses, key=lambda s: s.severity, default=cls.COMMITTED)


_SEVERITY = {Status.COMMITTED: 0, Status.NEEDS_RECAPTURE: 1, Status.FAILED: 2}


class FindingKind(enum.Enum):
    """What went wrong (or, for ``AUTO_RESTORED``, what graphsafe repaired) at one slot."""

    MOVED = "moved"
    VANISHED = "vanished"
    RESPECIFIED = "respecified"
    DEAD = "dead"
    ALIAS_BROKEN = "alias-broken"
    ORPHANED = "orphaned"
    STALE = "stale"
    BUDGET_EXHAUSTED = "budget-exhausted"
    RELOAD_ERROR = "reload-error"
    AUTO_RESTORED = "auto-restored"

    @property
    def recapture_fixes(self) -> bool:
        """Whether capturing the graphs again makes replay correct.

        A new capture reads the model's current tensors, so it fixes any address problem. It cannot fix wrong
        *values* (``stale``) nor a reload that raised halfway (the weights themselves are suspect).
        """
        return self not in (FindingKind.STALE, FindingKind.RELOAD_ERROR)

    @property
    def is_problem(self) -> bool:
        """``False`` only for records of repairs (``auto-restored``)."""
        return self is not FindingKind.AUTO_RESTORED


@dataclass(frozen=True, slots=True)
class Finding:
    """One slot's problem: which layer (qualified name in the model), which path, what kind, before vs after."""

    kind: FindingKind
    layer: str
    layer_class: str
    path: str
    declared: bool
    before: Fingerprint | None = None
    after: Fingerprint | None = None
    detail: str = ""
    rank: int | None = None

    @property
    def where(self) -> str:
        """``layer.qualname:path`` (the layer's name, or ``<model>`` for the root)."""
        return f"{self.layer or '<model>'}:{self.path}"

    def describe(self) -> str:
        """One line naming the layer, the path, what changed and (when known) the old and new fingerprints."""
        who = "declared" if self.declared else "undeclared"
        rank = f"[rank {self.rank}] " if self.rank is not None else ""
        owner = f"{self.layer or '<model>'} ({self.layer_class})"
        text = f"{rank}{self.kind.value}: " + (f"{who} slot {self.path!r} of {owner}" if self.path else owner)
        if self.detail:
            text += f": {self.detail}"
        if self.before is not None:
            text += f"\n    captured: {self.before.describe()}"
        if self.after is not None:
            text += f"\n    now:      {self.after.describe()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        return {
            "kind": self.kind.value,
            "layer": self.layer,
            "layer_class": self.layer_class,
            "path": self.path,
            "declared": self.declared,
            "detail": self.detail,
            "rank": self.rank,
            "before": self.before.to_dict() if self.before is not None else None,
            "after": self.after.to_dict() if self.after is not None else None,
        }


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """The result of one reload under a :class:`~graphsafe.GraphContract`."""

    status: Status
    mode: str
    findings: tuple[Finding, ...] = ()
    slots_restored: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    layers: int = 0
    error: BaseException | None = field(default=None, repr=False, compare=False)
    rank_statuses: tuple[tuple[int, Status], ...] = ()

    @property
    def needs_recapture(self) -> bool:
        """Whether the captured graphs must be captured again before the next replay."""
        return self.status is Status.NEEDS_RECAPTURE

    @property
    def committed(self) -> bool:
        """Whether every graph-visible address was kept and verified."""
        return self.status is Status.COMMITTED

    @property
    def problems(self) -> tuple[Finding, ...]:
        """The findings that are problems (excludes ``auto-restored`` records)."""
        return tuple(f for f in self.findings if f.kind.is_problem)

    @property
    def auto_restored(self) -> tuple[Finding, ...]:
        """Undeclared slots that ``migrate`` mode restored."""
        return tuple(f for f in self.findings if f.kind is FindingKind.AUTO_RESTORED)

    def summary(self) -> str:
        """A few lines: status, counts and the first findings."""
        lines = [
            f"reload {self.status.value} (mode={self.mode}): {self.slots_restored} slot(s) restored, "
            f"{self.bytes_copied} bytes copied, {len(self.problems)} problem(s) in {self.seconds * 1e3:.2f} ms"
        ]
        for finding in self.problems[:10]:
            lines.append("  - " + finding.describe().replace("\n", "\n    "))
        if len(self.problems) > 10:
            lines.append(f"  ... and {len(self.problems) - 10} more")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        return {
            "status": self.status.value,
            "mode": self.mode,
            "needs_recapture": self.needs_recapture,
            "slots_restored": self.slots_restored,
            "bytes_copied": self.bytes_copied,
            "seconds": self.seconds,
            "layers": self.layers,
            "error": repr(self.error) if self.error is not None else None,
            "rank_statuses": [[rank, status.value] for rank, status in self.rank_statuses],
            "findings": [f.to_dict() for f in self.findings],
        }
