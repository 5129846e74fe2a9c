"""The reload contract (private modules; public names are re-exported by :mod:`graphsafe`)."""

from graphsafe.contract._contract import (
    DETECT_POLICIES,
    MODES,
    Detect,
    GraphContract,
    Mode,
    RecaptureHandle,
    ReloadTransaction,
)
from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, SlotInfo, Status

__all__ = [
    "DETECT_POLICIES",
    "MODES",
    "Detect",
    "Finding",
    "FindingKind",
    "GraphContract",
    "Mode",
    "RecaptureHandle",
    "ReloadOutcome",
    "ReloadTransaction",
    "SlotInfo",
    "Status",
]
