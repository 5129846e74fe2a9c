"""What the CUDA graph tests share: a small MLP with a buffer no forward reads, and the warm-up a capture needs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.register_buffer("held_unread", torch.randn(width))  # held, never read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def warm(fn: Any, *args: torch.Tensor) -> None:
    """Run ``fn`` a few times on a side stream, as any CUDA graph capture needs first."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
