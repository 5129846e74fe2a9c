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

import gc
import itertools
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from graphsafe.collectors import _kernelscan as kscan
from graphsafe.collectors._classify import classify
from graphsafe.collectors._dataflow import _VIEW, _WRITE, _schema_access, _tensors
from graphsafe.collectors._names import module_names
from graphsafe.errors import GraphSafeError
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

__all__ = [
    "CapturedStorage",
    "Holder",
    "Manifest",
    "SealedModel",
    "kernel_scan_unavailable",
    "record_capture",
    "record_scan",
]


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
# Recording.

# Ops whose reads are their tensor arguments; any other namespace is a custom op (torch.library), whose
# implementation may read tensors it is not passed.
_TORCH_NAMESPACES = frozenset(
    {
        "aten",
        "prim",
        "prims",
        "_c10d_functional",
        "c10d",
        "profiler",
        "quantized",
        "rngprims",
        "debugprims",
        "inductor",
        "higher_order",
    }
)
# torch.tensor(data) inside a capture reaches the dispatcher as lift_fresh of a tensor made on the spot.
_FRESH_OPS: frozenset[Any] = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
# How an op uses an argument (collectors._dataflow reads it from the schema): a view only aliases it (reads no
# bytes), a write may not read it; anything else reads it. An ``out=`` argument is written without being read.
_READ = 0
_OUT = 3
# In-place ops that overwrite their first argument without reading it: a pure write, as ``out=`` is.
_OVERWRITE: frozenset[Any] = frozenset(
    {
        torch.ops.aten.copy_.default,
        torch.ops.aten.fill_.Scalar,
        torch.ops.aten.fill_.Tensor,
        torch.ops.aten.zero_.default,
    }
)
_ACCESS: dict[Any, tuple[dict[int, int], dict[str, int], str]] = {}


def _access(func: Any) -> tuple[dict[int, int], dict[str, int], str]:
    """Non-read uses of ``func``'s arguments by position and by name, and its name (cached per overload)."""
    cached = _ACCESS.get(func)
    if cached is None:
        positions, names = _schema_access(func)
        cached = _ACCESS[func] = (positions, names, str(func))
    return cached


def _contract_manifest(contract: SealedModel | None) -> Manifest:
    """The manifest a capture records into when none is passed: the contract's, else a new one."""
    existing = contract.manifest if contract is not None else None
    if existing is not None and not isinstance(existing, Manifest):
        raise GraphSafeError(
            f"the contract already has a manifest of type {type(existing).__name__}; pass manifest= explicitly"
        )
    return existing if existing is not None else Manifest()


def _touched_bytes(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``[lo, hi)`` in bytes of the storage a strided view addresses, or ``None`` for an empty view."""
    span = 0
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if size == 0:
            return None
        span += (int(size) - 1) * abs(int(stride))
    itemsize = tensor.element_size()
    lo = int(tensor.storage_offset()) * itemsize
    return lo, lo + (span + 1) * itemsize


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Notes the storages ops touch that the recording did not see being created."""

    def __init__(self, capture: str, devices: Collection[torch.device] | None, ignore: Iterable[torch.Tensor]):
        super().__init__()  # type: ignore[no-untyped-call]
        self.capture = capture
        self.devices = devices
        # Keyed by id(storage); the weak reference confirms the id still names the same storage (ids are reused).
        self.external: dict[int, CapturedStorage] = {}
        self.internal: dict[int, weakref.ReferenceType[Any]] = {}
        # The ignored tensors' own bytes, by storage: a static input carved out of a storage that also holds a model
        # tensor leaves that tensor's bytes recorded.
        self.ignored: dict[int, tuple[weakref.ReferenceType[Any], list[tuple[int, int]]]] = {}
        for tensor in ignore:
            for part in _memory(tensor):
                storage = part.untyped_storage()
                span = _touched_bytes(part)
                held = self.ignored.get(id(storage))
                if held is None or held[0]() is not storage:
                    held = self.ignored[id(storage)] = (weakref.ref(storage), [])
                if span is not None:
                    held[1].append(span)
        # Whether an op ran while a CUDA stream was capturing; if one did, ops outside the capture (torch's own
        # bookkeeping in capture_begin, e.g. the RNG seed/offset fills) are not part of the graph.
        self.capturing = False
        self.saw_capture = False
        self.in_capture: set[int] = set()
        #: Custom ops (outside torch's own namespaces) that ran: seen only through the tensors passed to them.
        self.custom: dict[str, None] = {}
        self.ops = 0  # ops recorded (a capture that recorded none proves nothing unread)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # An uninitialised CUDA context cannot be capturing (and must not be initialised just to ask).
        capturing = _cuda_ready() and torch.cuda.is_current_stream_capturing()
        self.capturing = capturing
        self.saw_capture = self.saw_capture or capturing
        if getattr(func, "namespace", "aten") not in _TORCH_NAMESPACES:
            self.custom.setdefault(str(getattr(func, "_overloadpacket", func)), None)
        if func in _FRESH_OPS:
            # torch.tensor(...) inside the capture: the input was made on the spot, not read from the model.
            for tensor in _tensors(args):
                self._mark_internal(tensor)
        else:
            self.ops += 1
            positions, names, name = _access(func)
            touch = self._touch
            # Inlined walk over the arguments: this runs for every op of the capture.
            overwrite = func in _OVERWRITE
            for index, value in enumerate(args):
                if isinstance(value, torch.Tensor):
                    touch(value, name, _OUT if overwrite and index == 0 else positions.get(index, _READ))
                elif isinstance(value, list | tuple):
                    access = positions.get(index, _READ)
                    for item in value:
                        if isinstance(item, torch.Tensor):
                            touch(item, name, access)
            for key, value in kwargs.items():
                access = names.get(key, _READ)
                if key == "out" and access == _WRITE:
                    access = _OUT
                for tensor in _tensors(value):
                    touch(tensor, name, access)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._mark_internal(out)
        else:
            for tensor in _tensors(out):
                self._mark_internal(tensor)
        return out

    def _mark_internal(self, tensor: torch.Tensor) -> None:
        if tensor.layout is not torch.strided:
            return
        if type(tensor) is not torch.Tensor and (parts := _parts(tensor)) is not None:
            for part in parts:
                self._mark_internal(part)
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        entry = self.external.get(key)
        if entry is not None and entry.storage_ref() is storage:
            return  # a view of (or an in-place result on) storage from before the capture
        self.internal[key] = weakref.ref(storage)

    def _touch(self, tensor: torch.Tensor, op: str, access: int) -> None:
        if tensor.layout is not torch.strided:
            return
        if type(tensor) is not torch.Tensor and (parts := _parts(tensor)) is not None:
            # A wrapper subclass reaches the mode whole; the ops on its inner tensors run under it unseen, so its
            # inner tensors are what the graph reads.
            for part in parts:
                self._touch(part, op, access)
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        ref = self.internal.get(key)
        if ref is not None and ref() is storage:
            return
        ignored = self.ignored.get(key)
        if ignored is not None and ignored[0]() is storage:
            span = _touched_bytes(tensor)
            if span is None or any(lo <= span[0] and span[1] <= hi for lo, hi in ignored[1]):
                return  # within an ignored tensor's bytes
        entry = self.external.get(key)
        if entry is None or entry.storage_ref() is not storage:
            device = tensor.device
            if device.type == "meta" or (self.devices is not None and not _device_in(device, self.devices)):
                return
            # Registered even when only viewed: the view's storage must not be taken for the graph's own.
            entry = CapturedStorage(
                capture=self.capture,
                storage_ref=weakref.ref(storage),
                data_ptr=storage.data_ptr(),
                nbytes=storage.nbytes(),
                device=device,
                first_view=fingerprint(tensor),
                op=op,
            )
            self.external[key] = entry
        if self.capturing:
            self.in_capture.add(key)
        if access == _VIEW:
            return
        if access != _READ:
            entry.written = True
        span = _touched_bytes(tensor)
        if span is None:
            return
        fresh = entry.fresh
        if access == _OUT:
            if not entry.read and (fresh[0] == fresh[1] or (span[0] <= fresh[1] and fresh[0] <= span[1])):
                entry.fresh = (min(fresh[0], span[0]), max(fresh[1], span[1])) if fresh[1] else span
        elif not (fresh[0] <= span[0] and span[1] <= fresh[1]):  # a read (an in-place write reads too)
            entry.read = True
        if entry.hi == 0:  # the first bytes touched name the op and the view in messages
            entry.op, entry.first_view, entry.lo, entry.hi = op, fingerprint(tensor), span[0], span[1]
        else:
            entry.lo = min(entry.lo, span[0])
            entry.hi = max(entry.hi, span[1])


def _cuda_ready() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _device_in(device: torch.device, devices: Collection[torch.device]) -> bool:
    return any(d == device or (d.index is None and d.type == device.type) for d in devices)


_NAMES = itertools.count()


@contextmanager
def record_capture(
    contract: SealedModel | None = None,
    *,
    name: str | None = None,
    ignore: Iterable[torch.Tensor] = (),
    devices: Collection[torch.device | str] | None = None,
    reindex: bool = True,
    manifest: Manifest | None = None,
    graph: Any = None,
    backend: str = "auto",
) -> Iterator[Manifest]:
    """Record what a capture touches: ``with record_capture(contract, graph=g): with torch.cuda.graph(g): ...``.

    On CUDA, :func:`~graphsafe.cuda_graph` does both in one step (``with cuda_graph(contract) as g: out = fwd(x)``).

    Every tensor an op reads or writes inside the block, whose storage was not created inside the block, is
    recorded in the contract's :class:`Manifest` (created and set as ``contract.manifest`` on first use), which
    the contract then checks at the end of every reload, and a capture is reported to the contract
    (``contract.note_capture()``: the evidence its ``reseal()`` needs after a failed reload) once the block exits
    without an exception. Also works around a plain forward (on CPU, for tests).
    When a CUDA capture ran inside the block, only what ran while the stream was capturing is kept. Python's
    cyclic garbage collector is paused inside the block (a collection could free another graph mid-capture).

    Args:
        contract: the contract whose graphs these are (``None``: record into ``manifest`` only).
        name: the capture's name; recording again under a name replaces that capture (a recapture). Default: a
            fresh name per call.
        ignore: tensors the graph touches that are not model state (static inputs and outputs): their own bytes
            are not recorded (the rest of a storage they share with a model tensor still is).
        devices: record only tensors on these devices (``"cuda"`` matches every index). Default: every device.
        reindex: tie the recorded storages to the model paths that hold them now. The adapter passes ``False``
            when the contract reseals right after (a recapture), which indexes everything anyway.
        manifest: record into this manifest instead of the contract's.
        graph: the ``torch.cuda.CUDAGraph`` captured inside the block. Made with ``keep_graph=True``, it is read by
            the kernel scan after the capture (what its kernel, memset and memcpy nodes point into) and no
            dispatch mode is active during the capture, so the graph checked is the graph that serves.
        backend: ``"auto"`` (the kernel scan when ``graph`` can be scanned, else the dispatch recorder, with a
            one-line warning where a CUDA capture ran under it), ``"kernel"`` (the kernel scan or a
            :class:`~graphsafe.GraphSafeError`) or ``"dispatch"`` (the dispatch recorder: the CPU fallback and the
            cross-check).

    Yields:
        The manifest; the new capture's storages are in it once the block exits without an exception.
    """
    if manifest is None:
        manifest = _contract_manifest(contract)
    capture = name if name is not None else f"capture-{next(_NAMES)}"
    ignore = list(ignore)
    if _kernel_backend(capture, graph, backend, manifest):
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield manifest
        finally:
            if gc_was_enabled:
                gc.enable()
        record_scan(contract, graph, name=capture, ignore=ignore, reindex=reindex, manifest=manifest)
        return
    wanted = tuple(torch.device(d) for d in devices) if devices is not None else None
    recorder = _Recorder(capture, wanted, ignore)
    # A cyclic collection inside a capture could destroy an unrelated CUDA graph (or free its pool), which
    # invalidates the capture; the recorder's own bookkeeping allocates enough to trigger one. Pause it.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with recorder:
            yield manifest
    finally:
        if gc_was_enabled:
            gc.enable()
    entries = recorder.external
    if recorder.saw_capture:
        entries = {key: entry for key, entry in entries.items() if key in recorder.in_capture}
    manifest._install(capture, list(entries.values()))
    if recorder.custom:
        manifest._blind[capture] = tuple(recorder.custom)
        manifest.notes.append(f"graphsafe: capture {capture!r}: {_blind_phrase(manifest._blind[capture])}")
    if not recorder.ops:  # it recorded around no forward: it proves nothing about a graph
        manifest._empty.add(capture)
    if recorder.saw_capture and backend == "auto" and graph is None:
        # A CUDA capture ran under the recorder by omission (no graph= to scan): never silently.
        manifest.notes.append(f"graphsafe: capture {capture!r}: {_BY_OMISSION}")
        warnings.warn(manifest.notes[-1], stacklevel=3)
    if contract is not None:
        contract.manifest = manifest
        # A capture ran: the evidence a reseal after a failed reload needs.
        contract.note_capture()
        if reindex:
            manifest._index(contract, manifest.entries(capture))


_BY_OMISSION = (
    "recorded by the dispatch recorder, a TorchDispatchMode active during the CUDA capture (a torch.compile'd "
    "forward then captures ATen's kernels, not its own); capture with graphsafe.cuda_graph(contract) where "
    "torch.cuda.graph was, or pass backend='dispatch' to choose this recorder"
)


def _blind_phrase(ops: tuple[str, ...]) -> str:
    more = f" and {len(ops) - 3} more" if len(ops) > 3 else ""
    return (
        f"the dispatch recorder sees custom op(s) {', '.join(ops[:3])}{more} only through the tensors passed to them; "
        "a tensor such an op reads without being passed (a module-level table) is not recorded (the kernel scan "
        "sees it)"
    )


def record_scan(
    contract: SealedModel | None,
    graph: Any,
    *,
    name: str,
    ignore: Iterable[torch.Tensor] = (),
    reindex: bool = True,
    manifest: Manifest | None = None,
) -> Manifest:
    """Record an already captured ``torch.cuda.CUDAGraph(keep_graph=True)`` by the kernel scan.

    What :func:`record_capture` does after a capture, for graphs someone else captured (an engine's runner):
    the capture ``name`` replaces an earlier one of that name, ``ignore`` are its registered inputs and outputs,
    and the contract is told a capture happened. Raises :class:`~graphsafe.GraphSafeError` when the graph cannot
    be scanned (no ``keep_graph``, no cuda-bindings).
    """
    if manifest is None:
        manifest = _contract_manifest(contract)
    try:
        kscan.driver()
    except kscan.ScanUnavailable as exc:
        raise GraphSafeError(f"collectors: capture {name!r}: {exc}") from exc
    manifest._install(name, _scan_capture(name, graph, contract, list(ignore), manifest), scanned=True)
    if contract is not None:
        contract.manifest = manifest
        contract.note_capture()
        if reindex:
            manifest._index(contract, manifest.entries(name))
    return manifest


def kernel_scan_unavailable() -> str | None:
    """Why the kernel scan cannot run in this process (no CUDA, no cuda-bindings), or ``None`` when it can."""
    if not torch.cuda.is_available():
        return "kernel scan unavailable: CUDA is not available"
    try:
        kscan.driver()
    except kscan.ScanUnavailable as exc:
        return str(exc)
    return None


def _kernel_backend(capture: str, graph: Any, backend: str, manifest: Manifest) -> bool:
    """Whether this capture is read by the kernel scan (see :func:`record_capture`'s ``backend``)."""
    if backend not in ("auto", "kernel", "dispatch"):
        raise GraphSafeError(
            f"collectors: record_capture(backend={backend!r}) is not a backend; use 'auto', 'kernel' or 'dispatch'"
        )
    if backend == "dispatch":
        return False
    if graph is None:
        if backend == "kernel":
            raise GraphSafeError(
                f"collectors: record_capture(backend='kernel') for capture {capture!r} needs graph=, the "
                "torch.cuda.CUDAGraph(keep_graph=True) captured inside the block"
            )
        return False
    try:
        if not kscan.keeps_graph(graph):
            raise kscan.ScanUnavailable(
                "kernel scan unavailable: the graph is not made with torch.cuda.CUDAGraph(keep_graph=True)"
            )
        kscan.driver()
    except kscan.ScanUnavailable as exc:
        if backend == "kernel":
            raise GraphSafeError(f"collectors: capture {capture!r}: {exc}") from exc
        note = f"graphsafe: capture {capture!r}: {exc}; recorded by the dispatch recorder instead"
        manifest.notes.append(note)
        warnings.warn(note, stacklevel=4)
        return False
    return True


def _scan_capture(
    capture: str, graph: Any, contract: SealedModel | None, ignore: list[torch.Tensor], manifest: Manifest
) -> list[CapturedStorage]:
    """The kernel scan of a just-captured graph, as manifest entries (holders are tied by ``_index``)."""
    drv = kscan.driver()
    try:
        scan = kscan.scan_graph(kscan.raw_graph(graph), drv)
    except kscan.ScanUnavailable as exc:
        raise GraphSafeError(f"collectors: capture {capture!r}: {exc}") from exc
    index = _PathIndex()
    if contract is not None:
        if contract.sealed:
            _contract_index(contract, index)
        _model_index(contract.model, index, walk=manifest.walk)
    model = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t) for t in index.tensors.values()]
    ignored = [part for tensor in ignore for part in _memory(tensor)]
    view = kscan.StorageView.from_allocator(model, ignored)
    facts = kscan.attribute(scan, view)
    entries: list[CapturedStorage] = []
    for tensor, offset, label in [*facts.model.values(), *facts.unowned.values()]:
        storage = tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else tensor
        try:
            first = fingerprint(tensor)
        except (TypeError, RuntimeError) as exc:
            manifest.notes.append(f"graphsafe: capture {capture!r}: a storage {label} reads cannot be recorded ({exc})")
            continue
        entries.append(
            CapturedStorage(
                capture=capture,
                storage_ref=weakref.ref(storage),
                data_ptr=storage.data_ptr(),
                nbytes=storage.nbytes(),
                device=tensor.device,
                first_view=first,
                op=label,
                lo=offset,
                hi=storage.nbytes(),
                read=True,
                backend="kernel-scan",
            )
        )
    # Kept per capture: counts, kernel names and notes. Not the tensors (a reference would keep a storage the graph
    # reads alive, so it could never be found dead), nor the parameter bytes.
    facts.model.clear()
    facts.unowned.clear()
    facts.scan = kscan.GraphScan(
        [kscan.GraphNode(n.kind, n.name) for n in scan.nodes], scan.notes, scan.seconds, scan.incomplete
    )
    manifest._scans[capture] = facts
    notes = list(dict.fromkeys(scan.notes))
    if facts.freed:
        # Right after capture_end nothing the capture read can have been freed yet: a word into a free block of
        # the default pool is a non-pointer value (a packed index or divisor) or a block whose pool the snapshot
        # does not name. Noted, not a finding; storages freed later are dead by their weak references.
        base, nbytes, label = facts.freed[0]
        notes.append(
            f"{len(facts.freed)} parameter word(s) point into free allocator blocks (first @0x{base:x}, "
            f"{nbytes} bytes, by {label}); not attributed"
        )
    manifest.notes.extend(f"graphsafe: capture {capture!r}: {note}" for note in notes)
    return entries


# --------------------------------------------------------------------------------------------------------------
# The manifest: storage -> paths index, reload check, unowned storage.


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

    def vouch_fixed(self, *tensors: torch.Tensor) -> None:
        """Vouch that these tensors, which the graphs read and no model path holds (a module-level lookup table),
        are fixed: no reload changes what they hold or where. Their storages are then not ``orphaned`` when
        unowned (a read no model path feeds is otherwise a finding), and not listed by :meth:`unowned`; freed,
        they are still ``dead``. Held weakly; vouch again for a table made anew."""
        for tensor in tensors:
            for part in _memory(tensor):
                storage = part.untyped_storage()
                self._fixed[id(storage)] = weakref.ref(storage)

    def _vouched(self, storage: Any) -> bool:
        ref = self._fixed.get(id(storage)) if storage is not None else None
        return ref is not None and ref() is storage

    def discard(self, capture: str) -> bool:
        """Forget a capture whose graph was destroyed; ``False`` if there was none by that name."""
        self._scans.pop(capture, None)
        self._blind.pop(capture, None)
        self._empty.discard(capture)
        return self._captures.pop(capture, None) is not None

    def _install(self, capture: str, entries: list[CapturedStorage], *, scanned: bool = False) -> None:
        self._captures[capture] = entries
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
        dispatch recorder; a kernel scan knows only where reading began)."""
        return [
            entry
            for entry in self.storages()
            if entry.backend == "dispatch" and entry.hi > entry.lo and entry.storage_ref() is not None
        ]

    def reads(self, start: int, end: int) -> bool:
        """Whether a kernel-scanned graph reads any byte of ``[start, end)`` (an address range): a node's word, or a
        pointer array's word read at scan time, falls into a storage, allocator block or address that overlaps it.
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

    # -- reload check ------------------------------------------------------------------------------------------
    def held(self, contract: SealedModel) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(layer, path, tensor)`` for every path that held a recorded (live) storage, as the model holds it now.

        The contract reads these before a restore writes into captured storage: a path it does not track (a
        tensor ``detect="declared-only"`` never seals) may now hold one of the captured storages with values the
        reload produced for that path, which a copy must not overwrite. O(recorded storages x their holders).
        """
        model = contract.model
        layers: dict[str, nn.Module | None] = {}
        seen: set[tuple[str, str]] = set()
        for entry in self.storages():
            if entry.storage_ref() is None:
                continue
            for holder in entry.holders:
                key = (holder.layer, holder.path)
                if key in seen:
                    continue
                seen.add(key)
                layer = _layer(model, layers, holder.layer)
                value = holder.slot_path.resolve_or(layer, None) if layer is not None else None
                if isinstance(value, torch.Tensor) and value.layout is torch.strided:
                    yield holder.layer, holder.path, value

    def check(self, contract: SealedModel) -> list[Finding]:
        """``dead`` and ``orphaned`` findings for the recorded storages, after a reload's restore.

        Only the recorded paths are re-resolved (no walk): O(recorded storages x their holders).
        """
        model = contract.model
        layers: dict[str, nn.Module | None] = {}
        findings: list[Finding] = []
        tracked = self._tracked
        for entry in self.storages():
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
                    findings.append(_finding(FindingKind.ORPHANED, entry, model, None, what=_UNOWNED_ALIVE))
                continue
            left = [holder for holder in entry.holders if not _holds(model, layers, holder, storage)]
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


def _layer(model: nn.Module, cache: dict[str, nn.Module | None], qualname: str) -> nn.Module | None:
    if qualname not in cache:
        try:
            cache[qualname] = model.get_submodule(qualname) if qualname else model
        except AttributeError:
            cache[qualname] = None
    return cache[qualname]


def _holds(model: nn.Module, cache: dict[str, nn.Module | None], holder: Holder, storage: Any) -> bool:
    layer = _layer(model, cache, holder.layer)
    if layer is None:
        return False
    value = holder.slot_path.resolve_or(layer, None)
    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
        return False
    return any(part.untyped_storage() is storage for part in _memory(value))


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
