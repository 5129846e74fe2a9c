"""``graphsafe.testing.assert_reload_stable`` on the example zoo and on hand-made faults.

Every zoo example is adapted to the ``make_layer`` / ``load_weights(layer, generator)`` protocol. Legacy
examples must fail with a report naming their real slot paths; migrated ones must pass having checked those
paths; injected faults (a PWAL that skips its rebuild, a loader that replaces a parameter, a PWAL that moves a
tensor only on a later reload) must be caught.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, GraphContract, graph_visible, migration_report, register_derived
from graphsafe.collectors import record_capture
from graphsafe.testing import StabilityResult, assert_reload_stable
from graphsafe.testing.zoo import EXAMPLES, Example, Variant, ZooModel

DOC = Path(__file__).resolve().parents[2] / "docs" / "making-a-kernel-reload-safe.md"
#: Zoo slots the migrated variants allocate with stable_empty (static: address-checked, not value-checked).
STABLE_EMPTY = {"quant_method.kernel.workspace", "_permute_scratch"}
NOT_LAZY = [name for name, ex in EXAMPLES.items() if not ex.lazy_paths and ex.unreachable is None]


def protocol(example: Example, variant: Variant) -> tuple[Callable[[], nn.Module], Callable[..., None]]:
    """The zoo's ``build``/``make_weights``/``load_weights`` as ``make_layer`` and ``load_weights``."""

    def make_layer() -> nn.Module:
        return ZooModel([example.make_layer(variant, torch.device("cpu")) for _ in range(2)])

    def load_weights(model: nn.Module, generator: torch.Generator) -> None:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        example.load_weights(model, example.make_weights(model, seed))

    return make_layer, load_weights


def example_input(example: Example) -> Callable[[nn.Module], torch.Tensor]:
    return lambda model: example.example_input(model)


def failure(make_layer: Callable[[], nn.Module], load: Callable[..., None], **kwargs: Any) -> str:
    with pytest.raises(AssertionError) as info:
        assert_reload_stable(make_layer, load, **kwargs)
    return str(info.value)


def report_paths(message: str) -> set[tuple[str, str]]:
    """``(layer, path)`` of every row of the migration report's table in a failure message."""
    rows = set()
    for line in message.splitlines():
        cells = line.split()
        if len(cells) >= 3 and re.fullmatch(r"layers\.\d+", cells[0]):
            rows.add((cells[0], cells[2]))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The zoo.


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_legacy_example_fails_with_a_report_naming_its_slots(name: str) -> None:
    example = EXAMPLES[name]
    message = failure(*protocol(example, "legacy"), example_input=example_input(example))
    assert message.startswith("assert_reload_stable(ZooModel, mode='strict'): reload 1 of 4")
    assert "graphsafe migration report" in message
    if example.unreachable is None:
        # The report's table names every graph-visible path of both layers, and nothing else.
        expected = {(layer, path) for layer in ("layers.0", "layers.1") for path in example.slot_paths}
        assert report_paths(message) == expected
        assert "graph_visible(" in message or "register_derived(" in message
    else:
        # module_cache: no path reaches the tensor; the capture manifest saw the graph read it, then it was freed.
        assert report_paths(message) == set()
        assert "unowned captured storage" in message.lower()
        assert "dead:" in message


@pytest.mark.parametrize("name", NOT_LAZY)
def test_legacy_report_prints_the_decorator_that_fixes_it(name: str) -> None:
    example = EXAMPLES[name]
    message = failure(*protocol(example, "legacy"))
    line = next(line.strip() for line in message.splitlines() if line.strip().startswith("@graph_visible("))
    declared = set(re.findall(r'"([^"]+)"', line))
    assert declared == set(example.slot_paths)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_migrated_example_passes_having_checked_its_slots(name: str) -> None:
    example = EXAMPLES[name]
    result = assert_reload_stable(*protocol(example, "migrated"), example_input=example_input(example))
    assert isinstance(result, StabilityResult)
    assert len(result.outcomes) == 4 and all(o.committed for o in result.outcomes)
    assert result.output_compared
    expected = {f"{layer}:{path}" for layer in ("layers.0", "layers.1") for path in example.slot_paths}
    assert expected <= set(result.slots)
    # Everything but stable_empty scratch (whose contents no reload defines) is compared by value too.
    scratch = {s for s in expected if s.split(":")[1] in STABLE_EMPTY}
    assert set(result.compared) & expected == expected - scratch
    assert result.manifest_storages > 0


def test_migrate_mode_accepts_undeclared_tensors_it_restores() -> None:
    example = EXAMPLES["marlin_workspace"]
    result = assert_reload_stable(*protocol(example, "legacy"), mode="migrate", example_input=example_input(example))
    assert all(o.committed for o in result.outcomes)
    # Each reload repaired the 2 x 2 undeclared slots: they were restored, not ignored.
    assert [len(o.auto_restored) for o in result.outcomes] == [4, 4, 4, 4]


def test_migrate_mode_cannot_save_a_scratch_that_pwal_drops() -> None:
    example = EXAMPLES["lazy_permute_scratch"]
    message = failure(*protocol(example, "legacy"), mode="migrate", example_input=example_input(example))
    assert "vanished: undeclared slot '_permute_scratch' of layers.0" in message


def test_lazy_scratch_is_only_seen_after_a_forward() -> None:
    example = EXAMPLES["lazy_permute_scratch"]
    legacy, migrated = protocol(example, "legacy"), protocol(example, "migrated")
    # Without an input nothing allocates the scratch: only w_t is graph-visible.
    assert report_paths(failure(*legacy)) == {("layers.0", "w_t"), ("layers.1", "w_t")}
    quiet = assert_reload_stable(*migrated)
    assert not any("_permute_scratch" in s for s in quiet.slots)
    # With one, the stable_empty scratch is address-checked but not value-checked (its contents are scratch).
    warm = assert_reload_stable(*migrated, example_input=example_input(example))
    assert "layers.0:_permute_scratch" in warm.slots
    assert "layers.0:_permute_scratch" not in warm.compared
    assert "layers.0:w_t" in warm.compared


def test_module_cache_is_invisible_without_an_example_input() -> None:
    # Nothing reachable from the layer holds the cached tensor: without a forward to record, there is nothing to
    # check, and the legacy site passes. The docs say so; this pins it.
    result = assert_reload_stable(*protocol(EXAMPLES["module_cache"], "legacy"))
    assert result.slots == () and result.manifest_storages == 0 and not result.output_compared


def test_a_whole_model_of_mixed_layers_names_only_the_bad_one() -> None:
    marlin, act_order = EXAMPLES["marlin_workspace"], EXAMPLES["act_order"]

    def make_layer() -> nn.Module:
        cpu = torch.device("cpu")
        return ZooModel([marlin.make_layer("migrated", cpu), act_order.make_layer("legacy", cpu)])

    load = protocol(marlin, "migrated")[1]  # Example.load_weights works on any ZooModel
    message = failure(make_layer, load, example_input=example_input(marlin))
    assert report_paths(message) == {("layers.1", "g_idx_sort_indices")}
    assert "quant_method.kernel" not in message


# ----------------------------------------------------------------------------------------------------------------
# Injected faults.


def skipping_rebuilds(example: Example, variant: Variant) -> tuple[Callable[[], nn.Module], Callable[..., None]]:
    """The example's protocol, but PWAL runs on a model's first load only: later loads copy weights and stop."""
    make_layer, load = protocol(example, variant)
    loaded: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def load_weights(model: nn.Module, generator: torch.Generator) -> None:
        if model not in loaded:
            loaded.add(model)
            load(model, generator)
            return
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        params = dict(model.named_parameters())
        for name, value in example.make_weights(model, seed).items():
            params[name].copy_(value)

    return make_layer, load_weights


def test_a_declared_slot_that_pwal_skips_is_stale() -> None:
    message = failure(*skipping_rebuilds(EXAMPLES["act_order"], "migrated"))
    assert "stale: declared slot 'g_idx_sort_indices' of layers.0" in message


def test_the_headline_names_stale_values_when_every_address_was_kept() -> None:
    headline = failure(*skipping_rebuilds(EXAMPLES["act_order"], "migrated")).splitlines()[0]
    assert "stale values" in headline and "captured address" in headline, headline
    assert "did not keep" not in headline, headline


def test_the_failure_is_a_public_assertion_error_of_graphsafe_testing() -> None:
    import graphsafe.testing

    with pytest.raises(graphsafe.testing.ReloadUnstable) as info:
        assert_reload_stable(*skipping_rebuilds(EXAMPLES["act_order"], "migrated"))
    assert isinstance(info.value, AssertionError)
    assert type(info.value).__module__ == "graphsafe.testing", "tracebacks name the public module"
    assert info.value.outcome.problems and info.value.report is not None


def test_an_undeclared_slot_that_pwal_skips_fails_the_value_oracle() -> None:
    # An undeclared tensor that stayed put while the weights changed: before any recording of PWAL nothing says it
    # does not depend on them, so the contract itself fails closed (stale), and the report says what to declare.
    message = failure(*skipping_rebuilds(EXAMPLES["machete_partial"], "legacy"), mode="migrate")
    assert "stale: undeclared slot" in message and "act_fn.keywords['perm']" in message
    assert "contract.record_inputs()" in message  # the fix for a tensor PWAL never computes
    assert """@graph_visible("act_fn.args[0]", "act_fn.keywords['perm']")""" in message


class ReplacingLinear(nn.Module):
    """Derived tensor declared and rebuilt properly, but its loader replaces the weight parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)

    @graph_visible("weight_t")
    def process_weights_after_loading(self) -> None:
        self.weight_t = self.weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t


def test_a_loader_that_replaces_a_parameter_is_restored_by_the_contract() -> None:
    # The contract tracks parameters: a same-geometry replacement is copied into the captured parameter, which is
    # bound back, so the independent address check of parameters and buffers passes on every reload.
    def load_weights(layer: nn.Module, generator: torch.Generator) -> None:
        assert isinstance(layer, ReplacingLinear)
        layer.weight = nn.Parameter(torch.randn(4, 4, generator=generator), requires_grad=False)
        layer.process_weights_after_loading()

    result = assert_reload_stable(ReplacingLinear, load_weights)
    assert result.state_tensors == 1 and result.compared == ("<model>:weight_t",)
    # weight_t (rebuilt by PWAL) and the replaced weight are both restored at every reload.
    assert all(o.committed and o.slots_restored == 2 for o in result.outcomes)


def test_a_loader_that_replaces_a_parameter_with_another_stride_order_is_restored_by_copy() -> None:
    def load_weights(layer: nn.Module, generator: torch.Generator) -> None:
        assert isinstance(layer, ReplacingLinear)
        value = torch.randn(4, 4, generator=generator)
        if getattr(layer, "loaded", False):
            value = value.t().contiguous().t()  # on a reload: the same values column-major (judged as captured)
        layer.loaded = True
        layer.weight = nn.Parameter(value, requires_grad=False)
        layer.process_weights_after_loading()

    result = assert_reload_stable(ReplacingLinear, load_weights, example_input=torch.randn(2, 4))
    assert all(o.committed for o in result.outcomes)


def test_a_loader_that_replaces_a_parameter_with_another_dtype_fails() -> None:
    def load_weights(layer: nn.Module, generator: torch.Generator) -> None:
        assert isinstance(layer, ReplacingLinear)
        value = torch.randn(4, 4, generator=generator)
        if getattr(layer, "loaded", False):
            value = value.double()  # on a reload: same shape, another dtype (no copy keeps the captured layout)
        layer.loaded = True
        layer.weight = nn.Parameter(value, requires_grad=False)
        layer.process_weights_after_loading()

    message = failure(ReplacingLinear, load_weights)
    expected = "respecified: declared slot 'weight' of <model> (ReplacingLinear): dtype torch.float32 -> torch.float64"
    assert expected in message
    assert "a parameter or buffer of the layer" in message
    assert "weight (parameter/buffer): moved from" not in message  # the contract's own finding names it


class CountingLinear(nn.Module):
    """Writes its derived tensor in place, except on its 4th load (a second A -> B), where it allocates anew."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
        self.loads = 0

    def process_weights_after_loading(self) -> None:
        self.loads += 1
        fresh = self.weight.t().contiguous()
        if self.loads == 1 or self.loads == 4:
            self.weight_t = fresh
        else:
            self.weight_t.copy_(fresh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t


def _load_counting(layer: nn.Module, generator: torch.Generator) -> None:
    assert isinstance(layer, CountingLinear)
    layer.weight.copy_(torch.randn(4, 4, generator=generator))
    layer.process_weights_after_loading()


def test_reloads_is_the_number_of_a_b_a_cycles() -> None:
    once = assert_reload_stable(CountingLinear, _load_counting, reloads=1, example_input=torch.randn(2, 4))
    assert len(once.outcomes) == 2 and once.slots == ("<model>:weight_t",)
    message = failure(CountingLinear, _load_counting, reloads=2, example_input=torch.randn(2, 4))
    assert "reload 3 of 4 (weights -> B, seed 1)" in message
    assert "moved: undeclared slot 'weight_t' of <model> (CountingLinear)" in message


def test_load_weights_must_use_its_generator() -> None:
    def constant(layer: nn.Module, generator: torch.Generator) -> None:
        assert isinstance(layer, CountingLinear)
        layer.weight.fill_(0.5)
        layer.process_weights_after_loading()

    with pytest.raises(ValueError, match="identical parameters for seeds 0 and 1"):
        assert_reload_stable(CountingLinear, constant)


def test_a_loader_error_propagates_with_a_note() -> None:
    calls = []

    def flaky(layer: nn.Module, generator: torch.Generator) -> None:
        calls.append(layer)
        if len(calls) == 3:  # subject A, reference B, then the first reload
            raise RuntimeError("checkpoint shard missing")
        _load_counting(layer, generator)

    with pytest.raises(RuntimeError, match="checkpoint shard missing") as info:
        assert_reload_stable(CountingLinear, flaky)
    assert any("during reload 1 of 4" in note for note in info.value.__notes__)


@pytest.mark.parametrize(("kwargs", "error"), [({"mode": "lenient"}, "unknown mode"), ({"reloads": 0}, "at least 1")])
def test_bad_arguments(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        assert_reload_stable(CountingLinear, _load_counting, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# The guide's code runs as it says.


def _doc_blocks() -> list[str]:
    return re.findall(r"```python[^\n]*\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_guide_fails_then_passes_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    legacy, test_code, fixed = _doc_blocks()[:3]
    module = types.ModuleType("my_kernels")
    monkeypatch.setitem(sys.modules, "my_kernels", module)
    exec(compile(legacy, "my_kernels.py", "exec"), module.__dict__)

    def run_guide_test() -> None:
        namespace: dict[str, Any] = {"__name__": "test_my_kernels"}
        exec(compile(test_code, "test_my_kernels.py", "exec"), namespace)
        namespace["test_my_int8_linear_is_reload_safe"]()

    with pytest.raises(AssertionError) as info:
        run_guide_test()
    # The fix the guide applies is the line the report prints, and the pasted report shows it too.
    fix_line = next(line.strip() for line in fixed.splitlines() if line.strip().startswith("@graph_visible("))
    assert fix_line in str(info.value)
    pasted = re.findall(r"```text\n(.*?)```", DOC.read_text(), flags=re.S)
    assert any(fix_line in block for block in pasted)
    exec(compile(fixed, "my_kernels.py", "exec"), module.__dict__)
    run_guide_test()


# ----------------------------------------------------------------------------------------------------
# One classification: a view of a weight is an alias wherever it is looked at
# ----------------------------------------------------------------------------------------------------


class _ViewOfWeight(nn.Module):
    """``w_t`` is a view of the weight (same storage), ``offset`` a buffer: nothing here needs declaring."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        self.register_buffer("offset", torch.zeros(4))
        self.w_t = self.weight.data.t()

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight.data.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_t + self.offset


def _load_view(layer: nn.Module, generator: torch.Generator) -> None:
    layer.weight.copy_(torch.randn(4, 3, generator=generator))
    layer.offset.copy_(torch.randn(4, generator=generator))
    layer.process_weights_after_loading()


def test_the_seal_the_reports_and_the_toolkit_agree_a_view_of_a_weight_is_an_alias() -> None:
    from graphsafe import GraphContract, Origin, migration_report

    result = assert_reload_stable(_ViewOfWeight, _load_view, example_input=torch.randn(2, 3))
    model = nn.Sequential(_ViewOfWeight())
    _load_view(model[0], torch.Generator().manual_seed(0))
    contract = GraphContract(model, "strict").seal()
    sealed = {(s.path, s.alias_of) for s in contract.slots() if s.origin is Origin.ALIAS}
    assert sealed == {("w_t", "weight")}
    for answer in (migration_report(model), migration_report(contract), result):
        assert {(a.path, a.alias_of) for a in answer.aliases} == sealed
    assert not migration_report(model).entries and not migration_report(contract).entries  # nothing to declare
    # The toolkit tracks the alias and counts the parameter and the buffer as state, not as slots to compare.
    assert result.slots == ("<model>:w_t",) and result.state_tensors == 2


# ----------------------------------------------------------------------------------------------------------------
# Seal where an engine seals, compare like with like, static from what PWAL wrote.


def _fill(layer: nn.Module, generator: torch.Generator) -> None:
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=generator))
    layer.process_weights_after_loading()


class LazyScratchKernel(nn.Module):
    """PWAL rebuilds a declared packed weight; the first forward allocates an activation scratch lazily (an
    AWQ-like kernel as a new author writes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.qweight = nn.Parameter(torch.empty(8, 8), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(8), requires_grad=False)
        self._act_scratch: torch.Tensor | None = None

    @graph_visible("w_packed")
    def process_weights_after_loading(self) -> None:
        self.w_packed = (self.qweight * self.scales).t().contiguous()

    def _scratch(self) -> torch.Tensor:
        if self._act_scratch is None:
            self._act_scratch = torch.empty(16, 8)
        return self._act_scratch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = self._scratch()[: x.shape[0]]
        torch.mul(x, 2.0, out=buf)
        return buf @ self.w_packed


def _report_after_one_reload(cls: type[nn.Module], mode: str, x: torch.Tensor) -> str:
    """What ``graphsafe report --capture`` does: load, seal, warm up, capture, reload once, report."""
    layer = cls()
    _fill(layer, torch.Generator().manual_seed(0))
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    layer(x)
    with record_capture(contract, ignore=[x]):
        layer(x)
    with contextlib.suppress(ContractViolation), contract.reload():
        _fill(layer, torch.Generator().manual_seed(1))
    return migration_report(contract).render("text")


def test_a_lazy_scratch_is_not_blamed_on_pwal() -> None:
    """Item 1: sealed after the warm-up, the scratch looked like PWAL's, the check failed and the advice was a
    decorator on PWAL, which raises DeclarationError at the first load. Sealed where an engine seals (before the
    warm-up), with the first load recorded, the scratch is what it is: the forward's, at a kept address."""
    x = torch.randn(4, 8)
    result = assert_reload_stable(LazyScratchKernel, _fill, example_input=x)
    assert result.compared == ("<model>:w_packed",) and result.manifest_storages > 0
    # A contract that records PWAL only at its first reload (the CLI) advises register_derived(static=True) where
    # the scratch is allocated, never a decorator on PWAL; following it literally commits.
    report = _report_after_one_reload(LazyScratchKernel, "strict", x)
    assert 'register_derived(self, "_act_scratch", static=True)' in report  # the layer's own forward: `self`
    assert '@graph_visible("_act_scratch"' not in report and "right after the code that assigns" in report

    class Fixed(LazyScratchKernel):
        def _scratch(self) -> torch.Tensor:
            if self._act_scratch is None:
                self._act_scratch = torch.empty(16, 8)
                register_derived(self, "_act_scratch", static=True)  # the printed line, layer = self
            return self._act_scratch

    assert "nothing to migrate" in _report_after_one_reload(Fixed, "strict", x)
    assert "<model>:_act_scratch" not in assert_reload_stable(Fixed, _fill, example_input=x).compared


class RunningScaleKernel(nn.Module):
    """A correct fp8-like kernel: PWAL derives an activation scale from the weights; every forward raises it to the
    largest activation seen (dynamic scaling). Strict mode commits it and it matches a cold model."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)

    @graph_visible("act_scale")
    def process_weights_after_loading(self) -> None:
        self.act_scale = self.weight.abs().amax().reshape(1).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.act_scale, x.abs().amax().reshape(1), out=self.act_scale)
        return (x / self.act_scale) @ self.weight


def test_values_are_compared_at_the_same_point_in_the_layers_life() -> None:
    """Item 2: the reloaded layer's tensors before its forward were compared with the reference's after its
    forward, so a correct kernel whose forward writes a derived tensor failed ("differs from weights B")."""
    x = torch.randn(4, 8) * 10  # larger than the weights: the forward moves the scale
    result = assert_reload_stable(RunningScaleKernel, _fill, example_input=x)
    assert result.compared == ("<model>:act_scale",) and result.output_compared


class InPlaceKernel(nn.Module):
    """Every derived tensor allocated once and written in place by PWAL, beside a torch.empty scratch PWAL never
    touches (undeclared: the report says what to declare)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)
        self.colsum = torch.empty(8)
        self.scratch = torch.empty(16, 8)

    def process_weights_after_loading(self) -> None:
        torch.sum(self.weight, dim=0, out=self.colsum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.scratch[: x.shape[0]]
        torch.matmul(x, self.weight, out=buf)
        return buf + self.colsum


def test_static_advice_follows_what_pwal_wrote_and_the_advice_works() -> None:
    """Items 2 and 3: an all-in-place kernel passes as it is (its torch.empty scratch is never compared by value).
    The report's advice: ``colsum`` is written in place by PWAL (its version counter moves, no finding), so it
    follows the weights and is not static; ``scratch`` is never written by PWAL: static. It was the other way
    round. Following the advice literally commits in strict mode and passes."""
    x = torch.randn(4, 8)
    result = assert_reload_stable(InPlaceKernel, _fill, example_input=x)
    assert "<model>:colsum" in result.compared and "<model>:scratch" not in result.compared
    report = _report_after_one_reload(InPlaceKernel, "migrate", x)
    assert '@graph_visible("colsum")' in report and '@graph_visible("scratch", static=True)' in report
    assert '"colsum", static=True' not in report

    class Fixed(InPlaceKernel):
        @graph_visible("colsum")
        @graph_visible("scratch", static=True)
        def process_weights_after_loading(self) -> None:
            super().process_weights_after_loading()

    assert "nothing to migrate" in _report_after_one_reload(Fixed, "strict", x)
    assert "<model>:colsum" in assert_reload_stable(Fixed, _fill, example_input=x).compared
