"""Reports build in linear time: a strict violation on a layer with N walker-found drifting tensors (its error
message, the outcome's summary, the migration report and its renderings), with and without a capture manifest.

Linear is checked on the work done, counted as function calls (deterministic, not a timing) at N, 2N and 4N: the
second difference of the counts is zero for linear work and grows with N^2 otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, GraphContract, migration_report
from graphsafe.collectors import record_capture

N = 300  # 2N tensors, then 4N and 8N
BOUND = 0.03  # linear code measures under 1%; one quadratic pass over the N views measured 11%


class Cache(nn.Module):
    """2N undeclared tensors PWAL re-creates on every load: N on storages of their own, N views of one storage."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.load(0.0)

    def load(self, value: float) -> None:
        self.own = [torch.full((2,), value) for _ in range(self.n)]
        base = torch.full((self.n, 2), value)
        self.views = [base[i] for i in range(self.n)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reads every one (a tensor no capture reads would be unread drift, a record, not a problem).
        return x + torch.stack(self.own).sum(0) + torch.stack(self.views).sum(0)


def _violation_and_reports(n: int) -> None:
    model = nn.Sequential(Cache(n))
    contract = GraphContract(model, "strict", detect="sealed-paths").seal()
    with record_capture(contract, name="graph"):  # the manifest ties the shared storage to its N paths
        model(torch.zeros(2))
    with pytest.raises(ContractViolation) as info, contract.reload():
        model[0].load(1.0)  # different values, new tensors: every one of them moved
    outcome = contract.last_outcome
    assert outcome is not None and len(outcome.problems) >= 2 * n
    assert "own[0]" in str(info.value)
    assert f"{len(outcome.problems)} problem(s)" in outcome.summary()
    report = migration_report(contract)
    assert len(report.entries) == 2 * n
    for fmt in ("text", "markdown", "json", "tree", "dot"):
        assert report.render(fmt)
    assert len(migration_report(outcome, model=model).entries) == 2 * n


def _calls(work: Callable[[], None]) -> int:
    """Python and C function calls made by ``work``: a count, not a time, so the test does not depend on load."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return count


def test_a_strict_violation_and_its_reports_build_in_linear_work() -> None:
    _violation_and_reports(50)  # warm caches and lazy imports
    one, two, four = (_calls(lambda n=n: _violation_and_reports(n)) for n in (N, 2 * N, 4 * N))
    # Work a + b*N + c*N^2: the second difference isolates the quadratic term (6*c*N^2); linear work leaves ~0.
    quadratic = (four - two) - 2 * (two - one)
    share = quadratic / (four - one)
    assert share < BOUND, f"calls at N, 2N, 4N: {one}, {two}, {four}; {share:.1%} of the growth is superlinear"
