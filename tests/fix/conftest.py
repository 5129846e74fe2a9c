"""The ``workdir`` fixture of the ``graphsafe fix`` tests (see ``workdir.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fix.workdir import Workdir


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Workdir]:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a rewritten module is always read from its source
    work = Workdir(tmp_path, capsys)
    yield work
    work.forget()
