"""The migration report: entries, owners, grouped fix lines, every rendering (golden files) and the JSON schema.

The golden model below is deterministic (fixed shapes, seeded weights) and covers what a report must handle: a
quant method owning tensors on a kernel object, two paths onto one tensor, a declared slot and an undeclared
alias of it, a path only some layers of an owner have, a layer's own PWAL, views sharing a storage, a tensor whose
shape changes every reload, a partial, a lazily allocated scratch the PWAL drops, and a module-level table only a
capture manifest sees. ``ViewLinear`` keeps a view of its own parameter: an alias, never work. Regenerate the
goldens with ``GRAPHSAFE_REGEN_GOLDEN=1``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

from graphsafe import (
    ContractViolation,
    GraphContract,
    ReloadFailedError,
    ReloadOutcome,
    UndeclaredDriftError,
    graph_visible,
    register_derived,
)
from graphsafe.collectors import record_capture
from graphsafe.outcome import FindingKind, Origin, SlotRef, Status
from graphsafe.registry import undeclare
from graphsafe.report import (
    FORMATS,
    SCHEMA_ID,
    STABLE,
    AliasEntry,
    FixKind,
    MigrationReport,
    migration_report,
    report_schema,
)

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
REGEN = os.environ.get("GRAPHSAFE_REGEN_GOLDEN") == "1"
GOLDEN_MODULE = "goldenpkg.kernels"
IN, OUT = 6, 4


def _pinned(cls: type) -> type:
    # Fix lines name classes by module; pin it so goldens do not depend on how pytest imports this file.
    cls.__module__ = GOLDEN_MODULE
    return cls


#: A lookup table the forward reads that no layer attribute holds: only a capture manifest sees it.
_TABLE = torch.arange(4, dtype=torch.float32)


def _permute(x: torch.Tensor, *, perm: torch.Tensor) -> torch.Tensor:
    return x.index_select(-1, perm)


@_pinned
class Kernel:
    def __init__(self) -> None:
        self.workspace: torch.Tensor | None = None
        self.ab_strides: torch.Tensor | None = None
        self.c_strides: torch.Tensor | None = None
        self.scale_view: torch.Tensor | None = None


@_pinned
class WorkspaceMethod:
    """A quant method: its PWAL puts new tensors on its kernel object and on the layer."""

    def __init__(self) -> None:
        self.kernel = Kernel()

    def process_weights_after_loading(self, layer: QLinear) -> None:
        w = layer.weight.detach()
        self.kernel.workspace = torch.zeros(8, dtype=torch.int32)
        layer.w_t = w.t().contiguous()
        strides = torch.full((2,), w.shape[1], dtype=torch.int64)
        self.kernel.ab_strides = strides  # one tensor under two names
        self.kernel.c_strides = strides
        layer.scale = w.abs().amax(dim=1)
        register_derived(layer, "scale")  # declared ...
        self.kernel.scale_view = layer.scale  # ... and an undeclared alias of it, restored with it
        if layer.with_bias:
            layer.bias_t = w.sum(dim=1)  # only some layers of this owner have it

    def apply(self, layer: QLinear, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        assert kernel.workspace is not None and kernel.ab_strides is not None and kernel.scale_view is not None
        y = (x @ layer.w_t) * kernel.scale_view + kernel.workspace[:OUT].float() + kernel.ab_strides.sum()
        return y + layer.bias_t if layer.with_bias else y


@_pinned
class QLinear(nn.Module):
    w_t: torch.Tensor
    scale: torch.Tensor
    bias_t: torch.Tensor

    def __init__(self, with_bias: bool, method: type[WorkspaceMethod] = WorkspaceMethod) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(OUT, IN), requires_grad=False)
        self.quant_method = method()
        self.with_bias = with_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


@_pinned
class Attention(nn.Module):
    """A layer with its own PWAL (no quant method)."""

    W_UV: torch.Tensor
    W_UK_T: torch.Tensor
    topk: torch.Tensor

    def __init__(self, growing: bool = True, reset_scratch: bool = True) -> None:
        super().__init__()
        self.kv_b = nn.Parameter(torch.empty(IN, IN), requires_grad=False)
        self.rope = torch.ones(3)  # made once, never replaced
        self.growing = growing
        self.reset_scratch = reset_scratch
        self.loads = 0
        self._scratch: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        self.loads += 1
        kv = (self.kv_b * 2).t().contiguous()
        self.W_UV = kv[:, :3]  # two views of one new tensor
        self.W_UK_T = kv[:, 3:].t()
        rows = self.loads if self.growing else 1
        self.topk = self.kv_b[:rows].clone()  # growing: a new shape every load
        self.act = functools.partial(_permute, perm=torch.argsort(self.kv_b[:, 0]))
        if self.reset_scratch:
            self._scratch = None  # the next forward allocates a new one

    def _ensure_scratch(self, x: torch.Tensor) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.zeros(4, IN)
        return self._scratch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = self._ensure_scratch(x)
        out = (self.act(x) @ self.W_UV) @ self.W_UK_T
        out = out + self.topk.sum() + self.rope.sum() + _TABLE.sum()
        scratch[: x.shape[0]].copy_(out)
        return scratch[: x.shape[0]]


@_pinned
class GoldenModel(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer(x).sum() for layer in self.layers])


def _load(model: nn.Module, seed: int) -> None:
    """Upstream-style: new values into the parameters in place, then PWAL on every layer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    for layer in model.modules():
        if isinstance(layer, QLinear):
            layer.quant_method.process_weights_after_loading(layer)
        elif isinstance(layer, Attention):
            layer.process_weights_after_loading()


def _input() -> torch.Tensor:
    return torch.randn(3, IN, generator=torch.Generator().manual_seed(99))


def _golden_model(*, load: bool = True, **attention: bool) -> GoldenModel:
    model = GoldenModel([QLinear(False), QLinear(True), Attention(**attention)])
    if load:
        _load(model, 0)
    return model


def _sealed(model: nn.Module, mode: str) -> GraphContract:
    """The recommended start: the initial load recorded (what each PWAL computes), then the seal. Without the
    recording, an undeclared tensor PWAL never computes (``rope``) is stale on the first reload: nothing says yet
    that it does not depend on the weights."""
    contract = GraphContract(model, mode)  # type: ignore[arg-type]
    with contract.record_inputs():
        _load(model, 0)
    return contract.seal()


def _run(model: nn.Module, mode: str = "migrate", capture: bool = True) -> GraphContract:
    """Load (recorded) and seal, warm up, capture (CPU stand-in), reload with other weights."""
    x = _input()
    contract = _sealed(model, mode)
    model(x)
    if capture:
        with record_capture(contract, name="golden", ignore=[x]):
            model(x)
    try:
        with contract.reload():
            _load(model, 1)
    except UndeclaredDriftError:
        pass
    except ReloadFailedError:
        # The module-level table no path holds, read and unwritten: stale as a cache PWAL skipped (the report
        # tells to vouch for it).
        assert capture
    except ContractViolation:
        # Without a capture nothing says the lazy scratch is written by the graph: a tensor that appeared after the
        # recording is watched, so a reload that leaves it fails it stale.
        assert not capture
    return contract


@pytest.fixture
def golden() -> tuple[GoldenModel, GraphContract, MigrationReport]:
    model = _golden_model(load=False)
    contract = _run(model)
    return model, contract, migration_report(contract)


# ----------------------------------------------------------------------------------------------------------------
# Golden files: every format.


def _mask(document: Any) -> Any:
    """The JSON document with every device address replaced by 0 (addresses change run to run)."""
    if isinstance(document, dict):
        return {k: (0 if k == "data_ptr" and v is not None else _mask(v)) for k, v in document.items()}
    if isinstance(document, list):
        return [_mask(v) for v in document]
    return document


_SUFFIX = {"text": "txt", "markdown": "md", "json": "json", "tree": "tree.txt", "dot": "dot"}


def _check_golden(name: str, actual: str) -> None:
    path = GOLDEN_DIR / name
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
    assert path.exists(), f"missing golden {path}: run with GRAPHSAFE_REGEN_GOLDEN=1"
    expected = path.read_text(encoding="utf-8")
    assert actual == expected, f"{name} differs from its golden (GRAPHSAFE_REGEN_GOLDEN=1 regenerates)"


@pytest.mark.parametrize("fmt", FORMATS)
def test_rendering_matches_golden(golden: tuple[GoldenModel, GraphContract, MigrationReport], fmt: str) -> None:
    _, _, report = golden
    rendered = report.render(fmt)
    if fmt == "json":
        rendered = json.dumps(_mask(json.loads(rendered)), indent=2) + "\n"
    _check_golden(f"report.{_SUFFIX[fmt]}", rendered)


@_pinned
class MigratedMethod(WorkspaceMethod):
    """WorkspaceMethod migrated by hand (the way the report says)."""

    @graph_visible(
        "quant_method.kernel.workspace", "quant_method.kernel.ab_strides", "quant_method.kernel.c_strides", "w_t"
    )
    def process_weights_after_loading(self, layer: QLinear) -> None:
        super().process_weights_after_loading(layer)
        if layer.with_bias:
            register_derived(layer, "bias_t")


@_pinned
class MigratedAttention(Attention):
    def __init__(self) -> None:
        super().__init__(growing=False, reset_scratch=False)

    @graph_visible("W_UV", "W_UK_T", "topk", "act.keywords['perm']")
    @graph_visible("rope", static=True)
    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()

    def _ensure_scratch(self, x: torch.Tensor) -> torch.Tensor:
        scratch = super()._ensure_scratch(x)
        register_derived(self, "_scratch", static=True)
        return scratch


def _migrated_model() -> GoldenModel:
    model = GoldenModel([QLinear(False, MigratedMethod), QLinear(True, MigratedMethod), MigratedAttention()])
    _load(model, 0)
    return model


def test_empty_report_matches_golden() -> None:
    model = _migrated_model()
    contract = _run(model, capture=False)
    report = migration_report(contract)
    assert report.clean and contract.last_outcome is not None and contract.last_outcome.committed
    _check_golden("report-empty.txt", report.render("text"))
    assert report.render("tree") == "(nothing to migrate: no undeclared graph-visible tensor)\n"


def test_goldens_are_stable_across_runs() -> None:
    """Two independent models give byte-identical non-JSON renderings (no addresses, no run-dependent text)."""
    models = [_golden_model(load=False), _golden_model(load=False)]  # kept alive: a contract holds its model weakly
    first, second = (migration_report(_run(model)) for model in models)
    assert [e.data_ptr for e in first.entries] != [e.data_ptr for e in second.entries]  # the control
    for fmt in ("text", "markdown", "tree", "dot"):
        assert first.render(fmt) == second.render(fmt)


@pytest.mark.parametrize("fmt", ["text", "markdown", "tree", "dot"])
def test_human_formats_print_no_addresses(golden: tuple[GoldenModel, GraphContract, MigrationReport], fmt: str) -> None:
    _, _, report = golden
    rendered = report.render(fmt)
    assert not re.search(r"0x[0-9a-f]{6,}", rendered)
    for entry in report.entries:
        assert entry.data_ptr is not None and str(entry.data_ptr) not in rendered
    for unowned in report.unowned:
        assert unowned.data_ptr is not None and str(unowned.data_ptr) not in rendered


def test_dot_is_well_formed(golden: tuple[GoldenModel, GraphContract, MigrationReport]) -> None:
    """No Graphviz here: check the structure by hand (one statement a line, quoted labels, edges between nodes)."""
    _, _, report = golden
    lines = report.render("dot").splitlines()
    assert lines[0] == "digraph migration_report {" and lines[-1] == "}"
    defined: set[str] = set()
    edges: list[tuple[str, str]] = []
    for line in lines[1:-1]:
        assert line.endswith(";"), line
        unescaped_quotes = len(re.findall(r'(?<!\\)"', line))
        assert unescaped_quotes % 2 == 0, line
        if match := re.fullmatch(r"  (\w+) -> (\w+)( \[.*\])?;", line):
            edges.append((match[1], match[2]))
        elif match := re.fullmatch(r"  (\w+) \[.*\];", line):
            defined.add(match[1])
    assert edges and all(a in defined and b in defined for a, b in edges)
    leaves = [line for line in lines if "shape=ellipse" in line]
    assert len(leaves) == len(report.entries)
    assert sum("shape=note" in line for line in lines) == len(report.fixes)


def test_unknown_format_names_the_choices(golden: tuple[GoldenModel, GraphContract, MigrationReport]) -> None:
    _, _, report = golden
    with pytest.raises(ValueError, match=r"unknown report format 'yaml'.*text, markdown, json, tree, dot"):
        report.render("yaml")


# ----------------------------------------------------------------------------------------------------------------
# Content: entries, owners, drift, aliases, laziness.


def _by_where(report: MigrationReport) -> dict[tuple[str, str], Any]:
    return {(e.layer, e.path): e for e in report.entries}


def test_entries_name_every_undeclared_tensor_and_nothing_declared(
    golden: tuple[GoldenModel, GraphContract, MigrationReport],
) -> None:
    model, _, report = golden
    entries = _by_where(report)
    q = "quant_method.kernel."
    expected = {
        ("layers.0", f"{q}workspace"),
        ("layers.0", f"{q}ab_strides"),
        ("layers.0", f"{q}c_strides"),
        ("layers.0", "w_t"),
        ("layers.1", f"{q}workspace"),
        ("layers.1", f"{q}ab_strides"),
        ("layers.1", f"{q}c_strides"),
        ("layers.1", "w_t"),
        ("layers.1", "bias_t"),
        ("layers.2", "rope"),
        ("layers.2", "_scratch"),
        ("layers.2", "W_UV"),
        ("layers.2", "W_UK_T"),
        ("layers.2", "topk"),
        ("layers.2", "act.keywords['perm']"),
    }
    assert set(entries) == expected
    # The declared slot and the undeclared path onto its storage are not migration work.
    assert ("layers.0", "scale") not in entries and ("layers.0", f"{q}scale_view") not in entries
    workspace = entries[("layers.0", f"{q}workspace")]
    assert (workspace.shape, workspace.dtype, workspace.device, workspace.nbytes) == ((8,), "int32", "cpu", 32)
    assert workspace.layer_class == "QLinear" and workspace.via == ("WorkspaceMethod", "Kernel")
    assert entries[("layers.2", "W_UK_T")].shares_storage_with == "W_UV"
    assert entries[("layers.0", f"{q}c_strides")].shares_storage_with == f"{q}ab_strides"
    # A storage shared by two paths is counted once.
    assert report.nbytes == sum(e.nbytes for e in report.entries) - sum(
        e.nbytes for e in report.entries if e.shares_storage_with
    )
    del model


def test_drift_comes_from_the_reload_findings(golden: tuple[GoldenModel, GraphContract, MigrationReport]) -> None:
    _, contract, report = golden
    entries = _by_where(report)
    # FAILED: the module-level table no path holds, read and unwritten, is stale (vouch_fixed would clear it)
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.FAILED
    assert report.status is Status.FAILED and report.mode == "migrate" and report.reloaded
    kinds = {where: entry.drift_kind for where, entry in entries.items()}
    assert kinds[("layers.0", "quant_method.kernel.workspace")] is FindingKind.AUTO_RESTORED
    assert kinds[("layers.2", "topk")] is FindingKind.RESPECIFIED
    assert kinds[("layers.2", "_scratch")] is FindingKind.VANISHED
    assert kinds[("layers.2", "rope")] is None  # never replaced
    # The JSON spelling follows from the kind.
    assert entries[("layers.2", "topk")].drift == "respecified" and entries[("layers.2", "rope")].drift == STABLE
    assert not entries[("layers.2", "rope")].problem and entries[("layers.2", "topk")].problem
    assert not entries[("layers.0", "quant_method.kernel.workspace")].problem  # a repair, not a problem


def test_the_alias_of_a_declared_slot_appears_once_it_is_undeclared() -> None:
    """Negative control for the alias rule: without the declaration both paths are undeclared work."""

    class Undeclaring(WorkspaceMethod):
        def process_weights_after_loading(self, layer: QLinear) -> None:
            super().process_weights_after_loading(layer)
            assert undeclare(layer, "scale")

    model = GoldenModel([QLinear(False, Undeclaring)])
    _load(model, 0)
    paths = {e.path for e in migration_report(model).entries}
    assert {"scale", "quant_method.kernel.scale_view"} <= paths


@_pinned
class ViewLinear(nn.Module):
    """Keeps a transposed view of its own weight: ``w_t`` is an alias of the parameter ``weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(3)), False)
        self.w_t = self.weight.data.t()
        self.workspace = torch.zeros(4)  # the control: a tensor of its own, undeclared work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_t + self.workspace.sum()


def _sealed_aliases(contract: GraphContract) -> tuple[AliasEntry, ...]:
    """The seal's answer: its alias slots, as report values."""
    return tuple(
        AliasEntry(s.layer, s.layer_class, s.path, s.alias_of)
        for s in contract.slots()
        if s.origin is Origin.ALIAS and s.alias_of is not None
    )


def test_a_view_of_a_parameter_is_an_alias_to_the_model_the_contract_and_the_seal_alike() -> None:
    """``self.w_t = self.weight.data.t()``: restored with ``weight``, so nothing to declare, from either source."""
    model = GoldenModel([ViewLinear()])
    contract = _sealed(model, "strict")
    sealed = _sealed_aliases(contract)
    assert sealed == (AliasEntry("layers.0", "ViewLinear", "w_t", "weight"),)
    from_model, from_contract = migration_report(model), migration_report(contract)
    for report in (from_model, from_contract):
        assert [e.path for e in report.entries] == ["workspace"], report.render()
        assert report.aliases == sealed
        assert report.aliases[0].target == SlotRef("layers.0", "weight")
    # A reload that writes the weight in place keeps the alias; the report still has nothing more to say.
    with contract.reload():
        _load(model, 1)
    after = migration_report(contract)
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert [e.path for e in after.entries] == ["workspace"] and after.aliases == sealed
    assert json.loads(after.render("json"))["aliases"] == [
        {"layer": "layers.0", "layer_class": "ViewLinear", "path": "w_t", "alias_of": "weight"}
    ]


def test_model_and_contract_agree_with_the_seal_on_the_golden_aliases(
    golden: tuple[GoldenModel, GraphContract, MigrationReport],
) -> None:
    model, contract, report = golden
    sealed = _sealed_aliases(contract)
    assert {(a.layer, a.path, a.alias_of) for a in sealed} == {
        ("layers.0", "quant_method.kernel.scale_view", "scale"),
        ("layers.1", "quant_method.kernel.scale_view", "scale"),
    }
    assert report.aliases == sealed == migration_report(model).aliases


def test_an_alias_made_after_the_seal_is_an_alias_not_work() -> None:
    layer = ViewLinear()
    model = GoldenModel([layer])
    contract = GraphContract(model, "migrate").seal()
    layer.w_head = layer.weight.data[:2]  # after the seal: the contract report classifies it now
    report = migration_report(contract)
    assert [e.path for e in report.entries] == ["workspace"], report.render()
    assert [(a.path, a.alias_of) for a in report.aliases] == [("w_t", "weight"), ("w_head", "weight")]
    assert report.aliases == migration_report(model).aliases


def test_owner_is_the_quant_method_else_the_layer(golden: tuple[GoldenModel, GraphContract, MigrationReport]) -> None:
    _, _, report = golden
    entries = _by_where(report)
    linear = entries[("layers.0", "w_t")]  # on the layer, but the quant method's PWAL made it
    assert linear.owner == f"{GOLDEN_MODULE}.WorkspaceMethod"
    assert linear.pwal == f"{GOLDEN_MODULE}.WorkspaceMethod.process_weights_after_loading"
    attention = entries[("layers.2", "W_UV")]
    assert attention.owner == f"{GOLDEN_MODULE}.Attention"
    assert attention.pwal == f"{GOLDEN_MODULE}.Attention.process_weights_after_loading"


def test_pwal_inherited_from_a_base_class_is_decorated_where_it_is_defined() -> None:
    class SubMethod(WorkspaceMethod):
        pass

    model = GoldenModel([QLinear(False, SubMethod)])
    _load(model, 0)
    entry = migration_report(model).entries[0]
    assert entry.owner.endswith("SubMethod")
    assert entry.pwal == f"{GOLDEN_MODULE}.WorkspaceMethod.process_weights_after_loading"


def test_lazy_tensors_get_register_derived_not_a_decorator(
    golden: tuple[GoldenModel, GraphContract, MigrationReport],
) -> None:
    _, _, report = golden
    scratch = _by_where(report)[("layers.2", "_scratch")]
    assert scratch.lazy and scratch.evidence == "after-seal"  # sealed before the warm-up allocated it
    fix = next(f for f in report.fixes if "_scratch" in f.paths)
    # It vanished in the reload: declaring alone would not keep the storage, so the fix line itself allocates it
    # through stable_empty (applied literally, the next reload keeps it).
    assert fix.kind is FixKind.REGISTER_DERIVED
    # Attention's own PWAL has no `layer`: the line names the layer `self`, as pasted there.
    assert fix.lines == ('self._scratch = stable_empty(self, "_scratch", (4, 6), torch.float32, "cpu")',)
    assert all("_scratch" not in line for f in report.fixes if f.kind is FixKind.GRAPH_VISIBLE for line in f.lines)


def test_a_tensor_found_only_after_the_seal_is_lazy_even_if_it_did_not_drift() -> None:
    model = _golden_model(load=False, growing=False, reset_scratch=False)
    # Captured: without a capture nothing says the graph writes the lazy scratch, which is then watched and
    # found stale (it appeared after the recording), a drift of its own.
    contract = _run(model)
    scratch = _by_where(migration_report(contract))[("layers.2", "_scratch")]
    assert scratch.lazy and scratch.drift == STABLE and scratch.evidence == "after-seal"


def test_sealed_after_warm_up_a_vanished_tensor_is_still_lazy() -> None:
    model = _golden_model(load=False)
    x = _input()
    contract = GraphContract(model, "recapture")
    with contract.record_inputs():
        _load(model, 0)
    model(x)  # warm up first: the scratch is in the seal
    contract.seal()
    with contract.reload():
        _load(model, 1)
    scratch = _by_where(migration_report(contract))[("layers.2", "_scratch")]
    assert scratch.evidence == "seal" and scratch.drift == "vanished" and scratch.lazy


# ----------------------------------------------------------------------------------------------------------------
# Fixes: grouped by owner, exact lines, and applying them works.


def test_fix_lines_are_grouped_by_owner_and_exact(golden: tuple[GoldenModel, GraphContract, MigrationReport]) -> None:
    _, _, report = golden
    fixes = [(f.kind, f.target, f.layers, f.lines) for f in report.fixes]
    method = f"{GOLDEN_MODULE}.WorkspaceMethod.process_weights_after_loading"
    attention = f"{GOLDEN_MODULE}.Attention.process_weights_after_loading"
    assert fixes[0] == (
        FixKind.GRAPH_VISIBLE,
        method,
        ("layers.0", "layers.1"),  # one line for both layers of the owner
        (
            '@graph_visible("quant_method.kernel.workspace", "quant_method.kernel.ab_strides", '
            '"quant_method.kernel.c_strides", "w_t")',
        ),
    )
    # bias_t exists on layers.1 only: a decorator would raise on layers.0, so it is declared per layer.
    assert fixes[1][0] is FixKind.REGISTER_DERIVED and fixes[1][2] == ("layers.1",)
    assert fixes[1][3] == ('register_derived(layer, "bias_t")',) and method in fixes[1][1]
    # rope kept its storage and was not written by the reload: it is declared static, on a line of its own.
    assert fixes[2] == (
        FixKind.GRAPH_VISIBLE,
        attention,
        ("layers.2",),
        ('@graph_visible("W_UV", "W_UK_T", "topk", "act.keywords[\'perm\']")', '@graph_visible("rope", static=True)'),
    )
    assert fixes[3][0] is FixKind.REGISTER_DERIVED
    assert fixes[3][3] == ('self._scratch = stable_empty(self, "_scratch", (4, 6), torch.float32, "cpu")',)
    assert len(fixes) == 4


def _apply_fixes(report: MigrationReport) -> tuple[type[WorkspaceMethod], type[Attention]]:
    """New subclasses with each fix's lines applied literally: decorators evaluated from their text, the
    register_derived calls run where the fix says (after PWAL assigns the path; after the lazy allocation)."""
    namespace = {"graph_visible": graph_visible, "register_derived": register_derived}

    def decorated(base: Any) -> Any:
        function = base.process_weights_after_loading
        for fix in report.fixes:
            target = f"{base.__name__}.process_weights_after_loading"
            if fix.kind is FixKind.GRAPH_VISIBLE and fix.target.endswith(target):
                for line in reversed(fix.lines):  # stacked decorators apply bottom-up
                    function = eval(line.removeprefix("@"), namespace)(function)
        return function

    def run(paths: tuple[str, ...], layer: nn.Module) -> None:
        for fix in report.fixes:
            if fix.kind is FixKind.REGISTER_DERIVED and set(fix.paths) & set(paths):
                for line in fix.lines:
                    eval(line, namespace, {"layer": layer, "self": layer})  # `self` in the layer's own code

    method_pwal = decorated(WorkspaceMethod)

    def pwal(self: WorkspaceMethod, layer: QLinear) -> None:
        method_pwal(self, layer)
        if layer.with_bias:
            run(("bias_t",), layer)

    def ensure(self: Attention, x: torch.Tensor) -> torch.Tensor:
        scratch = Attention._ensure_scratch(self, x)
        run(("_scratch",), self)
        return scratch

    def init(self: Attention) -> None:
        Attention.__init__(self, growing=False, reset_scratch=False)

    fixed_method = type("FixedMethod", (WorkspaceMethod,), {"process_weights_after_loading": pwal})
    fixed_attention = type(
        "FixedAttention",
        (Attention,),
        {"__init__": init, "process_weights_after_loading": decorated(Attention), "_ensure_scratch": ensure},
    )
    return fixed_method, fixed_attention


def test_applying_the_fixes_makes_the_report_empty_and_strict_mode_commit() -> None:
    legacy = GoldenModel([QLinear(False), QLinear(True), Attention(growing=False, reset_scratch=False)])
    # Captured: the capture shows the graph writes the lazy scratch (static evidence); without it the scratch is
    # watched and found stale, and the report cannot advise static=True.
    before = migration_report(_run(legacy, mode="strict"))
    assert len(before.fixes) == 4 and before.status is Status.FAILED
    fixed_method, fixed_attention = _apply_fixes(before)
    model = GoldenModel([QLinear(False, fixed_method), QLinear(True, fixed_method), fixed_attention()])
    contract = _run(model, mode="strict", capture=False)
    assert contract.last_outcome is not None and contract.last_outcome.committed, contract.last_outcome
    # The lazily declared scratch is sealed once it exists; the next strict reload keeps it too.
    contract.reseal()
    with contract.reload():
        _load(model, 2)
    assert contract.last_outcome.committed
    assert migration_report(contract).clean


def test_without_the_fixes_strict_mode_raises_with_a_report() -> None:
    model = _golden_model(load=False, growing=False, reset_scratch=False)
    x = _input()
    contract = _sealed(model, "strict")
    model(x)
    with record_capture(contract, ignore=[x]):  # the capture shows the graph writes the lazy scratch
        model(x)
    # (a ReloadFailedError: the module-level table, unwritten, is stale as well)
    with pytest.raises(ContractViolation) as info, contract.reload():
        _load(model, 1)
    assert "migration_report(contract)" in str(info.value)  # the error says where the report is
    report = migration_report(contract)
    # A report from the contract names the PWAL's owner (the quant method), not the layer.
    assert isinstance(report, MigrationReport) and report.source == "contract" and not report.clean
    owners = {entry.owner for entry in report.entries if entry.path == "quant_method.kernel.workspace"}
    assert owners and all("WorkspaceMethod" in owner for owner in owners), owners


# ----------------------------------------------------------------------------------------------------------------
# Sources: model, contract, outcome.


def test_model_source_walks_now_and_reports_no_drift() -> None:
    model = _golden_model()
    model(_input())
    report = migration_report(model)
    assert report.source == "model" and not report.reloaded and report.status is None
    assert {e.drift for e in report.entries} == {STABLE}
    assert {e.evidence for e in report.entries} == {"walk"}
    assert ("layers.2", "_scratch") in _by_where(report)
    assert report.fixes and report.fixes[0].kind is FixKind.GRAPH_VISIBLE


def test_outcome_source_without_the_model_falls_back_to_layer_classes(
    golden: tuple[GoldenModel, GraphContract, MigrationReport],
) -> None:
    model, contract, _ = golden
    outcome = contract.last_outcome
    assert isinstance(outcome, ReloadOutcome)
    bare = migration_report(outcome)
    assert bare.source == "outcome" and bare.entries
    assert {e.owner for e in bare.entries} <= {"QLinear", "Attention"} and all(e.pwal is None for e in bare.entries)
    assert any("pass model=" in note for note in bare.notes)
    # Only drifted slots are in an outcome; with the model, owners are exact.
    exact = migration_report(outcome, model=model)
    assert {e.path for e in exact.entries} == {e.path for e in bare.entries}
    pwal = f"{GOLDEN_MODULE}.WorkspaceMethod.process_weights_after_loading"
    assert _by_where(exact)[("layers.0", "w_t")].pwal == pwal
    assert ("layers.2", "rope") not in _by_where(exact)  # it did not drift


def test_declared_only_contract_says_it_did_not_collect() -> None:
    model = _golden_model()
    contract = GraphContract(model, "migrate", detect="declared-only").seal()
    report = migration_report(contract)
    assert report.clean
    assert any("declared-only" in note for note in report.notes)


def test_unowned_captured_storage_comes_from_the_manifest(
    golden: tuple[GoldenModel, GraphContract, MigrationReport],
) -> None:
    _, _, report = golden
    assert len(report.unowned) == 1
    unowned = report.unowned[0]
    assert unowned.data_ptr == _TABLE.untyped_storage().data_ptr()
    assert (unowned.shape, unowned.dtype, unowned.nbytes) == ((4,), "float32", 16)
    assert "capture 'golden'" in unowned.description
    # Without a capture there is no manifest, so nothing is unowned.
    assert migration_report(_run(_golden_model(load=False), capture=False)).unowned == ()


def test_only_a_capture_manifest_is_read_for_unowned_storage() -> None:
    """A manifest check of another kind is the contract's business; the report reads only a typed Manifest."""

    class OtherCheck:
        def reindex(self, contract: GraphContract) -> None:
            pass

        def check(self, contract: GraphContract) -> list[Any]:
            return []

        def unowned(self) -> list[torch.Tensor]:
            return [torch.zeros(3)]

    model = _golden_model(load=False)
    contract = _run(model, capture=False)
    contract.manifest = OtherCheck()
    assert migration_report(contract).unowned == ()


def test_bad_source_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module, a GraphContract or a ReloadOutcome, got int"):
        migration_report(42)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# JSON and its schema.


def _validate(document: Any) -> None:
    jsonschema.Draft202012Validator(report_schema()).validate(document)


def test_json_validates_against_the_schema_for_every_source(
    golden: tuple[GoldenModel, GraphContract, MigrationReport],
) -> None:
    model, contract, report = golden
    assert contract.last_outcome is not None
    jsonschema.Draft202012Validator.check_schema(report_schema())
    for candidate in (report, migration_report(model), migration_report(contract.last_outcome)):
        document = json.loads(candidate.render("json"))
        assert document["schema"] == SCHEMA_ID
        _validate(document)
    empty = migration_report(_migrated_model())
    assert empty.clean
    _validate(json.loads(empty.render("json")))


def test_json_carries_addresses_and_the_summary(golden: tuple[GoldenModel, GraphContract, MigrationReport]) -> None:
    _, _, report = golden
    document = json.loads(report.render("json"))
    assert [e["data_ptr"] for e in document["entries"]] == [e.data_ptr for e in report.entries]
    assert document["summary"]["entries"] == len(report.entries) == len(document["entries"])
    assert document["summary"]["by_drift"]["vanished"] == 1


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d.update(schema="graphsafe.migration-report/2"),
        lambda d: d["entries"][0].update(drift="exploded"),
        lambda d: d["entries"][0].pop("owner"),
        lambda d: d["fixes"][0].update(kind="monkeypatch"),
        lambda d: d.update(extra=1),
        lambda d: d["aliases"][0].pop("alias_of"),
    ],
    ids=["version", "drift", "missing-owner", "fix-kind", "extra-field", "alias-without-target"],
)
def test_the_schema_rejects_a_corrupted_report(
    golden: tuple[GoldenModel, GraphContract, MigrationReport], corrupt: Any
) -> None:
    _, _, report = golden
    document = json.loads(report.render("json"))
    corrupt(document)
    with pytest.raises(jsonschema.ValidationError):
        _validate(document)


class _TwoTables(nn.Module):
    """Two tables made at __init__ that PWAL never writes, beside a weight-derived tensor PWAL rebuilds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
        self.cos = torch.arange(4.0)
        self.sin = torch.arange(4.0) * 2

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight.t().contiguous()


def test_the_static_note_agrees_in_number() -> None:
    """The generated sentence said "they does not follow" for two static paths."""
    model = _TwoTables()
    contract = GraphContract(model, "migrate")
    # Recorded: PWAL is seen not making the tables. Without a recording they are found stale, which a PWAL
    # "already processed" guard looks like too, and the report never advises static=True for a stale tensor.
    with contract.record_inputs():
        model.weight.copy_(torch.randn(4, 4))
        model.process_weights_after_loading()
    contract.seal()
    with contextlib.suppress(ContractViolation), contract.reload():
        model.weight.copy_(torch.randn(4, 4))
        model.process_weights_after_loading()
    (fix,) = migration_report(contract).fixes
    assert fix.lines == ('@graph_visible("w_t")', '@graph_visible("cos", "sin", static=True)')
    assert "cos, sin, so they do not follow the weights" in fix.note and "flag them stale" in fix.note
    assert "they does" not in fix.note and "was not written" not in fix.note


class _Key:
    """A dict key no slot path can spell."""


_KEY = _Key()


class _ObjectKeyedCache(nn.Module):
    """PWAL caches its transposed weight in a dict under ``(4, <object>)``: no slot path can name it."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
        self.cache: dict[Any, torch.Tensor] = {}
        self.fixed = fixed

    def process_weights_after_loading(self) -> None:
        if self.fixed:  # the report's fix, literally: key by a plain int, declare where it is assigned
            self.cache[4] = self.weight.t().contiguous()
            register_derived(self, "cache[4]")
        else:
            self.cache[(4, _KEY)] = self.weight.t().contiguous()


def _load_cache(model: nn.Module, seed: int) -> None:
    model.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
    model.process_weights_after_loading()


def test_a_slot_no_path_can_name_is_a_finding_with_a_fix_not_a_note() -> None:
    """The report (no capture) said "nothing to migrate" with only a note at the bottom."""
    model = _ObjectKeyedCache()
    _load_cache(model, 0)
    contract = GraphContract(model, "migrate").seal()
    with contract.reload():
        _load_cache(model, 1)
    assert contract.last_outcome is not None and not contract.last_outcome.committed
    report = migration_report(contract)
    assert not report.clean and not any("untrackable" in note for note in report.notes)
    (place,) = report.untrackable
    assert place.where.endswith("(_ObjectKeyedCache)") and place.detail.startswith("cache: ")
    assert 'register_derived(layer, "cache[4]")' in place.fix and "plain int" in place.fix
    text = report.render("text")
    assert "nothing to migrate" not in text and "1 untrackable place(s)" in text.splitlines()[0]
    jsonschema.validate(json.loads(report.render("json")), report_schema())
    assert "## Untrackable" in report.render("markdown")

    fixed = _ObjectKeyedCache(fixed=True)
    _load_cache(fixed, 0)
    strict = GraphContract(fixed, "strict").seal()
    with strict.reload():
        _load_cache(fixed, 1)
    assert strict.last_outcome is not None and strict.last_outcome.committed
    assert migration_report(strict).clean
