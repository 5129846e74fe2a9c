"""Copying new values into captured storage, batched.

Small tensors are grouped by (device, dtype) and copied with one ``torch._foreach_copy_`` per group (a per-tensor
``copy_`` costs several microseconds of launch on a GPU); large tensors use ``copy_``, which reaches the copy
bandwidth. Mixing dtypes in one foreach call falls back to a slow path, hence the grouping.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["FOREACH_MAX_BYTES", "copy_pairs"]

#: Tensors at most this large go through the grouped ``_foreach_copy_`` path (see benchmarks/RESULTS.md).
FOREACH_MAX_BYTES = 1 << 20

_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy each ``src`` into its ``dst`` (``dst.copy_(src)`` semantics); return the bytes written."""
    written = 0
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(
        lambda: ([], [])
    )
    with torch.no_grad():
        for dst, src in pairs:
            nbytes = dst.numel() * dst.element_size()
            written += nbytes
            if (
                _HAS_FOREACH_COPY
                and nbytes <= FOREACH_MAX_BYTES
                and src.dtype == dst.dtype
                and src.device == dst.device
            ):
                dsts, srcs = groups[(dst.device, dst.dtype)]
                dsts.append(dst)
                srcs.append(src)
            else:
                dst.copy_(src)
        for dsts, srcs in groups.values():
            if len(dsts) == 1:
                dsts[0].copy_(srcs[0])
            else:
                torch._foreach_copy_(dsts, srcs)
    return written
