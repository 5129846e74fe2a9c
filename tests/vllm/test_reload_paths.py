"""The vLLM adapter's reload paths (the toolkit and plugin ones are in
``tests/tools/test_toolkit_plugin_advice.py``). Runs in ``.venv-vllm`` on CPU with vLLM's own reload code.

Each docstring names the reload that could break a promise, and the promise it must keep.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (these tests run in .venv-vllm)")

import torch
from test_vllm_adapter import (  # the adapter suite's harness (fixtures and helpers; no tests imported)
    DeclaredLinearMethod,
    StubRunner,
    build,
    checkpoint,
    plugin,
    vllm_config,
)
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.model_loader.reload import inplace, layerwise
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from graphsafe.adapters import vllm as gs_vllm
from graphsafe.errors import ContractViolation

__all__ = ["plugin", "vllm_config"]  # fixtures used by name below


def test_a_first_reload_in_kernel_format_is_guarded_like_a_checkpoint_one(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """A model loaded outside vLLM's runner and bound to it (``graphsafe.adapters.vllm.bind``, the documented way), or
    loaded before the plugin was turned on, has no contract until its first reload: the layerwise route seals one when
    it begins (``begin`` -> ``ensure_contract``). The kernel-format route (``reload_weights(...,
    is_checkpoint_format=False)``) opens its whole-model transaction only ``if model in state.contracts``, so a first
    reload that way copies the new weights in with no transaction at all: the author-declared derived slot ``w_t`` keeps
    the old weights' values, no outcome is recorded and no contract (so no serving gate) exists.

    Promise (1): docs/vllm.md, "A reload_weights(..., is_checkpoint_format=False) ... runs inside one
    whole-model transaction: a derived tensor computed from the old weights is then reported stale, not left
    silently." Oracle: a cold load of the same new weights.
    """
    plugin("strict")
    model = build(vllm_config, seed=0, method=DeclaredLinearMethod)
    gs_vllm.bind(model, StubRunner(vllm_config, model))  # a model loaded outside the runner, bound to it
    fresh = build(vllm_config, seed=43, method=DeclaredLinearMethod)
    kernel_format = [(name, p.detach().clone()) for name, p in fresh.named_parameters()]
    with pytest.raises(ContractViolation):  # strict: the stale declared slot fails the reload
        inplace.reload_weights(vllm_config, model, iter(kernel_format), None, False)
    assert torch.equal(model.qkv.weight, fresh.qkv.weight), "vLLM loaded the new weights"
    assert not torch.equal(model.qkv.w_t, fresh.qkv.w_t), "the declared derived slot kept the old values"
    state = gs_vllm.current_state()
    contract = state.contracts.get(model)
    assert contract is not None and not contract.serving_safe
    assert state.last_outcome is not None and not state.last_outcome.committed


def test_the_serving_gate_keeps_vllms_encoder_cuda_graphs_from_replaying(
    vllm_config: VllmConfig, plugin: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multimodal model served on model runner V1 with encoder CUDA graphs (vLLM 0.33's ``EncoderCudaGraphManager``,
    ``compilation_config.encoder_cudagraph_token_budgets``). Its graphs replay from
    ``GPUModelRunner._execute_mm_encoder`` through ``EncoderCudaGraphManager.execute`` -> ``graph.replay()``, never
    through ``CudagraphDispatcher.dispatch``, the only V1 path the serving gate wraps. After a failed reload the decoder
    runs eager, but every image still goes through the captured encoder graphs, which read the encoder's memory as it
    was captured (stale, or freed and reused).

    Promise (1): docs/vllm.md, "After a FAILED reload ... the engine keeps serving but runs eager ... so no
    captured graph replays". Oracle: the contract is not serving-safe (the dispatcher gate is closed), and the
    encoder manager's graph path runs anyway. vLLM's own fallback for "no graph" is ``execute`` returning
    ``None`` (the runner then calls ``model.embed_multimodal``).
    """
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    from graphsafe.errors import UndeclaredDriftError

    plugin("strict")
    model = build(vllm_config, seed=0)  # DerivedLinearMethod: undeclared tensors drift on every reload
    gs_vllm.bind(model, StubRunner(vllm_config, model))
    with pytest.raises(UndeclaredDriftError):
        inplace.reload_weights(vllm_config, model, iter(checkpoint(29).items()), None, True)
    assert not gs_vllm.current_state().contracts[model].serving_safe

    replayed: list[str] = []
    manager = object.__new__(EncoderCudaGraphManager)  # the real class; its replay path is a spy
    manager.use_dp = False
    manager.graph_hits = manager.graph_misses = 0
    manager.log_stats_interval = 100
    monkeypatch.setattr(manager, "get_cumulative_stats", lambda: {})
    monkeypatch.setattr(manager, "_execute_local", lambda mm_kwargs: replayed.append("graph.replay()") or [])
    output = manager.execute({"pixel_values": torch.zeros(1)})
    assert replayed == [], "an encoder CUDA graph replayed while the contract is not serving-safe"
    assert output is None, "vLLM's runner falls back to eager embed_multimodal on None"


# -- the declarations pack: the humming FP8 linear kernel's locks, on the FP8 linear methods besides Fp8LinearMethod --
_QUANT = "vllm.model_executor.layers.quantization"
#: (class whose PWAL builds the kernel, the linear method delegating to it when that class is a scheme)
HUMMING_LINEAR_METHODS = (
    (f"{_QUANT}.online.fp8:Fp8PerTensorOnlineLinearMethod", None),
    (f"{_QUANT}.online.fp8:Fp8PerBlockOnlineLinearMethod", None),
    (f"{_QUANT}.online.fp8:Fp8PtpcOnlineLinearMethod", None),
    (f"{_QUANT}.fbgemm_fp8:FBGEMMFp8LinearMethod", None),
    (
        f"{_QUANT}.compressed_tensors.schemes.compressed_tensors_w8a8_fp8:CompressedTensorsW8A8Fp8",
        f"{_QUANT}.compressed_tensors.compressed_tensors:CompressedTensorsLinearMethod",
    ),
    (f"{_QUANT}.quark.schemes.quark_w8a8_fp8:QuarkW8A8Fp8", f"{_QUANT}.quark.quark:QuarkLinearMethod"),
    (f"{_QUANT}.quark.schemes.quark_w8a8_fp8:QuarkW8A8Fp8PerBlock", f"{_QUANT}.quark.quark:QuarkLinearMethod"),
)


def _humming_pwal(self: Any, layer: nn.Module) -> None:
    """The graph-visible part of these methods' PWAL on the humming kernel: ``self.fp8_linear`` (a
    ``HummingFP8ScaledMMLinearKernel``) makes new lock tensors on every load (``create_humming_locks``, zeros)."""
    self.fp8_linear = SimpleNamespace(locks=torch.zeros(16, dtype=torch.int32))


class _HummingLayer(nn.Module):
    def __init__(self, method: Any, scheme: Any = None) -> None:
        super().__init__()
        self.quant_method = method
        if scheme is not None:  # compressed-tensors and Quark: the linear method delegates PWAL to layer.scheme
            self.scheme = scheme
        self.quant_config = SimpleNamespace(online_quantization_config=None)
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})


class _HummingModel(nn.Module):
    def __init__(self, target: str, linear: str | None) -> None:
        super().__init__()
        kernel_owner = object.__new__(_quant_class(target))  # the real class; its PWAL is the part above
        if linear is None:
            self.proj = _HummingLayer(kernel_owner)
        else:
            self.proj = _HummingLayer(object.__new__(_quant_class(linear)), kernel_owner)

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].weight_loader(params[name], tensor)
        return set(params)


def _humming_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [("proj.weight", torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)))]


@pytest.mark.parametrize(("target", "linear"), HUMMING_LINEAR_METHODS, ids=lambda t: str(t).rpartition(":")[2])
@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
def test_the_pack_keeps_the_humming_locks_of_every_fp8_linear_method(
    vllm_config: VllmConfig,
    plugin: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    linear: str | None,
    detect: str,
) -> None:
    """The humming FP8 linear kernel (``kernels/linear/scaled_mm/humming.py``) allocates new lock tensors
    in its PWAL; the pack declares them (static) for ``Fp8LinearMethod`` only, but the online FP8 linear methods
    (``quantization="fp8"`` on a bf16 checkpoint, the usual RL set-up) and FBGEMM FP8 hold the same kernel at the
    same path, ``quant_method.fp8_linear``, and the compressed-tensors and Quark W8A8 FP8 schemes at
    ``scheme.fp8_linear``. In strict mode every reload of such an engine then raises
    ``UndeclaredDriftError`` (a false alarm on every reload: the locks are zeros); under
    ``GRAPHSAFE_DETECT=declared-only`` the reload commits while the graph's lock tensor was freed (PWAL dropped
    it), so the kernel's semaphores live in memory the allocator hands out again.

    Promise (1): never commit while a captured address is not held; and the pack must describe the 0.33 methods
    that build this kernel. Oracle: the captured lock tensor's storage, held weakly: after the reload it must be
    alive and at the path.
    """
    import weakref

    monkeypatch.setattr(_quant_class(target), "process_weights_after_loading", _humming_pwal)
    plugin("strict", detect=detect)
    with set_current_vllm_config(vllm_config):
        model = _HummingModel(target, linear)
        layerwise.record_metadata_for_reloading(model)
        model.load_weights(_humming_weights(0))
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    kernel_owner = model.proj.quant_method if linear is None else model.proj.scheme
    captured = kernel_owner.fp8_linear.locks
    pointer, storage = captured.data_ptr(), weakref.ref(captured.untyped_storage())
    del captured
    inplace.reload_weights(vllm_config, model, iter(_humming_weights(1)), None, True)  # no false alarm
    outcome = gs_vllm.current_state().last_outcome
    assert outcome is not None and outcome.committed
    assert storage() is not None, "committed while the captured lock tensor was freed"
    assert kernel_owner.fp8_linear.locks.data_ptr() == pointer


def _quant_class(name: str) -> type:
    import importlib

    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)
