"""Collectors: the walker (undeclared tensors reachable from a layer) and the migration report.

Collectors read the registry to tell declared from undeclared; they never restore anything themselves.
"""

from graphsafe.collectors._report import MigrationReport, ReportEntry, migration_report
from graphsafe.collectors._walker import TensorRef, WalkResult, collect, walk

__all__ = ["MigrationReport", "ReportEntry", "TensorRef", "WalkResult", "collect", "migration_report", "walk"]
