"""graphsafe: hot weight reload that keeps captured CUDA graphs reading the right memory.

Authors declare graph-visible derived tensors (:func:`graph_visible`, :func:`register_derived`,
:func:`stable_empty`); a :class:`GraphContract` seals them before capture, restores them into the captured
storage after every reload, verifies every address and fails closed. The collectors (:func:`collect`,
:func:`record_capture`, :func:`migration_report`) find what nobody declared; :func:`capture` and :func:`reload`
(the plain-PyTorch adapter, also :class:`GraphRunner`) capture ``torch.cuda.graph`` graphs under a contract and
recapture them when a reload needs it.
"""

from graphsafe.adapters.torch import CapturedGraph, GraphRunner, capture, reload
from graphsafe.collectors import Manifest, MigrationReport, TensorRef, collect, migration_report, record_capture
from graphsafe.contract import Finding, FindingKind, GraphContract, ReloadOutcome, ReloadTransaction, Status
from graphsafe.errors import (
    ContractViolation,
    DeclarationError,
    DeclaredDriftError,
    GraphSafeError,
    NotServingSafeError,
    PathError,
    PathSyntaxError,
    RankAgreementError,
    RecaptureError,
    ReloadFailedError,
    UndeclaredDriftError,
)
from graphsafe.registry import (
    DerivedHandle,
    SlotPath,
    declared_paths,
    graph_visible,
    register_derived,
    stable_empty,
)

__version__ = "0.1.0"

__all__ = [
    "CapturedGraph",
    "ContractViolation",
    "DeclarationError",
    "DeclaredDriftError",
    "DerivedHandle",
    "Finding",
    "FindingKind",
    "GraphContract",
    "GraphRunner",
    "GraphSafeError",
    "Manifest",
    "MigrationReport",
    "NotServingSafeError",
    "PathError",
    "PathSyntaxError",
    "RankAgreementError",
    "RecaptureError",
    "ReloadFailedError",
    "ReloadOutcome",
    "ReloadTransaction",
    "SlotPath",
    "TensorRef",
    "Status",
    "UndeclaredDriftError",
    "__version__",
    "capture",
    "collect",
    "declared_paths",
    "graph_visible",
    "migration_report",
    "record_capture",
    "register_derived",
    "reload",
    "stable_empty",
]
