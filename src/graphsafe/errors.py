"""The one exception hierarchy of graphsafe.

Every error names the layer, the slot path and what changed, and says what to do. Contract violations carry
the :class:`~graphsafe.ReloadOutcome` so callers can inspect every finding programmatically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphsafe.outcome import ReloadOutcome

__all__ = [
    "ContractViolation",
    "DeclarationError",
    "DeclaredDriftError",
    "GraphSafeError",
    "NotServingSafeError",
    "PathError",
    "PathSyntaxError",
    "RankAgreementError",
    "RecaptureError",
    "ReloadFailedError",
    "UndeclaredDriftError",
    "UnloadedInputWarning",
]


# Not in __all__ (that lists the error classes, each exported by the package): graphsafe's own modules use it.
def hide_frames_in_pytest(excinfo: Any) -> bool:
    """A module's ``__tracebackhide__``: pytest leaves the module's frames out of a failure's traceback when the
    error is graphsafe's own (a contract violation, a refusal, a declaration error), so the test's line and the
    message are what shows; any other exception (a bug) keeps every frame. ``--full-trace`` shows them all."""
    return isinstance(getattr(excinfo, "value", None), GraphSafeError)


class GraphSafeError(Exception):
    """Base class of every error graphsafe raises."""


class PathSyntaxError(GraphSafeError, ValueError):
    """A slot path is not valid in graphsafe's path grammar."""

    def __init__(self, path: str, position: int, reason: str) -> None:
        self.path = path
        self.position = position
        self.reason = reason
        pointer = " " * position + "^"
        super().__init__(f"bad slot path {path!r} at column {position}: {reason}\n  {path}\n  {pointer}")


class PathError(GraphSafeError, LookupError):
    """A slot path does not resolve (or cannot be assigned) on a layer."""

    def __init__(self, owner: str, path: str, prefix: str, reason: str) -> None:
        self.owner = owner
        self.path = path
        self.prefix = prefix
        self.reason = reason
        super().__init__(f"{owner}: path {path!r} does not resolve: {reason} at {prefix!r}")

    @property
    def failed_at(self) -> str:
        """The shortest prefix of the path whose next step failed."""
        return self.prefix


class DeclarationError(GraphSafeError):
    """An author's declaration is wrong (reported where it was made)."""


class ContractViolation(GraphSafeError):
    """A reload could not keep every graph-visible address; carries the outcome."""

    def __init__(self, message: str, outcome: ReloadOutcome | None = None) -> None:
        self.outcome = outcome
        super().__init__(message)


class DeclaredDriftError(ContractViolation):
    """A declared slot could not be kept at its captured storage and layout."""


class UndeclaredDriftError(ContractViolation):
    """A tensor nobody declared moved, vanished or changed under a reload (strict mode).

    ``graphsafe.migration_report(contract)`` says what to declare, and where.
    """


class ReloadFailedError(ContractViolation):
    """A reload failed in a way a recapture cannot fix (e.g. stale derived values)."""


class NotServingSafeError(ContractViolation):
    """The contract refuses a reload because an earlier one left it unsafe; call ``reseal()`` first."""


class RecaptureError(ContractViolation):
    """A recapture callback failed, so the captured graphs may read stale memory."""


class RankAgreementError(ContractViolation):
    """Ranks did not agree on a reload outcome (a rank failed, or did not arrive in time)."""


class UnloadedInputWarning(GraphSafeError, UserWarning):
    """A note, not a failure: PWAL computed a derived slot only from tensors the reload never wrote (for instance
    a private copy of the first weights), while it wrote other tensors of the layer.

    Issued once, by the reload that records what PWAL reads. The slot may keep stale values no check can see.
    """
