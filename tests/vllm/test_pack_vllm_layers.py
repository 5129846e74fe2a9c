"""The declarations pack on vLLM 0.33's own layers: tensors a layer makes outside weight loading and PWAL.

Each test builds the real vLLM layer on CPU, runs the method that makes the tensor (as the engine does once the
model is loaded), seals a ``strict`` contract, reloads DIFFERENT weights in place (as vLLM's reload copies them
back into the captured storage) and requires COMMITTED with the pack applied; without the pack's entry the same
reload must fail strict naming the tensor (the red check). docs/vllm.md ("What the pack audited") lists every
pattern found, with what the pack declares for it or why it declares nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from math import prod
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (these tests run in .venv-vllm)")

import torch
from test_vllm_adapter import vllm_config  # the adapter suite's harness (a fixture; no tests imported)
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.utils.torch_utils import get_dtype_size

from graphsafe import GraphContract, Status
from graphsafe.adapters.vllm import PACK, PackEntry
from graphsafe.adapters.vllm._hooks import HookSet
from graphsafe.adapters.vllm._pack import apply_pack, declare_loaded
from graphsafe.errors import ContractViolation
from graphsafe.registry import declarations_of

__all__ = ["vllm_config"]  # a fixture used by name below

MAMBA_BASE = "vllm.model_executor.layers.mamba.abstract:MambaBase"


def entry(target: str, method: str) -> PackEntry:
    (found,) = [e for e in PACK if e.target == target and e.method == method]
    return found


@pytest.fixture
def pack() -> Iterator[Callable[[PackEntry], None]]:
    """``pack(entry)`` applies one of the pack's entries to the installed vLLM; undone after the test."""
    hooks = HookSet()

    def apply(chosen: PackEntry) -> None:
        result = apply_pack([chosen], hooks.patch)
        assert result.applied == [chosen], result.stale

    yield apply
    hooks.uninstall()


def refill(model: nn.Module, seed: int) -> None:
    """New weights copied into every parameter in place: vLLM's reload restores into the captured storage."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g))


def reload_outcome(model: nn.Module, seed: int) -> Any:
    """A strict contract sealed now, then one reload of new weights; the outcome (FAILED when strict raised)."""
    contract = GraphContract(model, "strict", detect="every-reload").seal()
    try:
        with contract.reload():
            refill(model, seed)
    except ContractViolation:
        pass
    return contract.last_outcome


# -- Mamba-like layers: the state cache bound in bind_kv_cache ------------------------------------------------------
def short_conv(config: VllmConfig, prefix: str) -> nn.Module:
    """vLLM's ShortConv (LFM2's conv layer), the smallest real MambaBase, loaded with random weights."""
    from vllm.model_executor.layers.mamba.short_conv import ShortConv

    with set_current_vllm_config(config):
        layer = ShortConv(
            SimpleNamespace(conv_L_cache=3, conv_bias=False),
            layer_idx=0,
            dim=16,
            model_config=config.model_config,
            cache_config=config.cache_config,
            prefix=prefix,
        )
    refill(layer, seed=0)
    return layer


def bind_state(layer: Any, blocks: int = 4) -> None:
    """What vLLM's runner does once the KV cache is allocated: one raw int8 page per block, bound to the layer
    (``bind_kv_cache`` slices it into the layer's state views); then a forward pass writes the states."""
    with set_current_vllm_config(layer.vllm_config_for_test):
        shapes, dtypes = layer.get_state_shape(), layer.get_state_dtype()
    page = sum(prod(shape) * get_dtype_size(dtype) for shape, dtype in zip(shapes, dtypes, strict=True))
    layer.bind_kv_cache(torch.zeros(blocks, 1, 1, page, dtype=torch.int8))
    for state in layer.kv_cache:
        state.fill_(0.5)  # serving state a forward pass wrote


@pytest.fixture
def mamba_layer(vllm_config: VllmConfig, request: pytest.FixtureRequest) -> nn.Module:
    layer = short_conv(vllm_config, prefix=f"graphsafe.{request.node.name}")
    layer.vllm_config_for_test = vllm_config
    return layer


def test_the_pack_declares_a_mamba_layers_state_static_where_it_is_bound(
    mamba_layer: Any, pack: Callable[[PackEntry], None]
) -> None:
    pack(entry(MAMBA_BASE, "bind_kv_cache"))
    bind_state(mamba_layer)
    declared = {name: d.static for name, d in declarations_of(mamba_layer).items()}
    assert declared == {"kv_cache[0]": True}, declared  # ShortConv has one state (conv)
    outcome = reload_outcome(mamba_layer, seed=1)
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()


def test_without_the_pack_a_mamba_layers_state_fails_strict(mamba_layer: Any) -> None:
    bind_state(mamba_layer)
    outcome = reload_outcome(mamba_layer, seed=1)
    assert outcome is not None and outcome.status is Status.FAILED
    assert any(f.path == "kv_cache[0]" for f in outcome.findings), outcome.summary()


# -- attention-like layers: the KV cache bound in bind_kv_cache -----------------------------------------------------
ATTENTION_BASE = "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase"


def with_weights(layer: nn.Module) -> nn.Module:
    """A model around a cache layer, with a weight a reload changes (a cache layer holds none of its own)."""
    model = nn.Module()
    model.proj = nn.Linear(4, 4)
    model.cache = layer
    return model


def cache_layer() -> nn.Module:
    """An attention-like layer on vLLM's own ``AttentionLayerBase.bind_kv_cache`` (as vLLM's cache-only and
    Step5 cache layers are): a module that holds nothing but the cache vLLM binds."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class CacheLayer(nn.Module, AttentionLayerBase):
        def __init__(self) -> None:
            super().__init__()
            self.kv_cache = torch.tensor([])

        def get_attn_backend(self) -> Any:
            raise NotImplementedError

        def get_kv_cache_spec(self, vllm_config: VllmConfig) -> Any:
            raise NotImplementedError

    return CacheLayer()


def indexer_cache(config: VllmConfig, prefix: str) -> nn.Module:
    """DeepSeek V3.2's indexer cache (vLLM's DeepseekV32IndexerCache), which overrides bind_kv_cache."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    with set_current_vllm_config(config):
        return DeepseekV32IndexerCache(8, torch.float32, prefix, config.cache_config)


def test_the_pack_declares_a_kv_cache_static_where_the_base_class_binds_it(
    pack: Callable[[PackEntry], None],
) -> None:
    pack(entry(ATTENTION_BASE, "bind_kv_cache"))
    model = with_weights(cache_layer())
    model.cache.bind_kv_cache(torch.full((4, 16, 2, 8), 0.5))  # what the runner binds; forward passes write it
    assert {n: d.static for n, d in declarations_of(model.cache).items()} == {"kv_cache": True}
    outcome = reload_outcome(model, seed=1)
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()


def test_an_override_of_bind_kv_cache_is_declared_when_its_contract_seals(
    vllm_config: VllmConfig, request: pytest.FixtureRequest
) -> None:
    """DeepseekV32IndexerCache binds its cache in its own bind_kv_cache, which no entry wraps: the pack's
    instance rule (``declare_loaded``, run by the plugin before it seals a model) declares it, and the reseal
    after the capture seals the bound cache."""
    hooks = HookSet()
    try:
        result = apply_pack([entry(ATTENTION_BASE, "bind_kv_cache")], hooks.patch)
        model = with_weights(indexer_cache(vllm_config, f"graphsafe.{request.node.name}"))
        declare_loaded(result, model)  # the plugin's ensure_contract, at the load
        contract = GraphContract(model, "strict", detect="every-reload").seal()
        model.cache.bind_kv_cache(torch.zeros(4, 1, 16, 8))  # the KV cache is allocated after the load
        model.cache.kv_cache.fill_(0.5)
        contract.note_capture()
        contract.reseal()  # what the plugin does after vLLM captured its graphs
        assert {n: d.static for n, d in declarations_of(model.cache).items()} == {"kv_cache": True}
        with contract.reload():
            refill(model, seed=1)
        outcome = contract.last_outcome
        assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    finally:
        hooks.uninstall()


@pytest.mark.parametrize("layer", ["base", "override"])
def test_without_the_pack_an_attention_like_layers_kv_cache_fails_strict(
    vllm_config: VllmConfig, layer: str, request: pytest.FixtureRequest
) -> None:
    made = cache_layer() if layer == "base" else indexer_cache(vllm_config, f"graphsafe.{request.node.name}")
    model = with_weights(made)
    model.cache.bind_kv_cache(torch.full((4, 1, 16, 8), 0.5))
    outcome = reload_outcome(model, seed=1)
    assert outcome is not None and outcome.status is Status.FAILED
    assert any(f.path == "kv_cache" for f in outcome.findings), outcome.summary()


# -- static sink attention: the sink key handed over by the model after every load ----------------------------------
SINK = "vllm.model_executor.layers.attention.static_sink_attention:StaticSinkAttention"


class PanguAttentionLike(nn.Module):
    """openPangu's attention as far as its sinks go: sink parameters, a k norm, and vLLM's StaticSinkAttention,
    handed the sink key and value by ``post_weight_load`` after every ``load_weights``."""

    def __init__(self) -> None:
        from vllm.model_executor.layers.attention.static_sink_attention import StaticSinkAttention

        super().__init__()
        self.param_sink_key = nn.Parameter(torch.randn(4, 2, 8), requires_grad=False)
        self.param_sink_value = nn.Parameter(torch.randn(4, 2, 8), requires_grad=False)
        self.k_layernorm = nn.LayerNorm(8)
        attn = object.__new__(StaticSinkAttention)  # vLLM's class (no attention backend here to build one with)
        nn.Module.__init__(attn)
        self.attn = attn

    def post_weight_load(self) -> None:  # openPangu's body
        self.attn.update_sink_kv(self.k_layernorm(self.param_sink_key), self.param_sink_value)


def reload_sinks(model: PanguAttentionLike, seed: int) -> Any:
    contract = GraphContract(model, "strict", detect="every-reload").seal()
    try:
        with contract.reload():
            refill(model, seed)  # load_weights copies the new weights in ...
            with torch.no_grad():
                model.post_weight_load()  # ... and then hands the sinks over again
    except ContractViolation:
        pass
    return contract.last_outcome


def test_the_pack_declares_the_sink_key_static_sink_attention_is_handed(pack: Callable[[PackEntry], None]) -> None:
    pack(entry(SINK, "update_sink_kv"))
    model = PanguAttentionLike()
    with torch.no_grad():
        model.post_weight_load()  # the first load
    assert set(declarations_of(model.attn)) == {"sink_key", "sink_value"}
    captured = model.attn.sink_key.data_ptr()
    outcome = reload_sinks(model, seed=1)
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    expected = torch.nn.functional.layer_norm(model.param_sink_key, (8,), model.k_layernorm.weight)
    assert model.attn.sink_key.data_ptr() == captured, "restored into the captured storage"
    assert torch.allclose(model.attn.sink_key, expected + model.k_layernorm.bias), "with the new sink key's values"


def test_without_the_pack_a_rebuilt_sink_key_fails_strict() -> None:
    model = PanguAttentionLike()
    with torch.no_grad():
        model.post_weight_load()
    outcome = reload_sinks(model, seed=1)
    assert outcome is not None and outcome.status is Status.FAILED
    assert any(f.path == "sink_key" for f in outcome.findings), outcome.summary()
