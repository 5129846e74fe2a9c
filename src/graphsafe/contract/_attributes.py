"""The Python attributes a tensor carries (``tensor.__dict__``) across a rebind: a captured tensor kept at a path
takes the attributes of the tensor the load put there."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphsafe.contract._slots import _MISSING
from graphsafe.outcome import Origin

__all__ = ["remap_held_elsewhere"]


_LOADED = (Origin.PARAMETER, Origin.BUFFER)


def _would_change(new: torch.Tensor, captured: torch.Tensor, keep: bool) -> bool:
    """Whether giving ``captured`` the attributes of ``new`` (see :func:`_move_attributes`) changes any."""
    old = captured.__dict__
    if keep:
        return not _same_attributes({name: old.get(name, _MISSING) for name in new.__dict__}, new.__dict__)
    return not _same_attributes(old, new.__dict__)


def _same_attributes(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether two attribute dicts hold the same things: the same objects, or equal plain values."""
    if first.keys() != second.keys():
        return False
    for name, value in first.items():
        other = second[name]
        if value is other:
            continue
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            return False
        try:
            if not bool(value == other):
                return False
        except Exception:
            return False
    return True


def _move_attributes(
    new: Mapping[str, Any], captured: torch.Tensor, swapped: Mapping[int, torch.Tensor], *, keep: bool
) -> None:
    """Give ``captured`` (about to be bound back in place of ``new``) the attributes PWAL left on ``new``: those are
    the model's state now; the captured object still carries the last load's, which a rebind would bring back.

    A value that is another restored slot's new tensor becomes that slot's captured tensor (the one bound at its
    path; a slot under it, ``weight.g_idx`` tracked on its own, so ends up with its own captured tensor). ``keep``:
    a parameter or buffer keeps attributes the new object lacks (a loader's metadata set once, at construction:
    ``weight_loader``); any other tensor's attributes are the new one's exactly (an attribute PWAL no longer sets
    is gone). ``new``: the new tensor's attributes, read before any rebind of the step (a swap moves one captured
    object's attributes before the other reads them).
    """
    attributes = {
        name: swapped.get(id(value), value) if isinstance(value, torch.Tensor) else value for name, value in new.items()
    }
    if not keep:
        captured.__dict__.clear()
    captured.__dict__.update(attributes)


def remap_held_elsewhere(rebound: Sequence[tuple[weakref.ref[torch.Tensor], torch.Tensor]]) -> None:
    """After a step's rebinds, with graphsafe's own references to the new tensors dropped: a new tensor still alive
    is held by something else. Where that is a tensor's attribute (``kernel.weight_ref = layer.weight`` on a tensor
    no slot path names, an undeclared one under ``declared-only``), it names what its path holds now, as
    :meth:`LayerSnapshot.remap_attributes` does for the tensors at slot paths; else a later in-place load writes
    the path's tensor and the attribute keeps the orphan's old values. ``rebound``: (weak reference to each new
    tensor the step replaced, what replaced it). Costs a weak-reference call per rebind; two walks of the
    collector's objects only where a new tensor survived."""
    alive: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for ref, held in rebound:
        new = ref()
        if new is not None:
            alive[id(new)] = (new, held)
    if not alive:
        return
    holders = [d for d in gc.get_referrers(*(new for new, _ in alive.values())) if type(d) is dict]
    if not holders:
        return
    ids = {id(d) for d in holders}
    for owner in gc.get_referrers(*holders):
        if not isinstance(owner, torch.Tensor):
            continue
        attributes = owner.__dict__
        if id(attributes) not in ids:  # (a tensor that refers to the dict otherwise)
            continue
        for name, value in list(attributes.items()):
            if isinstance(value, torch.Tensor) and id(value) in alive:
                attributes[name] = alive[id(value)][1]
