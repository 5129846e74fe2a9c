"""Drift of an undeclared tensor no captured graph reads is reported, not a problem.

A PWAL that re-creates a tensor the forward never reads (a debug copy of the weights) moves a walker-found slot;
without graph truth the contract cannot tell it from a tensor the graph reads, so it fails closed. Where the capture
manifest proves that no captured graph reads any byte of the slot's captured memory
(:meth:`~graphsafe.collectors.Manifest.unread_proof`: the kernel scan, complete; or the dispatch recorder on a device
whose kernels all go through the dispatcher, no custom op seen), the move changes no replay: the finding becomes an
``unread-drift`` record, and the reload commits in every mode. Declared slots, parameters and buffers keep their
findings (an author's declaration, or a weight, is restored whatever reads it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from graphsafe.outcome import Finding, FindingKind, Fingerprint

__all__ = ["excuse_unread_drift"]

#: What drift of an unread tensor may be: it moved, was re-created in another layout, left its path, was freed, or
#: kept old values.
_EXCUSABLE = frozenset(
    {FindingKind.MOVED, FindingKind.RESPECIFIED, FindingKind.VANISHED, FindingKind.DEAD, FindingKind.STALE}
)


def excuse_unread_drift(findings: list[Finding], manifest: object) -> list[Finding]:
    """``findings`` with each undeclared slot's drift that graph truth proves unread turned into a record."""
    prove: Callable[[], Callable[[Fingerprint], bool] | None] | None = getattr(manifest, "unread_proof", None)
    candidates = [f for f in findings if f.kind in _EXCUSABLE and not f.declared and f.path and f.before is not None]
    if not candidates or prove is None:
        return findings
    unread = prove()
    if unread is None:
        return findings
    excused: dict[int, Finding] = {}
    for finding in candidates:
        assert finding.before is not None
        if unread(finding.before):
            excused[id(finding)] = dataclasses.replace(
                finding,
                kind=FindingKind.UNREAD_DRIFT,
                detail=f"{finding.kind.value}, but no captured graph reads its captured memory (graph truth); "
                f"replay is unchanged: {finding.detail}",
            )
    return [excused.get(id(f), f) for f in findings] if excused else findings
