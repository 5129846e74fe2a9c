"""Deciding a reload's outcome and acting on it: the status per mode, the listeners told, and the error raised
(``GraphContract._decide``/``_apply``, the violation's message). Functions of a
:class:`~graphsafe.contract.GraphContract`, bound there as its methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphsafe.errors import (
    ContractViolation,
    DeclaredDriftError,
    RankAgreementError,
    RecaptureError,
    ReloadFailedError,
    UndeclaredDriftError,
    UnloadedInputWarning,
    hide_frames_in_pytest,
)
from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, Status

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

if TYPE_CHECKING:
    from graphsafe.contract._contract import GraphContract

__all__: list[str] = []


def _next_step(reason: str | None) -> str:
    """What a refusal adds so that it names the way back (the reason may say it already)."""
    # A reason that names reseal() names its own way back (an empty seal needs no recapture, only a new seal).
    if reason is not None and "reseal()" in reason:
        return ""
    return "; next step: recapture the graphs, then reseal() (graphsafe.capture graphs: graph.recapture_and_reseal())"


_DECLARE_HINT = (
    "\nDeclare them with @graph_visible(...) or register_derived(...); "
    "graphsafe.migration_report(contract) or `graphsafe report` shows how."
)


def _violation(outcome: ReloadOutcome, contract: GraphContract) -> ContractViolation:
    problems = outcome.problems
    remote = [f for f in problems if f.rank is not None]
    undeclared = [f for f in problems if not f.declared]
    header = (
        f"graphsafe {contract.mode} mode: the reload left {len(problems)} graph-visible slot(s) unsafe; "
        "the contract is not serving-safe until the graphs are captured again and reseal() ran."
    )
    body = outcome.summary()
    if remote and contract._decide([f for f in problems if f.rank is None], None) is not Status.FAILED:
        # This rank's own reload would have stood: name the ranks that failed the group (agreement findings).
        ranks = ", ".join(str(r) for r in sorted({f.rank for f in remote if f.rank is not None}))
        return RankAgreementError(
            f"graphsafe: the group's reload failed because of rank(s) {ranks}, so every rank of the group fails "
            f"it; the contract is not serving-safe until the graphs are captured again and reseal().\n{body}",
            outcome,
        )
    if any(not f.kind.recapture_fixes for f in problems):
        moved = any(f.path and f.kind.recapture_fixes and f.kind is not FindingKind.UNTRACKABLE for f in undeclared)
        return ReloadFailedError(f"{header}\n{body}{_DECLARE_HINT if moved else ''}", outcome)
    if undeclared and not remote:
        advice = ""
        if any(f.kind is FindingKind.UNTRACKABLE for f in undeclared):
            advice += (
                "\nUntrackable tensors (no slot path names them) can be neither declared nor restored where they "
                "are: hold them where a path reaches them and declare it; graphsafe.migration_report(contract) "
                "lists them."
            )
        undeclared = [f for f in undeclared if f.kind is not FindingKind.UNTRACKABLE]
        if any(f.path for f in undeclared):
            advice += _DECLARE_HINT
        if any(not f.path for f in undeclared):
            advice += (
                "\nCaptured storage no layer holds (a module-level cache or a library's internal buffer) cannot be "
                "declared: keep it reachable from the layer and declare that path, pass it as a graph input "
                "(ignore=), or vouch for a fixed table no reload changes with contract.manifest.vouch_fixed(tensor)."
            )
        return UndeclaredDriftError(f"{header}\n{body}{advice}", outcome)
    return DeclaredDriftError(f"{header}\n{body}", outcome)


def _unloaded_warning(notes: list[str]) -> UnloadedInputWarning:
    shown = "; ".join(notes[:5]) + (f"; and {len(notes) - 5} more" if len(notes) > 5 else "")
    return UnloadedInputWarning(
        f"graphsafe: PWAL computed {len(notes)} derived slot(s) only from tensors this reload never wrote, while "
        f"it wrote other tensors of their layers: {shown}. If those are copies of earlier weights, the slots keep "
        "values the contract cannot tell are stale: compute them from the loaded tensors "
        "(contract.recorded_inputs() lists what each slot reads)"
    )


def _notify(self: GraphContract, outcome: ReloadOutcome) -> Exception | None:
    """Call every ``on_outcome`` listener; return the first error one raised (raised once the contract acted)."""
    first: Exception | None = None
    for listener in list(self._listeners):
        try:
            listener(outcome)
        except Exception as exc:
            first = first or exc
    return first


def _decide(self: GraphContract, findings: list[Finding], error: BaseException | None) -> Status:
    problems = [f for f in findings if f.kind.is_problem]
    if error is not None:
        return Status.FAILED
    if not problems:
        return Status.COMMITTED
    if all(f.kind.recapture_fixes for f in problems) and self.graphless is not None and self.graphless():
        return Status.COMMITTED  # no captured graph replays: nothing reads the memory the findings name
    if self.mode == "strict" or any(not f.kind.recapture_fixes for f in problems):
        return Status.FAILED
    return Status.NEEDS_RECAPTURE


def _apply(self: GraphContract, outcome: ReloadOutcome, error: BaseException | None) -> None:
    """Turn an (agreed) outcome into the mode's action: commit, recapture, or raise."""
    self.last_outcome = outcome
    self.reloads += 1
    if outcome.status is Status.COMMITTED:
        return
    if outcome.status is Status.NEEDS_RECAPTURE:
        # Unsafe until the reseal below succeeds: a callback or the reseal itself may raise.
        self.mark_unsafe("the reload needs the graphs captured again: recapture, then call reseal()")
        if not self._callbacks:
            return
        for callback in list(self._callbacks):
            try:
                callback(outcome)
            except Exception as exc:
                self.mark_unsafe(f"recapture callback {callback!r} failed: {exc!r}")
                raise RecaptureError(
                    f"recapture after reload failed in {callback!r}: {exc}; the graphs may read stale memory "
                    "(contract not serving-safe until the graphs are captured again and reseal())",
                    outcome,
                ) from exc
        self.note_capture()  # the callbacks are the recapture
        self._seal(recaptured=False)  # the finishing reload holds the lock
        return
    self.mark_unsafe(
        "the last reload failed: " + (repr(error) if error is not None else f"{len(outcome.problems)} finding(s)")
    )
    if error is not None:
        return  # the transaction re-raises the original error
    raise _violation(outcome, self)
