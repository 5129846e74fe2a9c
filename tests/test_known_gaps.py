"""Known gaps, each a strict xfail with its reproducer: the day a change closes one, its test turns green and the
xfail must go (``strict=True`` fails an unexpected pass).

Found by the unread-skip differential fuzzer (``tests/fuzz/test_fuzz_skip.py``), whose fake kernel scan lets a graph
read only part of what the forward reads; identical under ``unread="restore"``, so a gap of the restore path itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, graph_visible, record_capture


class PingPong(nn.Module):
    """PWAL swaps the declared ``cur`` with an undeclared ``other`` (a ping-pong buffer), then writes each in place."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.other = torch.zeros(4)  # undeclared; no captured graph reads it

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "cur"):
            self.cur = self.weight * 2
            return
        self.cur, self.other = self.other, self.cur
        self.other.copy_(self.weight * 3)
        self.cur.copy_(self.weight * 2)


@pytest.mark.xfail(
    strict=True,
    reason="declared-only: the restore copies cur's new values into its captured storage, which PWAL handed to the "
    "undeclared 'other' (no manifest path lists it: no graph reads it), and commits; 'other' then holds cur's values "
    "(reproduced on fba0957)",
)
def test_declared_only_never_writes_into_an_untracked_tensor_pwal_gave_a_captured_storage() -> None:
    model = PingPong()
    model.process_weights_after_loading()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    with torch.no_grad(), record_capture(contract):
        model.cur.sum()  # the graph reads cur only
    with contract.reload(), torch.no_grad():
        model.weight.copy_(torch.full((4,), 5.0))
        model.process_weights_after_loading()
    # Whatever the outcome, graphsafe must not write values the reload did not produce (a recapture would read them).
    assert torch.equal(model.other, model.weight * 3), (
        f"graphsafe wrote cur's values into 'other' ({contract.last_outcome})"
    )
