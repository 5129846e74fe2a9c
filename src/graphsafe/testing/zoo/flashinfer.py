"""FlashInfer SwiGLU constants: models vLLM's ModelOpt NVFP4 MoE with FlashInfer CUTLASS experts.

PWAL folds the input and global weight scales into fp32 per-expert GEMM alphas ``g1_alphas``, ``g2_alphas`` and
the fc2 input quantization scale ``fc2_input_scale`` (a reciprocal), and keeps them on the experts object
``layer.quant_method.fused_experts`` (which outlives reloads; its attributes are replaced). The forward is a top-1
SwiGLU MoE that multiplies by all three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "FlashInferExperts", "FlashInferMoE", "MigratedNvFp4MoEMethod", "NvFp4MoEMethod"]

EXPERTS = 4
INTER = 8
_FE = "quant_method.fused_experts"
G1 = f"{_FE}.g1_alphas"
G2 = f"{_FE}.g2_alphas"
FC2 = f"{_FE}.fc2_input_scale"


class FlashInferExperts:
    """The experts object holding the fp32 SwiGLU constants."""

    def __init__(self) -> None:
        self.g1_alphas: torch.Tensor | None = None
        self.g2_alphas: torch.Tensor | None = None
        self.fc2_input_scale: torch.Tensor | None = None

    def apply(self, layer: FlashInferMoE, x: torch.Tensor) -> torch.Tensor:
        assert self.g1_alphas is not None and self.g2_alphas is not None and self.fc2_input_scale is not None
        ids = torch.matmul(x, layer.router.t()).argmax(-1)
        w13 = layer.w13_weight.index_select(0, ids)  # (n, 2*inter, hidden)
        gate_up = torch.bmm(w13, x.unsqueeze(-1)).squeeze(-1) * self.g1_alphas.index_select(0, ids)[:, None]
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up * self.fc2_input_scale  # quantize the fc2 input
        w2 = layer.w2_weight.index_select(0, ids)  # (n, hidden, inter)
        return torch.bmm(w2, h.unsqueeze(-1)).squeeze(-1) * self.g2_alphas.index_select(0, ids)[:, None]


class NvFp4MoEMethod:
    """Legacy MoE method: PWAL puts new constant tensors on the experts object every load."""

    def __init__(self) -> None:
        self.fused_experts = FlashInferExperts()

    def process_weights_after_loading(self, layer: FlashInferMoE) -> None:
        a13 = layer.w13_input_scale.amax()
        a2 = layer.w2_input_scale.amax()
        fe = self.fused_experts
        fe.g1_alphas = (a13 * layer.w13_weight_scale_2).to(torch.float32)
        fe.g2_alphas = (a2 * layer.w2_weight_scale_2).to(torch.float32)
        fe.fc2_input_scale = torch.reciprocal(a2).reshape(1).to(torch.float32)

    def apply(self, layer: FlashInferMoE, x: torch.Tensor) -> torch.Tensor:
        return self.fused_experts.apply(layer, x)


class MigratedNvFp4MoEMethod(NvFp4MoEMethod):
    """Migrated: the same PWAL, its three constants declared."""

    @graph_visible(
        G1,
        G2,
        FC2,
        derived_from=("w13_input_scale", "w13_weight_scale_2", "w2_input_scale", "w2_weight_scale_2"),
    )
    def process_weights_after_loading(self, layer: FlashInferMoE) -> None:
        super().process_weights_after_loading(layer)


class FlashInferMoE(nn.Module):
    """A top-1 SwiGLU MoE layer with per-expert global scales."""

    w13_weight: nn.Parameter
    w2_weight: nn.Parameter
    router: nn.Parameter
    w13_weight_scale_2: nn.Parameter
    w2_weight_scale_2: nn.Parameter
    w13_input_scale: nn.Parameter
    w2_input_scale: nn.Parameter

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.w13_weight = new_param(EXPERTS, 2 * INTER, HIDDEN, device=device)
        self.w2_weight = new_param(EXPERTS, HIDDEN, INTER, device=device)
        self.router = new_param(EXPERTS, HIDDEN, device=device)
        self.w13_weight_scale_2 = new_param(EXPERTS, device=device)
        self.w2_weight_scale_2 = new_param(EXPERTS, device=device)
        self.w13_input_scale = new_param(EXPERTS, device=device)
        self.w2_input_scale = new_param(EXPERTS, device=device)
        self.quant_method = MigratedNvFp4MoEMethod() if variant == "migrated" else NvFp4MoEMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


EXAMPLE = Example(
    name="flashinfer_swiglu",
    models="vLLM ModelOpt NVFP4 MoE on FlashInfer CUTLASS: fp32 g1_alphas, g2_alphas, fc2_input_scale on the experts",
    slot_paths=(G1, G2, FC2),
    make_layer=FlashInferMoE,
)
