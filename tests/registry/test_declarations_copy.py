"""Declarations follow a layer through ``copy.deepcopy``: the copy declares the same slots, its stable storage is
the copy's own tensor, and each side's declarations change independently. Pickling a declared model needs no
graphsafe to unpickle (the declarations are not pickled)."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

from graphsafe import GraphContract, register_derived, stable_empty
from graphsafe.outcome import Origin
from graphsafe.registry import declarations_of, undeclare


def _declared() -> nn.Sequential:
    layer = nn.Linear(4, 4)
    layer.w_t = layer.weight.detach().t().contiguous()
    register_derived(layer, "w_t", derived_from="weight")
    layer.scratch = stable_empty(layer, "scratch", (8,), torch.float32, "cpu")
    return nn.Sequential(layer)


def test_a_deep_copy_declares_the_same_slots() -> None:
    model = _declared()
    twin = copy.deepcopy(model)
    assert dict(declarations_of(twin[0])) == dict(declarations_of(model[0]))
    origins = {s.path: s.origin for s in GraphContract(twin, "strict").seal().slots()}
    assert origins["w_t"] is Origin.DECLARED and origins["scratch"] is Origin.DECLARED


def test_the_copy_has_its_own_stable_storage_and_declarations() -> None:
    model = _declared()
    twin = copy.deepcopy(model)
    again = stable_empty(twin[0], "scratch", (8,), torch.float32, "cpu")
    assert again is twin[0].scratch and again.untyped_storage() is not model[0].scratch.untyped_storage()
    assert undeclare(twin[0], "w_t")
    assert "w_t" in declarations_of(model[0]) and "w_t" not in declarations_of(twin[0])


def test_a_declared_model_pickles_without_its_declarations() -> None:
    buffer = io.BytesIO()
    torch.save(_declared(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded[0].w_t, torch.Tensor) and dict(declarations_of(loaded[0])) == {}
    assert pickle.loads(pickle.dumps(_declared()))[0].scratch.shape == (8,)
