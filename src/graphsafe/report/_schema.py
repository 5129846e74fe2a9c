"""The JSON document's version and its schema (``schema.json``, JSON Schema draft 2020-12)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Final

__all__ = ["SCHEMA_ID", "report_schema"]

#: The ``schema`` field of the JSON rendering; bumped on any incompatible change (see ``schema.json``).
SCHEMA_ID: Final = "graphsafe.migration-report/1"


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :meth:`~graphsafe.report.MigrationReport.to_dict`."""
    text = resources.files("graphsafe.report").joinpath("schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
