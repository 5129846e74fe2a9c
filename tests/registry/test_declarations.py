"""Declarations: ``graph_visible``, ``register_derived``, ``stable_empty`` and the weak per-layer store (CPU)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import graphsafe
from graphsafe import (
    DeclarationError,
    PathSyntaxError,
    RemovableHandle,
    graph_visible,
    graph_visible_spec,
    register_derived,
    stable_empty,
)
from graphsafe.registry import declarations_generation, declarations_of, declared_layers


class Plain(nn.Module):
    """A bare layer to hang derived tensors on."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(12.0).reshape(3, 4), requires_grad=False)


class Kernel:
    def __init__(self) -> None:
        self.workspace: torch.Tensor | None = None


class Method:
    """A quant method: PWAL is ``(self, layer)``."""

    def __init__(self) -> None:
        self.kernel = Kernel()
        self.calls = 0

    @graph_visible("weight_t", "quant_method.kernel.workspace")
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        layer.weight_t = layer.weight.detach().t().contiguous()
        self.kernel.workspace = torch.zeros(5)

    @graph_visible("never_assigned")
    def forgets(self, layer: nn.Module) -> None:
        layer.something_else = torch.zeros(1)

    @graph_visible("not_a_tensor")
    def assigns_int(self, layer: nn.Module) -> None:
        layer.not_a_tensor = 3


@graph_visible("scale", "stash['inv']")
def pwal_function(layer: nn.Module, factor: float = 2.0) -> None:
    layer.scale = layer.weight.detach().amax(dim=1) * factor
    layer.stash = {"inv": 1.0 / layer.scale}


class SelfPwal(nn.Module):
    """A layer whose own method is its PWAL: ``(self)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 3), requires_grad=False)

    @graph_visible("weight_t")
    def process_weights_after_loading(self) -> None:
        self.weight_t = self.weight.detach().t().contiguous()


def _with_method() -> Plain:
    layer = Plain()
    layer.quant_method = Method()
    return layer


# ----------------------------------------------------------------------------------------------------
# @graph_visible
# ----------------------------------------------------------------------------------------------------


def test_graph_visible_on_quant_method_declares_every_path_after_the_call() -> None:
    layer = _with_method()
    assert dict(declarations_of(layer)) == {}
    layer.quant_method.process_weights_after_loading(layer)
    declared = declarations_of(layer)
    assert set(declared) == {"weight_t", "quant_method.kernel.workspace"}
    assert declared["weight_t"].path.resolve(layer) is layer.weight_t
    assert "Method.process_weights_after_loading" in declared["weight_t"].source


def test_graph_visible_on_function_with_layer_argument() -> None:
    layer = Plain()
    pwal_function(layer, factor=3.0)
    assert set(declarations_of(layer)) == {"scale", "stash['inv']"}
    assert torch.equal(layer.scale, torch.tensor([3.0, 7.0, 11.0]) * 3.0)


def test_graph_visible_on_a_layers_own_method() -> None:
    layer = SelfPwal()
    layer.process_weights_after_loading()
    assert set(declarations_of(layer)) == {"weight_t"}


class ModuleMethod(nn.Module):
    """A quant method that is itself a module: the layer is still the ``layer`` argument, not ``self``."""

    @graph_visible("scale")
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.scale = torch.ones(2)


def test_graph_visible_declares_for_the_layer_argument_not_a_module_self() -> None:
    method, layer = ModuleMethod(), Plain()
    method.process_weights_after_loading(layer)
    assert "scale" in declarations_of(layer)
    assert dict(declarations_of(method)) == {}


def test_graph_visible_declares_once_however_often_pwal_reruns() -> None:
    layer = _with_method()
    for _ in range(3):
        layer.quant_method.process_weights_after_loading(layer)
    generation = declarations_generation(layer)
    assert generation > 0
    layer.quant_method.process_weights_after_loading(layer)
    assert len(declarations_of(layer)) == 2
    assert declarations_generation(layer) == generation  # an identical re-declaration changes nothing


def test_graph_visible_path_not_assigned_raises_naming_function_class_and_path() -> None:
    layer = _with_method()
    with pytest.raises(DeclarationError) as info:
        layer.quant_method.forgets(layer)
    message = str(info.value)
    assert "Method.forgets" in message
    assert "Plain" in message
    assert "never_assigned" in message
    assert "never_assigned" not in declarations_of(layer)


def test_graph_visible_path_holding_a_non_tensor_raises() -> None:
    layer = _with_method()
    with pytest.raises(DeclarationError, match=r"not_a_tensor.*int"):
        layer.quant_method.assigns_int(layer)


def test_graph_visible_without_a_layer_argument_raises() -> None:
    @graph_visible("x")
    def no_layer(value: int) -> None:
        del value

    with pytest.raises(DeclarationError, match="layer_arg"):
        no_layer(3)


def test_graph_visible_layer_arg_names_an_unusual_parameter() -> None:
    @graph_visible("scale", layer_arg="module")
    def pwal(cfg: object, module: nn.Module) -> None:
        module.scale = torch.ones(2)

    layer = Plain()
    pwal(object(), module=layer)
    assert "scale" in declarations_of(layer)


def test_marker_lists_paths_without_running_anything() -> None:
    calls: list[str] = []

    @graph_visible("a.b['c']", "d", derived_from="weight", static=True)
    def pwal(layer: nn.Module) -> None:
        calls.append("ran")

    spec = graph_visible_spec(pwal)
    assert spec is not None
    assert spec.paths == ("a.b['c']", "d")
    assert spec.derived_from == ("weight",)
    assert spec.static is True
    assert calls == []
    # Reachable through the class attribute and a bound method alike.
    method_spec = graph_visible_spec(Method.process_weights_after_loading)
    assert method_spec is not None and method_spec.paths == ("weight_t", "quant_method.kernel.workspace")
    bound_spec = graph_visible_spec(Method().process_weights_after_loading)
    assert bound_spec == method_spec
    assert graph_visible_spec(_with_method) is None


@pytest.mark.parametrize("bad", ["a..b", "a[", "1abc", "a.", "x[b]", "f.__closure__"])
def test_bad_path_syntax_raises_at_decoration_time(bad: str) -> None:
    with pytest.raises(PathSyntaxError):
        graph_visible("ok", bad)


def test_graph_visible_needs_a_path() -> None:
    with pytest.raises(DeclarationError):
        graph_visible()


# ----------------------------------------------------------------------------------------------------
# register_derived
# ----------------------------------------------------------------------------------------------------


def test_register_derived_declares_and_the_handle_removes() -> None:
    layer = Plain()
    layer.weight_t = layer.weight.detach().t().contiguous()
    handle = register_derived(layer, "weight_t", layer.weight_t)
    assert isinstance(handle, RemovableHandle)
    assert handle.active and handle.description == "register_derived(Plain, 'weight_t')"
    assert "weight_t" in declarations_of(layer)
    handle.remove()
    assert not handle.active
    assert "weight_t" not in declarations_of(layer)
    handle.remove()  # idempotent
    assert "weight_t" not in declarations_of(layer)


def test_register_derived_handle_is_a_context_manager() -> None:
    layer = Plain()
    layer.scratch = torch.zeros(4)
    with register_derived(layer, "scratch") as handle:
        assert "scratch" in declarations_of(layer)
        assert handle.active
    assert "scratch" not in declarations_of(layer)


def test_register_derived_redeclared_every_reload_is_one_declaration() -> None:
    layer = Plain()
    for step in range(4):
        layer.scale = torch.full((3,), float(step))  # a new tensor each "reload"
        register_derived(layer, "scale", layer.scale)
    assert list(declarations_of(layer)) == ["scale"]


def test_register_derived_accepts_another_object_viewing_the_same_memory() -> None:
    layer = Plain()
    layer.weight_t = layer.weight.detach().t().contiguous()
    same_view = layer.weight_t.view(layer.weight_t.shape)
    assert same_view is not layer.weight_t
    register_derived(layer, "weight_t", same_view)
    assert "weight_t" in declarations_of(layer)


def _slot_and_mismatches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A (3, 4) slot inside a larger storage, and tensors differing from it in exactly one respect each."""
    backing = torch.arange(16.0)
    slot = backing[:12].view(3, 4)
    return slot, {
        "other storage": slot.clone(),
        "offset": backing[4:].view(3, 4),
        "shape": backing[:8].view(2, 4),
        "stride": backing.as_strided((3, 4), (1, 3)),
        "dtype": slot.view(torch.int32),
    }


@pytest.mark.parametrize("kind", ["other storage", "offset", "shape", "stride", "dtype"])
def test_register_derived_with_a_tensor_that_is_not_the_slot_raises(kind: str) -> None:
    layer = Plain()
    layer.buf, mismatches = _slot_and_mismatches()
    with pytest.raises(DeclarationError, match=r"buf.*different tensor"):
        register_derived(layer, "buf", mismatches[kind])
    assert "buf" not in declarations_of(layer)
    register_derived(layer, "buf", layer.buf)  # the control: the slot itself is accepted
    assert "buf" in declarations_of(layer)


def test_register_derived_unresolvable_or_bad_path_raises() -> None:
    layer = Plain()
    with pytest.raises(DeclarationError, match="missing"):
        register_derived(layer, "missing")
    with pytest.raises(DeclarationError):
        register_derived(layer, "a..b")
    with pytest.raises(DeclarationError):
        register_derived(object(), "weight")  # type: ignore[arg-type]
    assert dict(declarations_of(layer)) == {}


# ----------------------------------------------------------------------------------------------------
# stable_empty
# ----------------------------------------------------------------------------------------------------


def _pwal_with_workspace(layer: nn.Module, zero: bool = False) -> torch.Tensor:
    layer.quant_method.kernel.workspace = stable_empty(
        layer, "quant_method.kernel.workspace", (4, 2), torch.float32, "cpu", zero=zero
    )
    return layer.quant_method.kernel.workspace


def test_stable_empty_returns_the_same_storage_on_every_rerun_and_declares_it() -> None:
    layer = _with_method()
    first = _pwal_with_workspace(layer)
    first.fill_(7.0)
    again = _pwal_with_workspace(layer)
    assert again.data_ptr() == first.data_ptr()
    assert again.untyped_storage() is first.untyped_storage()
    assert torch.equal(again, torch.full((4, 2), 7.0))  # zero=False leaves contents alone
    declaration = declarations_of(layer)["quant_method.kernel.workspace"]
    assert declaration.static


def test_stable_empty_zero_zeroes_in_place_every_time() -> None:
    layer = _with_method()
    first = _pwal_with_workspace(layer, zero=True)
    assert torch.equal(first, torch.zeros(4, 2))
    first.fill_(3.0)
    again = _pwal_with_workspace(layer, zero=True)
    assert again.data_ptr() == first.data_ptr()
    assert torch.equal(first, torch.zeros(4, 2))


def test_stable_empty_is_per_layer_and_per_name() -> None:
    one, two = Plain(), Plain()
    a = stable_empty(one, "ws", (3,), torch.float32, "cpu")
    b = stable_empty(two, "ws", (3,), torch.float32, "cpu")
    c = stable_empty(one, "other", (3,), torch.float32, "cpu")
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3


@pytest.mark.parametrize(
    ("shape", "dtype", "device"),
    [((5,), torch.float32, "cpu"), ((4,), torch.float16, "cpu"), ((4,), torch.float32, "meta")],
    ids=["shape", "dtype", "device"],
)
def test_stable_empty_with_another_layout_raises(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    layer = Plain()
    stable_empty(layer, "ws", (4,), torch.float32, "cpu")
    with pytest.raises(DeclarationError, match=r"ws.*recapture"):
        stable_empty(layer, "ws", shape, dtype, device)


# ----------------------------------------------------------------------------------------------------
# The weak per-layer store
# ----------------------------------------------------------------------------------------------------


class Doomed(nn.Module):
    """Only used by the store test below, so the store can be searched for its class."""


def test_a_collected_layer_leaves_nothing_in_the_store() -> None:
    layer = Doomed()
    layer.scale = torch.ones(3)
    layer.quant_method = Method()
    handle = register_derived(layer, "scale")
    layer.quant_method.kernel.workspace = stable_empty(
        layer, "quant_method.kernel.workspace", (2,), torch.float32, "cpu"
    )
    assert any(type(entry) is Doomed for entry in declared_layers())
    alive = weakref.ref(layer)
    del layer
    gc.collect()
    assert alive() is None  # the store (and the handle) did not keep it alive
    assert not any(type(entry) is Doomed for entry in declared_layers())
    assert not handle.active
    handle.remove()  # harmless once the layer is gone
    assert "active=False" in repr(handle)


# ----------------------------------------------------------------------------------------------------
# Public surface
# ----------------------------------------------------------------------------------------------------


def test_package_exports_the_public_api() -> None:
    for name in (
        "graph_visible",
        "register_derived",
        "stable_empty",
        "GraphContract",
        "ReloadOutcome",
        "Status",
        "Finding",
    ):
        assert name in graphsafe.__all__
        assert getattr(graphsafe, name) is not None
    assert {s.name for s in graphsafe.Status} >= {"COMMITTED", "NEEDS_RECAPTURE", "FAILED"}


def test_package_exports_every_error_class() -> None:
    errors = graphsafe.errors
    assert errors.__all__
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert isinstance(cls, type) and issubclass(cls, errors.GraphSafeError)
        assert getattr(graphsafe, name) is cls
        assert name in graphsafe.__all__


# ----------------------------------------------------------------------------------------------------
# declare: the public function a declarations pack uses
# ----------------------------------------------------------------------------------------------------


def test_declare_records_the_source_and_refuses_what_is_not_a_tensor() -> None:
    from graphsafe.registry import declare

    layer = Plain()
    layer.workspace = torch.zeros(3)
    before = declarations_generation(layer)
    declaration = declare(layer, "workspace", source="my pack: Plain")
    assert declarations_of(layer)["workspace"] is declaration
    assert declaration.source == "my pack: Plain" and not declaration.static
    moved = declarations_generation(layer)
    assert moved > before
    assert declare(layer, "workspace", source="my pack: Plain") is declaration  # idempotent
    assert declarations_generation(layer) == moved
    with pytest.raises(DeclarationError, match="does not resolve"):
        declare(layer, "missing", source="my pack: Plain")
    with pytest.raises(DeclarationError, match="bad slot path"):
        declare(layer, "a..b", source="my pack: Plain")
    with pytest.raises(DeclarationError, match=r"nn\.Module"):
        declare(object(), "workspace", source="my pack")  # type: ignore[arg-type]
