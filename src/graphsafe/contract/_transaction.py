"""The reload transaction: ``begin`` -> load -> ``finish`` (or ``before_layer``/``after_layer`` per layer), and the
settling of the outcome. Its restore steps live in :mod:`~graphsafe.contract._steps`, its rules on tensors held
outside the model in :mod:`~graphsafe.contract._holders` (functions of the transaction, bound as its methods).
"""

from __future__ import annotations

import contextlib
import dataclasses
import reprlib
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _python_dispatch

from graphsafe._gcpause import collections_paused
from graphsafe.collectors import Dataflow
from graphsafe.contract._agreement import Agreement
from graphsafe.contract._attributes import remap_held_elsewhere
from graphsafe.contract._departures import Departures
from graphsafe.contract._freshness import ClosedLayer, check_closed, permuted_deferred
from graphsafe.contract._late import LateModule, late_stale
from graphsafe.contract._order import LoadStamp, changed_since, load_stamps, loaded_early
from graphsafe.contract._repeat import Repeat, late_loads, note_repeat
from graphsafe.contract._samples import Digest, SampleBatch
from graphsafe.contract._slots import InputRef, SealedLayer
from graphsafe.contract._snapshot import LayerSnapshot
from graphsafe.contract._tensorref import TensorRef
from graphsafe.contract._unnamed import UnnamedNote, UnownedNote, note_unowned, unnamed_stale, unwritten_unowned
from graphsafe.contract._unread import SkipState
from graphsafe.contract._unread_drift import excuse_unread_drift
from graphsafe.errors import GraphSafeError, NotServingSafeError, hide_frames_in_pytest
from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, Status

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

from graphsafe.contract import _holders, _steps
from graphsafe.contract._recording import InputIndex
from graphsafe.contract._verdict import _next_step, _unloaded_warning

if TYPE_CHECKING:
    from graphsafe.contract._contract import GraphContract

__all__ = ["ReloadTransaction"]


class ReloadTransaction:
    """One reload under a contract. Use as a context manager, or call :meth:`begin` and :meth:`finish`."""

    def __init__(self, contract: GraphContract, *, layerwise: bool, agreement: Agreement | None) -> None:
        self.contract = contract
        self.layerwise = layerwise
        self.agreement = agreement
        self.outcome: ReloadOutcome | None = None
        self._snapshots: dict[int, LayerSnapshot] = {}
        self._held: dict[str, list[tuple[str, torch.Tensor]]] | None = None  # see _manifest_extras
        # captured tensors whose slot keeps a new tensor (not restored): what alias paths can no longer follow
        # (snapshot, slot index, device, first address, end): captured memory left for a tensor no copy restored
        self._abandoned: list[tuple[LayerSnapshot, int, str, int, int]] = []
        # (layer, path) -> (id, version counter, data_ptr) of what each untracked manifest path held at the start
        self._held_before: dict[tuple[str, str], tuple[int, int, int]] = {}
        self._aliases: dict[str, str] | None = None  # see _holders._sealed_name
        # id -> the captured objects this transaction's snapshots held (see LayerSnapshot.take's ``originals``)
        self._originals: dict[int, torch.Tensor] = {}
        self._gone: set[int] = set()  # sealed layers already reported as replaced or removed
        self._stamps: dict[int, LoadStamp] = {}  # layerwise: id(sealed layer) -> its stamp at begin (_order)
        # layerwise: each snapshotted layer's digests at begin and at its snapshot, compared at the end (_order)
        self._order_digests: list[tuple[SealedLayer, list[tuple[torch.Tensor, Digest]]]] = []
        self._repeats: dict[int, Repeat] = {}  # id(sealed layer) -> its latest repeated before_layer (_repeat)
        self._called: set[int] = set()  # id(sealed layer) of every layer before_layer() was called for
        self._late: list[LateModule] = []  # modules registered after the seal, as at begin() (contract._late)
        self._moved: set[int] = set()  # of those, the ones still in the model elsewhere when snapshotted
        self._findings: list[Finding] = []
        #: New tensors earlier restore steps left at their paths (findings): later steps treat them as readers.
        self._kept: list[torch.Tensor] = []
        self._inputs: InputIndex | None = None  # where the model holds each tensor, for a recording's walks
        self._keepers: list[_holders.Keeper] = []  # paths earlier after_layer() steps left on new tensors
        #: (weak reference to each new tensor a restore step replaced, what replaced it): see _settle.
        self._rebound: list[tuple[weakref.ReferenceType[torch.Tensor], torch.Tensor]] = []
        #: Of those, the ones after_layer() replaced, with their version then (see _steps.written_after_close).
        self._closed_rebinds: _steps.ClosedRebinds = {}
        #: id(storage) -> (storage, offset, bytes) of the new tensors earlier restore steps copied from on it (see
        #: _note_earlier_new).
        self._earlier: dict[int, list[tuple[weakref.ReferenceType[Any], int, int]]] = {}
        self._restored = 0
        self._bytes = 0
        self._seconds = 0.0
        self._setup_seconds = 0.0
        self._begun = False
        self._finished = False
        # Active on a contract's first reload: what PWAL reads, learned once (see GraphContract.recorded_inputs).
        self._dataflow: Dataflow | None = None
        self._recording_thread = 0  # the thread whose dispatch-mode stack holds _dataflow
        self._unloaded: list[str] = []  # slots PWAL computed only from tensors this reload never wrote
        self._skip = SkipState()  # unread="skip": what the skip step did (contract._unread)
        self._samples = SampleBatch()  # the value samples of the snapshots being taken (see _snapshot)
        #: Sealed layer id -> the layer as ``after_layer()`` left it, checked again when the reload finishes.
        self._closed: dict[int, ClosedLayer] = {}
        #: The capture manifest's storages with exactly recorded bytes (see ``_reads_no_copy_reached``), read once.
        self._byte_ranges: list[Any] | None = None
        self._written: dict[int, Any] | None = None  # storages a recorded capture wrote, by id (see _graph_writes)
        self._weights: set[int] | None = None  # ids of the model's weight storages (see _weight_storages)
        #: Sealed layer id -> its unnamed tensors at its first snapshot; the unowned storages a capture read, at
        #: begin(): judged when the reload finishes (contract._unnamed).
        self._unnamed: dict[int, UnnamedNote] = {}
        self._unowned: list[UnownedNote] = []
        #: Captured parameters and buffers a registration replaced during the reload, as they left (_holders).
        self._departures = Departures(self._captured_refs, self._unrecorded)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"graphsafe reload of {self.contract._model_name()}"

    def _require_open(self, step: str) -> None:
        if self._finished:
            raise GraphSafeError(
                f"{self._where()}: {step} on a reload transaction that already finished; open a new one with "
                "contract.reload()"
            )
        if not self._begun:
            raise GraphSafeError(
                f"{self._where()}: {step} without begin(): the reload transaction is not open; call begin() first "
                "(or use it as a context manager)"
            )

    def begin(self) -> ReloadTransaction:
        """Start the reload: refuse if the contract is not serving-safe; snapshot unless layerwise.

        One transaction per contract at a time: while one is open (in any thread) ``begin()`` raises
        :class:`~graphsafe.GraphSafeError` at once instead of waiting. A transaction begins once.
        """
        contract = self.contract
        if self._finished:
            raise GraphSafeError(
                f"{self._where()}: begin() on a reload transaction that already finished; open a new one with "
                "contract.reload()"
            )
        if self._begun:
            raise GraphSafeError(f"{self._where()}: begin() twice: this reload transaction is already open")
        # Never blocks: a second reload waiting for the first would then reload on top of whatever it decided.
        if not contract._lock.acquire(blocking=False):
            busy = GraphSafeError(
                f"{self._where()}: a reload transaction is already open on this contract (in another thread, or "
                "one that began and never finished, or a seal() is running); finish() it before beginning another"
            )
            self._take_part_failed(busy)
            raise busy
        contract._lock_owner = threading.get_ident()
        try:
            if not contract.serving_safe:
                raise NotServingSafeError(
                    f"refusing to reload: {contract.unsafe_reason}"
                    + (_next_step(contract.unsafe_reason) if contract.sealed else ""),  # unsealed: the reason says
                    contract.last_outcome,
                )
            contract._active = self
            self._begun = True
            self._departures.__enter__()
            # Whole model: every layer now. Layer by layer: those whose captured storage another layer reads too
            # (a tie) now as well, since an earlier layer's PWAL can write that storage before their before_layer().
            early = [s for s in contract._layers if not self.layerwise or s.shared_across_layers]
            if self.layerwise:
                start = time.perf_counter()
                stamped = [
                    (sealed, layer)
                    for sealed in contract._layers
                    if (layer := sealed.layer_ref()) is not None and not sealed.shared_across_layers
                ]
                layers = [(layer, [slot.get for slot in sealed.slots]) for sealed, layer in stamped]
                for (sealed, _), load_stamp in zip(stamped, load_stamps(layers), strict=True):
                    self._stamps[id(sealed)] = load_stamp
                self._seconds += time.perf_counter() - start
            read_unowned = getattr(contract.manifest, "read_unowned", None)
            if read_unowned is not None:  # flushed with the snapshots' samples, or below
                self._unowned = note_unowned(read_unowned(), self._samples)
            if early:
                start = time.perf_counter()
                with collections_paused():
                    for sealed in early:
                        self._snapshot(sealed, flush=False)
                    self._samples.flush()  # every layer's value samples in one copy per dtype, before the load
                self._seconds += time.perf_counter() - start
            if self._unowned and not early:
                self._samples.flush()
            self._findings.extend(contract._unsealed_modules(self._late))
        except BaseException as exc:
            # Nothing was loaded yet: leave the contract as it was, not stuck with an open transaction.
            self._departures.__exit__()
            self._snapshots.clear()
            if contract._active is self:
                contract._active = None
            self._begun = False
            contract._lock_owner = None
            contract._lock.release()
            if isinstance(exc, Exception):  # an interrupt does not take part (docs/distributed.md, pairing rule)
                self._take_part_failed(exc)
            raise
        policy = contract.record_reloads
        if policy == "every" or (
            policy == "first"
            and (not contract._recorded or any(slot.unrecorded for slot in contract._manifest_slots.values()))
        ):
            # The first reload, or one watching a graph-read path no recording saw (it appeared after the one
            # recording): record what PWAL computes, so a table it never touches stops being watched.
            self._setup_seconds = Dataflow.prepare()  # once per process, reported apart from the reload's time
            Dataflow.drop_abandoned()
            self._dataflow = Dataflow()
            for snapshot in self._snapshots.values():  # which bytes of each watched slot PWAL rewrites in place
                self._dataflow.watch(entry[0] for entry in snapshot.freshness.values())
            self._dataflow.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            self._recording_thread = threading.get_ident()
        return self

    def _take_part_failed(self, error: Exception, outcome: ReloadOutcome | None = None) -> ReloadOutcome | None:
        """A group reload leaving before its agreement still takes part in its round, as ``FAILED``; returns the
        agreed outcome (``None`` without an agreement, or where taking part raised).

        The peers reload and wait for this rank; rounds pair the n-th group reload of every rank, so a rank that
        skipped one would pair its next reload with the peers' current one. The transaction is spent afterwards.
        """
        if self.agreement is None:
            return None
        self._finished = True
        try:
            local = outcome or ReloadOutcome(Status.FAILED, self.contract.mode, error=error)
            return self.agreement(dataclasses.replace(local, contract=self.contract.name))
        except Exception as exc:
            error.add_note(
                f"graphsafe: taking part in the rank agreement as FAILED raised {exc!r} too; treat this reload as "
                "failed on every rank of the group"
            )
            return None

    def _captured_refs(self) -> dict[int, TensorRef]:
        """Every sealed slot's captured tensor object, by ``id()`` (what :class:`Departures` watches leave)."""
        return {slot.tensor_ref.ident: slot.tensor_ref for sealed in self.contract._layers for slot in sealed.slots}

    @contextlib.contextmanager
    def _unrecorded(self) -> Iterator[None]:
        """The contract's own tensor ops during the reload (snapshots, restores, departure witnesses): unseen by the
        recording of what PWAL reads. Leaves a recording paused by someone else paused."""
        dataflow = self._dataflow
        if dataflow is None or dataflow.paused:
            yield
            return
        if _python_dispatch._get_current_dispatch_mode() is dataflow:
            # Off the stack meanwhile: a paused mode still costs a Python call per op (thousands per layerwise
            # reload: the snapshots' samples and digests, the restore's copies).
            with _python_dispatch._pop_mode_temporarily():
                yield
            return
        dataflow.paused = True  # under another mode (or on another thread's stack): let ops through unrecorded
        try:
            yield
        finally:
            dataflow.paused = False

    def _stop_recording(self) -> Dataflow | None:
        dataflow, self._dataflow = self._dataflow, None
        if dataflow is None:
            return None
        if threading.get_ident() != self._recording_thread:
            # Dispatch modes are per thread: this one sits on the stack of the thread that began the reload and
            # cannot be popped from here. Made inert (that thread's next reload pops it), it still tells what ran on
            # that thread; of a layer loaded on this one it saw nothing, and says nothing (note_partial_writes).
            dataflow.abandon()
            return dataflow
        return dataflow if dataflow.stop() else None  # (one taken off the stack by another holds a part only)

    def _learn_inputs(self, dataflow: Dataflow, snapshots: list[LayerSnapshot]) -> None:
        """Before restore: keep on each slot PWAL recomputed what the recording saw it read."""
        snapshots = [s for s in snapshots if s.freshness and not s.done]
        if not snapshots:
            return
        index = self._inputs
        if index is None:
            index = self._inputs = InputIndex(self.contract, dataflow)
        else:  # what this step's load and PWAL bound
            index.refresh([(s.sealed.qualname, s.layer) for s in snapshots])
        held = index.held

        def reads(tensor: torch.Tensor) -> list[InputRef]:
            return dataflow.reads(tensor, held)

        for snapshot in snapshots:
            written = index.written(snapshot.layer)
            self._unloaded.extend(snapshot.learn_inputs(reads, dataflow.updated, written))
            snapshot.note_partial_writes(dataflow.unwritten_bytes, saw_load=bool(written))
            for slot in snapshot.slots:
                if slot.watch_only and not slot.unrecorded:
                    self.contract._recorded_extras[(snapshot.sealed.qualname, slot.path.text)] = slot.inputs

    def __enter__(self) -> ReloadTransaction:
        return self.begin()

    def _layer_entries(self, step: str, layer: Any) -> list[SealedLayer]:
        """The sealed entries ``step`` acts on; a clear error for what is no module of the model (a layer's name,
        ``None``): silently doing nothing would leave the layer unsnapshotted or unrestored."""
        if not isinstance(layer, nn.Module):
            raise GraphSafeError(
                f"{self._where()}: {step} takes the layer's nn.Module, not {type(layer).__name__} "
                f"{' '.join(reprlib.repr(layer).split())}; pass the module itself (model.get_submodule(name) for a "
                "name)"
            )
        contract = self.contract
        entries = contract._layer_entries(layer)
        if not entries and id(layer) not in contract._units and all(m is not layer for m in contract.model.modules()):
            raise GraphSafeError(
                f"{self._where()}: {step} got a {type(layer).__name__} that is not a module of the model; pass a "
                "layer of the model the contract sealed"
            )
        return entries

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._begun or self._finished:
            return  # never began (begin() raised), or the body called finish() itself
        if exc is not None and not isinstance(exc, Exception):
            # KeyboardInterrupt and friends: mark unsafe and let them through untouched, with the reload recorded as
            # failed (last_outcome, listeners): the previous outcome must not stand for a half-loaded model.
            self._finished = True
            contract = self.contract
            contract.mark_unsafe(f"the reload was interrupted by {exc_type.__name__ if exc_type else exc!r}")
            try:
                self.outcome = contract.last_outcome = self._settle(exc)
                contract._notify(self.outcome)  # a listener's own error gives way to the interrupt
            finally:
                contract._active = None
                contract._lock_owner = None
                contract._lock.release()
            return
        self.finish(error=exc)

    def before_layer(self, layer: nn.Module) -> None:
        """Snapshot ``layer`` (and sealed layers under it) before it is re-materialised.

        A sealed layer snapshotted and not yet restored keeps its snapshot (a parent visited after its child was
        loaded, a loader that calls this once per weight): a snapshot taken now would see the loaded state.
        """
        self._require_open("before_layer()")
        start = time.perf_counter()
        with self._unrecorded(), collections_paused():  # the snapshot's own reads are not PWAL's
            for sealed in self._layer_entries("before_layer()", layer):
                pending = self._snapshots.get(id(sealed))
                if pending is not None and not pending.done:
                    # Snapshotted and not restored yet (a second before_layer for the layer, or its parent's
                    # after the child was loaded): a snapshot now would take the loaded state for the old one.
                    if id(sealed) in self._called:  # a repeat: a load after it needs PWAL after it (_repeat)
                        repeat = note_repeat(pending)
                        if repeat is not None:
                            self._repeats[id(sealed)] = repeat
                    self._called.add(id(sealed))  # (a tie's snapshot is taken at begin(): not a repeat)
                    continue
                self._called.add(id(sealed))
                self._snapshot(sealed, flush=False)
            self._samples.flush()
        self._seconds += time.perf_counter() - start

    def after_layer(self, layer: nn.Module) -> None:
        """Restore and verify ``layer`` right after its PWAL, so its new derived tensors can be freed now.

        A sealed layer whose captured storage another layer also reads (a tied embedding and head, a workspace
        shared by layers) waits for :meth:`finish`: only once every layer that reads the storage is loaded can the
        restore tell whether they still agree on its values.
        """
        self._require_open("after_layer()")
        start = time.perf_counter()
        dataflow = self._dataflow
        with self._unrecorded():  # restore's copies are the contract's, not PWAL's
            group: list[LayerSnapshot] = []
            for sealed in self._layer_entries("after_layer()", layer):
                snapshot = self._snapshots.get(id(sealed))
                if snapshot is None:
                    self._stamps.pop(id(sealed), None)  # the finding below says so
                    snapshot = self._snapshot(sealed)
                    if snapshot is not None and self.layerwise:
                        # Taken after the load: it sees PWAL's tensors as the captured ones, so neither stale
                        # values nor tensors that appeared after the seal can be checked. Fail closed.
                        snapshot.findings.append(
                            sealed.layer_finding(
                                FindingKind.RELOAD_ERROR,
                                "after_layer() without before_layer(): the layer's state before the load "
                                "was never snapshotted, so stale values and moved late tensors go unchecked",
                                declared=True,
                            )
                        )
                repeat = self._repeats.pop(id(sealed), None)
                if repeat is not None and snapshot is not None and not snapshot.done:
                    snapshot.findings.extend(late_loads(snapshot, repeat))
                if snapshot is not None and not snapshot.done and not sealed.shared_across_layers:
                    group.append(snapshot)
                elif snapshot is not None and not snapshot.done:
                    # Deferred to finish() (its storage is shared across layers): what it is computed from must
                    # not change from here on either (nothing runs PWAL for it again).
                    self._closed[id(sealed)] = ClosedLayer.of(snapshot, self._samples)
            with collections_paused(), torch._C.DisableTorchFunctionSubclass():
                if dataflow is not None:  # layers restored at finish() learn there, once
                    self._learn_inputs(dataflow, group)
                self._restore_group(group, close=True)
                self._samples.flush()  # the closed layers' input samples, before the load goes on
        self._seconds += time.perf_counter() - start

    def finish(self, error: BaseException | None = None) -> ReloadOutcome:
        """End the reload: restore what is left, verify, agree across ranks, then commit, recapture or raise.

        With ``error`` (the reload raised), the outcome is ``FAILED``, the contract is not serving-safe, and the
        caller re-raises ``error`` (the context manager does). Refuses (:class:`~graphsafe.GraphSafeError`) without
        :meth:`begin` and a second time: a transaction ends once.
        """
        self._require_open("finish()")
        self._finished = True
        self.contract._lock_owner = threading.get_ident()  # its listeners and callbacks may seal (see seal())
        try:
            return self._finish(error)
        finally:
            # Held through the decision and the mode's action: a reload begun meanwhile would see the old state.
            self.contract._lock_owner = None
            self.contract._lock.release()

    def _finish(self, error: BaseException | None) -> ReloadOutcome:
        try:
            # The contract's own work (the agreement, listeners and callbacks are not), reading memory as it lies:
            # past any tensor subclass's __torch_function__ (one that refuses untyped_storage(), say).
            with collections_paused(), torch._C.DisableTorchFunctionSubclass():
                outcome = self._settle(error)
        except BaseException as exc:  # the restore raised (the contract is marked unsafe): the peers still wait
            self._record_failure(exc, "graphsafe's restore raised", agree=True)
            raise
        contract = self.contract
        if self.agreement is not None:
            try:
                outcome = self.agreement(dataclasses.replace(outcome, contract=contract.name))
            except BaseException as exc:
                contract.mark_unsafe(f"rank agreement raised {exc!r}; the group's outcome is unknown")
                self._record_failure(exc, "the rank agreement raised", agree=False)
                raise
        self.outcome = outcome
        if outcome.status is not Status.COMMITTED:
            # Unsafe from here: the listeners run before the mode's action (which says why), and one may ask, or
            # be interrupted (the action then never runs).
            contract.mark_unsafe(f"the last reload ended {outcome.status.value}; its outcome is being acted on")
        try:
            listener_error = contract._notify(outcome)
        except BaseException:
            contract.last_outcome = outcome  # an interrupt in a listener (their own errors are returned)
            raise
        contract._apply(outcome, error)
        if self._unloaded:  # a note, after the contract acted (a warnings filter may turn it into an error)
            warnings.warn(_unloaded_warning(self._unloaded), stacklevel=3)
        if listener_error is not None:
            raise listener_error
        return outcome

    def _record_failure(self, exc: BaseException, what: str, *, agree: bool) -> None:
        """A reload that ended in an error of graphsafe's own step (the contract is already unsafe): record it as
        ``FAILED`` (``last_outcome``, ``txn.outcome``), let the peers take part in this agreement round (else they
        wait for this rank until their timeout, and its round counter falls one behind theirs for good), and tell
        the listeners, so the previous outcome never stands for a half-restored model. The caller re-raises."""
        contract = self.contract
        outcome = ReloadOutcome(
            Status.FAILED,
            contract.mode,
            findings=(
                Finding(
                    FindingKind.RELOAD_ERROR,
                    layer="",
                    layer_class=contract._model_name(),
                    path="",
                    declared=True,
                    detail=f"{what} {exc!r}; slots may be half-restored: recapture the graphs once the weights are "
                    "good, then reseal()",
                ),
            ),
            layers=len(contract._layers),
            error=exc,
        )
        if agree and isinstance(exc, Exception):  # an interrupt does not take part (docs/distributed.md)
            outcome = self._take_part_failed(exc, outcome) or outcome
        self.outcome = contract.last_outcome = outcome
        contract._notify(outcome)  # a listener's own error gives way to the step's

    def _captured_meanwhile(self) -> None:
        """A capture was reported while this reload is open (another thread's graph): that graph read the model
        mid-reload, PWAL's new tensors that the restore then drops or overwrites, so the reload cannot commit."""
        self._findings.append(
            Finding(
                FindingKind.UNTRACKABLE,
                layer="",
                layer_class=self.contract._model_name(),
                path="",
                declared=True,
                detail="a capture was reported (note_capture) while this reload was open: that graph read the model "
                "mid-reload, tensors the restore drops or overwrites; capture graphs before or after a reload, not "
                "during it: recapture them, then reseal()",
            )
        )

    def _settle(self, error: BaseException | None) -> ReloadOutcome:
        """Restore what is left, verify, and decide this rank's outcome (nothing outside the contract runs)."""
        contract = self.contract
        start = time.perf_counter()
        self._departures.__exit__()  # the restore's own rebinds are no departures
        try:
            dataflow = self._stop_recording()
            if dataflow is not None and error is None:
                self._learn_inputs(dataflow, list(self._snapshots.values()))
                contract._recorded = True
            self._inputs = None  # (it holds the recording: let both go with the reload's last walk)
            if error is None:
                # One plan for the whole model: every copy is planned against every other before any is launched,
                # and small copies of every layer share one _foreach_copy_ per group.
                group: list[LayerSnapshot] = []
                for sealed in contract._layers:
                    snapshot = self._snapshots.get(id(sealed))
                    if snapshot is None:
                        snapshot = self._snapshot(sealed)
                    if snapshot is not None and not snapshot.done:
                        group.append(snapshot)
                if self._closed:  # tied layers after_layer() left to this restore: permuted since?
                    self._findings.extend(permuted_deferred(self._closed.values()))
                self._restore_group(group)
                if self._closed_rebinds:  # a loader's write into a tensor after_layer() replaced
                    self._findings.extend(_steps.written_after_close(self._closed_rebinds, final=True))
                    self._closed_rebinds = {}
                if self._order_digests:  # a layer whose weights were written before its before_layer()
                    noted, self._order_digests = self._order_digests, []
                    changed = changed_since([digests for _, digests in noted])
                    early = [sealed for (sealed, _), moved in zip(noted, changed, strict=True) if moved]
                    self._findings.extend(loaded_early(sealed) for sealed in early)
                if self._closed:  # layers after_layer() restored: still in the model, and as it left them?
                    closed = check_closed(self._closed.values(), self._still_in_model, self._held_anywhere)
                    self._findings.extend(closed)
                    self._closed.clear()
                if self._late:  # modules registered after the seal: derived tensors PWAL left stale
                    self._findings.extend(late_stale(self._late))
                    self._late = []
                judged: set[int] = set()
                if self._unnamed:  # tensors no slot path names, left stale behind an unnamed step
                    self._findings.extend(unnamed_stale(self._unnamed.values(), contract._unnamed_now))
                    judged = {ident for note in self._unnamed.values() for ident in note.storages()}
                    self._unnamed = {}
                if contract.manifest is not None:
                    # The walker and the manifest can see the same slot: report each (layer, path) once, where the
                    # contract's own finding stays a problem. One graph truth excuses (drift of a tensor no graph
                    # reads) must not hide the manifest's finding about the memory the graph does read there (a
                    # storage the path left, orphaned).
                    own = excuse_unread_drift(self._findings, contract.manifest)
                    flagged = {(f.layer, f.path) for f in own if f.kind.is_problem and f.path}
                    extra = [
                        f
                        for f in contract.manifest.check(contract, unwritten_unowned(self._unowned, judged))
                        if not f.path or (f.layer, f.path) not in flagged
                    ]
                    self._unowned = []
                    self._findings = own + excuse_unread_drift(extra, contract.manifest)
                # What a reseal must not take for fresh: the slots this reload found stale (SealedSlot.owed).
                stale = {(f.layer, f.path) for f in self._findings if f.kind is FindingKind.STALE}
                for sealed in contract._layers:
                    for slot in sealed.slots:
                        if stale:
                            slot.owed = slot.tracks_freshness and (sealed.qualname, slot.path.text) in stale
                        elif slot.owed:  # (nothing stale: only what was owed changes)
                            slot.owed = False
            else:
                for snapshot in self._snapshots.values():
                    try:
                        left = snapshot.left_stale()
                    except Exception:  # cannot tell: every watched slot may be left stale (fail closed)
                        left = list(snapshot.freshness)
                    for index in left:
                        snapshot.slots[index].owed = True
                self._quarantine_all()
                self._findings.append(
                    Finding(
                        FindingKind.RELOAD_ERROR,
                        layer="",
                        layer_class=type(contract.model).__name__,
                        path="",
                        declared=True,
                        detail=f"the reload raised {error!r}; captured storage was not restored "
                        "and the weights may be half-loaded",
                    )
                )
            if self._rebound:  # (an error too: after_layer() steps rebound before it)
                rebound, self._rebound = self._rebound, []
                remap_held_elsewhere(rebound, self._model_tensors)
            # Deciding asks code outside the contract too (the adapter's graphless hook, the manifest): an error
            # there leaves an unrestored model, so it must not leave the contract serving-safe either.
            status = contract._decide(self._findings, error)
            if status is not Status.COMMITTED and contract._unsafe_reason is None:
                # Unsafe from this rank's own outcome on, not from the group's: the agreement may wait minutes.
                contract.mark_unsafe(f"this rank's reload ended {status.value}; its outcome is being agreed on")
            unread = getattr(contract.manifest, "unread", None)  # the kernel scan's: slots no graph reads
            unread_slots = unread(contract) if callable(unread) and error is None else None
        except BaseException as exc:
            # The restore itself raised (a failed copy, an interrupt): some layers may be rebound, others not.
            self._quarantine_all()
            contract.mark_unsafe(f"the reload's restore raised {exc!r}; slots may be half-restored")
            raise
        finally:
            self._snapshots.clear()
            self._closed.clear()
            self._originals.clear()
            contract._active = None
        self._seconds += time.perf_counter() - start
        return ReloadOutcome(
            status=status,
            mode=contract.mode,
            findings=tuple(self._findings),
            slots_restored=self._restored,
            bytes_copied=self._bytes,
            seconds=self._seconds,
            layers=len(contract._layers),
            error=error,
            setup_seconds=self._setup_seconds,
            slots_unread=None if unread_slots is None else len(unread_slots),
            slots_skipped=self._skip.skipped,
            skip_refused=self._skip.refused if contract.unread == "skip" and error is None else None,
            skip_notes=tuple(self._skip.notes),
        )

    def _model_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the model: its parameters and buffers, and what the walker reaches from each module."""
        model = self.contract.model
        yield from (p for _, p in model.named_parameters(remove_duplicate=False))
        yield from (b for _, b in model.named_buffers(remove_duplicate=False))
        yield from self.contract._walked_tensors()

    # The restore steps (contract._steps).
    _reads_no_copy_reached = _steps._reads_no_copy_reached
    _snapshot = _steps._snapshot
    _graph_writes = _steps._graph_writes
    _weight_storages = _steps._weight_storages
    _note_earlier_new = _steps._note_earlier_new
    _earlier_new = _steps._earlier_new
    _still_in_model = _steps._still_in_model
    _holds_at = _steps._holds_at
    _held_anywhere = _steps._held_anywhere
    _quarantine = _steps._quarantine
    _quarantine_all = _steps._quarantine_all
    _restore_group = _steps._restore_group
    _note_rebound = _steps._note_rebound
    _plan_common = _steps._plan_common
    _launch_common = _steps._launch_common
    _plan_by_rules = _steps._plan_by_rules

    # Tensors held outside the model's paths (contract._holders).
    _block_foreign_holders = _holders._block_foreign_holders
    _take_back = _holders._take_back
    _doubt_abandoned = _holders._doubt_abandoned
    _protect_pending = _holders._protect_pending
    _manifest_extras = _holders._manifest_extras
    _untracked_holders = _holders._untracked_holders
    _sealed_name = _holders._sealed_name
    _changed_inputs = _holders._changed_inputs
    _version_of = _holders._version_of
    _captured_of = _holders._captured_of
