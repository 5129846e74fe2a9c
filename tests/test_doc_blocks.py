"""Every Python code block of README.md and docs/*.md runs as written.

A file's blocks run in order in one namespace, as a reader pastes them. Fence info says otherwise:

* ```` ```python ranks=2 ````: needs a process group; it runs on two spawned ranks joined in a gloo group (as
  ``torchrun`` sets one up before the reader's code runs), each in its own namespace.
* ```` ```python check ````: needs a GPU or vLLM, or is code of the reader's own package; it is compiled, its
  imports run, and every call of what they bring in is bound against the real signature (``tests/_doc_calls.py``),
  so a renamed keyword or a removed method fails here. Strings that name graphsafe objects (a dotted path, a worker
  extension method passed to ``collective_rpc``) must resolve.
* ```` ```python file=NAME.py ````: the contents of a file of that name; it is executed as module ``NAME`` (a later
  block with the same name edits the same module, as a reader edits the file) and written as ``NAME.py`` to the
  document's working directory (a fresh temporary one, on ``sys.path``). A ``test_*.py`` file's test functions
  run after the last block of the document, from a fresh import (as pytest would), so a guide that shows a
  failing test, then the fix, passes.
* ```` ```console run ````: a terminal session in that directory. Each ``$ graphsafe ARGS`` line runs the
  command (in process, after the blocks above it, the written files imported afresh from disk; ``> /dev/null``
  drops its stdout), and what it prints, stdout then stderr, must be the lines under it (trailing spaces aside);
  ``$ echo $?`` prints the exit status of the command before it. Other ``console`` blocks are not run.
"""

from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from _doc_calls import check_calls
from _ranks import run_on_ranks
from graphsafe.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", flags=re.M | re.S)
#: Every block a document's run steps through, in order: Python blocks and the terminal sessions it runs.
_STEP = re.compile(r"^```(python|console run)([^\n]*)\n(.*?)^```", flags=re.M | re.S)
INFOS = re.compile(r"|check|ranks=2|file=\w+\.py")


def _blocks(document: Path) -> list[tuple[str, str, int]]:
    """``(fence info, code, line)`` of every Python block."""
    text = document.read_text()
    return [(m[1].strip(), m[2], text.count("\n", 0, m.start()) + 2) for m in _BLOCK.finditer(text)]


def _steps(document: Path) -> list[tuple[str, str, int]]:
    """``(fence info, code, line)`` of every Python block and every ``console run`` block (info ``console``)."""
    text = document.read_text()
    return [
        ("console" if m[1] == "console run" else m[2].strip(), m[3], text.count("\n", 0, m.start()) + 2)
        for m in _STEP.finditer(text)
    ]


def _runnable() -> list[Path]:
    return [d for d in DOCUMENTS if any(info not in ("check", "ranks=2") for info, _, _ in _blocks(d))]


def _session(code: str, where: str, forget: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Run a ``console run`` block's ``$ graphsafe`` and ``$ echo $?`` lines; check what each prints."""
    commands: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            assert commands, f"{where}: output before the first $ command"
            commands[-1][1].append(line.rstrip())
    status: int | None = None
    for command, shown in commands:
        words = shlex.split(command, comments=True)
        if words == ["echo", "$?"]:
            assert status is not None, f"{where}: echo $? before any command"
            printed = f"{status}\n"
        else:
            assert words[0] == "graphsafe", f"{where}: only graphsafe commands run here: {command!r}"
            quiet = words[-1:] == [">/dev/null"] or words[-2:] == [">", "/dev/null"]
            args = words[1 : len(words) - (0 if not quiet else 1 if words[-1] == ">/dev/null" else 2)]
            for name in forget:  # as a new process would: the files as they are on disk now
                sys.modules.pop(name, None)
            capsys.readouterr()
            status = main(args)
            out, err = capsys.readouterr()
            printed = ("" if quiet else out) + err
        got = [line.rstrip() for line in printed.splitlines()]
        assert got == shown, f"{where}: $ {command}\nprinted:\n" + "\n".join(got)
    for name in forget:  # what the blocks below import, they import from the files as the session left them
        sys.modules.pop(name, None)


def _of_kind(kind: str) -> list[tuple[Path, str, int]]:
    return [(d, code, line) for d in DOCUMENTS for info, code, line in _blocks(d) if info == kind]


def test_the_documents_have_python_blocks_and_every_one_runs_or_is_checked() -> None:
    blocks = [block for document in DOCUMENTS for block in _blocks(document)]
    assert len(blocks) >= 10
    unknown = {f"{info!r}" for info, _, _ in blocks if not INFOS.fullmatch(info)}
    assert not unknown, f"fence infos this test does not know (so would not run or check): {unknown}"
    assert ROOT / "README.md" in _runnable()
    assert _of_kind("ranks=2"), "docs/distributed.md's example runs on two ranks"


@pytest.mark.parametrize("document", _runnable(), ids=lambda path: path.name)
def test_every_python_block_runs_as_written(
    document: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    monkeypatch.syspath_prepend(str(tmp_path))  # the file= blocks are importable from their files
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a file a command rewrote is read again from source
    try:
        _run_document(document, tmp_path, monkeypatch, capsys)
    finally:
        for name, module in list(sys.modules.items()):  # the modules imported from this document's files
            file = getattr(module, "__file__", None)
            if file is not None and Path(file).parent == tmp_path:
                del sys.modules[name]
    capsys.readouterr()  # what the blocks print is for the reader


def _run_document(
    document: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, Any] = {"__name__": f"doc_{document.stem}"}
    modules: dict[str, types.ModuleType] = {}
    files: dict[str, str] = {}
    test_files: dict[str, list[tuple[str, str]]] = {}
    for info, code, line in _steps(document):
        if info in ("check", "ranks=2"):
            continue
        where = f"{document.name}:{line}"
        if info == "console":
            _session(code, where, list(files), capsys)
            continue
        if info.startswith("file="):
            name = info.removeprefix("file=").removesuffix(".py")
            if name.startswith("test_"):
                test_files.setdefault(name, []).append((code, where))
            files[name] = files.get(name, "") + code
            path = tmp_path / f"{name}.py"
            path.write_text(files[name])
            module = modules.get(name)
            if module is None:
                module = modules[name] = types.ModuleType(name)
                module.__file__ = str(path)
                monkeypatch.setitem(sys.modules, name, module)
            target = module.__dict__
        else:
            target = namespace
        exec(compile(code, where, "exec"), target)
    # pytest imports each test file afresh when it runs, after every edit of the files it imports.
    for name, sources in test_files.items():
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        for code, where in sources:
            exec(compile(code, where, "exec"), module.__dict__)
        tests = [value for key, value in vars(module).items() if key.startswith("test_") and callable(value)]
        assert tests, f"{document.name}: {name}.py defines no test"
        for test in tests:
            test()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "document, code, line", _of_kind("ranks=2"), ids=lambda v: f"{v.name}" if isinstance(v, Path) else ""
)
def test_every_process_group_block_runs_on_two_gloo_ranks(document: Path, code: str, line: int, tmp_path: Path) -> None:
    run_on_ranks(code, f"{document.name}:{line}", str(tmp_path))


_GRAPHSAFE_PATH = re.compile(r"graphsafe(\.\w+)+")


def _strings_resolve(code: str) -> list[str]:
    """Dotted graphsafe paths in string constants import; ``collective_rpc("graphsafe_x")`` names a method of the
    worker extension."""
    import ast
    import importlib

    from graphsafe.adapters.vllm import GraphsafeWorkerExtension

    problems: list[str] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _GRAPHSAFE_PATH.fullmatch(node.value):
            module, _, name = node.value.rpartition(".")
            try:
                getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                problems.append(f"line {node.lineno}: {node.value!r} does not resolve ({exc})")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "collective_rpc"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("graphsafe_")
            and not callable(getattr(GraphsafeWorkerExtension, str(node.args[0].value), None))
        ):
            problems.append(f"line {node.lineno}: GraphsafeWorkerExtension has no method {node.args[0].value!r}")
    return problems


@pytest.mark.parametrize(
    "document, code, line", _of_kind("check"), ids=lambda v: f"{v.name}" if isinstance(v, Path) else ""
)
def test_every_block_that_cannot_run_here_binds_against_the_real_signatures(
    document: Path, code: str, line: int
) -> None:
    where = f"{document.name}:{line}"
    report = check_calls(code, where)
    problems = report.failures + _strings_resolve(code)
    assert not problems, f"{where}:\n" + "\n".join(problems)
    assert report.bound or report.unavailable, f"{where}: binds no call of graphsafe's"
