"""Plain-PyTorch adapter: capture ``torch.cuda.graph``\\ s under a contract, reload, recapture when needed.

For code that captures CUDA graphs itself (an RL loop, a custom server)::

    contract = GraphContract(model, "recapture")
    graph = capture(contract, model, static_x)          # warm-up, seal, capture (cuda_graph: kernel scan)
    for step in ...:
        run_reload(contract, lambda: load_new_weights(model))  # recaptures by itself when the reload needs it
        static_x.copy_(batch)
        y = graph.replay()                              # the same output tensors every time

Each :class:`CapturedGraph` registers itself with :meth:`GraphContract.on_recapture`, so a ``NEEDS_RECAPTURE``
outcome re-runs warm-up and capture for every graph the adapter owns before the contract reseals. The output
tensors are allocated once, outside the graph's pool, and the graph copies its result into them: references to
``graph.output`` stay valid across recaptures.

Without CUDA (or with CPU inputs) the adapter runs in a no-graph fallback: "replay" calls ``fn`` eagerly on the
static inputs and copies into the static output. The control flow (seal, record, reload, recapture, refusal) is the
same, which is what CPU tests cover; the fallback cannot show staleness, since eager calls read current tensors.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphsafe.collectors import cuda_graph, record_capture
from graphsafe.contract import Agreement, GraphContract, Mode
from graphsafe.errors import GraphSafeError, NotServingSafeError, hide_frames_in_pytest
from graphsafe.handles import RemovableHandle
from graphsafe.outcome import ReloadOutcome

__all__ = ["CapturedGraph", "GraphRunner", "capture", "recapture_and_reseal", "run_reload"]

#: pytest shows the caller's line and graphsafe's message, not this module's frames.
__tracebackhide__ = hide_frames_in_pytest

_NAMES = itertools.count()

#: The graphs captured under each contract by this adapter (weakly: a closed or collected graph drops out).
_GRAPHS: weakref.WeakKeyDictionary[GraphContract, weakref.WeakSet[CapturedGraph]] = weakref.WeakKeyDictionary()


class CapturedGraph:
    """``fn(*static_inputs)`` captured as a CUDA graph (or its eager fallback), kept valid under a contract.

    Build it with :func:`capture` or :meth:`GraphRunner.capture`. Copy new data into :attr:`static_inputs`, call
    :meth:`replay`, read :attr:`output`.
    """

    def __init__(
        self,
        contract: GraphContract,
        fn: Callable[..., Any],
        static_inputs: Sequence[torch.Tensor],
        *,
        warmup: int = 3,
        name: str | None = None,
        use_graph: bool | None = None,
    ) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.contract = contract
        self.fn = fn
        self.static_inputs: tuple[torch.Tensor, ...] = tuple(static_inputs)
        self.warmup = warmup
        self.name = name if name is not None else f"{getattr(fn, '__qualname__', type(fn).__name__)}#{next(_NAMES)}"
        # The manifest keeps one capture per name (a recapture replaces it): a second open graph under the same
        # name would replace, and on close discard, this one's reads. Each graph records under a key of its own.
        taken = {g._key for g in _GRAPHS.get(contract, ()) if not g._closed}
        self._key: str = self.name
        while self._key in taken:
            self._key = f"{self.name}#{next(_NAMES)}"
        self.device = _device_of(self.static_inputs, fn)
        cuda = self.device.type == "cuda"
        if use_graph is None:
            use_graph = cuda and torch.cuda.is_available()
        elif use_graph and not (cuda and torch.cuda.is_available()):
            raise GraphSafeError(
                f"graph {self.name!r}: use_graph=True needs CUDA and CUDA inputs (inputs are on {self.device})"
            )
        if use_graph and warmup < 1:
            raise ValueError(f"graph {self.name!r}: a CUDA graph capture needs warmup >= 1 (side-stream warm-up)")
        self.uses_graph: bool = use_graph
        #: How many times this graph was captured (1 after :func:`capture`, +1 per recapture).
        self.captures = 0
        self._generation = 0  # the contract's capture generation at this graph's last capture
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out_spec: pytree.TreeSpec | None = None
        self._out_leaves: list[torch.Tensor] = []
        self._output: Any = None
        self._handle: RemovableHandle | None = None
        self._closed: bool = False

    # -- public ------------------------------------------------------------------------------------------------
    @property
    def output(self) -> Any:
        """The static output (same tensors, same structure as ``fn`` returns), valid after each replay."""
        if self._out_spec is None:
            raise GraphSafeError(f"graph {self.name!r} has not been captured yet")
        return self._output

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The underlying ``torch.cuda.CUDAGraph`` (``None`` in the no-graph fallback)."""
        return self._graph

    def replay(self) -> Any:
        """Run the graph on the current static inputs; returns :attr:`output`.

        Refuses (:class:`~graphsafe.NotServingSafeError`) while the contract is not serving-safe: the graph would
        read stale or freed memory.
        """
        if self._closed:
            raise GraphSafeError(f"graph {self.name!r} was closed")
        contract = self.contract
        if not contract.serving_safe:
            raise NotServingSafeError(
                f"refusing to replay graph {self.name!r}: {contract.unsafe_reason}; next step: once the weights are "
                "good, graph.recapture_and_reseal() (recapture, then reseal)",
                contract.last_outcome,
            )
        if self._generation <= contract.invalidated_at:
            # A reseal after another graph's recapture makes the contract safe, not this graph: it still reads
            # the storage of before the reload that left the contract unsafe.
            raise NotServingSafeError(
                f"refusing to replay graph {self.name!r}: it was captured before a reload that left the contract "
                "unsafe and not captured since; next step: graph.recapture() (or graph.recapture_and_reseal())",
                contract.last_outcome,
            )
        if self.uses_graph:
            if self._graph is None:
                raise GraphSafeError(f"graph {self.name!r} has no captured graph (its last capture failed)")
            self._graph.replay()
        else:
            with torch.no_grad():
                result = self.fn(*self.static_inputs)
            self._copy_out(result)
        return self._output

    def recapture(self, *, reindex: bool = True) -> None:
        """Warm up and capture again (after a reload that moved what the old graph reads).

        This graph only; the contract stays not serving-safe until it is resealed. :meth:`recapture_and_reseal`
        is the way back after a failed reload.
        """
        if self._closed:
            raise GraphSafeError(f"graph {self.name!r} was closed")
        self._capture(reindex=reindex)

    def recapture_and_reseal(self) -> GraphContract:
        """The way back after a failed reload (once the weights are good again): capture every open graph of this
        graph's contract again, then reseal it. Returns the contract, serving-safe again.

        Every graph of the contract, not only this one: a reseal after recapturing some of them would make the
        contract call the others safe while they still read the storage of before the reload.
        """
        if self._closed:
            raise GraphSafeError(f"graph {self.name!r} was closed")
        return recapture_and_reseal(self.contract)

    def close(self) -> None:
        """Drop the graph, stop recapturing it, and forget its manifest entries (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            _forget(self._handle, weakref.ref(self.contract), self._key)
        self._graph = None

    def __repr__(self) -> str:
        kind = "cuda graph" if self.uses_graph else "eager fallback"
        return f"<CapturedGraph {self.name!r} ({kind}) captures={self.captures}>"

    # -- capture -----------------------------------------------------------------------------------------------
    def _start(self) -> CapturedGraph:
        self._capture(reindex=True)
        _GRAPHS.setdefault(self.contract, weakref.WeakSet()).add(self)
        # The contract holds the callback weakly: a strong bound method would make a reference cycle, and a cycle
        # collected by the GC in the middle of some later capture would destroy this graph there and invalidate it.
        self._handle = self.contract.on_recapture(_WeakRecapture(self))
        weakref.finalize(self, _forget, self._handle, weakref.ref(self.contract), self._key)
        return self

    def _on_recapture(self, outcome: ReloadOutcome) -> None:
        # The contract reseals right after its callbacks, and the reseal indexes the manifest.
        self._capture(reindex=False)

    def _capture(self, *, reindex: bool) -> None:
        inputs = self.static_inputs
        with torch.no_grad():
            result = self._warm_up()
            contract = self.contract
            if not contract.sealed:
                # Seal after warm-up: tensors the first forward allocates (scratch) are then in place.
                contract.seal()
            if result is not None:
                self._ensure_output(result)
            ignore = [*inputs, *self._out_leaves]
            if self.uses_graph:
                self._graph = None  # free the old graph's pool before capturing the new one
                # A keep_graph graph captured with nothing active, then kernel-scanned; where the scan is
                # unavailable (no cuda-bindings), the dispatch recorder instead, with a one-line warning and note.
                with cuda_graph(contract, name=self._key, ignore=ignore, reindex=reindex, fallback="dispatch") as graph:
                    self._copy_out(self.fn(*inputs))
                self._graph = graph
            else:
                with record_capture(contract, name=self._key, ignore=ignore, reindex=reindex):
                    result = self.fn(*inputs)
                self._ensure_output(result)
                self._copy_out(result)
        self.captures += 1
        self._generation = self.contract.captures  # the capture was reported to the contract

    def _warm_up(self) -> Any:
        """Run ``fn`` ``warmup`` times (on a side stream for CUDA graphs, as torch requires); the last result."""
        result: Any = None
        if self.warmup == 0:
            return None
        if not self.uses_graph:
            for _ in range(self.warmup):
                result = self.fn(*self.static_inputs)
            return result
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                result = self.fn(*self.static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return result

    def _ensure_output(self, result: Any) -> None:
        leaves, spec = pytree.tree_flatten(result)
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            kinds = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
            raise GraphSafeError(
                f"graph {self.name!r}: fn must return tensors (nested in tuples/lists/dicts), got {', '.join(kinds)}"
            )
        if self._out_spec is None:
            self._out_leaves = [torch.empty_like(leaf) for leaf in leaves]
            self._out_spec = spec
            self._output = pytree.tree_unflatten(list(self._out_leaves), spec)
            return
        same = spec == self._out_spec and all(
            (leaf.shape, leaf.dtype, leaf.device) == (out.shape, out.dtype, out.device)
            for leaf, out in zip(leaves, self._out_leaves, strict=True)
        )
        if not same:
            raise GraphSafeError(
                f"graph {self.name!r}: fn's output changed structure, shape, dtype or device since the first capture; "
                "its static output cannot be kept (capture a new graph instead)"
            )

    def _copy_out(self, result: Any) -> None:
        leaves = pytree.tree_leaves(result)
        if len(leaves) != len(self._out_leaves):
            raise GraphSafeError(
                f"graph {self.name!r}: fn returned {len(leaves)} tensors, expected {len(self._out_leaves)}"
            )
        for out, leaf in zip(self._out_leaves, leaves, strict=True):
            out.copy_(leaf)


class _WeakRecapture:
    """A recapture callback that does not keep its graph alive."""

    __slots__ = ("_graph",)

    def __init__(self, graph: CapturedGraph) -> None:
        self._graph = weakref.ref(graph)

    def __call__(self, outcome: ReloadOutcome) -> None:
        graph = self._graph()
        if graph is not None and not graph._closed:
            graph._on_recapture(outcome)

    def __repr__(self) -> str:
        return f"<recapture of {self._graph()!r}>"


def _forget(handle: RemovableHandle, contract_ref: weakref.ReferenceType[GraphContract], name: str) -> None:
    """Unregister a graph that was closed or collected, and drop its capture from the manifest."""
    handle.remove()
    contract = contract_ref()
    discard = getattr(contract.manifest if contract is not None else None, "discard", None)
    if callable(discard):
        discard(name)


def _device_of(inputs: Sequence[torch.Tensor], fn: Callable[..., Any]) -> torch.device:
    for tensor in inputs:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"static inputs must be tensors, got {type(tensor).__name__}")
    if inputs:
        return inputs[0].device
    if isinstance(fn, nn.Module):
        for tensor in itertools.chain(fn.parameters(), fn.buffers()):
            return tensor.device
    return torch.device("cpu")


def capture(
    contract: GraphContract,
    fn: Callable[..., Any],
    static_inputs: torch.Tensor | Sequence[torch.Tensor] = (),
    *,
    warmup: int = 3,
    name: str | None = None,
    use_graph: bool | None = None,
) -> CapturedGraph:
    """Warm up ``fn(*static_inputs)``, seal the contract if needed, and capture it, recording what it reads.

    On CUDA the graph is captured by :func:`~graphsafe.cuda_graph` (nothing active during the capture, then the
    kernel scan); where the kernel scan is unavailable (no cuda-bindings) by its explicit ``fallback="dispatch"``,
    with a one-line warning. In the no-graph fallback the eager call runs under :func:`record_capture`.

    Args:
        contract: the model's contract; its manifest records what the graph touches, and a reload that needs a
            recapture re-captures this graph.
        fn: the callable to capture (typically the model); runs under ``torch.no_grad()``.
        static_inputs: the input tensors the graph reads (copy new data into them before each replay).
        warmup: eager runs before capture (on a side stream for CUDA graphs); lazy allocations happen here.
        name: the capture's name in the manifest (default: ``fn``'s qualified name and a number).
        use_graph: ``None``: a CUDA graph when CUDA is available and the inputs are on it, else the eager
            fallback; ``True`` insists on a CUDA graph; ``False`` forces the fallback.
    """
    inputs = (static_inputs,) if isinstance(static_inputs, torch.Tensor) else tuple(static_inputs)
    return CapturedGraph(contract, fn, inputs, warmup=warmup, name=name, use_graph=use_graph)._start()


def recapture_and_reseal(contract: GraphContract) -> GraphContract:
    """Capture every open graph this adapter captured under ``contract`` again, then reseal it; returns it.

    The way back after a strict-mode violation or a failed reload, once the model holds good weights again: the
    recaptures are the evidence :meth:`GraphContract.reseal` needs. Raises :class:`~graphsafe.GraphSafeError`
    when no open graph of this adapter reads the contract's model (recapture your own graphs, call
    ``contract.note_capture()``, then ``contract.reseal()``).
    """
    graphs = sorted((g for g in _GRAPHS.get(contract, ()) if not g._closed), key=lambda g: g.name)
    if not graphs:
        raise GraphSafeError(
            "recapture_and_reseal: no open graph of graphsafe.capture reads this contract's model; recapture your "
            "own graphs, call contract.note_capture(), then contract.reseal()"
        )
    for graph in graphs:
        graph.recapture(reindex=False)
    return contract.reseal()


def run_reload(
    contract: GraphContract, load_fn: Callable[[], object], *, agreement: Agreement | None = None
) -> ReloadOutcome:
    """Run ``load_fn()`` (load new weights, PWAL) as one reload under ``contract``; returns the outcome.

    ``COMMITTED``: every captured address was kept. ``NEEDS_RECAPTURE``: the adapter's graphs were captured again
    and the contract resealed before this returns. Strict-mode findings raise a
    :class:`~graphsafe.ContractViolation`; an error in ``load_fn`` is re-raised (the contract is then not
    serving-safe and replays are refused). ``agreement``: see :meth:`GraphContract.reload`.
    """
    with contract.reload(agreement=agreement) as txn:
        load_fn()
    if txn.outcome is None:  # pragma: no cover - finish() always sets it unless it raised
        raise GraphSafeError("the reload transaction ended without an outcome")
    return txn.outcome


class GraphRunner(AbstractContextManager["GraphRunner"]):
    """A model, its contract, and the graphs captured for it.

    ``GraphRunner(model)`` makes a ``recapture``-mode contract; pass ``contract=`` (or ``mode=``) to choose.
    Use as a context manager to close every graph on exit.
    """

    def __init__(
        self,
        model: nn.Module,
        contract: GraphContract | None = None,
        *,
        mode: Mode = "recapture",
        warmup: int = 3,
        use_graph: bool | None = None,
    ) -> None:
        if contract is None:
            contract = GraphContract(model, mode)
        elif contract.model is not model:
            raise GraphSafeError("GraphRunner: the contract belongs to another model")
        self.model = model
        self.contract = contract
        self.warmup = warmup
        self.use_graph = use_graph
        self._graphs: list[CapturedGraph] = []

    @property
    def graphs(self) -> tuple[CapturedGraph, ...]:
        """The open graphs."""
        return tuple(g for g in self._graphs if not g._closed)

    def capture(
        self,
        static_inputs: torch.Tensor | Sequence[torch.Tensor] = (),
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        warmup: int | None = None,
    ) -> CapturedGraph:
        """Capture ``fn`` (default: the model) on ``static_inputs``; see :func:`capture`."""
        graph = capture(
            self.contract,
            fn if fn is not None else self.model,
            static_inputs,
            warmup=self.warmup if warmup is None else warmup,
            name=name,
            use_graph=self.use_graph,
        )
        self._graphs.append(graph)
        return graph

    def run_reload(self, load_fn: Callable[[], object], *, agreement: Agreement | None = None) -> ReloadOutcome:
        """One reload under the contract; see :func:`run_reload`."""
        return run_reload(self.contract, load_fn, agreement=agreement)

    def recapture(self) -> None:
        """Capture every open graph again and reseal: the way back after a strict-mode violation or a failed
        reload (once the weights are good again)."""
        if not self.graphs:
            self.contract.reseal()  # nothing captured: the reseal refuses unless a capture was reported
            return
        recapture_and_reseal(self.contract)

    def close(self) -> None:
        """Close every graph."""
        for graph in self._graphs:
            graph.close()
        self._graphs.clear()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
