"""MLA absorbed projections: models vLLM's ``MLACommonImpl.process_weights_after_loading``.

The attention layer's own PWAL dequantizes ``kv_b_proj.weight``, transposes it, splits it per head and keeps two
views of that one new tensor: ``W_UV`` (heads, latent, v) and ``W_UK_T`` (heads, nope, latent). Both are plain
attributes sharing one storage, neither contiguous. The forward absorbs ``W_UK_T`` into the query and projects
the latent context back with ``W_UV``.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "KVBProj", "MLAAttention", "MigratedMLAAttention"]

HEADS = 2
NOPE = 4
V_DIM = HIDDEN // HEADS  # 8: heads * v_dim == HIDDEN, so layers chain
LATENT = 8


class KVBProj(nn.Module):
    """``kv_b_proj``: a quantized column-parallel linear (weight and per-row scale)."""

    weight: nn.Parameter
    weight_scale: nn.Parameter

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = new_param(HEADS * (NOPE + V_DIM), LATENT, device=device)
        self.weight_scale = new_param(HEADS * (NOPE + V_DIM), device=device)


class MLAAttention(nn.Module):
    """Legacy MLA attention: PWAL re-derives ``W_UV`` and ``W_UK_T`` as views of a new tensor on every load."""

    W_UV: torch.Tensor
    W_UK_T: torch.Tensor

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.kv_b_proj = KVBProj(device)

    def _absorb(self) -> None:
        # Dequantize (a new tensor), then the exact view dance vLLM does.
        kv_b = (self.kv_b_proj.weight * self.kv_b_proj.weight_scale[:, None]).T
        kv_b = kv_b.view(LATENT, HEADS, NOPE + V_DIM)
        w_uk, w_uv = torch.split(kv_b, [NOPE, V_DIM], dim=-1)
        self.W_UV = w_uv.transpose(0, 1)  # (heads, latent, v)
        self.W_UK_T = w_uk.permute(1, 2, 0)  # (heads, nope, latent)

    def process_weights_after_loading(self) -> None:
        self._absorb()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q_nope = x.view(n, HEADS, V_DIM)[..., :NOPE].transpose(0, 1)  # (heads, n, nope)
        q_latent = torch.bmm(q_nope, self.W_UK_T)  # (heads, n, latent)
        out = torch.bmm(torch.tanh(q_latent), self.W_UV)  # (heads, n, v)
        return out.transpose(0, 1).reshape(n, HEADS * V_DIM)


class MigratedMLAAttention(MLAAttention):
    """Migrated: the layer's own PWAL, declared."""

    @graph_visible("W_UV", "W_UK_T", derived_from=("kv_b_proj.weight", "kv_b_proj.weight_scale"))
    def process_weights_after_loading(self) -> None:
        self._absorb()


def _make_layer(variant: Variant, device: torch.device) -> nn.Module:
    return MigratedMLAAttention(device) if variant == "migrated" else MLAAttention(device)


EXAMPLE = Example(
    name="mla_transposed",
    models="vLLM MLACommonImpl: W_UV and W_UK_T, transposed views of the dequantized kv_b_proj weight",
    slot_paths=("W_UV", "W_UK_T"),
    make_layer=_make_layer,
)
