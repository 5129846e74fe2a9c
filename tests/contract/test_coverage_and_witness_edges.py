"""Edges of the partial-write count (``collectors/_dataflow.py``: writes through ``out=`` into a slice, through a
view of another dtype, through indices the dispatcher passes with ``None`` or an int32 index, row by row into one
head of a fused buffer) and of the byte witnesses (``contract/_witness.py``, ``contract/_departures.py``: a holder
that negates the old tensor, which flips sign bits in pairs a plain or odd-weighted wrapping sum cancels). Each
reload loads different weights; the oracle is computed here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from contract.test_departure_witness import _capture, _reload
from contract.test_derived_witness import _holder_reload
from contract.test_partial_refresh import recorded_reload
from graphsafe import Status, register_derived

R, C = 64, 128
_IDX = torch.arange(R // 2)


class _Slot(nn.Module):
    def __init__(self, column_view: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(R, C), requires_grad=False)
        if column_view:  # a slot that is one head of a fused buffer (non-contiguous)
            self.buf = torch.cat([self.w.detach() * 2, self.w.detach() * 3], 1)
            self.s = self.buf[:, :C]
        else:
            self.s = self.w.detach() * 2
        register_derived(self, "s", self.s, derived_from="w")


def _run(write, column_view: bool = False):
    return recorded_reload(_Slot(column_view), write)


@pytest.mark.parametrize(
    "write",
    [
        lambda layer, v: torch.index_select(v, 0, _IDX, out=layer.s[: R // 2]),
        lambda layer, v: torch.gather(v[: R // 2], 0, torch.zeros(R // 2, C, dtype=torch.long), out=layer.s[: R // 2]),
        lambda layer, v: layer.s.view(torch.int16)[:, ::2].copy_(v.view(torch.int16)[:, ::2]),  # low half of each word
        lambda layer, v: (layer.s[: R // 2].copy_(v[: R // 2]), layer.s.view(torch.uint8)[0, ::2].fill_(0)),
    ],
    ids=["index_select-out-slice", "gather-out-slice", "int16-view-strided", "half-then-byte-view-strided"],
)
def test_a_partial_write_through_out_or_another_dtype_is_not_committed(write) -> None:
    outcome, captured, expected, error = _run(write)
    assert error is None, repr(error)
    if outcome.status is Status.COMMITTED:
        left = int((captured != expected).sum())
        assert left == 0, f"COMMITTED, but {left} of {R * C} captured elements hold old values"


@pytest.mark.parametrize(
    "write",
    [
        lambda layer, v: layer.s.__setitem__((slice(None), torch.arange(C)), v),  # index_put_ with a None index
        lambda layer, v: layer.s.__setitem__((Ellipsis, torch.arange(C)), v),
        lambda layer, v: (layer.s.copy_(v), layer.s.index_add_(0, _IDX.int(), torch.zeros(R // 2, C))),  # int32 index
        lambda layer, v: (layer.s.copy_(v), layer.s.index_reduce_(0, _IDX.int(), v[: R // 2], "amax")),
    ],
    ids=["s[:, idx]=v", "s[..., idx]=v", "index_add_-int32", "index_reduce_-int32"],
)
def test_whole_refresh_through_legal_indexing_does_not_crash(write) -> None:
    outcome, captured, expected, error = _run(write)
    assert error is None, f"graphsafe broke the user's PWAL: {error!r}"
    assert outcome.status is Status.COMMITTED and torch.equal(captured, expected)


def test_row_by_row_refresh_of_a_column_view_slot_is_committed() -> None:
    outcome, captured, expected, error = _run(
        lambda layer, v: [layer.s[i].copy_(v[i]) for i in range(R)], column_view=True
    )
    assert error is None
    assert torch.equal(captured, expected)  # every element was written
    assert outcome.status is Status.COMMITTED, [f.detail for f in outcome.findings]


def test_derived_slot_holder_negating_the_old_tensor_is_never_written() -> None:
    outcome, held, expected = _holder_reload(lambda w: w * 2, lambda t: t.data.neg_())
    assert torch.equal(held, expected), "graphsafe wrote the slot's new values over the holder's negated ones"
    assert not outcome.committed


def test_departed_parameter_negated_by_its_holder_is_never_written() -> None:
    spares = {}
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.ones(32, 1024), requires_grad=False)
    spares["spare"] = nn.Parameter(torch.zeros(32, 1024), requires_grad=False)
    contract = _capture(layer, lambda: layer.weight.sum())
    captured = layer.weight
    loaded = torch.arange(32 * 1024, dtype=torch.float32).view(32, 1024) + 1

    def pwal() -> None:
        old = layer.weight
        layer.weight = spares["spare"]
        spares["spare"] = old
        layer.weight.copy_(old * 2)
        old.data.neg_()  # the holder's own values

    with torch.no_grad():
        _reload(contract, layer, lambda: layer.weight.copy_(loaded), pwal)
    assert spares["spare"] is captured
    assert torch.equal(captured, -loaded), f"graphsafe wrote {captured[0, :3].tolist()} over the holder's values"
    assert not contract.last_outcome.committed
