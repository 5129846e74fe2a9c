"""Shared fixtures: a tiny quantized-linear model whose PWAL re-creates its derived tensors on every reload.

Each layer keeps its raw weight as a frozen parameter; a quant method object (holding a kernel object, as real
quant methods do) derives tensors from it in ``process_weights_after_loading`` (PWAL). A reload is the upstream
way: copy new values into the parameter in place, then re-run PWAL. Tests reload DIFFERENT values (another seed)
and compare with a model built cold on those values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe.contract._steps as steps_module
from graphsafe import graph_visible, stable_empty
from graphsafe.collectors import RecordedDriver
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.registry import declarations_of

IN_FEATURES = 6
OUT_FEATURES = 4
WORKSPACE = 8


class Kernel:
    """A kernel object as quant methods hold one: a plain object, not a module."""

    def __init__(self) -> None:
        self.workspace: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None


class DerivedQuant:
    """PWAL that allocates NEW derived tensors on every run: the pattern graphsafe exists for."""

    def __init__(self) -> None:
        self.kernel = Kernel()

    @graph_visible(
        "weight_t", "scale", "quant_method.kernel.scale", "ab_strides1", "c_strides2", "packed", "packed_tail"
    )
    def process_weights_after_loading(self, layer: QuantLinear) -> None:
        w = layer.weight.detach()
        layer.weight_t = w.t().contiguous()
        scale = w.abs().amax(dim=1)
        layer.scale = scale
        self.kernel.scale = scale  # two declared paths, one tensor
        strides = torch.full((2,), w.shape[1], dtype=torch.int64, device=w.device)
        layer.ab_strides1 = strides
        layer.c_strides2 = strides
        packed = torch.cat([w.sum(0), w.sum(1)])
        layer.packed = packed
        layer.packed_tail = packed[w.shape[1] :]  # a view of `packed` at an offset
        self.kernel.workspace = stable_empty(
            layer, "quant_method.kernel.workspace", (WORKSPACE,), torch.float32, w.device, zero=True
        )


class InPlaceQuant:
    """PWAL that allocates once, then writes derived values into the same tensors on every later run."""

    def __init__(self) -> None:
        self.kernel = Kernel()

    @graph_visible("weight_t", "quant_method.kernel.scale")
    def process_weights_after_loading(self, layer: QuantLinear) -> None:
        w = layer.weight.detach()
        if getattr(layer, "weight_t", None) is None:
            layer.weight_t = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
            self.kernel.scale = torch.empty(w.shape[0], dtype=w.dtype, device=w.device)
        assert self.kernel.scale is not None
        layer.weight_t.copy_(w.t())
        self.kernel.scale.copy_(w.abs().amax(dim=1))


class QuantLinear(nn.Module):
    """A linear layer with a raw weight parameter and a quant method that derives tensors from it."""

    weight_t: torch.Tensor

    def __init__(self, quant_method: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(OUT_FEATURES, IN_FEATURES), requires_grad=False)
        self.quant_method = quant_method


class TinyModel(nn.Module):
    """``layers.0``, ``layers.1``, ...: the qualified names findings report."""

    def __init__(self, quant: Callable[[], Any], n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([QuantLinear(quant()) for _ in range(n_layers)])


class Tiny:
    """Builds, loads and inspects :class:`TinyModel` instances (the ``tiny`` fixture)."""

    Derived = DerivedQuant
    InPlace = InPlaceQuant

    @staticmethod
    def weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}

    @staticmethod
    def load(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """In-place copy into the parameters, then PWAL on every layer."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
        for layer in model.layers:  # type: ignore[union-attr]
            layer.quant_method.process_weights_after_loading(layer)

    def reload(self, model: nn.Module, seed: int) -> None:
        self.load(model, self.weights(model, seed))

    def build(self, seed: int = 0, quant: Callable[[], Any] = DerivedQuant, n_layers: int = 2) -> TinyModel:
        model = TinyModel(quant, n_layers)
        self.load(model, self.weights(model, seed))
        return model

    @staticmethod
    def declared(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
        """Every declared slot of every layer, by ``(layer qualname, path)`` (the tensors themselves)."""
        found = {}
        for qualname, layer in model.named_modules():
            for text, declaration in declarations_of(layer).items():
                found[(qualname, text)] = declaration.path.resolve(layer)
        return found


RESTORE_TIERS = ("fast-tier", "rule-engine")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``both_tiers`` runs once per restore tier: these tests hold for both, not only for the
    tier the default configuration happens to take."""
    if metafunc.definition.get_closest_marker("both_tiers") is not None:
        metafunc.parametrize("restore_tier", RESTORE_TIERS, indirect=True)


@pytest.fixture(autouse=True)
def restore_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The restore tier a ``both_tiers`` test runs under: ``rule-engine`` keeps every restore step from the fast
    tier (its step conditions never hold), so each step is planned by the rules alone."""
    tier = getattr(request, "param", "fast-tier")
    if tier == "rule-engine":
        monkeypatch.setattr(steps_module, "step_conditions", lambda txn: False)
    return str(tier)


@pytest.fixture
def tiny() -> Tiny:
    return Tiny()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The kernel scan with ``state["table"]`` (a recorded node table) for a driver and each of ``state["tensors"]`` in
    its own allocator block: the scan runs on CPU (tests/collectors/test_kernelscan.py,
    tests/contract/test_unread_skip.py)."""
    state: dict[str, Any] = {"table": None, "tensors": []}

    def segments() -> list[dict[str, Any]]:
        rows = []
        for t in state["tensors"]:
            storage = t.untyped_storage()
            block = {"address": storage.data_ptr(), "size": storage.nbytes(), "state": "active_allocated"}
            rows.append({"address": block["address"], "total_size": block["size"], "blocks": [block]})
        return rows

    monkeypatch.setattr(kscan, "driver", lambda: RecordedDriver(state["table"]))
    monkeypatch.setattr(kscan, "allocator_segments", segments)
    monkeypatch.setattr(kscan, "live_tensors", lambda: iter(state["tensors"]))
    yield state
