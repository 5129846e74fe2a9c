"""The repository states the product: what it does, how to reproduce each figure, and why each rule exists. It does
not narrate how it was made (work rounds, numbered issues, who measured on which lent machine): those words name
nothing a reader can use. "session" keeps its product meanings in code (a pytest session, the vLLM adapter's reload
session) but has none in the documents."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
SOURCES = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
#: How the making of the product would be narrated; the place word is split so this file does not match itself.
HISTORY = re.compile(r"\bround ?\d|\bs[56]\b|\bissue \d+|\bwork" + r"place|\bhelper-\d+", flags=re.IGNORECASE)
SESSION = re.compile(r"\bsessions?\b", flags=re.IGNORECASE)


def _hits(paths: list[Path], pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_nothing_in_the_repository_narrates_how_it_was_made() -> None:
    hits = _hits(DOCUMENTS + SOURCES, HISTORY)
    assert not hits, "\n".join(hits)


def test_the_documents_speak_of_no_sessions() -> None:
    hits = _hits(DOCUMENTS, SESSION)
    assert not hits, "\n".join(hits)
