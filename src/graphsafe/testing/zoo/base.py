"""Shared scaffolding of the example zoo: the :class:`Example` record, the two-layer model, weights and reload.

Every example layer keeps its raw weights as parameters (``requires_grad=False``, as a serving engine does) and
runs a ``process_weights_after_loading`` (PWAL) that recomputes derived tensors from those weights. Reload is the
upstream vLLM way: copy new values into the existing parameters in place, then re-run PWAL on every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import torch
from torch import nn

from graphsafe.paths import SlotPath

__all__ = [
    "HIDDEN",
    "TOKENS",
    "VARIANTS",
    "Example",
    "LayerFactory",
    "Variant",
    "ZooModel",
    "check_variant",
    "new_param",
    "run_pwal",
]

Variant = Literal["legacy", "migrated"]
VARIANTS: tuple[Variant, ...] = get_args(Variant)

#: Width of every example layer's input and output (layers chain).
HIDDEN = 16
#: Tokens in :meth:`Example.example_input`.
TOKENS = 4

LayerFactory = Callable[[Variant, torch.device], nn.Module]


def check_variant(variant: str) -> Variant:
    """``variant`` if it names a variant; ``ValueError`` otherwise."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    return variant


def new_param(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """An uninitialised, frozen parameter (filled by the first :meth:`Example.load_weights`)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def run_pwal(layer: nn.Module) -> None:
    """Run one layer's PWAL the way vLLM's loader does: the quant method's if it has one, else the layer's own."""
    quant_method = getattr(layer, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(layer)
    else:
        cast(Any, layer).process_weights_after_loading()


def _random_weight(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    shape = tuple(param.shape)
    if not param.dtype.is_floating_point:
        # Integer parameters are group indices (g_idx): values in [0, 4).
        return torch.randint(0, 4, shape, generator=generator, dtype=param.dtype)
    if name.rsplit(".", 1)[-1].endswith(("scale", "scale_2")):
        # Scales stay positive and away from zero, so reciprocals in PWAL are tame.
        return (torch.rand(shape, generator=generator) + 0.5).to(param.dtype)
    return (torch.randn(shape, generator=generator) * 0.25).to(param.dtype)


class ZooModel(nn.Module):
    """Two (or more) example layers applied in sequence: ``model.layers[0]``, ``model.layers[1]``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class Example:
    """One site of the zoo: a layer kind in a ``legacy`` (undeclared) and a ``migrated`` (declared) variant."""

    #: Key in :data:`graphsafe.testing.zoo.EXAMPLES`.
    name: str
    #: Which real site it models, in one sentence.
    models: str
    #: Graph-visible derived slots, relative to each layer (empty when the layer cannot reach them).
    slot_paths: tuple[str, ...]
    #: Builds one uninitialised layer of the given variant on a device.
    make_layer: LayerFactory = field(repr=False)
    #: Slots allocated by the first forward after a load (warm-up), not by PWAL.
    lazy_paths: tuple[str, ...] = ()
    #: Derived tensors the layer does not reach at all (a module-level cache), by a descriptive name.
    unreachable: Callable[[nn.Module], dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    def build(self, variant: Variant, *, device: torch.device | str = "cpu", seed: int = 0) -> ZooModel:
        """A two-layer model with weights from ``seed`` and PWAL already run (the first load)."""
        variant = check_variant(variant)
        where = torch.device(device)
        model = ZooModel([self.make_layer(variant, where) for _ in range(2)])
        self.load_weights(model, self.make_weights(model, seed))
        return model

    def make_weights(self, model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
        """A fresh state dict of ``model``'s parameters for ``seed`` (different seeds, different values)."""
        generator = torch.Generator().manual_seed(seed)
        return {
            name: _random_weight(name, param, generator).to(param.device) for name, param in model.named_parameters()
        }

    def load_weights(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """Upstream-style reload: copy into the existing parameters in place, then PWAL on every layer."""
        params = dict(model.named_parameters())
        if params.keys() != weights.keys():
            missing = sorted(params.keys() - weights.keys())
            unexpected = sorted(weights.keys() - params.keys())
            raise KeyError(f"{self.name}: weights do not match the model (missing {missing}, unexpected {unexpected})")
        with torch.no_grad():
            for name, weight in weights.items():
                params[name].data.copy_(weight)
            for layer in self.layers(model):
                run_pwal(layer)

    def example_input(self, model: nn.Module, seed: int = 0) -> torch.Tensor:
        """A deterministic ``(TOKENS, HIDDEN)`` input on the model's device."""
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(10_000 + seed)
        return torch.randn(TOKENS, HIDDEN, generator=generator).to(device)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``model(x)``."""
        out: torch.Tensor = model(x)
        return out

    def layers(self, model: nn.Module) -> list[nn.Module]:
        """The example layers of ``model``."""
        return list(cast(nn.ModuleList, model.layers))

    def derived(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """Every derived tensor of ``layer`` by slot path (plus unreachable ones by name); unallocated ones left out."""
        found: dict[str, torch.Tensor] = {}
        for path in self.slot_paths:
            value: Any = SlotPath(path).resolve_or(layer)
            if isinstance(value, torch.Tensor):
                found[path] = value
        if self.unreachable is not None:
            found.update(self.unreachable(layer))
        return found
