"""graphsafe: hot weight reload that keeps captured CUDA graphs reading the right memory.

Authors declare graph-visible derived tensors (:func:`graph_visible`, :func:`register_derived`,
:func:`stable_empty`); a :class:`GraphContract` seals them before capture, restores them into the captured
storage after every reload, verifies every address and fails closed. The collectors (:func:`collect`,
:func:`record_capture`, :func:`migration_report`) find what nobody declared; :func:`capture` and :func:`reload`
(the plain-PyTorch adapter, also :class:`GraphRunner`) capture ``torch.cuda.graph`` graphs under a contract and
recapture them when a reload needs it.

The names load lazily (PEP 562): ``import graphsafe`` does not import torch until a name that needs it is used, so
the pytest plugin this package registers costs a test session nothing unless the session uses graphsafe.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from graphsafe.adapters.torch import CapturedGraph, GraphRunner, capture, reload
    from graphsafe.collectors import Manifest, TensorRef, collect, record_capture
    from graphsafe.contract import Finding, FindingKind, GraphContract, ReloadOutcome, ReloadTransaction, Status
    from graphsafe.paths import SlotPath
    from graphsafe.registry import (
        DerivedHandle,
        declared_paths,
        graph_visible,
        register_derived,
        stable_empty,
    )
    from graphsafe.report import MigrationReport, migration_report

__version__ = "0.1.0"

# Where each torch-dependent public name lives.
_LAZY = {
    "CapturedGraph": "graphsafe.adapters.torch",
    "GraphRunner": "graphsafe.adapters.torch",
    "capture": "graphsafe.adapters.torch",
    "reload": "graphsafe.adapters.torch",
    "Manifest": "graphsafe.collectors",
    "MigrationReport": "graphsafe.report",
    "TensorRef": "graphsafe.collectors",
    "collect": "graphsafe.collectors",
    "migration_report": "graphsafe.report",
    "record_capture": "graphsafe.collectors",
    "Finding": "graphsafe.contract",
    "FindingKind": "graphsafe.contract",
    "GraphContract": "graphsafe.contract",
    "ReloadOutcome": "graphsafe.contract",
    "ReloadTransaction": "graphsafe.contract",
    "Status": "graphsafe.contract",
    "DerivedHandle": "graphsafe.registry",
    "SlotPath": "graphsafe.paths",
    "declared_paths": "graphsafe.registry",
    "graph_visible": "graphsafe.registry",
    "register_derived": "graphsafe.registry",
    "stable_empty": "graphsafe.registry",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphsafe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
