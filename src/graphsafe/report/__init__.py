"""The migration report: what to declare, where, and why (see ``docs/migration-report.md``).

Sits above the contract: it reads a model, a contract or a reload outcome and renders text, markdown, JSON (with
a versioned schema), a tree or a Graphviz graph.

* :func:`migration_report` builds a :class:`MigrationReport` from any of the three sources.
* :class:`ReportEntry` (an undeclared tensor), :class:`AliasEntry` (a path restored with the slot it aliases),
  :class:`UnownedEntry` (captured storage no layer holds), :class:`Fix` (the code to add; its :class:`Placement`
  says where the lines go), :class:`Undecided` (the choices where what it saw does not decide the code) and
  :class:`DeclaredProblem` (what failed on a declared slot) are what it holds.
* :data:`FORMATS` names the renderings; :func:`report_schema` is the JSON document's schema (:data:`SCHEMA_ID`).
"""

from graphsafe.report._build import migration_report
from graphsafe.report._entries import (
    STABLE,
    AliasEntry,
    Choice,
    DeclaredProblem,
    Fix,
    MigrationReport,
    ReportEntry,
    Undecided,
    UnownedEntry,
    UntrackableEntry,
)
from graphsafe.report._fix_kind import FixKind, Placement
from graphsafe.report._render import FORMATS
from graphsafe.report._schema import SCHEMA_ID, report_schema

__all__ = [
    "FORMATS",
    "SCHEMA_ID",
    "STABLE",
    "AliasEntry",
    "Choice",
    "DeclaredProblem",
    "Fix",
    "FixKind",
    "Placement",
    "MigrationReport",
    "ReportEntry",
    "Undecided",
    "UnownedEntry",
    "UntrackableEntry",
    "migration_report",
    "report_schema",
]
