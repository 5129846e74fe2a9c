"""One advice generator, one answer, for a legacy layer whose quant method creates its workspace lazily (on the
first forward): the CLI report with ``--capture``, its JSON document and ``assert_reload_stable`` print the same
fix, and pasting it as printed makes strict mode commit three reloads with new weights. Without a capture the report
cannot tell scratch from a tensor computed from the weights: it prints no fix for the workspace but the two choices,
and each choice, pasted as printed where it says, commits too. A wrong declaration's problems are listed, in text and
JSON, not only counted."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

from graphsafe import GraphContract, Status
from graphsafe.cli import main
from graphsafe.report import FixKind, MigrationReport, report_schema
from graphsafe.testing import ReloadUnstable, assert_reload_stable

KERNEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    from graphsafe import graph_visible, register_derived
    from graphsafe.cli import ReloadTarget

    #: Lines pasted right after the code that creates the workspace, as a fix says.
    AFTER_CREATE = []
    #: Lines pasted in the quant method's PWAL, after it computes what it computes, as a fix says.
    IN_PWAL = []


    class Method:
        def __init__(self):
            self.workspace = None

        def process_weights_after_loading(self, layer):
            layer.w_t = (layer.weight * 2).t().contiguous()  # a new tensor at every load
            for line in IN_PWAL:
                exec(line, globals(), {"layer": layer})

        def apply(self, layer, x):
            if self.workspace is None:  # created lazily, on the first forward
                self.workspace = torch.zeros(16)
                for line in AFTER_CREATE:
                    exec(line, globals(), {"layer": layer})
            self.workspace.zero_()
            return x @ layer.w_t + self.workspace[:4]


    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
            self.quant_method = Method()

        def forward(self, x):
            return self.quant_method.apply(self, x)


    def load(model, seed):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, Layer):
                    layer.weight.copy_(torch.randn(4, 4, generator=generator))
                    layer.quant_method.process_weights_after_loading(layer)


    def warmup(model):
        model(torch.ones(2, 4))


    def target():
        model = nn.Sequential(Layer(), Layer())
        load(model, 0)
        return ReloadTarget(model, reload=load, warmup=warmup)
    """
)


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh copy of the kernel module per name (a fix edits its class, as an author edits the file)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def fresh(name: str) -> ModuleType:
        (tmp_path / f"{name}.py").write_text(KERNEL)
        made.append(name)
        return importlib.import_module(name)

    yield fresh
    for name in made:
        sys.modules.pop(name, None)


def _apply(kernel: ModuleType, owner_fixes: list[tuple[FixKind, str, list[str]]]) -> None:
    """Paste each fix as printed: a decorator on the function it names, register_derived lines where it says."""
    for kind, target, lines in owner_fixes:
        if kind is FixKind.GRAPH_VISIBLE:
            assert target.endswith("Method.process_weights_after_loading"), target
            pwal = kernel.Method.process_weights_after_loading
            for line in reversed(lines):
                pwal = eval(line[1:], vars(kernel))(pwal)
            kernel.Method.process_weights_after_loading = pwal
        elif "right after the code that creates" in target or "right after the code that assigns" in target:
            kernel.AFTER_CREATE.extend(lines)
        else:
            assert target.startswith(f"{kernel.__name__}.Method.process_weights_after_loading"), target
            kernel.IN_PWAL.extend(lines)


def _strict_commits_three_reloads(kernel: ModuleType) -> None:
    target = kernel.target()
    model = target.model
    contract = GraphContract(model, "strict").seal()  # right after the first load, as an engine seals
    target.warmup(model)  # the first forward creates the workspace (and runs what a fix pasted there)
    captured = [(layer.w_t.data_ptr(), layer.quant_method.workspace.data_ptr()) for layer in model]
    for seed in (1, 2, 3):
        with contract.reload() as txn:
            kernel.load(model, seed)
        assert txn.outcome is not None and txn.outcome.status is Status.COMMITTED, txn.outcome.summary()
        target.warmup(model)
        assert [(layer.w_t.data_ptr(), layer.quant_method.workspace.data_ptr()) for layer in model] == captured
        cold = kernel.target()
        kernel.load(cold.model, seed)
        assert all(torch.equal(a.w_t, b.w_t) for a, b in zip(model, cold.model, strict=True))


def _report_json(spec: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{spec.partition(':')[0]}.json"
    assert main(["report", spec, "--format", "json", "-o", str(out), *extra]) == 1
    document: dict[str, Any] = json.loads(out.read_text())
    jsonschema.validate(document, report_schema())
    return document


def _as_fixes(document: dict[str, Any]) -> list[tuple[FixKind, str, list[str]]]:
    return [(FixKind(f["kind"]), f["target"], f["lines"]) for f in document["fixes"]]


def test_the_cli_with_a_capture_and_its_json_give_the_fix_that_makes_strict_commit(
    kernels: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernels("lazy_cli")
    document = _report_json("lazy_cli:target", tmp_path, "--capture")
    lines = [line for f in document["fixes"] for line in f["lines"]]
    assert 'register_derived(layer, "quant_method.workspace", static=True)' in lines, lines
    assert not document["undecided"]
    assert main(["report", "lazy_cli:target", "--capture"]) == 1
    text = capsys.readouterr().out
    assert all(line in text for line in lines), text  # the text report prints the same lines
    fixed = kernels("lazy_cli_fixed")
    _apply(fixed, _as_fixes(document))
    _strict_commits_three_reloads(fixed)


def test_assert_reload_stable_gives_the_same_fix_and_it_makes_strict_commit(kernels: Any, tmp_path: Path) -> None:
    kernel = kernels("lazy_toolkit")

    def make_layer() -> nn.Module:
        return nn.Sequential(kernel.Layer(), kernel.Layer())

    def load_weights(model: nn.Module, generator: torch.Generator) -> None:
        kernel.load(model, int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))

    with pytest.raises(ReloadUnstable) as raised:
        assert_reload_stable(make_layer, load_weights, example_input=torch.ones(2, 4))
    report: MigrationReport = raised.value.report
    toolkit = [(f.kind, f.target.replace("lazy_toolkit", "lazy_cli"), list(f.lines)) for f in report.fixes]
    kernels("lazy_cli")
    assert toolkit == _as_fixes(_report_json("lazy_cli:target", tmp_path, "--capture"))  # one answer
    fixed = kernels("lazy_toolkit_fixed")
    _apply(fixed, [(kind, target.replace("lazy_cli", "lazy_toolkit_fixed"), lines) for kind, target, lines in toolkit])
    _strict_commits_three_reloads(fixed)
    refixed = kernels("lazy_toolkit_refixed")
    _apply(refixed, [(k, t.replace("lazy_cli", "lazy_toolkit_refixed"), lines) for k, t, lines in toolkit])
    assert_reload_stable(
        lambda: nn.Sequential(refixed.Layer(), refixed.Layer()),
        lambda model, generator: refixed.load(model, int(torch.randint(0, 2**31 - 1, (1,), generator=generator))),
        example_input=torch.ones(2, 4),
    )


def test_without_a_capture_the_report_gives_the_two_choices_not_a_fix_that_fails(
    kernels: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernels("lazy_nocap")
    document = _report_json("lazy_nocap:target", tmp_path)
    declared = [line for f in document["fixes"] for line in f["lines"] if "quant_method.workspace" in line]
    assert not declared, f"a fix for the workspace without the evidence to choose: {declared}"
    (undecided,) = document["undecided"]
    assert undecided["paths"] == ["quant_method.workspace"] and "--capture" in undecided["reason"]
    scratch, derived = undecided["choices"]
    assert scratch["lines"] == ['register_derived(layer, "quant_method.workspace", static=True)']
    assert derived["lines"] == ['register_derived(layer, "quant_method.workspace")']
    assert main(["report", "lazy_nocap:target"]) == 1
    text = capsys.readouterr().out
    assert "choose" in text and scratch["lines"][0] in text and derived["lines"][0] in text, text
    # The scratch choice, pasted where it says (with the other fixes), commits: the workspace is scratch.
    fixed = kernels("lazy_nocap_scratch")
    _apply(fixed, [*_as_fixes(document), (FixKind.REGISTER_DERIVED, scratch["target"], scratch["lines"])])
    _strict_commits_three_reloads(fixed)


def test_problems_left_on_declared_slots_are_listed_in_text_and_json(
    kernels: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Declared the wrong way (as derived from the weights, where the forward creates it): nothing is left to
    migrate, and the report says what fails on the declared slots and what to do, instead of only a count."""
    wrong = kernels("lazy_wrong")
    _apply(
        wrong,
        [
            (
                FixKind.REGISTER_DERIVED,
                "lazy_wrong.Method: right after the code that creates each path",
                ['register_derived(layer, "quant_method.workspace")'],
            )
        ],
    )
    wrong.IN_PWAL.append('register_derived(layer, "w_t")')
    document = _report_json("lazy_wrong:target", tmp_path)
    assert not document["entries"] and document["summary"]["declared_problems"] == 2
    problems = document["declared_problems"]
    assert {(p["layer"], p["path"], p["drift"]) for p in problems} == {
        ("0", "quant_method.workspace", "stale"),
        ("1", "quant_method.workspace", "stale"),
    }
    assert all("static=True" in p["detail"] for p in problems), problems
    assert main(["report", "lazy_wrong:target"]) == 1
    text = capsys.readouterr().out
    assert "nothing to migrate" in text and "Problems on declared slots" in text, text
    assert text.count("stale: 'quant_method.workspace'") == 2, text
