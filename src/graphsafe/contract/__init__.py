"""The reload contract (private modules; public names are re-exported by :mod:`graphsafe`)."""

from graphsafe.contract._contract import GraphContract, RecaptureHandle, ReloadTransaction
from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, SlotInfo, Status

__all__ = [
    "Finding",
    "FindingKind",
    "GraphContract",
    "RecaptureHandle",
    "ReloadOutcome",
    "ReloadTransaction",
    "SlotInfo",
    "Status",
]
