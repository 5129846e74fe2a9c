"""Modules registered after the seal: their derived tensors' freshness, judged from the state at ``begin()``.

A module registered after the seal (a layer replaced by a new module, one appended to a ``ModuleList``) has no
seal entry, so no snapshot: the reload reports it ``untrackable`` (recapture, then reseal), and a recapture reads
its tensors as they are. A PWAL that skipped one of its derived tensors while its weights changed would then be
recaptured stale. So ``begin()`` notes, for each such module, its own parameters and buffers
(:func:`graphsafe.contract._order.stamp`) and the object and version counter at each path of a tensor a seal would
watch for freshness (declared derived and not static, or found only by the walker); when the reload finishes, a
path still holding that object unwritten while a parameter or buffer changed is ``stale`` (FAILED: a recapture would
read it). An inference tensor (no version counter) is not noted. Cost: nothing unless such a module exists (then
one stamp and one path read per noted tensor at ``begin()`` and at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from graphsafe.collectors import Classified, LayerTensors
from graphsafe.contract._order import Stamp, stamp
from graphsafe.contract._samples import version_of
from graphsafe.outcome import Finding, FindingKind, Origin

__all__ = ["LateModule", "late_stale", "note_late"]


@dataclass(slots=True)
class LateModule:
    """A module registered after the seal, as it was when the reload began."""

    qualname: str
    module: nn.Module
    stamp: Stamp
    #: ``(classified entry, the tensor at its path, its version counter)``: the tensors are held until the end.
    held: list[tuple[Classified, torch.Tensor, int]]


def note_late(qualname: str, module: nn.Module, classified: LayerTensors) -> LateModule | None:
    """What ``begin()`` notes for a module registered after the seal (``None`` where it has nothing to watch)."""
    held: list[tuple[Classified, torch.Tensor, int]] = []
    for entry in classified.tensors:
        watched = entry.origin is Origin.WALKER or (entry.origin is Origin.DECLARED and not entry.static)
        version = version_of(entry.tensor) if watched else -1
        if version >= 0:
            held.append((entry, entry.tensor, version))
    return LateModule(qualname, module, stamp(module), held) if held else None


def late_stale(notes: Sequence[LateModule]) -> list[Finding]:
    """``stale`` findings for the tensors of late modules PWAL left unwritten while their weights changed."""
    findings: list[Finding] = []
    for note in notes:
        if stamp(note.module) == note.stamp:
            continue
        for entry, tensor, version in note.held:
            path = entry.path
            if path.resolve_or(note.module, None) is not tensor or version_of(tensor) != version:
                continue
            findings.append(
                Finding(
                    FindingKind.STALE,
                    layer=note.qualname,
                    layer_class=type(note.module).__name__,
                    path=path.text,
                    declared=entry.origin is Origin.DECLARED,
                    detail="registered after the seal, and PWAL neither rebuilt nor wrote it while the module's "
                    "weights changed: a recapture would read old values. Rebuild it in PWAL (or declare it "
                    "static=True), and recapture and reseal() after changing the model",
                )
            )
    return findings
