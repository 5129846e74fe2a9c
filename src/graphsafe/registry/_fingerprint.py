"""Fingerprints: what a graph captured about a tensor, and how to compare it cheaply.

A fingerprint is the storage's identity and liveness (a weak reference to the storage object, which torch keeps
unique per storage), the storage's data pointer and size, and the view's data pointer, offset, shape, stride,
dtype and device. ``key`` packs the comparable fields into one tuple so a verification is one tuple compare.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Fingerprint", "fingerprint", "geometry_key"]


def _significant_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    # A stride of a size-1 dimension is never used to address memory; torch is free to pick any value for it.
    return tuple(s if n != 1 else 0 for n, s in zip(shape, stride, strict=True))


# Not frozen: a frozen dataclass pays an object.__setattr__ per field on construction, and the walker and the seal
# build one fingerprint per tensor. Treat instances as immutable.
@dataclass(slots=True, eq=False)
class Fingerprint:
    """What a captured graph depends on for one tensor."""

    storage_ptr: int
    storage_nbytes: int
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    storage_ref: weakref.ReferenceType[Any] = field(repr=False)

    @property
    def key(self) -> tuple[Any, ...]:
        """Every comparable field in one tuple (equal keys mean the same memory seen the same way)."""
        return (
            self.storage_ptr,
            self.storage_nbytes,
            self.data_ptr,
            self.storage_offset,
            self.shape,
            _significant_stride(self.shape, self.stride),
            self.dtype,
            self.device,
        )

    @property
    def alive(self) -> bool:
        """Whether the fingerprinted storage still exists."""
        return self.storage_ref() is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the view (elements times element size)."""
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize

    def same_storage(self, other: Fingerprint) -> bool:
        """Whether both fingerprints name the same live storage object."""
        mine = self.storage_ref()
        return mine is not None and mine is other.storage_ref()

    def describe(self) -> str:
        """A short human-readable rendering used in error messages and reports."""
        state = "" if self.alive else " (freed)"
        return (
            f"{_dtype_name(self.dtype)}{list(self.shape)} stride={list(self.stride)} "
            f"offset={self.storage_offset} @0x{self.data_ptr:x} on {self.device}{state}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        return {
            "data_ptr": self.data_ptr,
            "storage_ptr": self.storage_ptr,
            "storage_nbytes": self.storage_nbytes,
            "storage_offset": self.storage_offset,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "dtype": _dtype_name(self.dtype),
            "device": str(self.device),
            "alive": self.alive,
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """Fingerprint ``tensor`` (a plain tensor, a view, or a parameter)."""
    storage = tensor.untyped_storage()
    return Fingerprint(
        storage_ptr=storage.data_ptr(),
        storage_nbytes=storage.nbytes(),
        data_ptr=tensor.data_ptr(),
        storage_offset=int(tensor.storage_offset()),
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        dtype=tensor.dtype,
        device=tensor.device,
        storage_ref=weakref.ref(storage),
    )


def geometry_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Shape, significant stride, dtype and device: what must match for a copy to be a faithful restore."""
    shape = tuple(tensor.shape)
    return (shape, _significant_stride(shape, tuple(tensor.stride())), tensor.dtype, tensor.device)
