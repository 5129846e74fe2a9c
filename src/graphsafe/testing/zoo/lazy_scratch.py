"""Lazy MoE permute scratch: models vLLM's MoE permute/unpermute workspace allocated on the first forward.

The scratch that holds the expert-sorted tokens is not made by PWAL: the first forward after a load allocates it
(during warm-up, before capture) and keeps it at ``layer._permute_scratch``. The legacy PWAL resets it to
``None`` -- so the first forward after every reload allocates a new one -- and re-derives the expert weight
layout ``w_t``. The migrated layer allocates the scratch through :func:`graphsafe.stable_empty` (the same storage
for the layer every time, declared) and declares ``w_t``.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible, stable_empty
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "MigratedPermuteMoE", "PermuteMoE"]

EXPERTS = 4
#: Rows of the scratch (the most tokens one forward may carry).
MAX_TOKENS = 16
SCRATCH = "_permute_scratch"


class PermuteMoE(nn.Module):
    """Legacy: a top-1 MoE that sorts tokens by expert into a lazily allocated scratch."""

    w: nn.Parameter
    router: nn.Parameter
    w_t: torch.Tensor

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w = new_param(EXPERTS, HIDDEN, HIDDEN, device=device)
        self.router = new_param(EXPERTS, HIDDEN, device=device)
        self._permute_scratch: torch.Tensor | None = None

    def _relayout(self) -> None:
        self.w_t = self.w.transpose(1, 2).contiguous()  # (experts, in, out)

    def process_weights_after_loading(self) -> None:
        self._relayout()
        self._permute_scratch = None  # re-allocated by the next forward

    def _allocate_scratch(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(MAX_TOKENS, HIDDEN, dtype=like.dtype, device=like.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._permute_scratch is None:
            self._permute_scratch = self._allocate_scratch(x)
        n = x.shape[0]
        ids = torch.matmul(x, self.router.t()).argmax(-1)
        order = torch.argsort(ids, stable=True)
        permuted = self._permute_scratch[:n]
        torch.index_select(x, 0, order, out=permuted)
        w_tok = self.w_t.index_select(0, ids.index_select(0, order))  # (n, in, out)
        y_sorted = torch.bmm(permuted.unsqueeze(1), w_tok).squeeze(1)
        return torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)  # unpermute


class MigratedPermuteMoE(PermuteMoE):
    """Migrated: stable scratch storage, declared ``w_t``; PWAL leaves the scratch in place."""

    @graph_visible("w_t", derived_from="w")
    def process_weights_after_loading(self) -> None:
        self._relayout()

    def _allocate_scratch(self, like: torch.Tensor) -> torch.Tensor:
        return stable_empty(self, SCRATCH, (MAX_TOKENS, HIDDEN), like.dtype, like.device)


def _make_layer(variant: Variant, device: torch.device) -> nn.Module:
    return MigratedPermuteMoE(device) if variant == "migrated" else PermuteMoE(device)


EXAMPLE = Example(
    name="lazy_permute_scratch",
    models="vLLM MoE permute/unpermute workspace, allocated lazily on the first forward at layer._permute_scratch",
    slot_paths=(SCRATCH, "w_t"),
    make_layer=_make_layer,
    lazy_paths=(SCRATCH,),
)
