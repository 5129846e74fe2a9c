"""With graph truth that proves a tensor unread, its drift is reported, not fatal.

A PWAL that re-creates an undeclared tensor the forward never reads (a debug copy of the weights) moves it; no
captured graph reads its memory, so the move changes no replay. When what the graphs read is known (the kernel
scan, complete; or the dispatch recorder on CPU, where every kernel goes through the dispatcher and no custom op
ran) the finding is an ``unread-drift`` record and the reload commits in every mode. Without that proof (no
capture, a custom op seen), or for a tensor a graph reads, it stays a problem.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadOutcome, Status
from graphsafe.collectors import record_capture


class WithDebugCopy(nn.Module):
    def __init__(self, read_debug: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.read_debug = read_debug
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        self.debug = self.weight.detach().clone()  # a new tensor every time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.debug if self.read_debug else self.weight)


def reload(contract: GraphContract, model: WithDebugCopy) -> ReloadOutcome:
    try:
        with contract.reload(), torch.no_grad():
            model.weight.copy_(torch.randn(4, 4))
            model.process_weights_after_loading()
    except Exception:
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_debug_copy_no_graph_reads_is_reported_not_fatal_with_the_dispatch_recorder(mode: str) -> None:
    model = WithDebugCopy()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    x = torch.randn(2, 4)
    with record_capture(contract, name="g", ignore=[x]):
        model(x)
    for _ in range(2):
        outcome = reload(contract, model)
        assert outcome.status is Status.COMMITTED, outcome.summary()
        # migrate restores what it can, an unread tensor too (a harmless copy); the others report it
        expected = FindingKind.AUTO_RESTORED if mode == "migrate" else FindingKind.UNREAD_DRIFT
        assert [(f.path, f.kind) for f in outcome.findings] == [("debug", expected)]
        assert mode == "migrate" or "no captured graph reads" in outcome.findings[0].detail


def test_a_debug_copy_the_graph_reads_stays_fatal() -> None:
    model = WithDebugCopy(read_debug=True)
    contract = GraphContract(model, "strict").seal()
    x = torch.randn(2, 4)
    with record_capture(contract, name="g", ignore=[x]):
        model(x)
    outcome = reload(contract, model)
    assert outcome.status is Status.FAILED
    assert FindingKind.UNREAD_DRIFT not in {f.kind for f in outcome.findings}


def test_without_a_capture_nothing_is_proven_unread() -> None:
    model = WithDebugCopy()
    contract = GraphContract(model, "recapture").seal()
    outcome = reload(contract, model)
    assert outcome.status is Status.NEEDS_RECAPTURE
    assert [(f.path, f.kind) for f in outcome.problems] == [("debug", FindingKind.MOVED)]


def _custom_op() -> Any:
    lib = torch.library.Library("graphsafe_test_unread", "FRAGMENT")
    lib.define("scale(Tensor x) -> Tensor")
    lib.impl("scale", lambda x: x * 2, "CompositeExplicitAutograd")
    return lib, torch.ops.graphsafe_test_unread.scale


def test_a_capture_that_ran_a_custom_op_proves_nothing_unread() -> None:
    lib, scale = _custom_op()  # keep the library alive
    model = WithDebugCopy()
    contract = GraphContract(model, "recapture").seal()
    x = torch.randn(2, 4)
    with record_capture(contract, name="g", ignore=[x]):
        scale(model(x))  # may read memory it is not passed: the recorder cannot see it
    outcome = reload(contract, model)
    assert outcome.status is Status.NEEDS_RECAPTURE
    assert [(f.path, f.kind) for f in outcome.problems] == [("debug", FindingKind.MOVED)]
    del lib


def test_a_capture_that_recorded_no_op_proves_nothing_unread() -> None:
    model = WithDebugCopy()
    contract = GraphContract(model, "recapture").seal()
    with record_capture(contract, name="g"):
        pass  # no forward: nothing says what a graph reads
    outcome = reload(contract, model)
    assert outcome.status is Status.NEEDS_RECAPTURE
    assert [(f.path, f.kind) for f in outcome.problems] == [("debug", FindingKind.MOVED)]
