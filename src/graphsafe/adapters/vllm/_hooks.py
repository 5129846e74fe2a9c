"""Wrap vLLM 0.33's layerwise reload so a :class:`~graphsafe.GraphContract` runs inside it.

vLLM reloads a model layer by layer: ``initialize_layerwise_reload(model)`` moves each layer's parameters to the
meta device (``restore_layer_on_meta``), every layer is processed as soon as its weights are in
(``_layerwise_process``: materialise, load, ``process_weights_after_loading``, copy parameters and buffers back
into the captured storage), and ``finalize_layerwise_processing`` processes what is left (attention layers,
partially loaded ones). Both routes reach it: ``reload_weights`` (``collective_rpc("reload_weights")``) and the
weight-transfer engines' ``start_weight_update`` / ``finish_weight_update``.

The wrappers map that onto one contract transaction per reload:

* ``initialize_layerwise_reload`` opens the transaction (sealing a contract first if the model has none),
* ``restore_layer_on_meta`` snapshots the layer (``txn.before_layer``) before it goes to meta,
* ``_layerwise_process`` restores and verifies the layer (``txn.after_layer``) right after its PWAL and vLLM's
  own copy-back, so the layer's new derived tensors can be freed before the next layer loads,
* ``finalize_layerwise_processing`` finishes it (``txn.finish``): commit, recapture, or raise through vLLM,
* any error on the way finishes the transaction as failed before it propagates.

vLLM's model runner and worker are wrapped to bind a model to the runner that captures its graphs (for
recapture), to seal after load and reseal after capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphsafe.adapters.vllm._guard import ResolvedHook, vllm_module
from graphsafe.adapters.vllm._session import abort, begin, bind, ensure_contract, finish, rejected
from graphsafe.adapters.vllm._state import AdapterState, Session
from graphsafe.contract import GraphContract

__all__ = ["HookSet", "install"]

log = logging.getLogger("graphsafe.vllm")

ORIGINAL_ATTR = "__graphsafe_original__"
_INHERITED: Any = object()
Wrapper = Callable[..., Any]


class HookSet:
    """The patches one ``install`` made, so they can be undone (tests, ``GRAPHSAFE_MODE=off``)."""

    def __init__(self) -> None:
        self._patches: list[tuple[Any, str, Any]] = []

    def patch(self, owner: Any, name: str, value: Any) -> None:
        # A class attribute is read from the class's own __dict__: an inherited one is removed again on uninstall.
        original = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, value)

    @property
    def count(self) -> int:
        """How many attributes were replaced."""
        return len(self._patches)

    def uninstall(self) -> None:
        """Put every original back (last patched first)."""
        while self._patches:
            owner, name, original = self._patches.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _mark(wrapper: Wrapper, original: Callable[..., Any]) -> Wrapper:
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, ORIGINAL_ATTR, original)
    return wrapper


def _patch_function(hooks: HookSet, resolved: ResolvedHook, make: Callable[[Callable[..., Any]], Wrapper]) -> None:
    """Replace a module-level function everywhere vLLM imported it by name (``from .layerwise import f``)."""
    original = resolved.value
    if hasattr(original, ORIGINAL_ATTR):
        return  # already wrapped (idempotent register)
    wrapper = _mark(make(original), original)
    hooks.patch(resolved.owner, resolved.name, wrapper)
    for module_name, module in list(sys.modules.items()):
        if module is None or module is resolved.owner or not module_name.startswith("vllm"):
            continue
        if getattr(module, resolved.name, None) is original:
            hooks.patch(module, resolved.name, wrapper)


def _patch_method(hooks: HookSet, resolved: ResolvedHook, make: Callable[[Callable[..., Any]], Wrapper]) -> None:
    original = resolved.owner.__dict__.get(resolved.name, resolved.value)
    if hasattr(original, ORIGINAL_ATTR):
        return
    hooks.patch(resolved.owner, resolved.name, _mark(make(original), original))


def _before_layer(session: Session, layer: nn.Module, state: AdapterState) -> None:
    if id(layer) in session.seen:
        return
    session.txn.before_layer(layer)
    for module in layer.modules():
        session.seen.add(id(module))
        state.layer_sessions[module] = session


def _pending_below(layer: nn.Module, get_info: Callable[[nn.Module], Any]) -> bool:
    """Whether a module under ``layer`` still waits for weights (its PWAL has not run yet)."""
    return any(module is not layer and get_info(module).can_load() for module in layer.modules())


# -- wrappers ------------------------------------------------------------------------------------------------------
def _wrap_initialize(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def initialize_layerwise_reload(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            session = begin(state, model)
            state.initializing = session
            try:
                return original(model, *args, **kwargs)
            except BaseException as exc:
                abort(state, session, exc)
                raise
            finally:
                if state.initializing is session:
                    state.initializing = None

        return initialize_layerwise_reload

    return make


def _wrap_restore_on_meta(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def restore_layer_on_meta(layer: nn.Module, info: Any, *args: Any, **kwargs: Any) -> Any:
            session = state.initializing
            if session is not None:
                _before_layer(session, layer, state)
            return original(layer, info, *args, **kwargs)

        return restore_layer_on_meta

    return make


def _wrap_layerwise_process(state: AdapterState, get_info: Callable[[nn.Module], Any]) -> Callable[..., Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def _layerwise_process(layer: nn.Module, info: Any, *args: Any, **kwargs: Any) -> Any:
            session = state.layer_sessions.get(layer)
            if session is None:  # a first load (online quantization), or a model without a session
                return original(layer, info, *args, **kwargs)
            try:
                result = original(layer, info, *args, **kwargs)
            except BaseException as exc:
                abort(state, session, exc)
                raise
            session.layers_processed += 1
            if _pending_below(layer, get_info):
                # Restoring now would mark the children done before their own PWAL: leave it to finalize.
                session.deferred.append(type(layer).__name__)
            else:
                session.txn.after_layer(layer)
            return result

        return _layerwise_process

    return make


def _wrap_finalize(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def finalize_layerwise_processing(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            session = state.sessions.get(model)
            if session is None:  # a first load, or a model whose reload graphsafe did not open
                return original(model, *args, **kwargs)
            try:
                result = original(model, *args, **kwargs)
            except BaseException as exc:
                abort(state, session, exc)
                raise
            finish(state, session)
            return result

        return finalize_layerwise_processing

    return make


def _wrap_reload_weights(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def reload_weights(vllm_config: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if _kernel_format(args, kwargs):
                # vLLM copies kernel-format weights into the parameters itself, with no layerwise hooks and no
                # PWAL: one whole-model transaction around it checks what the copy leaves (a derived slot computed
                # from the old weights is stale). A model with no contract yet (bound, or loaded before the plugin
                # was on) is sealed first, as the layerwise route's begin() does.
                session = begin(state, model, layerwise=False)
                try:
                    result = original(vllm_config, model, *args, **kwargs)
                except BaseException as exc:
                    abort(state, session, exc)
                    raise
                finish(state, session)
                return result
            with _failing_reloads(state, [model]):
                return original(vllm_config, model, *args, **kwargs)

        return reload_weights

    return make


def _kernel_format(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``reload_weights(vllm_config, model, weights_iterator, weights_path, is_checkpoint_format)`` call
    passes weights already in kernel format (``is_checkpoint_format=False``)."""
    flag = kwargs["is_checkpoint_format"] if "is_checkpoint_format" in kwargs else (args[2] if len(args) > 2 else True)
    return flag is False


@contextlib.contextmanager
def _failing_reloads(state: AdapterState, models: list[nn.Module]) -> Iterator[None]:
    """Around a vLLM call that reloads ``models``: an error it raises fails their reload, carrying that error.

    An error while a reload is open aborts it. An error after the reload was finished, or before one opened
    (vLLM rejecting the reload itself, as expert substitution does after putting the old weights back), replaces
    the last outcome with ``FAILED`` carrying vLLM's error.
    """
    reloads = {id(model): _reloads(state, model) for model in models}
    try:
        yield
    except BaseException as exc:
        for model in models:
            session = state.sessions.get(model)
            if session is not None:  # raised between initialize and finalize (e.g. in load_weights)
                abort(state, session, exc)
            elif isinstance(exc, Exception):
                rejected(state, model, exc, finished=_reloads(state, model) != reloads[id(model)])
        raise


def _reloads(state: AdapterState, model: nn.Module) -> int:
    contract = state.contracts.get(model)
    return contract.reloads if contract is not None else 0


# -- runner and worker ---------------------------------------------------------------------------------------------
def _runner_model(runner: Any) -> nn.Module | None:
    try:
        model = runner.get_model()
    except Exception:
        return None
    return model if isinstance(model, nn.Module) else None


def _wrap_runner_load(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            model = _runner_model(self)
            if model is not None:
                bind(state, model, runner=self)
                ensure_contract(state, model)
            return result

        return load_model

    return make


#: Prefix of the manifest's capture names for the graphs vLLM's runner captured (``vllm-0``, ``vllm-1``, ...).
SCAN_PREFIX = "vllm-"


@contextlib.contextmanager
def _maybe_record(state: AdapterState, contract: GraphContract | None, runner: Any = None) -> Iterator[None]:
    """Record the capture into the contract's manifest when ``GRAPHSAFE_MANIFEST=1``.

    With CUDA and cuda-bindings, by the kernel scan: every ``torch.cuda.CUDAGraph`` made during the capture is made
    with ``keep_graph=True`` and scanned once the runner's capture returns, with the CUDA tensors the runner holds
    (its persistent input buffers, the KV cache) registered as the engine's inputs and outputs. Otherwise (or for a
    graph that cannot be scanned) by the dispatch recorder, with one logged line saying why.
    """
    if contract is None or not state.config.record_manifest:
        yield
        return
    from graphsafe.collectors import kernel_scan_unavailable, record_capture, record_scan

    why = kernel_scan_unavailable()
    if why is not None:
        log.info("graphsafe: %s; vLLM's capture is recorded by the dispatch recorder", why)
        # The runner's own buffers (inputs, outputs, KV cache) are no model state; a read no model path feeds is a
        # finding. Those the model also holds stay recorded (the recorder drops whatever it is told to ignore).
        model_storages = {_storage_id(t) for t in (*contract.model.parameters(), *contract.model.buffers())}
        inputs = [t for t in engine_tensors(runner) if _storage_id(t) not in model_storages | {None}]
        with record_capture(contract, name="vllm", reindex=False, backend="dispatch", ignore=inputs):
            yield
        return
    with _kept_graphs() as graphs:
        yield
    manifest = contract.manifest
    for name in getattr(manifest, "captures", ()):
        if name.startswith(SCAN_PREFIX) or name == "vllm":
            manifest.discard(name)  # type: ignore[union-attr]  # a Manifest (it has captures)
    engine = engine_tensors(runner)
    for index, graph in enumerate(graphs):
        record_scan(contract, graph, name=f"{SCAN_PREFIX}{index}", ignore=engine, reindex=False)


@contextlib.contextmanager
def _kept_graphs() -> Iterator[list[Any]]:
    """Within the block, ``torch.cuda.CUDAGraph(...)`` makes graphs with ``keep_graph=True``; yields them."""
    original = torch.cuda.CUDAGraph
    made: list[Any] = []

    class _KeptGraph(original):  # type: ignore[misc,valid-type]  # torch's graph class, subclassed for the block
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            kwargs["keep_graph"] = True
            graph = super().__new__(cls, *args, **kwargs)
            made.append(graph)
            return graph

    torch.cuda.CUDAGraph = _KeptGraph  # type: ignore[misc]
    try:
        yield made
    finally:
        torch.cuda.CUDAGraph = original  # type: ignore[misc]


def _storage_id(tensor: torch.Tensor) -> int | None:
    """``id`` of a plain tensor's storage; ``None`` for one without (a wrapper subclass, sparse, meta)."""
    try:
        return id(tensor.untyped_storage()) if tensor.layout is torch.strided else None
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def engine_tensors(runner: Any, depth: int = 2) -> list[torch.Tensor]:
    """Tensors a model runner holds (attributes, their items, and one level of their attributes): the engine's
    input and output buffers and KV cache, which its graphs read but no model path holds. The model's own tensors
    are found among them too; the kernel scan looks a storage up among the model's paths first."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(value: Any, left: int) -> None:
        if id(value) in seen or isinstance(value, nn.Module):
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)  # a CPU tensor among them is harmless: no graph node points into it
            return
        if left == 0:
            return
        if isinstance(value, dict):
            items: list[Any] = list(value.values())
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            attrs = getattr(value, "__dict__", None)
            items = list(attrs.values()) if isinstance(attrs, dict) else []
        for item in items:
            visit(item, left - 1)

    if runner is not None:
        visit(runner, depth + 1)
    return found


def _wrap_capture(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            model = _runner_model(self)
            contract = state.contracts.get(model) if model is not None else None
            if kwargs.get("profile_only", False):  # graphs thrown away after measuring memory
                return original(self, *args, **kwargs)
            with _maybe_record(state, contract, self):
                result = original(self, *args, **kwargs)
            if contract is not None:
                contract.note_capture()  # the graphs read the model as it is now: a reseal may follow
            if model is not None:
                bind(state, model, runner=self)
            if contract is not None and not state.recapturing and contract.sealed:
                contract.reseal()  # seal what the graphs captured: lazy scratch from warm-up included
            return result

        return capture_model

    return make


def _worker_models(worker: Any) -> list[nn.Module]:
    runner = getattr(worker, "model_runner", None)
    models = []
    for getter in ("get_model", "get_draft_model"):
        fn = getattr(runner, getter, None)
        try:
            model = fn() if fn is not None else None
        except Exception:
            model = None
        if isinstance(model, nn.Module):
            models.append(model)
    return models


def _wrap_worker_load(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    def make(original: Callable[..., Any]) -> Wrapper:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            for model in _worker_models(self):
                bind(state, model, runner=getattr(self, "model_runner", None), worker=self)
            return result

        return load_model

    return make


def _wrap_worker_abort_on_error(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    """Worker RPCs of the weight-transfer route: an error there ends the open reload as failed."""

    def make(original: Callable[..., Any]) -> Wrapper:
        def worker_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            models = _worker_models(self)
            for model in models:
                bind(state, model, runner=getattr(self, "model_runner", None), worker=self)
            guarded = [model for model in models if model in state.contracts]
            with _failing_reloads(state, guarded):
                return original(self, *args, **kwargs)

        return worker_call

    return make


def _wrap_scheduler_init(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    """Remember every vLLM scheduler of this process (the in-flight check asks which requests it finished)."""

    def make(original: Callable[..., Any]) -> Wrapper:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            state.schedulers.add(self)

        return __init__

    return make


def _gate_reason(state: AdapterState) -> str | None:
    """Why the captured graphs must not replay now: a guarded model whose contract is not serving-safe."""
    for model, contract in list(state.contracts.items()):
        if contract.sealed and not contract.serving_safe:
            return f"{type(model).__name__}: {contract.unsafe_reason}"
    return None


def _wrap_dispatch_v1(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    """The serving gate on model runner V1: while a reload is failed or waits for its recapture, run eager."""

    def make(original: Callable[..., Any]) -> Wrapper:
        def dispatch(self: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            mode, descriptor = original(self, num_tokens, *args, **kwargs)
            # (The adapter's own recapture dispatches too: it captures the graphs the gate waits for.)
            if state.recapturing or _gate_reason(state) is None or mode.name == "NONE":
                return mode, descriptor
            forward_context = vllm_module("vllm.forward_context")
            return type(mode).NONE, forward_context.BatchDescriptor(num_tokens)

        return dispatch

    return make


def _wrap_dispatch_v2(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    """The serving gate on model runner V2 (its graph manager's dispatch): the same rule as V1's."""

    def make(original: Callable[..., Any]) -> Wrapper:
        def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
            descriptor = original(self, *args, **kwargs)
            if state.recapturing or _gate_reason(state) is None or descriptor.cg_mode.name == "NONE":
                return descriptor
            return dataclasses.replace(descriptor, cg_mode=type(descriptor.cg_mode).NONE)

        return dispatch

    return make


def _wrap_encoder_execute(state: AdapterState) -> Callable[[Callable[..., Any]], Wrapper]:
    """The serving gate on V1's encoder CUDA graphs, which replay outside the dispatcher: while the gate is closed,
    ``None`` (vLLM's own "no graph" answer: the runner then runs the encoder eager)."""

    def make(original: Callable[..., Any]) -> Wrapper:
        def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not state.recapturing and _gate_reason(state) is not None:
                return None
            return original(self, *args, **kwargs)

        return execute

    return make


# -- installation --------------------------------------------------------------------------------------------------
def install(state: AdapterState, resolved: dict[str, ResolvedHook]) -> HookSet:
    """Wrap every resolved hook point; returns the :class:`HookSet` that undoes it."""
    from graphsafe.adapters.vllm import _guard

    hooks = HookSet()
    layerwise = _guard.LAYERWISE
    get_info = resolved[f"{layerwise}:get_layerwise_info"].value
    makers: dict[str, Callable[[Callable[..., Any]], Wrapper]] = {
        f"{layerwise}:initialize_layerwise_reload": _wrap_initialize(state),
        f"{layerwise}:restore_layer_on_meta": _wrap_restore_on_meta(state),
        f"{layerwise}:_layerwise_process": _wrap_layerwise_process(state, get_info),
        f"{layerwise}:finalize_layerwise_processing": _wrap_finalize(state),
        f"{_guard.INPLACE}:reload_weights": _wrap_reload_weights(state),
    }
    for name, make in makers.items():
        _patch_function(hooks, resolved[name], make)
    methods: dict[str, Callable[[Callable[..., Any]], Wrapper]] = {
        f"{_guard.RUNNER_V2}:GPUModelRunner.load_model": _wrap_runner_load(state),
        f"{_guard.RUNNER_V2}:GPUModelRunner.capture_model": _wrap_capture(state),
        f"{_guard.RUNNER_V1}:GPUModelRunner.load_model": _wrap_runner_load(state),
        f"{_guard.RUNNER_V1}:GPUModelRunner.capture_model": _wrap_capture(state),
        f"{_guard.WORKER}:Worker.load_model": _wrap_worker_load(state),
        f"{_guard.WORKER}:Worker.reload_weights": _wrap_worker_abort_on_error(state),
        f"{_guard.WORKER}:Worker.update_weights": _wrap_worker_abort_on_error(state),
        f"{_guard.WORKER}:Worker.finish_weight_update": _wrap_worker_abort_on_error(state),
        f"{_guard.SCHEDULER}:Scheduler.__init__": _wrap_scheduler_init(state),
        f"{_guard.DISPATCHER}:CudagraphDispatcher.dispatch": _wrap_dispatch_v1(state),
        f"{_guard.CUDAGRAPH_UTILS}:CudaGraphManager.dispatch": _wrap_dispatch_v2(state),
        f"{_guard.ENCODER_CUDAGRAPH}:EncoderCudaGraphManager.execute": _wrap_encoder_execute(state),
    }
    for name, make in methods.items():
        if name in resolved:
            _patch_method(hooks, resolved[name], make)
    return hooks
