"""Grading the registry and the walker against a capture manifest: which source names what the graphs touched.

A testing aid, not a check the contract runs: record a capture (:func:`~graphsafe.collectors.record_capture`),
then :func:`grade` it to see which touched storages are parameters or buffers, which are declared, which the
walker finds, and which no source names at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsafe.collectors import CapturedStorage, Manifest, classify
from graphsafe.contract import GraphContract
from graphsafe.outcome import Origin, SlotRef

__all__ = ["GradedStorage", "Grading", "grade"]


@dataclass(frozen=True, slots=True)
class GradedStorage:
    """One recorded storage and the paths each source knows it by (``layer:path``)."""

    entry: CapturedStorage
    state: tuple[str, ...]
    registry: tuple[str, ...]
    walker: tuple[str, ...]

    @property
    def covered(self) -> bool:
        """Whether any source names it (parameters and buffers count: an in-place load keeps them)."""
        return bool(self.state or self.registry or self.walker)


@dataclass(frozen=True, slots=True)
class Grading:
    """How the registry and the walker cover what the graphs touched (live storages; ``dead`` separately)."""

    storages: tuple[GradedStorage, ...]
    dead: tuple[CapturedStorage, ...]

    @property
    def state_covered(self) -> tuple[GradedStorage, ...]:
        """Held as a parameter or buffer."""
        return tuple(g for g in self.storages if g.state)

    @property
    def registry_covered(self) -> tuple[GradedStorage, ...]:
        """Named by a registry declaration."""
        return tuple(g for g in self.storages if g.registry)

    @property
    def walker_covered(self) -> tuple[GradedStorage, ...]:
        """Found by the walker."""
        return tuple(g for g in self.storages if g.walker)

    @property
    def derived(self) -> tuple[GradedStorage, ...]:
        """Not a parameter or buffer: what reloads re-create and the registry or walker must keep."""
        return tuple(g for g in self.storages if not g.state)

    @property
    def uncovered(self) -> tuple[GradedStorage, ...]:
        """Named by no source at all: unowned captured storage."""
        return tuple(g for g in self.storages if not g.covered)

    @property
    def walker_only(self) -> tuple[GradedStorage, ...]:
        """Derived storage the walker finds but nobody declared (migration candidates)."""
        return tuple(g for g in self.derived if g.walker and not g.registry)

    @property
    def registry_only(self) -> tuple[GradedStorage, ...]:
        """Derived storage declared but out of the walker's reach (private containers, depth, closures)."""
        return tuple(g for g in self.derived if g.registry and not g.walker)

    def summary(self) -> str:
        """A few lines of counts and the uncovered storages."""
        derived = self.derived
        lines = [
            f"{len(self.storages)} captured storage(s) alive, {len(self.dead)} freed: {len(self.state_covered)} "
            f"parameter/buffer, {len(derived)} derived; of the derived, registry covers "
            f"{sum(1 for g in derived if g.registry)}, walker covers {sum(1 for g in derived if g.walker)}, "
            f"neither {sum(1 for g in derived if not g.registry and not g.walker)}"
        ]
        for graded in self.uncovered:
            lines.append(f"  - unowned captured storage: {graded.entry.describe()}")
        return "\n".join(lines)


class _StorageNames:
    """``layer:path`` names by storage, for one source (keyed by ``id``; the stored object confirms the id)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, list[str]]] = {}

    def add(self, tensor: torch.Tensor, where: str) -> None:
        if tensor.layout is not torch.strided:
            return  # no single storage to name
        storage = tensor.untyped_storage()
        names = self._by_id.setdefault(id(storage), (storage, []))[1]
        if where not in names:
            names.append(where)

    def of(self, storage: Any) -> tuple[str, ...]:
        found = self._by_id.get(id(storage))
        return tuple(found[1]) if found is not None and found[0] is storage else ()


def grade(target: GraphContract | nn.Module, manifest: Manifest) -> Grading:
    """Grade the registry and the walker against ``manifest``, on the model's current state.

    Call it right after capture (before any reload): for every storage the graphs touched, which parameters or
    buffers, which declarations and which walker paths name it now.
    """
    model = target if isinstance(target, nn.Module) else target.model
    state, registry, walker = _StorageNames(), _StorageNames(), _StorageNames()
    units = frozenset(id(module) for module in model.modules())  # as the contract's seal walks
    for qualname, layer in model.named_modules():
        for found in classify(layer, units=units).tensors:
            where = str(SlotRef(qualname, found.path.text))
            if found.origin.is_state:
                state.add(found.tensor, where)
            elif found.origin is Origin.DECLARED:
                registry.add(found.tensor, where)
            if found.walked:
                walker.add(found.tensor, where)

    graded: list[GradedStorage] = []
    dead: list[CapturedStorage] = []
    for entry in manifest.storages():
        storage = entry.storage_ref()
        if storage is None:
            dead.append(entry)
            continue
        graded.append(GradedStorage(entry, state.of(storage), registry.of(storage), walker.of(storage)))
    return Grading(tuple(graded), tuple(dead))
