"""``GraphContract``: seal -> reload transaction -> restore -> verify -> ``ReloadOutcome``.

The contract is the only place that decides an outcome. Adapters translate a framework's lifecycle into
``seal``/``reload``/``before_layer``/``after_layer`` calls and an outcome into the framework's action.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import reprlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
from torch import nn

from graphsafe.collectors import (
    UNTRACKABLE_ADVICE,
    Classified,
    Dataflow,
    classify,
    classify_walk,
    module_names,
    walk,
)
from graphsafe.contract._access import submodule_is
from graphsafe.contract._agreement import Agreement
from graphsafe.contract._copy import CopyBatch, clone_laid_out, overlapping_pairs
from graphsafe.contract._fast import Rebinds, plan_common, step_conditions
from graphsafe.contract._gcpause import collections_paused
from graphsafe.contract._order import Stamp, stamp
from graphsafe.contract._samples import SampleBatch, version_of
from graphsafe.contract._slots import (
    ClosedLayer,
    InputRef,
    LayerSnapshot,
    RestorePlan,
    SealedLayer,
    SealedSlot,
    SharedIndex,
    ValuesBefore,
    address_range,
    check_closed,
    check_freshness,
    judge_noted,
    reads_as_captured,
)
from graphsafe.contract._tensorref import TensorRef
from graphsafe.contract._unmaterialised import refuse_unmaterialised
from graphsafe.contract._unread import UNREAD_POLICIES, SkipState, skip_unread
from graphsafe.contract._unread_drift import excuse_unread_drift
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
    hide_frames_in_pytest,
)
from graphsafe.handles import RemovableHandle
from graphsafe.outcome import (
    Finding,
    FindingKind,
    Origin,
    ReloadOutcome,
    SlotInfo,
    SlotRef,
    Status,
    fingerprint,
    geometry_key,
    memory_tensors,
)
from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_generation, declarations_of

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

__all__ = [
    "DETECT_POLICIES",
    "MODES",
    "UNREAD_POLICIES",
    "Detect",
    "GraphContract",
    "Mode",
    "ReloadTransaction",
    "Unread",
]

Mode = Literal["strict", "recapture", "migrate"]
Detect = Literal["every-reload", "sealed-paths", "declared-only"]
Unread = Literal["restore", "skip"]
MODES: tuple[str, ...] = ("strict", "recapture", "migrate")
DETECT_POLICIES: tuple[str, ...] = ("every-reload", "sealed-paths", "declared-only")


class ManifestCheck(Protocol):
    """What the contract needs of a capture-time manifest (see :func:`graphsafe.record_capture`)."""

    def reindex(self, contract: GraphContract) -> None: ...

    def check(self, contract: GraphContract) -> list[Finding]: ...

    def held(self, contract: GraphContract) -> Iterable[tuple[str, str, torch.Tensor]]: ...


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
        TensorRef.of(entry.tensor),
        entry.origin,
        entry.declaration,
        restorable=entry.restorable,
        reason=entry.reason,
        alias_of=entry.alias_of,
        # A tensor only the walker found is watched until a recording of the initial load says PWAL leaves it
        # alone: one that appeared after that recording (a warm-up's lazy cache) was seen by none.
        unrecorded=entry.origin is Origin.WALKER,
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

    ``unread`` decides what a reload does with slots no captured graph reads (by the kernel scan):
    ``"restore"`` (default) copies them like every slot; ``"skip"`` skips their copies where it is safe (see
    ``graphsafe.contract._unread`` for the exact rule): the new tensor PWAL made stays at the path and becomes the
    slot's sealed memory, and the old captured storage is let go. Precondition of ``"skip"``: every graph that reads
    the model is captured through graphsafe with the kernel scan (the torch adapter, ``record_capture(graph=...)``,
    the vLLM plugin); a graph captured any other way would read freed memory. Where what the graphs read is not
    fully known (a capture by the dispatch recorder, a kernel whose parameters the scan could not read), nothing is
    skipped and the outcome says why (``skip_refused``).

    ``name`` names the contract in every outcome it decides (``ReloadOutcome.contract``); rank agreement checks that
    every rank of a round decides the same contract. Default: the model's class name. Contracts that share an
    agreement group need distinct names (a target and a draft model of one class: pass ``name=``).
    """

    def __init__(
        self,
        model: nn.Module,
        mode: Mode = "strict",
        *,
        detect: Detect = "every-reload",
        budget: WalkBudget | None = None,
        devices: Collection[torch.device | str] | None = None,
        unread: Unread = "restore",
        name: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GraphContract needs an nn.Module, got {type(model).__name__}")
        if mode not in MODES:
            raise ValueError(
                f"GraphContract: unknown mode {mode!r}: choose one of {', '.join(MODES)} (every mode acts on a "
                "finding; to only list findings, run graphsafe.migration_report or `graphsafe report`)"
            )
        if detect not in DETECT_POLICIES:
            raise ValueError(f"unknown detect policy {detect!r}: choose one of {', '.join(DETECT_POLICIES)}")
        if unread not in UNREAD_POLICIES:
            raise ValueError(
                f"GraphContract: unknown unread policy {unread!r}: choose 'restore' (copy every slot) or 'skip' (skip "
                "the copies of slots no kernel-scanned graph reads)"
            )
        self._model_ref = weakref.ref(model)
        #: The contract's name in its outcomes and agreement rounds.
        self.name: str = name if name is not None else type(model).__qualname__
        #: What a reload does with slots no captured graph reads: ``"restore"`` or ``"skip"`` (see the class docs).
        self.unread: Unread = unread
        self.mode: Mode = mode
        self.detect: Detect = detect
        self.budget = budget if budget is not None else WalkBudget()
        if not isinstance(self.budget, WalkBudget):
            raise TypeError(f"GraphContract: budget is a graphsafe.WalkBudget, not {type(budget).__name__}")
        #: The devices whose tensors the contract tracks (``None``: the walker's default, the layer's own devices).
        self.devices: DeviceSet | None = DeviceSet(devices) if devices is not None else None
        self._layers: list[SealedLayer] = []
        self._units: frozenset[int] = frozenset()  # ids of the model's modules at seal: each its own reload unit
        #: id(module) -> the split qualified names after its first, for a module held at several paths at seal.
        self._also: dict[int, list[tuple[str, ...]]] = {}
        self._by_layer: dict[int, list[int]] = {}  # id(layer) -> indices into _layers (for before/after_layer)
        self._shared: SharedIndex = {}  # captured storage id -> every (sealed layer, slot position) reading it
        #: (id(sealed layer), slot position) of slots whose captured memory also lies under another storage object.
        self._cross: set[tuple[int, int]] = set()
        self._slot_keys: set[tuple[str, str]] = set()  # (layer, path) of every sealed slot
        #: Whether a whole-model restore step may go through the fast tier (``contract._fast``) where no rule of the
        #: engine can act. Off, every step runs through the rule engine: the verdict and the bytes written are the
        #: same either way (the differential test holds the two to that); only the cost differs.
        self.fast_tier = True
        self._sealed = False
        self._unsafe_reason: str | None = "not sealed yet: call seal() after the first load, before capture"
        self._callbacks: list[Callable[[ReloadOutcome], Any]] = []
        self._listeners: list[Callable[[ReloadOutcome], Any]] = []
        # Captured tensors of slots a failed restore left behind: kept alive until reseal so that a replay the
        # caller should not do anyway reads stale memory rather than memory the allocator handed to someone else.
        self._quarantine: list[torch.Tensor] = []
        self._active: ReloadTransaction | None = None
        # One transaction at a time: begin() takes it without blocking, finish() gives it back. A seal takes it too.
        self._lock = threading.Lock()
        self._lock_owner: int | None = None  # the thread holding _lock (a seal inside its own reload's action)
        # The capture generation (note_capture), and the one the graphs were at when a reload left the contract
        # unsafe: a reseal needs a capture after it (None: no reload is waiting for a recapture).
        self._captures = 0
        self._recapture_after: int | None = None
        # Never reset by a seal: an adapter's graph captured at or before it still reads the old storage.
        self._invalidated_at = 0
        self.last_outcome: ReloadOutcome | None = None
        self.manifest: ManifestCheck | None = None
        self.reloads = 0
        #: Whether the first reload transaction records what PWAL reads (see :meth:`recorded_inputs`).
        self.record_first_reload = True
        self._recorded = False  # a recording was taken (at a reload, or of the initial load by record_inputs())
        # declared-only with a manifest: the paths the manifest saw holding captured storage that no sealed slot
        # tracks, each as a walker-found slot kept across reloads (so a recording's lesson about it is kept)
        self._manifest_slots: dict[tuple[str, str], SealedSlot] = {}
        #: Those paths a recording saw PWAL run over, with what it saw PWAL compute each from (``None``: not
        #: computed, a fixed table): kept across seals, so a path that reappears after a reseal is known.
        self._recorded_extras: dict[tuple[str, str], tuple[InputRef, ...] | None] = {}
        # record_inputs() before seal(), consumed by seal(): the recording, and the tensors as they were before it
        self._pending: tuple[Dataflow, ValuesBefore] | None = None
        #: Set by an engine adapter: why no captured graph replays this model (a platform without graphs, an eager
        #: configuration), or ``None`` while graphs may replay. Asked when a reload decides: with no graph, findings
        #: a recapture would fix read no wrong memory (every forward reads the model's tensors as they are now),
        #: so such a reload commits; stale values and reload errors still fail.
        self.graphless: Callable[[], str | None] | None = None

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The model (raises if it was garbage-collected)."""
        model = self._model_ref()
        if model is None:
            raise GraphSafeError(
                "the contract's model was garbage-collected: a GraphContract holds its model weakly (it never keeps "
                "a model alive), so keep a reference to the model for as long as the contract is used, e.g. "
                "`model = load_model(); contract = GraphContract(model).seal()`"
            )
        return model

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal` has run."""
        return self._sealed

    @property
    def serving_safe(self) -> bool:
        """Whether replaying the captured graphs is known to read the right memory (never while a reload
        transaction is open: its layers may be half-restored)."""
        return self._sealed and self._unsafe_reason is None and self._active is None

    @property
    def unsafe_reason(self) -> str | None:
        """Why the contract is not serving-safe, or ``None``."""
        if self._unsafe_reason is None and self._active is not None:
            return (
                "a reload transaction is open (begun, not finished): the captured memory may be half-restored; "
                "finish() it"
            )
        return self._unsafe_reason

    @property
    def captures(self) -> int:
        """The capture generation: how many captures of this model's graphs were reported (:meth:`note_capture`)."""
        return self._captures

    @property
    def invalidated_at(self) -> int:
        """The capture generation (:attr:`captures`) at which the captured graphs last became unsafe (a reload
        that did not commit, :meth:`mark_unsafe`); 0 if never. A graph captured at this generation or before reads
        the storage of before that reload until it is captured again, even after a :meth:`reseal`."""
        return self._invalidated_at

    def note_capture(self) -> int:
        """Report that the graphs reading this model were captured (again) just now, from the model as it is.

        The evidence :meth:`reseal` needs after a reload left the contract unsafe. The capture adapter
        (:mod:`graphsafe.adapters.torch`), :func:`~graphsafe.record_capture` and the vLLM adapter call it for every
        capture they run; code that captures graphs some other way calls it right after its capture. Returns the
        new capture generation (:attr:`captures`).
        """
        self._captures += 1
        active = self._active
        if active is not None:
            active._captured_meanwhile()
        return self._captures

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
        declared slot does not resolve to a tensor. After a reload that left the contract unsafe, sealing again is
        :meth:`reseal`, and needs a capture after that reload.

        A ``devices`` filter that matches none of the model's parameters, buffers and declared slots (a rank and
        local-rank mix-up) raises :class:`~graphsafe.GraphSafeError`: it would track the declared slots at most. So
        does a parameter or buffer not materialised yet (a lazy module before its first forward, a ``meta`` tensor).
        A seal that finds nothing to track (``detect="declared-only"`` on a model with no declaration, parameter
        or buffer) leaves the contract not serving-safe: a contract that tracks nothing cannot keep any captured
        address. :attr:`unsafe_reason` says which setting to change.
        """
        return self._seal_alone(recaptured=False)

    def _seal_alone(self, *, recaptured: bool) -> GraphContract:
        """``_seal`` under the transaction lock: a reload begun on another thread while a seal walks the model
        would snapshot the old seal and finish against the new one, taken mid-load. The thread that holds the lock
        while its reload acts (a listener, an ``on_recapture`` callback) seals as before."""
        if self._lock.acquire(blocking=False):
            self._lock_owner = threading.get_ident()
            try:
                return self._seal(recaptured=recaptured)
            finally:
                self._lock_owner = None
                self._lock.release()
        if self._lock_owner != threading.get_ident() or self._active is not None:
            raise GraphSafeError(
                f"graphsafe contract of {self._model_name()}: seal() while a reload transaction is open (begun, not "
                "finished, possibly on another thread); finish() it, then seal"
            )
        return self._seal(recaptured=recaptured)

    def _seal(self, *, recaptured: bool) -> GraphContract:
        if self._active is not None:
            raise GraphSafeError("seal() inside a reload transaction")
        if self._recapture_after is not None and self._captures <= self._recapture_after and not recaptured:
            raise NotServingSafeError(
                f"graphsafe contract of {self._model_name()}: reseal() refused: {self._unsafe_reason}; the captured "
                "graphs still read the storage they were captured on, so sealing the model's current tensors would "
                "not make replay safe: recapture the graphs, then reseal() (graphsafe.adapters.torch and "
                "record_capture report their captures; after a capture of your own call contract.note_capture(), "
                "or reseal(recaptured=True))",
                self.last_outcome,
            )
        self._refuse_foreign_devices()
        refuse_unmaterialised(self.model)
        layers: list[SealedLayer] = []
        self._units = frozenset(id(module) for module in self.model.modules())
        self._also = {
            key: [tuple(name.split(".")) for name in names[1:]]
            for key, names in module_names(self.model).items()
            if len(names) > 1
        }
        try:
            for qualname, layer in self.model.named_modules():
                sealed = self._seal_layer(qualname, layer)
                if sealed is not None:
                    layers.append(sealed)
        except BaseException:
            if self._recapture_after is not None:
                # What blocks the seal (a declared path gone) gets fixed in the model after the capture that was
                # the evidence, so that capture did not see the model that will be sealed: capture again.
                self._recapture_after = self._captures
            raise
        # What PWAL was seen reading belongs to the layers, not to one seal: a reseal keeps it (and that a recording
        # was blind to a slot, which must not make it a fixed table).
        # So does a slot a reload left stale: sealing its tensor does not make its values fresh (SealedSlot.owed).
        recorded = {
            (id(sealed.layer_ref()), slot.path.text): (sealed.layer_ref, slot.inputs, slot.unrecorded, slot.owed)
            for sealed in self._layers
            for slot in sealed.slots
            if slot.tracks_freshness
        }
        for sealed in layers:
            for slot in sealed.slots:
                entry = recorded.get((id(sealed.layer_ref()), slot.path.text)) if slot.tracks_freshness else None
                if entry is not None and entry[0]() is sealed.layer_ref():
                    slot.inputs, slot.unrecorded, slot.owed = entry[1], entry[2], entry[3]
        self._layers = layers
        self._slot_keys = {(sealed.qualname, slot.path.text) for sealed in layers for slot in sealed.slots}
        self._manifest_slots = {}
        self._index_layers()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._learn_initial_inputs(*pending)
        self._quarantine.clear()
        self._sealed = True
        self._recapture_after = None
        self._unsafe_reason = None if any(sealed.slots for sealed in layers) else self._tracks_nothing()
        if self.manifest is not None:
            self.manifest.reindex(self)
        return self

    def _model_name(self) -> str:
        model = self._model_ref()
        return type(model).__name__ if model is not None else "a collected model"

    def _refuse_foreign_devices(self) -> None:
        """A ``devices`` list that matches none of the model's loaded tensors (its parameters, buffers and declared
        slots; a rank and local-rank mix-up) would seal the declared slots only and let a loader rebind the weights
        the graphs read: refused, in one line."""
        devices = self.devices
        if devices is None:
            return
        model = self.model
        tensors = [*model.parameters(), *model.buffers()]
        for module in model.modules():
            for declaration in declarations_of(module).values():
                value = declaration.path.resolve_or(module, None)
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        held = sorted({str(t.device) for t in tensors if t.device.type != "meta"})
        if held and not any(t.device in devices for t in tensors):
            wanted = ", ".join(str(d) for d in devices.devices or ())
            raise GraphSafeError(
                f"graphsafe seal of {type(model).__name__}: devices=[{wanted}] matches none of its tensors (they are "
                f'on {", ".join(held)}); pass devices= naming the device the graphs read ("cuda" matches every '
                "cuda:N), or leave devices out"
            )

    def _tracks_nothing(self) -> str:
        """Why an empty seal is not serving-safe, naming the setting that made it empty and what to do."""
        model = self.model
        tensors = (*model.parameters(), *model.buffers())
        held = sorted({str(t.device) for t in tensors if t.device.type != "meta"})
        # Meta tensors have no storage a graph could read: a model only on meta is not loaded yet.
        on_meta = not held and bool(tensors)
        where = (
            f"its parameters and buffers are on {', '.join(held)}"
            if held
            else "its parameters and buffers are on meta: it is not loaded yet"
            if on_meta
            else "it has no parameter or buffer"
        )
        devices = "every device" if self.devices is None else ", ".join(str(d) for d in self.devices.devices or ())
        advice = ["load its weights off meta"] if on_meta else []
        if self.devices is not None:
            advice.append('pass devices= naming the device the graphs read ("cuda" matches every cuda:N)')
        if self.detect == "declared-only":
            advice.append(
                'declare the graph-visible tensors (@graph_visible, register_derived) or use detect="sealed-paths"'
            )
        advice.append("then reseal()")
        return (
            f"the contract tracks nothing: the seal of {type(model).__name__} found no tensor on devices="
            f"[{devices}] with detect={self.detect!r} ({where}), so no captured address is kept; " + ", ".join(advice)
        )

    def _index_layers(self) -> None:
        """Precompute what per-reload lookups need: entries by layer, and the captured storages several slots read
        (in one layer or across layers), which a restore checks as one (``RestorePlan.watch``)."""
        by_layer: dict[int, list[int]] = {}
        readers: dict[int, list[tuple[SealedLayer, int]]] = {}
        storages: dict[int, Any] = {}
        for position, sealed in enumerate(self._layers):
            by_layer.setdefault(id(sealed.layer_ref()), []).append(position)
            for index, slot in enumerate(sealed.slots):  # live storages have distinct ids
                for part in slot.fp.memory():  # a wrapper subclass reads its inner tensors' storages
                    storage = part.storage_ref()
                    if storage is not None:
                        readers.setdefault(id(storage), []).append((sealed, index))
                        storages[id(storage)] = storage
        shared = {key: entries for key, entries in readers.items() if len(entries) > 1}
        for entries in shared.values():
            if any(sealed is not entries[0][0] for sealed, _ in entries):
                for sealed, _ in entries:
                    sealed.shared_across_layers = True
        self._by_layer = by_layer
        self._shared = shared
        # Two storage objects on one memory, each read by a slot the contract restores from PWAL's tensors (not
        # loaded state: an arena buffer a tensor is carved from holds that tensor's values): a tie no restore can
        # check, since every check of shared memory goes by storage identity.
        derived = {
            key
            for key, entries in readers.items()
            if any(sealed.slots[index].origin not in _LOADED for sealed, index in entries)
        }
        self._cross = {
            (id(sealed), index)
            for pair in _storages_sharing_memory(storages)
            if derived.issuperset(pair)
            for key in pair
            for sealed, index in readers[key]
        }

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
        # What the walk finds now, before the load: a slot the recording does not see computed but whose values
        # changed was computed where it could not see (another thread, a raw kernel), not left as a fixed table.
        units = frozenset(id(module) for module in self.model.modules())
        before = ValuesBefore.take(
            ref.tensor
            for module in self.model.modules()
            for ref in walk(module, budget=self.budget, devices=self.devices, units=units).refs
        )
        Dataflow.prepare()  # torch's one-time dispatch set-up, before the caller's load starts
        dataflow = Dataflow()
        with dataflow:
            yield
        self._pending = (dataflow, before)

    @property
    def inputs_recorded(self) -> bool:
        """Whether a recording of PWAL was taken (:meth:`record_inputs`, or the first reload): then a slot missing
        from :meth:`recorded_inputs` is one that PWAL neither made nor wrote while it was recorded."""
        return self._recorded

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

    def _learn_initial_inputs(self, dataflow: Dataflow, before: ValuesBefore) -> None:
        """Keep what the recorded initial load computed each declared slot from (see :meth:`record_inputs`)."""
        held, _ = self._input_index(dataflow)
        unseen: list[tuple[SealedSlot, torch.Tensor]] = []  # walker slots the recording did not see computed
        for sealed in self._layers:
            layer = sealed.layer_ref()
            for slot in sealed.slots:
                current = slot.get(layer) if slot.tracks_freshness and layer is not None else None
                if isinstance(current, torch.Tensor) and dataflow.updated(current):
                    slot.inputs = tuple(dataflow.reads(current, held))
                elif isinstance(current, torch.Tensor) and slot.origin is Origin.WALKER:
                    unseen.append((slot, current))
        if unseen:
            for (slot, _), blind in zip(unseen, before.written_unseen([t for _, t in unseen]), strict=True):
                slot.unrecorded = blind  # a blind recording keeps it watched (the fallback inputs)
        self._recorded = True

    def reseal(self, *, recaptured: bool = False) -> GraphContract:
        """Seal again after the graphs were captured again; makes the contract serving-safe again.

        After a reload that left the contract unsafe (``FAILED``, ``NEEDS_RECAPTURE`` with no ``on_recapture``
        callback, a failed callback, an interrupted reload, :meth:`mark_unsafe`), the captured graphs still read
        the storage of before that reload, so a reseal alone would make the contract call those graphs safe. It
        raises :class:`~graphsafe.NotServingSafeError` ("recapture the graphs, then reseal()") unless a capture
        was reported since (:meth:`note_capture`; the torch adapter, ``record_capture`` and the vLLM adapter do
        it for their captures).

        ``recaptured=True`` is the caller's word instead of that evidence: it vouches that every captured graph
        that reads this model's memory was captured again after that reload, from the model as it is now (or that
        no captured graph reads it any more), and that nothing rebound the model's tensors since.
        """
        return self._seal_alone(recaptured=recaptured)

    def _seal_layer(self, qualname: str, layer: nn.Module) -> SealedLayer | None:
        generation = declarations_generation(layer)
        classified = classify(
            layer,
            walk_layer=self.detect != "declared-only",
            budget=self.budget,
            devices=self.devices,
            units=self._units,
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
        if not slots and exhausted is None and not classified.notes and self.detect != "every-reload":
            # Nothing to track now; with every-reload the layer stays, so tensors it allocates later (scratch on a
            # first forward) are still walked at each reload.
            return None
        return SealedLayer(
            weakref.ref(layer), qualname, type(layer).__name__, slots, generation, exhausted, classified.notes
        )

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
        """Declare the captured graphs unsafe to replay until they are captured again and :meth:`reseal` ran
        (used by adapters and by the transaction when a reload breaks off)."""
        self._unsafe_reason = reason
        self._recapture_after = self._captures
        self._invalidated_at = self._captures

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
            slot = SealedSlot(declaration.path, fingerprint(value), TensorRef.of(value), Origin.DECLARED, declaration)
            if index is not None:
                # Known to the walker since the seal: keep the sealed fingerprint, now as a declared slot.
                old = sealed.slots[index]
                slot = SealedSlot(old.path, old.fp, old.tensor_ref, Origin.DECLARED, declaration)
                sealed.slots[index] = slot
            else:
                sealed.slots.append(slot)
        sealed.declared_generation = generation
        sealed.slots_changed()  # the walker must now skip the new paths; a new slot may share a storage
        self._index_layers()  # a new slot may read a storage other slots read

    def _outer(self, qualname: str) -> list[tuple[str, nn.Module]]:
        """The modules above ``qualname``, nearest first (the model itself last)."""
        found: list[tuple[str, nn.Module]] = []
        name = qualname
        while name:
            name = name.rpartition(".")[0]
            try:
                found.append((name, self.model.get_submodule(name) if name else self.model))
            except AttributeError:
                break
        return found

    def _walker_extras(
        self, sealed: SealedLayer, layer: nn.Module
    ) -> tuple[list[SealedSlot], str | None, tuple[str, ...]]:
        """Tensors the walker finds now but the seal did not know, and where it finds untrackable ones now
        (``every-reload`` only)."""
        if self.detect != "every-reload":
            return [], None, ()
        known = sealed.known_paths
        # known paths are neither reported nor fingerprinted by the walk
        result = walk(layer, budget=self.budget, devices=self.devices, skip_paths=known, units=self._units)
        tracked = [
            (slot.path.text, slot.origin, part.storage_ref()) for slot in sealed.slots for part in slot.fp.memory()
        ]
        extras = [_sealed_slot(entry) for entry in classify_walk(result, known, tracked)]
        return extras, result.exhausted, result.notes

    def _unsealed_modules(self) -> list[Finding]:
        """Modules registered after the seal (a layer appended to a ``ModuleList``, an adapter) that hold tensors a
        seal would track: no seal entry knows them and the walk never enters a module, so a graph captured since may
        read them at addresses no reload keeps. Reported, not sealed now: the contract cannot tell what a graph
        captured of them (a seal must come before the capture)."""
        late = [(qualname, module) for qualname, module in self.model.named_modules() if id(module) not in self._units]
        if not late:
            return []
        units = self._units | {id(module) for _, module in late}
        replaced = {sealed.qualname for sealed in self._layers}  # their own findings say so (vanished)
        findings: list[Finding] = []
        for qualname, module in late:
            if qualname in replaced:
                continue
            classified = classify(
                module, walk_layer=self.detect != "declared-only", budget=self.budget, devices=self.devices, units=units
            )
            if classified.tensors or classified.unresolved or classified.notes or classified.exhausted:
                findings.append(
                    Finding(
                        FindingKind.UNTRACKABLE,
                        layer=qualname,
                        layer_class=type(module).__name__,
                        path="",
                        declared=True,
                        detail="registered after the seal: none of its tensors is sealed, so no reload keeps the "
                        "addresses a graph captured since reads; recapture the graphs, then reseal()",
                    )
                )
        return findings

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
        if all(f.kind.recapture_fixes for f in problems) and self.graphless is not None and self.graphless():
            return Status.COMMITTED  # no captured graph replays: nothing reads the memory the findings name
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
            self.mark_unsafe("the reload needs the graphs captured again: recapture, then call reseal()")
            if not self._callbacks:
                return
            for callback in list(self._callbacks):
                try:
                    callback(outcome)
                except Exception as exc:
                    self.mark_unsafe(f"recapture callback {callback!r} failed: {exc!r}")
                    raise RecaptureError(
                        f"recapture after reload failed in {callback!r}: {exc}; the graphs may read stale memory "
                        "(contract not serving-safe until the graphs are captured again and reseal())",
                        outcome,
                    ) from exc
            self.note_capture()  # the callbacks are the recapture
            self._seal(recaptured=False)  # the finishing reload holds the lock
            return
        self.mark_unsafe(
            "the last reload failed: " + (repr(error) if error is not None else f"{len(outcome.problems)} finding(s)")
        )
        if error is not None:
            return  # the transaction re-raises the original error
        raise _violation(outcome, self)


def _storages_sharing_memory(storages: Mapping[int, Any]) -> list[tuple[int, int]]:
    """Pairs of ids of storage objects whose memory overlaps (a DLPack import of a captured tensor, a tensor carved
    out of an arena: a second storage object on the same bytes): storage identity cannot tell that they share it."""
    return overlapping_pairs(
        (str(storage.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes(), key)
        for key, storage in storages.items()
    )


_LOADED = (Origin.PARAMETER, Origin.BUFFER)


def _overlapping(spans: list[tuple[str, int, int, int]], tensor: torch.Tensor) -> list[int]:
    """The keys of ``spans`` (device, first address, end, key) whose memory ``tensor`` reads any byte of."""
    if not tensor.numel():
        return []
    device, start, end = address_range(tensor)
    return [key for where, first, last, key in spans if where == device and first < end and start < last]


class _Landing:
    """The copies of a step by address, to ask which landed on a range: per device, sorted by first address with the
    running maximum of their ends, so a question costs a search and the copies it finds (not a pass over all)."""

    def __init__(self, written: Sequence[tuple[str, int, int, Any]]) -> None:
        by_device: dict[str, list[tuple[int, int, int, Any]]] = {}
        for position, (device, start, end, move) in enumerate(written):
            by_device.setdefault(device, []).append((start, end, position, move))
        self._on: dict[str, tuple[list[int], list[int], list[tuple[int, int, int, Any]]]] = {}
        for device, items in by_device.items():
            items.sort(key=lambda item: (item[0], item[2]))
            furthest: list[int] = []
            reach = -1
            for _, end, _, _ in items:
                reach = max(reach, end)
                furthest.append(reach)
            self._on[device] = ([item[0] for item in items], furthest, items)

    def on(self, device: str, first: int, end: int) -> list[Any]:
        """The copies on ``device`` whose ``[start, end)`` overlaps ``[first, end)``, in the order written."""
        found = self._on.get(device)
        if found is None:
            return []
        starts, furthest, items = found
        hits: list[tuple[int, Any]] = []
        index = bisect.bisect_left(starts, end) - 1  # every copy from here back starts before ``end``
        while index >= 0 and furthest[index] > first:
            _, stop, position, move = items[index]
            if stop > first:
                hits.append((position, move))
            index -= 1
        hits.sort(key=lambda hit: hit[0])
        return [move for _, move in hits]


def _gaps(first: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[first, end)`` that no span of ``spans`` (sorted by start) covers."""
    gaps: list[tuple[int, int]] = []
    at = first
    for start, stop in spans:
        if at >= end:
            break
        if start > at:
            gaps.append((at, min(start, end)))
        at = max(at, stop)
    if at < end:
        gaps.append((at, end))
    return gaps


class _Covered:
    """Spans sorted by start with the running maximum of their ends: the parts of a range no span covers are found
    by one search and a walk over the spans that start inside the range (not a pass over all of them)."""

    def __init__(self, spans: Iterable[tuple[int, int]]) -> None:
        self.spans = sorted(span for span in spans if span[1] > span[0])  # an empty span covers nothing
        self.starts = [start for start, _ in self.spans]
        self.furthest: list[int] = []
        reach = -1
        for _, stop in self.spans:
            reach = max(reach, stop)
            self.furthest.append(reach)

    def gaps(self, first: int, end: int) -> list[tuple[int, int]]:
        """:func:`_gaps` of ``[first, end)``: the spans starting at or before ``first`` only move its start on."""
        below = bisect.bisect_right(self.starts, first)
        at = max(first, self.furthest[below - 1]) if below else first
        return _gaps(at, end, self.spans[below:]) if at < end else []


def _fills_span(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements occupy every byte of its address span (a broadcast dimension repeats bytes
    and leaves none out): dense once dimensions of size 1 or stride 0 are set aside."""
    dims = sorted(
        (stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1 and stride
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected = stride * size
    return True


def _same_as_new(storage: Any, lo: int, hi: int, moves: Iterable[Any]) -> bool:
    """Whether bytes ``[lo, hi)`` of the captured ``storage`` equal the bytes at the same offsets of the one new
    storage every move into it copied from (each new tensor at its captured tensor's offset): the buffer PWAL
    packed the slots in. Several new storages, or none, and the bytes are not known to be fresh."""
    if storage is None:
        return False
    sources: dict[int, Any] = {}
    for move in moves:
        new = move.new
        if type(new) not in (torch.Tensor, nn.Parameter) or new.storage_offset() != move.dst.storage_offset():
            return False  # laid out elsewhere: its bytes say nothing about these offsets
        source = new.untyped_storage()
        sources[id(source)] = source
    if len(sources) != 1:
        return False  # the slots on the captured storage came from several new storages: none of them is the buffer
    (source,) = sources.values()
    if source.nbytes() < hi or source.device != storage.device:
        return False
    old = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[lo:hi]
    return torch.equal(torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)[lo:hi], old)


def _next_step(reason: str | None) -> str:
    """What a refusal adds so that it names the way back (the reason may say it already)."""
    # A reason that names reseal() names its own way back (an empty seal needs no recapture, only a new seal).
    if reason is not None and "reseal()" in reason:
        return ""
    return "; next step: recapture the graphs, then reseal() (graphsafe.capture graphs: graph.recapture_and_reseal())"


_DECLARE_HINT = (
    "\nDeclare them with @graph_visible(...) or register_derived(...); "
    "graphsafe.migration_report(contract) or `graphsafe report` shows how."
)


def _violation(outcome: ReloadOutcome, contract: GraphContract) -> ContractViolation:
    problems = outcome.problems
    remote = [f for f in problems if f.rank is not None]
    undeclared = [f for f in problems if not f.declared]
    header = (
        f"graphsafe {contract.mode} mode: the reload left {len(problems)} graph-visible slot(s) unsafe; "
        "the contract is not serving-safe until the graphs are captured again and reseal() ran."
    )
    body = outcome.summary()
    if remote and contract._decide([f for f in problems if f.rank is None], None) is not Status.FAILED:
        # This rank's own reload would have stood: name the ranks that failed the group (agreement findings).
        ranks = ", ".join(str(r) for r in sorted({f.rank for f in remote if f.rank is not None}))
        return RankAgreementError(
            f"graphsafe: the group's reload failed because of rank(s) {ranks}, so every rank of the group fails "
            f"it; the contract is not serving-safe until the graphs are captured again and reseal().\n{body}",
            outcome,
        )
    if any(not f.kind.recapture_fixes for f in problems):
        moved = any(f.path and f.kind.recapture_fixes and f.kind is not FindingKind.UNTRACKABLE for f in undeclared)
        return ReloadFailedError(f"{header}\n{body}{_DECLARE_HINT if moved else ''}", outcome)
    if undeclared and not remote:
        advice = ""
        if any(f.kind is FindingKind.UNTRACKABLE for f in undeclared):
            advice += (
                "\nUntrackable tensors (no slot path names them) can be neither declared nor restored where they "
                "are: hold them where a path reaches them and declare it; graphsafe.migration_report(contract) "
                "lists them."
            )
        undeclared = [f for f in undeclared if f.kind is not FindingKind.UNTRACKABLE]
        if any(f.path for f in undeclared):
            advice += _DECLARE_HINT
        if any(not f.path for f in undeclared):
            advice += (
                "\nCaptured storage no layer holds (a module-level cache or a library's internal buffer) cannot be "
                "declared: keep it reachable from the layer and declare that path, pass it as a graph input "
                "(ignore=), or vouch for a fixed table no reload changes with contract.manifest.vouch_fixed(tensor)."
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
        self._held: dict[str, list[tuple[str, torch.Tensor]]] | None = None  # see _manifest_extras
        # captured tensors whose slot keeps a new tensor (not restored): what alias paths can no longer follow
        # (snapshot, slot index, device, first address, end): captured memory left for a tensor no copy restored
        self._abandoned: list[tuple[LayerSnapshot, int, str, int, int]] = []
        # (layer, path) -> (id, version counter, data_ptr) of what each untracked manifest path held at the start
        self._held_before: dict[tuple[str, str], tuple[int, int, int]] = {}
        # id -> the captured objects this transaction's snapshots held (see LayerSnapshot.take's ``originals``)
        self._originals: dict[int, torch.Tensor] = {}
        self._gone: set[int] = set()  # sealed layers already reported as replaced or removed
        self._stamps: dict[int, Stamp] = {}  # layerwise: id(sealed layer) -> its stamp at begin (see _order)
        self._moved: set[int] = set()  # of those, the ones still in the model elsewhere when snapshotted
        self._findings: list[Finding] = []
        #: New tensors earlier restore steps left at their paths (findings): later steps treat them as readers.
        self._kept: list[torch.Tensor] = []
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
            # Whole model: every layer now. Layer by layer: those whose captured storage another layer reads too
            # (a tie) now as well, since an earlier layer's PWAL can write that storage before their before_layer().
            early = [s for s in contract._layers if not self.layerwise or s.shared_across_layers]
            if self.layerwise:
                for sealed in contract._layers:
                    layer = sealed.layer_ref()
                    if layer is not None and not sealed.shared_across_layers:
                        self._stamps[id(sealed)] = stamp(layer)
            if early:
                start = time.perf_counter()
                with collections_paused():
                    for sealed in early:
                        self._snapshot(sealed, flush=False)
                    self._samples.flush()  # every layer's value samples in one copy per dtype, before the load
                self._seconds += time.perf_counter() - start
            self._findings.extend(contract._unsealed_modules())
        except BaseException as exc:
            # Nothing was loaded yet: leave the contract as it was, not stuck with an open transaction.
            self._snapshots.clear()
            if contract._active is self:
                contract._active = None
            self._begun = False
            contract._lock_owner = None
            contract._lock.release()
            if isinstance(exc, Exception):  # an interrupt does not take part (docs/distributed.md, pairing rule)
                self._take_part_failed(exc)
            raise
        if contract.record_first_reload and (
            not contract._recorded or any(slot.unrecorded for slot in contract._manifest_slots.values())
        ):
            # The first reload, or one watching a graph-read path no recording saw (it appeared after the one
            # recording): record what PWAL computes, so a table it never touches stops being watched.
            self._setup_seconds = Dataflow.prepare()  # once per process, reported apart from the reload's time
            self._dataflow = Dataflow()
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

    def _stop_recording(self) -> Dataflow | None:
        dataflow, self._dataflow = self._dataflow, None
        if dataflow is None:
            return None
        if threading.get_ident() != self._recording_thread:
            # Dispatch modes are per thread: this one sits on the stack of the thread that began the reload and
            # cannot be popped from here. Made inert, it learns nothing (it never saw this thread's ops).
            dataflow.paused = True
            return None
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
        if self._dataflow is not None:
            self._dataflow.paused = True  # the snapshot's own reads are not PWAL's
        try:
            with collections_paused():
                for sealed in self._layer_entries("before_layer()", layer):
                    pending = self._snapshots.get(id(sealed))
                    if pending is not None and not pending.done:
                        # Snapshotted and not restored yet (a second before_layer for the layer, or its parent's
                        # after the child was loaded): a snapshot now would take the loaded state for the old one.
                        continue
                    self._snapshot(sealed, flush=False)
                self._samples.flush()
        finally:
            if self._dataflow is not None:
                self._dataflow.paused = False
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
        if dataflow is not None:
            dataflow.paused = True  # restore's copies are the contract's, not PWAL's
        try:
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
                if snapshot is not None and not snapshot.done and not sealed.shared_across_layers:
                    group.append(snapshot)
                elif snapshot is not None and not snapshot.done:
                    # Deferred to finish() (its storage is shared across layers): what it is computed from must
                    # not change from here on either (nothing runs PWAL for it again).
                    self._closed[id(sealed)] = ClosedLayer.of(snapshot, self._samples)
            with collections_paused():
                if dataflow is not None:  # layers restored at finish() learn there, once
                    self._learn_inputs(dataflow, group)
                self._restore_group(group, close=True)
                self._samples.flush()  # the closed layers' input samples, before the load goes on
        finally:
            if dataflow is not None:
                dataflow.paused = False
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
            with collections_paused():  # the contract's own work; the agreement, listeners and callbacks are not
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
        try:
            dataflow = self._stop_recording()
            if dataflow is not None and error is None:
                self._learn_inputs(dataflow, list(self._snapshots.values()))
                contract._recorded = True
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
                self._restore_group(group)
                if self._closed:  # layers after_layer() restored: still in the model, and as it left them?
                    self._findings.extend(check_closed(self._closed.values(), self._still_in_model))
                    self._closed.clear()
                if contract.manifest is not None:
                    # The walker and the manifest can see the same slot: report each (layer, path) once.
                    flagged = {(f.layer, f.path) for f in self._findings if f.kind.is_problem and f.path}
                    self._findings.extend(
                        f for f in contract.manifest.check(contract) if not f.path or (f.layer, f.path) not in flagged
                    )
                    self._findings = excuse_unread_drift(self._findings, contract.manifest)
                # What a reseal must not take for fresh: the slots this reload found stale (SealedSlot.owed).
                stale = {(f.layer, f.path) for f in self._findings if f.kind is FindingKind.STALE}
                for sealed in contract._layers:
                    for slot in sealed.slots:
                        slot.owed = slot.tracks_freshness and (sealed.qualname, slot.path.text) in stale
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

    def _reads_no_copy_reached(self, plan: RestorePlan) -> list[Finding]:
        """``stale`` for captured storages this step copied into whose recorded reads reach bytes neither a copy nor
        a model path covers (a kernel handed a slot's view reads the whole buffer PWAL packed it in): the copy wrote
        the slot's bytes and the rest keep the old values, which a recapture through the same path reads too. Bytes
        equal to those at the same offsets of the storage PWAL's new tensor lies in (alignment padding) are not."""
        manifest = self.contract.manifest
        ranges = getattr(manifest, "byte_ranges", None)
        if manifest is None or ranges is None or not plan.moves:
            return []
        if self._byte_ranges is None:  # once per reload: what was recorded does not change during it
            self._byte_ranges = ranges()
        if not self._byte_ranges:
            return []
        written = [(str(m.memory[0]), m.memory[1], m.memory[2], m) for m in plan.moves]
        landed = _Landing(written)
        # Each recorded storage this step copied into, with the copies that landed on its recorded bytes.
        entries = [
            (entry, sources)
            for entry in self._byte_ranges
            if (sources := landed.on(str(entry.device), entry.data_ptr + entry.lo, entry.data_ptr + entry.hi))
        ]
        if not entries:
            return []
        # Only a tensor whose elements fill its address span covers that span: a strided view (``packed[:, ::2]``)
        # leaves the bytes between its elements as they were (the copy wrote only its elements).
        covered = [(device, start, end) for device, start, end, move in written if _fills_span(move.dst)]
        for _, _, tensor in manifest.held(self.contract):
            try:
                # a wrapper: its inner ones
                covered.extend(address_range(part) for part in memory_tensors(tensor) if _fills_span(part))
            except (TypeError, RuntimeError):
                continue  # no memory of its own to cover anything
        findings: list[Finding] = []
        spans_on: dict[str, list[tuple[int, int]]] = {}  # per device, the covered spans
        for where, start, stop in covered:
            if stop > start:
                spans_on.setdefault(where, []).append((start, stop))
        covered_on = {device: _Covered(spans) for device, spans in spans_on.items()}
        nothing = _Covered(())
        for entry, sources in entries:
            device, base = str(entry.device), entry.data_ptr
            gaps = [
                gap
                for gap in covered_on.get(device, nothing).gaps(base + entry.lo, base + entry.hi)
                if not _same_as_new(entry.storage_ref(), gap[0] - base, gap[1] - base, sources)
            ]
            if not gaps:
                continue
            holder = entry.holders[0] if entry.holders else None
            findings.append(
                Finding(
                    FindingKind.STALE,
                    layer=holder.layer if holder is not None else "",
                    layer_class=holder.layer_class if holder is not None else "",
                    path=holder.path if holder is not None else "",
                    declared=holder is not None and holder.declared,
                    before=entry.first_view,
                    detail=f"the captured graph reads bytes {gaps[0][0] - base}..{gaps[0][1] - base} of its storage, "
                    "which no slot covers and which differ from what PWAL left there in its new tensor: the restore "
                    "copied the slot's own bytes and left those with their old values, and a recapture through "
                    "this path reads them too. Declare the whole buffer the kernel reads (the tensor PWAL packed it "
                    "in), not a view of part of it",
                )
            )
        return findings

    # -- per layer ---------------------------------------------------------------------------------------------
    def _snapshot(self, sealed: SealedLayer, *, flush: bool = True) -> LayerSnapshot | None:
        """Snapshot one sealed layer; its value samples are taken at once, or (``flush=False``) by the caller's
        ``self._samples.flush()`` before the load."""
        layer = sealed.layer_ref()
        contract = self.contract
        if id(sealed) in self._gone:
            return None  # reported when the reload began; finish() must not report it again
        if layer is None or not self._still_in_model(sealed, layer):
            self._gone.add(id(sealed))
            for slot in sealed.slots:
                self._findings.append(
                    sealed.finding(FindingKind.VANISHED, slot, detail="the layer itself was replaced, moved or removed")
                )
            if layer is None or all(module is not layer for module in contract.model.modules()):
                return None
            # Moved within the model (a reordered ModuleList): still snapshotted and restored, so that a stale value
            # in it is found before a recapture would read it.
            self._moved.add(id(sealed))
        contract._adopt_late_declarations(sealed, layer)
        self._closed.pop(id(sealed), None)  # reloaded again in this transaction: this snapshot's restore decides
        extras, exhausted, untrackable = contract._walker_extras(sealed, layer)
        extras += self._manifest_extras(sealed)
        snapshot = LayerSnapshot.take(
            sealed,
            layer,
            extras,
            samples=self._samples,
            recorded=contract._recorded,
            outer=functools.partial(contract._outer, sealed.qualname),
            scratch=self._graph_writes,
            originals=self._originals,
        )
        # Untrackable at the seal or now: no check can tell whether the graph still reads their memory.
        for where in dict.fromkeys(sealed.untrackable + untrackable):
            snapshot.findings.append(
                sealed.layer_finding(FindingKind.UNTRACKABLE, f"{where}; {UNTRACKABLE_ADVICE}", declared=False)
            )
        if exhausted or sealed.walk_exhausted:
            snapshot.findings.append(
                sealed.layer_finding(
                    FindingKind.BUDGET_EXHAUSTED,
                    (exhausted or sealed.walk_exhausted or "")
                    + "; undeclared tensors past it are unchecked: raise max_depth/max_objects or declare them",
                    declared=False,
                )
            )
        before = self._stamps.pop(id(sealed), None)
        if before is not None and stamp(layer) != before:
            snapshot.findings.append(
                sealed.layer_finding(
                    FindingKind.RELOAD_ERROR,
                    "loaded before its before_layer() (called late, or not at all): the snapshot saw the loaded "
                    "state, so stale values go unchecked; call txn.before_layer(layer) before each layer's load",
                    declared=True,
                )
            )
        self._snapshots[id(sealed)] = snapshot
        if flush:
            self._samples.flush()
        return snapshot

    def _graph_writes(self, tensor: torch.Tensor) -> bool:
        """Whether a recorded capture wrote ``tensor``'s storage: scratch the graph overwrites at every replay, so
        its values before a reload are not the graph's input (read once per reload from the manifest)."""
        if self._written is None:
            entries = getattr(self.contract.manifest, "entries", None)
            self._written = {}
            for entry in entries() if callable(entries) else ():
                storage = entry.storage_ref() if entry.written else None
                if storage is not None:
                    self._written[id(storage)] = storage
        if not self._written or tensor.layout is not torch.strided or tensor.device.type == "meta":
            return False
        storage = tensor.untyped_storage()
        return self._written.get(id(storage)) is storage

    def _still_in_model(self, sealed: SealedLayer, layer: nn.Module) -> bool:
        """Whether the model still holds ``layer`` at its qualified name, and at every other name it had at seal
        (a submodule shared at two paths: a module bound at either leaves the graph reading the captured one)."""
        if not sealed.qualname:
            return layer is self.contract.model
        also = self.contract._also.get(id(layer), ())
        return all(self._holds_at(atoms, layer) for atoms in (sealed.atoms, *also))

    def _holds_at(self, atoms: tuple[str, ...], layer: nn.Module) -> bool:
        known = submodule_is(self.contract.model, atoms, layer)
        if known is not None:
            return known
        try:
            return self.contract.model.get_submodule(".".join(atoms)) is layer
        except AttributeError:
            return False

    def _quarantine(self, snapshot: LayerSnapshot) -> None:
        """Keep the snapshot's captured tensors alive until the next seal (see ``GraphContract._quarantine``)."""
        self.contract._quarantine.extend(t for t in snapshot.captured if t is not None)

    def _quarantine_all(self) -> None:
        for snapshot in self._snapshots.values():
            self._quarantine(snapshot)

    def _restore_group(self, group: list[LayerSnapshot], *, close: bool = False) -> None:
        """Restore ``group`` (the whole model, or one ``after_layer``) as one plan: plan every copy, clone the sources
        a copy would overwrite, launch, check every slot reading a written storage, then rebind and verify.
        ``close``: the reload goes on after this step (``after_layer``), so each layer is kept to be checked again
        when it finishes (:class:`ClosedLayer`)."""
        if self.contract.unread == "skip":  # before planning: a skipped slot is in place from here on
            skip_unread(self.contract, [s for s in group if self._still_in_model(s.sealed, s.layer)], self._skip)
        plan = RestorePlan(self.contract._shared)
        common = self._plan_common(group, plan) if not close else None
        if common is not None:
            work, untracked = common
            self._launch_common(work, plan, untracked)
        else:
            work = self._plan_by_rules(group, plan)
        if work:
            # New tensors left at their paths read what they read now; a later after_layer must not write it.
            self._kept.extend(t for s, _ in work for t in s.kept)
        check_freshness([snapshot for snapshot, _ in work])
        seen: dict[int, Any] = {}
        for snapshot, rebinds in work:
            snapshot.conflicting_attributes(rebinds, seen)
        if any(snapshot.attributes for snapshot, _ in work):
            kept_at_paths = {id(t) for snapshot, rebinds in work for t in snapshot.kept_tensors(rebinds)}
            for snapshot, rebinds in work:
                snapshot.carry_attributes(rebinds, kept_at_paths)
        swapped = {id(new): held for snapshot, rebinds in work for new, held in snapshot.bound_instead(rebinds)}
        for snapshot, rebinds in work:
            snapshot.rebind(rebinds, swapped)
        if plan.moves and any(f.kind is FindingKind.MOVED for snapshot, _ in work for f in snapshot.findings):
            with plan.writing():
                plan.unbound()  # a rebind that failed: its path must not read what a copy wrote there
        if not any(f.kind.is_problem for snapshot, _ in work for f in snapshot.findings):
            # (Only when every copy of the step landed: a failed step leaves what PWAL made where it was.)
            for snapshot, _ in work:
                if snapshot.attributed:
                    snapshot.remap_attributes(swapped)
        for snapshot, _ in work:  # after every rebind: two layers' paths can reach one place (nested layers)
            snapshot.verify()
        self._doubt_abandoned(work, plan)
        for snapshot in group:
            snapshot.done = True
            self._restored += snapshot.restored
            self._findings.extend(snapshot.findings)
            if any(f.kind.is_problem for f in snapshot.findings):
                self._quarantine(snapshot)
            if close:  # (one with findings too: a weight written again after it would make a recapture stale)
                self._closed[id(snapshot.sealed)] = ClosedLayer.of(snapshot, self._samples)
            # Drop the strong references now: the new derived tensors of this layer can be freed before the next.
            snapshot.captured = [None] * len(snapshot.captured)
            snapshot.overrides, snapshot.kept, snapshot.keep, snapshot.attributes = {}, [], {}, {}
            snapshot.swapped, snapshot.carried, snapshot.attributed = {}, {}, []
        del work

    def _plan_common(self, group: list[LayerSnapshot], plan: RestorePlan) -> tuple[Rebinds, list[torch.Tensor]] | None:
        """The fast tier (``contract._fast``): the step planned in one lean pass where no rule of the engine can
        act, with the untracked holders it looked at; ``None`` hands the step to the rule engine unchanged."""
        if not step_conditions(self):
            return None
        in_group = {id(snapshot) for snapshot in group}
        if any(not s.done and id(s) not in in_group for s in self._snapshots.values()):
            return None  # layers still pending (the engine protects what their new tensors read)
        untracked = self._untracked_holders([])
        if untracked:
            return None  # readers at paths the contract does not track: the engine watches them
        work = plan_common(group, plan, shared=self.contract._shared, still_in_model=self._still_in_model)
        return None if work is None else (work, untracked)

    def _launch_common(self, work: Rebinds, plan: RestorePlan, kept: list[torch.Tensor]) -> None:
        """Launch a step the fast tier planned: what the rule engine does for it, less the checks that cannot act
        (no source reads a destination, no other slot or kept tensor reads one, every storage has one writer)."""
        judge_noted([snapshot for snapshot, _ in work])  # before any copy lands: the values PWAL left
        foreign = [*kept, *(move.new for move in plan.moves)]
        for snapshot, _ in work:
            snapshot.doubt_foreign_writes(foreign)
            snapshot.written = [
                captured is not None and 0 <= version != version_of(captured)
                for captured, version in zip(snapshot.captured, snapshot.versions, strict=False)
            ]
        batch = CopyBatch()
        try:
            if plan.moves:
                with plan.writing():
                    plan.launch(batch)
                if self.contract.manifest is not None:  # the recorded bytes no copy reached: the engine's rule
                    self._findings.extend(self._reads_no_copy_reached(plan))
        finally:
            self._bytes += batch.written

    def _plan_by_rules(self, group: list[LayerSnapshot], plan: RestorePlan) -> Rebinds:
        """The rule engine's planning and copies of a restore step (every rule of ``_slots``), for any step."""
        auto_restore = self.contract.mode == "migrate"
        work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]] = []
        for snapshot in group:
            if not self._still_in_model(snapshot.sealed, snapshot.layer) and id(snapshot.sealed) not in self._moved:
                # Replaced after the snapshot: the loader filled the new layer, so restoring the orphaned one would
                # commit captured storage that keeps the old values.
                snapshot.findings.extend(
                    snapshot.sealed.finding(
                        FindingKind.VANISHED, slot, detail="the layer was replaced during the reload"
                    )
                    for slot in snapshot.slots
                )
            elif not snapshot.in_place():
                work.append((snapshot, snapshot.restore(auto_restore=auto_restore, plan=plan)))
            else:  # in_place() saw what verify() would confirm: every slot its captured object, as sealed
                snapshot.confirmed = [True] * len(snapshot.slots)
        judge_noted([snapshot for snapshot, _ in work])  # before any copy lands: the values PWAL left
        if any(snapshot.suspects for snapshot, _ in work):
            work = self._block_foreign_holders(work, plan)
        cross = self.contract._cross
        if cross and plan.moves:
            shared = (
                "its captured memory also lies under another storage object (a DLPack import, say), where the "
                "contract cannot check that every slot reading it agrees"
            )
            crossed = [m for m in plan.moves if (id(m.snapshot.sealed), m.index) in cross]
            work = self._take_back(work, plan, {(id(m.snapshot), m.index): shared for m in crossed})
        crossing = plan.crossing()  # the same, for memory two copies write (ties made after the seal too)
        if crossing:
            both = (
                "another copy of this reload writes the same memory under another storage object (a DLPack import, "
                "say), so the slots sharing it cannot be checked to agree"
            )
            work = self._take_back(work, plan, {(id(m.snapshot), m.index): both for m in crossing})
        batch = CopyBatch()
        local = [s for s, _ in work if len(s.slots) > len(s.sealed.slots)]
        kept = [*self._kept, *(t for s, _ in work for t in s.kept), *self._untracked_holders(local)]
        foreign = [*kept, *(move.new for move in plan.moves)]
        for snapshot, _ in work:
            snapshot.doubt_foreign_writes(foreign)
            # What PWAL wrote before the plan's own copies and rebinds (see _doubt_abandoned; restore() noted
            # what it left on its captured memory).
            snapshot.written = [
                captured is not None and 0 <= version != version_of(captured)
                for captured, version in zip(snapshot.captured, snapshot.versions, strict=False)
            ]
        try:
            if plan.moves:
                plan.protect()
                kept.extend(self._protect_pending(plan, group))
                plan.watch(self._captured_of, self._version_of, local, kept, self._changed_inputs)
                with plan.writing():
                    plan.launch(batch)
                    plan.check()
                self._findings.extend(plan.findings)
                if self.contract.manifest is not None:
                    self._findings.extend(self._reads_no_copy_reached(plan))
        finally:
            # No flush here: launch() flushes its copies; after a failure the copies still pending are dropped, not
            # launched over what the failed step left (fail closed).
            self._bytes += batch.written
        return work

    def _block_foreign_holders(
        self, work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]], plan: RestorePlan
    ) -> list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]]:
        """Take back the planned copies into captured storage that something besides its slots holds.

        PWAL can hand a slot's captured tensor (or its base, a view of it, its raw storage) to another place (a
        ping-pong buffer swapped into an undeclared attribute, a storage pool) and give the slot a new one. Copying
        the slot's new values there would write values the reload never produced for that holder. Such a storage
        is not written: each slot planned into it keeps its new tensor and is ``alias-broken`` (the graph reads the
        holder's values there; recapture). Asked only when :func:`held_outside` saw another holder; then every
        module of the model is walked once. A storage is blocked when the walk finds it at a path the contract does
        not track, when the walk was cut short, or when its storage object is held (a storage pool). A tensor or
        view held outside every model path (a dict key, a table outside the model) is not told from a caller's
        reference to the slot, which the slot's new values rightly reach: that one is let be
        (docs/fault-matrix.md).
        """
        contract = self.contract
        suspects: dict[int, Any] = {}
        seen: dict[int, set[str]] = {}  # per storage, what held_outside saw holding it
        for snapshot, _ in work:
            for index, held, which in snapshot.suspects:
                captured = snapshot.captured[index]
                if captured is None:
                    continue
                # A wrapper held as a whole (-1): every storage under it is searched for; else one part's, or the
                # plain tensor's own.
                holders = memory_tensors(captured) if which is not None else [captured]
                if which is not None and which >= 0:
                    holders = holders[which : which + 1]
                for storage in (holder.untyped_storage() for holder in holders):
                    suspects.setdefault(id(storage), storage)
                    seen.setdefault(id(storage), set()).add(held)
        tracked = {
            f"{sealed.qualname}.{slot.path.text}" if sealed.qualname else slot.path.text
            for sealed in contract._layers
            for slot in sealed.slots
        }
        why: dict[int, str] = {}
        # The same memory can lie under another storage object (a DLPack import): matched by address too.
        spans = [
            (str(storage.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes(), key)
            for key, storage in suspects.items()
        ]
        budget = WalkBudget(max_depth=64, max_objects=max(1_000_000, contract.budget.max_objects))
        for qualname, module in contract.model.named_modules():
            result = walk(module, budget=budget, devices=contract.devices, units=contract._units)
            if result.exhausted is not None:
                for key in suspects:
                    why.setdefault(key, f"the search for other holders was cut short ({result.exhausted})")
            for ref in result.refs:
                try:
                    parts = memory_tensors(ref.tensor)  # a wrapper's inner tensors hold its memory
                except TypeError:
                    continue
                for part in parts:
                    if part.layout is not torch.strided:
                        continue
                    key = id(part.untyped_storage())
                    keys = [key] if key in suspects else _overlapping(spans, part)
                    if not keys:
                        continue
                    path = f"{qualname}.{ref.path}" if qualname else ref.path
                    if path not in tracked:
                        for found in keys:
                            why.setdefault(found, f"{path!r}, which the contract does not track, holds it")
        for key in suspects:
            if key not in why and "storage-object" in seen[key]:
                why[key] = "its storage object is held (a storage pool, or a reference outside every model path)"
        del suspects, seen
        if not why:
            return work
        return self._take_back(
            work,
            plan,
            {
                (id(m.snapshot), m.index): f"its captured memory is still held elsewhere: {why[m.storage]}"
                for m in plan.moves
                if m.storage in why
            },
        )

    def _take_back(
        self,
        work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]],
        plan: RestorePlan,
        reasons: dict[tuple[int, int], str],
    ) -> list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]]:
        """Take back every planned copy of the slots in ``reasons`` ((id(snapshot), slot index) -> why): nothing is
        written into their captured memory, each keeps its new tensor and is ``alias-broken``. A slot is restored
        whole or not at all (a wrapper's inner copies go together)."""
        blocked = [move for move in plan.moves if (id(move.snapshot), move.index) in reasons]
        plan.moves = [move for move in plan.moves if (id(move.snapshot), move.index) not in reasons]
        reported: set[tuple[int, int]] = set()
        for move in blocked:
            entry = (id(move.snapshot), move.index)
            if entry in reported:
                continue
            reported.add(entry)
            snapshot, slot = move.snapshot, move.snapshot.slots[move.index]
            snapshot.kept.append(move.new)
            snapshot.findings.append(
                snapshot.sealed.finding(
                    FindingKind.ALIAS_BROKEN,
                    slot,
                    after=fingerprint(move.new),
                    detail=f"PWAL gave it a new tensor, and {reasons[entry]}. Restoring would write this slot's new "
                    "values where something else reads them, so nothing is copied and the graph reads the old "
                    "values there. Rebuild the holder as a new tensor in PWAL (or declare it); recapture",
                )
            )
        return [
            (snapshot, [(index, t) for index, t in rebinds if (id(snapshot), index) not in reported])
            for snapshot, rebinds in work
        ]

    def _doubt_abandoned(
        self, work: list[tuple[LayerSnapshot, list[tuple[int, torch.Tensor]]]], plan: RestorePlan
    ) -> None:
        """Memory a slot left for a new tensor no copy restored there (respecified, moved and kept, vanished, or
        read another way) is *abandoned*: the slot's new values are not in it. A path left on it stays on old
        values, and so would a recapture (``stale``):

        * an alias path (a walker path, or an untracked manifest path, reading a tracked slot's memory) follows
          its slot, so it is stale whatever its values;
        * a watched slot (declared derived, or found by the walker) that nothing wrote is stale when its inputs,
          or the abandoning slot's, changed (a tie to another layer's rebuilt tensor), or when an earlier
          ``after_layer()`` saw that memory abandoned (PWAL may have written it before this layer's snapshot).
        """
        abandoned = self._abandoned
        copied = sorted((str(m.memory[0]), m.memory[1], m.memory[2]) for m in plan.moves)
        for snapshot, _ in work:
            layer = snapshot.layer
            confirmed = snapshot.confirmed
            for index, slot in enumerate(snapshot.slots):
                captured = snapshot.captured[index]
                if captured is None or slot.watch_only or slot.wrapped:
                    continue
                if confirmed[index]:
                    continue  # verify just saw the captured object at its path, on its captured memory
                fp = slot.fp
                if captured.data_ptr() != fp.data_ptr:  # the captured object itself moved (.data =, set_)
                    abandoned.append((snapshot, index, str(fp.device), fp.data_ptr, fp.data_ptr + fp.nbytes))
                elif not reads_as_captured(slot.get(layer), captured):
                    device, start, end = address_range(captured)
                    spans = [(first, last) for where, first, last in copied if where == device]
                    if slot.origin is Origin.ALIAS and not _gaps(start, end, spans):
                        continue  # an alias path that left memory its slot's copy rewrote: nothing is left old
                    abandoned.append((snapshot, index, device, start, end))
            abandoned.extend((snapshot, *entry) for entry in snapshot.gone)
        if not abandoned:
            return
        for snapshot, _ in work:
            layer = snapshot.layer
            for index, slot in enumerate(snapshot.slots):
                captured = snapshot.captured[index]
                if captured is None or slot.wrapped or not reads_as_captured(slot.get(layer), captured):
                    continue
                alias = slot.origin is Origin.ALIAS
                if not alias and not (slot.tracks_freshness and index in snapshot.freshness):
                    continue
                device, start, end = address_range(captured)
                partners = [
                    (owner, at)
                    for owner, at, where, first, last in abandoned
                    if (owner, at) != (snapshot, index)
                    and where == device
                    # an empty span (a tail of nothing) still marks where its slot's memory was
                    and ((first < end and start < last) or (first == last and start <= first <= end))
                ]
                if not partners:
                    continue
                if alias:
                    why = "it does not read that slot's new values, and neither would a recapture"
                else:
                    # A captured tensor without a version counter (made under torch.inference_mode()) cannot show
                    # that PWAL wrote it: it counts as unwritten, so changed inputs make it stale (fail closed).
                    if index >= len(snapshot.written) or snapshot.written[index]:
                        continue  # written by PWAL: its own values
                    if not snapshot.left[index]:
                        continue  # PWAL gave it a new tensor, which the restore copied: its new values
                    changed = snapshot.changed_inputs(index)
                    for owner, at in partners:
                        changed = changed or owner.changed_inputs(at)
                    if changed:
                        why = f"nothing wrote it although {', '.join(changed)} changed, and a recapture would read it"
                    elif any(owner.done for owner, _ in partners):
                        # Abandoned by an earlier after_layer(): PWAL may have written other values there (a swap)
                        # before this layer's snapshot, which then cannot vouch for its bytes. Fail closed.
                        why = "an earlier after_layer() saw it abandoned, so nothing here can vouch for its bytes"
                    else:
                        continue
                snapshot.findings.append(
                    snapshot.sealed.finding(
                        FindingKind.STALE,
                        slot,
                        detail=f"it reads the captured memory of a slot that now holds a new tensor no copy could "
                        f"restore there: {why}. Rebuild it in PWAL from that slot's new tensor",
                    )
                )

    def _protect_pending(self, plan: RestorePlan, group: list[LayerSnapshot]) -> list[torch.Tensor]:
        """Layers snapshotted but not restored yet (``before_layer`` ran, ``after_layer`` has not): a new tensor of
        theirs that reads memory this plan writes is cloned first, so their restore copies the values PWAL left.
        One no copy can restore (another geometry, class or offset: it stays at its path) is returned, to be kept
        by the plan as a reader of that memory like this step's own kept tensors. Costs a path lookup per slot of
        such layers, which a plain ``before_layer``/``after_layer`` pairing has none of."""
        readers: list[torch.Tensor] = []
        in_group = {id(snapshot) for snapshot in group}
        tensor_type = torch.Tensor
        for snapshot in self._snapshots.values():
            if snapshot.done or id(snapshot) in in_group:
                continue
            layer = snapshot.layer
            for index, slot in enumerate(snapshot.slots):
                captured = snapshot.captured[index]
                if captured is None:
                    continue
                current = slot.get(layer)
                if not isinstance(current, tensor_type) or current is captured:
                    continue
                saved = snapshot.overrides.get(index)
                if saved is not None and saved[0] is current:
                    continue
                try:
                    parts = memory_tensors(current)  # a wrapper's memory is its inner tensors'
                except TypeError:
                    continue  # no tensors to read: its restore says why
                if any(plan.overlaps_destination(part) for part in parts):
                    snapshot.overrides[index] = (current, tuple(clone_laid_out(part) for part in parts))
                    if (
                        len(parts) == 1
                        and parts[0] is current
                        and (
                            geometry_key(current) != geometry_key(captured)
                            or current.storage_offset() != captured.storage_offset()
                        )
                    ):
                        # Its restore will leave it at its path (respecified), reading what this plan writes there.
                        readers.append(current)
        return readers

    def _manifest_extras(self, sealed: SealedLayer) -> list[SealedSlot]:
        """Under ``detect="declared-only"`` or ``"sealed-paths"`` with a capture manifest: the layer's paths the
        manifest saw holding a captured storage that no sealed slot tracks (a tensor that appeared after the seal,
        under ``sealed-paths``), as watch-only walker-found slots.

        The graph reads them, so their freshness is judged like the walker's finds (stale when the weights changed
        and PWAL left them as they were, until a recording shows PWAL never computes them) instead of being
        trusted as static. They are never restored: where PWAL moved one, the manifest's check reports it. A path
        whose storage a tracked slot also reads (a view of a declared slot) stays a reader of that slot's memory.
        """
        contract = self.contract
        if contract.manifest is None:
            return []
        if self._held is None:  # resolved once, at the first snapshot: before any layer of this reload loads
            self._held = {}
            sealed_names = {s.qualname for s in contract._layers}
            for qualname, path, tensor in contract.manifest.held(contract):
                if (qualname, path) not in contract._slot_keys:
                    # A module no seal tracks (a child with no weights of its own) is watched from the nearest
                    # sealed module above it, by the longer path.
                    owner, prefix = qualname, ""
                    while owner not in sealed_names and owner:
                        owner, _, last = owner.rpartition(".")
                        prefix = f"{last}.{prefix}"
                    if owner in sealed_names:
                        self._held.setdefault(owner, []).append((prefix + path, tensor))
                    self._held_before[(qualname, path)] = (id(tensor), version_of(tensor), tensor.data_ptr())
        found = self._held.pop(sealed.qualname, None)  # the snapshot holds them from here
        if contract.detect == "every-reload":
            return []  # its walk finds them
        if not found:
            return []
        tracked = {id(part.storage_ref()) for slot in sealed.slots for part in slot.fp.memory()}
        extras: list[SealedSlot] = []
        for path, tensor in found:
            # One that reads a tracked slot's memory follows that slot like an alias path (see
            # _untracked_holders and _doubt_abandoned); any other is watched like a walker find.
            origin = Origin.ALIAS if id(tensor.untyped_storage()) in tracked else Origin.WALKER
            key = (sealed.qualname, path)
            slot = contract._manifest_slots.get(key)
            if slot is None or not slot.tensor_ref.holds(tensor) or slot.origin is not origin:
                slot = SealedSlot(SlotPath(path), fingerprint(tensor), TensorRef.of(tensor), origin)
                if key in contract._recorded_extras:  # a recording saw PWAL run over this path (before a reseal)
                    slot.inputs = contract._recorded_extras[key]
                else:
                    slot.unrecorded = True  # no recording saw PWAL over it (see _sealed_slot)
                slot.watch_only = True
                # Watched even as an alias path: the copy into its slot's memory (or its slot's own write) changes
                # its values, so only a path nothing refreshed looks stale; its slot may be empty or gone.
                slot.tracks_freshness = True
                contract._manifest_slots[key] = slot
            extras.append(slot)
        return extras

    def _untracked_holders(self, local: list[LayerSnapshot]) -> list[torch.Tensor]:
        """What the model holds now at the paths the capture-time manifest saw holding captured storage and the
        contract does not track (``detect="declared-only"`` seals declared slots only): a restore must not
        overwrite what those paths read (PWAL may have handed them a captured storage, a swap)."""
        manifest = self.contract.manifest
        if manifest is None:
            return []
        tracked = self.contract._slot_keys
        extra = {(s.sealed.qualname, slot.path.text) for s in local for slot in s.slots[len(s.sealed.slots) :]}
        before = self._held_before
        return [
            tensor
            for layer, path, tensor in manifest.held(self.contract)
            if (layer, path) not in tracked
            and (layer, path) not in extra
            # The same tensor, unwritten: a view left on the memory it read follows it, like an alias path
            # (its old bytes are no values of its own; the cold model reads its partner's new ones there).
            and before.get((layer, path)) != (id(tensor), version_of(tensor), tensor.data_ptr())
        ]

    def _changed_inputs(self, sealed: SealedLayer, position: int) -> list[str]:
        """The freshness inputs of a slot that this reload changed (its layer's snapshot watched them)."""
        snapshot = self._snapshots.get(id(sealed))
        return snapshot.changed_inputs(position) if snapshot is not None else []

    def _version_of(self, sealed: SealedLayer, position: int) -> int | None:
        """The captured tensor's version counter when the reload began, where its snapshot kept one."""
        snapshot = self._snapshots.get(id(sealed))
        if snapshot is not None and position < len(snapshot.versions):
            return snapshot.versions[position]
        return None

    def _captured_of(self, sealed: SealedLayer, position: int) -> torch.Tensor | None:
        """The captured tensor of a sealed slot: its snapshot's strong reference, else from the seal."""
        snapshot = self._snapshots.get(id(sealed))
        if snapshot is not None and position < len(snapshot.captured):
            held = snapshot.captured[position]
            if held is not None:
                return held
        return sealed.slots[position].captured()
