"""Collectors: the walker (undeclared tensors reachable from a layer), the capture-time manifest (what a graph
really read) and the migration report.

Collectors read the registry to tell declared from undeclared; they never restore anything themselves.
"""

from graphsafe.collectors._manifest import (
    CapturedStorage,
    GradedStorage,
    Grading,
    Holder,
    Manifest,
    grade,
    record_capture,
)
from graphsafe.collectors._report import MigrationReport, ReportEntry, migration_report
from graphsafe.collectors._walker import TensorRef, WalkResult, collect, walk

__all__ = [
    "CapturedStorage",
    "GradedStorage",
    "Grading",
    "Holder",
    "Manifest",
    "MigrationReport",
    "ReportEntry",
    "TensorRef",
    "WalkResult",
    "collect",
    "grade",
    "migration_report",
    "record_capture",
    "walk",
]
