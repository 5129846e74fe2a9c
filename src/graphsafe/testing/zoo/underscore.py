"""Underscore-prefixed derived scales: models FP8 linear/MoE layers that stash ``layer._w_scale_inv`` and
``layer._fc2_input_scale`` (e.g. vLLM's FP8 paths that keep reciprocal scales as private attributes).

A walker that skips private attributes misses them. The layer's own PWAL recomputes both from the scale
parameters; the forward quantizes its input with one and dequantizes its output with the other.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "MigratedScaledLinear", "ScaledLinear"]


class ScaledLinear(nn.Module):
    """Legacy: PWAL replaces the two private scale tensors on every load."""

    weight: nn.Parameter
    weight_scale: nn.Parameter
    input_scale: nn.Parameter
    _w_scale_inv: torch.Tensor
    _fc2_input_scale: torch.Tensor

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.weight_scale = new_param(HIDDEN, device=device)
        self.input_scale = new_param(1, device=device)

    def _rescale(self) -> None:
        self._w_scale_inv = torch.reciprocal(self.weight_scale)
        self._fc2_input_scale = torch.reciprocal(self.input_scale.amax()).reshape(1)

    def process_weights_after_loading(self) -> None:
        self._rescale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q = x * self._fc2_input_scale
        return torch.matmul(x_q, self.weight.t()) * self._w_scale_inv


class MigratedScaledLinear(ScaledLinear):
    """Migrated: the layer's own PWAL, declared."""

    @graph_visible("_fc2_input_scale", "_w_scale_inv", derived_from=("weight_scale", "input_scale"))
    def process_weights_after_loading(self) -> None:
        self._rescale()


def _make_layer(variant: Variant, device: torch.device) -> nn.Module:
    return MigratedScaledLinear(device) if variant == "migrated" else ScaledLinear(device)


EXAMPLE = Example(
    name="underscore_scales",
    models="FP8 layers keeping derived reciprocal scales as private attributes (layer._fc2_input_scale, _w_scale_inv)",
    slot_paths=("_fc2_input_scale", "_w_scale_inv"),
    make_layer=_make_layer,
)
