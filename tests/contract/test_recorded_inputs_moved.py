"""What a layerwise recording learns each slot is computed from, where the tensor it reads moved or was bound
between two steps outside the layers those steps read (``_recording.InputIndex``): made before the reload, on
another thread, or moved from a path the index saw; and the recording's place on the dispatch-mode stack when the
caller's own modes come and go around it.

Oracle: what the PWAL below reads by construction, and a cold model's values (weight * scale)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from contract.test_recorded_inputs_layerwise import _Layer, _layerwise, _status
from graphsafe import GraphContract, ReloadFailedError, SlotRef, Status


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(1), _Layer(2), _Layer(3)])
        self.holder = nn.Module()
        self.holder.scale = torch.full((8,), 2.0)
        self.holder2 = nn.Module()
        self.holder2.other = torch.full((8,), 7.0)
        for layer in self.layers:
            layer.pwal(self.holder.scale)


@pytest.fixture(autouse=True)
def _clean_mode_stack():
    """Each test starts and ends with an empty dispatch-mode stack (stray modes of a failed test popped)."""
    from torch.utils._python_dispatch import _pop_mode

    while _get_current_dispatch_mode_stack():
        _pop_mode()
    yield
    while _get_current_dispatch_mode_stack():
        _pop_mode()


def _later_scale_change_skipped(contract, model, scale: torch.Tensor) -> None:
    """A later reload changes only ``scale`` in place; the last layer's PWAL skips its rebuild. Committed means
    layers.2.d must equal weight * new scale (cold formula)."""
    last = model.layers[2]
    weight = last.weight.detach().clone()
    last.skip = True
    try:
        with contract.reload(), torch.no_grad():
            scale.fill_(5.0)
            for layer in model.layers[:2]:
                layer.pwal(scale)
    except ReloadFailedError:
        pass
    if _status(contract) is Status.COMMITTED:
        assert torch.equal(last.d, weight * 5.0), "COMMITTED while layers.2.d keeps values of the old scale"


# -- 1. a tensor made BEFORE begin(), bound to a non-layer module between two steps --------------------------------
def test_premade_tensor_bound_between_steps_is_learnt() -> None:
    model = _Model()
    model.scale_of = lambda: model.holder.scale
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    premade = torch.full((8,), 2.0)  # made before begin(): not "made during the recording"

    def between(i):
        if i == 0:
            model.holder.scale = premade

    assert _layerwise(contract, model, 5, between) is Status.COMMITTED
    learnt = contract.recorded_inputs()
    for i in (1, 2):
        assert set(learnt[SlotRef(f"layers.{i}", "d")]) == {
            SlotRef(f"layers.{i}", "weight"),
            SlotRef("holder", "scale"),
        }, learnt


def test_premade_tensor_bound_between_steps_then_skipped_rebuild_not_committed() -> None:
    model = _Model()
    model.scale_of = lambda: model.holder.scale
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    premade = torch.full((8,), 2.0)

    def between(i):
        if i == 0:
            model.holder.scale = premade

    assert _layerwise(contract, model, 5, between) is Status.COMMITTED
    _later_scale_change_skipped(contract, model, model.holder.scale)


# -- 2. a tensor made on ANOTHER THREAD during the reload, bound between steps --------------------------------------
def test_tensor_made_on_other_thread_bound_between_steps_then_skipped_rebuild_not_committed() -> None:
    model = _Model()
    model.scale_of = lambda: model.holder.scale
    contract = GraphContract(model, "recapture", detect="declared-only").seal()

    def between(i):
        if i == 0:
            box = []
            t = threading.Thread(target=lambda: box.append(torch.full((8,), 2.0)))
            t.start()
            t.join()
            model.holder.scale = box[0]

    assert _layerwise(contract, model, 5, between) is Status.COMMITTED
    learnt = contract.recorded_inputs()
    inputs_ok = SlotRef("holder", "scale") in set(learnt[SlotRef("layers.2", "d")])
    _later_scale_change_skipped(contract, model, model.holder.scale)
    assert inputs_ok, learnt


# -- 3. a pre-existing indexed tensor MOVED to another module's path between steps (stale index entry) --------------
def test_tensor_moved_to_another_path_between_steps_learns_the_live_path() -> None:
    """Layer 0 reads holder3.c; layers 1 and 2 read holder2.other, which after step 0 is the OLD holder.scale tensor
    (indexed at step 0 under holder.scale) while holder.scale gets another tensor. Nothing layer 0 read changes."""
    model = _Model()
    model.holder3 = nn.Module()
    model.holder3.c = torch.full((8,), 2.0)
    step = [0]
    model.scale_of = lambda: model.holder3.c if step[0] == 0 else model.holder2.other
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    replacement = torch.full((8,), 3.0)

    def between(i):
        if i == 0:
            step[0] = 1
            model.holder2.other = model.holder.scale
            model.holder.scale = replacement

    assert _layerwise(contract, model, 5, between) is Status.COMMITTED
    learnt = contract.recorded_inputs()
    inputs_ok = set(learnt[SlotRef("layers.2", "d")]) == {SlotRef("layers.2", "weight"), SlotRef("holder2", "other")}
    _later_scale_change_skipped(contract, model, model.holder2.other)
    assert inputs_ok, learnt


# -- 4. a layer's own plain attribute indexed at step 0, rebound in its own window; the old tensor moved to a holder
class _AuxLayer(_Layer):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.aux = torch.full((8,), 1.0)  # a plain tensor attribute (not declared)


def test_layer_attribute_rebound_in_its_window_old_entry_not_learnt() -> None:
    """layers.1.aux (indexed at step 0) moves to holder2.other in layers.1's own window, aux gets a new tensor; layers 1
    and 2 read holder2.other, layer 0 reads holder3.c."""
    model = _Model()
    model.layers = nn.ModuleList([_AuxLayer(1), _AuxLayer(2), _AuxLayer(3)])
    for layer in model.layers:
        layer.pwal(model.holder.scale)
    model.holder3 = nn.Module()
    model.holder3.c = torch.full((8,), 2.0)
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    g = torch.Generator().manual_seed(5)
    try:
        with contract.reload(layerwise=True) as txn, torch.no_grad():
            for index, layer in enumerate(model.layers):
                txn.before_layer(layer)
                layer.weight.copy_(torch.randn(8, generator=g))
                if index == 1:  # in layers.1's own window: its aux moves to holder2.other, aux gets a new tensor
                    model.holder2.other = layer.aux
                    layer.aux = torch.zeros(8)
                layer.pwal(model.holder3.c if index == 0 else model.holder2.other)
                txn.after_layer(layer)
    except ReloadFailedError:
        pass
    assert _status(contract) is Status.COMMITTED, contract.last_outcome.findings
    learnt = contract.recorded_inputs()
    inputs_ok = set(learnt[SlotRef("layers.2", "d")]) == {SlotRef("layers.2", "weight"), SlotRef("holder2", "other")}
    _later_scale_change_skipped(contract, model, model.holder2.other)
    assert inputs_ok, learnt


# -- 5. dispatch modes ---------------------------------------------------------------------------------------------
class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _plain_model_and_contract():
    model = _Model()
    model.scale_of = lambda: model.holder.scale
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    return model, contract


def test_a_user_mode_left_open_over_the_recording_leaves_it_inert_until_the_next_reload() -> None:
    """A mode entered inside PWAL and left open sits above the recording when the reload ends: the recording cannot
    leave the stack from under it, so it stays there inert (every op passes through) until the next reload on this
    thread pops it; what it saw still counts."""
    model, contract = _plain_model_and_contract()
    before = list(_get_current_dispatch_mode_stack())
    user = _Counting()

    def between(i):
        if i == 0:
            user.__enter__()

    status = _layerwise(contract, model, 5, between)
    user.__exit__(None, None, None)
    assert status is Status.COMMITTED
    learnt = contract.recorded_inputs()
    assert SlotRef("holder", "scale") in set(learnt[SlotRef("layers.2", "d")]), learnt
    left = [mode for mode in _get_current_dispatch_mode_stack() if mode not in before]
    assert all(getattr(mode, "paused", False) for mode in left), left
    _layerwise(contract, model, 6, lambda i: None)
    assert list(_get_current_dispatch_mode_stack()) == before


def test_user_mode_outside_whole_reload_sees_contract_ops_and_stack_restored() -> None:
    model, contract = _plain_model_and_contract()
    before = list(_get_current_dispatch_mode_stack())
    with _Counting():
        status = _layerwise(contract, model, 5, lambda i: None)
        inner = list(_get_current_dispatch_mode_stack())
    assert list(_get_current_dispatch_mode_stack()) == before
    assert status is Status.COMMITTED
    assert len(inner) == len(before) + 1, inner


def test_reload_finished_on_another_thread_leaves_no_mode_and_learns() -> None:
    model, contract = _plain_model_and_contract()
    before = list(_get_current_dispatch_mode_stack())
    g = torch.Generator().manual_seed(5)
    txn = contract.reload(layerwise=True).__enter__()
    errors = []
    with torch.no_grad():
        for layer in model.layers[:2]:
            txn.before_layer(layer)
            layer.weight.copy_(torch.randn(8, generator=g))
            layer.pwal(model.holder.scale)
            txn.after_layer(layer)

    def rest():
        try:
            with torch.no_grad():
                layer = model.layers[2]
                txn.before_layer(layer)
                layer.weight.copy_(torch.randn(8, generator=g))
                layer.pwal(model.holder.scale)
                txn.after_layer(layer)
                txn.__exit__(None, None, None)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=rest)
    t.start()
    t.join()
    # the next reload on this thread drops an abandoned recording
    _layerwise(contract, model, 6, lambda i: None)
    stack = list(_get_current_dispatch_mode_stack())
    assert stack == before, f"stray modes: {stack}; errors {errors}"
    assert not errors or isinstance(errors[0], ReloadFailedError), errors
    for i in range(3):  # cold formula after the second reload
        assert torch.equal(model.layers[i].d, model.layers[i].weight * model.holder.scale)
