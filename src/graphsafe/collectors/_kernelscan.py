"""Kernel scan: what a captured CUDA graph reads, from the graph's own nodes.

The dispatch recorder (:func:`~graphsafe.collectors.record_capture`'s CPU fallback) sees only ops that pass through
torch's dispatcher, and, active during a capture, changes what ``torch.compile`` captures. The graph itself holds
the truth: every kernel node keeps the bytes of its arguments. This module walks a graph's nodes through the CUDA
driver API and reads them:

* kernel nodes: the parameter bytes at the offsets and sizes ``cuFuncGetParamInfo`` gives; every aligned,
  pointer-sized word of them is a candidate address, except the words of a by-value descriptor whose layout the
  kernel's name proves are not pointers (ATen's ``TensorInfo``: only its data pointer, :func:`pointer_limits`);
* memset nodes: the destination; memcpy nodes: source and destination; child-graph nodes: walked in turn.

:class:`StorageView` then says what each candidate address is: a byte of a storage some model path holds, a
registered graph input or output (never a finding), an intermediate in a graph's private pool, another live tensor
no model path holds (unowned), freed memory, or memory the caching allocator never handed out (NCCL's, cuBLAS's
own; outside the model's concern, counted only). Allocator blocks no Python tensor holds (a library's workspace
taken from the caching allocator) are likewise counted, not reported.

Every word's range also joins the capture's :class:`ReadRanges` (what the graph reads, whatever the word was
classified as), and every storage a word locates in a model path, a registered input or output, or an unowned
tensor is read for pointers, whatever its dtype, ``nn.Parameter`` or not (:func:`attribute`): what its aligned
8-byte words point into is read too (not attributed to findings; it keeps memory from being called unread). A
storage of at most :data:`POINTER_ARRAY_BYTES` is copied to host and every word located; a larger one in a model
path or an unowned tensor is searched on its own device (:func:`search_words`) for words that point into memory
the graph is not yet known to read (:meth:`StorageView.unread_spans`), and only those words come to the host.

Cost, all of it at capture (the read ranges are kept; a reload asks them, one bisection per storage, and reads no
table): one host copy of each small storage a node points into, and one pass on the device over each larger one,
in chunks of :data:`SEARCH_CHUNK_WORDS` words: two comparisons of every word with the bounds of the unread memory
(two reads of the storage, 2 bytes of mask per word), then a ``searchsorted`` of the words inside those bounds
against the unread spans (a few, or none), and a host copy of the distinct words found. A graph that reads a model's
weights directly thus costs about two reads of every weight over 1 MiB per capture (bandwidth-bound), plus one host
synchronisation per chunk, and no device work when no memory the view knows is left unread.

Limits: a word a launch left uninitialised inside a parameter whose layout the kernel's name does not prove (an
ATen closure's ``OffsetCalculator`` past its used dims) is located like any other, so an earlier pointer there that
lands in a live tensor no model path holds is reported as an unowned read (a false alarm; it fails closed); a
pointer a kernel reads through a device-side pointer array (grouped-GEMM argument arrays) is visible to
the findings only as the array (one level of arrays counts for what is unread, see :func:`attribute`); a registered
graph input or output over :data:`POINTER_ARRAY_BYTES` (the engine's own data: the KV cache) is not read for
pointers; a storage that cannot be read (no memory of its own) makes the scan incomplete; parameters
passed through ``extra`` rather than ``kernelParams``, or whose layout ``cuFuncGetParamInfo`` cannot give, are not
read, and neither are host, conditional or other node types: each is noted and makes the scan incomplete
(:attr:`GraphScan.incomplete`); a graph captured without ``keep_graph=True`` cannot be scanned
(:class:`ScanUnavailable`).

The driver is reached through NVIDIA's ``cuda-bindings`` (the optional extra ``graphsafe[cuda]``), imported on
first use; :class:`RecordedDriver` replays a recorded node table, so the walk and the decoding run without a GPU.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import gc
import re
import time
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "POINTER_ARRAY_BYTES",
    "POINTER_SIZE",
    "SEARCH_CHUNK_WORDS",
    "CudaDriver",
    "Driver",
    "GraphNode",
    "GraphScan",
    "Located",
    "ScanFacts",
    "ReadRanges",
    "RecordedDriver",
    "ScanUnavailable",
    "StorageView",
    "allocator_segments",
    "attribute",
    "driver",
    "keeps_graph",
    "live_tensors",
    "parameter_types",
    "pointer_array_words",
    "pointer_limits",
    "pointer_words",
    "raw_graph",
    "record_table",
    "scan_graph",
    "search_words",
]

#: Bytes of a device pointer (the words the scan reads).
POINTER_SIZE = 8

# What a located address is.
MODEL = "model"  # inside a storage the caller named (model paths; their holders come from the manifest's index)
IGNORED = "ignored"  # a registered graph input or output
PRIVATE = "private"  # an active block of a graph's private pool: that graph's intermediates
UNOWNED = "unowned"  # a live Python-visible tensor no model path holds
FREED = "freed"  # inside an allocator segment but in no allocated block
FOREIGN = "foreign"  # memory the allocator never handed out, or an allocator block no Python tensor holds


class ScanUnavailable(Exception):
    """The kernel scan cannot run here (no driver bindings, no ``keep_graph``, a driver without the calls)."""


# --------------------------------------------------------------------------------------------------------------
# Nodes and decoding.


@dataclass(frozen=True, slots=True)
class GraphNode:
    """One node of a captured graph, as the scan reads it.

    ``kind`` is ``"kernel"``, ``"memset"``, ``"memcpy"`` or another node type's name (not read). For a kernel,
    ``layout`` is ``(offset, size)`` per parameter and ``params`` their bytes (``None`` when the launch passed
    them through ``extra``); for a memset or memcpy, ``pointers`` are its device addresses. ``undecoded`` says why
    a kernel's parameters were not (all) read (``""``: every parameter was read): then what the kernel reads is
    not known, and neither is what the graph does not read.
    """

    kind: str
    name: str = ""
    layout: tuple[tuple[int, int], ...] = ()
    params: tuple[bytes, ...] | None = ()
    pointers: tuple[int, ...] = ()
    undecoded: str = ""

    def words(self) -> list[int]:
        """Candidate addresses: a kernel's aligned pointer-sized parameter words, or a copy node's pointers."""
        if self.kind != "kernel":
            return [p for p in self.pointers if p]
        if self.params is None:
            return []
        return pointer_words(self.layout, self.params, self.name)


def pointer_words(layout: Sequence[tuple[int, int]], params: Sequence[bytes], name: str = "") -> list[int]:
    """Every non-zero, pointer-aligned, pointer-sized word of a kernel's parameters that may hold a pointer.

    ``layout[i]`` is parameter ``i``'s ``(offset, size)`` in the argument buffer and ``params[i]`` its bytes.
    Words are taken at argument-buffer offsets that are multiples of :data:`POINTER_SIZE` (where the ABI puts a
    pointer), inside parameters of at least that size: a pointer argument, or a pointer field of a struct
    argument (an array of pointers passed by value), within the leading bytes :func:`pointer_limits` gives for
    the kernel ``name`` (every byte of a parameter whose type the name does not prove, or whose bytes do not bear
    the proven layout out: a TensorInfo whose ``dims`` field holds no dimension count).
    """
    if len(layout) != len(params):
        raise ValueError(f"kernel scan: {len(layout)} parameter offsets but {len(params)} parameter buffers")
    limits = pointer_limits(name, tuple((int(offset), int(size)) for offset, size in layout))
    words: list[int] = []
    for (offset, size), data, limit in zip(layout, params, limits, strict=True):
        if size < POINTER_SIZE:
            continue
        if len(data) < size:
            raise ValueError(f"kernel scan: parameter at offset {offset} has {len(data)} bytes, expected {size}")
        if limit < size and not _tensor_info_dims_plausible(data, size):
            limit = size  # not the layout the name promised (another torch's struct): every word, as for any other
        start = (-offset) % POINTER_SIZE
        for at in range(start, min(size, limit) - POINTER_SIZE + 1, POINTER_SIZE):
            word = int.from_bytes(data[at : at + POINTER_SIZE], "little")
            if word:
                words.append(word)
    return words


#: ATen's by-value tensor descriptor ``at::cuda::detail::TensorInfo<T, IndexType>``: ``T* data``, then
#: ``IndexType sizes[25]``, ``IndexType strides[25]`` and ``int dims``. Its data pointer is its only pointer; a
#: launch fills ``dims`` entries of each array and leaves the rest as the host stack held them, often an earlier
#: pointer, which may land in any live tensor (a read the graph never makes).
_TENSOR_INFO = "at::cuda::detail::TensorInfo<"
_TENSOR_INFO_DIMS = 25
_INDEX_BYTES = {"unsigned int": 4, "int": 4, "unsigned long": 8, "long": 8}


def _tensor_info_bytes_by_width(width: int) -> int:
    """``sizeof(TensorInfo<T, IndexType>)`` for an index of ``width`` bytes: the pointer, two arrays, ``dims``,
    padded to the pointer's alignment."""
    raw = POINTER_SIZE + 2 * _TENSOR_INFO_DIMS * width + 4
    return -(-raw // POINTER_SIZE) * POINTER_SIZE


def _tensor_info_dims_plausible(data: bytes, size: int) -> bool:
    """Whether a parameter :func:`pointer_limits` took for a TensorInfo of ``size`` bytes has its ``dims`` field
    where that layout puts it, holding a dimension count (0 to 25)."""
    for width in (4, 8):
        if _tensor_info_bytes_by_width(width) == size:
            at = POINTER_SIZE + 2 * _TENSOR_INFO_DIMS * width
            return 0 <= int.from_bytes(data[at : at + 4], "little", signed=True) <= _TENSOR_INFO_DIMS
    return False


def _split_arguments(text: str) -> list[str] | None:
    """``text`` split at its top-level commas, stripped; ``None`` where its brackets do not balance."""
    parts: list[str] = []
    depth = 0
    start = 0
    for at, char in enumerate(text):
        if char in "<([{":
            depth += 1
        elif char in ">)]}":
            depth -= 1
            if depth < 0:
                return None
        elif char == "," and depth == 0:
            parts.append(text[start:at].strip())
            start = at + 1
    if depth != 0:
        return None
    parts.append(text[start:].strip())
    return parts


class _NotSimple(Exception):
    """The demangled signature is not one :class:`_Signature` reads for certain."""


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INTEGER = re.compile(r"-?[0-9]+(?:ull|ul|ll|u|l)?")
#: Words that start a builtin type of several (``unsigned int``, ``long long``), and the words that may follow.
_BUILTIN_FIRST = frozenset({"unsigned", "signed", "long", "short"})
_BUILTIN_NEXT = frozenset({"int", "long", "char", "short", "double"})


class _Signature:
    """A recursive-descent reader of the demangler's text for the simple signatures kernels have, and nothing more:
    ``[void ]qualified::name[<args>](type, ...)``, where a type is a builtin or a qualified name whose template
    arguments are types or integer literals, with ``const``, ``*`` and ``&``. Anything else (an expression or an
    ``operator`` in a template argument, a lambda, a function type, a cast) raises :class:`_NotSimple`: such text
    may hold angles that are no brackets, and a split by brackets could put one parameter's type on another."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._at = 0

    def parameters(self) -> list[str]:
        self._take("void ")
        self._qualified()
        self._expect("(")
        types: list[str] = []
        if not self._take(")") and not self._take("void)"):
            while True:
                types.append(self._type())
                if self._take(")"):
                    break
                self._expect(", ")
        if self._at != len(self._text):
            raise _NotSimple
        return types

    def _take(self, token: str) -> bool:
        if self._text.startswith(token, self._at):
            self._at += len(token)
            return True
        return False

    def _expect(self, token: str) -> None:
        if not self._take(token):
            raise _NotSimple

    def _identifier(self) -> str:
        found = _IDENTIFIER.match(self._text, self._at)
        if found is None:
            raise _NotSimple
        self._at = found.end()
        return found.group()

    def _qualified(self) -> None:
        while True:
            if not self._take("(anonymous namespace)"):
                self._identifier()
                if self._take("<"):
                    self._arguments()
            if not self._take("::"):
                return

    def _arguments(self) -> None:
        while True:
            literal = _INTEGER.match(self._text, self._at)
            if literal is not None:
                self._at = literal.end()
            else:
                self._type()
            if self._take(", "):
                continue
            self._take(" ")  # "A<B<int> >"
            self._expect(">")
            return

    def _type(self) -> str:
        start = self._at
        word = self._identifier()
        if word in _BUILTIN_FIRST:
            while self._text.startswith(" ", self._at):
                following = _IDENTIFIER.match(self._text, self._at + 1)
                if following is None or following.group() not in _BUILTIN_NEXT:
                    break
                self._at = following.end()
        else:
            self._at = start
            self._qualified()
        while self._take(" const") or self._take(" volatile") or self._take("*") or self._take("&"):
            pass
        return self._text[start : self._at]


#: A C++ function's mangled name: ``_Z`` and identifier characters only (the demangler copies a source name's
#: bytes as they are, so ``_Z1f40at::cuda::detail::TensorInfo<float, int>i`` would print a TensorInfo it never names).
_MANGLED = re.compile(r"_Z[A-Za-z0-9_]+")
#: The longest mangled name read, and the longest signature read: back-references let a short name demangle to
#: megabytes (each parameter naming the one before twice doubles the text); a longer one proves nothing.
MANGLED_NAME_CHARS = 4096
SIGNATURE_CHARS = 16384


def parameter_types(name: str) -> list[str] | None:
    """The parameter types of the kernel ``name`` as the C++ demangler spells them, in order; ``None`` when the
    name is not a mangled C++ function (a Triton or ``extern "C"`` kernel), is longer than
    :data:`MANGLED_NAME_CHARS` or its signature than :data:`SIGNATURE_CHARS`, or its signature is not one
    :class:`_Signature` reads for certain."""
    demangle = getattr(torch._C, "_demangle", None)
    if demangle is None or len(name) > MANGLED_NAME_CHARS or _MANGLED.fullmatch(name) is None:
        return None
    try:
        signature = str(demangle(name))
    except (TypeError, ValueError, RuntimeError, MemoryError):
        return None
    if signature == name or len(signature) > SIGNATURE_CHARS:
        return None
    try:
        return _Signature(signature).parameters()
    except (_NotSimple, RecursionError):
        return None


def _tensor_info_index(type_name: str) -> str | None:
    """The index type of an ``at::cuda::detail::TensorInfo<T, IndexType>`` spelled ``type_name``, else ``None``
    (another type, or one nested in a TensorInfo: ``TensorInfo<float, int>::X<...>``)."""
    if not type_name.startswith(_TENSOR_INFO) or not type_name.endswith(">"):
        return None
    arguments = _split_arguments(type_name[len(_TENSOR_INFO) : -1])
    if arguments is None or len(arguments) != 2 or arguments[1] not in _INDEX_BYTES:
        return None
    return arguments[1]


@functools.lru_cache(maxsize=4096)
def pointer_limits(name: str, layout: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Per parameter of the kernel ``name``, how many of its leading bytes may hold a pointer.

    A parameter's size, unless its demangled type is a layout the scan knows and its size and alignment match
    that layout: then only the bytes that layout keeps pointers in (:data:`POINTER_SIZE` for ATen's
    ``TensorInfo``, whose data pointer comes first). A name that does not demangle to exactly ``len(layout)``
    parameters proves nothing, and every byte of every parameter is read.
    """
    sizes = tuple(size for _, size in layout)
    if "10TensorInfoI" not in name:  # no TensorInfo spelled, none to find: not demangled at all
        return sizes
    types = parameter_types(name)
    if types is None or len(types) != len(layout):
        return sizes
    limits: list[int] = []
    for (offset, size), type_name in zip(layout, types, strict=True):
        index = _tensor_info_index(type_name)
        width = _INDEX_BYTES[index] if index is not None else 0
        if width and offset % POINTER_SIZE == 0 and size == _tensor_info_bytes_by_width(width):
            limits.append(POINTER_SIZE)
        else:
            limits.append(size)
    return tuple(limits)


class Driver(Protocol):
    """The driver calls the walk needs (:class:`CudaDriver` for the GPU, :class:`RecordedDriver` for tests)."""

    def nodes(self, graph: int) -> Sequence[int]:
        """The graph's node handles."""
        ...

    def node_type(self, node: int) -> str:
        """``"kernel"``, ``"memset"``, ``"memcpy"``, ``"graph"`` (a child graph), or another type's name."""
        ...

    def kernel(self, node: int) -> GraphNode:
        """A kernel node's name, parameter layout and parameter bytes."""
        ...

    def copy_pointers(self, node: int, kind: str) -> tuple[int, ...]:
        """A memset's destination, a memcpy's device source and destination."""
        ...

    def child(self, node: int) -> int:
        """A child-graph node's graph."""
        ...


@dataclass(slots=True)
class GraphScan:
    """What one walk of a graph found."""

    nodes: list[GraphNode] = field(default_factory=list)
    #: One line per node the scan could not read (a kernel with ``extra`` parameters, an unknown node type).
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Why the scan does not know everything the graph reads (one line per node it could not read fully: a kernel
    #: whose parameters it could not decode, a node type it does not read); empty when it read every node.
    incomplete: list[str] = field(default_factory=list)

    @property
    def kernel_names(self) -> list[str]:
        """The kernels' names, in node order."""
        return [node.name for node in self.nodes if node.kind == "kernel"]

    def counts(self) -> dict[str, int]:
        """Nodes per kind."""
        out: dict[str, int] = {}
        for node in self.nodes:
            out[node.kind] = out.get(node.kind, 0) + 1
        return out


#: Node types that read no memory a model holds: the scan has nothing to read in them.
_HARMLESS_NODES = frozenset({"empty", "event_record", "wait_event", "mem_alloc", "mem_free"})


def scan_graph(graph: int, drv: Driver) -> GraphScan:
    """Walk ``graph`` (and its child graphs) and read every kernel, memset and memcpy node."""
    start = time.perf_counter()
    result = GraphScan()
    pending = [graph]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for node in drv.nodes(current):
            kind = drv.node_type(node)
            if kind == "kernel":
                read = drv.kernel(node)
                if read.params is None:
                    note = (
                        f"kernel {read.name or '?'}: parameters passed through 'extra' are not read by the kernel scan"
                    )
                    result.notes.append(note)
                    result.incomplete.append(note)
                elif read.undecoded:
                    note = f"kernel {read.name or '?'}: {read.undecoded}"
                    result.notes.append(note)
                    result.incomplete.append(note)
                result.nodes.append(read)
            elif kind in ("memset", "memcpy"):
                result.nodes.append(GraphNode(kind, pointers=drv.copy_pointers(node, kind)))
            elif kind == "graph":
                pending.append(drv.child(node))
            elif kind not in _HARMLESS_NODES:
                note = f"a {kind} node is not read by the kernel scan"
                result.notes.append(note)
                result.incomplete.append(note)
    result.seconds = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------------------------------------------
# Recorded node tables (CPU tests, and what the GPU run dumps).


def record_table(graph: int, drv: Driver) -> dict[str, Any]:
    """The nodes of ``graph`` and its children as plain data, for :class:`RecordedDriver`."""
    graphs: dict[str, list[dict[str, Any]]] = {}
    pending = [graph]
    while pending:
        current = pending.pop()
        if str(current) in graphs:
            continue
        rows: list[dict[str, Any]] = []
        for node in drv.nodes(current):
            kind = drv.node_type(node)
            row: dict[str, Any] = {"type": kind}
            if kind == "kernel":
                read = drv.kernel(node)
                row["name"] = read.name
                row["layout"] = [list(pair) for pair in read.layout]
                row["params"] = None if read.params is None else [p.hex() for p in read.params]
                if read.undecoded:
                    row["undecoded"] = read.undecoded
            elif kind in ("memset", "memcpy"):
                row["pointers"] = list(drv.copy_pointers(node, kind))
            elif kind == "graph":
                child = drv.child(node)
                row["graph"] = child
                pending.append(child)
            rows.append(row)
        graphs[str(current)] = rows
    return {"root": graph, "graphs": graphs}


class RecordedDriver:
    """A :class:`Driver` over a recorded node table (``{"root": id, "graphs": {id: [row, ...]}}``).

    A kernel row has ``name``, ``layout`` and ``params`` (``None``: passed through ``extra``), and ``undecoded``
    when its parameters could not all be read; a memset or memcpy row has ``pointers``; a child-graph row ``graph``.
    """

    def __init__(self, table: Mapping[str, Any]) -> None:
        self.root = int(table["root"])
        self._rows: dict[int, dict[str, Any]] = {}
        self._graphs: dict[int, list[int]] = {}
        handle = 1
        for key, rows in table["graphs"].items():
            handles = []
            for row in rows:
                self._rows[handle] = row
                handles.append(handle)
                handle += 1
            self._graphs[int(key)] = handles

    def nodes(self, graph: int) -> Sequence[int]:
        if graph not in self._graphs:
            raise ScanUnavailable(f"kernel scan: no recorded graph {graph}")
        return self._graphs[graph]

    def node_type(self, node: int) -> str:
        return str(self._rows[node]["type"])

    def kernel(self, node: int) -> GraphNode:
        row = self._rows[node]
        params = row.get("params")
        return GraphNode(
            "kernel",
            name=str(row.get("name", "")),
            layout=tuple((int(o), int(s)) for o, s in row.get("layout", ())),
            params=None if params is None else tuple(bytes.fromhex(p) for p in params),
            undecoded=str(row.get("undecoded", "")),
        )

    def copy_pointers(self, node: int, kind: str) -> tuple[int, ...]:
        return tuple(int(p) for p in self._rows[node].get("pointers", ()))

    def child(self, node: int) -> int:
        return int(self._rows[node]["graph"])


# --------------------------------------------------------------------------------------------------------------
# The CUDA driver through cuda-bindings.

_NODE_TYPES = {
    0: "kernel",
    1: "memcpy",
    2: "memset",
    3: "host",
    4: "graph",
    5: "empty",
    6: "wait_event",
    7: "event_record",
    8: "ext_semas_signal",
    9: "ext_semas_wait",
    10: "mem_alloc",
    11: "mem_free",
    12: "batch_mem_op",
    13: "conditional",
}


class CudaDriver:
    """:class:`Driver` through ``cuda.bindings.driver`` (``cuda-bindings``, the ``cuda`` extra)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise ScanUnavailable(
                "kernel scan unavailable: cuda-bindings is not installed (pip install 'cuda-bindings>=12.4')"
            ) from exc
        self._cu: Any = cu
        self._success = cu.CUresult.CUDA_SUCCESS
        self._end = cu.CUresult.CUDA_ERROR_INVALID_VALUE  # what cuFuncGetParamInfo answers past the last parameter
        self._layouts: dict[int, tuple[tuple[tuple[int, int], ...], str, str]] = {}

    def _call(self, what: str, result: Any) -> Any:
        err, *rest = result
        if err != self._success:
            raise ScanUnavailable(f"kernel scan: {what} failed with {err!r}")
        return rest[0] if len(rest) == 1 else tuple(rest)

    def nodes(self, graph: int) -> Sequence[int]:
        cu = self._cu
        _, count = self._call("cuGraphGetNodes", cu.cuGraphGetNodes(graph, 0))
        if not count:
            return []
        nodes, _ = self._call("cuGraphGetNodes", cu.cuGraphGetNodes(graph, count))
        return [int(node) for node in nodes[:count]]

    def node_type(self, node: int) -> str:
        kind = self._call("cuGraphNodeGetType", self._cu.cuGraphNodeGetType(node))
        return _NODE_TYPES.get(int(kind), f"type-{int(kind)}")

    def _layout(self, func: int) -> tuple[tuple[tuple[int, int], ...], str, str]:
        """The kernel's parameter layout, its name, and why the layout could not be read (``""``: it was)."""
        cached = self._layouts.get(func)
        if cached is not None:
            return cached
        cu = self._cu
        layout: list[tuple[int, int]] = []
        unreadable = ""
        get_info = getattr(cu, "cuFuncGetParamInfo", None)
        if get_info is None:
            unreadable = (
                "the driver bindings have no cuFuncGetParamInfo (CUDA 12.4 or newer), so its parameters are not read"
            )
        while get_info is not None:
            err, offset, size = get_info(func, len(layout))
            if err != self._success:
                if err != self._end:  # CUDA_ERROR_INVALID_VALUE past the last parameter; anything else: unknown
                    unreadable = f"cuFuncGetParamInfo failed with {err!r}, so its parameters are not all read"
                break
            layout.append((int(offset), int(size)))
        err, name = cu.cuFuncGetName(func)
        text = name.decode(errors="replace") if err == self._success and isinstance(name, bytes) else str(name)
        cached = (tuple(layout), text, unreadable)
        self._layouts[func] = cached
        return cached

    def kernel(self, node: int) -> GraphNode:
        cu = self._cu
        params = self._call("cuGraphKernelNodeGetParams", cu.cuGraphKernelNodeGetParams(node))
        func = int(params.func)
        if not func and int(params.kern):
            func = int(self._call("cuKernelGetFunction", cu.cuKernelGetFunction(params.kern)))
        layout, name, unreadable = self._layout(func)
        address = int(params.kernelParams)
        if not address:
            return GraphNode("kernel", name=name, layout=layout, params=None)
        values: list[bytes] = []
        missing: list[int] = []
        for index, (_, size) in enumerate(layout):
            pointer = ctypes.c_void_p.from_address(address + index * ctypes.sizeof(ctypes.c_void_p)).value
            if not pointer:
                missing.append(index)
            values.append(ctypes.string_at(pointer, size) if pointer else bytes(size))
        if missing and not unreadable:
            unreadable = f"parameter(s) {missing} have no value pointer in kernelParams, so they are not read"
        return GraphNode("kernel", name=name, layout=layout, params=tuple(values), undecoded=unreadable)

    def copy_pointers(self, node: int, kind: str) -> tuple[int, ...]:
        cu = self._cu
        if kind == "memset":
            params = self._call("cuGraphMemsetNodeGetParams", cu.cuGraphMemsetNodeGetParams(node))
            return (int(params.dst),)
        params = self._call("cuGraphMemcpyNodeGetParams", cu.cuGraphMemcpyNodeGetParams(node))
        return (int(params.srcDevice), int(params.dstDevice))

    def child(self, node: int) -> int:
        return int(self._call("cuGraphChildGraphNodeGetGraph", self._cu.cuGraphChildGraphNodeGetGraph(node)))


_DRIVER: CudaDriver | None = None


def driver() -> CudaDriver:
    """The process's :class:`CudaDriver` (raises :class:`ScanUnavailable` without cuda-bindings)."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = CudaDriver()
    return _DRIVER


def raw_graph(graph: Any) -> int:
    """The ``cudaGraph_t`` of a captured ``torch.cuda.CUDAGraph``; :class:`ScanUnavailable` without keep_graph."""
    try:
        return int(graph.raw_cuda_graph())
    except (RuntimeError, AttributeError) as exc:
        raise ScanUnavailable(
            "kernel scan unavailable: the graph was captured without torch.cuda.CUDAGraph(keep_graph=True)"
        ) from exc


def keeps_graph(graph: Any) -> bool:
    """Whether an (uncaptured or captured) ``torch.cuda.CUDAGraph`` was made with ``keep_graph=True``."""
    try:
        graph.raw_cuda_graph()
    except AttributeError:
        return False
    except RuntimeError as exc:
        # Before capture_end torch refuses either way; only the refusal for a graph it will not keep names it.
        return "keep_graph" not in str(exc)
    return True


# --------------------------------------------------------------------------------------------------------------
# Addresses to storages.


@dataclass(frozen=True, slots=True)
class Located:
    """One address range the graph reads, and what it is."""

    what: str
    base: int
    nbytes: int
    storage: Any = None
    #: The lowest offset into the range any node's word pointed at.
    offset: int = 0


class _Intervals:
    """``[start, end)`` ranges with a payload, searched by bisection; ranges may nest or overlap."""

    def __init__(self, ranges: Iterable[tuple[int, int, Any]]) -> None:
        # Sorted by the range alone: views of one storage give equal ranges, and payloads (tensors) do not compare.
        items = sorted(
            ((start, start + size, payload) for start, size, payload in ranges if size > 0),
            key=lambda item: (item[0], item[1]),
        )
        self._starts = [item[0] for item in items]
        self._items = items
        # reach[i]: the furthest end of items[0..i], so a search looks back only while an earlier range can reach.
        self._reach: list[int] = []
        furthest = 0
        for _, end, _ in items:
            furthest = max(furthest, end)
            self._reach.append(furthest)

    def find(self, address: int) -> tuple[int, int, Any] | None:
        """The range with the greatest start that contains ``address`` (the innermost of nested ones)."""
        index = bisect.bisect_right(self._starts, address) - 1
        while index >= 0 and self._reach[index] > address:
            start, end, payload = self._items[index]
            if start <= address < end:
                return start, end, payload
            index -= 1
        return None


def _storage_ranges(tensors: Iterable[object]) -> Iterator[tuple[int, int, Any]]:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and tensor.device.type != "meta":
            try:
                storage = tensor.untyped_storage()
                address = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue  # no memory of its own (a FakeTensor or FunctionalTensor left from compiling)
            yield address, storage.nbytes(), tensor


def _own_ranges(tensors: Iterable[object]) -> Iterator[tuple[int, int, Any]]:
    """``(address, nbytes, tensor)`` of the bytes each tensor itself spans (not its whole storage)."""
    for start, _nbytes, tensor in _storage_ranges(tensors):
        lo, hi = _span(tensor)
        yield start + lo, hi - lo, tensor


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)`` in bytes of its storage that a strided tensor spans (``(0, 0)`` when empty)."""
    if tensor.numel() == 0:
        return 0, 0
    extent = sum((int(n) - 1) * abs(int(st)) for n, st in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    lo = int(tensor.storage_offset()) * tensor.element_size()
    return lo, lo + extent * tensor.element_size()


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ``[start, end)`` ranges covering the same addresses (touching ones joined; empty dropped)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _less(ranges: Sequence[tuple[int, int]], cut: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The addresses of ``ranges`` outside ``cut`` (both as :func:`_merged` gives them), merged."""
    out: list[tuple[int, int]] = []
    first = 0
    for start, end in ranges:
        while first < len(cut) and cut[first][1] <= start:
            first += 1
        at = first
        while start < end and at < len(cut) and cut[at][0] < end:
            if cut[at][0] > start:
                out.append((start, cut[at][0]))
            start = max(start, cut[at][1])
            at += 1
        if start < end:
            out.append((start, end))
    return out


class StorageView:
    """What an address is, by the caller's storages and the caching allocator's own view.

    A registered graph input or output is looked up first, by the bytes it spans: it is what the caller said the
    graph reads there, whatever else claims the address (a model path that also holds it, a layer caching its
    last input; an address another tensor held before), so it is never a finding.

    Args:
        model: ``(address, nbytes, tensor)`` of the storages model paths hold.
        ignored: registered graph inputs and outputs (tensors).
        segments: the allocator's segments as ``torch.cuda.memory._snapshot()["segments"]`` gives them.
        others: ``(address, nbytes, tensor)`` of other live tensors; ``None``: found through the garbage
            collector when an allocated block is neither model, input/output nor private (once per view).
    """

    def __init__(
        self,
        model: Iterable[tuple[int, int, Any]],
        ignored: Iterable[object] = (),
        segments: Sequence[Mapping[str, Any]] = (),
        others: Iterable[tuple[int, int, Any]] | None = None,
    ) -> None:
        self._model = _Intervals(model)
        self._ignored = _Intervals(_own_ranges(ignored))
        blocks: list[tuple[int, int, Any]] = []
        segs: list[tuple[int, int, Any]] = []
        for segment in segments:
            pool = tuple(segment.get("segment_pool_id", (0, 0)) or (0, 0))
            private = any(pool)
            base = int(segment["address"])
            segs.append((base, int(segment["total_size"]), private))
            at = base
            for block in segment.get("blocks", ()):
                address = int(block.get("address", at))
                size = int(block["size"])
                at = address + size
                allocated = str(block.get("state", "")).startswith("active")
                blocks.append((address, size, (allocated, private)))
        self._segments = _Intervals(segs)
        self._blocks = _Intervals(blocks)
        self._others = None if others is None else _Intervals(others)

    @classmethod
    def from_allocator(cls, model: Iterable[tuple[int, int, Any]], ignored: Iterable[object] = ()) -> StorageView:
        """Model storages and ignored tensors against the live caching allocator's snapshot."""
        return cls(model, ignored, allocator_segments())

    def unread_spans(self, reads: ReadRanges) -> list[tuple[int, int]]:
        """Where a word must be located to know whether it adds to ``reads``: the sorted, merged ``[start, end)``
        spans of memory this view knows that ``reads`` does not cover.

        :meth:`locate` answers by the first kind of range holding an address: a registered input or output, a
        model storage, an allocator block (an allocated one may hold another tensor, which lies inside it), a
        segment. A span is every range of a kind that ``reads`` does not cover in full, less every range of an
        earlier kind: an address outside the spans is in no range of this view (a bare address, :data:`FOREIGN`),
        or what :meth:`locate` gives for it is inside memory ``reads`` covers already.
        """
        earlier: list[tuple[int, int]] = []
        spans: list[tuple[int, int]] = []
        for kind in (self._ignored, self._model, self._blocks, self._segments):
            ranges = [(start, end) for start, end, _ in kind._items]
            uncovered = _merged(r for r in ranges if not reads.covers(*r))
            spans.extend(_less(uncovered, _merged(earlier)))
            earlier.extend(ranges)
        return _merged(spans)

    def _other(self, address: int) -> tuple[int, int, Any] | None:
        if self._others is None:
            self._others = _Intervals(_storage_ranges(live_tensors()))
        return self._others.find(address)

    def locate(self, address: int) -> Located:
        """What ``address`` is (see the module docs for the kinds)."""
        hit = self._ignored.find(address)
        if hit is not None:
            return Located(IGNORED, hit[0], hit[1] - hit[0], hit[2], address - hit[0])
        hit = self._model.find(address)
        if hit is not None:
            return Located(MODEL, hit[0], hit[1] - hit[0], hit[2], address - hit[0])
        block = self._blocks.find(address)
        if block is None:
            segment = self._segments.find(address)
            if segment is None:
                return Located(FOREIGN, address, 0)
            return Located(PRIVATE if segment[2] else FREED, segment[0], segment[1] - segment[0])
        allocated, private = block[2]
        if private:  # allocated or not: a graph's pool keeps its intermediates' memory for replay
            return Located(PRIVATE, block[0], block[1] - block[0])
        if not allocated:
            return Located(FREED, block[0], block[1] - block[0])
        hit = self._other(address)
        if hit is not None:
            return Located(UNOWNED, hit[0], hit[1] - hit[0], hit[2], address - hit[0])
        return Located(FOREIGN, block[0], block[1] - block[0])


def allocator_segments() -> list[Mapping[str, Any]]:
    """The caching allocator's segments with their blocks and pool ids (``torch.cuda.memory._snapshot()``)."""
    return list(torch.cuda.memory._snapshot()["segments"])


def live_tensors() -> Iterator[torch.Tensor]:
    """Every live CUDA tensor the garbage collector tracks (capture time only, and only when needed: O(heap))."""
    for obj in gc.get_objects():
        # type(), not isinstance(): the heap holds weak proxies (isinstance on a dead one raises) and deprecated
        # module attributes that warn when touched.
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cuda":
            yield obj


#: The largest storage the scan copies to host to read for pointers (a device-side pointer array), whatever its dtype
#: (a fused-MoE workspace lays its pointer tables out in a ``uint8`` or float buffer): 1 MiB. A larger one a node
#: points at, in a model path or an unowned tensor, whatever its dtype and ``nn.Parameter`` or not, is searched on
#: its own device instead (:func:`search_words`): it is a weight more often than not, and is not copied.
POINTER_ARRAY_BYTES = 1 << 20
#: Words of a large storage searched in one device step (:func:`search_words`): bounds the step's temporaries to
#: its masks, 2 bytes a word (32 MiB), and the few words found.
SEARCH_CHUNK_WORDS = 1 << 24


_ADDRESS_END = (1 << 64) - 1  # the largest bound an unsigned 64-bit array holds


class ReadRanges:
    """Merged ``[start, end)`` address ranges a graph reads: every storage (or allocator block, or bare address) a
    node's word points into, and every one a pointer array read at scan time points into.

    Kept per capture (8 bytes per bound, no tensors), so that whether a graph reads any byte of some memory is one
    bisection, whatever classified the word then.
    """

    __slots__ = ("_ends", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        starts: list[int] = []
        ends: list[int] = []
        # A word near the top of the address space plus its block size can pass 2**64: no allocation lies there,
        # and the bounds are kept as unsigned 64-bit integers.
        bounded = ((start, min(end, _ADDRESS_END)) for start, end in ranges if 0 <= start < _ADDRESS_END)
        for start, end in sorted(r for r in bounded if r[1] > r[0]):
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        self._starts = array("Q", starts)
        self._ends = array("Q", ends)

    def __len__(self) -> int:
        return len(self._starts)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any byte of ``[start, end)`` is in a range (an empty span counts as its first address)."""
        end = max(end, start + 1)
        index = bisect.bisect_left(self._starts, end) - 1  # the last range starting before ``end``
        return index >= 0 and self._ends[index] > start

    def covers(self, start: int, end: int) -> bool:
        """Whether every byte of ``[start, end)`` is in the ranges (an empty span counts as its first address)."""
        end = max(end, start + 1)
        index = bisect.bisect_right(self._starts, start) - 1  # the last range starting at or before ``start``
        return index >= 0 and self._ends[index] >= end


def _aligned_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``tensor``'s whole storage as ``uint8`` on its device, the byte offset of its first 8-aligned address (where a
    kernel's 8-byte loads can start), and how many whole aligned words follow it."""
    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(storage)
    skip = -int(storage.data_ptr()) % POINTER_SIZE
    return raw, skip, max(int(storage.nbytes()) - skip, 0) // POINTER_SIZE


def _words(raw: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """``count`` 8-byte words of ``raw`` from byte ``at`` as ``int64`` (copied when ``at`` is not a multiple of 8:
    torch views a byte tensor as words only from a whole word of its storage)."""
    part = raw[at : at + count * POINTER_SIZE]
    return (part.clone() if at % POINTER_SIZE else part).view(torch.int64)


def pointer_array_words(tensor: torch.Tensor) -> list[int]:
    """The non-zero aligned 8-byte words of ``tensor``'s whole storage, read to host once (a device-side pointer
    array: grouped-GEMM argument arrays, CUTLASS MoE stride and pointer tables made before capture)."""
    raw, skip, count = _aligned_bytes(tensor)
    host = raw.cpu() if raw.device.type != "cpu" else raw
    words = _words(host, skip, count)
    return [int(w) for w in words[words > 0].tolist()]


_INT64_END = 1 << 63  # a word is searched as a signed 64-bit integer: no allocation lies at or above this address


def search_words(tensor: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[int]:
    """The distinct aligned 8-byte words of ``tensor``'s whole storage that fall in ``spans`` (sorted, disjoint
    ``[start, end)`` address ranges, as :meth:`StorageView.unread_spans` gives them), searched on the storage's own
    device: only the words found come to the host (a large storage, mostly a weight, is never copied).

    In steps of :data:`SEARCH_CHUNK_WORDS` words: a mask of the words between the first span's start and the last
    span's end, then ``searchsorted`` of those words against the spans' starts and a comparison with the end of the
    span found. Raises what torch raises for a storage without memory of its own.
    """
    bounded = [(start, min(end, _INT64_END - 1)) for start, end in spans if 0 <= start < _INT64_END - 1]
    if not bounded:
        return []
    raw, skip, count = _aligned_bytes(tensor)
    starts = torch.tensor([start for start, _ in bounded], dtype=torch.int64, device=raw.device)
    ends = torch.tensor([end for _, end in bounded], dtype=torch.int64, device=raw.device)
    low, high = bounded[0][0], bounded[-1][1]
    found: list[torch.Tensor] = []
    for first in range(0, count, SEARCH_CHUNK_WORDS):
        words = _words(raw, skip + first * POINTER_SIZE, min(SEARCH_CHUNK_WORDS, count - first))
        near = words[(words >= low).logical_and_(words < high)]
        if near.numel():
            span = torch.searchsorted(starts, near, right=True) - 1  # >= 0: every near word is >= starts[0]
            found.append(near[near < ends[span]])
    if not found:
        return []
    return [int(w) for w in torch.unique(torch.cat(found)).tolist()]


def _storage_bytes(payload: Any) -> int | None:
    """The size of ``payload``'s storage when it is a strided tensor (one whose bytes may hold pointers)."""
    if not isinstance(payload, torch.Tensor) or payload.layout is not torch.strided:
        return None
    try:
        return int(payload.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return None


@dataclass(slots=True)
class ScanFacts:
    """What a scanned graph reads, by storage, with the counts the scan could not attribute."""

    scan: GraphScan
    #: id(storage) -> (tensor or storage, lowest offset read, first node that read it), model and unowned.
    model: dict[int, tuple[Any, int, str]] = field(default_factory=dict)
    unowned: dict[int, tuple[Any, int, str]] = field(default_factory=dict)
    #: Freed ranges a node points into: (base, nbytes, kernel).
    freed: list[tuple[int, int, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    #: Every range the graph reads, whatever it is (see :class:`ReadRanges`).
    reads: ReadRanges = field(default_factory=ReadRanges)
    #: Storages read to host as pointer arrays, larger ones searched on their device for pointers, and the words in
    #: either that point at located memory.
    arrays: int = 0
    tables: int = 0
    indirect: int = 0


def attribute(scan: GraphScan, view: StorageView, *, arrays: bool = True) -> ScanFacts:
    """Sort every candidate address of ``scan`` by what ``view`` says it is.

    Every word's range (the storage, allocator block or bare address it falls in) joins :attr:`ScanFacts.reads`.
    With ``arrays``, every storage a word locates in a model path, a registered input or output, or an unowned
    tensor is read for pointers, whatever its dtype, ``nn.Parameter`` or not: a kernel reading a pointer table
    reads what it points to, so the range of every aligned 8-byte word of it that :meth:`StorageView.locate` places
    in memory joins the reads too. Those indirect reads are not attributed (no finding names them); they only keep
    memory from being taken for unread.

    * A storage of at most :data:`POINTER_ARRAY_BYTES` is copied to host once (:func:`pointer_array_words`) and
      every word is located.
    * A larger one in a model path or an unowned tensor is searched on its own device (:func:`search_words`) for
      the words that fall in memory the reads found so far do not cover (:meth:`StorageView.unread_spans`), and
      only those are located: any other word is located in memory already read, or in none. A registered input
      or output this large is the engine's own data (the KV cache) and is not read.
    * A storage that cannot be read (no memory of its own) makes the scan incomplete: what it points to is unknown.
    """
    facts = ScanFacts(scan)
    counts = facts.counts
    freed_seen: set[int] = set()
    ranges: list[tuple[int, int]] = []
    small: dict[int, tuple[torch.Tensor, str]] = {}
    large: dict[int, tuple[torch.Tensor, str]] = {}
    for node in scan.nodes:
        label = node.name or node.kind
        for word in node.words():
            where = view.locate(word)
            counts[where.what] = counts.get(where.what, 0) + 1
            ranges.append((where.base, where.base + max(where.nbytes, 1)))
            seen = where.base in small or where.base in large
            if arrays and where.what in (MODEL, UNOWNED, IGNORED) and not seen:
                nbytes = _storage_bytes(where.storage)
                if nbytes is None:
                    _unknown(scan, label, where.base, "it has no memory of its own to read")
                elif 0 < nbytes <= POINTER_ARRAY_BYTES:
                    small[where.base] = (where.storage, label)
                elif nbytes > POINTER_ARRAY_BYTES and where.what != IGNORED:
                    large[where.base] = (where.storage, label)
            if where.what in (MODEL, UNOWNED):
                table = facts.model if where.what == MODEL else facts.unowned
                payload = where.storage
                key = id(payload.untyped_storage() if isinstance(payload, torch.Tensor) else payload)
                known = table.get(key)
                if known is None:
                    table[key] = (where.storage, where.offset, label)
                elif where.offset < known[1]:
                    table[key] = (known[0], where.offset, known[2])
            elif where.what == FREED and where.base not in freed_seen:
                freed_seen.add(where.base)
                facts.freed.append((where.base, where.nbytes, label))
    pointed: set[int] = set()
    for base, (tensor, label) in small.items():
        facts.arrays += 1
        try:
            pointed.update(pointer_array_words(tensor))
        except (RuntimeError, NotImplementedError) as exc:
            _unknown(scan, label, base, f"reading it failed ({exc})")
    indirect = list(_located(view, pointed))
    if large:
        # Searched against the memory the graph is not yet known to read (its own words, the small arrays' words).
        spans = view.unread_spans(ReadRanges([*ranges, *indirect]))
        found: set[int] = set()
        for base, (tensor, label) in large.items():
            facts.tables += 1
            try:
                found.update(search_words(tensor, spans))
            except (RuntimeError, NotImplementedError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                _unknown(scan, label, base, f"searching it on its device failed ({exc})")
        indirect.extend(_located(view, found - pointed))
    facts.indirect = len(indirect)
    ranges.extend(indirect)
    facts.reads = ReadRanges(ranges)
    return facts


def _located(view: StorageView, words: Iterable[int]) -> Iterator[tuple[int, int]]:
    """The range each word of a pointer table falls in, where :meth:`StorageView.locate` places it in memory."""
    for word in words:
        where = view.locate(word)
        if where.what == FOREIGN and not where.nbytes:
            continue  # an integer, or memory the allocator never handed out: no storage a model holds
        yield where.base, where.base + max(where.nbytes, 1)


def _unknown(scan: GraphScan, label: str, base: int, why: str) -> None:
    """Make ``scan`` incomplete: the storage at ``base`` a kernel points into cannot be read for pointers."""
    note = f"kernel {label!r} reads the storage at 0x{base:x}, which cannot be read for pointers ({why})"
    if note not in scan.incomplete:
        scan.incomplete.append(note)
