"""``pytest --graphsafe-fix-diff FILE``: the diff ``graphsafe fix`` proposes, written for the layers a test suite's
``graphsafe_contract`` contracts touched (each fix once however many tests touched its class), no source file
changed. Applied, it makes the failing suite pass, and the suite run again writes an empty diff."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import libcst
import pytest

import graphsafe

pytest_plugins = ["pytester"]

#: The inner sessions import graphsafe from this source tree, and LibCST from wherever this session has it.
PYTHONPATH = os.pathsep.join(
    [str(Path(graphsafe.__file__).resolve().parents[1]), str(Path(libcst.__file__).resolve().parents[1])]
)

KERNELS = '''"""Two legacy layers: PWAL makes a new tensor on every load; forward() makes its scratch on first use."""

import torch
from torch import nn


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)

    def process_weights_after_loading(self):
        # the kernel wants (in, out)
        self.w_t = self.weight.t().contiguous()

    def forward(self, x):
        return x @ self.w_t


class Scratchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)
        self.w_t = None
        self.scratch = None

    def process_weights_after_loading(self):
        self.w_t = self.weight.t().contiguous()

    def forward(self, x):
        if self.scratch is None:
            self.scratch = torch.empty(4, 8)  # written by every call
        torch.matmul(x, self.w_t, out=self.scratch)
        return self.scratch.clone()
'''

COMMON = """
import torch
from torch import nn

import kernels


def build():
    model = nn.Sequential(kernels.Transposed(), kernels.Scratchy())
    load(model, 0)
    return model


def load(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
        for layer in model:
            layer.process_weights_after_loading()


def warmup(model):
    with torch.no_grad():
        model(torch.randn(4, 8))
"""

TESTS = """
import torch
from graphsafe import capture

from common import build, load, warmup


def test_one(graphsafe_contract):
    model = build()
    contract = graphsafe_contract(model, mode="strict")
    warmup(model)  # as an engine does before it captures
    graph = capture(contract, model, torch.randn(4, 8))  # kept: a graph dropped is forgotten by the manifest
    with contract.reload():
        load(model, 1)
    graph.replay()


def test_two(graphsafe_contract):
    model = build()
    contract = graphsafe_contract(model, mode="strict")
    warmup(model)  # as an engine does before it captures
    graph = capture(contract, model, torch.randn(4, 8))  # kept: a graph dropped is forgotten by the manifest
    for seed in (2, 3):
        with contract.reload():
            load(model, seed)
        graph.replay()


def test_untouched():
    build()
"""

TARGET = """
from common import build, load, warmup


def target():
    return build(), load, warmup
"""


def inner(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", PYTHONPATH)
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=240)


def graphsafe_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), PYTHONPATH])}
    return subprocess.run(
        [sys.executable, "-m", "graphsafe", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_the_plugin_writes_the_patch_graphsafe_fix_proposes(pytester: pytest.Pytester) -> None:
    kernels = pytester.makepyfile(kernels=KERNELS)
    pytester.makepyfile(common=COMMON, target=TARGET, test_suite=TESTS)
    before = kernels.read_text(encoding="utf-8")

    result = inner(pytester, "--graphsafe-fix-diff=out/fix.diff", "test_suite.py")
    result.assert_outcomes(passed=1, failed=2)  # strict: the legacy layers make undeclared tensors
    diff = (pytester.path / "out" / "fix.diff").read_text(encoding="utf-8")
    assert kernels.read_text(encoding="utf-8") == before  # a diff, nothing written
    assert diff.startswith("--- a/kernels.py\n+++ b/kernels.py\n")
    # Two tests touched both classes: every fix is in the diff once.
    assert diff.count('+    @graph_visible("w_t")\n') == 2
    assert diff.count('+            register_derived(self, "scratch", static=True)\n') == 1
    assert diff.count("+from graphsafe import graph_visible, register_derived\n") == 1
    result.stdout.fnmatch_lines(["graphsafe fix diff: 3 fix(es), 1 file(s) to change, written to *fix.diff"])

    # The same patch as graphsafe fix on a TARGET of the same model.
    cli = graphsafe_cli(pytester.path, "fix", "target:target")
    assert cli.returncode == 1, cli.stderr
    assert cli.stdout == diff

    applied = subprocess.run(["patch", "-p1", "-i", "out/fix.diff"], cwd=pytester.path, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    again = inner(pytester, "--graphsafe-fix-diff=out/fix.diff", "test_suite.py")
    again.assert_outcomes(passed=3)
    assert (pytester.path / "out" / "fix.diff").read_text(encoding="utf-8") == ""
    again.stdout.fnmatch_lines(["graphsafe fix diff: 0 fix(es), 0 file(s) to change, written to *fix.diff"])


def test_without_libcst_the_option_is_a_one_line_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite="def test_nothing():\n    pass\n")
    pytester.makeconftest("import sys\nsys.modules['libcst'] = None  # import libcst raises ImportError\n")
    result = inner(pytester, "--graphsafe-fix-diff=fix.diff")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    said = [line for line in result.stderr.lines if line.strip()]
    assert len(said) == 1 and "--graphsafe-fix-diff needs LibCST" in said[0], said
    assert said[0].endswith("pip install 'graphsafe[fix]'") and "passed" not in result.stdout.str()
    assert not (pytester.path / "fix.diff").exists()
