"""The example zoo: every site in both variants, eager on the CPU (plus one CUDA-graph test when a GPU is there).

What the zoo must guarantee for the differential oracle and the contract tests built on it:

- PWAL really recomputes its derived tensors from the weights (reload changes their values and the output);
- a cold build on seed B equals a build on seed A reloaded with B's weights;
- the legacy variant reproduces the bug (a slot's storage moves on reload) and declares nothing; the migrated one
  declares exactly ``slot_paths``;
- the forward reads every derived tensor, and a stale one changes the output;
- skipping PWAL makes the differential oracle fail.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_of
from graphsafe.testing.zoo import (
    EXAMPLES,
    HIDDEN,
    TOKENS,
    VARIANTS,
    Example,
    ZooModel,
    act_order,
    base,
    cutlass_moe,
    machete_closure,
    marlin,
    module_cache,
)

SITES = (
    "marlin_workspace",
    "act_order",
    "cutlass_moe_strides",
    "mla_transposed",
    "flashinfer_swiglu",
    "underscore_scales",
    "machete_partial",
    "machete_closure",
    "slots_kernel",
    "lazy_permute_scratch",
    "module_cache",
)

CASES = [pytest.param(EXAMPLES[name], variant, id=f"{name}-{variant}") for name in SITES for variant in VARIANTS]
EXAMPLE_PARAMS = [pytest.param(EXAMPLES[name], id=name) for name in SITES]

Key = tuple[int, str]


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def warm(example: Example, model: ZooModel) -> torch.Tensor:
    """One forward (allocates lazy scratch, as warm-up before capture does)."""
    return example.forward(model, example.example_input(model))


def derived(example: Example, model: ZooModel) -> dict[Key, torch.Tensor]:
    """Every derived tensor of every layer, uncopied (holding them keeps their storage alive)."""
    return {
        (index, path): tensor
        for index, layer in enumerate(example.layers(model))
        for path, tensor in example.derived(layer).items()
    }


def snapshot(example: Example, model: ZooModel) -> dict[Key, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in derived(example, model).items()}


def reload(example: Example, model: ZooModel, seed: int) -> None:
    example.load_weights(model, example.make_weights(model, seed))


class ReadRecorder(TorchDispatchMode):
    """Records the storages of every tensor an aten op receives (what a graph would read)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        for leaf in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(leaf, torch.Tensor):
                self.storages.add(leaf.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------------
# The zoo itself
# ----------------------------------------------------------------------------------------------------


def test_zoo_lists_every_site() -> None:
    assert tuple(EXAMPLES) == SITES
    for name, example in EXAMPLES.items():
        assert example.name == name
        assert example.models.strip()
        module = sys.modules[example.make_layer.__module__]
        assert module.__doc__ and "models" in module.__doc__.lower(), f"{module.__name__} needs a docstring"
        assert set(example.lazy_paths) <= set(example.slot_paths)
    assert all(EXAMPLES[name].slot_paths for name in SITES)


def test_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        EXAMPLES["act_order"].build("both")  # type: ignore[arg-type]


def test_load_weights_refuses_a_mismatched_state_dict() -> None:
    example = EXAMPLES["act_order"]
    model = example.build("legacy")
    weights = example.make_weights(model, 1)
    weights.pop("layers.0.weight")
    with pytest.raises(KeyError, match=r"missing \['layers.0.weight'\]"):
        example.load_weights(model, weights)


@pytest.mark.parametrize("example", EXAMPLE_PARAMS)
def test_make_weights_is_seeded(example: Example) -> None:
    model = example.build("legacy")
    first, again, other = (example.make_weights(model, seed) for seed in (5, 5, 6))
    assert first.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        assert first[name].shape == param.shape and first[name].dtype == param.dtype
        assert torch.equal(first[name], again[name])
        assert not torch.equal(first[name], other[name]), f"{name}: seeds 5 and 6 give the same values"
        assert all(dim <= 64 for dim in param.shape)


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_forward_is_deterministic(example: Example, variant: Any) -> None:
    model = example.build(variant, seed=3)
    twin = example.build(variant, seed=3)
    x = example.example_input(model)
    y = example.forward(model, x)
    assert y.shape == (TOKENS, HIDDEN) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert y.abs().mean() > 1e-2, "the output is too small to tell a stale tensor from a fresh one"
    assert torch.equal(example.forward(model, x), y)
    assert torch.equal(example.forward(twin, x), y)
    assert not torch.equal(example.forward(model, example.example_input(model, seed=1)), y)


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_slot_paths_resolve_to_tensors(example: Example, variant: Any) -> None:
    model = example.build(variant)
    warm(example, model)
    if example.name == "module_cache" and variant == "legacy":
        return  # the one legacy variant that holds its derived tensor at no layer path (the migration adds one)
    for layer in example.layers(model):
        for path in example.slot_paths:
            assert isinstance(SlotPath(path).resolve(layer), torch.Tensor), path


# ----------------------------------------------------------------------------------------------------
# PWAL recomputes from the weights
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_reload_recomputes_derived_values(example: Example, variant: Any) -> None:
    model = example.build(variant, seed=0)
    y_a = warm(example, model)
    before = snapshot(example, model)
    reload(example, model, 1)
    y_b = warm(example, model)
    after = snapshot(example, model)
    assert before.keys() == after.keys() and before
    for index in range(len(example.layers(model))):
        changed = [path for (i, path) in before if i == index and not torch.equal(before[i, path], after[i, path])]
        assert changed, f"layer {index}: no derived value changed on reload"
    assert not torch.equal(y_a, y_b)


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_reload_equals_cold_build(example: Example, variant: Any) -> None:
    cold_b = example.build(variant, seed=1)
    model = example.build(variant, seed=0)
    warm(example, model)
    reload(example, model, 1)
    x = example.example_input(model)
    assert torch.equal(example.forward(model, x), example.forward(cold_b, x))
    for (name, p), (cold_name, q) in zip(model.named_parameters(), cold_b.named_parameters(), strict=True):
        assert name == cold_name and torch.equal(p, q)
    ours, theirs = derived(example, model), derived(example, cold_b)
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key[1] not in example.lazy_paths:  # scratch contents are whatever the last forward left
            assert torch.equal(ours[key], theirs[key]), key
    # and back again
    reload(example, model, 0)
    assert torch.equal(example.forward(model, x), example.forward(example.build(variant, seed=0), x))


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_skipping_pwal_breaks_the_differential(example: Example, variant: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: with PWAL skipped, A reloaded with B's weights is not cold B."""
    cold_b = example.build(variant, seed=1)
    model = example.build(variant, seed=0)
    warm(example, model)
    monkeypatch.setattr(base, "run_pwal", lambda layer: None)
    reload(example, model, 1)
    x = example.example_input(model)
    assert not torch.equal(example.forward(model, x), example.forward(cold_b, x))


SITE_PWALS = [
    pytest.param(act_order, "process_act_order", "act_order", "legacy", id="act_order-function"),
    pytest.param(act_order, "process_act_order_migrated", "act_order", "migrated", id="act_order-migrated"),
    pytest.param(
        cutlass_moe.CutlassMoEMethod,
        "process_weights_after_loading",
        "cutlass_moe_strides",
        "migrated",
        id="cutlass-quant-method",
    ),
    pytest.param(module_cache, "process_cached_migrated", "module_cache", "migrated", id="module_cache"),
]


@pytest.mark.parametrize(("owner", "attr", "name", "variant"), SITE_PWALS)
def test_a_site_pwal_that_skips_recomputation_is_caught(
    owner: Any, attr: str, name: str, variant: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = EXAMPLES[name]
    cold_b = example.build(variant, seed=1)
    model = example.build(variant, seed=0)
    monkeypatch.setattr(owner, attr, lambda *args: None)
    reload(example, model, 1)
    x = example.example_input(model)
    assert not torch.equal(example.forward(model, x), example.forward(cold_b, x))


# ----------------------------------------------------------------------------------------------------
# The forward reads every derived tensor, and a stale one shows
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_forward_reads_every_derived_tensor(example: Example, variant: Any) -> None:
    model = example.build(variant)
    x = example.example_input(model)
    warm(example, model)
    with ReadRecorder() as recorder:
        example.forward(model, x)
    for key, tensor in derived(example, model).items():
        assert tensor.untyped_storage().data_ptr() in recorder.storages, f"the forward never reads {key}"


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_a_stale_derived_tensor_changes_the_output(example: Example, variant: Any) -> None:
    stale_source = example.build(variant, seed=0)
    model = example.build(variant, seed=1)
    x = example.example_input(model)
    warm(example, stale_source)
    fresh = example.forward(model, x)
    stale, current = derived(example, stale_source), derived(example, model)
    tried = []
    for key, tensor in current.items():
        if key[1] in example.lazy_paths or torch.equal(tensor, stale[key]):
            continue  # scratch is rewritten by every forward; constants (strides, zeroed locks) are never stale
        kept = tensor.clone()
        tensor.copy_(stale[key])
        try:
            assert not torch.equal(example.forward(model, x), fresh), f"a stale {key} does not change the output"
        finally:
            tensor.copy_(kept)
        tried.append(key)
    assert {index for index, _ in tried} == {0, 1}
    assert torch.equal(example.forward(model, x), fresh)


def test_marlin_forward_reads_the_lock_workspace() -> None:
    example = EXAMPLES["marlin_workspace"]
    model = example.build("legacy")
    x = example.example_input(model)
    fresh = example.forward(model, x)
    workspace = SlotPath(marlin.WORKSPACE).resolve(model.layers[0])
    workspace.fill_(3)  # what a reused, no-longer-zero block would hold
    assert not torch.equal(example.forward(model, x), fresh)


# ----------------------------------------------------------------------------------------------------
# Legacy reproduces the bug; migrated declares
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLE_PARAMS)
def test_legacy_reload_moves_a_graph_visible_tensor(example: Example) -> None:
    model = example.build("legacy", seed=0)
    warm(example, model)
    captured = derived(example, model)  # held, as a graph's pool would hold them
    reload(example, model, 1)
    for index, layer in enumerate(example.layers(model)):
        for path in example.lazy_paths:
            assert SlotPath(path).resolve(layer) is None, "legacy PWAL resets the lazy scratch"
        assert not declarations_of(layer)
        moved_by_pwal = {
            key
            for key, tensor in derived(example, model).items()
            if key[0] == index and tensor.data_ptr() != captured[key].data_ptr()
        }
        assert moved_by_pwal, f"layer {index}: reload kept every derived tensor in place; the bug is not reproduced"
    warm(example, model)  # the first forward after the reload
    now = derived(example, model)
    assert now.keys() == captured.keys()
    for key in (k for k in captured if k[1] in example.lazy_paths):
        assert now[key].data_ptr() != captured[key].data_ptr(), f"{key}: the first forward reused the scratch"


@pytest.mark.parametrize("example", EXAMPLE_PARAMS)
def test_migrated_declares_exactly_its_slots(example: Example) -> None:
    model = example.build("migrated", seed=0)
    warm(example, model)
    for layer in example.layers(model):
        declared = declarations_of(layer)
        assert set(declared) == {SlotPath(p).text for p in example.slot_paths}
        for path, declaration in declared.items():
            assert isinstance(SlotPath(path).resolve(layer), torch.Tensor)
            assert declaration.static == (path in example.lazy_paths or path == marlin.WORKSPACE)
    reload(example, model, 1)
    warm(example, model)
    for layer in example.layers(model):
        assert set(declarations_of(layer)) == {SlotPath(p).text for p in example.slot_paths}


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("marlin_workspace", marlin.WORKSPACE),
        ("lazy_permute_scratch", "_permute_scratch"),
        ("module_cache", f"{module_cache.__name__}._DERIVED_CACHE[id(layer)]"),
    ],
)
def test_migrated_stable_storage_survives_reload(name: str, path: str) -> None:
    example = EXAMPLES[name]
    model = example.build("migrated", seed=0)
    warm(example, model)
    before = {key: (t, t.clone()) for key, t in derived(example, model).items() if key[1] == path}
    assert len(before) == 2
    reload(example, model, 1)
    warm(example, model)
    after = derived(example, model)
    for key, (tensor, values) in before.items():
        assert after[key].data_ptr() == tensor.data_ptr() and after[key] is tensor
        if name == "module_cache":
            assert not torch.equal(after[key], values), "the cache entry was not rewritten in place"
        if name == "marlin_workspace":
            assert not after[key].any(), "the workspace is re-zeroed"


def test_the_migrated_module_cache_entry_is_held_by_its_layer() -> None:
    example = EXAMPLES["module_cache"]
    model = example.build("migrated")
    for layer in example.layers(model):
        (tensor,) = module_cache.cached_weight(layer).values()
        assert layer.folded is tensor and example.derived(layer)["folded"] is tensor


# ----------------------------------------------------------------------------------------------------
# Site specifics
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_cutlass_strides_are_one_tensor_on_a_rebuilt_experts_object(variant: Any) -> None:
    example = EXAMPLES["cutlass_moe_strides"]
    model = example.build(variant)
    layer = model.layers[0]
    experts = SlotPath("quant_method.moe_kernel.fused_experts").resolve(layer)
    assert experts.c_strides2 is experts.ab_strides1
    assert experts.ab_strides1.dtype == torch.int64
    reload(example, model, 1)
    rebuilt = SlotPath("quant_method.moe_kernel.fused_experts").resolve(layer)
    assert rebuilt is not experts
    assert rebuilt.c_strides2 is rebuilt.ab_strides1


@pytest.mark.parametrize("variant", VARIANTS)
def test_mla_slots_are_transposed_views_of_one_storage(variant: Any) -> None:
    model = EXAMPLES["mla_transposed"].build(variant)
    layer = model.layers[0]
    w_uv, w_uk_t = layer.W_UV, layer.W_UK_T
    assert w_uv.untyped_storage().data_ptr() == w_uk_t.untyped_storage().data_ptr()
    assert not w_uv.is_contiguous() and not w_uk_t.is_contiguous()
    assert w_uk_t.untyped_storage().data_ptr() != layer.kv_b_proj.weight.untyped_storage().data_ptr()


def test_flashinfer_constants_are_fp32() -> None:
    model = EXAMPLES["flashinfer_swiglu"].build("legacy")
    for path, tensor in EXAMPLES["flashinfer_swiglu"].derived(model.layers[0]).items():
        assert tensor.dtype == torch.float32, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_machete_partial_holds_the_permutation(variant: Any) -> None:
    layer = EXAMPLES["machete_partial"].build(variant).layers[0]
    perm = SlotPath("act_fn.keywords['perm']").resolve(layer)
    assert perm is layer.act_fn.keywords["perm"]
    assert torch.equal(perm, torch.argsort(layer.g_idx, stable=True))
    assert SlotPath("act_fn.args[0]").resolve(layer) is layer.act_fn.args[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_machete_closure_cell_index_is_act_perm(variant: Any) -> None:
    layer = EXAMPLES["machete_closure"].build(variant).layers[0]
    assert machete_closure.PERM == "act_fn.__closure__[0]"
    assert layer.act_fn.__code__.co_freevars[machete_closure.PERM_CELL] == "act_perm"
    perm = SlotPath(machete_closure.PERM).resolve(layer)
    assert torch.equal(perm, torch.argsort(layer.g_idx, stable=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_slots_kernel_has_no_instance_dict(variant: Any) -> None:
    layer = EXAMPLES["slots_kernel"].build(variant).layers[0]
    assert not hasattr(layer.kernel, "__dict__")
    assert isinstance(SlotPath("kernel.scales").resolve(layer), torch.Tensor)


def test_module_cache_is_unreachable_from_the_layer_and_leaves_with_it() -> None:
    example = EXAMPLES["module_cache"]
    model = example.build("legacy")
    layer = model.layers[0]
    (tensor,) = example.derived(layer).values()
    holders = [ref for ref in gc.get_referrers(tensor) if isinstance(ref, dict)]
    assert holders and all(ref is module_cache._DERIVED_CACHE for ref in holders)
    assert not any(t is tensor for t in layer.__dict__.values())
    assert not declarations_of(layer)
    keys = {id(layer) for layer in example.layers(model)}
    assert keys <= module_cache._DERIVED_CACHE.keys()
    del model, layer, tensor
    gc.collect()
    assert not keys & module_cache._DERIVED_CACHE.keys()


# ----------------------------------------------------------------------------------------------------
# On a GPU: the forwards capture, and a legacy reload makes the replay stale
# ----------------------------------------------------------------------------------------------------


def _capture(model: nn.Module, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(x)  # warm-up: lazy scratch is allocated here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(x)
    return graph, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("example", "variant"), CASES)
def test_forward_captures_and_legacy_reload_goes_stale(example: Example, variant: Any) -> None:
    model = example.build(variant, seed=0, device="cuda")
    x = example.example_input(model)
    graph, out = _capture(model, x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, example.forward(model, x))
    if variant == "legacy":
        captured = derived(example, model)  # keep the captured storages alive and unchanged
        reload(example, model, 1)
        expected = example.forward(model, x)
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, expected), "the replay followed the reload without any help"
        del captured
