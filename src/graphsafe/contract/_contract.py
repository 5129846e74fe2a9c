"""``GraphContract``: seal -> reload transaction -> restore -> verify -> ``ReloadOutcome``.

The contract is the only place that decides an outcome. Adapters translate a framework's lifecycle into
``seal``/``reload``/``before_layer``/``after_layer`` calls and an outcome into the framework's action.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
from torch import nn

from graphsafe.collectors import Classified, Dataflow, classify, classify_walk, walk
from graphsafe.contract._access import submodule_is
from graphsafe.contract._agreement import Agreement
from graphsafe.contract._copy import CopyBatch
from graphsafe.contract._slots import InputRef, LayerSnapshot, SealedLayer, SealedSlot
from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.errors import (
    ContractViolation,
    DeclarationError,
    DeclaredDriftError,
    GraphSafeError,
    NotServingSafeError,
    RankAgreementError,
    RecaptureError,
    ReloadFailedError,
    UndeclaredDriftError,
    UnloadedInputWarning,
)
from graphsafe.handles import RemovableHandle
from graphsafe.outcome import Finding, FindingKind, Origin, ReloadOutcome, SlotInfo, SlotRef, Status, fingerprint
from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_generation, declarations_of

__all__ = ["DETECT_POLICIES", "MODES", "Detect", "GraphContract", "Mode", "ReloadTransaction"]

Mode = Literal["strict", "recapture", "migrate"]
Detect = Literal["every-reload", "sealed-paths", "declared-only"]
MODES: tuple[str, ...] = ("strict", "recapture", "migrate")
DETECT_POLICIES: tuple[str, ...] = ("every-reload", "sealed-paths", "declared-only")


class ManifestCheck(Protocol):
    """What the contract needs of a capture-time manifest (see :func:`graphsafe.record_capture`)."""

    def reindex(self, contract: GraphContract) -> None: ...

    def check(self, contract: GraphContract) -> list[Finding]: ...


def _listen(
    registry: list[Callable[[ReloadOutcome], Any]], fn: Callable[[ReloadOutcome], Any], kind: str
) -> RemovableHandle:
    registry.append(fn)

    def remove() -> None:
        if fn in registry:
            registry.remove(fn)

    return RemovableHandle(remove, lambda: fn in registry, f"{kind}({fn!r})")


def _sealed_slot(entry: Classified) -> SealedSlot:
    return SealedSlot(
        entry.path,
        entry.fingerprint,
        weakref.ref(entry.tensor),
        entry.origin,
        entry.declaration,
        restorable=entry.restorable,
        reason=entry.reason,
        alias_of=entry.alias_of,
    )


class GraphContract:
    """Keeps every graph-visible tensor of ``model`` at its captured storage across weight reloads.

    ``mode`` decides what a finding does, and every mode fails closed:

    * ``"strict"``: any finding raises a :class:`~graphsafe.ContractViolation` carrying the outcome; the contract
      is then not serving-safe and refuses reloads until :meth:`reseal`.
    * ``"recapture"``: findings a new capture fixes give ``NEEDS_RECAPTURE``; ``on_recapture`` callbacks run, then
      the contract reseals itself (with no callback it waits, not serving-safe, for :meth:`reseal`).
    * ``"migrate"``: as ``recapture``, and undeclared tensors that drifted are restored like declared ones
      (recorded as ``auto-restored`` findings) where their path and layout allow.

    ``detect`` is the collector policy: ``"every-reload"`` walks each layer at every reload (finds tensors that
    appeared after the seal, e.g. scratch allocated on the first forward), ``"sealed-paths"`` only re-resolves
    the paths found at seal (no walk per reload: O(declared + found)), ``"declared-only"`` tracks declared slots
    alone. Parameters and buffers are tracked under every policy (restored like declared slots).
    """

    def __init__(
        self,
        model: nn.Module,
        mode: Mode = "strict",
        *,
        detect: Detect = "every-reload",
        budget: WalkBudget | None = None,
        devices: Collection[torch.device | str] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GraphContract needs an nn.Module, got {type(model).__name__}")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)} (no mode only warns)")
        if detect not in DETECT_POLICIES:
            raise ValueError(f"unknown detect policy {detect!r}: choose one of {', '.join(DETECT_POLICIES)}")
        self._model_ref = weakref.ref(model)
        self.mode: Mode = mode
        self.detect: Detect = detect
        self.budget = budget if budget is not None else WalkBudget()
        if not isinstance(self.budget, WalkBudget):
            raise TypeError(f"GraphContract: budget is a graphsafe.WalkBudget, not {type(budget).__name__}")
        #: The devices whose tensors the contract tracks (``None``: the walker's default, the layer's own devices).
        self.devices: DeviceSet | None = DeviceSet(devices) if devices is not None else None
        self._layers: list[SealedLayer] = []
        self._by_layer: dict[int, list[int]] = {}  # id(layer) -> indices into _layers (for before/after_layer)
        self._sealed = False
        self._unsafe_reason: str | None = "not sealed yet: call seal() after the first load, before capture"
        self._callbacks: list[Callable[[ReloadOutcome], Any]] = []
        self._listeners: list[Callable[[ReloadOutcome], Any]] = []
        # Captured tensors of slots a failed restore left behind: kept alive until reseal so that a replay the
        # caller should not do anyway reads stale memory rather than memory the allocator handed to someone else.
        self._quarantine: list[torch.Tensor] = []
        self._active: ReloadTransaction | None = None
        self.last_outcome: ReloadOutcome | None = None
        self.manifest: ManifestCheck | None = None
        self.reloads = 0
        #: Whether the first reload transaction records what PWAL reads (see :meth:`recorded_inputs`).
        self.record_first_reload = True
        self._recorded = False  # a recording was taken (at a reload, or of the initial load by record_inputs())
        self._pending: Dataflow | None = None  # record_inputs() before seal(), consumed by seal()

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The model (raises if it was garbage-collected)."""
        model = self._model_ref()
        if model is None:
            raise GraphSafeError("the contract's model was garbage-collected")
        return model

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal` has run."""
        return self._sealed

    @property
    def serving_safe(self) -> bool:
        """Whether replaying the captured graphs is known to read the right memory."""
        return self._sealed and self._unsafe_reason is None

    @property
    def unsafe_reason(self) -> str | None:
        """Why the contract is not serving-safe, or ``None``."""
        return self._unsafe_reason

    def slots(self) -> Iterator[SlotInfo]:
        """Every sealed slot (declared, parameter or buffer, alias and walker-found)."""
        for sealed in self._layers:
            for slot in sealed.slots:
                yield SlotInfo(
                    sealed.qualname,
                    sealed.layer_class,
                    slot.path.text,
                    slot.origin,
                    slot.fp,
                    slot.restorable,
                    slot.alias_of,
                    slot.declaration.source if slot.declaration else None,
                )

    def sealed_layers(self) -> Iterator[tuple[str, nn.Module]]:
        """``(qualified name, layer)`` for every layer the seal tracks."""
        for sealed in self._layers:
            layer = sealed.layer_ref()
            if layer is not None:
                yield sealed.qualname, layer

    # -- sealing -----------------------------------------------------------------------------------------------
    def seal(self) -> GraphContract:
        """Fingerprint every declared slot, parameter and buffer (and, unless ``declared-only``, every undeclared
        device tensor).

        Call after the first load and PWAL, before capture. Raises :class:`~graphsafe.DeclarationError` if a
        declared slot does not resolve to a tensor.
        """
        if self._active is not None:
            raise GraphSafeError("seal() inside a reload transaction")
        layers: list[SealedLayer] = []
        for qualname, layer in self.model.named_modules():
            sealed = self._seal_layer(qualname, layer)
            if sealed is not None:
                layers.append(sealed)
        # What PWAL was seen reading belongs to the layers, not to one seal: a reseal keeps it.
        recorded = {
            (id(sealed.layer_ref()), slot.path.text): (sealed.layer_ref, slot.inputs)
            for sealed in self._layers
            for slot in sealed.slots
            if slot.inputs is not None
        }
        for sealed in layers:
            for slot in sealed.slots:
                entry = recorded.get((id(sealed.layer_ref()), slot.path.text)) if slot.tracks_freshness else None
                if entry is not None and entry[0]() is sealed.layer_ref():
                    slot.inputs = entry[1]
        self._layers = layers
        self._index_layers()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._learn_initial_inputs(pending)
        self._quarantine.clear()
        self._sealed = True
        self._unsafe_reason = None
        if self.manifest is not None:
            self.manifest.reindex(self)
        return self

    def _index_layers(self) -> None:
        """Precompute what per-reload lookups need: entries by layer, and storages shared across layers."""
        by_layer: dict[int, list[int]] = {}
        owner: dict[int, SealedLayer] = {}
        for position, sealed in enumerate(self._layers):
            by_layer.setdefault(id(sealed.layer_ref()), []).append(position)
            for slot in sealed.slots:  # every storage is alive at seal, so ids are distinct
                first = owner.setdefault(id(slot.fp.storage_ref()), sealed)
                if first is not sealed:
                    first.shared_across_layers = sealed.shared_across_layers = True
        self._by_layer = by_layer

    # -- what PWAL reads -----------------------------------------------------------------------------------------
    @contextmanager
    def record_inputs(self) -> Iterator[None]:
        """Record what the initial load and PWAL compute each derived slot from: ``with contract.record_inputs():
        load(); pwal()``, then :meth:`seal`.

        Optional: without it the first reload transaction records the same (once; later reloads do not pay for
        the recording). Recording the initial load means even that first reload checks each slot against what its
        PWAL really reads rather than against the whole layer.
        """
        if self._sealed:
            raise GraphSafeError(
                "record_inputs() records the initial load before seal(); this contract is sealed, and its first "
                "reload records what PWAL reads by itself"
            )
        dataflow = Dataflow()
        with dataflow:
            yield
        self._pending = dataflow

    def recorded_inputs(self) -> dict[SlotRef, tuple[SlotRef, ...]]:
        """For every declared slot a recording saw PWAL compute: the tensors (as the model holds them) it was
        computed from. Slots missing here are checked against their ``derived_from``, else the whole layer."""
        return {
            SlotRef(sealed.qualname, slot.path.text): tuple(ref.ref for ref in slot.inputs)
            for sealed in self._layers
            for slot in sealed.slots
            if slot.inputs is not None
        }

    def _input_index(self, dataflow: Dataflow) -> tuple[Callable[[Any], InputRef | None], dict[int, set[int]]]:
        """Every tensor the model holds, by storage, as the first path found (parameters and buffers, then plain
        tensor attributes, then the seal's deeper paths); and by module id, the storages of its weights (anything
        but its declared slots) the recording saw written."""
        index: dict[int, tuple[Any, InputRef]] = {}
        updated: dict[int, set[int]] = {}
        modules = list(self.model.named_modules())

        def add(module: nn.Module, qualname: str, text: str, value: Any, weight: bool) -> None:
            if not isinstance(value, torch.Tensor) or value.layout is not torch.strided or value.device.type == "meta":
                return
            storage = value.untyped_storage()
            if weight and dataflow.updated(value):
                updated.setdefault(id(module), set()).add(id(storage))
            if id(storage) in index:
                return
            try:
                path = SlotPath(text)
            except GraphSafeError:  # an attribute name outside the path grammar cannot be watched by path
                return
            index[id(storage)] = (storage, InputRef(weakref.ref(module), path, SlotRef(qualname, path.text)))

        for qualname, module in modules:
            for name, value in (*module._parameters.items(), *module._buffers.items()):
                add(module, qualname, name, value, True)
        for qualname, module in modules:
            declared = declarations_of(module)
            for name, value in list(vars(module).items()):
                add(module, qualname, name, value, name not in declared)
        for sealed in self._layers:
            layer = sealed.layer_ref()
            if layer is not None:
                for slot in sealed.slots:
                    add(layer, sealed.qualname, slot.path.text, slot.get(layer), False)

        def held(storage: Any) -> InputRef | None:
            entry = index.get(id(storage))
            return entry[1] if entry is not None and entry[0] is storage else None

        return held, updated

    def _learn_initial_inputs(self, dataflow: Dataflow) -> None:
        """Keep what the recorded initial load computed each declared slot from (see :meth:`record_inputs`)."""
        held, _ = self._input_index(dataflow)
        for sealed in self._layers:
            layer = sealed.layer_ref()
            for slot in sealed.slots:
                current = slot.get(layer) if slot.tracks_freshness and layer is not None else None
                if isinstance(current, torch.Tensor) and dataflow.updated(current):
                    slot.inputs = tuple(dataflow.reads(current, held))
        self._recorded = True

    def reseal(self) -> GraphContract:
        """Seal again after a recapture or a full reload; makes the contract serving-safe again."""
        return self.seal()

    def _seal_layer(self, qualname: str, layer: nn.Module) -> SealedLayer | None:
        generation = declarations_generation(layer)
        classified = classify(
            layer, walk_layer=self.detect != "declared-only", budget=self.budget, devices=self.devices
        )
        for missing in classified.unresolved:
            raise DeclarationError(
                f"{SlotRef(qualname, '')} ({type(layer).__name__}): declared slot {missing.path!r} {missing.what} "
                f"at seal (declared by {missing.declaration.source}); assign it before seal() or remove the declaration"
            )
        for entry in classified.tensors:
            declaration = entry.declaration
            if declaration is None:
                continue
            for source in declaration.derived_from or ():
                if not isinstance(SlotPath(source).resolve_or(layer, None), torch.Tensor):
                    raise DeclarationError(
                        f"{SlotRef(qualname, entry.path.text)} ({type(layer).__name__}): declared slot "
                        f"{entry.path.text!r} names derived_from {source!r}, which does not resolve to a tensor at "
                        f"seal (declared by {declaration.source}); name the tensor it is computed from, or drop "
                        "derived_from and let graphsafe record what PWAL reads"
                    )
        slots = [_sealed_slot(entry) for entry in classified.tensors]
        exhausted = classified.exhausted
        if not slots and exhausted is None and self.detect != "every-reload":
            # Nothing to track now; with every-reload the layer stays, so tensors it allocates later (scratch on a
            # first forward) are still walked at each reload.
            return None
        return SealedLayer(weakref.ref(layer), qualname, type(layer).__name__, slots, generation, exhausted)

    # -- reload ------------------------------------------------------------------------------------------------
    def reload(self, *, layerwise: bool = False, agreement: Agreement | None = None) -> ReloadTransaction:
        """A reload transaction: ``with contract.reload() as txn: model.load_weights(new)``.

        With ``layerwise=True`` nothing is snapshotted up front: call ``txn.before_layer(layer)`` before each layer
        is re-materialised and ``txn.after_layer(layer)`` right after its PWAL. With ``agreement`` (for instance
        ``graphsafe.adapters.distributed.agreement(group)``) every rank prepares locally, then all ranks agree on
        the worst status before any commits, recaptures or raises.
        """
        return ReloadTransaction(self, layerwise=layerwise, agreement=agreement)

    def on_recapture(self, fn: Callable[[ReloadOutcome], Any]) -> RemovableHandle:
        """Run ``fn(outcome)`` when a reload needs the graphs captured again (then the contract reseals)."""
        return _listen(self._callbacks, fn, "on_recapture")

    def on_outcome(self, fn: Callable[[ReloadOutcome], Any]) -> RemovableHandle:
        """Call ``fn(outcome)`` with the outcome of every reload, whatever its status, once it is decided (after rank
        agreement, before the mode acts on it). A listener that raises does not change the outcome: its error is
        raised after the contract has acted."""
        return _listen(self._listeners, fn, "on_outcome")

    def mark_unsafe(self, reason: str) -> None:
        """Declare the captured graphs unsafe to replay until :meth:`reseal` (used by adapters)."""
        self._unsafe_reason = reason

    # -- internals used by the transaction --------------------------------------------------------------------
    def _layer_entries(self, layer: nn.Module) -> list[SealedLayer]:
        """The sealed entries of ``layer`` and the modules under it, in seal order."""
        positions: list[int] = []
        for module in layer.modules():
            for position in self._by_layer.get(id(module), ()):
                if self._layers[position].layer_ref() is module:
                    positions.append(position)
        if len(positions) > 1:
            positions = sorted(set(positions))
        return [self._layers[p] for p in positions]

    def _adopt_late_declarations(self, sealed: SealedLayer, layer: nn.Module) -> None:
        """Declarations made after the seal (``register_derived`` on a first forward) join the seal as declared."""
        generation = declarations_generation(layer)
        if generation == sealed.declared_generation:
            return
        by_path = {slot.path.text: index for index, slot in enumerate(sealed.slots)}
        for text, declaration in list(declarations_of(layer).items()):
            index = by_path.get(text)
            if index is not None and sealed.slots[index].origin is Origin.DECLARED:
                continue
            value = declaration.path.resolve_or(layer, None)
            if not isinstance(value, torch.Tensor):
                continue  # verified at the next seal, which raises DeclarationError for it
            slot = SealedSlot(declaration.path, fingerprint(value), weakref.ref(value), Origin.DECLARED, declaration)
            if index is not None:
                # Known to the walker since the seal: keep the sealed fingerprint, now as a declared slot.
                old = sealed.slots[index]
                slot = SealedSlot(old.path, old.fp, old.tensor_ref, Origin.DECLARED, declaration)
                sealed.slots[index] = slot
            else:
                sealed.slots.append(slot)
        sealed.declared_generation = generation

    def _walker_extras(self, sealed: SealedLayer, layer: nn.Module) -> tuple[list[SealedSlot], str | None]:
        """Tensors the walker finds now but the seal did not know (``every-reload`` only)."""
        if self.detect != "every-reload":
            return [], None
        known = sealed.known_paths
        # known paths are neither reported nor fingerprinted by the walk
        result = walk(layer, budget=self.budget, devices=self.devices, skip_paths=known)
        storages = {
            id(s.fp.storage_ref()): s.path.text
            for s in sealed.slots
            if s.origin is Origin.DECLARED or s.origin.is_state
        }
        extras = [_sealed_slot(entry) for entry in classify_walk(result, known, storages)]
        return extras, result.exhausted

    def _notify(self, outcome: ReloadOutcome) -> Exception | None:
        """Call every ``on_outcome`` listener; return the first error one raised (raised once the contract acted)."""
        first: Exception | None = None
        for listener in list(self._listeners):
            try:
                listener(outcome)
            except Exception as exc:
                first = first or exc
        return first

    def _decide(self, findings: list[Finding], error: BaseException | None) -> Status:
        problems = [f for f in findings if f.kind.is_problem]
        if error is not None:
            return Status.FAILED
        if not problems:
            return Status.COMMITTED
        if self.mode == "strict" or any(not f.kind.recapture_fixes for f in problems):
            return Status.FAILED
        return Status.NEEDS_RECAPTURE

    def _apply(self, outcome: ReloadOutcome, error: BaseException | None) -> None:
        """Turn an (agreed) outcome into the mode's action: commit, recapture, or raise."""
        self.last_outcome = outcome
        self.reloads += 1
        if outcome.status is Status.COMMITTED:
            return
        if outcome.status is Status.NEEDS_RECAPTURE:
            # Unsafe until the reseal below succeeds: a callback or the reseal itself may raise.
            self._unsafe_reason = "the reload needs the graphs captured again: recapture, then call reseal()"
            if not self._callbacks:
                return
            for callback in list(self._callbacks):
                try:
                    callback(outcome)
                except Exception as exc:
                    self._unsafe_reason = f"recapture callback {callback!r} failed: {exc!r}"
                    raise RecaptureError(
                        f"recapture after reload failed in {callback!r}: {exc}; the graphs may read stale memory "
                        "(contract not serving-safe until reseal())",
                        outcome,
                    ) from exc
            self.seal()
            return
        self._unsafe_reason = "the last reload failed: " + (
            repr(error) if error is not None else f"{len(outcome.problems)} finding(s)"
        )
        if error is not None:
            return  # the transaction re-raises the original error
        raise _violation(outcome, self)


def _violation(outcome: ReloadOutcome, contract: GraphContract) -> ContractViolation:
    problems = outcome.problems
    remote = [f for f in problems if f.rank is not None]
    undeclared = [f for f in problems if not f.declared]
    header = (
        f"graphsafe {contract.mode} mode: the reload left {len(problems)} graph-visible slot(s) unsafe; "
        "the contract is not serving-safe until reseal() (after a recapture or a full reload)."
    )
    body = outcome.summary()
    if remote and contract._decide([f for f in problems if f.rank is None], None) is not Status.FAILED:
        # This rank's own reload would have stood: name the ranks that failed the group (agreement findings).
        ranks = ", ".join(str(r) for r in sorted({f.rank for f in remote if f.rank is not None}))
        return RankAgreementError(
            f"graphsafe: the group's reload failed because of rank(s) {ranks}, so every rank of the group fails "
            f"it; the contract is not serving-safe until reseal().\n{body}",
            outcome,
        )
    if any(not f.kind.recapture_fixes for f in problems):
        return ReloadFailedError(f"{header}\n{body}", outcome)
    if undeclared and not remote:
        advice = ""
        if any(f.path for f in undeclared):
            advice += (
                "\nDeclare them with @graph_visible(...) or register_derived(...); "
                "graphsafe.migration_report(contract) or `graphsafe report` shows how."
            )
        if any(not f.path for f in undeclared):
            advice += (
                "\nCaptured storage no layer holds (a module-level cache or a library's internal buffer) cannot be "
                "declared: write it in place in PWAL, or keep it reachable from the layer and declare that path."
            )
        return UndeclaredDriftError(f"{header}\n{body}{advice}", outcome)
    return DeclaredDriftError(f"{header}\n{body}", outcome)


def _unloaded_warning(notes: list[str]) -> UnloadedInputWarning:
    shown = "; ".join(notes[:5]) + (f"; and {len(notes) - 5} more" if len(notes) > 5 else "")
    return UnloadedInputWarning(
        f"graphsafe: PWAL computed {len(notes)} derived slot(s) only from tensors this reload never wrote, while "
        f"it wrote other tensors of their layers: {shown}. If those are copies of earlier weights, the slots keep "
        "values the contract cannot tell are stale: compute them from the loaded tensors "
        "(contract.recorded_inputs() lists what each slot reads)"
    )


class ReloadTransaction:
    """One reload under a contract. Use as a context manager, or call :meth:`begin` and :meth:`finish`."""

    def __init__(self, contract: GraphContract, *, layerwise: bool, agreement: Agreement | None) -> None:
        self.contract = contract
        self.layerwise = layerwise
        self.agreement = agreement
        self.outcome: ReloadOutcome | None = None
        self._snapshots: dict[int, LayerSnapshot] = {}
        self._gone: set[int] = set()  # sealed layers already reported as replaced or removed
        self._findings: list[Finding] = []
        self._restored = 0
        self._bytes = 0
        self._seconds = 0.0
        self._begun = False
        # Active on a contract's first reload: what PWAL reads, learned once (see GraphContract.recorded_inputs).
        self._dataflow: Dataflow | None = None
        self._unloaded: list[str] = []  # slots PWAL computed only from tensors this reload never wrote

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def begin(self) -> ReloadTransaction:
        """Start the reload: refuse if the contract is not serving-safe; snapshot unless layerwise."""
        contract = self.contract
        if contract._active is not None:
            raise GraphSafeError("a reload transaction is already open on this contract")
        if not contract.serving_safe:
            refused = NotServingSafeError(f"refusing to reload: {contract.unsafe_reason}", contract.last_outcome)
            if self.agreement is not None:
                # The peers reload and wait for this rank: take part as FAILED so that agreement rounds stay paired.
                self.agreement(ReloadOutcome(Status.FAILED, contract.mode, error=refused))
            raise refused
        contract._active = self
        self._begun = True
        if not self.layerwise:
            start = time.perf_counter()
            try:
                for sealed in contract._layers:
                    self._snapshot(sealed)
            except BaseException:
                # Nothing was loaded yet: leave the contract as it was, not stuck with an open transaction.
                self._snapshots.clear()
                contract._active = None
                self._begun = False
                raise
            self._seconds += time.perf_counter() - start
        if contract.record_first_reload and not contract._recorded:
            self._dataflow = Dataflow()
            self._dataflow.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        return self

    def _stop_recording(self) -> Dataflow | None:
        dataflow, self._dataflow = self._dataflow, None
        if dataflow is not None:
            dataflow.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        return dataflow

    def _learn_inputs(self, dataflow: Dataflow, snapshots: list[LayerSnapshot]) -> None:
        """Before restore: keep on each slot PWAL recomputed what the recording saw it read."""
        snapshots = [s for s in snapshots if s.freshness and not s.done]
        if not snapshots:
            return
        held, updated = self.contract._input_index(dataflow)

        def reads(tensor: torch.Tensor) -> list[InputRef]:
            return dataflow.reads(tensor, held)

        for snapshot in snapshots:
            written = {storage for module in snapshot.layer.modules() for storage in updated.get(id(module), ())}
            self._unloaded.extend(snapshot.learn_inputs(reads, dataflow.updated, written))

    def __enter__(self) -> ReloadTransaction:
        return self.begin()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._begun:
            return
        if exc is not None and not isinstance(exc, Exception):
            # KeyboardInterrupt and friends: mark unsafe and let them through untouched.
            self._stop_recording()
            self.contract._active = None
            self.contract.mark_unsafe(f"the reload was interrupted by {exc_type.__name__ if exc_type else exc!r}")
            return
        self.finish(error=exc)

    def before_layer(self, layer: nn.Module) -> None:
        """Snapshot ``layer`` (and sealed layers under it) before it is re-materialised."""
        start = time.perf_counter()
        if self._dataflow is not None:
            self._dataflow.paused = True  # the snapshot's own reads are not PWAL's
        try:
            for sealed in self.contract._layer_entries(layer):
                self._snapshot(sealed)
        finally:
            if self._dataflow is not None:
                self._dataflow.paused = False
        self._seconds += time.perf_counter() - start

    def after_layer(self, layer: nn.Module) -> None:
        """Restore and verify ``layer`` right after its PWAL, so its new derived tensors can be freed now."""
        start = time.perf_counter()
        batch = CopyBatch()
        dataflow = self._dataflow
        if dataflow is not None:
            dataflow.paused = True  # restore's copies are the contract's, not PWAL's
        try:
            entries = self.contract._layer_entries(layer)
            if dataflow is not None:
                taken = (self._snapshots.get(id(sealed)) for sealed in entries)
                self._learn_inputs(dataflow, [s for s in taken if s is not None])
            for sealed in entries:
                snapshot = self._snapshots.get(id(sealed))
                if snapshot is None:
                    batch.flush()  # a snapshot reads input values
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
                if snapshot is not None and not snapshot.done:
                    self._restore(snapshot, batch)
        finally:
            batch.flush()
            self._bytes += batch.written
            if dataflow is not None:
                dataflow.paused = False
        self._seconds += time.perf_counter() - start

    def finish(self, error: BaseException | None = None) -> ReloadOutcome:
        """End the reload: restore what is left, verify, agree across ranks, then commit, recapture or raise.

        With ``error`` (the reload raised), the outcome is ``FAILED``, the contract is not serving-safe, and the
        caller re-raises ``error`` (the context manager does).
        """
        contract = self.contract
        start = time.perf_counter()
        try:
            dataflow = self._stop_recording()
            if dataflow is not None and error is None:
                self._learn_inputs(dataflow, list(self._snapshots.values()))
                contract._recorded = True
            if error is None:
                # One batch for the whole model: small copies of every layer share one _foreach_copy_ per group.
                batch = CopyBatch()
                try:
                    for sealed in contract._layers:
                        snapshot = self._snapshots.get(id(sealed))
                        if snapshot is None:
                            batch.flush()  # a snapshot reads input values
                            snapshot = self._snapshot(sealed)
                        if snapshot is not None and not snapshot.done:
                            self._restore(snapshot, batch)
                finally:
                    batch.flush()  # also when a layer raised: rebound slots must not keep old values
                    self._bytes += batch.written
                if contract.manifest is not None:
                    # The walker and the manifest can see the same slot: report each (layer, path) once.
                    flagged = {(f.layer, f.path) for f in self._findings if f.kind.is_problem and f.path}
                    self._findings.extend(
                        f for f in contract.manifest.check(contract) if not f.path or (f.layer, f.path) not in flagged
                    )
            else:
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
        except BaseException as exc:
            # The restore itself raised (a failed copy, an interrupt): some layers may be rebound, others not.
            self._quarantine_all()
            contract.mark_unsafe(f"the reload's restore raised {exc!r}; slots may be half-restored")
            raise
        finally:
            self._snapshots.clear()
            contract._active = None
        self._seconds += time.perf_counter() - start
        status = contract._decide(self._findings, error)
        outcome = ReloadOutcome(
            status=status,
            mode=contract.mode,
            findings=tuple(self._findings),
            slots_restored=self._restored,
            bytes_copied=self._bytes,
            seconds=self._seconds,
            layers=len(contract._layers),
            error=error,
        )
        if self.agreement is not None:
            try:
                outcome = self.agreement(outcome)
            except BaseException as exc:
                contract.mark_unsafe(f"rank agreement raised {exc!r}; the group's outcome is unknown")
                raise
        self.outcome = outcome
        listener_error = contract._notify(outcome)
        contract._apply(outcome, error)
        if self._unloaded:  # a note, after the contract acted (a warnings filter may turn it into an error)
            warnings.warn(_unloaded_warning(self._unloaded), stacklevel=3)
        if listener_error is not None:
            raise listener_error
        return outcome

    # -- per layer ---------------------------------------------------------------------------------------------
    def _snapshot(self, sealed: SealedLayer) -> LayerSnapshot | None:
        layer = sealed.layer_ref()
        contract = self.contract
        if id(sealed) in self._gone:
            return None  # reported when the reload began; finish() must not report it again
        if layer is None or not self._still_in_model(sealed, layer):
            self._gone.add(id(sealed))
            for slot in sealed.slots:
                self._findings.append(
                    sealed.finding(FindingKind.VANISHED, slot, detail="the layer itself was replaced or removed")
                )
            return None
        contract._adopt_late_declarations(sealed, layer)
        extras, exhausted = contract._walker_extras(sealed, layer)
        snapshot = LayerSnapshot.take(sealed, layer, extras)
        if exhausted or sealed.walk_exhausted:
            snapshot.findings.append(
                sealed.layer_finding(
                    FindingKind.BUDGET_EXHAUSTED,
                    (exhausted or sealed.walk_exhausted or "")
                    + "; undeclared tensors past it are unchecked: raise max_depth/max_objects or declare them",
                    declared=False,
                )
            )
        self._snapshots[id(sealed)] = snapshot
        return snapshot

    def _still_in_model(self, sealed: SealedLayer, layer: nn.Module) -> bool:
        if not sealed.qualname:
            return layer is self.contract.model
        known = submodule_is(self.contract.model, sealed.atoms, layer)
        if known is not None:
            return known
        try:
            return self.contract.model.get_submodule(sealed.qualname) is layer
        except AttributeError:
            return False

    def _quarantine(self, snapshot: LayerSnapshot) -> None:
        """Keep the snapshot's captured tensors alive until the next seal (see ``GraphContract._quarantine``)."""
        self.contract._quarantine.extend(t for t in snapshot.captured if t is not None)

    def _quarantine_all(self) -> None:
        for snapshot in self._snapshots.values():
            self._quarantine(snapshot)

    def _restore(self, snapshot: LayerSnapshot, batch: CopyBatch) -> None:
        """Restore one layer. Its copies join ``batch`` and are launched with later layers' (or by the caller)."""
        rebinds: list[tuple[int, torch.Tensor]] = []
        if not self._still_in_model(snapshot.sealed, snapshot.layer):
            # Replaced after the snapshot: the loader filled the new layer, so restoring the orphaned one would
            # commit captured storage that keeps the old values.
            snapshot.findings.extend(
                snapshot.sealed.finding(FindingKind.VANISHED, slot, detail="the layer was replaced during the reload")
                for slot in snapshot.slots
            )
        elif not snapshot.in_place():
            # A layer whose captured storage another layer also tracks keeps the one-layer-at-a-time order of
            # copies; so does one with walker extras (their storages are not known ahead).
            isolate = snapshot.sealed.shared_across_layers or snapshot.shared
            if isolate:
                batch.flush()
            rebinds = snapshot.restore(auto_restore=self.contract.mode == "migrate", batch=batch)
            if snapshot.pairs:
                if isolate:
                    batch.flush()
                snapshot.check_aliases(rebinds)
            snapshot.rebind(rebinds)
            snapshot.verify()
        snapshot.done = True
        self._restored += snapshot.restored
        self._findings.extend(snapshot.findings)
        if any(f.kind.is_problem for f in snapshot.findings):
            self._quarantine(snapshot)
        # Drop the strong references now: the new derived tensors of this layer can be freed before the next.
        snapshot.captured = [None] * len(snapshot.captured)
        snapshot.pairs = []
        del rebinds
