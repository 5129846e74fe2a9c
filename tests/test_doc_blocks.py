"""Every Python code block of README.md and docs/*.md runs as written (issue 17).

A file's blocks run in order in one namespace, as a reader pastes them. Fence info says otherwise:

* ```` ```python no-run ````: not run (it needs CUDA, vLLM, a process group, or code of your own package); the
  prose around it says so. Used sparingly: :data:`NO_RUN_AT_MOST` caps them.
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

from graphsafe.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", flags=re.M | re.S)
#: Every block a document's run steps through, in order: Python blocks and the terminal sessions it runs.
_STEP = re.compile(r"^```(python|console run)([^\n]*)\n(.*?)^```", flags=re.M | re.S)
#: How many blocks may be left unrun, in all documents.
NO_RUN_AT_MOST = 5


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
    return [d for d in DOCUMENTS if any(info != "no-run" for info, _, _ in _blocks(d))]


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


def test_the_documents_have_python_blocks_and_few_are_left_unrun() -> None:
    blocks = [block for document in DOCUMENTS for block in _blocks(document)]
    assert len(blocks) >= 10
    infos = {info for info, _, _ in blocks}
    assert infos <= {"", "no-run"} | {i for i in infos if re.fullmatch(r"file=\w+\.py", i)}, infos
    assert sum(info == "no-run" for info, _, _ in blocks) <= NO_RUN_AT_MOST
    assert ROOT / "README.md" in _runnable()


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
        if info == "no-run":
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
