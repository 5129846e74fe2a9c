"""The vLLM adapter's guards: each test is a place where the plugin could lie or break vLLM, and the rule it must
hold there. vLLM's own classes and functions are used wherever they run on CPU: the layerwise reload, the real quant
method classes the declarations pack wraps, vLLM's ``make_fp8_moe_kernel`` building the real TRT-LLM and CUTLASS
experts objects, vLLM's ``CudagraphDispatcher`` and the V1 runner's ``_determine_batch_execution_and_padding``.
Where a quant method's own PWAL needs a GPU, the class's PWAL is replaced (before the plugin wraps it) by the part
of it that builds graph-visible tensors: ``self.moe_kernel = make_fp8_moe_kernel(...)`` from the layer's scales,
as ``Fp8MoEMethod._init_moe_kernel`` / ``QuarkW8A8Fp8MoEMethod`` / ``_Fp8OnlineMoEBase._setup_kernel`` do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (these tests run in .venv-vllm)")

import numpy as np
import torch
from test_vllm_adapter import (  # the adapter suite's harness (fixtures and helpers; no tests imported)
    DeclaredLinearMethod,
    SpyRunner,
    _dispatcher,
    build,
    checkpoint,
    plugin,
    vllm_config,
    workspace,
)
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.model_loader.reload import inplace, layerwise
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from graphsafe.adapters import vllm as gs_vllm

__all__ = ["plugin", "vllm_config", "workspace"]  # fixtures used by name below

E, K, N = 4, 16, 8  # experts, hidden, intermediate per partition


# -- an FP8 MoE layer on CPU: vLLM's real quant-method classes and experts objects ----------------------------------
def _moe_config() -> Any:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=E,
        experts_per_token=2,
        hidden_dim=K,
        intermediate_size=N,
        num_local_experts=E,
        num_logical_experts=E,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        intermediate_size_per_partition=N,
    )


def _kernel_builder(experts: str, static_input_scales: bool) -> Callable[[Any, nn.Module], None]:
    """The graph-visible part of an FP8 MoE method's PWAL: vLLM's ``make_fp8_moe_kernel`` on the layer's scales
    (what ``Fp8MoEMethod._init_moe_kernel`` runs once the weights are in kernel format)."""

    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
        from vllm.model_executor.layers.fused_moe.experts.trtllm_fp8_moe import TrtLlmFp8ExpertsMonolithic
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, make_fp8_moe_kernel

        experts_cls, backend = {
            "trtllm": (TrtLlmFp8ExpertsMonolithic, Fp8MoeBackend.FLASHINFER_TRTLLM),
            "cutlass": (CutlassExpertsFp8, Fp8MoeBackend.VLLM_CUTLASS),
        }[experts]
        quant = fp8_w8a8_moe_quant_config(
            w1_scale=layer.w13_weight_scale,
            w2_scale=layer.w2_weight_scale,
            a1_scale=layer.w13_input_scale if static_input_scales else None,
            a2_scale=layer.w2_input_scale if static_input_scales else None,
        )
        self.moe_quant_config = quant
        self.moe_kernel = make_fp8_moe_kernel(
            moe_quant_config=quant,
            moe_config=_moe_config(),
            experts_cls=experts_cls,
            fp8_backend=backend,
            routing_tables=None,
        )

    return process_weights_after_loading


MOE_SHAPES = {
    "w13_weight": (E, 2 * N, K),
    "w2_weight": (E, K, N),
    "w13_weight_scale": (E,),
    "w2_weight_scale": (E,),
    "w13_input_scale": (1,),
    "w2_input_scale": (1,),
}


class ExpertsLayer(nn.Module):
    """vLLM's RoutedExperts as the layerwise reload sees it: the FP8 MoE parameters and the quant method."""

    def __init__(self, method: Any) -> None:
        super().__init__()
        self.quant_method = method
        self.quant_config = SimpleNamespace(online_quantization_config=None)  # read by the online timing context
        for name, shape in MOE_SHAPES.items():
            param = nn.Parameter(torch.empty(shape), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": default_weight_loader})
            self.register_parameter(name, param)


class MoEModel(nn.Module):
    def __init__(self, method_cls: type) -> None:
        super().__init__()
        self.experts = ExpertsLayer(object.__new__(method_cls))  # the real class; its PWAL is the builder above

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].weight_loader(params[name], tensor)
        return set(params)


def moe_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in MOE_SHAPES.items():
        value = torch.rand(shape, generator=g) + 0.5 if "scale" in name else torch.randn(shape, generator=g)
        out[f"experts.{name}"] = value
    return out


def build_moe(config: VllmConfig, method_cls: type, seed: int) -> MoEModel:
    with set_current_vllm_config(config):
        model = MoEModel(method_cls)
        layerwise.record_metadata_for_reloading(model)
        model.load_weights(moe_checkpoint(seed).items())
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model


def fused_experts(model: MoEModel) -> Any:
    return model.experts.quant_method.moe_kernel.impl.fused_experts


def _quant_class(name: str) -> type:
    import importlib

    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


FP8_MOE = "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod"
ONLINE_FP8_MOE = "vllm.model_executor.layers.quantization.online.fp8:Fp8PerTensorOnlineMoEMethod"
QUARK_FP8_MOE = "vllm.model_executor.layers.quantization.quark.quark_moe:QuarkW8A8Fp8MoEMethod"
TRTLLM_DERIVED = ("_g1_alphas", "_g2_alphas", "_g1_scale_c")
CUTLASS_STRIDES = ("ab_strides1", "ab_strides2", "c_strides1", "c_strides2")


def _reload_moe_and_judge(
    config: VllmConfig, method_cls: type, names: tuple[str, ...]
) -> tuple[Any, list[str], list[str], list[str]]:
    """Reload DIFFERENT weights through vLLM's reload_weights; returns (outcome, moved, stale-at-captured, changed
    by the new weights)."""
    model = build_moe(config, method_cls, seed=0)
    captured = {name: getattr(fused_experts(model), name) for name in names}  # what the captured graph reads
    before = {name: t.clone() for name, t in captured.items()}
    pointers = {name: t.data_ptr() for name, t in captured.items()}
    inplace.reload_weights(config, model, iter(moe_checkpoint(1).items()), None, True)
    outcome = gs_vllm.current_state().last_outcome
    fresh = fused_experts(build_moe(config, method_cls, seed=1))  # the oracle: a cold load of the new weights
    live = fused_experts(model)
    moved = [name for name in names if getattr(live, name).data_ptr() != pointers[name]]
    stale = [name for name in names if not torch.equal(captured[name], getattr(fresh, name))]
    changed = [name for name in names if not torch.equal(before[name], getattr(fresh, name))]
    return outcome, moved, stale, changed


# -- 1. the declarations pack ---------------------------------------------------------------------------------------
def test_pack_misses_trtllm_fp8_per_tensor_alphas_declared_only_commits_stale(
    vllm_config: VllmConfig, plugin: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fp8MoEMethod (a pack entry) on the FlashInfer TRT-LLM backend with per-tensor scales. vLLM's
    ``TrtLlmFp8ExpertsMonolithic.__init__`` (experts/trtllm_fp8_moe.py:370-376) computes ``_g1_alphas = w1_scale *
    a1_scale``, ``_g2_alphas`` and ``_g1_scale_c`` as NEW tensors derived from the weight scales, read by every launch
    (lines 558-561). The pack declares ``gemm1_alpha/beta/clamp_limit`` etc. on
    ``quant_method.moe_kernel.impl.fused_experts``, not these three. Under ``GRAPHSAFE_DETECT=declared-only`` nothing
    tracks them.

    Promise (1): a reload never reports success while a graph would read wrong memory. Oracle: a cold load of the
    new weights; the captured tensors' addresses must hold the new values, or the reload must not commit.
    """
    method = _quant_class(FP8_MOE)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: "cpu")  # the experts' device lookup
    monkeypatch.setattr(method, "process_weights_after_loading", _kernel_builder("trtllm", True))
    plugin("strict", detect="declared-only")
    outcome, moved, stale, changed = _reload_moe_and_judge(vllm_config, method, TRTLLM_DERIVED)
    assert changed, "the scenario needs the derived scales to change with the weights"
    assert not outcome.committed or not (moved or stale), (
        f"committed while the TRT-LLM experts' {moved} moved to new storage; the captured ones hold the old "
        f"weights' values ({stale} differ from a cold load)"
    )


@pytest.mark.parametrize("target", [ONLINE_FP8_MOE, QUARK_FP8_MOE], ids=["online-fp8", "quark-w8a8-fp8"])
def test_pack_misses_fp8_moe_methods_that_build_the_same_cutlass_kernel(
    vllm_config: VllmConfig, plugin: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """The FP8 MoE methods outside the pack that build the same ``make_fp8_moe_kernel`` kernel as Fp8MoEMethod:
    ``Fp8PerTensorOnlineMoEMethod`` (``quantization="fp8"`` on a bf16 checkpoint, the usual RL set-up;
    online/fp8.py:556) and ``QuarkW8A8Fp8MoEMethod`` (quark_moe.py:969). With the VLLM_CUTLASS backend every PWAL
    allocates new CUTLASS stride tables on the experts object (cutlass_moe.py:300-310), which the pack declares for
    Fp8MoEMethod only. Under ``declared-only`` they move unseen. (Control, checked while writing this: the same builder
    on Fp8MoEMethod restores all four and commits.)

    Promise (1): never commit while a captured address no longer holds what the graph must read (here: the old
    stride tables are freed, the graph reads freed memory).
    """
    method = _quant_class(target)
    monkeypatch.setattr(method, "process_weights_after_loading", _kernel_builder("cutlass", False))
    plugin("strict", detect="declared-only")
    outcome, moved, stale, _ = _reload_moe_and_judge(vllm_config, method, CUTLASS_STRIDES)
    assert not outcome.committed or not (moved or stale), (
        f"committed while the CUTLASS stride tables {moved} moved (not in the pack)"
    )


# -- 2. the serving gate blocks vLLM's own recapture -----------------------------------------------------------------
class DispatchingRunner(SpyRunner):
    """A V1 model runner whose capture does what vLLM's does for each capture size: ``_dummy_run`` asks
    ``_determine_batch_execution_and_padding`` (vLLM's real method, on vLLM's real dispatcher) for the batch's
    mode and asserts it equals the mode being captured (gpu_model_runner.py:5557-5588)."""

    def __init__(self, config: VllmConfig, model: nn.Module, calls: list[str], dispatcher: Any) -> None:
        super().__init__(config, model, calls)
        del self.req_states, self.block_tables, self.cudagraph_manager  # a V1 runner: no V2 graph manager
        self.requests: dict[str, Any] = {}
        self.cudagraph_dispatcher = dispatcher
        self.uniform_decode_query_len = 1
        self.model_config = config.model_config
        self.parallel_config = config.parallel_config

    def capture_model(self) -> int:
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        self._is_uniform_decode = GPUModelRunner._is_uniform_decode
        for num_tokens in (8, 4, 2, 1):
            capturing = CUDAGraphMode.PIECEWISE
            mode, *_ = GPUModelRunner._determine_batch_execution_and_padding(
                self,
                num_tokens=num_tokens,
                num_reqs=num_tokens,
                num_scheduled_tokens_np=np.ones(num_tokens, dtype=np.int32),
                max_num_scheduled_tokens=1,
                force_eager=False,
                force_uniform_decode=False,
                force_has_lora=False,
                force_num_active_loras=0,
            )
            assert capturing == mode, (
                f"Cudagraph runtime mode mismatch in dummy_run. Expected {mode}, but got {capturing}."
            )
            self.calls.append(f"captured {num_tokens}")
        return 0


@pytest.mark.parametrize("route", ["mode-recapture", "graphsafe_recapture"])
def test_the_serving_gate_makes_vllms_v1_recapture_assert(
    vllm_config: VllmConfig,
    plugin: Callable[..., Any],
    workspace: list[str],
    monkeypatch: pytest.MonkeyPatch,
    route: str,
) -> None:
    """A reload that needs its graphs captured again, on model runner V1. The recapture runs while the
    contract is not serving-safe (``_apply`` marks it unsafe before the callback; ``graphsafe_recapture`` reseals
    only after the capture), so the serving gate (``_wrap_dispatch_v1``) answers NONE to the capture's own
    dispatch, and vLLM's ``_dummy_run`` asserts that the dispatched mode equals the mode it captures.

    Promise (4): the plugin must not break vLLM; and the documented way back to serving-safe (the mode's own
    recapture, ``collective_rpc("graphsafe_recapture")``) must work. Observed: the recapture raises vLLM's
    "Cudagraph runtime mode mismatch" assertion and the engine stays eager for good.
    """
    dispatcher = _dispatcher(vllm_config, monkeypatch)
    from graphsafe.errors import UndeclaredDriftError

    plugin("recapture" if route == "mode-recapture" else "strict")
    model = build(vllm_config, seed=0)  # DerivedLinearMethod: undeclared tensors drift on every reload
    runner = DispatchingRunner(vllm_config, model, workspace, dispatcher)
    runner.capture_model()  # the engine's first capture, before any reload: the gate is open
    assert workspace[-1] == "captured 1"
    workspace.clear()
    gs_vllm.bind(model, runner)
    if route == "mode-recapture":
        inplace.reload_weights(vllm_config, model, iter(checkpoint(41).items()), None, True)
        assert gs_vllm.current_state().last_outcome.needs_recapture
    else:
        with pytest.raises(UndeclaredDriftError):
            inplace.reload_weights(vllm_config, model, iter(checkpoint(41).items()), None, True)

        class Extended(gs_vllm.GraphsafeWorkerExtension):
            model_runner = runner

        Extended().graphsafe_recapture()
    assert "captured 1" in workspace
    assert gs_vllm.current_state().contracts[model].serving_safe


# -- 3. an entry point of reload_weights that is not guarded ---------------------------------------------------------
def test_reload_weights_in_kernel_format_is_unguarded_and_leaves_a_declared_slot_stale(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """``reload_weights(..., is_checkpoint_format=False)`` (``collective_rpc("reload_weights",
    kwargs={"weights_iterator": ..., "is_checkpoint_format": False})``): vLLM copies the parameters in place
    (inplace.py: ``param.copy_``) and runs no PWAL, no initialize, no finalize. The plugin wraps this very function
    (docs/vllm.md: "The plugin guards ... reload_weights") but opens no transaction for this branch: the author-declared
    derived slot ``w_t`` keeps the old weights' values, no outcome is recorded, the last outcome still says
    ``committed``, and the contract (and so the serving gate) stays serving-safe.

    Promise (1)/(3): a reload never reports success (here: the status the plugin exposes) while a graph reads
    wrong values. Oracle: a cold load of the same new weights.
    """
    plugin("strict")
    model = build(vllm_config, seed=0, method=DeclaredLinearMethod)
    state = gs_vllm.current_state()
    inplace.reload_weights(vllm_config, model, iter(checkpoint(42).items()), None, True)  # a guarded reload
    reloads = state.contracts[model].reloads
    fresh = build(vllm_config, seed=43, method=DeclaredLinearMethod)
    kernel_format = [(name, p.detach().clone()) for name, p in fresh.named_parameters()]
    inplace.reload_weights(vllm_config, model, iter(kernel_format), None, False)
    assert torch.equal(model.qkv.weight, fresh.qkv.weight), "vLLM loaded the new weights"
    assert not torch.equal(model.qkv.w_t, fresh.qkv.w_t), "the declared derived slot kept the old values"
    contract = state.contracts[model]
    assert contract.reloads > reloads or not contract.serving_safe, (
        "a reload that left a declared graph-visible slot stale went unrecorded; the last outcome still reads "
        f"{contract.last_outcome.status.value!r} and the serving gate stays open"
    )
