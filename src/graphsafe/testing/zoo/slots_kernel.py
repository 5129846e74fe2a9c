"""A ``__slots__`` kernel object: models quantized-linear kernels whose derived tensors live on a small kernel
or config object with ``__slots__`` (no instance ``__dict__``), e.g. an int8 channelwise kernel.

The layer's own PWAL quantizes the weight channelwise and stores the scales and the quantized weight on
``layer.kernel`` (created on the first load, its slots replaced on every later one). A walker that only looks at
``__dict__`` misses them.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe.registry import graph_visible
from graphsafe.testing.zoo.base import HIDDEN, Example, Variant, new_param

__all__ = ["EXAMPLE", "Int8Kernel", "Int8Linear", "MigratedInt8Linear"]


class Int8Kernel:
    """Channelwise int8 kernel state (values kept in float for the CPU)."""

    __slots__ = ("scales", "w_q")

    def __init__(self, scales: torch.Tensor, w_q: torch.Tensor) -> None:
        self.scales = scales
        self.w_q = w_q

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w_q.t()) * self.scales


class Int8Linear(nn.Module):
    """Legacy: PWAL replaces the kernel's slots with new tensors on every load."""

    weight: nn.Parameter

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = new_param(HIDDEN, HIDDEN, device=device)
        self.kernel: Int8Kernel | None = None

    def _quantize(self) -> None:
        scales = self.weight.abs().amax(dim=1) / 127.0
        w_q = torch.round(self.weight / scales[:, None])
        if self.kernel is None:
            self.kernel = Int8Kernel(scales, w_q)
        else:
            self.kernel.scales = scales
            self.kernel.w_q = w_q

    def process_weights_after_loading(self) -> None:
        self._quantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernel is not None, "PWAL has not run"
        return self.kernel.apply(x)


class MigratedInt8Linear(Int8Linear):
    """Migrated: the layer's own PWAL, declared through the slots."""

    @graph_visible("kernel.scales", "kernel.w_q", derived_from="weight")
    def process_weights_after_loading(self) -> None:
        self._quantize()


def _make_layer(variant: Variant, device: torch.device) -> nn.Module:
    return MigratedInt8Linear(device) if variant == "migrated" else Int8Linear(device)


EXAMPLE = Example(
    name="slots_kernel",
    models="a channelwise int8 kernel object with __slots__ holding derived scales (layer.kernel.scales)",
    slot_paths=("kernel.scales", "kernel.w_q"),
    make_layer=_make_layer,
)
