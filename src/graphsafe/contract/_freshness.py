"""Whether a derived slot still holds what the model computes: the freshness checks of a snapshot
(``LayerSnapshot.doubt_foreign_writes``, ``left_stale``, ``_check_fresh``), the step-wide :func:`judge_noted` and
:func:`check_freshness`, and a layer closed by ``after_layer`` kept for the final check (:class:`ClosedLayer`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.contract._carved import inside_detail, permuted_after_close
from graphsafe.contract._inputs import (
    _CHANGED,
    _MAYBE,
    _UNCHANGED,
    _input_before,
    _input_change,
    _input_changes,
    _InputBefore,
    state_inputs,
)
from graphsafe.contract._memory import _overlap
from graphsafe.contract._order import Stamp, stamp
from graphsafe.contract._samples import SLOT_ELEMENTS, SampleBatch, unchanged, version_of
from graphsafe.contract._slots import SealedLayer, SealedSlot, _view
from graphsafe.outcome import Finding, FindingKind, Origin, fingerprint

if TYPE_CHECKING:
    from graphsafe.contract._snapshot import LayerSnapshot

__all__ = ["ClosedLayer", "check_freshness", "judge_noted", "permuted_deferred"]


@dataclass(slots=True, eq=False)
class ClosedLayer:
    """A layer restored by ``after_layer()`` while the reload goes on: what must still hold when it finishes.

    Nothing looks at a restored layer again otherwise, so a loader that touches it afterwards (PWAL run again, a
    parent's PWAL rebuilding a child's slot, a weight written again) would commit captured memory that no longer
    holds what the model computes. Kept: each slot :meth:`LayerSnapshot.verify` confirmed, with its captured
    tensor; and each freshness input as it was right after the restore.
    """

    snapshot: LayerSnapshot
    #: ``(slot index, captured tensor)`` of every slot confirmed at its captured memory by the restore.
    confirmed: list[tuple[int, torch.Tensor]]
    #: Input key -> its state right after the restore (see ``_input_before``).
    inputs: dict[Any, _InputBefore]
    #: Slot index -> the keys of its inputs: the ones its restore was judged by, and the ones a recording of this
    #: PWAL saw it read (a weight of another layer, loaded later).
    keys: dict[int, tuple[Any, ...]]
    #: id() of the object at each slot's path when the layer closed -> that slot's index (the objects are held in
    #: ``at_close_held`` so the ids stay theirs): a slot holding another's at the end was permuted by a second PWAL.
    at_close: dict[int, int] = field(default_factory=dict)
    at_close_held: list[Any] = field(default_factory=list)
    #: ``(slot index, version counter)`` of each slot the restore left on its new tensor (respecified, moved), with
    #: the layer's own parameters and buffers at the close: weights written afterwards leave such a slot stale.
    kept: list[tuple[int, int]] = field(default_factory=list)
    own: Stamp = ()
    #: The keys (in ``inputs``) of the layer's own parameters and buffers, sampled at the close: one written with
    #: other values afterwards leaves whatever PWAL computed from it old (tensors, Python attributes, plain values).
    weights: tuple[Any, ...] = ()
    #: Input key -> its name and how to resolve it now.
    named: dict[Any, tuple[str, Callable[[], Any]]] = field(default_factory=dict)

    @classmethod
    def of(cls, snapshot: LayerSnapshot, samples: SampleBatch) -> ClosedLayer:
        """Close ``snapshot`` (restored and verified); input samples go through ``samples``, flushed by the caller
        before the load goes on."""
        confirmed = [
            (index, captured)
            for index, (captured, ok) in enumerate(zip(snapshot.captured, snapshot.confirmed, strict=False))
            if ok and captured is not None
        ]
        keys: dict[int, tuple[Any, ...]] = {}
        watched = snapshot.inputs
        if watched is not None and snapshot.freshness:
            for index, entry in snapshot.freshness.items():
                recorded = snapshot.slots[index].inputs
                learned = watched._recorded_keys(recorded) if recorded and all(map(watched._resolves, recorded)) else ()
                keys[index] = tuple(dict.fromkeys((*entry[3], *learned)))
        held = [slot.get(snapshot.layer) for slot in snapshot.slots]
        named = {key: watched.inputs[key][:2] for found in keys.values() for key in found} if watched else {}
        # The layer's own parameters and buffers, watched from the close (one a derived slot reads is sampled once);
        # not through the snapshot's watch, whose values before the load a deferred restore still judges by.
        own = state_inputs(snapshot.layer)
        weights = tuple(key for key, _, _ in own)
        for key, name, resolve in own:
            named.setdefault(key, (name, resolve))
        inputs = {key: _input_before(resolve(), samples) for key, (_, resolve) in named.items()}
        at_close = {id(value): index for index, value in enumerate(held) if isinstance(value, torch.Tensor)}
        done = {index for index, _ in confirmed}
        kept = (
            [
                (index, version_of(value))
                for index, value in enumerate(held)
                if index not in done and isinstance(value, torch.Tensor) and not snapshot.slots[index].watch_only
            ]
            if snapshot.done
            else []
        )  # (a layer deferred to finish() is restored after this: nothing was kept yet)
        stamped = stamp(snapshot.layer) if kept else ()
        return cls(snapshot, confirmed, inputs, keys, at_close, held, kept, stamped, weights, named)

    def holds_anothers(self, index: int, current: Any) -> bool:
        """Whether slot ``index`` now holds ``current``, what another slot of the layer held at the close (not this
        slot's own: slots sharing one tensor held the same): PWAL ran again and permuted them."""
        return current is not self.at_close_held[index] and id(current) in self.at_close

    def check(self, changes: Mapping[Any, int]) -> list[Finding]:
        """Findings for what changed since the layer was closed; ``changes`` says how each input changed."""
        snapshot = self.snapshot
        sealed, layer = snapshot.sealed, snapshot.layer
        findings: list[Finding] = []
        flagged: set[int] = set()
        others = self.at_close
        memory: dict[tuple[str, int], int] | None = None  # confirmed slots by captured memory, made where needed
        for index, captured in self.confirmed:
            slot = snapshot.slots[index]
            current = slot.get(layer)
            if current is captured and captured.data_ptr() == slot.fp.data_ptr and _view(captured) == slot.layout:
                continue
            flagged.add(index)
            # A captured object now on another slot's captured memory (swap_tensors, ``.data =``) is the same
            # permutation as another slot's object at this path.
            on = None
            if isinstance(current, torch.Tensor):
                if memory is None:
                    memory = {
                        (str(snapshot.slots[i].fp.device), snapshot.slots[i].fp.data_ptr): i for i, _ in self.confirmed
                    }
                on = memory.get((str(current.device), current.data_ptr()))
            if others.get(id(current), index) != index or on not in (None, index):
                findings.append(permuted_after_close(sealed, slot))  # what another slot held at the close
                continue
            findings.append(
                sealed.finding(
                    FindingKind.MOVED,
                    slot,
                    detail="changed after its layer's after_layer() restored it (PWAL ran again, or another layer's "
                    "PWAL rebuilt it): the graph reads the captured memory, which holds the values of the first "
                    "pass. Call after_layer() once, when the layer is loaded and processed for the last time",
                )
            )
        left_new = {index for index, _ in self.kept}
        for index, slot in enumerate(snapshot.slots):
            # A watched slot (the manifest's path, never restored here) or one the restore left on its new tensor
            # (respecified) holding what another slot held at the close: the same second PWAL, which moved memory a
            # later layer's tie or a skipped alias still reads and wrote another role's values there. (A slot the
            # restore rebinds after the close, a tie's deferred layer, holds its captured tensor: not asked here.)
            if index in flagged or not (slot.watch_only or index in left_new):
                continue
            try:
                current = slot.get(layer)
            except Exception:
                continue  # a path gone: the manifest's check speaks
            if self.holds_anothers(index, current):
                flagged.add(index)
                findings.append(permuted_after_close(sealed, slot))
        if self.kept and stamp(layer) != self.own:
            # The layer's weights changed after its close; a slot the restore left on its new tensor (a view of a
            # Parameter the restore rebound to the captured one, say) and nothing wrote since holds the old values.
            for index, version in self.kept:
                slot = snapshot.slots[index]
                current = slot.get(layer)
                if (
                    index in flagged
                    or slot.static  # its contents depend on no weight (what else PWAL left: ``weights``)
                    or current is not self.at_close_held[index]
                    or version_of(current) != version
                ):
                    continue
                flagged.add(index)
                findings.append(
                    sealed.finding(
                        FindingKind.STALE,
                        slot,
                        detail="kept its new tensor at its layer's after_layer() (not restored into the captured "
                        "memory), and the layer's weights changed afterwards without a rebuild: a recapture would "
                        "read the old values. Call after_layer() once the layer's last weight is loaded and PWAL ran",
                    )
                )
        if not self.inputs:
            return findings
        changed = {key for key in self.inputs if changes.get(key, _UNCHANGED) == _CHANGED}
        if not changed:
            return findings
        for index, found in self.keys.items():
            names = [self.named[key][0] for key in found if key in changed]
            if not names or index in flagged:
                continue
            findings.append(
                sealed.finding(
                    FindingKind.STALE,
                    snapshot.slots[index],
                    detail=f"its input(s) {', '.join(names)} changed after its layer's after_layer() restored it; "
                    "the graph reads values computed from the earlier weights. Call after_layer() once the layer's "
                    "last weight is loaded and PWAL ran",
                )
            )
        written = [self.named[key][0] for key in self.weights if key in changed]
        if written and not any(finding.kind is FindingKind.STALE for finding in findings):
            # What else PWAL computed from them (a Python attribute, a plain value, a tensor no path names) no check
            # can name: the layer as a whole.
            findings.append(
                sealed.layer_finding(
                    FindingKind.STALE,
                    f"its weight(s) {', '.join(written)} were written with other values after its after_layer() "
                    "restored it, and PWAL did not run on them: what it computed from them (tensors, Python "
                    "attributes, plain values) holds the earlier ones. Call after_layer() once the layer's last "
                    "weight is loaded and PWAL ran",
                    declared=True,
                )
            )
        return findings


def permuted_deferred(closed: Iterable[ClosedLayer]) -> list[Finding]:
    """``stale`` findings for the slots of layers closed by ``after_layer()`` but restored only at ``finish()`` (a
    tie: another layer holds their tensors) that hold what another slot of the layer held at the close: PWAL ran
    again and permuted them, and a layer that took such a tensor meanwhile holds the values of its new role. Call
    before the final restore rebinds anything."""
    findings: list[Finding] = []
    for record in closed:
        snapshot = record.snapshot
        if snapshot.done:
            continue
        for index, slot in enumerate(snapshot.slots):
            current = slot.get(snapshot.layer)
            if record.holds_anothers(index, current):
                findings.append(permuted_after_close(snapshot.sealed, slot))
    return findings


def check_closed(
    closed: Iterable[ClosedLayer],
    in_model: Callable[[SealedLayer, nn.Module], bool],
    held: Callable[[nn.Module], bool] = lambda layer: False,
) -> list[Finding]:
    """Check every closed layer at the end of the reload; the inputs of all compared in one batch. A layer no longer
    at every name it had (``in_model``) was replaced after its restore: every slot of it ``vanished``; one the model
    still holds at another name (``held``: a shared submodule) is checked there too."""
    findings: list[Finding] = []
    kept: list[ClosedLayer] = []
    for record in closed:
        snapshot = record.snapshot
        if in_model(snapshot.sealed, snapshot.layer) or held(snapshot.layer):
            kept.append(record)
        if in_model(snapshot.sealed, snapshot.layer):
            continue
        findings.extend(
            snapshot.sealed.finding(
                FindingKind.VANISHED,
                slot,
                detail="the layer was replaced after its after_layer() restored it: the graph reads the old layer's "
                "captured memory",
            )
            for slot in snapshot.slots
            if not slot.watch_only
        )
    closed = kept
    asked: list[tuple[int, Any, _InputBefore, Any]] = []
    for position, record in enumerate(closed):
        for key, before in record.inputs.items():
            asked.append((position, key, before, record.named[key][1]()))
    verdicts: list[dict[Any, int]] = [{} for _ in closed]
    for (position, key, _, _), change in zip(asked, _input_changes([(b, v) for _, _, b, v in asked]), strict=True):
        verdicts[position][key] = change
    findings.extend(finding for record, known in zip(closed, verdicts, strict=True) for finding in record.check(known))
    return findings


def judge_noted(snapshots: Sequence[LayerSnapshot]) -> None:
    """Keep, of the slots :meth:`LayerSnapshot.restore` noted on their captured memory, those whose value sample
    PWAL left as it was: due for :func:`check_freshness` (a write that changed the sample is a refresh).

    Call once every snapshot of a restore step is restored and before any copy of its plan lands: the samples of
    every layer are compared in one batch (one host-device synchronisation per device, not one per layer or slot).
    """
    noted = [(snapshot, entry) for snapshot in snapshots for entry in snapshot.noted]
    if not noted:
        return
    for snapshot in snapshots:
        snapshot.noted = []
    same = unchanged([(entry[4], entry[2]) for _, entry in noted], SLOT_ELEMENTS)
    for (snapshot, entry), kept in zip(noted, same, strict=True):
        if kept:
            snapshot.unseen.discard(entry[0])  # (its sample says no write: judged as any slot left as it was)
            snapshot.fresh_due.append(entry[:4])
        elif entry[0] in snapshot.partly or entry[0] in snapshot.unseen:  # in part, or unseen: by its inputs
            snapshot.fresh_due.append((entry[0], entry[1], entry[2], True))
        else:
            snapshot.resampled.add(entry[0])
            if entry[1].inside is not None and (not entry[3] or entry[1].shares_version):
                # Inside a loaded arena, changed by no write through the slot's own tensor (its version counter, not
                # the arena's, stayed; or it is the arena's): the loader's write, or one PWAL hid (``.data``).
                # Judged by its inputs.
                snapshot.fresh_due.append((entry[0], entry[1], entry[2], False))


def check_freshness(snapshots: Sequence[LayerSnapshot]) -> None:
    """Judge the slots :func:`judge_noted` found due against their inputs (stale where an input changed); call with
    the plan's copies done. Each input is judged once per layer, the value samples of all in one batch."""
    due = [snapshot for snapshot in snapshots if snapshot.fresh_due]
    if not due:
        return
    changes: list[dict[Any, int]] = []
    asked: list[tuple[dict[Any, int], Any, _InputBefore, Any]] = []  # (per-layer verdicts, key, before, now)
    for snapshot in due:
        inputs = snapshot.inputs
        assert inputs is not None  # _note_fresh notes only slots with inputs
        known: dict[Any, int] = {}
        changes.append(known)
        for index, _, _, _ in snapshot.fresh_due:
            for key in snapshot.freshness[index][3]:
                if key not in known:
                    _, resolve, before = inputs.inputs[key]
                    known[key] = _UNCHANGED  # set below
                    asked.append((known, key, before, resolve()))
    for (known, key, _, _), change in zip(asked, _input_changes([(b, v) for _, _, b, v in asked]), strict=True):
        known[key] = change
    for snapshot, known in zip(due, changes, strict=True):
        entries, snapshot.fresh_due = snapshot.fresh_due, []
        for index, slot, current, rewritten in entries:
            snapshot._check_fresh(index, slot, current, rewritten, known)


def doubt_foreign_writes(self: LayerSnapshot, foreign: Sequence[torch.Tensor]) -> None:
    """Flag a slot left on its captured memory whose bytes the reload wrote through another path's new tensor.

    ``foreign`` are new tensors left at other paths (respecified, moved and kept, untracked): when PWAL rebinds
    another slot onto this slot's memory (a rotation of captured tensors) and writes it there, this slot's
    version counter moves and its value sample changes, so it looks refreshed, but the values are the other
    slot's (found by the fuzzer as a ``skip`` of a view whose base was rotated away).
    """
    if not foreign:
        return
    layer = self.layer
    for index, slot in enumerate(self.slots):
        captured = self.captured[index]
        watched = slot.origin is Origin.ALIAS or (slot.tracks_freshness and index in self.freshness)
        if captured is None or not watched or slot.wrapped:
            continue
        version = self.versions[index] if index < len(self.versions) else -1
        # Its sample changed: written, also where the version counter did not move (a write through ``.data``).
        if index not in self.resampled and (version < 0 or version_of(captured) == version):
            continue  # nothing wrote its memory
        current = slot.get(layer)
        if current is not captured and not (
            isinstance(current, torch.Tensor)
            and current.untyped_storage() is captured.untyped_storage()
            and current.data_ptr() == captured.data_ptr()
        ):
            continue  # not left in place: restore judged it
        # Foreign tensors are other paths' new tensors, even the captured object itself (another path took it);
        # a new view object at this very path is its own.
        owners = [t for t in foreign if (t is not current or current is captured) and _overlap(t, captured)]
        if not owners:
            continue
        self.findings.append(
            self.sealed.finding(
                FindingKind.STALE,
                slot,
                detail="PWAL left it on its captured memory, but the reload wrote that memory through another "
                "path's new tensor: it holds that path's values, and a recapture would read them. Rebuild it "
                "in PWAL",
            )
        )


def left_stale(self: LayerSnapshot) -> list[int]:
    """For a reload that raised (nothing checked): the watched slots PWAL left on their captured memory with
    their old value sample while an input changed, as :meth:`_check_fresh` would judge them (see
    :attr:`SealedSlot.owed`)."""
    left = [
        (index, sample, current)
        for index, (before, _, sample, _) in self.freshness.items()
        if isinstance(current := self.slots[index].get(self.layer), torch.Tensor)
        and current.layout is torch.strided
        and current.device.type != "meta"
        and current.untyped_storage() is before.untyped_storage()
        and self.changed_inputs(index)
    ]
    same = unchanged([(sample, current) for _, sample, current in left], SLOT_ELEMENTS)
    return [index for (index, _, _), kept in zip(left, same, strict=True) if kept]


def changed_inputs(self: LayerSnapshot, index: int) -> list[str]:
    """The names of slot ``index``'s freshness inputs that changed since the snapshot (none if unwatched)."""
    before = self.freshness.get(index)
    inputs = self.inputs
    if before is None or inputs is None:
        return []
    changed: list[str] = []
    for key in before[3]:
        name, resolve, input_before = inputs.inputs[key]
        if _input_change(input_before, resolve()) != _UNCHANGED:
            changed.append(name)
    return changed


def _check_fresh(
    self: LayerSnapshot,
    index: int,
    slot: SealedSlot,
    current: torch.Tensor,
    rewritten: bool,
    changes: Mapping[Any, int],
) -> None:
    """Flag a noted slot whose inputs changed.

    A slot rewritten in place with its old sampled values is still taken as refreshed when the inputs too were
    only maybe written (the same sampled values through the parameter or in a new tensor): a same-weights
    reload.
    """
    assert self.inputs is not None  # _note_fresh notes only slots with inputs
    changed: list[str] = []
    worst = _UNCHANGED
    for key in self.freshness[index][3]:
        change = changes[key]
        if change != _UNCHANGED:
            changed.append(self.inputs.inputs[key][0])
            worst = max(worst, change)
    fresh = worst == _UNCHANGED or (worst == _MAYBE and rewritten)
    if fresh and not slot.owed:
        return  # a partial reload that did not touch this slot's inputs, or the same values written again
    left = self.partly.get(index)
    if left is not None or index in self.unseen:  # rewritten in place, in part or by no write the recording saw
        if not fresh:
            inputs = ", ".join(changed)
            if left is not None:
                size = current.numel() * current.element_size()
                detail = (
                    f"its input(s) {inputs} changed but PWAL rewrote it in place only in part ({left:,} of its "
                    f"{size:,} bytes are not provably new: left out, written by an op that reads what it writes "
                    "(mul_, a custom op's mutable argument) or whose reach is not known, or given values computed "
                    "from old ones); the graph would read old values there. Rewrite all of it from its inputs in "
                    "PWAL (or rebuild it as a new tensor)"
                )
            else:
                detail = (
                    f"its input(s) {inputs} changed and so did its values, but the recording of this reload saw no "
                    "write to it (a NumPy view, a raw kernel or another thread wrote it): nothing says all of it is "
                    "new, and the graph would read any old values left. Write it with torch ops in PWAL (or rebuild "
                    "it as a new tensor)"
                )
            self.findings.append(
                self.sealed.finding(FindingKind.STALE, slot, after=fingerprint(current), detail=detail)
            )
        return
    if index in self.resampled:  # a carve of a loaded arena whose bytes changed (judge_noted)
        if not fresh:
            self.findings.append(
                self.sealed.finding(
                    FindingKind.STALE, slot, after=fingerprint(current), detail=inside_detail(slot, changed)
                )
            )
        return
    what = "kept the old values through an in-place write" if rewritten else "neither rebuilt it nor wrote it"
    cause = (
        "an earlier reload left it stale (or raised before PWAL refreshed it), a reseal kept it so,"
        if fresh
        else f"its input(s) {', '.join(changed)} changed"
    )
    if slot.origin is Origin.WALKER:
        # Undeclared: nothing recorded says PWAL does not compute it, so a weight change that leaves it is stale.
        fix = (
            "Rebuild it in PWAL; if its contents do not depend on the weights, declare it static=True or record "
            "the initial load (with contract.record_inputs(): load(), before seal())"
        )
    else:
        fix = "Rebuild it in PWAL, or declare it static=True if its contents do not depend on the weights"
    self.findings.append(
        self.sealed.finding(
            FindingKind.STALE,
            slot,
            after=fingerprint(current),
            detail=f"{cause} but PWAL {what}; the graph would read old values at the right address. {fix}",
        )
    )
