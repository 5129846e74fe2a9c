"""The capture drop-in: ``torch.cuda.graph`` that records what the graph reads, by the kernel scan, in one step.

``with graphsafe.cuda_graph(contract, g): out = model(x)`` stands where ``with torch.cuda.graph(g):`` stood. It
makes the graph with ``keep_graph=True`` (or checks the one it is given), captures with nothing active (no dispatch
mode, so a ``torch.compile``'d forward captures the kernels it captures without graphsafe), then scans the graph's
kernel, memset and memcpy nodes into the contract's manifest (:func:`~graphsafe.collectors.record_capture` with
``backend="kernel"``) and instantiates it, ready to replay.

The dispatch recorder is never chosen by omission here: where the kernel scan cannot run (no cuda-bindings, a
driver without the calls) the drop-in refuses, unless ``fallback="dispatch"`` says to record by the dispatch
recorder (with a one-line warning and a manifest note), which changes what a ``torch.compile``'d forward captures.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from graphsafe.collectors import _kernelscan as kscan
from graphsafe.collectors._capture import kernel_scan_unavailable, record_capture
from graphsafe.collectors._manifest import Manifest, SealedModel
from graphsafe.errors import GraphSafeError

__all__ = ["cuda_graph"]

_ERROR_MODES = ("global", "thread_local", "relaxed")
_FALLBACKS = ("error", "dispatch")


@contextmanager
def cuda_graph(
    contract: SealedModel | None,
    graph: torch.cuda.CUDAGraph | None = None,
    *,
    pool: tuple[int, int] | None = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: Literal["global", "thread_local", "relaxed"] = "global",
    name: str | None = None,
    ignore: Iterable[torch.Tensor] = (),
    reindex: bool = True,
    manifest: Manifest | None = None,
    fallback: Literal["error", "dispatch"] = "error",
) -> Iterator[torch.cuda.CUDAGraph]:
    """Capture a CUDA graph and record what it reads: a drop-in for ``torch.cuda.graph(g)``.

    ``with cuda_graph(contract, g): out = model(x)`` captures into ``g`` exactly as ``torch.cuda.graph(g)``
    would (the same ``pool``, ``stream`` and ``capture_error_mode``), with nothing active during the capture; once
    the block exits without an exception, the graph's nodes are read by the kernel scan into the contract's
    manifest (set as ``contract.manifest`` on first use; the contract is told a capture happened), and the graph is
    instantiated (``g.instantiate()``), ready to replay. Yields the graph, so ``with cuda_graph(contract) as g:``
    makes one. Warm up on a side stream first, as for any CUDA graph capture.

    Args:
        contract: the contract whose graphs these are (``None``: record into ``manifest`` only).
        graph: the ``torch.cuda.CUDAGraph`` to capture into, made with ``keep_graph=True`` (the scan reads the
            captured graph, which torch keeps only then) and not captured yet. Default: a new one.
        pool: as ``torch.cuda.graph``'s: a pool handle this capture may share memory with.
        stream: as ``torch.cuda.graph``'s: the stream to capture on (default: torch's side stream).
        capture_error_mode: as ``torch.cuda.graph``'s: ``"global"``, ``"thread_local"`` or ``"relaxed"``.
        name: the capture's name in the manifest; capturing again under a name replaces that capture (a
            recapture). Default: a fresh name per call.
        ignore: tensors the graph touches that are not model state (static inputs and outputs).
        reindex: tie the recorded storages to the model paths that hold them now (``False`` when the contract
            reseals right after, which indexes everything anyway).
        manifest: record into this manifest instead of the contract's.
        fallback: where the kernel scan cannot run (no cuda-bindings, a driver without the calls, a torch
            without ``CUDAGraph(keep_graph=True)``): ``"error"`` raises :class:`~graphsafe.GraphSafeError`;
            ``"dispatch"`` records by the dispatch recorder instead, with a one-line warning and a manifest note.
            That recorder is a ``TorchDispatchMode`` active during the capture: a ``torch.compile``'d forward
            then captures ATen's kernels instead of its own, and kernels launched outside the dispatcher (a raw
            Triton or CuPy launch) are not seen.

    Raises:
        GraphSafeError: before anything is captured, for a graph not made with ``keep_graph=True`` or already
            captured, an unknown ``capture_error_mode`` or ``fallback``, no contract and no manifest, no CUDA, or
            (``fallback="error"``) no kernel scan or a torch without ``keep_graph``.
    """
    if capture_error_mode not in _ERROR_MODES:
        raise GraphSafeError(
            f"collectors: cuda_graph(capture_error_mode={capture_error_mode!r}) is not a capture mode; use "
            "'global', 'thread_local' or 'relaxed'"
        )
    if fallback not in _FALLBACKS:
        raise GraphSafeError(
            f"collectors: cuda_graph(fallback={fallback!r}) is not a fallback; use 'error' (refuse where the kernel "
            "scan cannot run) or 'dispatch' (the dispatch recorder, which changes what torch.compile captures)"
        )
    if contract is None and manifest is None:
        raise GraphSafeError(
            "collectors: cuda_graph(None) has nowhere to record; pass the model's contract or manifest="
        )
    if graph is not None:
        _check_graph(graph)
    if not torch.cuda.is_available():
        raise GraphSafeError(
            "collectors: cuda_graph: CUDA is not available, so there is no graph to capture; on CPU record a "
            "forward with record_capture(contract), or capture with graphsafe.capture (its eager fallback)"
        )
    why = kernel_scan_unavailable()
    if why is not None and fallback == "error":
        raise GraphSafeError(
            f"collectors: cuda_graph: {why}; make the kernel scan available (the graphsafe[cuda] extra), or pass "
            "fallback='dispatch' to record by the dispatch recorder (which changes what torch.compile captures)"
        )
    if graph is None:
        graph = _new_graph(fallback)
    # The kernel scan; "auto" only where fallback="dispatch" allowed the dispatch recorder (it warns and notes why).
    kept = kscan.keeps_graph(graph)
    backend = "kernel" if why is None and kept else "auto"
    with (
        record_capture(
            contract, name=name, ignore=ignore, reindex=reindex, manifest=manifest, graph=graph, backend=backend
        ),
        torch.cuda.graph(graph, pool=_pool(pool), stream=stream, capture_error_mode=capture_error_mode),
    ):
        yield graph
    if kept:
        graph.instantiate()  # a keep_graph graph is instantiated on request; now, not on the first replay


def _new_graph(fallback: str) -> torch.cuda.CUDAGraph:
    """A graph torch keeps after capture; a plain one only where ``fallback="dispatch"`` allows (a torch without
    ``keep_graph``, whose graphs the kernel scan cannot read: the dispatch recorder then warns and records)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        if fallback == "error":
            raise GraphSafeError(
                f"collectors: cuda_graph: torch {torch.__version__} has no torch.cuda.CUDAGraph(keep_graph=True), so "
                "the kernel scan cannot read the captured graph; upgrade torch, or pass fallback='dispatch' (the "
                "dispatch recorder, which changes what torch.compile captures)"
            ) from None
        return torch.cuda.CUDAGraph()


def _check_graph(graph: Any) -> None:
    """Refuse, before capture, a graph the kernel scan cannot read afterwards or that holds a capture already."""
    if not callable(getattr(graph, "capture_begin", None)):
        raise GraphSafeError(
            f"collectors: cuda_graph(graph=...) got a {type(graph).__name__!r}, not a torch.cuda.CUDAGraph; pass "
            "torch.cuda.CUDAGraph(keep_graph=True), or leave graph= out to get one"
        )
    if not kscan.keeps_graph(graph):
        raise GraphSafeError(
            "collectors: cuda_graph(graph=...) needs a graph made with torch.cuda.CUDAGraph(keep_graph=True) (the "
            "kernel scan reads the captured graph, which torch keeps only then); make it so, or leave graph= out"
        )
    try:
        graph.raw_cuda_graph()
    except RuntimeError:
        return  # keep_graph, not captured yet: torch refuses the raw graph until capture_end
    raise GraphSafeError(
        "collectors: cuda_graph(graph=...) got a graph that already holds a capture; pass a new "
        "torch.cuda.CUDAGraph(keep_graph=True), or leave graph= out to get one"
    )


def _pool(pool: tuple[int, int] | None) -> Any:
    """The pool handle as ``torch.cuda.graph`` takes it (a ``(int, int)`` token, typed by torch as a NewType)."""
    return pool
