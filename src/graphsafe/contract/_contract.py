"""``GraphContract``: seal -> reload transaction -> restore -> verify -> ``ReloadOutcome``.

The contract is the only place that decides an outcome. Adapters translate a framework's lifecycle into
``seal``/``reload``/``before_layer``/``after_layer`` calls and an outcome into the framework's action.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, Literal, Protocol

import torch
from torch import nn

from graphsafe.collectors import Dataflow
from graphsafe.contract._agreement import Agreement
from graphsafe.contract._inputs import ValuesBefore
from graphsafe.contract._owned import OwnedMemory
from graphsafe.contract._plan import SharedIndex
from graphsafe.contract._slots import InputRef, SealedLayer, SealedSlot
from graphsafe.contract._unread import UNREAD_POLICIES
from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.errors import GraphSafeError, hide_frames_in_pytest
from graphsafe.handles import RemovableHandle
from graphsafe.outcome import Finding, ReloadOutcome, SlotInfo

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

from graphsafe.contract import _recording, _sealing, _verdict
from graphsafe.contract._transaction import ReloadTransaction

__all__ = [
    "DETECT_POLICIES",
    "MODES",
    "RECORD_POLICIES",
    "UNREAD_POLICIES",
    "Detect",
    "GraphContract",
    "Mode",
    "Record",
    "Unread",
]

Mode = Literal["strict", "recapture", "migrate"]
Detect = Literal["every-reload", "sealed-paths", "declared-only"]
Unread = Literal["restore", "skip"]
Record = Literal["every", "first", "none"]
MODES: tuple[str, ...] = ("strict", "recapture", "migrate")
DETECT_POLICIES: tuple[str, ...] = ("every-reload", "sealed-paths", "declared-only")
RECORD_POLICIES: tuple[str, ...] = ("every", "first", "none")


class ManifestCheck(Protocol):
    """What the contract needs of a capture-time manifest (see :func:`graphsafe.record_capture`)."""

    def reindex(self, contract: GraphContract) -> None: ...

    def check(self, contract: GraphContract, unwritten: Collection[int] = ()) -> list[Finding]: ...

    def held(self, contract: GraphContract) -> Iterable[tuple[str, str, torch.Tensor]]: ...


def _listen(
    registry: list[Callable[[ReloadOutcome], Any]], fn: Callable[[ReloadOutcome], Any], kind: str
) -> RemovableHandle:
    registry.append(fn)

    def remove() -> None:
        if fn in registry:
            registry.remove(fn)

    return RemovableHandle(remove, lambda: fn in registry, f"{kind}({fn!r})")


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

    ``record_reloads`` decides which reloads record what the load and PWAL read and write (a dispatch mode over
    their ops, ``collectors.Dataflow``): ``"every"`` (default); ``"first"``, the first after each seal (and one
    watching a graph-read path no recording saw); ``"none"``. A recorded reload learns what each derived slot is
    computed from and finds a slot PWAL rewrites in place only in part, and one whose bytes changed by no write it
    saw (NumPy, a raw kernel): an unrecorded one judges an in-place rewrite by value samples, which a partial write
    changes too, so ``"first"`` leaves a partial refresh first made on a later reload unfound. The price: a
    dispatch-mode call per op of the load and PWAL (``benchmarks/first_reload.py``).

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
        record_reloads: Record = "every",
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
        self._owned: OwnedMemory | None = None  # contract._owned: memory an unseen owner may use
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
        self.record_reloads = record_reloads
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

    @property
    def record_reloads(self) -> Record:
        """Which reloads record the load and PWAL: ``"every"``, ``"first"`` or ``"none"`` (see the class docs)."""
        return self._record_reloads

    @record_reloads.setter
    def record_reloads(self, policy: Record) -> None:
        if policy not in RECORD_POLICIES:
            raise ValueError(
                f"GraphContract: unknown record_reloads policy {policy!r}: choose 'every' (every reload recorded: "
                "a partial in-place refresh is found on any), 'first' or 'none'"
            )
        self._record_reloads: Record = policy

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

    # Sealing (contract._sealing).
    _seal_alone = _sealing._seal_alone
    _seal = _sealing._seal
    _model_name = _sealing._model_name
    _refuse_foreign_devices = _sealing._refuse_foreign_devices
    _tracks_nothing = _sealing._tracks_nothing
    _index_layers = _sealing._index_layers

    # Recording the inputs of declared slots (contract._recording).
    record_inputs = _recording.record_inputs

    @property
    def inputs_recorded(self) -> bool:
        """Whether a recording of PWAL was taken (:meth:`record_inputs`, or the first reload): then a slot missing
        from :meth:`recorded_inputs` is one that PWAL neither made nor wrote while it was recorded."""
        return self._recorded

    # Recording the inputs of declared slots (contract._recording).
    recorded_inputs = _recording.recorded_inputs
    _walked_tensors = _recording.walked_tensors
    _learn_initial_inputs = _recording._learn_initial_inputs

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

    # Sealing (contract._sealing).
    _seal_layer = _sealing._seal_layer

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

    # Sealing (contract._sealing).
    _layer_entries = _sealing._layer_entries
    _adopt_late_declarations = _sealing._adopt_late_declarations
    _outer = _sealing._outer
    _walker_extras = _sealing._walker_extras
    _unnamed_now = _sealing._unnamed_now
    _unsealed_modules = _sealing._unsealed_modules

    # The outcome and what it does (contract._verdict).
    _notify = _verdict._notify
    _decide = _verdict._decide
    _apply = _verdict._apply
