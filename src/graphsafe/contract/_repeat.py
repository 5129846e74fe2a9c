"""A second ``before_layer()`` for a layer snapshotted and not yet restored: a load after PWAL already ran.

A loader may call ``before_layer(layer)`` once per weight and run PWAL after each weight. The first snapshot is
kept (one taken later would see loaded state), so the freshness check compares against the state before the first
load; a slot PWAL rebuilt as a new tensor between two loads is taken as rebuilt, although the weight loaded after
that PWAL never reached it. So a repeated ``before_layer()`` notes the layer's own parameters and buffers
(:func:`graphsafe.contract._order.stamp`) and the object and version counter at each freshness-tracked slot's path;
at the layer's restore, when a parameter or buffer changed since the repeat and a slot still holds the object
PWAL made before it, unwritten, the slot is ``stale`` (run PWAL after the layer's last weight). A slot still
holding its captured object, untouched, is left to the ordinary freshness check. Cost: nothing unless
``before_layer()`` is repeated; then one stamp and one path read per tracked slot, at the repeat and at the restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphsafe.contract._order import Stamp, stamp
from graphsafe.contract._samples import version_of
from graphsafe.outcome import Finding, FindingKind

if TYPE_CHECKING:
    from graphsafe.contract._snapshot import LayerSnapshot

__all__ = ["Repeat", "late_loads", "note_repeat"]


@dataclass(slots=True)
class Repeat:
    """The layer at its latest repeated ``before_layer()``: its stamp and, per tracked slot, the object there."""

    stamp: Stamp
    #: ``(slot index, the object at its path, its version counter)``; the objects are held until the restore.
    held: list[tuple[int, Any, int]]


def note_repeat(snapshot: LayerSnapshot) -> Repeat | None:
    """What a repeated ``before_layer()`` notes for ``snapshot``'s layer (``None`` where nothing is tracked)."""
    layer = snapshot.layer
    if layer is None:
        return None
    held = [
        (index, current, version)
        for index, slot in enumerate(snapshot.slots)
        if slot.tracks_freshness and index in snapshot.freshness
        for current in (slot.get(layer),)
        if isinstance(current, torch.Tensor)
        for version in (version_of(current),)
        if version >= 0  # an inference tensor counts no writes: its samples speak (the freshness check)
    ]
    return Repeat(stamp(layer), held) if held else None


def late_loads(snapshot: LayerSnapshot, repeat: Repeat) -> list[Finding]:
    """``stale`` findings for the slots PWAL computed before a load that followed the repeated ``before_layer()``;
    call at the layer's restore, before anything is rebound."""
    layer = snapshot.layer
    if layer is None or stamp(layer) == repeat.stamp:
        return []
    findings: list[Finding] = []
    for index, held, version in repeat.held:
        slot = snapshot.slots[index]
        captured = snapshot.captured[index]
        untouched = held is captured and version == snapshot.versions[index]
        if untouched or slot.get(layer) is not held or version_of(held) != version:
            continue
        findings.append(
            snapshot.sealed.finding(
                FindingKind.STALE,
                slot,
                detail="PWAL computed it before a weight of the layer was loaded (after a second before_layer()), "
                "and nothing rebuilt or wrote it after that load: it holds values from the old weight. Run PWAL "
                "after the layer's last weight is loaded",
            )
        )
    return findings
