"""Derived slots that lie inside a parameter's or buffer's memory (a carve of a weight arena).

The loader writes a parameter whole, so a derived slot carved out of its memory changes whenever the loader writes
the arena, whether PWAL refreshed the slot or skipped it: a changed value sample cannot stand for PWAL's write
there. The seal marks such slots (:attr:`SealedSlot.inside`, by address: a DLPack or ``from_numpy`` carve is
another storage object on the same bytes); :func:`graphsafe.contract._freshness.judge_noted` judges a marked slot whose
bytes changed while its own version counter did not move (no write went through the slot's tensor: the loader
wrote the arena) by its inputs instead (``stale`` where they changed). A slot that may share the parameter's version
counter (an autograd view of it, or of a ``detach()`` of it: :attr:`SealedSlot.shares_version`, set here) moves with
the loader's write too: nothing left at the end of a reload tells that write from PWAL's, so such a slot whose bytes
changed is judged by its inputs whatever its counter says (``stale`` where they changed: fails closed, also after a
PWAL that did refresh it; carve it with ``.data`` or hold it in a tensor of its own). A view of a whole weight
(``w_t = weight.t()``) is an alias, not a carve. Cost: nothing per reload on a model without such a slot (one
attribute read per slot whose sample changed); at seal, two path reads per carved slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphsafe.contract._copy import overlapping_pairs
from graphsafe.outcome import Finding, FindingKind, Origin, SlotRef

if TYPE_CHECKING:
    from graphsafe.contract._slots import SealedLayer, SealedSlot

__all__ = ["inside_detail", "mark_inside_loaded", "permuted_after_close"]

_LOADED = (Origin.PARAMETER, Origin.BUFFER)


def mark_inside_loaded(layers: Sequence[SealedLayer]) -> None:
    """Set :attr:`SealedSlot.inside` of every freshness-tracked slot whose captured bytes overlap a parameter's or
    buffer's captured bytes (in any layer) to that parameter's ``layer:path``; clear it on every other slot."""
    ranges: list[tuple[str, int, int, tuple[bool, SealedLayer, SealedSlot]]] = []
    for sealed in layers:
        for slot in sealed.slots:
            slot.inside = None
            loaded = slot.origin in _LOADED
            if slot.wrapped or not (loaded or slot.tracks_freshness):
                continue
            fp = slot.fp
            start, end = slot.span
            ranges.append((str(fp.device), fp.storage_ptr + start, fp.storage_ptr + end, (loaded, sealed, slot)))
    if not any(loaded for _, _, _, (loaded, _, _) in ranges):
        return
    for (first_loaded, first_layer, first), (second_loaded, second_layer, second) in overlapping_pairs(ranges):
        if first_loaded == second_loaded:
            continue
        owner, owner_slot, carved = (first_layer, first, second) if first_loaded else (second_layer, second, first)
        carved_layer = second_layer if first_loaded else first_layer
        if carved.inside is None:
            carved.inside = str(SlotRef(owner.qualname, owner_slot.path.text))
            # the whole of the parameter's bytes (the parameter itself, or a view of all of it) holds what the
            # loader wrote, which is its value: no carve of a part whose write could pass for PWAL's
            whole = carved.fp.storage_ptr + carved.span[0] == owner_slot.fp.storage_ptr + owner_slot.span[0] and (
                carved.span[1] - carved.span[0] == owner_slot.span[1] - owner_slot.span[0]
            )
            carved.shares_version = not whole and _may_share_version(_at(carved_layer, carved), _at(owner, owner_slot))


def _at(sealed: SealedLayer, slot: SealedSlot) -> Any:
    layer = sealed.layer_ref()
    return slot.get(layer) if layer is not None else None


def _may_share_version(carved: Any, owner: Any) -> bool:
    """Whether ``carved`` may share ``owner``'s version counter: its view chain's root is ``owner``, or another
    tensor (a ``detach()``) whose counter reads the same as ``owner``'s (a ``.data`` alias counts its own writes;
    an equal count by chance fails closed). No write is made to tell (torch has no read-only way)."""
    if not isinstance(carved, torch.Tensor) or not isinstance(owner, torch.Tensor):
        return False
    root = carved._base if carved._base is not None else carved
    if root is owner:
        return True
    if root is carved or carved.is_inference() or owner.is_inference():
        return False  # no view chain (a DLPack or from_numpy carve), or no counter to share
    return root.untyped_storage() is owner.untyped_storage() and root._version == owner._version


def inside_detail(slot: SealedSlot, changed: Sequence[str]) -> str:
    """The ``stale`` finding's text for a carved slot whose bytes changed while its inputs changed."""
    if slot.shares_version:
        return (
            f"it lies inside the memory of {slot.inside}, which the loader writes, and may share its version "
            f"counter (an autograd view of it), and its input(s) {', '.join(changed)} changed: a write of the loader "
            "cannot be told from PWAL's refresh there, so the graph may read the checkpoint's bytes instead of "
            "PWAL's values. Carve it with .data (a version counter of its own) or hold it in a tensor of its own"
        )
    return (
        f"it lies inside the memory of {slot.inside}, which the loader writes, and its input(s) "
        f"{', '.join(changed)} changed: its bytes changed, but a write of the loader cannot be told from PWAL's "
        "refresh there, so the graph may read the checkpoint's bytes instead of PWAL's values. Hold it in a tensor "
        "of its own (PWAL makes it), or declare it static=True if it does not depend on the weights"
    )


def permuted_after_close(sealed: SealedLayer, slot: SealedSlot) -> Finding:
    """The ``stale`` finding for a slot of a layer closed by ``after_layer()`` that holds another slot's captured
    tensor when the reload finishes: PWAL ran again and permuted the captured tensors, writing captured memory in
    place; neither that memory nor the model's tensors hold what one pass of PWAL computes, so a recapture cannot
    make them right (the ``moved`` finding of a rebuilt slot is recapture-fixable; this is not)."""
    return sealed.finding(
        FindingKind.STALE,
        slot,
        detail="PWAL ran again after its layer's after_layer() and moved the captured tensors among the layer's "
        "slots, writing the memory the graph reads in place: a recapture would read the values of two passes. Call "
        "after_layer() once, when the layer is loaded and processed for the last time",
    )
