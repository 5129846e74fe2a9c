"""The departure witness (``contract/_departures.py``) and the holders rule (``contract/_holders.py``): a captured
parameter that left its module (by registration, or unseen: ``del``, ``= None``, a write into ``_parameters``, a
buffer turned parameter) and that a holder or the plain tensor it is carved from wrote afterwards (a permutation
within a digest row included, a write while it was away and came back, a wrapper's inner tensors) is never copied
into.

Each test asserts the promise with its own oracle: (1) never COMMITTED while the captured memory holds values the
eager model does not compute; (2) graphsafe never writes into tensor values the reload did not produce for it.
Every reload loads values that differ from the captured ones.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, Status, record_capture
from graphsafe.errors import GraphSafeError


def _capture(model: nn.Module, read, mode: str = "recapture", detect: str | None = None) -> GraphContract:
    kwargs = {} if detect is None else {"detect": detect}
    contract = GraphContract(model, mode, **kwargs).seal()  # type: ignore[arg-type]
    with torch.no_grad(), record_capture(contract):
        read()
    return contract


def _reload(contract: GraphContract, layer: nn.Module, load, pwal, layerwise: bool = False) -> None:
    with contextlib.suppress(GraphSafeError), contract.reload(layerwise=layerwise) as txn, torch.no_grad():
        if layerwise:
            txn.before_layer(layer)
        load()
        pwal()
        if layerwise:
            txn.after_layer(layer)


# -- 1. rule B: a carved parameter that leaves with no registration hook seen ----------------------------------------
# _written_since_left's departed_only branch asks departures.written_since_left(), which answers None (falsy) for a
# tensor whose departure no hook saw, and never asks left_unseen() (the unexplained branch does): the copy goes ahead.


class _Carved(nn.Module):
    def __init__(self, kind: str = "parameter") -> None:
        super().__init__()
        self.flat = torch.ones(8)
        if kind == "parameter":
            self.w1 = nn.Parameter(self.flat[:4], requires_grad=False)
            self.w2 = nn.Parameter(self.flat[4:], requires_grad=False)
        else:
            self.register_buffer("w1", self.flat[:4])
            self.register_buffer("w2", self.flat[4:])

    def forward(self) -> torch.Tensor:
        return torch.cat([self.flat, self.w1, self.w2])


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("detect", ["sealed-paths", "every-reload"])
@pytest.mark.parametrize("how", ["del_first", "none_first", "parameters_dict", "buffer_to_parameter"])
def test_carved_parameter_leaving_unseen_then_alias_written_is_never_copied_into(
    how: str, detect: str, layerwise: bool
) -> None:
    layer = _Carved("buffer" if how == "buffer_to_parameter" else "parameter")
    contract = _capture(layer, layer, detect=detect)
    flat = layer.flat

    def pwal() -> None:
        new = nn.Parameter(layer.w1 * 2, requires_grad=False)
        if how == "del_first":
            del layer.w1
        elif how == "none_first":
            layer.w1 = None
        if how == "parameters_dict":
            layer._parameters["w1"] = new
        else:
            layer.w1 = new  # buffer_to_parameter: torch drops the buffer before the parameter hook runs
        layer.flat.mul_(3)  # written through the alias path after w1 left

    _reload(contract, layer, lambda: layer.flat.copy_(torch.arange(8.0) + 100), pwal, layerwise)
    expected = (torch.arange(8.0) + 100) * 3
    outcome = contract.last_outcome
    assert torch.equal(flat, expected), f"graphsafe wrote {flat.tolist()} over the flat tensor PWAL scaled"
    assert outcome is not None and outcome.status is not Status.COMMITTED


# -- 2. the every-byte witness of a large tensor is a row-sum digest: a permutation inside a row is invisible --------

_SPARES: dict[str, torch.Tensor] = {}


class _LargePingPong(nn.Module):
    """A (32, 1024) parameter (128 KiB: digested, not copied) swapped with a spare an engine table holds; the holder
    then writes the old one with each row reversed (through ``.data``, or in inference mode: no counter moves)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        with torch.inference_mode() if how == "inference" else contextlib.nullcontext():
            self.weight = nn.Parameter(torch.ones(32, 1024), requires_grad=False)
            _SPARES["spare"] = nn.Parameter(torch.zeros(32, 1024), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        old = self.weight
        self.weight = _SPARES["spare"]
        _SPARES["spare"] = old
        with torch.no_grad(), torch.inference_mode() if self.how == "inference" else contextlib.nullcontext():
            self.weight.copy_(old * 2)
            target = old.data if self.how == "data" else old
            target.copy_(old.flip(1))  # the holder's own values: every row reversed


@pytest.mark.parametrize("how", ["data", "inference"])
def test_large_pingpong_holder_writing_a_row_permutation_is_never_written(how: str) -> None:
    layer = _LargePingPong(how)
    contract = _capture(layer, lambda: layer.weight.sum())
    captured = layer.weight
    loaded = torch.arange(32 * 1024, dtype=torch.float32).view(32, 1024)

    def load() -> None:
        with torch.inference_mode() if how == "inference" else contextlib.nullcontext():
            layer.weight.copy_(loaded)

    _reload(contract, layer, load, layer.process_weights_after_loading)
    assert _SPARES["spare"] is captured
    assert torch.equal(captured, loaded.flip(1)), f"graphsafe wrote {captured[0, :3].tolist()}... into the spare"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


def test_large_carved_parameter_alias_permuted_after_it_left_is_never_copied_into() -> None:
    """Rule B with the same blind spot: the alias path rewrites w1's bytes (rows reversed) after w1 left."""
    n = 32 * 1024
    layer = nn.Module()
    layer.flat = torch.ones(2 * n)
    layer.w1 = nn.Parameter(layer.flat[:n], requires_grad=False)
    layer.w2 = nn.Parameter(layer.flat[n:], requires_grad=False)
    contract = _capture(layer, lambda: torch.cat([layer.flat, layer.w1, layer.w2]).sum())
    flat = layer.flat

    def pwal() -> None:
        layer.w1 = nn.Parameter(layer.w1 * 2, requires_grad=False)
        rows = layer.flat[:n].view(-1, 1024)
        rows.copy_(rows.flip(1))

    loaded = torch.arange(2.0 * n) + 100
    _reload(contract, layer, lambda: layer.flat.copy_(loaded), pwal)
    expected = loaded.clone()
    expected[:n] = expected[:n].view(-1, 1024).flip(1).reshape(-1)
    assert torch.equal(flat, expected), "graphsafe wrote w1's values over the bytes PWAL wrote through flat"
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED


# -- 3. rule A keeps only the latest departure: a write while away is forgotten if the tensor comes back and leaves --


class _Returning(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        _SPARES["a"] = nn.Parameter(torch.zeros(4), requires_grad=False)
        _SPARES["b"] = nn.Parameter(torch.zeros(4), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        old = self.weight
        self.weight = _SPARES["a"]  # the captured parameter leaves ...
        old.copy_(torch.full((4,), 7.0))  # ... the table's holder writes it (no loader writes after this)
        self.weight = old  # it comes back ...
        self.weight = _SPARES["b"]  # ... and leaves again, into the table
        _SPARES["b"] = old
        self.weight.copy_(torch.arange(4.0) + 9)


def test_a_parameter_written_while_away_then_returned_and_left_again_is_never_written() -> None:
    layer = _Returning()
    contract = _capture(layer, lambda: layer.weight.sum())
    captured = layer.weight
    with torch.no_grad():
        _reload(contract, layer, lambda: layer.weight.copy_(torch.arange(4.0) + 5), layer.process_weights_after_loading)
    assert _SPARES["b"] is captured
    assert torch.equal(captured, torch.full((4,), 7.0)), f"graphsafe wrote {captured.tolist()} over the holder's 7s"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


# -- 4. a wrapper subclass held outside the model is never checked: _written_since_left skips which is not None -----


def test_a_wrapper_parameter_pingpong_written_after_it_left_is_never_written() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    layer = nn.Module()
    layer.weight = nn.Parameter(TwoTensor(torch.ones(4), torch.ones(4)), requires_grad=False)
    _SPARES["w"] = nn.Parameter(TwoTensor(torch.zeros(4), torch.zeros(4)), requires_grad=False)
    contract = _capture(layer, lambda: layer.weight.sum())
    captured = layer.weight

    def pwal() -> None:
        old = layer.weight
        layer.weight = _SPARES["w"]
        _SPARES["w"] = old
        layer.weight.copy_(old * 2)
        old.a.copy_(torch.full((4,), 7.0))  # the holder writes the old wrapper's inner tensor, in place
        old.b.copy_(torch.full((4,), 7.0))

    loaded = torch.arange(4.0) + 5
    _reload(contract, layer, lambda: layer.weight.copy_(TwoTensor(loaded, loaded.clone())), pwal)
    assert _SPARES["w"] is captured
    assert torch.equal(captured.a, torch.full((4,), 7.0)), f"graphsafe wrote {captured.a.tolist()} into the spare"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed
