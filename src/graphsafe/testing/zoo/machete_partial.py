"""Machete act-order permutation inside a ``functools.partial``: models vLLM's ``MacheteLinearKernel.act_perm``.

PWAL (a plain function ``(layer)``) sorts ``g_idx`` and binds the permutation -- and a permuted per-column input
scale -- into a partial: ``layer.act_fn = functools.partial(apply_act_perm, col_scale, perm=act_perm)``. The
tensors live at ``act_fn.keywords['perm']`` and ``act_fn.args[0]``, where only a path through the partial
reaches them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "MachetePartialLinear", "apply_act_perm", "process_machete", "process_machete_migrated"]

PERM = "act_fn.keywords['perm']"
COL_SCALE = "act_fn.args[0]"


def apply_act_perm(col_scale: torch.Tensor, x: torch.Tensor, *, perm: torch.Tensor) -> torch.Tensor:
    """Permute the input columns into sorted-group order and scale them."""
    return x.index_select(-1, perm) * col_scale


def _bind_act_perm(layer: MachetePartialLinear) -> None:
    act_perm = torch.argsort(layer.g_idx, stable=True)
    col_scale = layer.input_scale.index_select(0, act_perm)
    layer.act_fn = functools.partial(apply_act_perm, col_scale, perm=act_perm)


def process_machete(layer: MachetePartialLinear) -> None:
    """Legacy PWAL: a new partial holding new tensors on every load."""
    _bind_act_perm(layer)


@graph_visible(PERM, COL_SCALE, derived_from=("g_idx", "input_scale"))
def process_machete_migrated(layer: MachetePartialLinear) -> None:
    """Migrated PWAL: the same, declared through the partial."""
    _bind_act_perm(layer)


class MachetePartialLinear(nn.Module):
    """A Machete act-order linear layer whose input permutation is a partial."""

    weight: nn.Parameter
    g_idx: nn.Parameter
    input_scale: nn.Parameter
    act_fn: functools.partial[torch.Tensor]

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.variant = variant
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.g_idx = new_param(HIDDEN, device=device, dtype=torch.int32)
        self.input_scale = new_param(HIDDEN, device=device)

    def process_weights_after_loading(self) -> None:
        if self.variant == "migrated":
            process_machete_migrated(self)
        else:
            process_machete(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.act_fn(x), self.weight.t())


EXAMPLE = Example(
    name="machete_partial",
    models="vLLM MacheteLinearKernel act_perm, here bound in a functools.partial (keywords['perm'], args[0])",
    slot_paths=(PERM, COL_SCALE),
    make_layer=MachetePartialLinear,
)
