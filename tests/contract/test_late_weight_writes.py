"""A layer's weight written with other values after ``after_layer()``, with no PWAL after it: whatever PWAL
computed from the weight (tensors no slot path names, Python attributes on a slot, on a parameter or on the module,
in the layer or in a module beside it) holds the values before, so the reload must not commit, nor ask for a
recapture that would read it.

Every reload loads DIFFERENT weights. The oracle is a cold layer built with the final weights (load, then PWAL):
what its forward reads is what the reloaded layer must read. Writing the same values again, or nothing, is a
legitimate reload and must still commit.
"""

from __future__ import annotations

import contextlib
import contextvars

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, GraphSafeError, Status, register_derived

MODES = ("strict", "recapture", "migrate")


def w(seed: int) -> torch.Tensor:
    """Distinct values per seed; seed 1 sums to a positive number, seed -1 to a negative one."""
    return (torch.arange(4, dtype=torch.float32) + 10.0 * abs(seed) + 0.5) * (1 if seed > 0 else -1)


class Derives(nn.Module):
    """A weight, and what PWAL computes from it that no derived slot's inputs judge, by ``kind``:

    - ``static_fast``: a fixed table (declared static) carrying the weight as its ``fast`` path where the weights
      sum positive (elsewhere no attribute: the slower path reads ``-weight``);
    - ``static_scale``: the table carrying a scale of the weight as a Python float;
    - ``parameter``: that scale hung on the weight parameter itself;
    - ``buffer``: on a registered buffer;
    - ``module``: a plain attribute of the module;
    - ``child``: on a table of a child module that holds no weight of its own;
    - ``parent``: the weight in a child module, the table and its scale on the parent;
    - ``nothing``: PWAL computes nothing (the forward reads the weight alone).
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "parent":
            self.inner = nn.Module()
            self.inner.weight = nn.Parameter(w(1), requires_grad=False)
        else:
            self.weight = nn.Parameter(w(1), requires_grad=False)
        if kind == "buffer":
            self.register_buffer("table", torch.arange(4, dtype=torch.float32))
        if kind == "child":
            self.sub = nn.Module()

    @property
    def source(self) -> nn.Parameter:
        return self.inner.weight if self.kind == "parent" else self.weight

    def _table(self) -> torch.Tensor:
        owner = self.sub if self.kind == "child" else self
        if not hasattr(owner, "table"):
            owner.table = torch.arange(4, dtype=torch.float32)
            register_derived(owner, "table", static=True)
        table: torch.Tensor = owner.table
        return table

    def process_weights_after_loading(self) -> None:
        scale = float(self.source.abs().max())
        if self.kind == "static_fast":
            table = self._table()
            if bool(self.source.sum() > 0):
                table.fast = self.source
            else:
                table.__dict__.pop("fast", None)
        elif self.kind in ("static_scale", "child", "parent"):
            self._table().scale = scale
        elif self.kind == "parameter":
            self.weight.scale = scale
        elif self.kind == "buffer":
            self.table.scale = scale
        elif self.kind == "module":
            self.scale = scale

    def forward(self) -> torch.Tensor:
        kind = self.kind
        if kind == "nothing":
            return self.source * 2
        if kind == "static_fast":
            fast = getattr(self.table, "fast", None)
            return self.table + (fast if fast is not None else -self.source)
        if kind == "parameter":
            return self.weight * self.weight.scale
        if kind == "module":
            return self.weight * self.scale
        table = self.sub.table if kind == "child" else self.table
        return table * table.scale + self.source


def _reload(layer: nn.Module, contract: GraphContract, first: torch.Tensor, late: torch.Tensor | None) -> None:
    """A layerwise reload: ``first`` loaded and processed, ``after_layer()``, then ``late`` written (no PWAL)."""
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=True) as txn, torch.no_grad():
        txn.before_layer(layer)
        layer.source.copy_(first)
        layer.process_weights_after_loading()
        txn.after_layer(layer)
        if late is not None:
            layer.source.copy_(late)


def _cold(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        layer.source.copy_(weight)
    layer.process_weights_after_loading()
    out: torch.Tensor = layer()
    return out


KINDS = ("static_fast", "static_scale", "parameter", "buffer", "module", "child", "parent")


@pytest.mark.parametrize("kind", [*KINDS, "nothing"])
@pytest.mark.parametrize("mode", MODES)
def test_a_weight_written_with_other_values_after_after_layer_fails_the_reload(mode: str, kind: str) -> None:
    """The weight is written again with other values after ``after_layer()`` (a late shard), PWAL does not
    run again: what it computed from the weight is the first pass's (the fast path taken for a weight that no longer
    sums positive; a scale of the old values), wherever it lives. Promise: not COMMITTED, and no recapture of a
    model whose forward differs from a cold one's; a ``stale`` finding names the weight. A layer whose PWAL computes
    nothing fails too: nothing can tell what a PWAL computed (fail closed, documented)."""
    layer = Derives(kind)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, mode).seal()
    _reload(layer, contract, w(2), w(-3))
    outcome = contract.last_outcome
    assert outcome is not None
    right = torch.equal(layer(), _cold(Derives(kind), w(-3)))
    assert right is (kind == "nothing"), "the scenario must leave the layer's forward wrong exactly where PWAL derives"
    assert outcome.status is Status.FAILED, (outcome.status, [(f.kind.value, f.path) for f in outcome.problems])
    assert any(f.kind is FindingKind.STALE and "weight" in f.detail for f in outcome.problems), outcome.problems


@pytest.mark.parametrize("late", ["same", "none"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_no_other_value_written_after_after_layer_commits(mode: str, kind: str, late: str) -> None:
    """Legitimate: the weight written again with the values it has (a duplicate shard), or not at all: the forward
    is a cold one's, the reload commits."""
    layer = Derives(kind)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, mode).seal()
    _reload(layer, contract, w(2), w(2) if late == "same" else None)
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.COMMITTED, [(f.kind.value, f.path, f.detail) for f in outcome.problems]
    assert torch.equal(layer(), _cold(Derives(kind), w(2)))


class Scaled(nn.Module):
    """PWAL keeps its scaled weight only in a ContextVar (no slot path names it: untrackable)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.held: contextvars.ContextVar[torch.Tensor] = contextvars.ContextVar("scaled")

    @property
    def source(self) -> nn.Parameter:
        return self.weight

    def process_weights_after_loading(self) -> None:
        self.held.set(self.weight * 2.0)

    def forward(self) -> torch.Tensor:
        return self.held.get() + 1.0


@pytest.mark.parametrize("late", ["other", "same", "none"])
def test_a_contextvar_tensor_pwal_set_is_not_left_to_a_recapture_after_a_late_write(late: str) -> None:
    """PWAL sets a ContextVar to a tensor computed from the weight (untrackable: a recapture is the way
    out); the weight is written again with other values after ``after_layer()``. A recapture now would read the
    first pass's values. Promise: FAILED (stale), not NEEDS_RECAPTURE. With nothing or the same values written, a
    recapture reads right: NEEDS_RECAPTURE, as for any untrackable tensor."""
    layer = Scaled()
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture").seal()
    written = {"other": w(3), "same": w(2), "none": None}[late]
    _reload(layer, contract, w(2), written)
    outcome = contract.last_outcome
    assert outcome is not None
    right = torch.equal(layer(), _cold(Scaled(), w(3) if late == "other" else w(2)))
    assert right is (late != "other"), "the scenario must leave the layer's forward wrong exactly after other values"
    if late == "other":
        assert outcome.status is Status.FAILED, (outcome.status, [(f.kind.value, f.path) for f in outcome.problems])
        assert any(f.kind is FindingKind.STALE and "weight" in f.detail for f in outcome.problems)
    else:
        assert outcome.status is Status.NEEDS_RECAPTURE, [(f.kind.value, f.detail) for f in outcome.problems]


class Large(nn.Module):
    """A weight of 100,003 elements; PWAL hangs its largest magnitude on the module (what the forward scales by)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 100_003), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.peak = float(self.weight.abs().max())

    def forward(self) -> torch.Tensor:
        return self.weight / self.peak


@pytest.mark.parametrize("through", ["data", "inference_mode"])
def test_one_element_written_after_after_layer_past_the_version_counter_fails_the_reload(through: str) -> None:
    """A loader writes through ``.data`` (or under inference mode on an inference weight): no version
    counter moves; the late write changes one element, between any sample's elements, and it is the peak PWAL
    scaled by. Promise: not COMMITTED (the weights are compared by a digest of every byte)."""
    layer = Large()
    if through == "inference_mode":
        with torch.inference_mode():
            layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture").seal()
    index = 50_001  # not an element any sample of 4,096 spread over the weight reads
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=True) as txn, torch.no_grad():
        txn.before_layer(layer)
        layer.process_weights_after_loading()  # a partial reload: the weight is not in this shard
        txn.after_layer(layer)
        with torch.inference_mode() if through == "inference_mode" else contextlib.nullcontext():
            layer.weight.data[index] = 9.0  # the new peak
    outcome = contract.last_outcome
    assert outcome is not None
    assert layer.peak != 9.0, "the scenario must leave PWAL's peak stale"
    assert outcome.status is Status.FAILED, (outcome.status, [(f.kind.value, f.path) for f in outcome.problems])


class _Tied(nn.Module):
    """One weight registered in two layers (an embedding and a head), neither PWAL computing anything from it."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Parameter(torch.arange(8.0).reshape(2, 4), requires_grad=False)
        self.embed, self.head = nn.Module(), nn.Module()
        self.embed.weight = shared
        self.head.weight = shared


@pytest.mark.parametrize("loaded_in", ["first", "second", "both"])
def test_a_tied_weight_is_loaded_while_the_first_layer_holding_it_is_open(loaded_in: str) -> None:
    """The late-write rule's documented refusal of a correct model (docs/fault-matrix.md): a tied weight loaded only
    while its second layer is open reaches the first layer after that one was closed, so the first fails ``stale``
    (nothing can tell that its PWAL computed nothing); loaded while the first layer is open, it commits."""
    model = _Tied()
    contract = GraphContract(model, "strict").seal()
    new = torch.full((2, 4), 7.0)
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=True) as txn, torch.no_grad():
        for position, layer in enumerate((model.embed, model.head)):
            txn.before_layer(layer)
            if loaded_in == "both" or (loaded_in == "first") == (position == 0):
                layer.weight.copy_(new)
            txn.after_layer(layer)
    outcome = contract.last_outcome
    assert outcome is not None and torch.equal(model.head.weight, new)
    if loaded_in == "second":
        assert outcome.status is Status.FAILED
        assert [(f.kind, f.layer) for f in outcome.problems] == [(FindingKind.STALE, "embed")], outcome.problems
    else:
        assert outcome.status is Status.COMMITTED, [(f.kind.value, f.layer, f.detail) for f in outcome.problems]
