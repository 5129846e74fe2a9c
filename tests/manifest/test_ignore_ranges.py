"""``record_capture(ignore=[...])`` drops the ignored tensors' own bytes, not the whole storage they lie in: a static
input carved out of a storage that also holds a model tensor leaves the model tensor's reads recorded (and checked
at every reload)."""

from __future__ import annotations

import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, Status
from graphsafe.collectors import record_capture


class Arena(nn.Module):
    """Reads ``table``, a plain tensor in the same storage as the static input (neither a parameter nor declared)."""

    def __init__(self, arena: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.table = arena[8:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.table.view(2, 4)


def test_an_ignored_input_sharing_a_storage_with_a_model_tensor_leaves_the_model_tensor_recorded() -> None:
    arena = torch.randn(16)
    x = arena[:8].view(2, 4)  # the static input: the first half of the storage
    layer = Arena(arena)
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        layer(x)
    (entry,) = [e for e in manifest.storages() if e.storage_ref() is arena.untyped_storage()]
    assert entry.byte_range == (32, 64)  # the table's bytes, not the input's
    assert {h.path for h in entry.holders} == {"table"}
    with contract.reload():
        layer.table = torch.randn(8)  # PWAL-style: a new tensor, the graph reads the old one
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert [(f.kind, f.path) for f in outcome.problems] == [(FindingKind.ORPHANED, "table")]


def test_an_ignored_input_alone_in_its_storage_is_not_recorded() -> None:
    layer = Arena(torch.randn(16))
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        layer(x)
    assert not [e for e in manifest.storages() if e.storage_ref() is x.untyped_storage()]
