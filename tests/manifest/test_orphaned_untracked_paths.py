"""A captured storage the model no longer holds at an untracked path is ``orphaned`` by the manifest's check, and the
reload must not commit while the graph reads it.

Under ``declared-only`` the path is also watched as a watch-only slot; when that slot's own finding is ``stale``
for the new tensor at the path (PWAL left it unwritten) and graph truth excuses it as ``unread-drift`` (no graph
reads the new tensor), the manifest's ``orphaned`` for the storage the graph does read there must still be
reported: the transaction reports each (layer, path) once only where the contract's own finding stays a problem.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadOutcome, Status
from graphsafe.collectors import Manifest, record_capture

N = 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N, N), requires_grad=False)
        self.table = self.weight.detach().sum(0)  # undeclared: a declared-only seal does not track it

    def pwal(self, write: bool) -> None:
        if write:
            self.table.copy_(self.weight.detach().sum(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.table


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer()])


def _reload(contract: GraphContract, layer: Layer, write: bool) -> ReloadOutcome:
    try:
        with contract.reload():
            with torch.no_grad():
                layer.weight.copy_(torch.randn(N, N))
            layer.pwal(write)
    except Exception:
        pass  # the outcome is in last_outcome
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def test_a_storage_left_by_an_untracked_path_between_reloads_is_not_committed() -> None:
    model = Model()
    layer = model.layers[0]
    assert isinstance(layer, Layer)
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    x = torch.randn(2, N)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        layer(x)
    assert _reload(contract, layer, write=True).status is Status.COMMITTED
    old = layer.table
    layer.table = old.clone()  # the graph still reads the old storage, kept alive here, held at no path
    outcome = _reload(contract, layer, write=False)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert [f.kind for f in manifest.check(contract)] == [FindingKind.ORPHANED]  # the manifest alone sees it
    assert outcome.status is not Status.COMMITTED, outcome.summary()
    del old
