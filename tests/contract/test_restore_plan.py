"""The compiled restore plan: accessors agree with SlotPath, copies land grouped, the walker can skip known paths.

The accessors are shortcuts for the per-reload hot loop; each test runs the shortcut and the registry's own
``resolve_or``/``assign`` on twin structures and demands the same result (or the same error).
"""

from __future__ import annotations

import functools
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe.collectors import walk
from graphsafe.contract._access import submodule_is
from graphsafe.contract._copy import FOREACH_MAX_BYTES, CopyBatch, copy_group
from graphsafe.errors import PathError
from graphsafe.paths import MISSING, SlotPath, compile_getter, compile_setter

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

Pair = namedtuple("Pair", "a b")


@dataclass(frozen=True)
class Frozen:
    t: torch.Tensor


class Holder:
    def __init__(self) -> None:
        self.t = torch.zeros(2)


class ReadOnly:
    def __init__(self) -> None:
        self._t = torch.zeros(2)

    @property
    def t(self) -> torch.Tensor:  # no setter: assign must fail, the same way through both routes
        return self._t


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.register_buffer("buf", torch.zeros(2))
        self.child = nn.Linear(2, 2)
        self.ws = torch.zeros(2)
        self.holder = Holder()
        self.table: dict[Any, Any] = {"x": torch.zeros(2), 3: torch.zeros(2)}
        self.items = [torch.zeros(2), torch.zeros(2)]
        self.pair = Pair(torch.zeros(2), torch.zeros(2))
        self.tup = (torch.zeros(2), (torch.zeros(2),))
        self.part = functools.partial(max, torch.zeros(2), key=torch.zeros(2))
        self.frozen = Frozen(torch.zeros(2))
        self.ro = ReadOnly()
        captured = torch.zeros(2)
        self.fn = lambda: captured


PATHS = [
    "ws",
    "weight",
    "buf",
    "child",
    "child.weight",
    "holder.t",
    "table['x']",
    "table[3]",
    "items[0]",
    "items[-1]",
    "items[5]",
    "pair.a",
    "pair[1]",
    "tup[0]",
    "tup[1][0]",
    "part.args[0]",
    "part.keywords['key']",
    "frozen.t",
    "ro.t",
    "fn.__closure__[0]",
    "fn.__closure__[4]",
    "missing",
    "holder.missing",
    "table['missing']",
    "table['x'].nope",
]


@pytest.mark.parametrize("path", PATHS)
def test_compiled_getter_resolves_like_slot_path(path: str) -> None:
    layer = Layer()
    slot = SlotPath(path)
    expected = slot.resolve_or(layer, MISSING)
    got = compile_getter(slot)(layer)
    assert got is expected, f"{path}: compiled getter gave {got!r}, SlotPath gave {expected!r}"


def _state(layer: Layer, path: str) -> Any:
    """What a later resolve sees, plus where torch's Module bookkeeping put the value."""
    value = SlotPath(path).resolve_or(layer, MISSING)
    return value, sorted(layer._parameters), sorted(layer._buffers), "ws" in vars(layer)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value_kind", ["tensor", "parameter", "buffer-flagged"])
def test_compiled_setter_assigns_like_slot_path(path: str, value_kind: str) -> None:
    value: torch.Tensor = torch.ones(2)
    if value_kind == "parameter":
        value = nn.Parameter(value, requires_grad=False)
    elif value_kind == "buffer-flagged":
        value._is_buffer = True  # type: ignore[attr-defined]  # nn.Buffer's instance check accepts this
    reference, compiled = Layer(), Layer()
    slot = SlotPath(path)
    expected_error: str | None = None
    try:
        slot.assign(reference, value)
    except Exception as exc:  # the registry's failure is the contract's: the shortcut must fail the same way
        expected_error = f"{type(exc).__name__}: {exc}"
    try:
        compile_setter(slot)(compiled, value)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    assert error == expected_error
    if expected_error is None:
        assert _state(compiled, path) == _state(reference, path)
        assert SlotPath(path).resolve(compiled) is value


def test_module_fast_path_refuses_a_parameter_name() -> None:
    # A plain tensor put where a Parameter lives must raise as nn.Module.__setattr__ does, not shadow it.
    layer = Layer()
    with pytest.raises(PathError, match="cannot assign"):
        compile_setter(SlotPath("weight"))(layer, torch.ones(2))
    assert isinstance(layer.weight, nn.Parameter)
    assert "weight" not in vars(layer)


def test_module_fast_path_keeps_a_custom_setattr() -> None:
    seen: list[str] = []

    class Watching(nn.Module):
        def __setattr__(self, name: str, value: Any) -> None:
            seen.append(name)
            super().__setattr__(name, value)

    layer = Watching()
    layer.ws = torch.zeros(2)
    seen.clear()
    compile_setter(SlotPath("ws"))(layer, torch.ones(2))
    assert seen == ["ws"]  # the override ran: no shortcut around user code


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))])


def test_submodule_is_agrees_with_get_submodule() -> None:
    model = Model()
    for name, module in model.named_modules():
        if name:
            assert submodule_is(model, tuple(name.split(".")), module) is True
    other = nn.Linear(2, 2)
    assert submodule_is(model, ("layers", "0"), other) is False
    model.layers[0] = other  # replaced: the old layer is no longer in the model
    assert submodule_is(model, ("layers", "0"), other) is True


def test_submodule_is_unsure_when_something_shadows_the_child() -> None:
    model = Model()
    sub = model.layers
    object.__setattr__(model, "layers", nn.Linear(2, 2))  # an instance attribute hides _modules['layers']
    assert submodule_is(model, ("layers",), sub) is None
    assert model.get_submodule("layers") is not sub


def test_copy_batch_groups_by_dtype_and_size_and_counts_bytes() -> None:
    big = FOREACH_MAX_BYTES // 4 + 1  # float32 elements: just over the foreach limit
    dsts = [torch.zeros(3), torch.zeros(5, dtype=torch.int64), torch.zeros(big), torch.zeros(2, dtype=torch.bfloat16)]
    srcs = [torch.arange(3.0), torch.arange(5), torch.full((big,), 7.0), torch.ones(2, dtype=torch.bfloat16)]
    batch = CopyBatch()
    for d, s in zip(dsts, srcs, strict=True):
        batch.add(d, s, copy_group(d), d.numel() * d.element_size())
    assert batch.pending == 3
    # A large copy starts at once (the device copies while the host plans); small ones wait for the flush.
    assert [torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True)] == [False, False, True, False]
    batch.flush()
    assert batch.pending == 0
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    assert batch.written == sum(d.numel() * d.element_size() for d in dsts)


def test_walker_skip_paths_only_drops_the_named_refs() -> None:
    layer = nn.Linear(2, 2)
    shared = torch.zeros(3)
    layer.ws = shared
    layer.cache = {"ws": shared, "other": torch.zeros(1)}  # type: ignore[assignment]
    full = walk(layer)
    skipped = walk(layer, skip_paths=frozenset({"ws", "cache['other']"}))
    assert {r.path for r in full.refs} == {"ws", "cache['ws']", "cache['other']"}
    assert [r.path for r in skipped.refs] == ["cache['ws']"]  # the alias of a skipped path is still reported
    assert skipped.refs[0].tensor is shared
    assert skipped.objects_visited == full.objects_visited


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.sampled_from([0, 1, 2, 5, 17]), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.int8, torch.bfloat16, torch.int64]),
    transposed=st.booleans(),
    offset=st.booleans(),
)
def test_the_sealed_span_is_the_span_of_the_tensor_as_sealed(
    shape: list[int], dtype: torch.dtype, transposed: bool, offset: bool
) -> None:
    """The restore plan uses the span computed at seal for a captured tensor still laid out as sealed: it must be
    the bytes the tensor spans (the overlap checks that order copies rely on it)."""
    from graphsafe.contract._copy import byte_span
    from graphsafe.contract._slots import SealedSlot
    from graphsafe.contract._tensorref import TensorRef
    from graphsafe.outcome import Origin, fingerprint
    from graphsafe.paths import SlotPath

    tensor = torch.zeros(*shape, dtype=dtype) if shape else torch.zeros((), dtype=dtype)
    if transposed and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    if offset and tensor.dim() and tensor.shape[0] > 1:
        tensor = tensor[1:]
    slot = SealedSlot(SlotPath("t"), fingerprint(tensor), TensorRef.of(tensor), Origin.DECLARED)
    # The oracle: each element's own place in the storage, read off a tensor of element indices laid out alike.
    if tensor.numel() == 0:
        expected = (0, 0)
    else:
        where = torch.arange(tensor.untyped_storage().nbytes() // tensor.element_size())
        where = where.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        size = tensor.element_size()
        expected = (int(where.min()) * size, (int(where.max()) + 1) * size)
    assert slot.span == byte_span(tensor) == expected
