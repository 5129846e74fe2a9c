"""The migration report: what to declare, where, and why (see ``docs/migration-report.md``).

Sits above the contract: it reads a model, a contract or a reload outcome and renders text, markdown, JSON (with
a versioned schema), a tree or a Graphviz graph.
"""

from graphsafe.report._build import (
    FORMATS,
    SCHEMA_ID,
    STABLE,
    Fix,
    MigrationReport,
    ReportEntry,
    UnownedEntry,
    migration_report,
    report_schema,
)

__all__ = [
    "FORMATS",
    "SCHEMA_ID",
    "STABLE",
    "Fix",
    "MigrationReport",
    "ReportEntry",
    "UnownedEntry",
    "migration_report",
    "report_schema",
]
