"""Every Python code block of README.md and docs/*.md runs as written.

A file's blocks run in order in one namespace, as a reader pastes them. Fence info says otherwise:

* ```` ```python no-run ````: not run (it needs CUDA, vLLM, a process group, or code of your own package); the
  prose around it says so. Used sparingly: :data:`NO_RUN_AT_MOST` caps them.
* ```` ```python file=NAME.py ````: the contents of a file of that name; it is executed as module ``NAME`` (a later
  block with the same name edits the same module, as a reader edits the file). A ``test_*.py`` file's test
  functions run after the last block of the document, from a fresh import (as pytest would), so a guide that
  shows a failing test, then the fix, passes.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", flags=re.M | re.S)
#: How many blocks may be left unrun, in all documents.
NO_RUN_AT_MOST = 5


def _blocks(document: Path) -> list[tuple[str, str, int]]:
    """``(fence info, code, line)`` of every Python block."""
    text = document.read_text()
    return [(m[1].strip(), m[2], text.count("\n", 0, m.start()) + 2) for m in _BLOCK.finditer(text)]


def _runnable() -> list[Path]:
    return [d for d in DOCUMENTS if any(info != "no-run" for info, _, _ in _blocks(d))]


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
    namespace: dict[str, Any] = {"__name__": f"doc_{document.stem}"}
    modules: dict[str, types.ModuleType] = {}
    test_files: dict[str, list[tuple[str, str]]] = {}
    for info, code, line in _blocks(document):
        if info == "no-run":
            continue
        where = f"{document.name}:{line}"
        if info.startswith("file="):
            name = info.removeprefix("file=").removesuffix(".py")
            if name.startswith("test_"):
                test_files.setdefault(name, []).append((code, where))
            module = modules.get(name)
            if module is None:
                module = modules[name] = types.ModuleType(name)
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
    capsys.readouterr()  # what the blocks print is for the reader
