"""A derived tensor only a module-level cache holds: models kernels that keep per-layer derived tensors in a
global dict (workspace / lookup-table caches keyed by layer) instead of on the layer.

Nothing reachable from the layer points at the tensor, so no walker or path can find it; only a capture-time
manifest of what the graph read sees it. The legacy PWAL puts a new tensor in the cache every load; the migrated
PWAL writes the new values into the cached tensor in place (``copy_``) and keeps it reachable from the layer
(``layer.folded``, declared), so a model path feeds what the graph reads (a captured read no model path holds is
a finding, however it is written).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from graphsafe.registry import register_derived
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = [
    "EXAMPLE",
    "CachedLinear",
    "cached_weight",
    "process_cached",
    "process_cached_migrated",
]

#: Derived weights by ``id(layer)`` (an entry leaves with its layer).
_DERIVED_CACHE: dict[int, torch.Tensor] = {}


def cached_weight(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The cache entry of ``layer`` (empty before its first PWAL), for tests and tools."""
    tensor = _DERIVED_CACHE.get(id(layer))
    return {} if tensor is None else {f"{__name__}._DERIVED_CACHE[id(layer)]": tensor}


def _derive(layer: CachedLinear) -> torch.Tensor:
    return (layer.weight * layer.weight_scale[:, None]).t().contiguous()


def _put(layer: CachedLinear, tensor: torch.Tensor) -> None:
    key = id(layer)
    if key not in _DERIVED_CACHE:
        weakref.finalize(layer, _DERIVED_CACHE.pop, key, None)
    _DERIVED_CACHE[key] = tensor


def process_cached(layer: CachedLinear) -> None:
    """Legacy PWAL: a new tensor in the cache on every load."""
    _put(layer, _derive(layer))


def process_cached_migrated(layer: CachedLinear) -> None:
    """Migrated PWAL: new values into the cached tensor's own storage, which the layer also holds (``folded``)."""
    fresh = _derive(layer)
    cached = _DERIVED_CACHE.get(id(layer))
    if cached is None:
        _put(layer, fresh)
        layer.folded = fresh
        register_derived(layer, "folded", fresh)
    else:
        cached.copy_(fresh)


class CachedLinear(nn.Module):
    """A linear layer whose folded weight lives in the module cache (and, migrated, at ``folded`` too)."""

    weight: nn.Parameter
    weight_scale: nn.Parameter
    folded: torch.Tensor

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.variant = variant
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.weight_scale = new_param(HIDDEN, device=device)

    def process_weights_after_loading(self) -> None:
        if self.variant == "migrated":
            process_cached_migrated(self)
        else:
            process_cached(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, _DERIVED_CACHE[id(self)])


EXAMPLE = Example(
    name="module_cache",
    models="a module-level dict cache of per-layer derived weights (keyed by id(layer)), unreachable from the layer",
    slot_paths=("folded",),  # the migrated variant's; the legacy one holds nothing at a layer path
    make_layer=CachedLinear,
    unreachable=cached_weight,
)
