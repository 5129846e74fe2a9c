"""Declarations: what an author names as graph-visible, held in one weak per-layer store.

Knows nothing about walking, graphs or frameworks. Slot paths live in :mod:`graphsafe.paths`, fingerprints in
:mod:`graphsafe.outcome`.
"""

from graphsafe.registry._declarations import (
    DerivedHandle,
    GraphVisibleSpec,
    declared_paths,
    graph_visible,
    register_derived,
    stable_empty,
)
from graphsafe.registry._store import Declaration, declarations_of

__all__ = [
    "Declaration",
    "DerivedHandle",
    "GraphVisibleSpec",
    "declarations_of",
    "declared_paths",
    "graph_visible",
    "register_derived",
    "stable_empty",
]
