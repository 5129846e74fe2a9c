"""Call order in a layerwise reload: ``before_layer(layer)`` must come before the layer's load.

A snapshot taken after the load takes the loaded state for the captured one: the freshness check then sees the
weights unchanged, and a PWAL that skipped the rebuild (a guard) commits stale derived values. So a layerwise
transaction stamps every sealed layer when it begins: its own parameters and buffers (object identity, version
counter, data pointer and a digest of every byte; :func:`load_stamps`, one batch for the whole model) and what each
sealed slot path holds (:func:`slot_stamp`: a PWAL run before the snapshot rebuilds, rotates or writes them). The
digest is needed: a load through ``param.data.copy_`` (vLLM's default loader) moves neither identity, version
counter nor pointer. At the layer's first snapshot the stamp is compared at once; the digests are taken in the
snapshot's own batch (:func:`note_digests`) and compared for all layers when the reload finishes
(:func:`changed_since`). A layer whose stamp changed before its snapshot was loaded out of order (``before_layer()``
late or missing): a ``reload-error`` finding, never a commit. A layer the reload left alone (no load, no PWAL) keeps
its stamp and needs no call.

Cost, layerwise only: one digest of every weight at ``begin()`` (batched per device and dtype), one more inside each
snapshot's batch, one comparison at the end; each slot path read once more at ``begin()`` and at the snapshot. A
tensor without a digest (non-contiguous, a wrapper subclass) is judged by identity, version and pointer alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.contract._samples import Digest, SampleBatch, digests, same_digests, version_of
from graphsafe.outcome import Finding, FindingKind
from graphsafe.paths import Getter

if TYPE_CHECKING:
    from graphsafe.contract._slots import SealedLayer

__all__ = [
    "LoadStamp",
    "Stamp",
    "changed_since",
    "load_stamps",
    "loaded_early",
    "moved_since",
    "note_digests",
    "slot_stamp",
    "stamp",
]

Stamp = tuple[tuple[int, int, int], ...]


def _own(layer: nn.Module) -> list[torch.Tensor]:
    return [t for t in chain(layer._parameters.values(), layer._buffers.values()) if isinstance(t, torch.Tensor)]


def stamp(layer: nn.Module) -> Stamp:
    """The layer's own parameters and buffers as ``(id, version, data pointer)``; what a load changes."""
    return _keys(_own(layer))


def _keys(tensors: Sequence[torch.Tensor]) -> Stamp:
    return tuple((id(tensor), version_of(tensor), _address(tensor)) for tensor in tensors)


def _read(layer: nn.Module, getters: Sequence[Getter]) -> list[Any]:
    """What each slot path holds now (a path that raises: a marker, a change as good as any)."""
    held: list[Any] = []
    for get in getters:
        try:
            held.append(get(layer))
        except Exception:
            held.append(_UNREADABLE)
    return held


def slot_stamp(held: Sequence[Any]) -> tuple[Any, ...]:
    """What the slot paths hold (:func:`_read`): ``(id, version, data pointer)`` of a tensor, ``id`` of anything
    else; what PWAL changes (a rebuild, a rotation, an in-place write)."""
    return tuple(
        (id(value), version_of(value), _address(value)) if isinstance(value, torch.Tensor) else id(value)
        for value in held
    )


_UNREADABLE = object()


@dataclass(slots=True)
class LoadStamp:
    """A layer when the reload began: its own parameters and buffers (:func:`stamp`, and a digest of each one's
    bytes, ``None`` where a tensor has none) and what its sealed slot paths held (:func:`slot_stamp`), with the
    getters that read them. The objects are held, so an ``id`` cannot be reused meanwhile."""

    keys: Stamp
    tensors: list[torch.Tensor]
    digests: list[torch.Tensor | None]
    getters: Sequence[Getter]
    held: list[Any]
    slots: tuple[Any, ...]


def load_stamps(layers: Sequence[tuple[nn.Module, Sequence[Getter]]]) -> list[LoadStamp]:
    """The :class:`LoadStamp` of each ``(layer, its slot getters)``, every digest computed in one batch."""
    owned = [_own(layer) for layer, _ in layers]
    flat = digests([tensor for tensors in owned for tensor in tensors])
    stamps: list[LoadStamp] = []
    start = 0
    for (layer, getters), tensors in zip(layers, owned, strict=True):
        held = _read(layer, getters)
        found = flat[start : start + len(tensors)]
        stamps.append(LoadStamp(_keys(tensors), tensors, found, getters, held, slot_stamp(held)))
        start += len(tensors)
    return stamps


def moved_since(before: LoadStamp, layer: nn.Module) -> bool:
    """Whether ``layer``'s own parameters or buffers, or what its slot paths hold, changed since ``before`` (by
    identity, version counter or pointer; bytes written through ``.data`` are :func:`changed_since`'s)."""
    return stamp(layer) != before.keys or slot_stamp(_read(layer, before.getters)) != before.slots


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


def loaded_early(sealed: SealedLayer) -> Finding:
    """The ``reload-error`` of a layer whose stamp changed before its first snapshot."""
    return sealed.layer_finding(
        FindingKind.RELOAD_ERROR,
        "loaded or processed (PWAL) before its before_layer() (called late, or not at all): the snapshot saw "
        "the new state, so stale values go unchecked; call txn.before_layer(layer) before each layer's load",
        declared=True,
    )


def _address(tensor: torch.Tensor) -> int:
    if tensor.device.type == "meta":
        return 0
    try:
        return int(tensor.data_ptr()) if tensor.layout is torch.strided else 0
    except RuntimeError:  # a wrapper subclass without storage of its own: identity and version decide
        return 0
