"""Declarations: what an author names as graph-visible, held in one weak per-layer store.

Knows nothing about walking, graphs or frameworks. Slot paths live in :mod:`graphsafe.paths`, fingerprints in
:mod:`graphsafe.outcome`.
"""

from graphsafe.registry._declarations import (
    GRAPH_VISIBLE_ATTR,
    GraphVisibleSpec,
    declare,
    graph_visible,
    graph_visible_spec,
    layer_of_call,
    register_derived,
    stable_empty,
    undeclare,
)
from graphsafe.registry._store import (
    CopyHook,
    Declaration,
    declarations_generation,
    declarations_of,
    declared_layers,
)

__all__ = [
    "CopyHook",
    "GRAPH_VISIBLE_ATTR",
    "Declaration",
    "GraphVisibleSpec",
    "declarations_generation",
    "declarations_of",
    "declared_layers",
    "declare",
    "graph_visible",
    "graph_visible_spec",
    "layer_of_call",
    "register_derived",
    "stable_empty",
    "undeclare",
]
