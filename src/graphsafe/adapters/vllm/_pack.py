"""The declarations pack: graph-visible paths of vLLM's own quant methods, applied without editing vLLM.

Each :class:`PackEntry` names a class by qualified name, the method that creates graph-visible tensors (its
``process_weights_after_loading``) and the slot paths, relative to the layer, that the method assigns. At plugin
load the method is wrapped: after it returns, every listed path that resolves to a tensor on that layer is
declared (as ``@graph_visible`` would), so the contract restores those slots in every mode, strict included.

Entries are checked against the installed vLLM: an entry whose module, class or method is missing is reported in
:attr:`PackResult.stale`, never dropped silently. Paths are conditional in vLLM (a backend, an activation scheme
or a checkpoint flag decides which exist), so a path that does not resolve on a given layer is counted, not an
error; :attr:`PackResult.usage` shows which paths were ever declared.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.paths import SlotPath
from graphsafe.registry import GRAPH_VISIBLE_ATTR, GraphVisibleSpec, declare, layer_of_call

__all__ = ["PACK", "PackEntry", "PackResult", "StaleEntry", "apply_pack", "declare_loaded", "validate_pack"]

PACK_ATTR = "__graphsafe_pack__"
_PWAL = "process_weights_after_loading"

# Where vLLM 0.33's modular MoE kernel keeps its experts object: layer.quant_method.moe_kernel.impl.fused_experts
_EXPERTS = "quant_method.moe_kernel.impl.fused_experts"
#: CUTLASS grouped-GEMM stride tables (CutlassExpertsFp8Base, CutlassExpertsW4A8Fp8): device int64 tensors the
#: experts object allocates when PWAL builds the kernel, read by every grouped GEMM launch.
_CUTLASS_STRIDES = tuple(
    f"{_EXPERTS}.{name}"
    for name in (
        "ab_strides1",
        "ab_strides2",
        "c_strides1",
        "c_strides2",
        "a_strides1",
        "a_strides2",
        "b_strides1",
        "b_strides2",
        "s_strides1",
        "s_strides2",
    )
)
#: FlashInfer / TRT-LLM MoE constants the experts object allocates (activation alpha/beta/clamp, input scales).
_FLASHINFER_CONSTANTS = tuple(
    f"{_EXPERTS}.{name}"
    for name in (
        "gemm1_alpha",
        "gemm1_beta",
        "gemm1_clamp_limit",
        "fake_input_scale",
        "_fc2_input_scale",
        "per_token_global_scale",
        # TRT-LLM FP8 per-tensor experts: products of the weight and input scales, new tensors on every kernel build
        "_g1_alphas",
        "_g2_alphas",
        "_g1_scale_c",
    )
)
_MOE_PATHS = _CUTLASS_STRIDES + _FLASHINFER_CONSTANTS
#: A Mamba-like layer's state views, ``kv_cache[i]`` (vLLM 0.33 binds at most five: conv, ssm and the ReplaySSM
#: ring's x, dt and B caches); a path past a layer's count does not resolve and is only counted.
_MAMBA_STATES = tuple(f"kv_cache[{i}]" for i in range(8))


@dataclass(frozen=True, slots=True)
class PackEntry:
    """Declarations for one vLLM class: ``target`` is ``"module:Class"``, ``paths`` are relative to the layer."""

    target: str
    paths: tuple[str, ...]
    site: str
    method: str = _PWAL
    #: paths among ``paths`` declared ``static=True``: contents the weights do not determine (serving state such
    #: as the KV cache), which a reload rightly leaves alone; their addresses are tracked like any slot's.
    static: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"pack entry {self.target!r}: target must be 'module:Class'")
        for path in self.paths:
            SlotPath(path)  # a syntax error is a bug in the pack: fail at import
        if not set(self.static) <= set(self.paths):
            raise ValueError(f"pack entry {self.target!r}: static paths {self.static} must be among its paths")

    @property
    def name(self) -> str:
        """``module:Class.method``."""
        return f"{self.target}.{self.method}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        return {
            "target": self.target,
            "method": self.method,
            "paths": list(self.paths),
            "static": list(self.static),
            "site": self.site,
        }


@dataclass(frozen=True, slots=True)
class StaleEntry:
    """A pack entry the installed vLLM does not have, and why."""

    entry: PackEntry
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        return {**self.entry.to_dict(), "reason": self.reason}


@dataclass(slots=True)
class PackResult:
    """What applying the pack did: entries applied, entries stale, and per-path declaration counts."""

    applied: list[PackEntry] = field(default_factory=list)
    stale: list[StaleEntry] = field(default_factory=list)
    #: ``entry name -> path -> [declared, not resolved]`` since the pack was applied.
    usage: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        return {
            "applied": [e.name for e in self.applied],
            "stale": [s.to_dict() for s in self.stale],
            "usage": self.usage,
        }


#: The pack for vLLM 0.33: sites whose PWAL leaves graph-visible tensors outside ``_parameters``/``_buffers``
#: (or, for MLA, parameters that are worth verifying because every decode step reads them).
PACK: tuple[PackEntry, ...] = (
    PackEntry(
        "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod",
        _MOE_PATHS,
        "FP8 MoE: PWAL rebuilds self.moe_kernel; CUTLASS stride tables / FlashInfer constants are new tensors",
    ),
    PackEntry(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
        "compressed_tensors_moe_w8a8_fp8:CompressedTensorsW8A8Fp8MoEMethod",
        _MOE_PATHS,
        "compressed-tensors W8A8 FP8 MoE: same kernel rebuild as Fp8MoEMethod",
    ),
    PackEntry(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
        "compressed_tensors_moe_w4a8_fp8:CompressedTensorsW4A8Fp8MoEMethod",
        ("quant_method.b_strides1", "quant_method.b_strides2", *_CUTLASS_STRIDES),
        "W4A8 CUTLASS MoE: PWAL re-derives b_strides1/2 on the quant method and rebuilds the experts' strides",
    ),
    PackEntry(
        "vllm.model_executor.layers.quantization.modelopt:ModelOptFp8MoEMethod",
        _MOE_PATHS,
        "ModelOpt FP8 MoE: kernel rebuild in PWAL",
    ),
    PackEntry(
        "vllm.model_executor.layers.quantization.modelopt:ModelOptNvFp4FusedMoE",
        _MOE_PATHS,
        "ModelOpt NVFP4 MoE (FlashInfer CUTLASS / TRT-LLM): kernel rebuild allocates scale constants",
    ),
    PackEntry(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
        "compressed_tensors_moe_w4a4_nvfp4:CompressedTensorsW4A4Nvfp4MoEMethod",
        _MOE_PATHS,
        "compressed-tensors NVFP4 MoE: FlashInfer kernel constants",
    ),
    PackEntry(
        "vllm.model_executor.layers.quantization.mxfp4:Mxfp4MoEMethod",
        _MOE_PATHS,
        "MXFP4 MoE (TRT-LLM): gemm1_alpha/beta/clamp_limit tensors on the experts object",
    ),
    *(
        PackEntry(target, _MOE_PATHS, f"{target.rpartition(':')[2]}: PWAL builds the MoE kernel (make_*_moe_kernel)")
        for target in (
            # Other MoE methods whose PWAL builds the same kernels (vLLM 0.33: make_fp8_moe_kernel,
            # make_nvfp4_moe_kernel, make_mxfp4_moe_kernel), online quantization (RL's usual setup) included.
            "vllm.model_executor.layers.quantization.online.fp8:Fp8PerTensorOnlineMoEMethod",
            "vllm.model_executor.layers.quantization.online.fp8:Fp8PerBlockOnlineMoEMethod",
            "vllm.model_executor.layers.quantization.online.fp8:Fp8PtpcOnlineMoEMethod",
            "vllm.model_executor.layers.quantization.online.mxfp8:Mxfp8OnlineMoEMethod",
            "vllm.model_executor.layers.quantization.online.nvfp4:Nvfp4OnlineMoEMethod",
            "vllm.model_executor.layers.quantization.online.mxfp4:Mxfp4OnlineMoEMethod",
            "vllm.model_executor.layers.quantization.quark.quark_moe:QuarkW8A8Fp8MoEMethod",
            "vllm.model_executor.layers.quantization.quark.quark_moe:QuarkW8A8Mxfp8MoEMethod",
            "vllm.model_executor.layers.quantization.quark.quark_moe:QuarkNvfp4MoEMethod",
            "vllm.model_executor.layers.quantization.quark.quark_moe:QuarkOCP_MX_MoEMethod",
            "vllm.model_executor.layers.quantization.modelopt:ModelOptMxFp8FusedMoE",
            "vllm.model_executor.layers.quantization.modelopt_block_quant:ModelOptBlockQuantMoEMethod",
            "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
            "compressed_tensors_moe_w8a8_mxfp8:CompressedTensorsW8A8Mxfp8MoEMethod",
            "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
            "compressed_tensors_moe_w4a4_mxfp4:CompressedTensorsW4A4Mxfp4MoEMethod",
            "vllm.model_executor.layers.quantization.inc.schemes.inc_mxfp8_moe:INCMxfp8MoEMethod",
            "vllm.model_executor.layers.quantization.inc.schemes.inc_mxfp4_moe:INCMxfp4MoEMethod",
        )
    ),
    *(
        PackEntry(
            target,
            (f"{holder}.fp8_linear.locks",),
            f"{target.rpartition(':')[2]}: FP8 linear on the humming kernel: PWAL makes new lock (semaphore) tensors "
            "the kernel reads; serving scratch, not computed from the weights",
            static=(f"{holder}.fp8_linear.locks",),
        )
        for target, holder in (
            # Every 0.33 FP8 linear method whose PWAL builds ``self.fp8_linear`` (init_fp8_linear_kernel, the humming
            # kernel among its choices): on the quant method, or on the scheme compressed-tensors and Quark delegate to.
            ("vllm.model_executor.layers.quantization.fp8:Fp8LinearMethod", "quant_method"),
            ("vllm.model_executor.layers.quantization.online.fp8:Fp8PerTensorOnlineLinearMethod", "quant_method"),
            ("vllm.model_executor.layers.quantization.online.fp8:Fp8PerBlockOnlineLinearMethod", "quant_method"),
            ("vllm.model_executor.layers.quantization.online.fp8:Fp8PtpcOnlineLinearMethod", "quant_method"),
            ("vllm.model_executor.layers.quantization.fbgemm_fp8:FBGEMMFp8LinearMethod", "quant_method"),
            (
                "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8:"
                "CompressedTensorsW8A8Fp8",
                "scheme",
            ),
            ("vllm.model_executor.layers.quantization.quark.schemes.quark_w8a8_fp8:QuarkW8A8Fp8", "scheme"),
            ("vllm.model_executor.layers.quantization.quark.schemes.quark_w8a8_fp8:QuarkW8A8Fp8PerBlock", "scheme"),
        )
    ),
    PackEntry(
        "vllm.model_executor.layers.attention.mla_attention:MLAAttention",
        ("W_UV", "W_UK_T", "W_UK_T_dcp_qrep", "W_K", "W_K_scale", "W_V", "W_V_scale", "kv_cache"),
        "MLA absorbed projections split from kv_b_proj in PWAL (0.33 keeps them as parameters via "
        "replace_parameter; declared so every reload verifies their addresses); its KV cache is serving state",
        static=("kv_cache",),
    ),
    PackEntry(
        "vllm.model_executor.layers.hpc.rope_norm:HpcRopeNorm",
        ("_kv_scratch",),
        "HpcRopeNorm's stride-aware fallback makes _kv_scratch (zeros: throwaway K/V pages the fused kernel writes "
        "and nothing reads back) lazily in forward, on the first call per (dtype, block size, device): scratch, "
        "declared static when it is made",
        method="_kv_write_scratch",
        static=("_kv_scratch",),
    ),
    PackEntry(
        "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase",
        ("kv_cache",),
        "every attention-like layer holds its KV cache (or indexer / compressor cache) at kv_cache, bound in "
        "bind_kv_cache: serving state. Declared where the base class binds it, and, through the instance rule of "
        "declare_loaded, on every subclass when its contract seals (the subclasses that override bind_kv_cache, "
        "DeepSeek V3.2's indexer cache among them, start with an empty tensor there)",
        method="bind_kv_cache",
        static=("kv_cache",),
    ),
    PackEntry(
        "vllm.model_executor.layers.mamba.abstract:MambaBase",
        _MAMBA_STATES,
        "every Mamba-like layer (Mamba1/2, short conv, gated delta net, KDA, linear attention) binds its state cache "
        "as a tuple of views (conv, ssm, and ReplaySSM's ring) in bind_kv_cache: serving state written by forward "
        "passes, not computed from the weights; declared static when it is bound",
        method="bind_kv_cache",
        static=_MAMBA_STATES,
    ),
    PackEntry(
        "vllm.model_executor.layers.attention.static_sink_attention:StaticSinkAttention",
        ("sink_key", "sink_value"),
        "openPangu's static sink attention: the model's post_weight_load (run by every load_weights, so by every "
        "reload) hands update_sink_kv the sink key (a new tensor, the k_layernorm of the sink parameter) and the "
        "sink value parameter; the sink key is derived from the weights, declared where it is handed over",
        method="update_sink_kv",
    ),
    PackEntry(
        "vllm.model_executor.layers.attention.attention:Attention",
        ("kv_cache",),
        "the KV cache bound to the layer is serving state written by forward passes, not computed from the "
        "weights: a reload rightly leaves its contents alone (without this, freshness would call it stale)",
        static=("kv_cache",),
    ),
)


def _declare_resolved(
    entry: PackEntry, parsed: Sequence[SlotPath], layer: nn.Module, usage: dict[str, list[int]]
) -> None:
    source = f"graphsafe vLLM pack: {entry.name}"
    for path in parsed:
        counts = usage.setdefault(path.text, [0, 0])
        if isinstance(path.resolve_or(layer, None), torch.Tensor):
            declare(layer, path, source=source, static=path.text in entry.static)
            counts[0] += 1
        else:
            counts[1] += 1


def _wrap(entry: PackEntry, original: Callable[..., Any], usage: dict[str, list[int]]) -> Callable[..., Any]:
    parsed = tuple(SlotPath(p) for p in entry.paths)
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def declared(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        layer = layer_of_call(signature, None, args, kwargs)  # the same rule as @graph_visible
        if layer is not None:
            _declare_resolved(entry, parsed, layer, usage)
        return result

    setattr(declared, GRAPH_VISIBLE_ATTR, GraphVisibleSpec(entry.paths, None, False, None))
    setattr(declared, PACK_ATTR, entry)
    return declared


def _find(entry: PackEntry) -> tuple[type | None, str | None]:
    """``(class, None)`` if the entry matches the installed vLLM, else ``(None, why)``."""
    module_name, _, class_name = entry.target.partition(":")
    try:
        if module_name.partition(".")[0] == "vllm":
            importlib.import_module("vllm.config")  # see _guard._import: vLLM's own import order
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return None, f"module {module_name} cannot be imported: {exc}"
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        return None, f"{module_name} has no class {class_name!r}"
    if not callable(getattr(cls, entry.method, None)):
        return None, f"{class_name} has no method {entry.method!r}"
    return cls, None


def validate_pack(entries: Sequence[PackEntry] = PACK) -> PackResult:
    """Check every entry against the installed vLLM without applying anything."""
    result = PackResult()
    for entry in entries:
        cls, why = _find(entry)
        if cls is None:
            result.stale.append(StaleEntry(entry, why or "not found"))
        else:
            result.applied.append(entry)
    return result


def apply_pack(entries: Sequence[PackEntry], patch: Callable[[Any, str, Any], None]) -> PackResult:
    """Wrap each entry's method with its declarations (``patch(owner, name, value)`` does the assignment, so the
    caller can undo it); stale entries are reported. Applying an entry twice is a no-op."""
    result = PackResult()
    for entry in entries:
        cls, why = _find(entry)
        if cls is None:
            result.stale.append(StaleEntry(entry, why or "not found"))
            continue
        current = cls.__dict__.get(entry.method, getattr(cls, entry.method))
        if getattr(current, PACK_ATTR, None) == entry:
            result.applied.append(entry)
            continue
        usage = result.usage.setdefault(entry.name, {})
        patch(cls, entry.method, _wrap(entry, current, usage))
        result.applied.append(entry)
    return result


def declare_loaded(result: PackResult, model: nn.Module) -> int:
    """Declare the pack's paths on every layer of ``model`` its applied entries cover; returns how many layers.

    The pack declares after each PWAL; a model loaded before the plugin was turned on (``GRAPHSAFE_MODE`` set
    after the engine started) had its PWAL run unwrapped. This applies the same declarations to it, before its
    contract seals: a layer is covered when it is an instance of the entry's class, or its ``quant_method`` (or the
    ``scheme`` compressed-tensors and Quark delegate PWAL to) is.
    """
    covered = 0
    for entry in result.applied:
        cls, _ = _find(entry)
        if cls is None:
            continue
        parsed = tuple(SlotPath(p) for p in entry.paths)
        usage = result.usage.setdefault(entry.name, {})
        for module in model.modules():
            held = (getattr(module, "quant_method", None), getattr(module, "scheme", None))
            if isinstance(module, cls) or any(isinstance(owner, cls) for owner in held):
                _declare_resolved(entry, parsed, module, usage)
                covered += 1
    return covered
