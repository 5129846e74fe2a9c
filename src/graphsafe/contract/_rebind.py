"""Putting the captured tensors back at the model's paths after the copies (``LayerSnapshot.rebind``) and checking
that every path reads what the graph reads (``LayerSnapshot.verify``). Functions of a
:class:`~graphsafe.contract._snapshot.LayerSnapshot`, bound there as its methods."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from graphsafe.contract._attributes import (
    _LOADED,
    _move_attributes,
    _same_attributes,
    _would_change,
    point_at_replacements,
)
from graphsafe.contract._slots import SealedSlot, _describe_geometry_change, _view
from graphsafe.outcome import FindingKind, fingerprint

if TYPE_CHECKING:
    from graphsafe.contract._snapshot import LayerSnapshot

__all__: list[str] = []


def broken_paths(self: LayerSnapshot) -> set[str]:
    """The paths of this layer's ``alias-broken`` slots (they keep their new values: see :meth:`rebind`)."""
    return {f.path for f in self.findings if f.kind is FindingKind.ALIAS_BROKEN}


def bound_instead(
    self: LayerSnapshot, rebinds: list[tuple[int, torch.Tensor]]
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(slot index, new tensor, what its path will hold)`` for every rebind :meth:`rebind` will make: the captured
    tensor; an ``alias-broken`` slot's kept clone of its values (a slot that keeps its new tensor is left out).
    Ask after every copy of the step was taken back or not (the rebinds left are the ones made)."""
    broken = self.broken_paths() if self.findings else set()
    for index, captured in rebinds:
        new = self.swapped.get(index)
        if new is None:
            continue
        if self.slots[index].path.text not in broken:
            yield index, new, captured
        elif index in self.keep:
            yield index, new, self.keep[index]


def carry_attributes(self: LayerSnapshot, rebinds: list[tuple[int, torch.Tensor]], kept_at_paths: set[int]) -> None:
    """Before any rebind of the step: read the attributes each new tensor carries (:attr:`carried`); a slot
    whose captured tensor another path keeps (``kept_at_paths``: ids of tensors at paths the step does not
    rebind; PWAL swapped the two and the other's copy was taken back) is ``alias-broken``: one object cannot
    carry both paths' attributes, so it keeps its new tensor."""
    for index, captured in rebinds:
        carrier = self.attributes.get(index)
        if carrier is None:
            continue
        keep = self.slots[index].origin in _LOADED
        if carrier is not captured and id(captured) in kept_at_paths and _would_change(carrier, captured, keep):
            self.findings.append(
                self.sealed.finding(
                    FindingKind.ALIAS_BROKEN,
                    self.slots[index],
                    detail="its captured tensor stays at another path this reload does not rebind, which PWAL "
                    "gave it with other Python attributes: it keeps its new tensor",
                )
            )
            continue
        self.carried[index] = dict(carrier.__dict__)


def kept_tensors(self: LayerSnapshot, rebinds: list[tuple[int, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """The tensors at this layer's paths that the step leaves there (slots it does not rebind)."""
    rebound = {index for index, _ in rebinds} - self._broken_indices()
    layer = self.layer
    for index, slot in enumerate(self.slots):
        if index not in rebound:
            current = slot.get(layer)
            if isinstance(current, torch.Tensor):
                yield current


def _broken_indices(self: LayerSnapshot) -> set[int]:
    broken = self.broken_paths() if self.findings else set()
    return {index for index, slot in enumerate(self.slots) if slot.path.text in broken}


def remap_attributes(self: LayerSnapshot, swapped: Mapping[int, torch.Tensor]) -> None:
    """After the step's rebinds: an attribute of a tensor left in place that names a new tensor the step
    replaced (a kernel object keeping a reference to a rebound parameter) names what replaced it."""
    for tensor in self.attributed:
        point_at_replacements(tensor.__dict__, swapped)


def conflicting_attributes(self: LayerSnapshot, rebinds: list[tuple[int, torch.Tensor]], seen: dict[int, Any]) -> None:
    """Flag a slot whose captured tensor another slot of the step also rebinds (a tie) with other attributes:
    one object cannot carry both (``alias-broken``: it keeps its new tensor). ``seen``: id(captured tensor) ->
    the attributes the first slot gives it, shared across the step's snapshots."""
    for index, captured in rebinds:
        new = self.swapped.get(index)
        if new is None:
            continue
        attributes = new.__dict__
        first = seen.setdefault(id(captured), attributes)
        if first is attributes or _same_attributes(first, attributes):
            continue
        self.findings.append(
            self.sealed.finding(
                FindingKind.ALIAS_BROKEN,
                self.slots[index],
                detail="it shares its captured tensor with another slot (a tie), and PWAL gave the two new "
                "tensors other Python attributes, which one object cannot carry: it keeps its new tensor",
            )
        )


def rebind(self: LayerSnapshot, rebinds: list[tuple[int, torch.Tensor]], swapped: Mapping[int, torch.Tensor]) -> None:
    """Put the captured tensors back at their paths. ``swapped``: id() of each new tensor the restore step
    replaces by a captured one -> that captured tensor (for the attributes moved onto captured tensors)."""
    # A slot whose alias broke keeps its new tensor: the shared captured storage now holds another slot's
    # values, and rebinding would hand this path (and any recapture) the wrong ones.
    broken = self.broken_paths() if self.findings else set()
    layer = self.layer
    for index, captured in rebinds:
        slot = self.slots[index]
        if broken and slot.path.text in broken:
            kept = self.keep.get(index)
            if kept is not None:  # its new tensor reads memory a copy overwrote: it keeps its values instead
                try:
                    slot.set(layer, kept)
                except Exception as exc:
                    self.findings.append(
                        self.sealed.finding(
                            FindingKind.MOVED, slot, detail=f"could not bind its new values back: {exc}"
                        )
                    )
            continue
        carried = self.carried.get(index) if self.carried else None
        if carried is not None and self.attributes[index] is not captured:
            _move_attributes(carried, captured, swapped, keep=slot.origin in _LOADED)
        try:
            slot.set(layer, captured)
        except Exception as exc:  # a container that no longer takes assignment
            self.findings.append(
                self.sealed.finding(FindingKind.MOVED, slot, detail=f"could not rebind the captured tensor: {exc}")
            )
            continue
        self.restored += 1


def verify(self: LayerSnapshot) -> None:
    """Every slot must again have its sealed fingerprint; anything else is a finding (once per slot)."""
    flagged = {f.path for f in self.findings if f.kind.is_problem} if self.findings else ()
    layer = self.layer
    captured = self.captured
    tensor_type = torch.Tensor
    confirmed = self.confirmed = [False] * len(self.slots)
    for index, slot in enumerate(self.slots):
        if (flagged and slot.path.text in flagged) or slot.watch_only:
            continue
        if slot.fp.storage_ref() is None:
            self.findings.append(self.sealed.finding(FindingKind.DEAD, slot, detail="the captured storage was freed"))
            continue
        current = slot.get(layer)
        if not isinstance(current, tensor_type):
            self.findings.append(self.sealed.finding(FindingKind.VANISHED, slot, detail="the path no longer resolves"))
            continue
        if current is captured[index] and not slot.wrapped and _as_sealed(current, slot):
            # The captured object on its captured memory (``.data =``, ``set_`` or a storage ``resize_`` can
            # move the same object elsewhere).
            confirmed[index] = True
            continue
        try:
            after = fingerprint(current)
        except (TypeError, RuntimeError) as exc:  # no storage and no flattenable inner tensors
            self.findings.append(
                self.sealed.finding(FindingKind.MOVED, slot, detail=f"cannot read the tensor's memory ({exc})")
            )
            continue
        if after.key != slot.key or not after.same_storage(slot.fp):
            detail = "not at its captured storage after restore"
            if after.data_ptr == slot.fp.data_ptr and after.same_storage(slot.fp) and not slot.wrapped:
                # The captured memory, now read another way (a quantized tensor's scale changed in place).
                detail = f"its captured memory is now read another way ({_describe_geometry_change(slot, current)})"
            self.findings.append(self.sealed.finding(FindingKind.MOVED, slot, after=after, detail=detail))


def _as_sealed(tensor: torch.Tensor, slot: SealedSlot) -> bool:
    """Whether ``tensor`` lies at the slot's captured address, laid out as sealed (:func:`_view` against
    :attr:`SealedSlot.layout`, compared field by field where the sealed tensor was plain: a tensor of its dtype is
    then neither quantized nor read through other parameters)."""
    if tensor.data_ptr() != slot.fp.data_ptr:
        return False
    shape, stride, dtype, device, conj, neg, kind, params = slot.layout
    if params is not None or tensor.is_nested:
        return _view(tensor) == slot.layout
    return (
        tensor.dtype is dtype
        and type(tensor) is kind
        and tensor.shape == shape
        and tensor.stride() == stride
        and tensor.device == device
        and tensor.is_conj() is conj
        and tensor.is_neg() is neg
    )
