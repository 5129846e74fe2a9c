"""The kinds of fix the report writes and where their lines go (read by the fix generator, the entries, every
renderer and ``graphsafe fix``)."""

from __future__ import annotations

import enum

__all__ = ["FixKind", "Placement"]


class FixKind(enum.Enum):
    """What a fix asks the author to write."""

    GRAPH_VISIBLE = "graph_visible"  # decorate the PWAL that assigns the paths
    REGISTER_DERIVED = "register_derived"  # call register_derived where each path is assigned


class Placement(enum.Enum):
    """Where a fix's lines go in the owner's source, as ``graphsafe fix`` places them."""

    DECORATOR = "decorator"  # each line decorates :attr:`Fix.function` (merged with a graph_visible already there)
    #: each line (one per path, in the order of :attr:`Fix.paths`) right after the statement that assigns its path:
    #: in :attr:`Fix.function` or what it calls when that is set, else anywhere in the owner class
    AFTER_ASSIGNMENT = "after-assignment"
    FUNCTION_END = "function-end"  # the lines, at the end of :attr:`Fix.function`
