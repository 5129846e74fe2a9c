"""The dataflow recorder: which storages each storage was computed from, over one load and PWAL.

A :class:`Dataflow` is a ``TorchDispatchMode``. While it is active, every op that passes through torch's
dispatcher adds edges ``written storage <- read storage``: an op's new outputs are computed from the tensors it
read, and an argument it writes in place (``copy_``, ``mul_``, ``out=``) keeps what it was computed from before and
gains what the op read. Views alias storage, so they add nothing. Storages are nodes, keyed by identity and held
weakly (intermediates die during PWAL; their edges stay, so a chain through them is still followed).

:meth:`Dataflow.reads` then answers, for a tensor PWAL left in the model, which tensors the model holds that it
was (transitively) computed from: the walk goes back through intermediates and stops at storages the caller says
the model holds. The contract uses it to learn each derived slot's real inputs once, on a first reload.
:meth:`Dataflow.unwritten_bytes` says how much of a watched tensor (:meth:`Dataflow.watch`) the recorded writes left
unrefreshed (byte ranges per watched storage, a host bitmap once a write is strided or indexed), which tells a slot
PWAL rewrote whole from one it rewrote in part. A byte is refreshed once an op overwrites it (``copy_``, ``fill_``,
an indexed write, ``out=``) with values computed without reading an unrefreshed byte of the same storage; an op that
reads the values it writes (``mul_``, ``add_``, a custom op's mutable argument) refreshes nothing, so a no-op scale
after a partial write leaves the rest as old as it was; a write whose reach it cannot mark refreshes nothing either.
Values are followed through temporaries whole (a temporary holding some old bytes taints all it is copied into: fail
closed), through another storage object over a watched slot's memory (a DLPack or NumPy import), and across slots
(a slot written from another slot's old bytes that PWAL refreshes afterwards is not refreshed); not through Python
values (``.item()``, ``.tolist()``).

Like the capture manifest's dispatch recorder, it sees only ops that pass through the dispatcher, each only
through the tensors passed to it (a ``torch.library`` custom op that reads a table it is not passed hides that
read), and only on the thread that entered it.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

import torch
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from graphsafe.collectors._kernelscan import _span
from graphsafe.outcome import memory_tensors

__all__ = ["Dataflow"]

T = TypeVar("T")

_VIEW, _WRITE = 1, 2
#: Per overload: access by position (kind, argument name), by name, and the names of its ``out=`` arguments.
_SCHEMAS: dict[Any, tuple[dict[int, tuple[int, str]], dict[str, int], frozenset[str]]] = {}


def _schema_access(func: Any) -> tuple[dict[int, tuple[int, str]], dict[str, int], frozenset[str]]:
    """Which arguments ``func`` writes or only views, by position and by name, and which it writes as ``out=``
    results (cached per overload)."""
    cached = _SCHEMAS.get(func)
    if cached is None:
        positions: dict[int, tuple[int, str]] = {}
        names: dict[str, int] = {}
        outs: set[str] = set()
        schema = getattr(func, "_schema", None)
        for index, argument in enumerate(schema.arguments if schema is not None else ()):
            alias = argument.alias_info
            if alias is not None:
                kind = _WRITE if alias.is_write else _VIEW
                positions[index] = (kind, argument.name)
                names[argument.name] = kind
                if argument.is_out:
                    outs.add(argument.name)
        cached = _SCHEMAS[func] = (positions, names, frozenset(outs))
    return cached


def _tensors(value: Any) -> tuple[torch.Tensor, ...] | list[torch.Tensor]:
    """Tensors in an op argument or result: a tensor, or a (one level) list/tuple of optional tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, list | tuple):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return ()


#: Shared empty values: a recording makes a node per storage an op touches (thousands per reload), and every object
#: one keeps is one more for the cyclic GC to traverse.
_NO_STALE: frozenset[tuple[int, int]] = frozenset()


class _Node(weakref.ref):  # type: ignore[type-arg]  # (a weak reference to an untyped storage)
    """One storage seen during the recording: a weak reference to it (called, the storage or ``None``) that carries
    what the recording learnt about it. One object per storage rather than a node holding a reference: fewer objects
    for the cyclic GC. Compared and hashed by identity, whether its storage is alive or not."""

    __slots__ = ("aliases", "created", "sources", "stale", "written")
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __new__(cls, storage: Any, *, created: bool) -> _Node:
        return super().__new__(cls, storage)

    def __init__(self, storage: Any, *, created: bool) -> None:  # (``weakref.ref.__new__`` took ``storage``)
        # What its values were computed from: a frozenset shared with other nodes (the results of one op) until it
        # grows, then a set of its own.
        self.sources: frozenset[_Node] | set[_Node] = _NO_NODES
        self.created = created  # allocated during the recording
        self.written = False  # written in place during the recording
        # (id, generation) of each watched storage whose unrefreshed bytes its values were computed from (_Coverage).
        self.stale = _NO_STALE
        # Watched storages whose memory this other storage object overlaps (a DLPack or NumPy import), once asked.
        self.aliases: tuple[_Coverage, ...] | None = None

    def gain(self, sources: frozenset[_Node]) -> None:
        """Its values now also computed from ``sources`` (never from itself: an in-place write reads its own)."""
        if not sources:
            return
        if not self.sources and self not in sources:
            self.sources = sources  # shared (frozen) until it grows
            return
        if isinstance(self.sources, frozenset):
            self.sources = set(self.sources)
        self.sources |= sources
        self.sources.discard(self)

    def taint(self, stale: frozenset[tuple[int, int]]) -> None:
        """Its values now also computed from the unrefreshed bytes ``stale`` names."""
        if stale:
            self.stale = self.stale | stale if self.stale else stale


_NO_NODES: frozenset[_Node] = frozenset()


#: Contiguous in-place writes kept as byte ranges per watched storage; past this many, a bitmap takes over.
_MAX_SPANS = 1024
#: Argument names by which an in-place op writes only some elements of its destination.
_INDEXING = frozenset({"index", "indices", "mask"})
#: Ops that write through indices or a mask, and how to mark what they wrote: the same indexing applied to a bitmap.
_MARKED_BY_INDEX = frozenset(
    {"index_copy_", "index_fill_", "index_add_", "index_reduce_", "scatter_", "scatter_add_", "scatter_reduce_"}
)
_MARKED_BY_MASK = frozenset({"masked_fill_", "masked_scatter_"})
_MARKED_BY_INDICES = frozenset({"index_put_", "_index_put_impl_"})
#: In-place ops that overwrite what they reach without reading it (``accumulate``/``reduce`` variants excepted);
#: every other in-place op reads the values it writes.
_OVERWRITES = frozenset(
    {"copy_", "fill_", "zero_", "index_copy_", "index_fill_", "masked_fill_", "masked_scatter_", "put_", "scatter_"}
    | {"_foreach_copy_", "_foreach_zero_"}
    | _MARKED_BY_INDICES
    | {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
)


class _Coverage(weakref.ref):  # type: ignore[type-arg]  # (a weak reference to an untyped storage)
    """Which bytes of one watched storage the recorded writes refreshed: byte ranges while every refreshing write is
    contiguous, then a bitmap of its bytes on the host (strided and indexed writes mark exactly the bytes they
    reach, whatever the dtype of the view written through). Like a node, a weak reference to the storage (called,
    the storage or ``None``), compared and hashed by identity."""

    __slots__ = ("bitmap", "drawn", "generation", "spans", "unknown", "written")
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __init__(self, storage: Any) -> None:  # (``weakref.ref.__new__`` took ``storage``)
        self.spans: list[tuple[int, int]] = []
        self.bitmap: torch.Tensor | None = None
        self.written = False
        self.unknown = False  # a write whose reach the recorder could not mark: nothing in it is provably fresh
        self.generation = 0  # counts the writes that refreshed some of its bytes
        # Other watched storages (id -> generation when read) whose unrefreshed bytes a write here drew on.
        self.drawn: dict[int, int] = {}

    def note(
        self, func: Any, tensor: torch.Tensor, named: dict[str, Any], *, overwrite: bool, stale: bool, inner: bool
    ) -> None:
        """A recorded write of ``tensor`` (a view of this storage) by ``func``: an ``overwrite`` (it reads none of
        the values it writes) or not; ``stale``: its values were computed from unrefreshed bytes of this storage;
        ``inner``: ``tensor`` is a wrapper subclass's inner tensor the op reached through the wrapper."""
        if _metadata_only(func):
            return
        self.written = True
        if self.unknown or _writes_nothing(func):
            return
        if inner and _indexed(named):  # which of the inner tensor's elements the indices pick is not known
            self.unknown = True
            return
        if not stale and not overwrite:
            # It reads what it writes: an elementwise op leaves each element as fresh as it was, as a whole (an
            # element read through a wider dtype, a complex or float64 view, mixes its bytes); another (a cumulative
            # sum, an accumulating index op, a custom op) mixes them, so nothing it reached is fresh unless all was.
            if not self.unrefreshed(tensor):
                return
            if _pointwise(func):
                elements = self._bytes(tensor)
                elements.copy_(elements.all(-1, keepdim=True).expand_as(elements))
                return
            stale = True
        if not stale:
            self.generation += 1
        # Indices and masks pick elements of ``self`` only; an ``out=`` tensor is written whole.
        if named.get("self") is tensor and _indexed(named):
            elements = torch.zeros(tuple(tensor.shape), dtype=torch.bool)
            if not _mark(_op_name(func), elements, named):
                self.unknown = True
                return
            self._bytes(tensor)[elements] = not stale
            return
        span = _exact_span(tensor)
        if not stale and span is not None and self.bitmap is None and len(self.spans) < _MAX_SPANS:
            if span[1] > span[0]:
                self.spans.append(span)
            return
        self._bytes(tensor).fill_(not stale)

    def unrefreshed(self, tensor: torch.Tensor) -> bool:
        """Whether some byte of ``tensor`` (a view of this storage) is not refreshed (or that is not known)."""
        left = self.unwritten_bytes(tensor) if self.written else None
        return left is None or left > 0

    def unrefreshed_between(self, start: int, end: int) -> bool:
        """Whether some byte in ``[start, end)`` of this storage is not refreshed (or that is not known)."""
        if not self.written or self.unknown:
            return True
        if self.bitmap is None:
            reach = start
            for first, last in sorted(self.spans):
                if first > reach:
                    break
                reach = max(reach, last)
            return reach < end
        return not bool(self._grown(end)[start:end].all())

    def note_between(
        self, func: Any, start: int, end: int, named: dict[str, Any], *, overwrite: bool, stale: bool, exact: bool
    ) -> None:
        """A recorded write of bytes ``[start, end)`` of this storage through another storage object over its
        memory (a DLPack or NumPy import): ``exact``, every byte of the range written. Only a whole overwrite of
        new values refreshes; values from unrefreshed bytes, or an op mixing unrefreshed ones, unrefresh it."""
        if _metadata_only(func):
            return
        self.written = True
        if self.unknown or _writes_nothing(func):
            return
        if not stale and not overwrite:
            if not self.unrefreshed_between(start, end):
                return
            stale = True  # an elementwise op too: its elements' bytes here are not known
        if stale:
            self._bitmap(end)[start:end] = False
        elif exact and not _indexed(named):
            self.generation += 1
            if self.bitmap is None and len(self.spans) < _MAX_SPANS:
                self.spans.append((start, end))
            else:
                self._bitmap(end)[start:end] = True

    def _bitmap(self, end: int) -> torch.Tensor:
        """The bitmap (made now, holding the byte ranges so far), at least ``end`` bytes long."""
        if self.bitmap is None:
            storage = self()
            self.bitmap = torch.zeros(storage.nbytes() if storage is not None else 0, dtype=torch.bool)
            for first, last in self.spans:
                self._grown(last)[first:last] = True
            self.spans = []
        return self._grown(end)

    def _grown(self, end: int) -> torch.Tensor:
        """The bitmap, at least ``end`` bytes long (a storage can grow: ``resize_``; new bytes are unrefreshed)."""
        assert self.bitmap is not None
        if self.bitmap.numel() < end:
            grown = torch.zeros(end, dtype=torch.bool)
            grown[: self.bitmap.numel()] = self.bitmap
            self.bitmap = grown
        return self.bitmap

    def _bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s bytes in the bitmap (made now, holding the byte ranges so far), shaped ``[*shape, size]``."""
        bitmap = self._bitmap(_span(tensor)[1] if tensor.numel() else 0)
        size = tensor.element_size()
        shape = (*tuple(tensor.shape), size)
        stride = (*(int(step) * size for step in tensor.stride()), 1)
        return bitmap.as_strided(shape, stride, int(tensor.storage_offset()) * size)

    def unwritten_bytes(self, tensor: torch.Tensor) -> int | None:
        if not self.written:
            return None
        if self.unknown:  # nothing in it is provably refreshed
            start, end = _span(tensor) if tensor.numel() else (0, 0)
            return end - start
        if self.bitmap is None and _exact_span(tensor) is not None:
            start, end = _span(tensor)
            union, reach = 0, start  # the union of the recorded ranges, clipped to the span
            for first, last in sorted(self.spans):
                first, last = max(first, reach), min(last, end)
                if last > first:
                    union += last - first
                    reach = last
            return (end - start) - union
        # A tensor with gaps (one head of a fused buffer): its own bytes, not the ones between them.
        return int((~self._bytes(tensor)).sum())


def _op_name(func: Any) -> str:
    """An op's name without its overload (``copy_``), or a higher-order op's (``cond``)."""
    packet = getattr(func, "_overloadpacket", None)
    return str(packet.__name__) if packet is not None else str(getattr(func, "_name", ""))


def _pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in getattr(func, "tags", ())


def _writes_nothing(func: Any) -> bool:
    """An op whose ``out=`` (or ``self``) is left as it was: an allocation (``empty_like.out``, ``new_empty``)."""
    name = _op_name(func)
    return name.startswith(("empty", "new_empty"))


def _overwrites(func: Any, named: dict[str, Any], argument: str, outs: frozenset[str]) -> bool:
    """Whether ``func`` writes its argument ``argument`` without reading the values there: an ``out=`` result, or
    ``self`` of an in-place op that overwrites what it reaches (``copy_``, ``fill_``, an indexed copy). A custom op's
    mutable argument counts as read: nothing says it is not (``fused_add_rms_norm`` reads its own)."""
    if argument in outs:
        return True
    if argument != "self" or _op_name(func) not in _OVERWRITES:
        return False
    return not named.get("accumulate") and named.get("reduce") is None


def _replaces_whole(func: Any, tensor: torch.Tensor, named: dict[str, Any], overwrite: bool) -> bool:
    """Whether writing ``tensor`` by ``func`` replaces every byte of its storage without reading them."""
    if not overwrite or (named.get("self") is tensor and _indexed(named)):
        return False
    return _exact_span(tensor) == (0, tensor.untyped_storage().nbytes())


def _indexed(named: dict[str, Any]) -> bool:
    """Whether an op call picks the elements of ``self`` it writes by indices or a mask."""
    return any(isinstance(named.get(key), torch.Tensor | list | tuple) for key in _INDEXING)


_READS_VALUES: dict[Any, bool] = {}


def _reads_values(func: Any) -> bool:
    """Whether ``func`` reads its tensor arguments' values (``empty_like``, ``new_zeros`` read only their shape);
    cached per overload (asked of every op recorded)."""
    reads = _READS_VALUES.get(func)
    if reads is None:
        name = _op_name(func)
        reads = _READS_VALUES[func] = not (name.endswith("_like") or name.startswith("new_"))
    return reads


def _metadata_only(func: Any) -> bool:
    """An in-place op that changes a tensor's view of its memory, not the memory (``t_``, ``set_``, ``resize_``)."""
    return torch.Tag.inplace_view in getattr(func, "tags", ()) or _op_name(func) in ("set_", "resize_", "resize_as_")


def _host_index(value: Any) -> Any:
    """An index tensor as the host bitmap takes it (on the host, 64-bit); a mask on the host."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.cpu()
    return value if value.dtype is torch.bool else value.long()


def _mark(name: str, elements: torch.Tensor, named: dict[str, Any]) -> bool:
    """Mark in ``elements`` (one flag per element of the written tensor) what an indexed write ``name`` reached;
    ``False`` for an op this does not know."""
    if name in _MARKED_BY_INDEX:
        index = _host_index(named["index"])
        if name.startswith("scatter"):
            elements.scatter_(int(named["dim"]), index, True)
        else:
            elements.index_fill_(int(named["dim"]), index, True)
        return True
    if name in _MARKED_BY_MASK:
        elements.masked_fill_(_host_index(named["mask"]), True)
        return True
    if name in _MARKED_BY_INDICES:  # ``None`` stands for a whole dimension
        elements[tuple(slice(None) if index is None else _host_index(index) for index in named["indices"])] = True
        return True
    if name == "put_":
        elements.view(-1)[_host_index(named["index"]).reshape(-1)] = True
        return True
    return False


#: A tensor an op reads (strided: ``_parts``), its storage and that storage's node.
_Read = tuple[torch.Tensor, Any, _Node]


class Dataflow(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Records ``written <- read`` edges between storages while active. ``paused`` lets ops through unrecorded
    (the contract's own snapshot and copies run inside the recording)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.paused = False
        self.abandoned = False  # stopped where it could not leave the stack: inert there until popped
        self._nodes: dict[int, _Node] = {}  # id(storage) -> node; the weak reference confirms the id
        self._watched: dict[int, _Coverage] = {}  # id(storage) -> what in-place writes reached (see watch())
        # id(tensor) -> (the tensor, weakly; stale) of results followed by object (sparse, mkldnn; see _outputs).
        self._opaque: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[tuple[int, int]]]] = {}
        # The watched storages by device, sorted by start address, and the longest (see _watched_over).
        self._index: dict[str, tuple[list[int], list[tuple[int, int, _Coverage]], int]] | None = None

    _prepared: ClassVar[bool] = False
    #: Higher-order ops (``torch.cond``) come to ``__torch_dispatch__`` too, rather than raising into the user's code.
    supports_higher_order_operators = True

    @classmethod
    def prepare(cls) -> float:
        """Pay torch's one-time cost of a Python dispatch mode now, outside any recording: the first op a process
        dispatches to such a mode imports torch's compiler stack (``torch._dynamo``, seconds on a CPU). Returns the
        seconds it took, 0.0 once paid; callers report it as one-time set-up, apart from a reload's own time."""
        if cls._prepared:
            return 0.0
        start = time.perf_counter()
        mode = cls()
        mode.paused = True
        with mode:
            torch.zeros(1).add_(1)
        cls._prepared = True
        return time.perf_counter() - start

    def stop(self) -> bool:
        """End the recording on the thread that began it: leave the dispatch-mode stack where it is on top (and drop
        the abandoned recordings that surface under it); under a mode entered after it and still open (two
        contracts' reloads interleaved), it cannot leave without taking that one off: it is abandoned there.
        Returns whether it recorded until now: ``False`` where something else took it off the stack (a mode entered
        before it and exited while it was open pops it), so that what it holds is a part only."""
        stack = _python_dispatch._get_current_dispatch_mode_stack()
        if stack and stack[-1] is self:
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            Dataflow.drop_abandoned()
            return True
        self.abandon()
        return any(mode is self for mode in stack)

    def abandon(self) -> None:
        """Stop recording without leaving the stack (another thread's, or under another mode): inert from now on,
        popped by :meth:`drop_abandoned` once it is on top of its thread's stack."""
        self.paused = True
        self.abandoned = True

    @staticmethod
    def drop_abandoned() -> None:
        """Pop the abandoned recordings on top of this thread's dispatch-mode stack (each reload that stops one from
        another thread would otherwise leave a mode every op of this thread passes through)."""
        while True:
            top = _python_dispatch._get_current_dispatch_mode()
            if not (isinstance(top, Dataflow) and top.abandoned):
                return
            top.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        positions, names, outs = _schema_access(func)
        read: list[_Read] = []
        written: list[tuple[torch.Tensor, str, bool]] = []
        opaque: list[torch.Tensor] = []
        argument_storages: set[int] = set()
        for index, value in enumerate(args):
            access, name = positions.get(index, (0, ""))
            for tensor in _tensors(value):
                self._sort(tensor, access, name, read, written, opaque, argument_storages)
        for key, value in kwargs.items():
            access = names.get(key, 0)
            for tensor in _tensors(value):
                self._sort(tensor, access, key, read, written, opaque, argument_storages)
        stale = self._stale_reads(func, read, opaque) if self._watched else _NO_STALE
        out = func(*args, **kwargs)
        sources = self._sources(read)
        named: dict[str, Any] | None = None
        for tensor, argument, inner in written:
            storage = tensor.untyped_storage()
            node = self._node_of(storage, created=False)
            watched = self._coverage_of(storage)
            aliases = self._aliases(node, storage) if self._watched and watched is None else ()
            node.written = True
            node.gain(sources)
            if not (node.stale or stale or watched is not None or aliases):
                continue
            named = named if named is not None else _named(func, args, kwargs)
            overwrite = _overwrites(func, named, argument, outs)
            if node.stale and _replaces_whole(func, tensor, named, overwrite):
                node.stale = stale  # all its values are this op's now
            else:
                node.taint(stale)
            if watched is not None:
                self._note(watched, func, tensor, named, overwrite, stale, inner)
            for alias in aliases:
                self._note(alias, func, tensor, named, overwrite, stale, inner, alias=True)
        self._outputs(out, sources, stale, argument_storages)
        return out

    def _outputs(
        self, out: Any, sources: frozenset[_Node], stale: frozenset[tuple[int, int]], argument_storages: set[int]
    ) -> None:
        """Nodes for an op's new results (a wrapper subclass's inner tensors), computed from ``sources``; a result
        the recorder follows by object (sparse, mkldnn) keeps ``stale`` too."""
        for tensor in _tensors(out):
            parts = _parts(tensor)
            if parts is None:
                if stale:
                    self._opaque[id(tensor)] = (weakref.ref(tensor), stale)
                continue
            for part in parts:
                storage = part.untyped_storage()
                if id(storage) not in argument_storages:
                    node = self._node_of(storage, created=True)
                    node.gain(sources)
                    node.taint(stale)

    def _higher_order(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A higher-order op (``torch.cond``, ``map``): its body runs unseen. Every tensor passed counts as read and
        what it returns as computed from all of them; one that may write what it is passed (a mutation wrapper)
        leaves nothing watched it was passed provably fresh."""
        read: list[_Read] = []
        written: list[tuple[torch.Tensor, str, bool]] = []
        opaque: list[torch.Tensor] = []
        argument_storages: set[int] = set()
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._sort(leaf, 0, "", read, written, opaque, argument_storages)
        stale = self._stale_reads(func, read, opaque) if self._watched else _NO_STALE
        if any(word in _op_name(func) for word in ("mutation", "functionalize", "effects")):
            for _, storage, node in read:
                coverage = self._coverage_of(storage)
                if coverage is not None:
                    coverage.written = coverage.unknown = True
                for alias in self._aliases(node, storage) if self._watched else ():
                    alias.written = alias.unknown = True
        out = func(*args, **kwargs)
        self._outputs(pytree.tree_leaves(out), self._sources(read), stale, argument_storages)
        return out

    def _note(
        self,
        coverage: _Coverage,
        func: Any,
        tensor: torch.Tensor,
        named: dict[str, Any],
        overwrite: bool,
        stale: frozenset[tuple[int, int]],
        inner: bool,
        *,
        alias: bool = False,
    ) -> None:
        """Count a write into a watched storage: through one of its own views, or (``alias``) through another storage
        object over its memory, on the bytes of it the write reaches. Where the values drew on another watched
        storage's unrefreshed bytes, remember that storage's generation (a later refresh of it makes them old)."""
        other = coverage()
        if other is None or (alias and not tensor.numel()):
            return
        own = id(other)
        own_stale = any(key == own for key, _ in stale)
        try:
            if not alias:
                coverage.note(func, tensor, named, overwrite=overwrite, stale=own_stale, inner=inner)
            else:
                first, last = _span(tensor)
                shift = tensor.untyped_storage().data_ptr() - other.data_ptr()
                start, end = max(first + shift, 0), min(last + shift, other.nbytes())
                if start < end:
                    exact = _exact_span(tensor) is not None  # no gaps, clipped to the watched storage or not
                    coverage.note_between(func, start, end, named, overwrite=overwrite, stale=own_stale, exact=exact)
        except Exception:  # the user's op went through; what it reached is not known
            coverage.unknown = True
            coverage.written = coverage.written or alias
        self._drawn(coverage, own, stale)

    @staticmethod
    def _drawn(coverage: _Coverage, own: int, stale: frozenset[tuple[int, int]]) -> None:
        for key, generation in stale:
            if key != own:
                coverage.drawn[key] = min(generation, coverage.drawn.get(key, generation))

    def _stale_reads(self, func: Any, read: list[_Read], opaque: list[torch.Tensor]) -> frozenset[tuple[int, int]]:
        """``(id, generation)`` of each watched storage whose unrefreshed bytes ``func`` reads, directly, through
        another storage object over the same memory, or through values computed from them (a sparse or mkldnn
        tensor's followed by object)."""
        if not (read or opaque) or not _reads_values(func):
            return _NO_STALE
        stale: set[tuple[int, int]] = set()
        for tensor in opaque:
            held = self._opaque.get(id(tensor))
            if held is not None and held[0]() is tensor:
                stale |= held[1]
        try:
            for tensor, storage, node in read:
                if node.stale:
                    stale |= {entry for entry in node.stale if entry[0] != id(storage)}  # its own: coverage tells
                coverage = self._coverage_of(storage)
                if coverage is not None:
                    if coverage.unrefreshed(tensor):
                        stale.add((id(storage), coverage.generation))
                elif tensor.numel() and self._aliases(node, storage):
                    first, last = _span(tensor)
                    for alias in self._aliases(node, storage):
                        other = alias()
                        if other is None:
                            continue
                        shift = storage.data_ptr() - other.data_ptr()  # the read's bytes, where ``other`` starts
                        start, end = max(first + shift, 0), min(last + shift, other.nbytes())
                        if start < end and alias.unrefreshed_between(start, end):
                            stale.add((id(other), alias.generation))
        except Exception:  # what it read is not known: nothing watched is provably fresh from here on
            for coverage in self._watched.values():
                coverage.unknown = True
        return frozenset(stale) if stale else _NO_STALE

    def _coverage_of(self, storage: Any) -> _Coverage | None:
        """The account of a watched storage, or ``None`` (not watched, or its id now names another storage)."""
        coverage = self._watched.get(id(storage))
        return coverage if coverage is not None and coverage() is storage else None

    def _aliases(self, node: _Node, storage: Any) -> tuple[_Coverage, ...]:
        """The watched storages whose memory ``storage`` (another storage object) overlaps, asked once per node."""
        if node.aliases is None:
            # memory allocated while recording is no watched storage's
            node.aliases = () if node.created else self._watched_over(storage)
        return node.aliases

    def _watched_over(self, storage: Any) -> tuple[_Coverage, ...]:
        """The watched storages (not ``storage`` itself) whose memory overlaps ``storage``'s: by address, through an
        index of the watched storages sorted by where they start (made again after :meth:`watch`)."""
        if self._index is None:
            index: dict[str, list[tuple[int, int, _Coverage]]] = {}
            for coverage in self._watched.values():
                other = coverage()
                start = _address(other) if other is not None else None
                if other is not None and start is not None:
                    index.setdefault(str(other.device), []).append((start, start + other.nbytes(), coverage))
            for entries in index.values():
                entries.sort(key=lambda entry: entry[0])
            self._index = {
                device: ([e[0] for e in entries], entries, max(e[1] - e[0] for e in entries))
                for device, entries in index.items()
            }
        found = self._index.get(str(storage.device))
        first = _address(storage)
        if found is None or first is None:
            return ()
        starts, entries, longest = found
        end = first + storage.nbytes()
        overlapping = []
        position = bisect.bisect_left(starts, end) - 1
        while position >= 0 and starts[position] + longest > first:
            start, stop, coverage = entries[position]
            if start < end and first < stop and coverage() is not storage:
                overlapping.append(coverage)
            position -= 1
        return tuple(overlapping)

    def _sort(
        self,
        tensor: torch.Tensor,
        access: int,
        argument: str,
        read: list[_Read],
        written: list[tuple[torch.Tensor, str, bool]],
        opaque: list[torch.Tensor],
        seen: set[int],
    ) -> None:
        """File an op's tensor argument under what the op does to it: its memory (a wrapper subclass's inner
        tensors) read or written, or a tensor followed by object (sparse, mkldnn). A read one's node is found now,
        once for the op (the op cannot give a tensor it only reads another storage)."""
        parts = _parts(tensor)
        if parts is None:
            if access != _VIEW:
                opaque.append(tensor)
            return
        inner = len(parts) != 1 or parts[0] is not tensor  # identity: == on tensors compares values
        for part in parts:
            storage = part.untyped_storage()
            seen.add(id(storage))
            if access == _WRITE:
                written.append((part, argument, inner))
            elif access != _VIEW:
                read.append((part, storage, self._node_of(storage, created=False)))

    @staticmethod
    def _sources(read: list[_Read]) -> frozenset[_Node]:
        """The nodes of the storages an op read."""
        return frozenset([node for _, _, node in read]) if read else _NO_NODES

    def _node_of(self, storage: Any, *, created: bool) -> _Node:
        """The node of a strided tensor's storage (made now if unseen)."""
        node = self._nodes.get(id(storage))
        if node is None or node() is not storage:  # unseen, or the id now names another storage
            node = self._nodes[id(storage)] = _Node(storage, created=created)
        return node

    def updated(self, tensor: Any) -> bool:
        """Whether ``tensor`` (any value) is a tensor whose storage was allocated or written in place while
        recording."""
        if not _strided(tensor):
            return False
        storage = tensor.untyped_storage()
        node = self._nodes.get(id(storage))
        return node is not None and node() is storage and (node.created or node.written)

    def watch(self, tensors: Iterable[Any]) -> None:
        """Keep, from now on, which elements of each of ``tensors``' storages in-place writes reach
        (:meth:`unwritten_bytes`); other storages keep no such account."""
        for tensor in tensors:
            for part in (_parts(tensor) or []) if isinstance(tensor, torch.Tensor) else ():
                storage = part.untyped_storage()
                if self._coverage_of(storage) is None:
                    self._watched[id(storage)] = _Coverage(storage)
                    self._index = None

    def unwritten_bytes(self, tensor: torch.Tensor) -> int | None:
        """How many bytes of ``tensor`` the writes recorded on its storage since :meth:`watch` left unrefreshed
        (0: it was rewritten whole), or ``None`` where that is unknown: its storage not watched or not written in
        place while recording, or written by an indexed op the recorder cannot mark. A strided write (``s[::2]``, a
        column block) and an indexed one (``index_copy_``, ``scatter_``, a masked or boolean-indexed assignment,
        ``put_``) refresh the elements they reach; an op that reads the values it writes (``mul_``, ``index_add_``)
        or writes values computed from unrefreshed bytes of the same storage (``s.copy_(s * 1)``) refreshes
        nothing, and an op that changes only the view (``t_``, ``set_``) marks nothing. Writes the dispatcher never
        sees (a NumPy view, a raw kernel) are not counted. A wrapper subclass's are its inner tensors' together."""
        parts = _parts(tensor) if isinstance(tensor, torch.Tensor) else None
        if not parts:
            return None
        if len(parts) != 1 or parts[0] is not tensor:
            found = [self.unwritten_bytes(part) for part in parts]
            if all(left is None for left in found):
                return None
            # an inner tensor nothing wrote while another was written: none of its bytes refreshed
            return sum(_nbytes(part) if left is None else left for part, left in zip(parts, found, strict=True))
        coverage = self._coverage_of(tensor.untyped_storage())
        if coverage is None:
            return None
        for key, generation in coverage.drawn.items():
            other = self._watched.get(key)
            if other is not None and other.generation > generation:
                # computed from another slot's bytes that were refreshed afterwards: all of it is suspect
                start, end = _span(tensor) if tensor.numel() else (0, 0)
                return end - start
        return coverage.unwritten_bytes(tensor)

    def reads(self, tensor: torch.Tensor, held: Callable[[Any], T | None]) -> list[T]:
        """What ``tensor`` was computed from during the recording, as the model holds it.

        Walks back from ``tensor``'s storage through every recorded edge; a storage for which ``held(storage)``
        is not ``None`` is an input (its value is returned, once) and the walk stops there. ``tensor``'s own
        storage is never its own input. Empty when no recorded op wrote or allocated ``tensor``'s storage.
        """
        if not _strided(tensor):
            return []
        storage = tensor.untyped_storage()
        start = self._nodes.get(id(storage))
        if start is None or start() is not storage:
            return []
        found: list[T] = []
        seen_values: set[int] = set()
        visited = {start}
        stack = list(start.sources)
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            alive = node()
            value = held(alive) if alive is not None else None
            if value is not None:
                if id(value) not in seen_values:
                    seen_values.add(id(value))
                    found.append(value)
                continue
            stack.extend(node.sources)
        return found


def _named(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op call's arguments by their schema names."""
    schema = getattr(func, "_schema", None)
    named = dict(kwargs)
    for argument, value in zip(schema.arguments if schema is not None else (), args, strict=False):
        named[argument.name] = value
    return named


def _exact_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage a strided tensor spans (``_kernelscan._span``) where a write to it writes every one
    of them (no gaps, no repeated element), else ``None``."""
    if tensor.numel() == 0:
        return 0, 0
    if 0 in tensor.stride() and tensor.numel() > 1:
        return None
    start, end = _span(tensor)
    return (start, end) if end - start == tensor.numel() * tensor.element_size() else None


def _parts(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The strided tensors whose memory ``tensor`` is: itself, or a wrapper subclass's inner tensors (a nested
    jagged tensor's values); ``None`` for one the recorder follows by object instead (sparse, mkldnn)."""
    if type(tensor) not in _PLAIN and is_traceable_wrapper_subclass(tensor):
        return [part for part in memory_tensors(tensor) if _strided(part)]
    return [tensor] if _strided(tensor) else None


def _address(storage: Any) -> int | None:
    """Where a storage's memory starts, or ``None`` for one with none to read (a wrapper subclass's own storage)."""
    try:
        return int(storage.data_ptr())
    except RuntimeError:
        return None


def _nbytes(tensor: torch.Tensor) -> int:
    start, end = _span(tensor) if tensor.numel() else (0, 0)
    return end - start


#: Tensor types that are no wrapper subclass and read their device from their own TensorImpl (no
#: ``__torch_function__`` of their own): ``is_meta`` says what ``device.type`` would without making a device object.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _strided(tensor: Any) -> bool:
    if type(tensor) in _PLAIN:
        return tensor.layout is torch.strided and not tensor.is_meta
    return isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and tensor.device.type != "meta"
