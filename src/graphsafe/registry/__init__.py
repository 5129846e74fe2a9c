"""Declarations, slot paths and fingerprints. Knows nothing about walking, graphs or frameworks."""

from graphsafe.registry._declarations import (
    DerivedHandle,
    GraphVisibleSpec,
    declared_paths,
    graph_visible,
    register_derived,
    stable_empty,
)
from graphsafe.registry._fingerprint import Fingerprint, fingerprint
from graphsafe.registry._paths import SlotPath, format_path, parse_path
from graphsafe.registry._store import Declaration, declarations_of

__all__ = [
    "Declaration",
    "DerivedHandle",
    "Fingerprint",
    "GraphVisibleSpec",
    "SlotPath",
    "declarations_of",
    "declared_paths",
    "fingerprint",
    "format_path",
    "graph_visible",
    "parse_path",
    "register_derived",
    "stable_empty",
]
