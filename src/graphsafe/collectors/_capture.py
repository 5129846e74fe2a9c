"""Recording a capture into a :class:`~graphsafe.collectors._manifest.Manifest`: :func:`record_capture` around a
capture, with the dispatch recorder (a ``TorchDispatchMode`` noting every tensor an op reads or writes whose storage
existed before the capture began) or the kernel scan of the captured graph (:func:`record_scan`), which reads what
the captured kernels really point at."""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from graphsafe._gcpause import collections_paused
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.collectors._dataflow import _VIEW, _WRITE, _schema_access, _tensors
from graphsafe.collectors._manifest import (
    CapturedStorage,
    Manifest,
    SealedModel,
    _blind_phrase,
    _contract_index,
    _memory,
    _model_index,
    _parts,
    _PathIndex,
)
from graphsafe.errors import GraphSafeError
from graphsafe.outcome import fingerprint

__all__ = ["kernel_scan_unavailable", "record_capture", "record_scan"]


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
        positions, names, _ = _schema_access(func)
        kinds = {index: kind for index, (kind, _) in positions.items()}
        cached = _ACCESS[func] = (kinds, names, str(func))
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

    #: Higher-order ops (``torch.cond``) come to ``__torch_dispatch__`` too, rather than raising into the capture.
    supports_higher_order_operators = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # An uninitialised CUDA context cannot be capturing (and must not be initialised just to ask).
        capturing = _cuda_ready() and torch.cuda.is_current_stream_capturing()
        self.capturing = capturing
        self.saw_capture = self.saw_capture or capturing
        if isinstance(func, HigherOrderOperator):
            # Its body runs unseen, reading what its functions close over as well as what it is passed: seen
            # through the tensors passed, like a custom op, and the capture is blind to the rest.
            name = f"{getattr(func, '_name', func)} (higher-order)"
            self.custom.setdefault(name, None)
            self.ops += 1
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self._touch(leaf, name, _READ)
            out = func(*args, **kwargs)
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._mark_internal(leaf)
            return out
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
        with collections_paused():
            yield manifest
        record_scan(contract, graph, name=capture, ignore=ignore, reindex=reindex, manifest=manifest)
        return
    wanted = tuple(torch.device(d) for d in devices) if devices is not None else None
    recorder = _Recorder(capture, wanted, ignore)
    # A cyclic collection inside a capture could destroy an unrelated CUDA graph (or free its pool), which
    # invalidates the capture; the recorder's own bookkeeping allocates enough to trigger one. Pause it (by the
    # threshold: the user's forward runs inside, and its own gc.enable()/gc.disable() must stay as it left them).
    with collections_paused(), recorder:
        yield manifest
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
