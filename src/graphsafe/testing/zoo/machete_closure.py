"""Machete act-order permutation in a closure: models vLLM's ``MacheteLinearKernel`` (``self.act_perm = lambda
x: x[:, perm]``).

PWAL (a plain function ``(layer)``) sorts ``g_idx`` and captures the permutation in a closure
``layer.act_fn``; the tensor sits in closure cell ``act_fn.__closure__[i]``, where ``i`` is the position of
``act_perm`` in the inner function's ``co_freevars`` (computed below, not assumed).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = [
    "EXAMPLE",
    "PERM",
    "PERM_CELL",
    "MacheteClosureLinear",
    "make_act_fn",
    "process_machete_closure",
    "process_machete_closure_migrated",
]


def make_act_fn(act_perm: torch.Tensor, n_cols: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The permuting closure; it captures ``act_perm`` (a tensor) and ``n_cols`` (an int)."""

    def act_fn(x: torch.Tensor) -> torch.Tensor:
        return x[..., :n_cols].index_select(-1, act_perm)

    return act_fn


def _cell_index(outer: Callable[..., object], inner: str, name: str) -> int:
    for const in outer.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == inner:
            return const.co_freevars.index(name)
    raise LookupError(f"{outer.__qualname__} defines no function {inner!r}")


#: Closure cell of ``act_perm``: the cell order is the inner code object's ``co_freevars`` (CPython sorts them by
#: name), so derive the index instead of assuming it.
PERM_CELL = _cell_index(make_act_fn, "act_fn", "act_perm")
PERM = f"act_fn.__closure__[{PERM_CELL}]"


def _bind_act_perm(layer: MacheteClosureLinear) -> None:
    layer.act_fn = make_act_fn(torch.argsort(layer.g_idx, stable=True), HIDDEN)


def process_machete_closure(layer: MacheteClosureLinear) -> None:
    """Legacy PWAL: a new closure over a new permutation on every load."""
    _bind_act_perm(layer)


@graph_visible(PERM, derived_from="g_idx")
def process_machete_closure_migrated(layer: MacheteClosureLinear) -> None:
    """Migrated PWAL: the same, declared through the closure cell."""
    _bind_act_perm(layer)


class MacheteClosureLinear(nn.Module):
    """A Machete act-order linear layer whose input permutation is a closure."""

    weight: nn.Parameter
    g_idx: nn.Parameter
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.variant = variant
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.g_idx = new_param(HIDDEN, device=device, dtype=torch.int32)

    def process_weights_after_loading(self) -> None:
        if self.variant == "migrated":
            process_machete_closure_migrated(self)
        else:
            process_machete_closure(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.act_fn(x), self.weight.t())


EXAMPLE = Example(
    name="machete_closure",
    models="vLLM MacheteLinearKernel act_perm captured in a lambda closure (act_fn.__closure__[i])",
    slot_paths=(PERM,),
    make_layer=MacheteClosureLinear,
)
