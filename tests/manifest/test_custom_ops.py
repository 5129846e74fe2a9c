"""A ``torch.library`` custom op whose implementation reads a tensor it is not passed (a module-level table) is a
read the dispatch recorder cannot see. The manifest says so: its notes and ``truth()`` name the custom op, and
``blind_spots()`` lists it per capture, so nothing takes the recorder's record for the graph's whole truth."""

from __future__ import annotations

import torch
from torch import nn

from graphsafe import GraphContract
from graphsafe.collectors import record_capture

_TABLE = {"scale": torch.arange(4.0)}


@torch.library.custom_op("graphsafe_tests::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * _TABLE["scale"]  # read without being passed


@scaled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled(x @ self.weight)


def test_the_dispatch_recorder_names_the_custom_ops_it_cannot_see_into() -> None:
    layer = UsesTable()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, name="decode", ignore=[x], backend="dispatch") as manifest:
        layer(x)
    # The table is invisible: nothing recorded it.
    assert not [e for e in manifest.storages() if e.storage_ref() is _TABLE["scale"].untyped_storage()]
    assert manifest.blind_spots() == {"decode": ("graphsafe_tests.scaled",)}
    why = manifest.truth()
    assert why is not None and "graphsafe_tests.scaled" in why and "only through the tensors passed" in why
    assert any("graphsafe_tests.scaled" in note for note in manifest.notes)


def test_a_capture_of_aten_ops_only_has_no_blind_spot() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, name="plain", ignore=[x], backend="dispatch") as manifest:
        layer(x)
    assert manifest.blind_spots() == {}
    assert not any("custom op" in note for note in manifest.notes)


def test_a_recapture_without_the_custom_op_clears_its_blind_spot() -> None:
    layer = UsesTable()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, name="decode", ignore=[x], backend="dispatch") as manifest:
        layer(x)
    with record_capture(contract, name="decode", ignore=[x], backend="dispatch"):
        x @ layer.weight
    assert manifest.blind_spots() == {}


class BranchesOnAClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.table = torch.arange(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ``torch.cond``'s functions read ``self.table`` without being passed it
        return torch.cond(x.sum() > 0, lambda a: a * self.table, lambda a: a - self.table, (x @ self.weight,))


def test_a_higher_order_op_is_recorded_through_what_it_is_passed_and_named_as_a_blind_spot() -> None:
    """``torch.cond`` runs under the recorder (it does not raise into the capture); what its functions read without
    being passed is invisible, so the capture names it as a blind spot like a custom op."""
    layer = BranchesOnAClosure()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, name="decode", ignore=[x], backend="dispatch") as manifest:
        out = layer(x)
    product = x @ layer.weight
    assert torch.equal(out, product * layer.table if x.sum() > 0 else product - layer.table)
    (blind,) = manifest.blind_spots()["decode"]
    assert blind.startswith("cond")
    why = manifest.truth()
    assert why is not None and "higher-order" in why
