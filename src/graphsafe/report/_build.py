""":func:`migration_report`: one report from a model, a contract or a reload outcome."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from graphsafe.contract import GraphContract
from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.outcome import ReloadOutcome
from graphsafe.report._drafts import to_entries
from graphsafe.report._entries import MigrationReport, SourceKind, UnownedEntry
from graphsafe.report._fixes import fixes, split_untrackable
from graphsafe.report._sources import Collected, from_contract, from_model, from_outcome, unowned_storage

__all__ = ["migration_report"]


def migration_report(
    source: nn.Module | GraphContract | ReloadOutcome,
    *,
    model: nn.Module | None = None,
    max_depth: int = 8,
    max_objects: int = 100_000,
    devices: Collection[torch.device | str] | None = None,
) -> MigrationReport:
    """The migration report of a model, a sealed contract or a reload outcome.

    Args:
        source: an ``nn.Module`` (classified now: every drift is ``"stable so far"``), a
            :class:`~graphsafe.GraphContract` (its walker-found slots, what its last reload found, what a
            classification finds now that the seal did not know, and unowned captured storage from its capture
            manifest) or a :class:`~graphsafe.ReloadOutcome` (its findings on undeclared slots).
        model: with an outcome source, the model it came from, so owners can be resolved exactly.
        max_depth, max_objects, devices: walk budget and device filter for a model source (a contract uses its
            own).

    A model and a contract give the same answer for a path: a walker find is an entry (to declare), an alias of
    a declared slot, parameter or buffer is in :attr:`MigrationReport.aliases` (restored with it). An entry is lazy
    (it gets ``register_derived``, not a decorator) when it is not at its path right after PWAL: it vanished in a
    reload, or it appeared after the seal (seal right after the load, before warm-up).
    """
    kind: SourceKind
    outcome: ReloadOutcome | None
    unowned: list[UnownedEntry] = []
    mode: str | None = None
    collected: Collected
    if isinstance(source, nn.Module):
        budget = WalkBudget(max_depth, max_objects)
        collected = from_model(source, budget, DeviceSet(devices) if devices is not None else None)
        collected.notes.insert(0, "no reload observed: drift is unknown until one (report a contract after a reload)")
        kind, outcome = "model", None
    elif isinstance(source, GraphContract):
        collected = from_contract(source)
        unowned = unowned_storage(source, collected.drafts)
        kind, mode, outcome = "contract", source.mode, source.last_outcome
    elif isinstance(source, ReloadOutcome):
        collected = from_outcome(source, model)
        kind, mode, outcome = "outcome", source.mode, source
    else:
        raise TypeError(
            f"migration_report needs an nn.Module, a GraphContract or a ReloadOutcome, got {type(source).__name__}"
        )
    drafted = to_entries(collected.drafts, collected.layers)
    untrackable, notes = split_untrackable(dict.fromkeys(collected.notes))
    written, undecided = fixes(drafted, reloaded=outcome is not None)
    return MigrationReport(
        entries=drafted.entries,
        fixes=written,
        unowned=tuple(unowned),
        notes=tuple(notes),
        source=kind,
        mode=mode,
        status=outcome.status if outcome is not None else None,
        reloaded=outcome is not None,
        declared_problems=collected.declared_problems,
        aliases=tuple(collected.aliases),
        untrackable=tuple(untrackable),
        undecided=undecided,
        declared=tuple(collected.declared),
    )
