"""Attacks on the vLLM adapter's reload paths (session s6, "tools" focus; the rest is in
``tests/test_attack_s6_tools.py``). Runs in ``.venv-vllm`` on CPU with vLLM's own reload code.

Each test FAILED on the code it was written against; its docstring names the attack and the promise it breaks.
"""

from __future__ import annotations

from collections.abc import Callable
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
from vllm.config import VllmConfig
from vllm.model_executor.model_loader.reload import inplace

from graphsafe.adapters import vllm as gs_vllm
from graphsafe.errors import ContractViolation

__all__ = ["plugin", "vllm_config"]  # fixtures used by name below


def test_a_first_reload_in_kernel_format_is_guarded_like_a_checkpoint_one(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """Attack: a model loaded outside vLLM's runner and bound to it (``graphsafe.adapters.vllm.bind``, the
    documented way), or loaded before the plugin was turned on, has no contract until its first reload: the
    layerwise route seals one when it begins (``begin`` -> ``ensure_contract``). The kernel-format route
    (``reload_weights(..., is_checkpoint_format=False)``) opens its whole-model transaction only
    ``if model in state.contracts``, so a first reload that way copies the new weights in with no transaction at
    all: the author-declared derived slot ``w_t`` keeps the old weights' values, no outcome is recorded and no
    contract (so no serving gate) exists.

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
    """Attack: a multimodal model served on model runner V1 with encoder CUDA graphs (vLLM 0.33's
    ``EncoderCudaGraphManager``, ``compilation_config.encoder_cudagraph_token_budgets``). Its graphs replay from
    ``GPUModelRunner._execute_mm_encoder`` through ``EncoderCudaGraphManager.execute`` -> ``graph.replay()``,
    never through ``CudagraphDispatcher.dispatch``, the only V1 path the serving gate wraps. After a failed reload
    the decoder runs eager, but every image still goes through the captured encoder graphs, which read the
    encoder's memory as it was captured (stale, or freed and reused).

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
