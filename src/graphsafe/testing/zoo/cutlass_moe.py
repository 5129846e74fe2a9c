"""CUTLASS MoE strides: models vLLM's ``CutlassExpertsFp8`` built by the FP8 MoE method's modular kernel.

PWAL rebuilds the experts object (``layer.quant_method.moe_kernel.fused_experts``) on every load, with a fresh
int64 stride tensor passed as both ``ab_strides1`` and ``c_strides2`` -- one tensor object under two names, as
vLLM's ``ab_strides1_c_strides2`` is -- and a per-expert weight scale derived from the weights. The forward
gathers each token's expert weight from the flat weight buffer with the strides (index math a grouped GEMM does)
and writes its output rows with ``c_strides2``.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = [
    "EXAMPLE",
    "CutlassExperts",
    "CutlassMoE",
    "CutlassMoEMethod",
    "MigratedCutlassMoEMethod",
    "ModularKernel",
]

EXPERTS = 4
_FE = "quant_method.moe_kernel.fused_experts"
AB_STRIDES1 = f"{_FE}.ab_strides1"
C_STRIDES2 = f"{_FE}.c_strides2"
W1_SCALE = f"{_FE}.w1_scale"


class CutlassExperts:
    """The experts object: strides (one tensor under two names) and the per-expert weight scale."""

    def __init__(self, ab_strides1: torch.Tensor, c_strides2: torch.Tensor, w1_scale: torch.Tensor) -> None:
        self.ab_strides1 = ab_strides1
        self.c_strides2 = c_strides2
        self.w1_scale = w1_scale

    def apply(self, w: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = x.shape
        rows = w.shape[1]
        device = x.device
        row_stride = self.ab_strides1.index_select(0, ids)  # (n,): K for every expert
        base = ids * row_stride * rows
        r = torch.arange(rows, device=device)
        c = torch.arange(k, device=device)
        flat = base[:, None, None] + r[None, :, None] * row_stride[:, None, None] + c[None, None, :]
        w_tok = w.reshape(-1).index_select(0, flat.reshape(-1)).view(n, rows, k)
        y = torch.bmm(w_tok, x.unsqueeze(-1)).squeeze(-1) / self.w1_scale.index_select(0, ids)[:, None]
        out_stride = self.c_strides2.index_select(0, ids)  # (n,): the output row stride
        out_idx = torch.arange(n, device=device)[:, None] * out_stride[:, None] + r[None, :]
        out = torch.zeros(n * rows, dtype=y.dtype, device=device)
        return out.index_copy(0, out_idx.reshape(-1), y.reshape(-1)).view(n, rows)


class ModularKernel:
    """``FusedMoEModularKernel`` stand-in: holds the experts object (rebuilt by PWAL)."""

    def __init__(self) -> None:
        self.fused_experts: CutlassExperts | None = None


class CutlassMoEMethod:
    """Legacy FP8 MoE method: PWAL builds a new experts object with new stride and scale tensors."""

    def __init__(self) -> None:
        self.moe_kernel = ModularKernel()

    def process_weights_after_loading(self, layer: CutlassMoE) -> None:
        w = layer.w
        strides = torch.full((EXPERTS,), w.shape[2], dtype=torch.int64, device=w.device)
        w1_scale = w.abs().amax(dim=(1, 2))
        self.moe_kernel.fused_experts = CutlassExperts(ab_strides1=strides, c_strides2=strides, w1_scale=w1_scale)

    def apply(self, layer: CutlassMoE, x: torch.Tensor) -> torch.Tensor:
        experts = self.moe_kernel.fused_experts
        assert experts is not None, "PWAL has not run"
        ids = torch.matmul(x, layer.router.t()).argmax(-1)
        return experts.apply(layer.w, x, ids)


class MigratedCutlassMoEMethod(CutlassMoEMethod):
    """Migrated: the same PWAL, its three slots (two of them one tensor) declared."""

    @graph_visible(AB_STRIDES1, C_STRIDES2, W1_SCALE, derived_from="w")
    def process_weights_after_loading(self, layer: CutlassMoE) -> None:
        super().process_weights_after_loading(layer)


class CutlassMoE(nn.Module):
    """A top-1 MoE layer of ``EXPERTS`` (HIDDEN x HIDDEN) experts."""

    w: nn.Parameter
    router: nn.Parameter

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.w = new_param(EXPERTS, HIDDEN, HIDDEN, device=device)
        self.router = new_param(EXPERTS, HIDDEN, device=device)
        self.quant_method = MigratedCutlassMoEMethod() if variant == "migrated" else CutlassMoEMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


EXAMPLE = Example(
    name="cutlass_moe_strides",
    models="vLLM CutlassExpertsFp8: ab_strides1 and c_strides2 (one tensor) on an experts object PWAL rebuilds",
    slot_paths=(AB_STRIDES1, C_STRIDES2, W1_SCALE),
    make_layer=CutlassMoE,
)
