"""What ``graphsafe fix`` refuses, in one line, exit status 2 and no file written: installed code, a file it
cannot write (the other files are not written either), no LibCST, a TARGET it cannot use, a disk error while
writing (the files written before it are put back); and code it does not understand, which it leaves alone and
lists with the report's text."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from fix.workdir import Run, Workdir

LEGACY = """import torch
from torch import nn


class {name}(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)

    def process_weights_after_loading(self):
        self.w_t = self.weight.t().contiguous()  # a new tensor on every load

    def forward(self, x):
        return x @ self.w_t
"""

TARGET = """
import torch
from torch import nn

{imports}


def load(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
        for layer in model:
            layer.process_weights_after_loading()


def target():
    model = nn.Sequential({layers})
    load(model, 0)
    return model, load, lambda model: model(torch.randn(4, 8))
"""


def one_line_error(run: Run) -> str:
    assert run.status == 2, (run.status, run.err)
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphsafe: error: fix: "), run.err
    assert run.out == ""
    return lines[0]


def test_installed_code_is_refused(workdir: Workdir) -> None:
    installed = workdir.path / "venv" / "lib" / "python3" / "site-packages"
    installed.mkdir(parents=True)
    kernel = installed / "vendored_kernel.py"
    kernel.write_text(LEGACY.format(name="Vendored"), encoding="utf-8")
    sys.path.insert(0, str(installed))
    try:
        workdir.write("target", TARGET.format(imports="import vendored_kernel", layers="vendored_kernel.Vendored()"))
        for args in (("fix", "target:target"), ("fix", "--write", "target:target")):
            line = one_line_error(workdir.graphsafe(*args))
            assert "vendored_kernel.Vendored is installed code" in line and str(kernel) in line
    finally:
        sys.path.remove(str(installed))
        sys.modules.pop("vendored_kernel", None)
    assert kernel.read_text(encoding="utf-8") == LEGACY.format(name="Vendored")


def test_a_read_only_file_stops_every_write(workdir: Workdir) -> None:
    first = workdir.write("kernel_a", LEGACY.format(name="A"))
    second = workdir.write("kernel_b", LEGACY.format(name="B"))
    workdir.write(
        "target", TARGET.format(imports="import kernel_a\nimport kernel_b", layers="kernel_a.A(), kernel_b.B()")
    )
    os.chmod(second, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        shown = workdir.graphsafe("fix", "target:target")  # the diff needs no write
        assert shown.status == 1 and "+++ b/kernel_a.py" in shown.out and "+++ b/kernel_b.py" in shown.out
        line = one_line_error(workdir.graphsafe("fix", "--write", "target:target"))
        assert f"{second} is not writable" in line and "nothing written" in line
    finally:
        os.chmod(second, stat.S_IRUSR | stat.S_IWUSR)
    assert first.read_text(encoding="utf-8") == LEGACY.format(name="A")  # written first, had it not been checked
    assert second.read_text(encoding="utf-8") == LEGACY.format(name="B")


def test_without_libcst_one_line_names_the_extra(workdir: Workdir, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = workdir.write("kernel_a", LEGACY.format(name="A"))
    workdir.write("target", TARGET.format(imports="import kernel_a", layers="kernel_a.A()"))
    monkeypatch.setitem(sys.modules, "libcst", None)  # import libcst raises ImportError
    monkeypatch.delitem(sys.modules, "graphsafe.fix._edit", raising=False)
    line = one_line_error(workdir.graphsafe("fix", "--write", "target:target"))
    assert "pip install 'graphsafe[fix]'" in line
    assert kernel.read_text(encoding="utf-8") == LEGACY.format(name="A")


ONE_LINE_BLOCK = """import torch
from torch import nn


class Scratchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)
        self.scratch = None

    def process_weights_after_loading(self):
        self.w_t = self.weight.t().contiguous()

    def forward(self, x):
        if self.scratch is None: self.scratch = torch.empty(4, 8)  # noqa: E701
        torch.matmul(x, self.w_t, out=self.scratch)
        return self.scratch.clone()
"""


def test_code_it_does_not_understand_is_listed_not_guessed(workdir: Workdir) -> None:
    kernel = workdir.write("scratchy", ONE_LINE_BLOCK)
    workdir.write("target", TARGET.format(imports="import scratchy", layers="scratchy.Scratchy()"))
    run = workdir.graphsafe("fix", "--write", "target:target")
    assert run.status == 1, run.err
    after = kernel.read_text(encoding="utf-8")
    # The decorator is placed; the scratch's declaration is not (its assignment shares the if's line).
    assert '    @graph_visible("w_t")\n    def process_weights_after_loading(self):' in after
    assert "register_derived" not in after
    unchanged = after.replace("from graphsafe import graph_visible\n", "").replace('    @graph_visible("w_t")\n', "")
    assert unchanged == ONE_LINE_BLOCK
    assert "1 item(s) left to place by hand" in run.err
    assert "register_derived in " in run.err and "scratch is assigned in a one-line block" in run.err
    assert 'register_derived(self, "scratch", static=True)' in run.err  # the report's own line
    again = workdir.graphsafe("fix", "target:target")
    assert again.status == 1 and again.out == "" and "left to place by hand" in again.err


def test_usage_errors_exit_2_and_write_nothing(workdir: Workdir) -> None:
    kernel = workdir.write("kernel_a", LEGACY.format(name="A"))
    bad = workdir.graphsafe("fix", "--write", "no_such_module:target")
    assert (bad.status, bad.out) == (2, "") and len(bad.err.strip().splitlines()) == 1, bad.err
    assert "cannot import module 'no_such_module'" in bad.err
    missing = workdir.graphsafe("fix", "--write")  # TARGET is required: fix edits your code, not the zoo's
    assert missing.status == 2 and "TARGET" in missing.err and missing.out == ""
    assert kernel.read_text(encoding="utf-8") == LEGACY.format(name="A")


def test_a_write_that_fails_midway_puts_back_the_files_written_before(
    workdir: Workdir, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = workdir.write("kernel_a", LEGACY.format(name="A"))
    second = workdir.write("kernel_b", LEGACY.format(name="B"))
    workdir.write(
        "target", TARGET.format(imports="import kernel_a\nimport kernel_b", layers="kernel_a.A(), kernel_b.B()")
    )
    synced: list[int] = []

    def fsync(fd: int) -> None:  # the disk fails on the second file, after the first was written
        synced.append(fd)
        if len(synced) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    line = one_line_error(workdir.graphsafe("fix", "--write", "target:target"))
    assert f"writing {second} failed (No space left on device)" in line and "nothing written" in line
    assert first.read_text(encoding="utf-8") == LEGACY.format(name="A")
    assert second.read_text(encoding="utf-8") == LEGACY.format(name="B")
