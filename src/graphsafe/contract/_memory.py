"""Where a tensor's bytes live, and who else holds them: the address, overlap and reference-count rules that
the snapshot, the restore plan and the fast tier read (``held_outside``, ``storage_covers``, ``reads_as_captured``)."""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from graphsafe.contract._copy import byte_span, spans_overlap
from graphsafe.contract._samples import flat_copy, version_of
from graphsafe.contract._slots import SealedSlot, _is_wrapper, _view
from graphsafe.outcome import geometry_key, memory_tensors, shape_and_stride

__all__ = ["held_outside", "repointed_inference"]


_NOTHING = torch.empty(0)  # stands in for a captured tensor the snapshot let go of


_STORAGE_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def repointed_inference(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an inference tensor repointed (``.data =``) outside inference mode: no longer an
    inference tensor, yet without a version counter; torch refuses to read it there."""
    return not tensor.is_inference() and version_of(tensor) < 0


def held_outside(tensor: torch.Tensor, *, own: int, storage: Any = None) -> str | None:
    """What besides ``own`` references of the caller's data (and the caller's one local name) holds the captured
    tensor: ``"object"`` (the tensor object itself), ``"base"`` (a view's base), ``"storage-object"`` (its storage's
    Python object: a storage pool), ``"storage"`` (another tensor on its storage), or ``None``. (A DLPack import
    holds the tensor object: ``"object"``; the search then matches its other storage object by address.)

    The cheap look before a copy into captured memory whose slot PWAL moved: normally the snapshot alone still
    holds the old captured tensor. An answer is only a reason to search (a ping-pong buffer kept at an untracked
    path, a storage pool, a caller's reference); the contract's search decides.
    """
    # sys.getrefcount counts its own argument and this function's parameter; the caller's local is one more.
    if sys.getrefcount(tensor) - 3 > own:
        return "object"
    view = tensor._base is not None
    # A view's base: the temporary from ``_base`` and the argument are all when nothing else holds it.
    if view and sys.getrefcount(tensor._base) > 2:
        return "base"
    passed = storage is not None  # the caller's local holds it too
    if storage is None:
        storage = tensor.untyped_storage()
    # The storage's one Python object (torch keeps one per storage): this local, the argument and torch's own.
    if sys.getrefcount(storage) > 3 + passed:
        return "storage-object"
    # One use per tensor on the storage (a view's base is one more) and one for the Python storage object.
    if _STORAGE_USE_COUNT is not None and int(_STORAGE_USE_COUNT(storage._cdata)) > 2 + view:
        return "storage"
    return None


def _memory_lost(captured: torch.Tensor, storage: Any, slot: SealedSlot) -> str | None:
    """Why a copy into ``captured`` (on ``storage``) would not land on the memory the graph reads, or ``None``.

    PWAL can free or shrink the old storage in place (``untyped_storage().resize_(0)``, as offloading code does)
    or point the captured object elsewhere (``.data =``, ``set_``): a copy then writes freed memory, past the end of
    an allocation, or into another tensor's storage. Nothing is copied; the graph's memory is gone.
    """
    if captured.data_ptr() != slot.fp.data_ptr:
        return (
            "PWAL moved or freed the captured tensor's memory during the reload (.data =, set_, or its storage "
            "resized); the graph reads memory no copy can reach: nothing copied, recapture"
        )
    if not storage_covers(captured, storage):
        return (
            f"PWAL shrank the captured storage to {storage.nbytes()} bytes during the reload (resize_); a copy "
            "would write past its end: nothing copied, recapture"
        )
    return None


def storage_covers(tensor: torch.Tensor, storage: Any = None) -> bool:
    """Whether ``tensor``'s storage (``storage``, where the caller has it) still holds every byte it spans (PWAL can
    ``resize_`` a storage in place)."""
    return (tensor.untyped_storage() if storage is None else storage).nbytes() >= byte_span(tensor)[1]


def address_range(tensor: torch.Tensor) -> tuple[str, int, int]:
    """``(device, first byte address, end address)`` of the memory a plain strided tensor spans."""
    if tensor.is_nested:
        shape, stride = shape_and_stride(tensor)
        extent = sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1 if tensor.numel() else 0
    elif tensor.is_contiguous():
        extent = tensor.numel()  # the sum below, for row-major strides (one call)
    else:
        shape, stride = tensor.shape, tensor.stride()
        extent = sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1 if tensor.numel() else 0
    # From the storage: an empty tensor's data_ptr() is 0, but it still marks a place in its storage.
    start = tensor.untyped_storage().data_ptr() + int(tensor.storage_offset()) * tensor.element_size()
    return str(tensor.device), start, start + int(extent) * tensor.element_size()


def reads_as_captured(current: Any, captured: torch.Tensor) -> bool:
    """Whether the value at a slot's path reads its captured memory exactly as captured: the object, or a view at
    its pointer with its layout (another view of the same bytes, conjugate or negative, reads other values)."""
    if current is captured:
        return True
    return (
        isinstance(current, torch.Tensor)
        and current.layout is captured.layout  # (sparse, mkldnn: no storage to ask)
        and current.untyped_storage() is captured.untyped_storage()
        and current.data_ptr() == captured.data_ptr()
        and _view(current) == _view(captured)
        and geometry_key(current) == geometry_key(captured)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` (any tensor; a wrapper subclass reads its inner tensors) reads bytes of the plain tensor ``b``."""
    storage, span = b.untyped_storage(), byte_span(b)
    return any(part.untyped_storage() is storage and spans_overlap(byte_span(part), span) for part in memory_tensors(a))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` read the same bits element for element: +0.0 and -0.0 differ (a copy of one over the
    other changes what ``1 / x`` reads), a NaN agrees with the same NaN (scratch still agrees with itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_raw_bytes(a), _raw_bytes(b))


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s values as read (lazy bits resolved), flat."""
    return flat_copy(tensor.resolve_conj().resolve_neg()).view(torch.uint8)


def _sorted_ranges(ranges: Iterable[tuple[Any, int, int]]) -> dict[Any, tuple[list[int], list[int]]]:
    """``(device, start, end)`` ranges as, per device, their starts in order and the running maximum of their ends:
    a range ``[a, b)`` overlaps one of them iff, among those starting before ``b``, the furthest end is past ``a``."""
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for device, start, end in ranges:
        if end > start:
            by_device.setdefault(device, []).append((start, end))
    found: dict[Any, tuple[list[int], list[int]]] = {}
    for device, pairs in by_device.items():
        pairs.sort()
        ends: list[int] = []
        furthest = 0
        for _, end in pairs:
            furthest = max(furthest, end)
            ends.append(furthest)
        found[device] = ([start for start, _ in pairs], ends)
    return found


def _memory(tensor: torch.Tensor, span: tuple[int, int] | None = None) -> tuple[Any, int, int] | None:
    """``(device, first address, end)`` of the bytes a plain tensor spans (``span``: its :func:`byte_span`), or
    ``None`` where it spans none or has no memory of its own (a wrapper's is its inner tensors')."""
    if span is None:
        span = byte_span(tensor)
    if span[1] <= span[0] or _is_wrapper(tensor):
        return None
    start = tensor.data_ptr()  # the address of byte span[0]
    return (tensor.device, start, start + span[1] - span[0]) if start else None


def _hits(ranges: Mapping[Any, tuple[list[int], list[int]]], memory: tuple[Any, int, int] | None) -> bool:
    """Whether ``memory`` shares a byte with one of ``ranges`` (:func:`_sorted_ranges`)."""
    if memory is None:
        return False
    found = ranges.get(memory[0])
    if found is None:
        return False
    starts, ends = found
    below = bisect.bisect_left(starts, memory[2])  # the ranges that start before this one ends
    return below > 0 and ends[below - 1] > memory[1]
