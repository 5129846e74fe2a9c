"""Synthetic models for the reload benchmark: N layers, each with k derived tensors that PWAL re-creates.

The derived tensors look like what real kernels keep next to their weights (cycled in this order): an int32
workspace, an int64 stride table, fp32 per-channel scales, a bf16 transposed copy of the weight. They sit at
three kinds of path, as in real engines: a layer attribute (``ws_0``), an attribute of a plain kernel-args
object (``args.strides_1``) and a dict entry (``kernel['scale_2']``).

``process_weights_after_loading`` (PWAL) always builds NEW tensors and assigns them, the upstream way; with
``declare=True`` it also declares them (``register_derived``), as a migrated kernel does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsafe import register_derived

KINDS = ("workspace", "strides", "scales", "transposed")


@dataclass(frozen=True)
class Shape:
    """A model shape: ``layers`` x ``k`` derived tensors, weights ``[rows, cols]`` in bf16."""

    name: str
    layers: int
    k: int
    rows: int
    cols: int
    workspace: int = 256  # int32 elements
    strides: int = 8  # int64 elements
    kinds: tuple[str, ...] = KINDS  # the derived tensors, cycled
    inplace: bool = False  # PWAL writes into the tensors it made last time (a kernel migrated to stable storage)

    def kind(self, i: int) -> str:
        return self.kinds[i % len(self.kinds)]

    @property
    def slots(self) -> int:
        return self.layers * self.k


class KernelArgs:
    """A kernel's argument object (plain attributes), as quant methods keep them."""

    def __init__(self) -> None:
        self.name = "kernel-args"
        self.flags = {"fused": True, "split_k": 1}


class SynthLayer(nn.Module):
    """One layer: a bf16 weight parameter and ``k`` derived tensors rebuilt by PWAL."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.rows, shape.cols, dtype=torch.bfloat16, device=device), False)
        self.shape = shape
        self.args = KernelArgs()
        self.kernel: dict[str, Any] = {"variant": "synthetic"}
        self.built = False
        self.names = [f"{shape.kind(i)}_{i}" for i in range(shape.k)]
        self.paths = [_path(i, name) for i, name in enumerate(self.names)]

    def derive(self, i: int) -> torch.Tensor:
        """Derived tensor ``i`` of the current weight (a NEW tensor every call)."""
        w, s = self.weight, self.shape
        kind = s.kind(i)
        if kind == "workspace":
            return torch.zeros(s.workspace, dtype=torch.int32, device=w.device)
        if kind == "strides":
            return torch.full((s.strides,), s.cols, dtype=torch.int64, device=w.device)
        if kind == "scales":
            return w.abs().amax(dim=1).float()
        return w.t().contiguous()

    def process_weights_after_loading(self, declare: bool) -> None:
        for i, path in enumerate(self.paths):
            tensor = self.derive(i)
            if self.shape.inplace and self.built:
                with torch.no_grad():
                    read_derived(self, i).copy_(tensor)  # into last time's storage: nothing for a contract to move
            else:
                assign_derived(self, i, tensor)
            if declare:
                register_derived(self, path, static=self.shape.kind(i) in ("workspace", "strides"))
        self.built = True

    def derived(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(index, tensor)`` for every derived tensor as the layer now holds it."""
        for i in range(self.shape.k):
            yield i, read_derived(self, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reads every derived tensor (so a captured graph depends on all of them); output shape of ``x``."""
        y = x
        others: dict[torch.dtype, list[torch.Tensor]] = {}
        for i, tensor in self.derived():
            if self.shape.kind(i) == "transposed":
                y = y + (x @ tensor) * 1e-3
            else:
                others.setdefault(tensor.dtype, []).append(tensor.reshape(-1)[:1])
        for group in others.values():  # one small kernel per dtype reads every other derived tensor
            y = y + 1e-9 * torch.cat(group).sum().to(y.dtype)
        return y


def _path(i: int, name: str) -> str:
    where = i % 3
    if where == 0:
        return name
    if where == 1:
        return f"args.{name}"
    return f"kernel['{name}']"


def assign_derived(layer: SynthLayer, i: int, tensor: torch.Tensor) -> None:
    name = layer.names[i]
    where = i % 3
    if where == 0:
        setattr(layer, name, tensor)
    elif where == 1:
        setattr(layer.args, name, tensor)
    else:
        layer.kernel[name] = tensor


def read_derived(layer: SynthLayer, i: int) -> torch.Tensor:
    name = layer.names[i]
    where = i % 3
    if where == 0:
        value: torch.Tensor = getattr(layer, name)
    elif where == 1:
        value = getattr(layer.args, name)
    else:
        value = layer.kernel[name]
    return value


class SynthModel(nn.Module):
    """``shape.layers`` synthetic layers in a ``ModuleList``."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(SynthLayer(shape, device) for _ in range(shape.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_weights(model: SynthModel, seed: int, device: torch.device) -> list[torch.Tensor]:
    """New weight values, one per layer, on ``device`` (pinned when it is the host and CUDA is present)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in model.layers:
        w = torch.randn(tuple(layer.weight.shape), generator=gen).to(torch.bfloat16)
        if device.type == "cpu" and torch.cuda.is_available():
            w = w.pin_memory()
        out.append(w.to(device))
    return out


def load_weights(model: SynthModel, weights: list[torch.Tensor], declare: bool) -> None:
    """The upstream reload: copy into the parameters in place, then PWAL on every layer."""
    with torch.no_grad():
        for layer, w in zip(model.layers, weights, strict=True):
            layer.weight.copy_(w, non_blocking=True)
        for layer in model.layers:
            layer.process_weights_after_loading(declare)


def build(shape: Shape, device: torch.device, declare: bool, seed: int = 0) -> SynthModel:
    """A model with weights loaded and PWAL run once."""
    model = SynthModel(shape, device)
    load_weights(model, make_weights(model, seed, device), declare)
    return model


# -- a MoE-like model for the walker ---------------------------------------------------------------------------


class ExpertsKernel:
    """A fused-experts object: per-expert stride/scale lists, a dict of kernel args, a bound launcher."""

    def __init__(self, experts: int, device: torch.device) -> None:
        self.ab_strides = torch.full((experts,), 128, dtype=torch.int64, device=device)
        self.c_strides = self.ab_strides
        self.w_scales = [torch.ones(4, device=device) for _ in range(experts)]
        self.problem_sizes = torch.zeros(experts, 3, dtype=torch.int32, device=device)
        self.config = {"block_m": 64, "block_n": 128, "num_warps": 4, "stages": 3, "name": "cutlass-grouped"}
        self.meta = {f"expert_{e}": (e, "bf16", 128) for e in range(experts)}
        self.topk_ids_buf = torch.zeros(16, dtype=torch.int32, device=device)


class QuantMethod:
    def __init__(self, experts: int, device: torch.device) -> None:
        self.kernel = ExpertsKernel(experts, device)
        self.quant_config = {"group_size": 128, "bits": 4, "desc_act": False, "sym": True}
        self.workspace = torch.zeros(1024, dtype=torch.int32, device=device)


class MoELayer(nn.Module):
    def __init__(self, experts: int, device: torch.device) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(experts, 8, 8, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, 8, 8, device=device), requires_grad=False)
        self.quant_method = QuantMethod(experts, device)
        self.expert_map = torch.arange(experts, device=device)
        self.layer_name = "model.layers.0.mlp.experts"


class AttnLayer(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.empty(24, 8, device=device), requires_grad=False)
        self.o = nn.Parameter(torch.empty(8, 8, device=device), requires_grad=False)
        self.cos_sin_cache = torch.zeros(64, 8, device=device)
        self.kv_scales = {"k": torch.ones(1, device=device), "v": torch.ones(1, device=device)}
        self.impl = {"backend": "flash", "block_size": 16, "sliding_window": None}


class MoEBlock(nn.Module):
    def __init__(self, experts: int, device: torch.device) -> None:
        super().__init__()
        self.attn = AttnLayer(device)
        self.mlp = MoELayer(experts, device)


class MoEModel(nn.Module):
    """``layers`` decoder blocks, each an attention layer and a MoE layer of ``experts`` experts."""

    def __init__(self, layers: int, experts: int, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(experts, device) for _ in range(layers))


# -- a tensor-dense MoE model for the walker: one kernel-args object per expert ----------------------------------


class ExpertArgs:
    """One expert's kernel arguments: three small tensors (scales, zero points, a permutation), as a quantized
    grouped GEMM keeps them per expert."""

    def __init__(self, device: torch.device) -> None:
        self.scales = torch.ones(4, device=device)
        self.zeros = torch.zeros(4, dtype=torch.int32, device=device)
        self.g_idx = torch.arange(8, dtype=torch.int32, device=device)


class DenseMoELayer(nn.Module):
    """A MoE layer whose quant method keeps a list of per-expert argument objects (3 tensors each)."""

    def __init__(self, experts: int, device: torch.device) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(experts, 8, 8, device=device), requires_grad=False)
        self.experts = [ExpertArgs(device) for _ in range(experts)]


class DenseMoEModel(nn.Module):
    """``layers`` MoE layers of ``experts`` experts, each expert an object holding 3 tensors."""

    def __init__(self, layers: int, experts: int, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseMoELayer(experts, device) for _ in range(layers))
