"""The Python attributes a tensor carries (``tensor.__dict__``) across a rebind: a captured tensor kept at a path
takes the attributes of the tensor the load put there."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from graphsafe.contract._slots import _MISSING
from graphsafe.outcome import Origin

__all__ = ["point_at_replacements", "remap_held_elsewhere"]


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


def point_at_replacements(attributes: dict[str, Any], replaced: Mapping[int, torch.Tensor]) -> None:
    """Point each attribute in ``attributes`` (a tensor's ``__dict__``) that is a replaced new tensor at what replaced
    it. ``replaced``: id() of each replaced tensor -> its replacement, every replaced tensor alive meanwhile, so an id
    names that tensor alone (no value of the caller's is asked anything: a proxy's ``__class__``)."""
    for name, value in list(attributes.items()):
        found = replaced.get(id(value))
        if found is not None:
            attributes[name] = found


def remap_held_elsewhere(
    rebound: Sequence[tuple[weakref.ref[torch.Tensor], torch.Tensor]], owners: Callable[[], Iterable[torch.Tensor]]
) -> None:
    """After a reload's rebinds, with graphsafe's own references to the new tensors dropped: a new tensor still
    alive is held by something else. Where that is an attribute of a tensor of the model that no slot path names
    (``kernel.weight_ref = layer.weight`` on an undeclared kernel tensor under ``declared-only``), it names what
    replaced the new tensor, as :meth:`LayerSnapshot.remap_attributes` does for the tensors at slot paths; else a
    later in-place load writes the path's tensor and the attribute keeps the orphan's old values. ``rebound``:
    (weak reference to each new tensor a restore step replaced, what replaced it). ``owners``: the model's tensors,
    asked only where a new tensor survived (a walk of the model). Lists, dicts and objects of the caller's (a
    loader's ``params`` dict) are never rewritten."""
    survivors = [(new, held) for new, held in ((ref(), held) for ref, held in rebound) if new is not None]
    if not survivors:
        return
    replaced = {id(new): held for new, held in survivors}  # (``survivors`` keeps them alive: no id is reused)
    for owner in owners():
        try:
            attributes = owner.__dict__
        except Exception:  # a subclass that keeps its dict to itself: nothing to remap through
            continue
        if attributes:
            point_at_replacements(attributes, replaced)
