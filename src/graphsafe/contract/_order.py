"""Call order in a layerwise reload: ``before_layer(layer)`` must come before the layer's load.

A snapshot taken after the load takes the loaded state for the captured one: the freshness check then sees the
weights unchanged, and a PWAL that skipped the rebuild (a guard) commits stale derived values. So a layerwise
transaction stamps every sealed layer's own parameters and buffers when it begins: object identity, version counter
and data pointer, and a digest of every byte (:func:`load_stamps`, one batch for the whole model). The digest is
needed: a load through ``param.data.copy_`` (vLLM's default loader) moves neither identity, version counter nor
pointer. At the layer's first snapshot the stamp is compared at once; the digests are taken in the snapshot's own
batch (:func:`note_digests`) and compared for all layers when the reload finishes (:func:`changed_since`). A layer
whose stamp changed before its snapshot was loaded out of order (``before_layer()`` late or missing): a
``reload-error`` finding, never a commit. A layer the reload left alone keeps its stamp and needs no call.

Cost, layerwise only: one digest of every weight at ``begin()`` (batched per device and dtype), one more inside each
snapshot's batch, one comparison at the end. A tensor without a digest (non-contiguous, a wrapper subclass) is
judged by identity, version and pointer alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn

from graphsafe.contract._samples import Digest, SampleBatch, digests, same_digests, version_of

__all__ = ["LoadStamp", "Stamp", "changed_since", "load_stamps", "note_digests", "stamp"]

Stamp = tuple[tuple[int, int, int], ...]


def _own(layer: nn.Module) -> list[torch.Tensor]:
    return [t for t in chain(layer._parameters.values(), layer._buffers.values()) if isinstance(t, torch.Tensor)]


def stamp(layer: nn.Module) -> Stamp:
    """The layer's own parameters and buffers as ``(id, version, data pointer)``; what a load changes."""
    return tuple((id(tensor), version_of(tensor), _address(tensor)) for tensor in _own(layer))


@dataclass(slots=True)
class LoadStamp:
    """A layer's own parameters and buffers when the reload began: :func:`stamp` and a digest of each one's bytes
    (``None`` where a tensor has none). The tensors are held, so an ``id`` cannot be reused meanwhile."""

    keys: Stamp
    tensors: list[torch.Tensor]
    digests: list[torch.Tensor | None]


def load_stamps(layers: Sequence[nn.Module]) -> list[LoadStamp]:
    """The :class:`LoadStamp` of each layer, every digest computed in one batch."""
    owned = [_own(layer) for layer in layers]
    flat = digests([tensor for tensors in owned for tensor in tensors])
    stamps: list[LoadStamp] = []
    start = 0
    for layer, tensors in zip(layers, owned, strict=True):
        stamps.append(LoadStamp(stamp(layer), tensors, flat[start : start + len(tensors)]))
        start += len(tensors)
    return stamps


def note_digests(before: LoadStamp, batch: SampleBatch) -> list[tuple[torch.Tensor, Digest]]:
    """Each digest ``before`` holds, with the same tensor's digest as the next flush of ``batch`` takes it (a
    snapshot's own batch: no launch of its own). Compare with :func:`changed_since` once the batch is flushed."""
    held = zip(before.tensors, before.digests, strict=True)
    return [(old, batch.digest(tensor)) for tensor, old in held if old is not None]


def changed_since(noted: Sequence[Sequence[tuple[torch.Tensor, Digest]]]) -> list[bool]:
    """For each layer's :func:`note_digests`: whether any of its tensors has other bytes now (one comparison for
    all layers, one device-to-host transfer per device)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    owner: list[int] = []
    changed = [False] * len(noted)
    for position, layer in enumerate(noted):
        for old, handle in layer:
            new = handle.get()
            if new is None:  # no digest now (its layout changed in place): not the tensor it was
                changed[position] = True
                continue
            pairs.append((old, new))
            owner.append(position)
    for position, same in zip(owner, same_digests(pairs), strict=True):
        if not same:
            changed[position] = True
    return changed


def _address(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.data_ptr()) if tensor.layout is torch.strided else 0
    except RuntimeError:  # a wrapper subclass without storage of its own: identity and version decide
        return 0
