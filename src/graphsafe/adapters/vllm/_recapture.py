"""Turning an outcome into vLLM's action: recapture through vLLM's own sequence.

``NEEDS_RECAPTURE`` runs the contract's ``on_recapture`` callback made here. It follows the sequence vLLM 0.33's
elastic-EP scaling uses when a captured graph's pointers go stale (``ElasticEPScalingExecutor.warm_and_capture``):
release the captured graphs, unlock the workspace, capture again with the serving state kept out of the KV cache,
lock the workspace. ``FAILED`` needs nothing here: the contract raises inside ``finalize_layerwise_processing``,
so the error leaves ``reload_weights`` / ``finish_weight_update`` and ``collective_rpc`` surfaces it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from graphsafe.adapters.vllm._guard import vllm_module
from graphsafe.adapters.vllm._state import AdapterState
from graphsafe.errors import GraphSafeError
from graphsafe.outcome import ReloadOutcome

__all__ = [
    "graphless_reason",
    "in_flight",
    "no_graphs",
    "platform_has_graphs",
    "recapture_callback",
    "recapture_runner",
    "release_graphs",
]

log = logging.getLogger("graphsafe.vllm")


def release_graphs(runner: Any) -> None:
    """Drop every graph vLLM captured for ``runner`` (model runner V2's managers, and the compiled wrappers)."""
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None:
        manager.release_graphs()
        speculator = getattr(runner, "speculator", None)
        if speculator is not None:
            manager_cls = vllm_module("vllm.v1.worker.gpu.cudagraph_utils").CudaGraphManager
            for value in vars(speculator).values():
                if isinstance(value, manager_cls):
                    value.release_graphs()
    # Piecewise graphs of a compiled model live in its CUDAGraphWrapper instances, not in the manager.
    vllm_module("vllm.compilation.cuda_graph").CUDAGraphWrapper.clear_all_graphs()
    vllm_module("vllm.compilation.breakable_cudagraph").BreakableCUDAGraphWrapper.clear_all_graphs()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def platform_has_graphs() -> bool:
    """Whether vLLM's current platform captures CUDA graphs at all (the CPU platform, say, captures none)."""
    return bool(vllm_module("vllm.platforms").current_platform.is_cuda_alike())


def no_graphs(runner: Any) -> str | None:
    """Why no captured graph replays ``runner``'s model, or ``None`` when graphs may replay.

    The one rule for "nothing to recapture": a platform without CUDA graphs, ``enforce_eager``, a cudagraph mode
    of none, or a model runner V2 with no graph manager (no KV cache yet). ``runner`` may be ``None`` (a model no
    runner is bound to): only the platform can answer then.
    """
    if not platform_has_graphs():
        platform = vllm_module("vllm.platforms").current_platform
        return f"vLLM's {type(platform).__name__} captures no CUDA graphs"
    if runner is None:
        return None
    if "cudagraph_manager" in vars(runner) and runner.cudagraph_manager is None:
        return "the runner captured no graphs (eager mode or no KV cache yet)"
    if getattr(getattr(runner, "model_config", None), "enforce_eager", False):
        return "enforce_eager"
    compilation = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    if getattr(getattr(compilation, "cudagraph_mode", None), "name", None) == "NONE":
        return "cudagraph_mode is NONE"
    return None


def _request_ids(runner: Any) -> list[Any]:
    states = getattr(runner, "req_states", None)  # model runner V2
    requests = getattr(states, "req_id_to_index", None)
    if requests is None:
        requests = getattr(runner, "requests", None)  # model runner V1
    return list(requests.keys()) if requests is not None else []


def in_flight(runner: Any, schedulers: Iterable[Any] = ()) -> int:
    """How many requests ``runner`` is really serving now.

    The runner forgets a finished request only at the next step, whose scheduler output lists it as finished. An
    engine run in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as colocated RL runs it) stops
    stepping when no request is unfinished, so that step never comes: requests the scheduler already finished are
    not counted. ``schedulers`` are the vLLM schedulers alive in this process (a worker of a multiprocess engine
    has none, and its engine core's busy loop runs that step).
    """
    finished: set[Any] = set()
    for scheduler in schedulers:
        finished.update(getattr(scheduler, "finished_req_ids", ()))
    return sum(1 for request in _request_ids(runner) if request not in finished)


@contextlib.contextmanager
def _serving_state(runner: Any) -> Iterator[None]:
    """Keep the capture's dummy batches out of the KV cache (model runner V2), as elastic EP does."""
    if getattr(runner, "block_tables", None) is None or getattr(runner, "req_states", None) is None:
        yield
        return
    with vllm_module("vllm.v1.worker.gpu.eplb_utils").preserve_serving_state(runner):
        yield


def _capture_context(worker: Any) -> contextlib.AbstractContextManager[Any]:
    make = getattr(worker, "_get_cudagraph_capture_context", None)
    return make() if callable(make) else contextlib.nullcontext()


def recapture_runner(runner: Any, *, worker: Any = None, state: AdapterState | None = None) -> str:
    """Capture ``runner``'s graphs again through vLLM's sequence; returns what it did, in words.

    Refuses (:class:`~graphsafe.GraphSafeError`) while requests are in flight: vLLM's capture runs dummy batches,
    so a reload that needs a recapture must happen with generation paused (as RL frameworks do between steps).
    """
    why = no_graphs(runner)
    if why is not None:
        return f"nothing to recapture: {why}"
    serving = in_flight(runner, list(state.schedulers) if state is not None else ())
    if serving:
        raise GraphSafeError(
            f"cannot recapture vLLM's graphs with {serving} request(s) in flight; pause generation before "
            "reloading weights (the captured graphs are not safe to replay until they are captured again)"
        )
    workspace = vllm_module("vllm.v1.worker.workspace")
    release_graphs(runner)
    workspace.unlock_workspace()
    if state is not None:
        state.recapturing = True
    try:
        with _serving_state(runner), _capture_context(worker):
            runner.capture_model()
    finally:
        if state is not None:
            state.recapturing = False
        workspace.lock_workspace()  # capture_model locks too; an error halfway must not leave it unlocked
    return "released and captured the graphs again"


def recapture_callback(state: AdapterState, model: nn.Module) -> Callable[[ReloadOutcome], None]:
    """The ``on_recapture`` callback of ``model``'s contract: recapture through the runner bound to it."""
    model_ref = weakref.ref(model)

    def recapture(outcome: ReloadOutcome) -> None:
        target = model_ref()
        runner = state.runner_of(target) if target is not None else None
        if runner is None:
            raise GraphSafeError(
                f"the reload of {type(target).__name__} needs its graphs captured again, but no vLLM model runner "
                "is bound to it (graphsafe binds one when vLLM's runner loads the model; for a model loaded "
                "elsewhere call graphsafe.adapters.vllm.bind(model, runner))"
            )
        assert target is not None
        done = recapture_runner(runner, worker=state.worker_of(target), state=state)
        log.info("graphsafe: %s (%d finding(s) needed it)", done, len(outcome.problems))

    return recapture


def graphless_reason(state: AdapterState, model: nn.Module) -> Callable[[], str | None]:
    """The contract's ``graphless`` hook for ``model``: :func:`no_graphs` of the runner bound to it, asked when a
    reload decides. In strict mode it says once, per model, that there is nothing to protect."""
    model_ref = weakref.ref(model)
    said = False

    def graphless() -> str | None:
        nonlocal said
        target = model_ref()
        why = no_graphs(state.runner_of(target) if target is not None else None)
        if why is not None and not said and state.config.mode == "strict":
            said = True
            log.warning(
                "graphsafe: strict mode has nothing to protect on %s: %s; reloads are restored and committed",
                type(target).__name__,
                why,
            )
        return why

    return graphless
