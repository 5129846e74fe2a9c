"""An engine-shaped model for the reload benchmark: decoder layers with several kinds of quant method.

Each decoder layer (``EngineLayer``) holds what a served MoE model with MLA attention holds:

* ``self_attn`` (``MLAAttention``): raw ``q_proj``, ``kv_a_proj``, ``kv_b_proj`` weights; PWAL keeps the absorbed
  projections as transposed copies (SGLang's ``w_kc``/``w_vc``: a new contiguous tensor per head, read through a
  transposed, non-contiguous view);
* ``self_attn.o_proj`` (``Fp8Linear``): a bf16 master weight, as an RL trainer pushes it; PWAL quantizes it
  online to ``float8_e4m3fn`` with a per-channel fp32 scale and keeps the column-major ``qweight`` (``.t()``)
  a cutlass fp8 GEMM wants;
* ``mlp.experts`` (``FusedMoE``): ``w13``/``w2`` expert weights; its quant method builds a NEW kernel-args object on
  every PWAL (``quant_method.kernel``) with int64 stride tables (``ab_strides1`` and ``c_strides2`` one tensor, as
  in vLLM's CUTLASS MoE) and transposed experts (``w13_t``, ``w2_t``), and keeps a ``stable_empty`` permute scratch
  (``_permute_scratch``: the migrated in-place style, the same storage on every PWAL);
* ``mlp.shared_expert`` (``ActOrderLinear``): an act-order linear whose PWAL binds the permutation, the permuted
  input scale and the permuted weight into a ``functools.partial`` (``act_fn.args[0]``, ``act_fn.keywords[...]``).

PWAL always builds NEW tensors (the upstream way); with ``declare=True`` it also declares them with
``register_derived`` (``stable_empty`` declares itself), as a migrated kernel does. The forward reads the derived
tensors, never the raw weights they are computed from (the router, norms and the plain projections are read as
loaded), so a captured graph really depends on every derived tensor: the MoE gathers each token's expert rows with
index math on the stride tables, and writes its outputs with them.

Every reload loads DIFFERENT values (a new seed): address identity is the oracle, values must follow the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphsafe import register_derived, stable_empty

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class EngineShape:
    """Sizes of the engine-shaped model. ``heads * v_dim == hidden``, so layers chain."""

    name: str
    layers: int
    hidden: int
    heads: int
    nope: int  # per-head query/key dimension (no rope part)
    latent: int  # MLA's compressed KV dimension
    experts: int
    inter: int  # expert intermediate size
    max_tokens: int  # rows of the permute scratch: the largest batch a graph is captured for
    groups: int = 8  # act-order quantization groups of the shared expert's input channels

    @property
    def v_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> dict[str, Any]:
        return asdict(self)


#: ~1 GiB of bf16 weights (32 layers x ~30 MiB), about as much again in derived tensors.
CUDA_SHAPE = EngineShape(
    "engine-1GiB", layers=32, hidden=1024, heads=8, nope=64, latent=256, experts=8, inter=512, max_tokens=32
)
#: The same tensor count per layer, small values (the per-tensor overhead is what a CPU run can show).
CPU_SHAPE = EngineShape(
    "engine-cpu", layers=32, hidden=128, heads=4, nope=16, latent=32, experts=8, inter=64, max_tokens=32
)
#: For the smoke test.
TINY_SHAPE = EngineShape(
    "engine-tiny", layers=2, hidden=32, heads=2, nope=8, latent=16, experts=4, inter=16, max_tokens=8, groups=4
)


def _param(*shape: int, device: torch.device, dtype: torch.dtype = DTYPE) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight


# -- fp8 linear: online quantization of a bf16 master weight -----------------------------------------------------


class Fp8Linear(nn.Module):
    """``weight`` (out, in) bf16 as loaded; PWAL: ``qweight`` fp8 (in, out) column-major, ``weight_scale`` (out,)."""

    qweight: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, out_features: int, in_features: int, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, device=device)

    def pwal(self, declare: bool) -> None:
        w = self.weight.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)  # per output channel
        self.qweight = (w / scale[:, None]).to(FP8).t()  # a NEW fp8 tensor, read column-major (in, out)
        self.weight_scale = scale
        if declare:
            register_derived(self, "qweight")
            register_derived(self, "weight_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Dequantize-and-matmul: the same tensors a fused fp8 GEMM would read (qweight, weight_scale).
        return x @ (self.qweight.to(x.dtype) * self.weight_scale.to(x.dtype))


# -- MLA attention: absorbed, transposed projections --------------------------------------------------------------


class MLAAttention(nn.Module):
    """MLA with absorbed projections: ``w_kc`` (heads, nope, latent), ``w_vc`` (heads, latent, v) from ``kv_b_proj``.

    Attention runs over the batch's own tokens against the compressed KV ``kv_a_proj(x)`` (no KV cache: the
    benchmark needs the kernels' reads of the derived tensors, not a cache).
    """

    w_kc: torch.Tensor
    w_vc: torch.Tensor

    def __init__(self, shape: EngineShape, device: torch.device) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.q_proj = _param(s.heads * s.nope, s.hidden, device=device)
        self.kv_a_proj = _param(s.latent, s.hidden, device=device)
        self.kv_b_proj = _param(s.heads * (s.nope + s.v_dim), s.latent, device=device)
        self.o_proj = Fp8Linear(s.hidden, s.heads * s.v_dim, device)

    def pwal(self, declare: bool) -> None:
        s = self.shape
        w = self.kv_b_proj.view(s.heads, s.nope + s.v_dim, s.latent)
        w_k, w_v = torch.split(w, [s.nope, s.v_dim], dim=1)  # (heads, nope, latent), (heads, v, latent)
        # SGLang's DeepSeek-V2 post_load_weights: new contiguous tensors, kept as transposed views.
        self.w_kc = w_k.transpose(1, 2).contiguous().transpose(1, 2)  # (heads, nope, latent), column-major
        self.w_vc = w_v.contiguous().transpose(1, 2)  # (heads, latent, v)
        if declare:
            register_derived(self, "w_kc")
            register_derived(self, "w_vc")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n = x.shape[0]
        q = F.linear(x, self.q_proj).view(n, s.heads, s.nope).transpose(0, 1)  # (heads, n, nope)
        c = F.linear(x, self.kv_a_proj)  # (n, latent)
        q_latent = torch.bmm(q, self.w_kc)  # (heads, n, latent)
        scores = torch.matmul(q_latent, c.t()).float() * s.latent**-0.5  # (heads, n, n)
        p = torch.softmax(scores, dim=-1).to(x.dtype)
        ctx = torch.matmul(p, c)  # (heads, n, latent)
        out = torch.bmm(ctx, self.w_vc)  # (heads, n, v)
        return self.o_proj(out.transpose(0, 1).reshape(n, s.heads * s.v_dim))


# -- MoE: a kernel-args object with stride tables and transposed experts, a stable scratch ------------------------


class MoEKernelArgs:
    """A grouped-GEMM kernel's arguments, rebuilt by every PWAL (vLLM's ``CutlassExpertsFp8`` pattern)."""

    def __init__(
        self,
        ab_strides1: torch.Tensor,
        c_strides1: torch.Tensor,
        ab_strides2: torch.Tensor,
        c_strides2: torch.Tensor,
        w13_t: torch.Tensor,
        w2_t: torch.Tensor,
    ) -> None:
        self.ab_strides1 = ab_strides1
        self.c_strides1 = c_strides1
        self.ab_strides2 = ab_strides2
        self.c_strides2 = c_strides2
        self.w13_t = w13_t
        self.w2_t = w2_t
        self.config = {"block_m": 64, "block_n": 128, "num_warps": 4, "name": "grouped-gemm"}


KERNEL = "quant_method.kernel"
STRIDE_PATHS = tuple(f"{KERNEL}.{n}" for n in ("ab_strides1", "c_strides1", "ab_strides2", "c_strides2"))
EXPERT_PATHS = (f"{KERNEL}.w13_t", f"{KERNEL}.w2_t")
SCRATCH = "_permute_scratch"


class GroupedMoEMethod:
    """The MoE quant method: PWAL makes a new kernel-args object and (re)binds the stable permute scratch."""

    def __init__(self) -> None:
        self.kernel: MoEKernelArgs | None = None

    def process_weights_after_loading(self, layer: FusedMoE, declare: bool) -> None:
        s = layer.shape
        dev = layer.w13.device
        e = s.experts

        def table(value: int) -> torch.Tensor:
            return torch.full((e,), value, dtype=torch.int64, device=dev)

        rows13 = table(s.hidden)  # rows of one expert of w13_t; also the output row stride of the down GEMM
        self.kernel = MoEKernelArgs(
            ab_strides1=rows13,
            c_strides1=table(2 * s.inter),
            ab_strides2=table(s.inter),
            c_strides2=rows13,  # one tensor under two names, as vLLM's ab_strides1_c_strides2
            w13_t=layer.w13.transpose(1, 2).contiguous(),  # (E, hidden, 2*inter)
            w2_t=layer.w2.transpose(1, 2).contiguous(),  # (E, inter, hidden)
        )
        layer._permute_scratch = stable_empty(layer, SCRATCH, (s.max_tokens, s.hidden), DTYPE, dev)
        if declare:
            for path in STRIDE_PATHS:
                register_derived(layer, path, static=True)  # from the shapes: not weight values
            for path in EXPERT_PATHS:
                register_derived(layer, path)


class FusedMoE(nn.Module):
    """Top-1 routed experts: tokens sorted by expert into the scratch, rows gathered with the stride tables."""

    _permute_scratch: torch.Tensor

    def __init__(self, shape: EngineShape, device: torch.device) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.w13 = _param(s.experts, 2 * s.inter, s.hidden, device=device)
        self.w2 = _param(s.experts, s.hidden, s.inter, device=device)
        self.quant_method = GroupedMoEMethod()

    def pwal(self, declare: bool) -> None:
        self.quant_method.process_weights_after_loading(self, declare)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        s = self.shape
        k = self.quant_method.kernel
        assert k is not None, "PWAL has not run"
        n = x.shape[0]
        dev = x.device
        order = torch.argsort(ids, stable=True)
        xs = self._permute_scratch[:n]
        torch.index_select(x, 0, order, out=xs)  # permute into the stable scratch
        ids_s = ids.index_select(0, order)
        tok = torch.arange(n, device=dev)[:, None]
        u = _grouped(xs, k.w13_t, ids_s, k.ab_strides1, k.c_strides1, s.hidden, 2 * s.inter, tok)
        a = F.silu(u[:, : s.inter]) * u[:, s.inter :]
        y = _grouped(a, k.w2_t, ids_s, k.ab_strides2, k.c_strides2, s.inter, s.hidden, tok)
        return torch.zeros_like(y).index_copy(0, order, y)  # unpermute


def _grouped(
    x: torch.Tensor,
    w_t: torch.Tensor,
    ids: torch.Tensor,
    ab_strides: torch.Tensor,
    c_strides: torch.Tensor,
    k_dim: int,
    n_dim: int,
    tok: torch.Tensor,
) -> torch.Tensor:
    """``x[t] @ w_t[ids[t]]``: the expert rows found through ``ab_strides``, the output rows through ``c_strides``."""
    n = x.shape[0]
    dev = x.device
    rows = w_t.view(-1, n_dim)  # (E * k_dim, n_dim)
    row_idx = ids[:, None] * ab_strides.index_select(0, ids)[:, None] + torch.arange(k_dim, device=dev)[None, :]
    w_tok = rows.index_select(0, row_idx.reshape(-1)).view(n, k_dim, n_dim)
    y = torch.bmm(x.unsqueeze(1), w_tok).squeeze(1)  # (n, n_dim)
    out_idx = tok * c_strides.index_select(0, ids)[:, None] + torch.arange(n_dim, device=dev)[None, :]
    out = torch.zeros(n * n_dim, dtype=y.dtype, device=dev)
    return out.index_copy(0, out_idx.reshape(-1), y.reshape(-1)).view(n, n_dim)


# -- act-order shared expert: tensors bound in a functools.partial ------------------------------------------------


def act_order_linear(col_scale: torch.Tensor, x: torch.Tensor, *, perm: torch.Tensor, weight: torch.Tensor) -> Any:
    """Permute the input channels into group order, scale them, multiply by the permuted weight."""
    return F.linear(x.index_select(-1, perm) * col_scale, weight)


PARTIAL_PATHS = ("act_fn.args[0]", "act_fn.keywords['perm']", "act_fn.keywords['weight']")


class ActOrderLinear(nn.Module):
    """``weight`` (out, in), ``g_idx`` (in,) int32 and ``input_scale`` (in,) fp32 as loaded; PWAL binds a partial."""

    act_fn: functools.partial[Any]

    def __init__(self, shape: EngineShape, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(shape.hidden, shape.hidden, device=device)
        self.g_idx = _param(shape.hidden, device=device, dtype=torch.int32)
        self.input_scale = _param(shape.hidden, device=device, dtype=torch.float32)

    def pwal(self, declare: bool) -> None:
        perm = torch.argsort(self.g_idx, stable=True)
        col_scale = self.input_scale.index_select(0, perm).to(DTYPE)
        weight = self.weight.index_select(1, perm)  # (out, in) in group order
        self.act_fn = functools.partial(act_order_linear, col_scale, perm=perm, weight=weight)
        if declare:
            for path in PARTIAL_PATHS:
                register_derived(self, path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(x)  # type: ignore[no-any-return]


# -- the decoder layer and the model ------------------------------------------------------------------------------


class MoEBlock(nn.Module):
    def __init__(self, shape: EngineShape, device: torch.device) -> None:
        super().__init__()
        self.router = _param(shape.experts, shape.hidden, device=device)
        self.experts = FusedMoE(shape, device)
        self.shared_expert = ActOrderLinear(shape, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = F.linear(x, self.router).argmax(-1)
        return self.experts(x, ids) + self.shared_expert(x)


class EngineLayer(nn.Module):
    """One decoder layer: norm, MLA attention (fp8 ``o_proj``), norm, MoE with a shared expert."""

    def __init__(self, shape: EngineShape, device: torch.device) -> None:
        super().__init__()
        self.input_norm = _param(shape.hidden, device=device)
        self.self_attn = MLAAttention(shape, device)
        self.post_norm = _param(shape.hidden, device=device)
        self.mlp = MoEBlock(shape, device)

    def process_weights_after_loading(self, declare: bool) -> None:
        """PWAL of every module of the layer that has one, in module order (as an engine's loader runs it)."""
        for module in self.modules():
            pwal = getattr(module, "pwal", None)
            if pwal is not None:
                pwal(declare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(rms_norm(x, self.input_norm))
        return h + self.mlp(rms_norm(h, self.post_norm))


class EngineModel(nn.Module):
    def __init__(self, shape: EngineShape, device: torch.device) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(EngineLayer(shape, device) for _ in range(shape.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# -- weights, loads, checks ----------------------------------------------------------------------------------------

LayerWeights = list[tuple[nn.Parameter, torch.Tensor]]


def _value(name: str, param: torch.Tensor, shape: EngineShape, gen: torch.Generator) -> torch.Tensor:
    """New values for one parameter: scaled normal weights, norms near 1, act-order group ids, positive scales."""
    dims = tuple(param.shape)
    if name.endswith("g_idx"):
        return torch.randint(0, shape.groups, dims, generator=gen, dtype=torch.int32)
    if name.endswith("input_scale"):
        return torch.rand(dims, generator=gen) + 0.5
    if name.endswith("norm"):
        return (1.0 + 0.1 * torch.randn(dims, generator=gen)).to(param.dtype)
    fan_in = dims[-1]
    return (torch.randn(dims, generator=gen) * fan_in**-0.5).to(param.dtype)


def make_weights(model: EngineModel, seed: int, device: torch.device) -> list[list[torch.Tensor]]:
    """New values for every parameter, per layer in ``named_parameters`` order, on ``device`` (pinned on the host
    when CUDA is present: an RL trainer's push)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in model.layers:
        values = []
        for name, param in layer.named_parameters():
            value = _value(name, param, model.shape, gen)
            if device.type == "cpu" and torch.cuda.is_available():
                value = value.pin_memory()
            values.append(value.to(device))
        out.append(values)
    return out


def load_layer(layer: EngineLayer, values: list[torch.Tensor], declare: bool) -> None:
    """One layer's upstream reload: copy into its parameters in place, then its PWAL."""
    with torch.no_grad():
        for param, value in zip(layer.parameters(), values, strict=True):
            param.copy_(value, non_blocking=True)
        layer.process_weights_after_loading(declare)


def load_weights(model: EngineModel, weights: list[list[torch.Tensor]], declare: bool) -> None:
    """The upstream whole-model reload: every parameter in place, then PWAL of every layer."""
    with torch.no_grad():
        for layer, values in zip(model.layers, weights, strict=True):
            for param, value in zip(layer.parameters(), values, strict=True):
                param.copy_(value, non_blocking=True)
        for layer in model.layers:
            layer.process_weights_after_loading(declare)  # type: ignore[operator]


def build(
    shape: EngineShape,
    device: torch.device,
    declare: bool,
    weights: list[list[torch.Tensor]] | None = None,
    seed: int = 0,
) -> EngineModel:
    """A model with weights loaded (``weights``, else new ones from ``seed``) and PWAL run once."""
    model = EngineModel(shape, device)
    load_weights(model, weights if weights is not None else make_weights(model, seed, device), declare)
    return model


def derived(model: EngineModel) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every derived tensor PWAL made (not the scratch: its contents are the forward's)."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        yield f"layers.{i}.self_attn.w_kc", attn.w_kc
        yield f"layers.{i}.self_attn.w_vc", attn.w_vc
        yield f"layers.{i}.self_attn.o_proj.qweight", attn.o_proj.qweight
        yield f"layers.{i}.self_attn.o_proj.weight_scale", attn.o_proj.weight_scale
        kernel = mlp.experts.quant_method.kernel
        for name in ("ab_strides1", "c_strides1", "ab_strides2", "c_strides2", "w13_t", "w2_t"):
            yield f"layers.{i}.mlp.experts.{KERNEL}.{name}", getattr(kernel, name)
        fn = mlp.shared_expert.act_fn
        yield f"layers.{i}.mlp.shared_expert.act_fn.args[0]", fn.args[0]
        yield f"layers.{i}.mlp.shared_expert.act_fn.keywords['perm']", fn.keywords["perm"]
        yield f"layers.{i}.mlp.shared_expert.act_fn.keywords['weight']", fn.keywords["weight"]


def graph_read(model: EngineModel) -> dict[str, tuple[int, int]]:
    """``name -> (data_ptr, storage_offset)`` of every tensor a captured graph reads besides the parameters:
    the derived tensors and the scratch. After a kept reload every one must be where it was sealed."""
    out = {name: (t.data_ptr(), t.storage_offset()) for name, t in derived(model)}
    for i, layer in enumerate(model.layers):
        scratch = layer.mlp.experts._permute_scratch
        out[f"layers.{i}.mlp.experts.{SCRATCH}"] = (scratch.data_ptr(), scratch.storage_offset())
    return out


def moved(model: EngineModel, sealed: dict[str, tuple[int, int]]) -> list[str]:
    """The graph-read tensors no longer at their sealed address (empty after a reload the contract kept)."""
    now = graph_read(model)
    return [name for name, where in sealed.items() if now.get(name) != where]


def value_mismatches(a: EngineModel, b: EngineModel) -> list[str]:
    """The derived tensors whose values differ between two models (same weights loaded: must be none)."""
    return [na for (na, ta), (_, tb) in zip(derived(a), derived(b), strict=True) if not torch.equal(ta, tb)]


def weight_bytes(model: EngineModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def derived_bytes(model: EngineModel) -> int:
    return sum(t.numel() * t.element_size() for _, t in derived(model))
