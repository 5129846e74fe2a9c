"""Act-order permutation: models vLLM's GPTQ-Marlin act order (``marlin_sort_g_idx``).

With ``desc_act`` checkpoints, PWAL sorts the group index parameter ``g_idx`` and keeps the permutation as a bare
attribute ``layer.g_idx_sort_indices`` (outside ``_parameters``/``_buffers``); every forward permutes the input
columns with it. The PWAL is a plain function ``(layer)``; the migrated one is the same body under
:func:`graphsafe.graph_visible`.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "ActOrderLinear", "process_act_order", "process_act_order_migrated"]

SORT = "g_idx_sort_indices"


def _sort_g_idx(layer: ActOrderLinear) -> None:
    layer.g_idx_sort_indices = torch.argsort(layer.g_idx, stable=True)


def process_act_order(layer: ActOrderLinear) -> None:
    """Legacy PWAL: a new permutation tensor on every load."""
    _sort_g_idx(layer)


@graph_visible(SORT, derived_from="g_idx")
def process_act_order_migrated(layer: ActOrderLinear) -> None:
    """Migrated PWAL: the same, declared."""
    _sort_g_idx(layer)


class ActOrderLinear(nn.Module):
    """A GPTQ act-order linear layer; the weight's input columns are stored in sorted-group order."""

    weight: nn.Parameter
    g_idx: nn.Parameter
    g_idx_sort_indices: torch.Tensor

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.variant = variant
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.g_idx = new_param(HIDDEN, device=device, dtype=torch.int32)

    def process_weights_after_loading(self) -> None:
        # Looked up at call time, so a test can patch the module's function.
        if self.variant == "migrated":
            process_act_order_migrated(self)
        else:
            process_act_order(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_sorted = x.index_select(-1, self.g_idx_sort_indices)
        return torch.matmul(x_sorted, self.weight.t())


EXAMPLE = Example(
    name="act_order",
    models="vLLM GPTQ-Marlin act order: layer.g_idx_sort_indices = argsort(g_idx), a bare attribute",
    slot_paths=(SORT,),
    make_layer=ActOrderLinear,
)
