"""Helpers of the ``graphsafe fix`` tests: a scratch directory importable as a package root, the command run in
process, and the check that a diff changes only the lines a fix meant."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from graphsafe.cli import main


@dataclass
class Run:
    status: int
    out: str
    err: str


@dataclass
class Workdir:
    """A directory on ``sys.path`` (and the working directory) whose modules are imported fresh on demand."""

    path: Path
    capsys: pytest.CaptureFixture[str]

    def write(self, name: str, text: str) -> Path:
        file = self.path / f"{name}.py"
        file.write_text(text, encoding="utf-8")
        return file

    def fresh(self, name: str) -> ModuleType:
        """Import ``name`` again from its file (the modules of this directory are dropped first)."""
        self.forget()
        importlib.invalidate_caches()
        return importlib.import_module(name)

    def forget(self) -> None:
        for key, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file is not None and Path(file).parent == self.path:
                del sys.modules[key]

    def graphsafe(self, *args: str) -> Run:
        """``graphsafe ARGS`` in this process, on fresh imports of this directory's modules."""
        self.forget()
        self.capsys.readouterr()
        status = main(list(args))
        captured = self.capsys.readouterr()
        return Run(status, captured.out, captured.err)


def only_meant_lines(before: str, after: str, meant: Callable[[str], bool]) -> list[str]:
    """The lines ``after`` adds or changes (difflib), having checked that every one of them is a line the fix
    meant (``meant(line)``) and that every line it drops or changes was a graphsafe import or decorator (merged)."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    added: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for line in old[i1:i2]:
            stripped = line.strip()
            assert stripped.startswith(("@graph_visible(", "from graphsafe import")), f"changed: {line!r}"
        for line in new[j1:j2]:
            assert meant(line.strip()), f"a line no fix meant: {line!r}"
            added.append(line.strip())
    return added
