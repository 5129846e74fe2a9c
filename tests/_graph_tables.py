"""Shared test helper: recorded kernel-node tables for the ``fake_cuda`` fixture (tests/conftest.py), which stands
in for a captured CUDA graph's nodes when no GPU is present."""

from __future__ import annotations

from typing import Any

import torch


def word(value: int) -> bytes:
    """An 8-byte little-endian kernel parameter word."""
    return value.to_bytes(8, "little")


def kernel_row(*tensors: torch.Tensor, name: str = "grouped") -> dict[str, Any]:
    """A kernel node whose parameters are the data pointers of ``tensors``, one 8-byte word each."""
    params = [word(t.data_ptr()).hex() for t in tensors]
    return {"type": "kernel", "name": name, "layout": [[8 * i, 8] for i in range(len(tensors))], "params": params}


class FakeGraph:
    """A keep_graph CUDAGraph stand-in whose raw graph is the recorded table's root."""

    def raw_cuda_graph(self) -> int:
        return 1
