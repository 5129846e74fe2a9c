"""The freshness of tensors a layer holds where no slot path can name them (``contract._unnamed``): behind a
ContextVar, in a set, as a weak reference's referent, in an lru_cache. The layer never commits (``untrackable``:
the reload asks for a recapture), so a tensor PWAL skipped while the weights changed must be ``stale`` (FAILED):
the recapture would read it. One PWAL rebuilt or wrote in place is the recapture's to read: no ``stale``.

Oracle: the test's own bookkeeping of what PWAL did (``action``), independent of graphsafe's samples.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, FindingKind, GraphContract, Status

HOLDERS = ("contextvar", "set", "weakref", "lru_cache")
_KEEP: list[torch.Tensor] = []  # what the weak references' referents stay alive in
_KEEP_LRU: dict[int, torch.Tensor] = {}  # the tensor each lru_cache holds, by id of the cache (the test's view)


def _hold(holder: str, tensor: torch.Tensor) -> Any:
    if holder == "contextvar":
        return contextvars.ContextVar("table", default=tensor)
    if holder == "set":
        return {tensor}
    if holder == "weakref":
        _KEEP.append(tensor)
        return weakref.ref(tensor)
    cached = functools.lru_cache(maxsize=None)(_same)
    cached(tensor)  # key and result are in the cache now
    _KEEP_LRU[id(cached)] = tensor
    return cached


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _held(holder: str, box: Any) -> torch.Tensor:
    if holder == "contextvar":
        return box.get()
    if holder == "set":
        return next(iter(box))
    if holder == "weakref":
        return box()
    return _KEEP_LRU[id(box)]


class Held(nn.Module):
    """``table = weight * 3 + 1``, held where no path names it; PWAL rebuilds it, writes it in place or skips."""

    def __init__(self, holder: str) -> None:
        super().__init__()
        self.holder = holder
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.action = "rebuild"
        self.box = _hold(holder, self.weight.detach() * 3 + 1)

    def process_weights_after_loading(self) -> None:
        value = self.weight.detach() * 3 + 1
        if self.action == "rebuild":
            self.box = _hold(self.holder, value)
        elif self.action == "inplace":
            _held(self.holder, self.box).copy_(value)


def _reload(contract: GraphContract, layer: Held, loader: str, same: bool = False) -> Any:
    new = layer.weight.detach().clone() if same else torch.randn(4, 4)
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        if loader == "copy":
            layer.weight.copy_(new)
        else:  # moves no version counter
            layer.weight.data.copy_(new)
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


@pytest.mark.parametrize("loader", ["copy", "data"])
@pytest.mark.parametrize("action", ["skip", "rebuild", "inplace"])
@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
@pytest.mark.parametrize("holder", HOLDERS)
def test_an_unnamed_tensor_pwal_skipped_is_stale_and_one_it_refreshed_is_not(
    holder: str, detect: str, action: str, loader: str
) -> None:
    layer = Held(holder)
    contract = GraphContract(layer, "recapture", detect=detect).seal()  # type: ignore[arg-type]
    layer.action = action
    outcome = _reload(contract, layer, loader)
    kinds = {f.kind for f in outcome.problems}
    assert FindingKind.UNTRACKABLE in kinds, outcome.summary()  # never a commit
    stale = [f for f in outcome.problems if f.kind is FindingKind.STALE]
    if action == "skip":
        assert outcome.status is Status.FAILED, outcome.summary()
        assert len(stale) == 1 and stale[0].detail.startswith("box"), outcome.summary()
        assert "weight" in stale[0].detail  # the input that changed
    else:
        assert outcome.status is Status.NEEDS_RECAPTURE and not stale, outcome.summary()


def test_an_unnamed_weak_reference_to_a_weight_is_the_weight_slot_own() -> None:
    """A weak reference to the layer's own weight: the weight's slot judges it, never ``stale`` as an unnamed
    tensor (its memory is a parameter's)."""
    layer = Held("set")
    layer.box = weakref.ref(layer.weight)
    layer.action = "skip"
    contract = GraphContract(layer, "recapture").seal()
    outcome = _reload(contract, layer, "data")
    assert not [f for f in outcome.problems if f.kind is FindingKind.STALE], outcome.summary()


def test_an_unnamed_tensor_pwal_skipped_while_no_weight_changed_is_not_stale() -> None:
    """Nothing the layer is computed from changed (no load reached it): the skipped tensor still holds what PWAL
    computes."""
    layer = Held("contextvar")
    layer.action = "skip"
    contract = GraphContract(layer, "recapture").seal()
    with contextlib.suppress(ContractViolation), contract.reload():
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
