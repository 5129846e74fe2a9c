"""The byte witness of a captured derived tensor (``contract/_witness.py``): a PWAL that gives the slot a new
tensor and hands the old one to a holder outside the model (a dict key) that writes it, through ``.data`` or under
inference mode, by a permutation within a digest row, as a conjugate view or a wrapper subclass's inner tensor, is
refused (``alias-broken``): graphsafe must not copy the slot's new values over the holder's. Every reload loads
different weights; the oracle is computed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from fuzz.classes import Wrapper
from graphsafe import GraphContract, graph_visible, record_capture
from graphsafe.errors import ContractViolation

N = 8192

# ---------------------------------------------------------------------------------------------------------------
# (A) a derived slot's old captured tensor handed to a holder outside the model (a dict key) that writes it
#     without moving a version counter (.data): graphsafe must not copy the slot's new values over the holder's.
# ---------------------------------------------------------------------------------------------------------------


class _Holder(nn.Module):
    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor], write: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(1)), requires_grad=False)
        self.make, self.write = make, write
        self.table: dict[torch.Tensor, str] = {}  # a dict key: no walk reaches it

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "cur"):
            self.cur = self.make(self.weight)
            self.table = {self.make(self.weight * 0): "spare"}
            return
        (other,) = self.table
        old, self.cur = self.cur, other
        self.table = {old: "spare"}
        self.write(old)  # the holder writes the old captured tensor
        self.cur.copy_(self.make(self.weight))


def _holder_reload(make, write, mode: str = "recapture", detect: str = "declared-only"):
    layer = _Holder(make, write)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    with torch.no_grad(), record_capture(contract):
        layer.cur.sum()
    captured = layer.cur
    with torch.no_grad():
        expected = captured.clone()
        write(expected)  # what the holder's write leaves there (oracle)
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        layer.weight.copy_(torch.randn(N, generator=torch.Generator().manual_seed(9)))
        layer.process_weights_after_loading()
    (held,) = layer.table
    assert held is captured
    return contract.last_outcome, held, expected


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.inner if isinstance(t, Wrapper) else t
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _swap_first_two(t: torch.Tensor) -> None:
    """The holder reorders two entries (a permutation within one digest row) through .data."""
    d = t.data.view(-1)
    first = d[0].clone()
    d[0] = d[1]
    d[1] = first


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_holder_that_permutes_entries_within_a_digest_row_is_never_written(mode: str) -> None:
    outcome, held, expected = _holder_reload(lambda w: w * 2, _swap_first_two, mode)
    assert torch.equal(held, expected), "graphsafe overwrote the holder's bytes with the slot's new values"
    assert outcome is not None and not outcome.committed


def test_a_holder_that_permutes_entries_is_never_written_under_every_reload() -> None:
    """Same root cause; here the reload is refused (untrackable) but the holder is still overwritten."""
    outcome, held, expected = _holder_reload(lambda w: w * 2, _swap_first_two, detect="every-reload")
    assert torch.equal(held, expected), f"graphsafe overwrote the holder ({outcome.status.name})"


def test_a_conjugate_view_slot_written_sparsely_by_its_holder_is_never_written() -> None:
    def sparse(t: torch.Tensor) -> None:
        t.data[1::2] = 7.0 + 0j  # between the value sample's elements

    outcome, held, expected = _holder_reload(lambda w: torch.complex(w, w * 0.5).conj(), sparse)
    assert torch.equal(_plain(held), _plain(expected)), "graphsafe overwrote the holder's bytes"
    assert outcome is not None and not outcome.committed


def test_a_wrapper_subclass_slot_written_by_its_holder_is_never_written() -> None:
    def write(t: torch.Tensor) -> None:
        t.inner.data[1::2] = 7.0

    outcome, held, expected = _holder_reload(lambda w: Wrapper(w * 2), write)
    assert torch.equal(_plain(held), _plain(expected)), "graphsafe overwrote the holder's bytes"
    assert outcome is not None and not outcome.committed


# ---------------------------------------------------------------------------------------------------------------
