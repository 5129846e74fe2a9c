"""Capture-time manifest: the storages a captured graph actually touched, recorded while it was captured.

The walker and the registry say where a model *keeps* graph-visible tensors; a check built on them inherits
their blind spots. The manifest is the independent record: :func:`record_capture` puts a ``TorchDispatchMode``
around a capture and notes every tensor an op reads or writes whose storage existed before the capture began
(storages created inside the capture live in the graph's private pool and are the graph's own business).

Once per capture (and again at every seal) each recorded storage is tied to the model paths that held it: its
parameters and buffers, the contract's sealed slots and the registry's declarations, and, where the contract does
not walk, the walker's finds. At the end of every reload :meth:`Manifest.check` re-resolves only those paths: a
recorded storage that was freed is ``dead``, one the model no longer holds under any of them is ``orphaned``. The
contract decides what a finding does, per mode, as for any other finding.

Only ops that pass through torch's dispatcher are seen, and only through the tensors passed to them: aten ops
read nothing else, but a ``torch.library`` custom op's implementation may read a tensor it is not passed (a
module-level table, a closure, a pointer held in C++), which the dispatch recorder cannot see; the capture's
:meth:`Manifest.truth` and notes name every custom op it ran. A kernel launched directly (a raw Triton or CUDA
call) is invisible too. The kernel scan reads what the captured kernels really point at, and sees both.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from graphsafe.collectors import _kernelscan as kscan
from graphsafe.collectors._classify import classify
from graphsafe.collectors._manifest_index import ReloadIndex
from graphsafe.collectors._names import module_names
from graphsafe.outcome import (
    Finding,
    FindingKind,
    Fingerprint,
    Origin,
    SlotInfo,
    SlotNamed,
    fingerprint,
    inner_tensors,
    memory_tensors,
)
from graphsafe.paths import SlotPath

__all__ = ["CapturedStorage", "Holder", "Manifest", "SealedModel"]


@dataclass(frozen=True, slots=True)
class Holder(SlotNamed):
    """One model path that held a recorded storage at capture: ``layer`` (qualified name) and ``path`` on it."""

    layer: str
    layer_class: str
    path: str
    #: How :func:`~graphsafe.collectors.classify` (or the contract's seal) classified the path.
    origin: Origin
    slot_path: SlotPath = field(repr=False, compare=False)

    @property
    def declared(self) -> bool:
        """Whether an author named this path (a registry declaration or an alias of a tracked slot)."""
        return self.origin is Origin.DECLARED or self.origin is Origin.ALIAS


@dataclass(slots=True, eq=False)
class CapturedStorage:
    """One storage a capture touched that it did not allocate."""

    #: Name of the capture that recorded it.
    capture: str
    storage_ref: weakref.ReferenceType[Any] = field(repr=False)
    #: The storage's data pointer and size at capture.
    data_ptr: int
    nbytes: int
    device: torch.device
    #: The first view through which the graph touched it.
    first_view: Fingerprint = field(repr=False)
    #: The first op that read or wrote it (``aten.mm.default``), or that viewed it when nothing did.
    op: str
    #: Byte range ``[lo, hi)`` of the storage the graph read or wrote, relative to its start (``(0, 0)``: the
    #: capture only took views of it, e.g. to return them).
    lo: int = 0
    hi: int = 0
    #: Whether some op wrote it (an ``out=`` or in-place argument); reads are the common case.
    written: bool = False
    #: Whether the capture read bytes of it that it had not itself written first through ``out=`` (a scratch the
    #: graph fills before reading is no read of what was there before). The kernel scan cannot tell: always set.
    read: bool = False
    #: ``[lo, hi)``: the bytes ``out=`` arguments wrote before any read (the dispatch recorder's bookkeeping).
    fresh: tuple[int, int] = (0, 0)
    #: Model paths that held it when last indexed; empty for unowned storage.
    holders: tuple[Holder, ...] = ()
    #: Which backend produced this fact: ``"dispatch"`` (the dispatch recorder) or ``"kernel-scan"`` (the graph's
    #: kernel nodes; ``op`` is then the first kernel that pointed into it and ``lo`` the lowest offset it used).
    backend: str = "dispatch"

    @property
    def alive(self) -> bool:
        """Whether the storage still exists."""
        return self.storage_ref() is not None

    @property
    def byte_range(self) -> tuple[int, int]:
        """``(lo, hi)``: the bytes the graph touched, relative to the storage start."""
        return self.lo, self.hi

    @property
    def access(self) -> str:
        """What the capture did with it: ``"wrote"``, ``"read"`` or ``"viewed"`` (no bytes read)."""
        return "wrote" if self.written else "read" if self.hi else "viewed"

    def touched(self) -> str:
        """A phrase for messages: which bytes of which storage the capture used, and how."""
        if self.backend == "kernel-scan":
            return (
                f"capture {self.capture!r} (kernel scan) reads storage @0x{self.data_ptr:x} from byte {self.lo} "
                f"({self.nbytes} bytes on {self.device}; first by kernel {self.op})"
            )
        what = f"bytes [{self.lo}, {self.hi}) of" if self.hi else "(no bytes of)"
        return (
            f"capture {self.capture!r} {self.access} {what} storage @0x{self.data_ptr:x} "
            f"({self.nbytes} bytes on {self.device}; first by {self.op})"
        )

    def describe(self) -> str:
        """One line: address, bytes touched, first op, and where the model held it."""
        where = ", ".join(h.where for h in self.holders) or "no model path (unowned)"
        state = "" if self.alive else " (freed)"
        return f"{self.touched()}{state}; held at {where}"


# --------------------------------------------------------------------------------------------------------------
# The manifest: storage -> paths index, reload check, unowned storage.


def _blind_phrase(ops: tuple[str, ...]) -> str:
    more = f" and {len(ops) - 3} more" if len(ops) > 3 else ""
    return (
        f"the dispatch recorder sees custom or higher-order op(s) {', '.join(ops[:3])}{more} only through the "
        "tensors passed to them; a tensor such an op reads without being passed (a module-level table, a tensor its "
        "function closes over) is not recorded (the kernel scan sees it)"
    )


def _parts(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """A wrapper subclass's memory tensors (``None`` for a tensor with storage of its own; empty when unreadable)."""
    try:
        return memory_tensors(tensor) if inner_tensors(tensor) is not None else None
    except TypeError:
        return []


def _memory(tensor: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor]:
    """The tensors whose storages ``tensor`` reads: itself, or a wrapper's inner tensors."""
    parts = _parts(tensor)
    return (tensor,) if parts is None else parts


class _PathIndex:
    """Model paths by storage, built once per (re)index."""

    def __init__(self) -> None:
        self.by_storage: dict[int, tuple[Any, list[Holder]]] = {}
        #: One tensor per storage id (the kernel scan locates addresses by them).
        self.tensors: dict[int, torch.Tensor] = {}
        # (storage id, layer, path) already added: one set lookup, not a scan of the storage's holders (a storage
        # viewed at N paths would otherwise cost O(N^2)).
        self._seen: set[tuple[int, str, str]] = set()

    def add(self, tensor: object, layer: str, layer_class: str, path: str, origin: Origin) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
            return
        for part in _memory(tensor):
            storage = part.untyped_storage()
            key = (id(storage), layer, path)
            if key in self._seen:
                continue
            self._seen.add(key)
            slot = self.by_storage.setdefault(id(storage), (storage, []))
            self.tensors.setdefault(id(storage), part)
            slot[1].append(Holder(layer, layer_class, path, origin, SlotPath(path)))

    def holders(self, storage: Any) -> list[Holder]:
        slot = self.by_storage.get(id(storage))
        return slot[1] if slot is not None and slot[0] is storage else []


def _model_index(model: nn.Module, index: _PathIndex, *, walk: bool) -> None:
    """Every classified path of every layer (the walker's finds too when ``walk``), under every qualified name of a
    module held at several paths."""
    units = frozenset(id(module) for module in model.modules())  # as the contract's seal walks
    names = module_names(model)
    for qualname, layer in model.named_modules():
        layer_class = type(layer).__name__
        for entry in classify(layer, walk_layer=walk, units=units).tensors:
            for name in names.get(id(layer), [qualname]):
                index.add(entry.tensor, name, layer_class, entry.path.text, entry.origin)


def _contract_index(contract: SealedModel, index: _PathIndex) -> None:
    layers = dict(contract.sealed_layers())
    for info in contract.slots():
        layer = layers.get(info.layer)
        if layer is not None:
            index.add(SlotPath(info.path).resolve_or(layer, None), info.layer, info.layer_class, info.path, info.origin)


class SealedModel(Protocol):
    """What the manifest reads of a contract (:class:`~graphsafe.GraphContract` is one)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def sealed(self) -> bool: ...

    @property
    def detect(self) -> str: ...

    manifest: Any

    def slots(self) -> Iterator[SlotInfo]: ...

    def sealed_layers(self) -> Iterator[tuple[str, nn.Module]]: ...

    def note_capture(self) -> int: ...


class Manifest:
    """What the captured graphs touched, per capture, and which model paths held it (see the module docs).

    Implements the contract's ``ManifestCheck``: the contract calls :meth:`reindex` when it seals and
    :meth:`check` at the end of every reload.

    Args:
        walk: where the contract does not walk (``detect="declared-only"``) or is not sealed yet, run the walker
            at index time (once per capture or seal, never per reload) so findings can name undeclared paths.
    """

    def __init__(self, *, walk: bool = True) -> None:
        self.walk = walk
        self._captures: dict[str, list[CapturedStorage]] = {}
        self._tracked: frozenset[tuple[str, str]] = frozenset()  # (layer, path) of the contract's slots at seal
        #: The kernel scan's facts per capture it read (captures missing here were recorded by dispatch).
        self._scans: dict[str, kscan.ScanFacts] = {}
        #: One line per thing a capture could not see (kernel scan unavailable, ``extra`` parameters, ...).
        self.notes: list[str] = []
        # Custom ops each dispatch-recorded capture ran (seen only through their tensor arguments).
        self._blind: dict[str, tuple[str, ...]] = {}
        # Storages vouched for as fixed tables outside the model (vouch_fixed), by id; weakly held.
        self._fixed: dict[int, weakref.ReferenceType[Any]] = {}
        # Dispatch-recorded captures that recorded no op at all.
        self._empty: set[str] = set()
        # What the reload checks read that no reload changes (see _manifest_index), rebuilt when stale; the
        # generation moves at every capture, discard, reindex and vouch.
        self._generation = 0
        self._reload_index: ReloadIndex | None = None

    def _changed(self) -> None:
        self._generation += 1
        self._reload_index = None

    def _indexed(self) -> ReloadIndex:
        """The reload index, rebuilt where the captures, their holders or their storages' liveness changed."""
        index = self._reload_index
        if index is None or not index.fits(self._generation):
            index = self._reload_index = ReloadIndex(self._generation, self.entries(), self.storages())
        return index

    # -- contents ----------------------------------------------------------------------------------------------
    @property
    def captures(self) -> tuple[str, ...]:
        """Names of the recorded captures."""
        return tuple(self._captures)

    def entries(self, capture: str | None = None) -> list[CapturedStorage]:
        """Recorded storages of one capture, or of all (a storage two captures touched appears twice)."""
        if capture is not None:
            return list(self._captures.get(capture, ()))
        return [entry for entries in self._captures.values() for entry in entries]

    def storages(self) -> list[CapturedStorage]:
        """Recorded storages, one entry per distinct live-or-dead storage (the first capture's)."""
        seen: dict[int, CapturedStorage] = {}
        # Two live storages never share an address, so a freed one is known by its address and device.
        dead: dict[tuple[int, torch.device], CapturedStorage] = {}
        for entry in self.entries():
            storage = entry.storage_ref()
            if storage is None:
                dead.setdefault((entry.data_ptr, entry.device), entry)
            else:
                seen.setdefault(id(storage), entry)
        return [*seen.values(), *dead.values()]

    def __len__(self) -> int:
        return len(self.storages())

    def unowned(self) -> list[CapturedStorage]:
        """Recorded storages no model path held when indexed (module-level caches, third-party internals), but
        those vouched for as fixed tables (:meth:`vouch_fixed`)."""
        return [entry for entry in self.storages() if not entry.holders and not self._vouched(entry.storage_ref())]

    def read_unowned(self) -> list[Any]:
        """The live storages the graphs read that no model path held when indexed and that are not vouched for as
        fixed: what a reload notes when it begins, to tell at its end whether it wrote them (see :meth:`check`)."""
        found: list[Any] = []
        for entry in self._indexed().read_unowned:
            storage = entry.storage_ref()
            if storage is not None and not self._vouched(storage):
                found.append(storage)
        return found

    def vouch_fixed(self, *tensors: torch.Tensor) -> None:
        """Vouch that these tensors, which the graphs read and no model path holds (a module-level lookup table),
        are fixed: no reload changes what they hold or where. Their storages are then not ``orphaned`` when
        unowned (a read no model path feeds is otherwise a finding), and not listed by :meth:`unowned`; freed,
        they are still ``dead``. Held weakly; vouch again for a table made anew."""
        for tensor in tensors:
            for part in _memory(tensor):
                storage = part.untyped_storage()
                self._fixed[id(storage)] = weakref.ref(storage)
        self._changed()

    def _vouched(self, storage: Any) -> bool:
        ref = self._fixed.get(id(storage)) if storage is not None else None
        return ref is not None and ref() is storage

    def discard(self, capture: str) -> bool:
        """Forget a capture whose graph was destroyed; ``False`` if there was none by that name."""
        self._scans.pop(capture, None)
        self._blind.pop(capture, None)
        self._empty.discard(capture)
        self._changed()
        return self._captures.pop(capture, None) is not None

    def _install(self, capture: str, entries: list[CapturedStorage], *, scanned: bool = False) -> None:
        self._captures[capture] = entries
        self._changed()
        self._blind.pop(capture, None)  # a recapture says again what it could not see
        self._empty.discard(capture)
        if not scanned:
            self._scans.pop(capture, None)  # a recapture by the dispatch recorder replaces an earlier scan

    def blind_spots(self) -> dict[str, tuple[str, ...]]:
        """The custom ops each dispatch-recorded capture ran, by capture: the dispatch recorder sees them only through
        the tensors passed to them, so it cannot prove that a tensor no recorded op touched is unread."""
        return dict(self._blind)

    def backends(self) -> dict[str, str]:
        """Which backend recorded each capture: ``"kernel-scan"`` or ``"dispatch"``."""
        return {name: "kernel-scan" if name in self._scans else "dispatch" for name in self._captures}

    def truth(self) -> str | None:
        """Why what the captured graphs read is not fully known, or ``None`` when it is (:attr:`complete`).

        Known means: at least one capture, every capture read by the kernel scan, and every node of every scanned
        graph read in full (no kernel with parameters passed through ``extra`` or whose parameter layout could not be
        read, no node type the scan does not read). The first reason found is named, with its capture.
        """
        if not self._captures:
            return (
                "no capture was recorded under graphsafe (cuda_graph, record_capture, graphsafe.capture or the vLLM "
                "plugin)"
            )
        for name in self._captures:
            facts = self._scans.get(name)
            if facts is None:
                blind = self._blind.get(name)
                return f"capture {name!r} was recorded by the dispatch recorder, not read by the kernel scan" + (
                    f"; {_blind_phrase(blind)}" if blind else ""
                )
            if facts.scan.incomplete:
                more = len(facts.scan.incomplete) - 1
                return f"capture {name!r}: {facts.scan.incomplete[0]}" + (f" (and {more} more)" if more else "")
        return None

    @property
    def complete(self) -> bool:
        """Whether what the captured graphs read is fully known (see :meth:`truth`)."""
        return self.truth() is None

    def byte_ranges(self) -> list[CapturedStorage]:
        """The live recorded storages whose bytes read or written the recorder knows exactly (``[lo, hi)``: the
        dispatch recorder; a kernel scan knows only where reading began). Built once per capture or index."""
        return list(self._indexed().byte_ranges)

    def reads(self, start: int, end: int) -> bool:
        """Whether a kernel-scanned graph reads any byte of ``[start, end)`` (an address range): a node's word, or a
        pointer table's word read at scan time, falls into a storage, allocator block or address that overlaps it.
        Captures recorded by the dispatch recorder are not asked (see :meth:`truth`)."""
        return any(facts.reads.overlaps(start, end) for facts in self._scans.values())

    def read_test(self) -> Callable[[Any], bool]:
        """A test ``storage -> bool``: whether a captured graph reads any byte of that untyped storage. It does when
        the storage is a recorded storage of some capture, or a scanned graph reads an address range overlapping its
        memory (:meth:`reads`). Built once (a set of the recorded storages), then O(captures x log ranges) a call."""
        read: dict[int, Any] = {}
        for entry in self.entries():
            storage = entry.storage_ref()
            if storage is not None:
                read[id(storage)] = entry.storage_ref
        scans = [facts.reads for facts in self._scans.values()]

        def reads_storage(storage: Any) -> bool:
            ref = read.get(id(storage))
            if ref is not None and ref() is storage:
                return True
            start = int(storage.data_ptr())
            end = start + int(storage.nbytes())
            return any(ranges.overlaps(start, end) for ranges in scans)

        return reads_storage

    def unread_proof(self) -> Callable[[Fingerprint], bool] | None:
        """A test ``captured fingerprint -> bool``: whether graph truth proves that no captured graph reads any
        byte of that memory (a wrapper's: every inner tensor's storage). ``None`` before any capture.

        Each capture must prove it. A kernel-scanned one whose scan is complete (:meth:`truth`) proves what none of
        its read ranges overlaps. A dispatch-recorded one proves what none of its recorded storages (read, written
        or only viewed) overlaps, only on a device whose kernels all go through the dispatcher (not CUDA, where a
        Triton or CuPy launch is unseen) and only when it ran no custom op (which may read memory it is not
        passed). Anything else proves nothing.
        """
        if not self._captures:
            return None
        # Per capture: whether it can prove anything, whether it is a dispatch recording (which cannot on CUDA),
        # and the address ranges it read (one process's addresses are distinct across devices).
        ranges: list[tuple[bool, bool, kscan.ReadRanges]] = []
        for name, entries in self._captures.items():
            facts = self._scans.get(name)
            if facts is not None:
                ranges.append((not facts.scan.incomplete, False, facts.reads))
                continue
            spans = kscan.ReadRanges((e.data_ptr, e.data_ptr + max(e.nbytes, 1)) for e in entries)
            ranges.append((not self._blind.get(name) and name not in self._empty, True, spans))

        def unread(fp: Fingerprint) -> bool:
            for part in fp.memory():
                start, end = part.storage_ptr, part.storage_ptr + max(part.storage_nbytes, 1)
                for proves, dispatch, reads in ranges:
                    if not proves or (dispatch and part.device.type == "cuda") or reads.overlaps(start, end):
                        return False
            return True

        return unread

    def unread(self, contract: SealedModel) -> list[SlotInfo] | None:
        """The contract's slots whose storage no captured graph reads; ``None`` unless :attr:`complete`.

        A slot is read when any byte of any storage it holds (a wrapper's inner tensors') is read by some capture
        (:meth:`read_test`). O(slots x captures x log ranges): the slots are resolved once, no walk.
        """
        if not self.complete:
            return None
        reads_storage = self.read_test()
        layers = dict(contract.sealed_layers())
        unread: list[SlotInfo] = []
        for info in contract.slots():
            layer = layers.get(info.layer)
            value = SlotPath(info.path).resolve_or(layer, None) if layer is not None else None
            if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
                continue
            if not any(reads_storage(part.untyped_storage()) for part in _memory(value)):
                unread.append(info)
        return unread

    # -- indexing ----------------------------------------------------------------------------------------------
    def reindex(self, contract: SealedModel) -> None:
        """Tie every recorded storage to the model paths holding it now (the contract calls this on seal).

        A recorded storage the model no longer holds anywhere keeps the paths it was last held at, so the next
        check still reports it (the graph reads it until it is captured again).
        """
        self._index(contract, self.entries())

    def _index(self, contract: SealedModel, entries: list[CapturedStorage]) -> None:
        if not entries:
            return
        model = contract.model
        index = _PathIndex()
        if contract.sealed:
            self._tracked = frozenset((info.layer, info.path) for info in contract.slots())
            _contract_index(contract, index)
        # Declarations made after the seal, and (where the contract does not walk) the walker's finds.
        # (``every-reload`` walks every reload itself; the other policies track no tensor that appeared after the
        # seal, which the graph may read: a warm-up forward's lazily computed cache.)
        walked = self.walk and (contract.detect != "every-reload" or not contract.sealed)
        _model_index(model, index, walk=walked)
        if (
            self.walk
            and not walked
            and any(e.storage_ref() is not None and not index.holders(e.storage_ref()) for e in entries)
        ):
            # Something no sealed or registered path holds: before calling it unowned (a finding when read), look
            # where the walker finds tensors that appeared after the seal (a first forward's lazy table). Once per
            # capture or seal, and only then.
            index = _PathIndex()
            _contract_index(contract, index)
            _model_index(model, index, walk=True)
        for entry in entries:
            storage = entry.storage_ref()
            if storage is None:
                continue
            holders = index.holders(storage)
            if holders:
                entry.holders = tuple(holders)
        self._changed()

    # -- reload check ------------------------------------------------------------------------------------------
    def held(self, contract: SealedModel) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(layer, path, tensor)`` for every path that held a recorded (live) storage, as the model holds it now.

        The contract reads these before a restore writes into captured storage: a path it does not track (a
        tensor ``detect="declared-only"`` never seals) may now hold one of the captured storages with values the
        reload produced for that path, which a copy must not overwrite. O(recorded storages x their holders).
        """
        index = self._indexed()  # the paths and their getters, built once per capture or index
        modules = index.resolve(contract.model)  # the layers, resolved now
        tensor_type, strided = torch.Tensor, torch.strided
        for holder, node, get in index.held:
            layer = modules[node]
            if layer is None:
                continue
            value = get(layer)
            if isinstance(value, tensor_type) and value.layout is strided:
                yield holder.layer, holder.path, value

    def check(self, contract: SealedModel, unwritten: Collection[int] = ()) -> list[Finding]:
        """``dead`` and ``orphaned`` findings for the recorded storages, after a reload's restore.

        ``unwritten``: ids of the unowned storages the caller found with the same bytes as when the reload began
        (no write reached them); each that the graphs read is ``stale`` rather than ``orphaned``: a recapture would
        read those old bytes, unless the code now reads another tensor that no check can see.

        Only the recorded paths are re-resolved (no walk): O(recorded storages x their holders).
        """
        model = contract.model
        layers: dict[str, nn.Module | None] = {}  # for the findings' own lookups
        findings: list[Finding] = []
        tracked = self._tracked
        index = self._indexed()  # the storages, their paths and getters, built once per capture or index
        modules = index.resolve(model)  # the layers, resolved now
        for entry, compiled in index.rows:
            storage = entry.storage_ref()
            if storage is None:
                findings.append(_finding(FindingKind.DEAD, entry, model, None))
                continue
            if entry.nbytes and storage.data_ptr() != entry.data_ptr:
                # Same storage object, new memory (``storage.resize_``, an offload and back): the graph's address
                # was freed, whoever holds the storage now.
                moved = f"the storage was reallocated to @0x{storage.data_ptr():x}, so replay touches freed memory"
                findings.append(_finding(FindingKind.DEAD, entry, model, None, what=moved))
                continue
            if not entry.holders:
                # The graph reads it (a kernel node points into it, or an op read bytes the graph had not written
                # through out= first; a storage only viewed is no read) and no model path, input or output holds it:
                # nothing a reload does is known to reach what replay reads there, in either backend.
                if entry.read and not self._vouched(storage):
                    if id(storage) in unwritten:
                        findings.append(_finding(FindingKind.STALE, entry, model, None, what=_UNOWNED_UNWRITTEN))
                    else:
                        findings.append(_finding(FindingKind.ORPHANED, entry, model, None, what=_UNOWNED_ALIVE))
                continue
            left = [holder for holder, node, get in compiled if not _holds_now(modules[node], get, storage)]
            if len(left) < len(entry.holders):
                # Still held. A path the contract does not track that left it (PWAL rebuilt an undeclared base
                # of a declared view) had its new values put elsewhere: the graph reads its old ones here. A
                # tracked path that left it is the contract's own finding.
                untracked = [h for h in left if (h.layer, h.path) not in tracked]
                if untracked:
                    findings.append(_left_finding(entry, model, layers, untracked[0]))
                continue
            first = entry.holders[0]
            layer = _layer(model, layers, first.layer)
            now = first.slot_path.resolve_or(layer, None) if layer is not None else None
            findings.append(_finding(FindingKind.ORPHANED, entry, model, now))
        return findings


_UNOWNED_ALIVE = (
    "no model path holds it, so no reload updates what replay reads there; hold it at a model path, declare it, "
    "pass it as a graph input (record_capture's ignore=), or, for a fixed table no reload changes, vouch for it "
    "with contract.manifest.vouch_fixed(tensor)"
)


_UNOWNED_UNWRITTEN = (
    "no model path holds it and the reload wrote none of its bytes, so a recapture would read the same values "
    "(PWAL skipped rebuilding it; or made a new one elsewhere, which no check can see): hold it at a model path and "
    "declare it, pass it as a graph input (record_capture's ignore=), or, for a fixed table no reload changes, vouch "
    "for it with contract.manifest.vouch_fixed(tensor)"
)


def _layer(model: nn.Module, cache: dict[str, nn.Module | None], qualname: str) -> nn.Module | None:
    if qualname not in cache:
        try:
            cache[qualname] = model.get_submodule(qualname) if qualname else model
        except AttributeError:
            cache[qualname] = None
    return cache[qualname]


def _holds_now(layer: nn.Module | None, get: Callable[[Any], Any], storage: Any) -> bool:
    """Whether the path ``get`` reads on ``layer`` holds ``storage`` now (a wrapper: one of its inner tensors)."""
    if layer is None:
        return False
    value = get(layer)
    if type(value) in _OWN_STORAGE:  # a plain tensor or parameter: its own storage, no wrapper to open
        return value.layout is torch.strided and value.untyped_storage() is storage
    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
        return False
    return any(part.untyped_storage() is storage for part in _memory(value))


_OWN_STORAGE = (torch.Tensor, nn.Parameter)


def _left_finding(
    entry: CapturedStorage, model: nn.Module, layers: dict[str, nn.Module | None], holder: Holder
) -> Finding:
    layer = _layer(model, layers, holder.layer)
    now = holder.slot_path.resolve_or(layer, None) if layer is not None else None
    after = fingerprint(now) if isinstance(now, torch.Tensor) and now.layout is torch.strided else None
    keep = ", ".join(h.where for h in entry.holders if h is not holder)
    return Finding(
        FindingKind.ORPHANED,
        layer=holder.layer,
        layer_class=holder.layer_class,
        path=holder.path,
        declared=holder.declared,
        before=entry.first_view,
        after=after,
        detail=f"{_source(entry)}: {entry.touched()}; the model no longer holds it at {holder.path!r} (still at "
        f"{keep}), so replay reads that path's old values there; declare {holder.path!r} or recapture",
    )


def _finding(
    kind: FindingKind, entry: CapturedStorage, model: nn.Module, now: object, what: str | None = None
) -> Finding:
    touched = entry.touched()
    after = None
    if kind is FindingKind.DEAD:
        what = what or "the storage was freed, so replay touches freed memory"
    elif what is None:
        paths = ", ".join(repr(h.path) for h in entry.holders)
        what = f"the model no longer holds it at {paths}, so replay reads memory no reload updates"
        if isinstance(now, torch.Tensor) and now.layout is torch.strided:
            after = fingerprint(now)
    if entry.holders:
        first = entry.holders[0]
        others = [h.where for h in entry.holders[1:]]
        also = f"; also held at {', '.join(others)}" if others else ""
        return Finding(
            kind,
            layer=first.layer,
            layer_class=first.layer_class,
            path=first.path,
            declared=any(h.declared for h in entry.holders),
            before=entry.first_view,
            after=after,
            detail=f"{_source(entry)}: {touched}; {what}{also}",
        )
    return Finding(
        kind,
        layer="",
        layer_class=type(model).__name__,
        path="",
        declared=False,
        before=entry.first_view,
        detail=f"{_source(entry)}: unowned captured storage (no model path held it at capture): {touched}; {what}",
    )


def _source(entry: CapturedStorage) -> str:
    """Which backend a finding's fact came from, as its messages start."""
    return "capture manifest (kernel scan)" if entry.backend == "kernel-scan" else "capture manifest"
