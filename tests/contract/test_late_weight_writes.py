"""A layer's weight written with other values after ``after_layer()``, with no PWAL after it: the state PWAL left
that no input judges (Python attributes on a slot judged by no inputs, tensors no slot path names) was computed
from the values before, so the reload must not commit, nor ask for a recapture that would read it.

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


class Flagged(nn.Module):
    """``table`` holds fixed contents (declared static); PWAL hangs on it what the forward reads besides: the
    weight itself where the weights sum positive (a fast path), a scale computed from the weight, or nothing."""

    def __init__(self, attribute: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.attribute = attribute

    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "table"):
            self.table = torch.arange(4, dtype=torch.float32)
            register_derived(self, "table", static=True)
        if self.attribute == "conditional":
            if bool(self.weight.sum() > 0):
                self.table.fast = self.weight
            else:
                self.table.__dict__.pop("fast", None)
        else:
            self.table.scale = float(self.weight.abs().max())

    def forward(self) -> torch.Tensor:
        if self.attribute == "conditional":
            fast = getattr(self.table, "fast", None)
            return self.table + (fast if fast is not None else -self.weight)
        return self.table * self.table.scale + self.weight


def _reload(layer: nn.Module, contract: GraphContract, first: torch.Tensor, late: torch.Tensor | None) -> None:
    """A layerwise reload: ``first`` loaded and processed, ``after_layer()``, then ``late`` written (no PWAL)."""
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=True) as txn, torch.no_grad():
        txn.before_layer(layer)
        layer.weight.copy_(first)
        layer.process_weights_after_loading()
        txn.after_layer(layer)
        if late is not None:
            layer.weight.copy_(late)


def _cold(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.process_weights_after_loading()
    out: torch.Tensor = layer()
    return out


@pytest.mark.parametrize("attribute", ["conditional", "scale"])
@pytest.mark.parametrize("mode", MODES)
def test_an_attribute_of_a_static_slot_is_stale_when_the_weight_is_written_after_after_layer(
    mode: str, attribute: str
) -> None:
    """Attacker: the weight is written again with other values after ``after_layer()`` (a late shard), PWAL does not
    run again: ``table``'s contents are fixed (right), its attribute is the first pass's (the fast path taken for a
    weight that no longer sums positive; a scale of the old values). Promise: not COMMITTED, and no recapture of a
    model whose forward differs from a cold one's."""
    layer = Flagged(attribute)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, mode).seal()
    _reload(layer, contract, w(2), w(-3))
    outcome = contract.last_outcome
    assert outcome is not None
    cold = _cold(Flagged(attribute), w(-3))
    assert not torch.equal(layer(), cold), "the scenario must leave the layer's forward wrong"
    assert outcome.status is Status.FAILED, (outcome.status, [(f.kind.value, f.path) for f in outcome.problems])
    assert any(f.kind is FindingKind.STALE and f.path == "table" for f in outcome.problems)


@pytest.mark.parametrize("late", ["same", "none"])
@pytest.mark.parametrize("attribute", ["conditional", "scale"])
@pytest.mark.parametrize("mode", MODES)
def test_an_attribute_of_a_static_slot_commits_when_no_other_value_is_written_after_after_layer(
    mode: str, attribute: str, late: str
) -> None:
    """Legitimate: the weight written again with the values it has (a duplicate shard), or not at all: the forward
    is a cold one's, the reload commits."""
    layer = Flagged(attribute)
    layer.process_weights_after_loading()
    contract = GraphContract(layer, mode).seal()
    _reload(layer, contract, w(2), w(2) if late == "same" else None)
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.COMMITTED, [(f.kind.value, f.path, f.detail) for f in outcome.problems]
    assert torch.equal(layer(), _cold(Flagged(attribute), w(2)))


class Scaled(nn.Module):
    """PWAL keeps its scaled weight only in a ContextVar (no slot path names it: untrackable)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.held: contextvars.ContextVar[torch.Tensor] = contextvars.ContextVar("scaled")

    def process_weights_after_loading(self) -> None:
        self.held.set(self.weight * 2.0)

    def forward(self) -> torch.Tensor:
        return self.held.get() + 1.0


@pytest.mark.parametrize("late", ["other", "same", "none"])
def test_a_contextvar_tensor_pwal_set_is_not_left_to_a_recapture_after_a_late_write(late: str) -> None:
    """Attacker: PWAL sets a ContextVar to a tensor computed from the weight (untrackable: a recapture is the way
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
        assert any(f.kind is FindingKind.STALE and "untrackable" in f.detail for f in outcome.problems)
    else:
        assert outcome.status is Status.NEEDS_RECAPTURE, [(f.kind.value, f.detail) for f in outcome.problems]


class _Packed(torch.Tensor):
    """A wrapper subclass keeping its parts as attributes (``codes``, ``lut``): its contents, not PWAL's notes."""

    codes: torch.Tensor
    lut: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, lut: torch.Tensor) -> _Packed:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, codes.shape, dtype=torch.float32, device=codes.device, requires_grad=False
        )

    def __init__(self, codes: torch.Tensor, lut: torch.Tensor) -> None:
        self.codes = codes
        self.lut = lut

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["codes", "lut"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: None, size: object, stride: object) -> _Packed:
        return _Packed(inner["codes"], inner["lut"])

    def __repr__(self) -> str:  # type: ignore[override]
        return "_Packed()"

    @classmethod
    def __torch_dispatch__(
        cls, func: object, types: object, args: tuple[object, ...] = (), kwargs: object = None
    ) -> object:
        raise NotImplementedError(f"_Packed does not compute ({func})")


class PackedTable(nn.Module):
    """A fixed lookup table packed in a wrapper subclass (declared static), beside a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "table"):
            self.table = _Packed(torch.arange(4, dtype=torch.int8), torch.linspace(0.0, 1.0, 4))
            register_derived(self, "table", static=True)


@pytest.mark.parametrize("mode", MODES)
def test_the_parts_of_a_static_wrapper_slot_are_no_attributes_a_late_write_leaves_stale(mode: str) -> None:
    """Legitimate: a static wrapper slot's parts live in its ``__dict__`` (``__tensor_flatten__`` names them); they
    do not depend on the weight, so a weight written after ``after_layer()`` leaves nothing stale: COMMITTED."""
    layer = PackedTable()
    layer.process_weights_after_loading()
    codes, lut = layer.table.codes, layer.table.lut
    contract = GraphContract(layer, mode).seal()
    _reload(layer, contract, w(2), w(3))
    outcome = contract.last_outcome
    assert outcome is not None
    assert outcome.status is Status.COMMITTED, [(f.kind.value, f.path, f.detail) for f in outcome.problems]
    assert layer.table.codes is codes and layer.table.lut is lut and torch.equal(layer.weight, w(3))
