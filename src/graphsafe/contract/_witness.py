"""Witnesses of every byte a captured derived tensor held when a reload began, and whether it still holds them.

A PWAL can give a derived slot a new tensor and hand the old, captured one to a holder outside the model (a
ping-pong spare, a dict key) that writes it, through ``.data``, ``set_`` or under inference mode as well as in
place: no version counter need move. Before the restore copies the slot's new values into such a tensor it asks
whether the reload wrote it (the holder's bytes must not be overwritten). A value sample would miss a write between
its elements, so the witness reads every byte: a small dense tensor's value sample is all of it (joined with the
snapshot's other samples: the cheapest); a larger one is digested, each word weighted by its position (a holder's
permutation within a row shows), over its own bytes or the bytes its strided span covers (for a conjugate,
negative or transposed view, still exactly its storage's); a wrapper subclass's inner tensors are digested at once.
Cost per reload: one digest of every captured derived tensor over :data:`SLOT_ELEMENTS` elements at ``begin()``
(batched with the snapshot's samples), and a comparison only for a tensor something outside the model holds when
the reload finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from graphsafe.contract._copy import span_bytes
from graphsafe.contract._samples import (
    SLOT_ELEMENTS,
    Digest,
    Sample,
    SampleBatch,
    digests,
    every_byte,
    same_digests,
    unchanged,
)

__all__ = ["changed_since", "sampled_whole", "witness_of"]

_PLAIN = (torch.Tensor, nn.Parameter)


def _plain_dense(tensor: torch.Tensor) -> bool:
    """A plain strided tensor whose elements are its bytes in order (no lazy conjugate or negative bit)."""
    return (
        type(tensor) in _PLAIN
        and tensor.layout is torch.strided
        and not tensor.is_nested
        and tensor.is_contiguous()
        and not (tensor.is_conj() or tensor.is_neg())
    )


def _digested(tensor: torch.Tensor) -> torch.Tensor | None:
    """What a digest of every byte of ``tensor`` reads: the tensor itself where it is plain and dense, else the bytes
    its strided span covers; ``None`` for a wrapper subclass or another layout (its inner tensors are read instead)."""
    return tensor if _plain_dense(tensor) else span_bytes(tensor)


def sampled_whole(tensor: torch.Tensor) -> bool:
    """Whether a value sample of ``tensor`` (``SLOT_ELEMENTS`` elements) is all of its bytes: a witness already."""
    return _plain_dense(tensor) and tensor.numel() <= SLOT_ELEMENTS


def witness_of(tensor: torch.Tensor, samples: SampleBatch) -> Sample | Digest | None:
    """A witness of every byte ``tensor`` holds, taken through ``samples`` (flushed by the caller before the load),
    or ``None`` where none can be taken (another layout, the meta device)."""
    if sampled_whole(tensor):
        return samples.take(tensor, SLOT_ELEMENTS)
    read = _digested(tensor)
    if read is not None:
        return samples.digest(read, weighted=True)
    whole = every_byte(tensor, 0)  # a wrapper subclass: its inner tensors' digests, now
    if whole is None:
        return None
    taken = Digest()
    taken.value, taken.taken = whole, True
    return taken


def changed_since(pairs: Sequence[tuple[Sample | Digest, torch.Tensor]]) -> list[bool]:
    """For each ``(witness, tensor)``: whether ``tensor``'s bytes differ from what :func:`witness_of` saw (a tensor
    whose layout changed meanwhile, read another way now, differs too). Samples compared in one batch, digests in
    another."""
    result = [True] * len(pairs)
    sampled = [
        (position, witness, tensor) for position, (witness, tensor) in enumerate(pairs) if isinstance(witness, Sample)
    ]
    if sampled:
        same = unchanged([(witness, tensor) for _, witness, tensor in sampled], SLOT_ELEMENTS)
        for (position, _, _), kept in zip(sampled, same, strict=True):
            result[position] = not kept
    compared: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, digest before, digest now)
    batched: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, digest before, what to digest now)
    for position, (witness, tensor) in enumerate(pairs):
        if isinstance(witness, Sample):
            continue
        before = witness.get()
        if before is None:
            continue  # nothing witnessed: changed, as far as anyone can tell
        read = _digested(tensor)
        if read is not None:
            batched.append((position, before, read))
            continue
        now = every_byte(tensor, 0)
        if now is not None:
            compared.append((position, before, now))
    found = digests([value for _, _, value in batched], weighted=True)
    for (position, before, _), now in zip(batched, found, strict=True):
        if now is not None:
            compared.append((position, before, now))
    verdicts = same_digests(
        [(before, now) for _, before, now in compared if before.dtype == now.dtype and before.shape == now.shape]
    )
    matching = iter(verdicts)
    for position, before, now in compared:
        if before.dtype == now.dtype and before.shape == now.shape:
            result[position] = not next(matching)
    return result
