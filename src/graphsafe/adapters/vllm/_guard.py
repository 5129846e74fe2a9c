"""Version guard: the installed vLLM must be 0.32.x or 0.33.x and have every hook point with the expected signature.

The plugin wraps private functions of vLLM's layerwise reload. A vLLM that renamed or re-signed one of them
would leave the plugin silently doing nothing (or wrapping the wrong thing), so a mismatch is an error that
names the missing hook. What the plugin does with it depends on whether the operator asked for graphsafe: with
``GRAPHSAFE_MODE`` set it refuses to start; unset, the plugin stays off and says why in one log line.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graphsafe.errors import GraphSafeError

__all__ = [
    "HOOK_POINTS",
    "SUPPORTED_VERSIONS",
    "HookMismatchError",
    "HookPoint",
    "ResolvedHook",
    "check_version",
    "resolve",
    "resolve_all",
    "vllm_module",
]

#: The vLLM release series the hook points below were read from (each checked by :func:`resolve_all`).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.32", "0.33")
_SUPPORTED = " or ".join(f"{series}.x" for series in SUPPORTED_VERSIONS)

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
INPLACE = "vllm.model_executor.model_loader.reload.inplace"
RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
WORKER = "vllm.v1.worker.gpu_worker"
WORKSPACE = "vllm.v1.worker.workspace"
EPLB_UTILS = "vllm.v1.worker.gpu.eplb_utils"
CUDAGRAPH_UTILS = "vllm.v1.worker.gpu.cudagraph_utils"
SCHEDULER = "vllm.v1.core.sched.scheduler"
DISPATCHER = "vllm.v1.cudagraph_dispatcher"
ENCODER_CUDAGRAPH = "vllm.v1.worker.encoder_cudagraph"


class HookMismatchError(GraphSafeError):
    """The installed vLLM is not the one the adapter was written for (a hook is missing or re-signed)."""


@dataclass(frozen=True, slots=True)
class HookPoint:
    """One vLLM function or method the adapter wraps or calls.

    ``params`` are the leading parameter names it must have. ``core`` points are the layerwise reload itself:
    without them the plugin cannot work anywhere. The others (model runner, worker, workspace) are checked when
    their module imports; a module that cannot be imported on this platform is recorded as unavailable, since
    vLLM then cannot use it either.
    """

    module: str
    attr: str
    params: tuple[str, ...]
    core: bool = True

    @property
    def name(self) -> str:
        """``module:attr``, how errors and reports name the hook."""
        return f"{self.module}:{self.attr}"


HOOK_POINTS: tuple[HookPoint, ...] = (
    HookPoint(LAYERWISE, "initialize_layerwise_reload", ("model",)),
    HookPoint(LAYERWISE, "restore_layer_on_meta", ("layer", "info")),
    HookPoint(LAYERWISE, "_layerwise_process", ("layer", "info")),
    HookPoint(LAYERWISE, "finalize_layerwise_processing", ("model", "model_config")),
    HookPoint(LAYERWISE, "get_layerwise_info", ("layer",)),
    HookPoint(
        INPLACE,
        "reload_weights",
        ("vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format"),
    ),
    HookPoint(RUNNER_V2, "GPUModelRunner.load_model", ("self", "load_dummy_weights"), core=False),
    HookPoint(RUNNER_V2, "GPUModelRunner.capture_model", ("self",), core=False),
    HookPoint(
        RUNNER_V2,
        "GPUModelRunner.reload_weights",
        ("self", "weights_iterator", "weights_path", "is_checkpoint_format"),
        core=False,
    ),
    HookPoint(RUNNER_V1, "GPUModelRunner.load_model", ("self",), core=False),
    HookPoint(RUNNER_V1, "GPUModelRunner.capture_model", ("self",), core=False),
    HookPoint(WORKER, "Worker.load_model", ("self",), core=False),
    HookPoint(WORKER, "Worker.reload_weights", ("self",), core=False),
    HookPoint(WORKER, "Worker.start_weight_update", ("self",), core=False),
    HookPoint(WORKER, "Worker.update_weights", ("self", "update_info"), core=False),
    HookPoint(WORKER, "Worker.finish_weight_update", ("self",), core=False),
    HookPoint(WORKSPACE, "lock_workspace", (), core=False),
    HookPoint(WORKSPACE, "unlock_workspace", (), core=False),
    HookPoint(EPLB_UTILS, "preserve_serving_state", ("model_runner",), core=False),
    HookPoint(CUDAGRAPH_UTILS, "CudaGraphManager.release_graphs", ("self",), core=False),
    HookPoint(CUDAGRAPH_UTILS, "CudaGraphManager.dispatch", ("self", "num_reqs", "num_tokens"), core=False),
    HookPoint(SCHEDULER, "Scheduler.__init__", ("self", "vllm_config"), core=False),
    HookPoint(DISPATCHER, "CudagraphDispatcher.dispatch", ("self", "num_tokens"), core=False),
    HookPoint(ENCODER_CUDAGRAPH, "EncoderCudaGraphManager.execute", ("self", "mm_kwargs"), core=False),
)


@dataclass(frozen=True, slots=True)
class ResolvedHook:
    """A hook point found in the installed vLLM: the object holding it, the name, and the current value."""

    point: HookPoint
    owner: Any
    name: str
    value: Callable[..., Any]


def check_version(version: str) -> None:
    """Raise :class:`HookMismatchError` unless ``version`` is in the supported series."""
    parts = version.split(".")
    if ".".join(parts[:2]) not in SUPPORTED_VERSIONS:
        raise HookMismatchError(
            f"graphsafe's vLLM adapter supports vLLM {_SUPPORTED}, but vLLM {version} is installed. Install a "
            "supported vLLM, or set GRAPHSAFE_MODE=off to run without graphsafe."
        )


def vllm_module(module: str) -> Any:
    """Import a vLLM module lazily (vLLM is never a dependency of ``import graphsafe``)."""
    # vLLM's worker modules import transformers in an order that only works once vllm.config is loaded.
    importlib.import_module("vllm.config")
    return importlib.import_module(module)


def _leading_params(fn: Callable[..., Any]) -> tuple[str, ...]:
    target = inspect.unwrap(getattr(fn, "__graphsafe_original__", fn))
    return tuple(inspect.signature(target).parameters)


def resolve(point: HookPoint) -> ResolvedHook:
    """Find ``point`` in the installed vLLM; :class:`HookMismatchError` if it is missing or re-signed.

    ``ImportError`` of the module propagates (the caller decides whether the point is optional).
    """
    owner: Any = vllm_module(point.module)
    *outer, name = point.attr.split(".")
    for step in outer:
        owner = getattr(owner, step, None)
        if owner is None:
            raise HookMismatchError(
                f"vLLM hook {point.name} is missing: {point.module} has no {step!r}. The installed vLLM does not "
                f"match graphsafe's adapter for vLLM {_SUPPORTED}; set GRAPHSAFE_MODE=off to run without it."
            )
    value = getattr(owner, name, None)
    if value is None or not callable(value):
        raise HookMismatchError(
            f"vLLM hook {point.name} is missing (no callable {name!r}). The installed vLLM does not match "
            f"graphsafe's adapter for vLLM {_SUPPORTED}; set GRAPHSAFE_MODE=off to run without it."
        )
    try:
        params = _leading_params(value)
    except (TypeError, ValueError):
        params = point.params  # a builtin without a signature: nothing to compare
    if params[: len(point.params)] != point.params:
        raise HookMismatchError(
            f"vLLM hook {point.name} has parameters {params}, expected them to start with {point.params}. "
            f"The installed vLLM does not match graphsafe's adapter for vLLM {_SUPPORTED}; set "
            "GRAPHSAFE_MODE=off to run without it."
        )
    return ResolvedHook(point, owner, name, value)


def resolve_all(
    points: Sequence[HookPoint] = HOOK_POINTS,
) -> tuple[dict[str, ResolvedHook], dict[str, str]]:
    """Resolve every hook point: ``(found by name, unavailable optional modules with why)``.

    Raises :class:`HookMismatchError` naming the first core point missing, or any point whose module imports
    but lacks it.
    """
    found: dict[str, ResolvedHook] = {}
    unavailable: dict[str, str] = {}
    for point in points:
        try:
            found[point.name] = resolve(point)
        except ImportError as exc:
            if point.core:
                raise HookMismatchError(
                    f"vLLM hook {point.name} is missing: cannot import {point.module} ({exc}). Set "
                    "GRAPHSAFE_MODE=off to run without graphsafe."
                ) from exc
            unavailable[point.name] = f"cannot import {point.module}: {exc}"
    return found, unavailable
