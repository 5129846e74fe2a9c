"""Marlin lock workspace: models vLLM's ``MarlinLinearKernel`` (``marlin_make_workspace_new``).

The Marlin GEMM keeps an int32 lock workspace that must be all zeros between launches; PWAL allocates it (and
repacks the weight) on a kernel object held by the quant method held by the layer:
``layer.quant_method.kernel.workspace``. Legacy PWAL allocates a fresh zeroed workspace and a fresh repacked
weight every load; the migrated one takes the workspace from :func:`graphsafe.stable_empty` (same storage every
load, re-zeroed in place) and declares the repacked weight with :func:`graphsafe.graph_visible`.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible, stable_empty
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "MarlinKernel", "MarlinLinear", "MarlinLinearMethod", "MigratedMarlinLinearMethod"]

WORKSPACE = "quant_method.kernel.workspace"
PACKED = "quant_method.kernel.w_packed"
#: Lock counters (Marlin sizes it by SM count; tiny here).
WORKSPACE_SIZE = 32


class MarlinKernel:
    """The kernel object: repacked weight and lock workspace."""

    def __init__(self) -> None:
        self.workspace: torch.Tensor | None = None
        self.w_packed: torch.Tensor | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        assert self.workspace is not None and self.w_packed is not None, "PWAL has not run"
        out = torch.matmul(x, self.w_packed)
        n = out.shape[-1]
        locks = self.workspace[:n]
        # The locks are zero, so this is the identity -- but it reads every lock, as the kernel does: a stale or
        # freed workspace shows in the output (remainder keeps garbage in range, never a device assert).
        cols = torch.remainder(torch.arange(n, device=out.device) + locks.to(torch.int64), n)
        return out.index_select(-1, cols) + locks.to(out.dtype)


class MarlinLinearMethod:
    """Legacy quant method: PWAL makes a new workspace and a new repacked weight on every load."""

    def __init__(self) -> None:
        self.kernel = MarlinKernel()

    def _repack(self, layer: MarlinLinear) -> None:
        # "Repack": fold the per-channel scale in and lay the weight out (in, out).
        self.kernel.w_packed = (layer.weight * layer.weight_scale[:, None]).t().contiguous()

    def process_weights_after_loading(self, layer: MarlinLinear) -> None:
        self.kernel.workspace = torch.zeros(WORKSPACE_SIZE, dtype=torch.int32, device=layer.weight.device)
        self._repack(layer)

    def apply(self, layer: MarlinLinear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(x)


class MigratedMarlinLinearMethod(MarlinLinearMethod):
    """Migrated quant method: the workspace is stable storage, the repacked weight is declared."""

    @graph_visible(PACKED, derived_from=("weight", "weight_scale"))
    def process_weights_after_loading(self, layer: MarlinLinear) -> None:
        self.kernel.workspace = stable_empty(
            layer, WORKSPACE, (WORKSPACE_SIZE,), torch.int32, layer.weight.device, zero=True
        )
        self._repack(layer)


class MarlinLinear(nn.Module):
    """A Marlin-quantized linear layer (weights kept dense for the CPU)."""

    weight: nn.Parameter
    weight_scale: nn.Parameter

    def __init__(self, variant: Variant, device: torch.device) -> None:
        super().__init__()
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.weight_scale = new_param(HIDDEN, device=device)
        self.quant_method = MigratedMarlinLinearMethod() if variant == "migrated" else MarlinLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


EXAMPLE = Example(
    name="marlin_workspace",
    models="vLLM MarlinLinearKernel: the int32 lock workspace and repacked weight on layer.quant_method.kernel",
    slot_paths=(WORKSPACE, PACKED),
    make_layer=MarlinLinear,
)
