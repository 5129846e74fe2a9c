"""The kinds of fix the report writes (read by the fix generator, the entries and every renderer)."""

from __future__ import annotations

import enum

__all__ = ["FixKind"]


class FixKind(enum.Enum):
    """What a fix asks the author to write."""

    GRAPH_VISIBLE = "graph_visible"  # decorate the PWAL that assigns the paths
    REGISTER_DERIVED = "register_derived"  # call register_derived where each path is assigned
