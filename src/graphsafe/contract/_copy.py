"""Copying new values into captured storage, batched.

Copies are grouped by (device, dtype, layout). Small tensors go through one ``torch._foreach_copy_`` per group: a
per-tensor ``copy_`` costs ~7.5 us of launch on a GPU, the grouped call ~0.5 us per tensor. Large tensors use
``copy_``, which reaches the copy bandwidth where ``_foreach_copy_`` does not. Mixing dtypes in one foreach call
falls back to a slow path (15x slower on an H200), hence the grouping.

The threshold (:data:`FOREACH_MAX_BYTES`) was measured on an NVIDIA H200 (torch 2.11, bf16): per tensor, one
``_foreach_copy_`` costs 0.35 us up to 64 KiB, 0.9 us at 1 MiB and 3.4 us at 4 MiB, where a ``copy_`` costs
6.5 us (launch-bound); at 16 MiB ``copy_`` wins (11.3 vs 13.0 us), since the foreach kernel tops out near
1.3 TB/s against ``copy_``'s 1.5-1.8 TB/s. See ``benchmarks/RESULTS.md`` ("copy threshold"). Nothing here
synchronises the device.

A copy always lands on the bytes as stored (:func:`distinct_views`): a lazy conjugate or negative bit that both
sides carry is taken off both (``_foreach_copy_`` is not trusted to honour it), and a broadcast (stride-0)
destination is written through its distinct elements only (writing an expanded view would write one location many
times, which torch refuses).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from graphsafe.outcome import inner_tensors

__all__ = [
    "FOREACH_MAX_BYTES",
    "CopyBatch",
    "byte_span",
    "clone_laid_out",
    "copy_group",
    "distinct_views",
    "overlapping_pairs",
    "plain_layout",
    "span_bytes",
    "span_of",
    "spans_overlap",
]

#: Tensors at most this large go through the grouped ``_foreach_copy_`` path (H200 crossover: 4-16 MiB).
FOREACH_MAX_BYTES = 4 << 20

_HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


def copy_group(dst: torch.Tensor) -> tuple[Any, ...]:
    """The batch group of a destination tensor: copies into one group may share a ``_foreach_copy_`` call."""
    return (dst.device, dst.dtype, dst.layout)


def distinct_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)`` as views that copy byte for byte: shared lazy bits resolved away, broadcast dimensions cut
    to their one distinct element.

    The caller vouches that both have the same geometry (``outcome.geometry_key``): the same bits, and stride 0
    wherever ``dst`` has stride 0 on a dimension longer than 1, so ``src`` holds one value along it and nothing is
    dropped. A pair that breaks that is refused (``ValueError``), never copied into the wrong bytes.
    """
    if dst.is_conj() and src.is_conj():
        dst, src = dst.conj(), src.conj()  # clears the bit: the stored bytes, read as stored
    if dst.is_neg() and src.is_neg():
        dst, src = torch._neg_view(dst), torch._neg_view(src)
    stride = dst.stride()
    if 0 in stride:
        src_stride = src.stride()
        index: list[slice] = []
        for n, d, s in zip(dst.shape, stride, src_stride, strict=True):
            if d == 0 and n > 1:
                if s != 0:
                    raise ValueError("a broadcast destination can only take a source broadcast the same way")
                index.append(slice(0, 1))
            else:
                index.append(slice(None))
        dst, src = dst[tuple(index)], src[tuple(index)]
    return dst, src


def clone_laid_out(tensor: torch.Tensor) -> torch.Tensor:
    """A clone of ``tensor``'s values whose broadcast (stride-0) dimensions stay broadcast and whose lazy conjugate
    and negative bits stay set: ``clone()`` materializes both, and a clone that lost them is the source (or the
    saved bytes) of a destination that has them, which :func:`distinct_views` refuses for a broadcast and torch's
    ``_foreach_copy_`` refuses for a lazy bit."""
    tensor = tensor.detach()
    conj, neg = tensor.is_conj(), tensor.is_neg()
    if conj:
        tensor = tensor.conj()  # the stored bytes, set back on the clone below
    if neg:
        tensor = torch._neg_view(tensor)
    if 0 not in tensor.stride():
        clone = tensor.clone()
    else:
        index = tuple(
            slice(0, 1) if step == 0 and size > 1 else slice(None)
            for size, step in zip(tensor.shape, tensor.stride(), strict=True)
        )
        clone = tensor[index].clone().expand(tensor.shape)
    if neg:
        clone = torch._neg_view(clone)
    if conj:
        clone = clone.conj()
    return clone


def plain_layout(conj: bool, neg: bool, stride: Sequence[int]) -> bool:
    """Whether a plain ``copy_`` into a tensor so laid out writes each of its bytes once: no lazy conjugate or
    negative bit, no broadcast (zero-stride) dimension."""
    return not (conj or neg or 0 in stride)


def _plain(dst: torch.Tensor) -> bool:
    return plain_layout(dst.is_conj(), dst.is_neg(), dst.stride())


def span_of(shape: Sequence[int], stride: Sequence[int], offset: int, itemsize: int) -> tuple[int, int]:
    """:func:`byte_span` of a tensor laid out as given (elements: ``offset``; bytes: ``itemsize``)."""
    if 0 in shape:
        return 0, 0
    extent = 1
    for size, step in zip(shape, stride, strict=True):
        extent += (int(size) - 1) * int(step)
    start = int(offset) * itemsize
    return start, start + extent * itemsize


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage a tensor can read or write: its strided extent (a superset of the
    bytes it really touches, so two spans that do not overlap are certain not to share a byte)."""
    return span_of(tensor.shape, tensor.stride(), int(tensor.storage_offset()), tensor.element_size())


def span_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """A flat uint8 tensor over the bytes of its storage a strided tensor spans (:func:`byte_span`; for a dense
    tensor, whatever its stride order, exactly its bytes), or ``None`` for another layout, an empty tensor or the
    meta device. A digest of it witnesses every byte a write through any alias (``.data``, ``set_``) can change."""
    if tensor.layout is not torch.strided or tensor.is_nested or tensor.device.type == "meta":
        return None
    try:
        if inner_tensors(tensor) is not None:  # a wrapper subclass: its storage is no memory of its own
            return None
        storage = tensor.untyped_storage()
    except (TypeError, RuntimeError, NotImplementedError):
        return None
    start, end = byte_span(tensor)
    if end <= start or end > storage.nbytes():
        return None
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return raw.set_(storage, start, (end - start,), (1,))


def spans_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two byte spans of one storage share a byte."""
    return a[0] < b[1] and b[0] < a[1]


_Item = TypeVar("_Item")


def overlapping_pairs(ranges: Iterable[tuple[Hashable, int, int, _Item]]) -> list[tuple[_Item, _Item]]:
    """Every pair of items whose address ranges ``(device, first address, end, item)`` share a byte, the one that
    starts first first (empty ranges share none)."""
    by_device: dict[Hashable, list[tuple[int, int, _Item]]] = {}
    for device, start, end, item in ranges:
        if end > start:
            by_device.setdefault(device, []).append((start, end, item))
    pairs: list[tuple[_Item, _Item]] = []
    for found in by_device.values():
        found.sort(key=lambda r: r[0])
        active: list[tuple[int, _Item]] = []  # (end, item) of the ranges begun so far
        for start, end, item in found:
            active = [(last, other) for last, other in active if last > start]
            pairs.extend((other, item) for _, other in active)
            active.append((end, item))
    return pairs


class CopyBatch:
    """Copies collected across slots (and layers): ``add`` plans one, ``flush`` launches all that are pending.

    A large copy is launched at once: it is bandwidth-bound, so starting it early lets the device copy while the
    host plans the next slots. Small ones wait for ``flush``, which launches one ``_foreach_copy_`` per group.
    ``written`` counts the bytes of every copy added so far. Callers flush before anything reads captured values
    (an alias check, an input signature) and before returning, so deferring a copy is never observable.
    """

    __slots__ = ("_groups", "pending", "written")

    def __init__(self) -> None:
        self._groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.pending = 0
        self.written = 0

    def add(
        self, dst: torch.Tensor, src: torch.Tensor, group: tuple[Any, ...], nbytes: int, *, plain: bool | None = None
    ) -> None:
        """Plan ``dst.copy_(src)``; the caller vouches that ``src`` has ``dst``'s shape, dtype and device.

        ``group`` is :func:`copy_group` of ``dst`` and ``nbytes`` its size, both known ahead (at seal). A
        destination with a lazy bit or a broadcast dimension is copied through :func:`distinct_views` (and counts
        only its distinct bytes); ``plain`` says whether ``dst`` is free of both, where the caller knows it.
        """
        if not (_plain(dst) if plain is None else plain):
            dst, src = distinct_views(dst, src)
            nbytes = dst.numel() * dst.element_size()
        self.written += nbytes
        if nbytes > FOREACH_MAX_BYTES or not _HAS_FOREACH_COPY:
            with torch.no_grad():
                dst.copy_(src)
            return
        self.pending += 1
        lists = self._groups.get(group)
        if lists is None:
            lists = self._groups[group] = ([], [])
        lists[0].append(dst)
        lists[1].append(src)

    def flush(self) -> None:
        """Launch every pending copy: one ``_foreach_copy_`` per group."""
        if not self.pending:
            return
        groups = self._groups
        self._groups, self.pending = {}, 0
        with torch.no_grad():
            for dsts, srcs in groups.values():
                if len(dsts) == 1:
                    dsts[0].copy_(srcs[0])
                else:
                    torch._foreach_copy_(dsts, srcs)
