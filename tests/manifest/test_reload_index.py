"""The manifest's reload index (``collectors._manifest_index``) is built once per capture, discard, reindex and
vouch, and again when a recorded storage is freed; the per-reload checks read the model again every time. Each test
changes, between two reloads, one thing the index holds or points at, and the next verdict must follow the change:
a module replaced under a holder's layer name, a path rebound, a storage resized, a capture recorded again under its
name or discarded, the holders changed by a reseal, a storage freed, a table vouched for after the capture.

The model: ``layers.0`` holds a weight (the only slot a ``declared-only`` seal tracks), a plain attribute ``w_t``
its PWAL rewrites in place; the model's child ``side``, with no weights of its own, holds a fixed ``table`` the
forward reads.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadFailedError, ReloadOutcome, Status
from graphsafe.collectors import Manifest, record_capture

N = 4
_FIXED = torch.arange(float(N))  # a lookup table outside the model, never reloaded


class Inner(nn.Module):
    """A child with no weights: no seal tracks it, only the manifest ties its table to a path."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(N)


class Host(nn.Module):
    def __init__(self, *, fixed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N, N), requires_grad=False)
        self.w_t = self.weight.detach().t().contiguous()
        self.fixed = fixed

    def pwal(self) -> None:
        self.w_t.copy_(self.weight.detach().t())  # in place: the captured storage keeps serving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w_t
        return y + _FIXED if self.fixed else y


class Model(nn.Module):
    def __init__(self, **options: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Host(**options)])
        self.side = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x) + self.side.table


def host(model: Model) -> Host:
    found = model.layers[0]
    assert isinstance(found, Host)
    return found


def setup(mode: str = "recapture", **options: bool) -> tuple[Model, GraphContract]:
    model = Model(**options)
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    capture(model, contract)
    return model, contract


def capture(model: Model, contract: GraphContract, name: str = "g") -> Manifest:
    x = torch.randn(2, N)
    with torch.no_grad(), record_capture(contract, name=name, ignore=[x], backend="dispatch") as manifest:
        model(x)
    return manifest


def reload(model: Model, contract: GraphContract) -> ReloadOutcome:
    with contextlib.suppress(ReloadFailedError), contract.reload():
        with torch.no_grad():
            host(model).weight.copy_(torch.randn(N, N))
        host(model).pwal()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def committed(model: Model, contract: GraphContract) -> None:
    """A reload that commits: the index is built and used once before the change under test."""
    outcome = reload(model, contract)
    assert outcome.status is Status.COMMITTED, outcome.summary()


def kinds(outcome: ReloadOutcome) -> dict[str, FindingKind]:
    return {f.where: f.kind for f in outcome.problems}


def test_a_module_replaced_under_a_holders_layer_name_is_seen() -> None:
    model, contract = setup()
    committed(model, contract)
    old = model.side  # kept alive: its table is orphaned, not freed
    model.side = Inner()
    outcome = reload(model, contract)
    assert kinds(outcome).get("side:table") is FindingKind.ORPHANED, outcome.summary()
    del old


def test_a_path_rebound_to_another_tensor_is_seen() -> None:
    model, contract = setup()
    committed(model, contract)
    old = host(model).w_t
    host(model).w_t = old.clone()
    outcome = reload(model, contract)
    assert kinds(outcome).get("layers.0:w_t") is FindingKind.ORPHANED, outcome.summary()
    del old


def test_a_storage_resized_between_reloads_is_dead() -> None:
    model, contract = setup()
    committed(model, contract)
    storage = host(model).w_t.untyped_storage()
    before = storage.data_ptr()
    storage.resize_(storage.nbytes() * 64)
    assert storage.data_ptr() != before
    outcome = reload(model, contract)
    found = [f for f in outcome.problems if f.where == "layers.0:w_t"]
    assert found and found[0].kind is FindingKind.DEAD and "reallocated" in found[0].detail, outcome.summary()


def test_a_recapture_under_the_same_name_replaces_what_is_checked() -> None:
    model, contract = setup()
    committed(model, contract)
    old = host(model).w_t
    host(model).w_t = old.clone()  # the old storage kept alive: orphaned unless the recapture replaced it
    capture(model, contract, name="g")
    outcome = reload(model, contract)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    del old


def test_a_discarded_capture_is_no_longer_checked() -> None:
    model, contract = setup()
    committed(model, contract)
    old = host(model).w_t
    host(model).w_t = old.clone()
    assert contract.manifest is not None and contract.manifest.discard("g")  # type: ignore[attr-defined]
    outcome = reload(model, contract)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    del old


def test_holders_a_reseal_adds_are_checked() -> None:
    model, contract = setup(fixed=True)
    outcome = reload(model, contract)
    # read, held nowhere, and unwritten: as a cache PWAL skipped
    assert [f.kind for f in outcome.problems] == [FindingKind.STALE], outcome.summary()
    model.side.lookup = _FIXED  # now held at a model path: the reseal ties the storage to it
    contract.reseal(recaptured=True)
    committed(model, contract)
    model.side.lookup = _FIXED.clone()  # the path leaves it (the module global keeps it alive)
    outcome = reload(model, contract)
    assert kinds(outcome).get("side:lookup") is FindingKind.ORPHANED, outcome.summary()


def test_a_freed_storage_is_no_longer_held_at_its_paths() -> None:
    model, contract = setup()
    committed(model, contract)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert ("layers.0", "w_t") in {(layer, path) for layer, path, _ in manifest.held(contract)}
    host(model).w_t = host(model).w_t.clone()  # the captured storage is freed
    assert ("layers.0", "w_t") not in {(layer, path) for layer, path, _ in manifest.held(contract)}
    outcome = reload(model, contract)
    assert kinds(outcome).get("layers.0:w_t") is FindingKind.DEAD, outcome.summary()


@pytest.mark.parametrize("vouch", [False, True])
def test_a_table_vouched_for_after_a_reload_takes_effect_at_the_next(vouch: bool) -> None:
    model, contract = setup(fixed=True)
    outcome = reload(model, contract)
    # read, held nowhere, and unwritten: as a cache PWAL skipped
    assert [f.kind for f in outcome.problems] == [FindingKind.STALE], outcome.summary()
    contract.reseal(recaptured=True)
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    if vouch:
        manifest.vouch_fixed(_FIXED)
    outcome = reload(model, contract)
    assert (outcome.status is Status.COMMITTED) is vouch, outcome.summary()


class Redirecting(Model):
    """``side`` reads as another child (a wrapper forwarding attribute access): ``get_submodule("side")`` is
    ``other``, not ``_modules["side"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.other = Inner()

    def __getattr__(self, name: str) -> object:
        if name == "side" and self._redirect:
            return self._modules["other"]
        return super().__getattr__(name)


def test_a_holders_layer_is_resolved_as_get_submodule_resolves_it() -> None:
    model = Redirecting()
    model._redirect = False
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    capture(model, contract)
    committed(model, contract)
    model._redirect = True  # now "side" names the other child, whose table the graph never read
    assert model.get_submodule("side") is model.other
    outcome = reload(model, contract)
    assert kinds(outcome).get("side:table") is FindingKind.ORPHANED, outcome.summary()
