"""Device tensors no slot path names, whose freshness a reload judges from the state when it began: those a sealed
layer holds behind a step no path can name (a ContextVar's value, a set member, a weak reference's referent, an
lru_cache's results), and the storages a captured graph reads that no model path holds (a module-level cache).

Neither can be restored, so a reload that finds one never commits (``untrackable``, ``orphaned``: recapture), and a
recapture reads them as they are. Where PWAL skipped rebuilding one while the weights changed, that recapture would
read old values; so the reload notes them before the load and judges them when it finishes:

- :func:`note_unnamed` / :func:`unnamed_stale`: a layer's unnamed tensors, each with its storage, identity, version
  counter and value sample, and the layer's own weights as its inputs (as for an undeclared slot). When the reload
  finishes the layer is walked again: a tensor still found behind an unnamed step, on the same memory and unwritten
  (same version counter, same value sample) while an input changed, is ``stale`` (FAILED). One that PWAL made anew
  (a value set again, a new variable) is not found there: the recapture reads the new one.
- :func:`note_unowned` / :func:`unwritten_unowned`: each unowned storage a capture read, by a digest of its bytes.
  Nothing says where the code that runs at a recapture finds it, so one the reload left alive and unwritten is
  ``stale`` in the manifest's check (:meth:`~graphsafe.collectors.Manifest.check`): a recapture would read the same
  old bytes unless the code now reads another tensor no check can see (a cache entry replaced while a rollback list
  keeps the old one: fails closed). A fixed table is vouched for (``Manifest.vouch_fixed``) and not noted.

Tensors on the memory of a parameter or buffer of the model (a weak reference to a weight) are their slots' own and
left out. Cost: nothing unless a layer holds an unnamed device tensor or the manifest an unowned read storage (such
a reload never commits); then one walk at the end of each such layer whose inputs changed (and one at its snapshot
where the mode no longer walks after the seal), one value sample per tensor, and one digest per unowned storage at
the start and end.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsafe.contract._inputs import _UNCHANGED, _input_changes, _Inputs, _strided
from graphsafe.contract._samples import (
    SLOT_ELEMENTS,
    Digest,
    Sample,
    SampleBatch,
    digests,
    same_digests,
    unchanged,
    version_of,
)
from graphsafe.contract._slots import SealedLayer, _view
from graphsafe.contract._tensorref import TensorRef
from graphsafe.outcome import Finding, FindingKind

__all__ = [
    "Unnamed",
    "UnnamedNote",
    "UnownedNote",
    "note_unnamed",
    "note_unowned",
    "unnamed_stale",
    "unwritten_unowned",
]

#: What a walk of a layer finds behind unnamed steps: ``(where, what, tensor)`` (``WalkResult.unnamed``).
Unnamed = Sequence[tuple[str, str, torch.Tensor]]


@dataclass(slots=True, eq=False)
class _Held:
    """One unnamed tensor as the snapshot found it (no reference to it is kept)."""

    where: str
    what: str
    storage: weakref.ReferenceType[Any]
    ident: TensorRef
    pointer: int
    layout: Any
    version: int
    sample: Sample


@dataclass(slots=True, eq=False)
class UnnamedNote:
    """A sealed layer's unnamed tensors at its snapshot, and the inputs they are judged against."""

    sealed: SealedLayer
    layer: nn.Module
    held: list[_Held]
    inputs: _Inputs
    keys: tuple[Any, ...]

    def storages(self) -> set[int]:
        """ids of the storages noted (alive)."""
        return {id(storage) for held in self.held if (storage := held.storage()) is not None}


def note_unnamed(
    sealed: SealedLayer,
    layer: nn.Module,
    found: Unnamed,
    inputs: _Inputs | None,
    samples: SampleBatch,
    named: Callable[[], set[int]],
    outer: Callable[[], list[tuple[str, nn.Module]]] | None = None,
) -> UnnamedNote | None:
    """Note the unnamed tensors a walk ``found`` in ``layer`` before its load (``None`` where none is watched).

    ``inputs``: the snapshot's own (shared, so each input is sampled once), else one is made; ``named``: ids of the
    storages slots judge (the model's parameters and buffers, the layer's slots), asked only when a tensor is found.
    Samples go through ``samples``, which the caller flushes before the load."""
    candidates = [(where, what, t) for where, what, t in found if _strided(t)]
    if not candidates:
        return None
    own = named()
    held: list[_Held] = []
    seen: set[int] = set()
    for where, what, tensor in candidates:
        storage = tensor.untyped_storage()
        if id(tensor) in seen or id(storage) in own:
            continue
        seen.add(id(tensor))
        held.append(
            _Held(
                where,
                what,
                weakref.ref(storage),
                TensorRef.of(tensor),
                tensor.data_ptr(),
                _view(tensor),
                version_of(tensor),
                samples.take(tensor, SLOT_ELEMENTS),
            )
        )
    if not held:
        return None
    watched = inputs if inputs is not None else _Inputs(layer, sealed.qualname, samples, outer=outer)
    return UnnamedNote(sealed, layer, held, watched, watched.layer_keys())


def unnamed_stale(notes: Iterable[UnnamedNote], walk: Callable[[nn.Module], Unnamed]) -> list[Finding]:
    """``stale`` findings for the noted unnamed tensors PWAL left unwritten while their layer's inputs changed;
    ``walk`` gives what a walk of a layer finds behind unnamed steps now (asked only of a layer whose inputs
    changed: every input of every note judged first, in one batch)."""
    notes = list(notes)
    asked = [(note, key) for note in notes for key in note.keys]
    pairs = [(note.inputs.inputs[key][2], note.inputs.inputs[key][1]()) for note, key in asked]
    changed: dict[int, list[str]] = {}  # id(note) -> the names of its inputs that changed
    for (note, key), change in zip(asked, _input_changes(pairs), strict=True):
        if change != _UNCHANGED:
            changed.setdefault(id(note), []).append(note.inputs.inputs[key][0])
    left: list[tuple[UnnamedNote, _Held, torch.Tensor]] = []
    for note in notes:
        if id(note) not in changed:
            continue
        now: dict[int, list[torch.Tensor]] = {}
        for _, _, tensor in walk(note.layer):
            if _strided(tensor):
                now.setdefault(id(tensor.untyped_storage()), []).append(tensor)
        for held in note.held:
            storage = held.storage()
            for tensor in now.get(id(storage), ()) if storage is not None else ():
                if tensor.data_ptr() != held.pointer or _view(tensor) != held.layout:
                    continue  # another part of that storage
                if held.ident.holds(tensor) and held.version >= 0 and version_of(tensor) != held.version:
                    continue  # written through it
                left.append((note, held, tensor))
                break
    if not left:
        return []
    same = unchanged([(held.sample, tensor) for _, held, tensor in left], SLOT_ELEMENTS)
    return [
        note.sealed.layer_finding(
            FindingKind.STALE,
            f"{held.where}: {held.what} is a tensor no slot path can name, and PWAL neither rebuilt nor wrote it "
            f"while the layer's input(s) {', '.join(changed[id(note)])} changed: a recapture would read its old "
            "values. Rebuild it in PWAL (a new value for the variable), or hold it where a slot path reaches it and "
            "declare it",
            declared=False,
        )
        for (note, held, _), kept in zip(left, same, strict=True)
        if kept
    ]


@dataclass(slots=True, eq=False)
class UnownedNote:
    """An unowned storage a capture read, as it was when the reload began."""

    storage: weakref.ReferenceType[Any]
    pointer: int
    digest: Digest


def _bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def note_unowned(storages: Iterable[Any], samples: SampleBatch) -> list[UnownedNote]:
    """Note each storage (alive, unowned, read by a capture) by a digest of its bytes, taken at the next flush of
    ``samples`` (before the load)."""
    notes: list[UnownedNote] = []
    for storage in storages:
        if storage is None or storage.device.type == "meta" or not storage.nbytes():
            continue
        notes.append(UnownedNote(weakref.ref(storage), storage.data_ptr(), samples.digest(_bytes(storage))))
    return notes


def unwritten_unowned(notes: Sequence[UnownedNote], judged: set[int]) -> set[int]:
    """ids of the noted storages still alive at their address with the same bytes, but those in ``judged`` (the
    unnamed tensors' storages, judged by where they are held)."""
    asked: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for note in notes:
        storage = note.storage()
        before = note.digest.get()
        if storage is None or id(storage) in judged or before is None or storage.data_ptr() != note.pointer:
            continue
        asked.append((id(storage), before, _bytes(storage)))
    now = digests([view for _, _, view in asked])
    pairs = [
        (ident, (before, after)) for (ident, before, _), after in zip(asked, now, strict=True) if after is not None
    ]
    return {ident for (ident, _), same in zip(pairs, same_digests([p for _, p in pairs]), strict=True) if same}
