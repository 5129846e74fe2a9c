"""A submodule held at two paths (``model.a is model.b``) is one sealed layer with two qualified names. A reload
that binds another module at either path (the second one too) leaves the graph reading the captured layer where
the model no longer holds it: the layer is ``vanished`` at that path, never committed. The capture manifest ties a
recorded storage to every path of a shared module, so it sees the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, GraphSafeError, ReloadOutcome, Status, register_derived
from graphsafe.collectors import record_capture


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a  # one module at two paths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4))
        self.second = nn.Sequential(self.first[0])  # the same Linear under another parent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def reload(contract: GraphContract, body: object) -> ReloadOutcome:
    with contract.reload():
        body()  # type: ignore[operator]
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
@pytest.mark.parametrize("path", ["a", "b"])
def test_binding_another_module_at_either_path_of_a_shared_submodule_does_not_commit(path: str, detect: str) -> None:
    model = Twice()
    contract = GraphContract(model, "recapture", detect=detect).seal()  # type: ignore[arg-type]
    outcome = reload(contract, lambda: setattr(model, path, nn.Linear(4, 4)))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert {f.kind for f in outcome.problems} == {FindingKind.VANISHED}


def test_a_shared_module_replaced_under_its_second_parent_does_not_commit() -> None:
    model = Nested()
    contract = GraphContract(model, "recapture").seal()
    outcome = reload(contract, lambda: model.second.__setitem__(0, nn.Linear(4, 4)))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert {f.kind for f in outcome.problems} == {FindingKind.VANISHED}


def test_a_shared_submodule_reloaded_in_place_commits() -> None:
    model = Twice()
    contract = GraphContract(model, "strict").seal()
    new = torch.randn(4, 4)
    outcome = reload(contract, lambda: model.b.weight.data.copy_(new))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(model.a.weight, new)


def test_the_manifest_ties_a_shared_module_storage_to_both_paths() -> None:
    model = Twice()
    contract = GraphContract(model, "recapture").seal()
    x = torch.randn(2, 4)
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        model(x)
    (entry,) = [e for e in manifest.storages() if e.storage_ref() is model.a.weight.untyped_storage()]
    assert {h.where for h in entry.holders} >= {"a:weight", "b:weight"}


@pytest.mark.parametrize("path", ["a", "b"])
def test_a_stale_slot_of_a_shared_submodule_replaced_at_one_path_fails_rather_than_recapture(path: str) -> None:
    """The shared layer's derived slot is not rebuilt although its weight changed, then another module is bound at
    one of its two paths. The captured layer is still held at the other path, stale: a recapture would read its old
    values there, so the reload fails (``stale``), it does not ask for a recapture (the fuzzer's ``shared``
    class: a replaced layer reported only ``vanished``, never checked, would pass)."""
    model = Twice()
    model.a.w_t = model.a.weight.detach().t().contiguous()
    register_derived(model.a, "w_t")
    contract = GraphContract(model, "recapture").seal()

    def body() -> None:
        with torch.no_grad():
            model.a.weight.copy_(torch.randn(4, 4))  # PWAL's guard skips w_t: stale
        setattr(model, path, nn.Linear(4, 4))

    with pytest.raises(GraphSafeError):
        reload(contract, body)
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.FAILED, outcome.summary()
    assert {f.kind for f in outcome.problems} >= {FindingKind.STALE, FindingKind.VANISHED}


@pytest.mark.parametrize("path", ["a", "b"])
def test_a_shared_submodule_written_after_its_after_layer_and_replaced_at_one_path_fails(path: str) -> None:
    """Layerwise: the shared layer is restored by its after_layer(), then its weight is written again (other values,
    no PWAL after it: ``w_t`` stale) and another module is bound at one of its paths. The end-of-reload check of
    the closed layer must still run where the model holds it (it reported only ``vanished``, so a recapture read
    the stale ``w_t``)."""
    model = Twice()
    model.a.w_t = model.a.weight.detach().t().contiguous()
    register_derived(model.a, "w_t")
    contract = GraphContract(model, "recapture").seal()
    with pytest.raises(GraphSafeError), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        with torch.no_grad():
            model.a.weight.copy_(torch.randn(4, 4))
        model.a.w_t = model.a.weight.detach().t().contiguous()
        txn.after_layer(model.a)
        with torch.no_grad():
            model.a.weight.copy_(torch.randn(4, 4))  # a late shard, and no PWAL after it
        setattr(model, path, nn.Linear(4, 4))
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.FAILED, outcome.summary()
    assert {f.kind for f in outcome.problems} >= {FindingKind.STALE, FindingKind.VANISHED}


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
def test_a_shared_submodule_written_in_place_under_a_capture_manifest_commits(detect: str) -> None:
    """The capture manifest ties the shared layer's storages to both its names; the second name's holder is the
    same slot, not an untracked path another tensor wrote: an in-place reload commits (not ``stale``, "the
    reload wrote that memory through another path's new tensor"; the fuzzer's ``shared`` class)."""
    model = Twice()
    model.a.w_t = model.a.weight.detach().t().contiguous()
    register_derived(model.a, "w_t")
    contract = GraphContract(model, "strict", detect=detect).seal()  # type: ignore[arg-type]
    x = torch.randn(2, 4)
    with record_capture(contract, ignore=[x], backend="dispatch"):
        model(x)
        model.b.w_t.clone()
    new = torch.randn(4, 4)

    def body() -> None:
        with torch.no_grad():
            model.b.weight.copy_(new)
        model.a.w_t.copy_(new.t())  # PWAL writes its derived tensor in place

    outcome = reload(contract, body)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(model.b.w_t, new.t())
