"""The vLLM declarations pack declares the scratch vLLM layers make lazily in forward (no vLLM needed here).

``HpcRopeNorm._kv_write_scratch`` makes ``_kv_scratch`` (zeros: throwaway K/V pages the fused kernel writes and
nothing reads back) on the first forward per (dtype, block size, device). Undeclared, a reload that changes the
layer's norm weights finds it ``stale`` in every mode (vLLM's own
``test_hpc_rope_norm_kernel_sees_refit_norm_weights``). The pack declares it static when it is made. The entry is
applied here to a stand-in with the same method body (vLLM is not installed in this environment).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, Status
from graphsafe.adapters.vllm import PACK, PackEntry
from graphsafe.adapters.vllm._hooks import HookSet
from graphsafe.adapters.vllm._pack import apply_pack

HPC_ROPE_NORM = "vllm.model_executor.layers.hpc.rope_norm:HpcRopeNorm"


class HpcRopeNormLike(nn.Module):
    """vLLM's HpcRopeNorm as far as a reload sees it: fallback norms as submodules, scratch made in forward."""

    def __init__(self, head_dim: int = 8, num_kv_heads: int = 1) -> None:
        super().__init__()
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        self.fallback_qnorm = nn.LayerNorm(head_dim)
        self.fallback_knorm = nn.LayerNorm(head_dim)

    def _kv_write_scratch(self, cache: torch.Tensor) -> torch.Tensor:  # vLLM's body
        block_size = cache.shape[1]
        key = (cache.dtype, block_size, cache.device)
        if getattr(self, "_kv_scratch_key", None) != key:
            self._kv_scratch = torch.zeros(
                2, 1, block_size, self.num_kv_heads, self.head_dim, dtype=cache.dtype, device=cache.device
            )
            self._kv_scratch_key = key
        return self._kv_scratch

    def forward(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        scratch = self._kv_write_scratch(cache)
        scratch.zero_()  # the kernel's throwaway writes
        return self.fallback_qnorm(q)


def _entry() -> PackEntry:
    (entry,) = [e for e in PACK if e.target == HPC_ROPE_NORM]
    return entry


def test_the_pack_declares_hpc_rope_norm_scratch_static_where_it_is_made() -> None:
    entry = _entry()
    assert (entry.method, entry.paths, entry.static) == ("_kv_write_scratch", ("_kv_scratch",), ("_kv_scratch",))


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_refit_of_the_norm_weights_commits_with_the_scratch_declared(mode: str) -> None:
    entry = _entry()
    stand_in = PackEntry(f"{__name__}:HpcRopeNormLike", entry.paths, entry.site, entry.method, entry.static)
    hooks = HookSet()
    try:
        result = apply_pack([stand_in], hooks.patch)
        assert result.applied == [stand_in], result.stale
        layer = HpcRopeNormLike()
        q, cache = torch.randn(2, 8), torch.zeros(3, 4, 8)
        layer(q, cache)  # warm-up: the scratch is made (and declared)
        contract = GraphContract(layer, mode, detect="every-reload").seal()  # type: ignore[arg-type]

        def refit() -> None:
            with torch.no_grad():
                layer.fallback_qnorm.weight.fill_(2.0)
                layer.fallback_knorm.weight.fill_(3.0)
            layer(q, cache)

        with contract.reload():
            refit()
        outcome: Any = contract.last_outcome
        assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
        assert result.usage[stand_in.name]["_kv_scratch"][0] >= 1
    finally:
        hooks.uninstall()
