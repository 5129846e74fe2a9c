"""Call order in a layerwise reload: ``before_layer(layer)`` must come before the layer's load.

A snapshot taken after the load takes the loaded state for the captured one: the freshness check then sees the
weights unchanged, and a PWAL that skipped the rebuild (a guard) commits stale derived values. So a layerwise
transaction stamps every sealed layer's own parameters and buffers when it begins (object identity, version
counter and data pointer: no device sync, O(parameters)) and compares at the layer's first snapshot. A layer whose
stamp changed before its snapshot was loaded out of order (``before_layer()`` late or missing): a
``reload-error`` finding, never a commit. A layer the reload left alone keeps its stamp and needs no call.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn

from graphsafe.contract._samples import version_of

__all__ = ["Stamp", "stamp"]

Stamp = tuple[tuple[int, int, int], ...]


def stamp(layer: nn.Module) -> Stamp:
    """The layer's own parameters and buffers as ``(id, version, data pointer)``; what a load changes."""
    found: list[tuple[int, int, int]] = []
    for tensor in chain(layer._parameters.values(), layer._buffers.values()):
        if isinstance(tensor, torch.Tensor):
            found.append((id(tensor), version_of(tensor), _address(tensor)))
    return tuple(found)


def _address(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.data_ptr()) if tensor.layout is torch.strided else 0
    except RuntimeError:  # a wrapper subclass without storage of its own: identity and version decide
        return 0
