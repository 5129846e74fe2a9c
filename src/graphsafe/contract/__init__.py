"""The contract: the only place that mutates a model during a reload and decides its outcome.

:class:`GraphContract` seals what the graphs captured, restores it inside a :class:`ReloadTransaction` and decides
``COMMITTED``, ``NEEDS_RECAPTURE`` or ``FAILED``; with an :class:`Agreement` every rank of a group decides the same.
"""

from graphsafe.contract._agreement import (
    DEFAULT_TIMEOUT,
    SUMMARY_FINDINGS,
    Agreement,
    AgreementGroup,
    KeyValueStore,
    StoreAgreement,
)
from graphsafe.contract._contract import DETECT_POLICIES, MODES, RECORD_POLICIES, Detect, GraphContract, Mode, Record
from graphsafe.contract._samples import version_of
from graphsafe.contract._transaction import ReloadTransaction

__all__ = [
    "DEFAULT_TIMEOUT",
    "DETECT_POLICIES",
    "MODES",
    "RECORD_POLICIES",
    "SUMMARY_FINDINGS",
    "Agreement",
    "AgreementGroup",
    "Detect",
    "GraphContract",
    "KeyValueStore",
    "Mode",
    "Record",
    "ReloadTransaction",
    "StoreAgreement",
    "version_of",
]
