"""graphsafe: hot weight reload that keeps captured CUDA graphs reading the right memory.

Authors declare graph-visible derived tensors (:func:`graph_visible`, :func:`register_derived`,
:func:`stable_empty`); a :class:`GraphContract` seals them before capture, restores them into the captured
storage after every reload, verifies every address and fails closed. The collectors (:func:`collect`,
:func:`record_capture`, :func:`migration_report`) find what nobody declared; :func:`cuda_graph` stands where
``torch.cuda.graph`` stood and records what the captured graph reads (the kernel scan); :func:`capture` and
:func:`run_reload` (the plain-PyTorch adapter, also :class:`GraphRunner`) capture ``torch.cuda.graph`` graphs under
a contract and recapture them when a reload needs it.

The names load lazily (PEP 562): ``import graphsafe`` does not import torch until a name that needs it is used, so
the pytest plugin this package registers costs a test session nothing unless the session uses graphsafe.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from graphsafe._version import __version__
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
    UnloadedInputWarning,
)

if _TYPE_CHECKING:
    from graphsafe.adapters.torch import CapturedGraph, GraphRunner, capture, recapture_and_reseal, run_reload
    from graphsafe.collectors import Manifest, TensorRef, classify, collect, cuda_graph, record_capture
    from graphsafe.contract import GraphContract, ReloadTransaction
    from graphsafe.devices import DeviceSet, WalkBudget
    from graphsafe.handles import RemovableHandle
    from graphsafe.outcome import Finding, FindingKind, Fingerprint, Origin, ReloadOutcome, SlotInfo, SlotRef, Status
    from graphsafe.paths import SlotPath
    from graphsafe.registry import graph_visible, graph_visible_spec, register_derived, stable_empty
    from graphsafe.report import MigrationReport, migration_report


# Where each torch-dependent public name lives.
_LAZY = {
    "CapturedGraph": "graphsafe.adapters.torch",
    "GraphRunner": "graphsafe.adapters.torch",
    "capture": "graphsafe.adapters.torch",
    "run_reload": "graphsafe.adapters.torch",
    "recapture_and_reseal": "graphsafe.adapters.torch",
    "Manifest": "graphsafe.collectors",
    "TensorRef": "graphsafe.collectors",
    "classify": "graphsafe.collectors",
    "collect": "graphsafe.collectors",
    "cuda_graph": "graphsafe.collectors",
    "record_capture": "graphsafe.collectors",
    "GraphContract": "graphsafe.contract",
    "ReloadTransaction": "graphsafe.contract",
    "DeviceSet": "graphsafe.devices",
    "WalkBudget": "graphsafe.devices",
    "RemovableHandle": "graphsafe.handles",
    "Finding": "graphsafe.outcome",
    "FindingKind": "graphsafe.outcome",
    "Fingerprint": "graphsafe.outcome",
    "Origin": "graphsafe.outcome",
    "ReloadOutcome": "graphsafe.outcome",
    "SlotInfo": "graphsafe.outcome",
    "SlotRef": "graphsafe.outcome",
    "Status": "graphsafe.outcome",
    "SlotPath": "graphsafe.paths",
    "graph_visible": "graphsafe.registry",
    "graph_visible_spec": "graphsafe.registry",
    "register_derived": "graphsafe.registry",
    "stable_empty": "graphsafe.registry",
    "MigrationReport": "graphsafe.report",
    "migration_report": "graphsafe.report",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphsafe' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CapturedGraph",
    "ContractViolation",
    "DeclarationError",
    "DeclaredDriftError",
    "DeviceSet",
    "Finding",
    "FindingKind",
    "Fingerprint",
    "GraphContract",
    "GraphRunner",
    "GraphSafeError",
    "Manifest",
    "MigrationReport",
    "NotServingSafeError",
    "Origin",
    "PathError",
    "PathSyntaxError",
    "RankAgreementError",
    "RecaptureError",
    "ReloadFailedError",
    "ReloadOutcome",
    "ReloadTransaction",
    "RemovableHandle",
    "SlotInfo",
    "SlotPath",
    "SlotRef",
    "Status",
    "TensorRef",
    "UndeclaredDriftError",
    "UnloadedInputWarning",
    "WalkBudget",
    "__version__",
    "capture",
    "classify",
    "collect",
    "cuda_graph",
    "graph_visible",
    "graph_visible_spec",
    "migration_report",
    "recapture_and_reseal",
    "record_capture",
    "register_derived",
    "run_reload",
    "stable_empty",
]
