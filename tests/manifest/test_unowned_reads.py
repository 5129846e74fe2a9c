"""A captured read that no model path feeds is a finding in every backend: storage the graph read that the model
holds nowhere is ``orphaned`` at the end of a reload where the reload wrote it (a recapture reads what PWAL left
there), and ``stale`` where the reload wrote none of its bytes: a recapture would read the same bytes, and nothing
tells a cache entry PWAL skipped from one it replaced while a rollback list keeps the old one alive, an unignored
static input, or a fixed table (``contract._unnamed``). A truly external fixed table is vouched for explicitly
(``Manifest.vouch_fixed``); a storage the capture only viewed is no read."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadFailedError, ReloadOutcome, Status
from graphsafe.collectors import Manifest, record_capture

_CACHE: dict[int, torch.Tensor] = {}
_ROLLBACK: list[torch.Tensor] = []  # the previous entries, kept alive for a rollback
_TABLE = torch.arange(4.0)  # a fixed lookup table outside the model, never reloaded


class Cached(nn.Module):
    """Forward reads a module-level cache entry that PWAL replaces (the old one goes to a rollback list)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        old = _CACHE.get(id(self))
        if old is not None:
            _ROLLBACK.append(old)
        _CACHE[id(self)] = self.weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _CACHE[id(self)]


class Tabled(nn.Module):
    """Forward reads the fixed external table besides its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + _TABLE


def _reload(contract: GraphContract, layer: nn.Module, pwal: bool, in_place: bool = False) -> ReloadOutcome:
    with contextlib.suppress(ReloadFailedError), contract.reload():
        with torch.no_grad():
            layer.weight.copy_(torch.randn(4, 4))
            if in_place:
                _CACHE[id(layer)].copy_(layer.weight.t())
        if pwal:
            layer.process_weights_after_loading()  # type: ignore[operator]
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_replaced_cache_entry_kept_alive_outside_the_model_fails_closed_under_the_dispatch_recorder(
    mode: str,
) -> None:
    """The old entry is alive and unwritten: as a skipped rebuild leaves it, so a recapture is no fix."""
    layer = Cached()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    with record_capture(contract, ignore=[x], backend="dispatch"):
        layer(x)
    assert [entry.hi > 0 for entry in contract.manifest.unowned()] == [True]  # the cache entry, read
    outcome = _reload(contract, layer, pwal=True)
    assert outcome.status is Status.FAILED, outcome.summary()
    assert [f.kind for f in outcome.problems] == [FindingKind.STALE]
    assert "no model path holds it" in outcome.problems[0].detail
    assert "vouch_fixed" in outcome.problems[0].detail


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_cache_entry_written_in_place_is_orphaned(mode: str) -> None:
    """The reload wrote the entry's bytes: a recapture reads what PWAL left there."""
    layer = Cached()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    with record_capture(contract, ignore=[x], backend="dispatch"):
        layer(x)
    outcome = _reload(contract, layer, pwal=False, in_place=True)
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert [f.kind for f in outcome.problems] == [FindingKind.ORPHANED]
    assert "no model path holds it" in outcome.problems[0].detail


def test_a_static_input_left_out_of_ignore_is_a_finding_too() -> None:
    """Nothing tells an unignored input from an unowned cache PWAL skipped: the input must be passed as
    ``ignore=``."""
    layer = Tabled()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "recapture").seal()
    contract.manifest = Manifest()
    contract.manifest.vouch_fixed(_TABLE)
    with record_capture(contract, backend="dispatch"):
        layer(x)
    outcome = _reload(contract, layer, pwal=False)
    assert outcome.status is Status.FAILED, outcome.summary()
    assert "ignore=" in outcome.problems[0].detail


def test_a_vouched_fixed_external_table_commits() -> None:
    layer = Tabled()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        layer(x)
    manifest.vouch_fixed(_TABLE)
    assert manifest.unowned() == []
    outcome = _reload(contract, layer, pwal=False)
    assert outcome.status is Status.COMMITTED, outcome.summary()


def test_an_unvouched_external_table_fails_closed() -> None:
    layer = Tabled()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "recapture").seal()
    with record_capture(contract, ignore=[x], backend="dispatch"):
        layer(x)
    outcome = _reload(contract, layer, pwal=False)
    assert outcome.status is Status.FAILED, outcome.summary()
    assert [f.kind for f in outcome.problems] == [FindingKind.STALE]
    assert "vouch_fixed" in outcome.problems[0].detail


def test_a_storage_the_capture_only_viewed_is_no_finding() -> None:
    layer = Tabled()
    x = torch.randn(2, 4)
    held = torch.randn(8)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        layer(x)
        held.view(2, 4)  # a view, no bytes read
    manifest.vouch_fixed(_TABLE)
    outcome = _reload(contract, layer, pwal=False)
    assert outcome.status is Status.COMMITTED, outcome.summary()


def test_an_unowned_scratch_the_graph_fills_before_reading_is_no_read() -> None:
    """Bytes the capture writes through ``out=`` or ``copy_`` before reading them are the graph's own values."""
    layer = Tabled()
    x = torch.randn(2, 4)
    scratch, other = torch.empty(2, 4), torch.empty(2, 4)
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        torch.mul(layer(x), 2, out=scratch)
        other.copy_(scratch)
        (scratch + other).sum()
    manifest.vouch_fixed(_TABLE)
    assert {entry.read for entry in manifest.unowned()} == {False}
    outcome = _reload(contract, layer, pwal=False)
    assert outcome.status is Status.COMMITTED, outcome.summary()


def test_an_unowned_scratch_read_beyond_what_the_graph_wrote_is_a_read() -> None:
    layer = Tabled()
    x = torch.randn(2, 4)
    scratch = torch.empty(4, 4)
    contract = GraphContract(layer, "recapture").seal()
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        torch.mul(layer(x), 2, out=scratch[:2])
        scratch.sum()  # rows 2 and 3 hold what was there before the capture
    manifest.vouch_fixed(_TABLE)
    outcome = _reload(contract, layer, pwal=False)
    assert outcome.status is Status.FAILED, outcome.summary()  # read, and no reload wrote it
    assert [f.kind for f in outcome.problems] == [FindingKind.STALE]


class LazyTable(nn.Module):
    """Forward makes ``table`` on its first call (after the seal) and reads it: held at a layer path, by the walker."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.ones(4)
        return x @ self.weight + self.table


def test_a_tensor_that_appeared_after_the_seal_at_a_layer_path_is_not_unowned() -> None:
    layer = LazyTable()
    x = torch.randn(2, 4)
    contract = GraphContract(layer, "strict").seal()  # every-reload: the reload walk finds the table
    layer(x)  # warm-up: the table appears
    with record_capture(contract, ignore=[x], backend="dispatch") as manifest:
        layer(x)
    assert manifest.unowned() == []
    (entry,) = [e for e in manifest.storages() if e.storage_ref() is layer.table.untyped_storage()]
    assert [h.path for h in entry.holders] == ["table"]
