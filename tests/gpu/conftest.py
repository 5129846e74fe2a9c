"""GPU tests: skipped where CUDA is absent; a summary of exact vs tolerance comparisons at the end of the run."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

_RECORDS = pytest.StashKey[list[str]]()


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(autouse=True)
def _without_earlier_garbage() -> None:
    # Each test starts without the cyclic garbage of the tests before it: an earlier pointer a kernel launch leaves in
    # an opaque parameter (docs/design.md, "The kernel scan") may otherwise land in one of their tensors.
    gc.collect()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def gpu_notes(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Lines to print in the terminal summary (comparisons that needed the reduction tolerance, and the like)."""
    records = request.config.stash.setdefault(_RECORDS, [])
    yield records


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    records = config.stash.get(_RECORDS, [])
    if records:
        terminalreporter.section("graphsafe GPU notes")
        for line in records:
            terminalreporter.write_line(line)
