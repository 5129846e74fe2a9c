"""The walker: every device tensor reachable from a layer, under every simple path, without running user code."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import io
import math
import types
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe.collectors.walker import TensorRef, WalkResult, collect, walk
from graphsafe.collectors.walker._readers import MODULE_INTERNALS
from graphsafe.devices import WalkBudget
from graphsafe.errors import PathError
from graphsafe.paths import SlotPath, format_path, parse_path

CALLS: Counter[str] = Counter()  # every trap below counts here; the walker must leave it at zero


# ----------------------------------------------------------------------------------------------------------------
# Helpers and fixtures


def paths(result: WalkResult | list[TensorRef]) -> list[str]:
    refs = result.refs if isinstance(result, WalkResult) else result
    return [ref.path for ref in refs]


def by_path(result: WalkResult) -> dict[str, TensorRef]:
    return {ref.path: ref for ref in result.refs}


def check_refs(layer: nn.Module, result: WalkResult) -> None:
    """Every ref's path is canonical, resolves to exactly its tensor, and its fingerprint is that tensor's."""
    assert len(set(paths(result))) == len(result.refs), "a path is reported twice"
    for ref in result.refs:
        assert SlotPath(ref.path).text == ref.path
        assert SlotPath(ref.path).resolve(layer) is ref.tensor, ref.path
        assert ref.fingerprint.data_ptr == ref.tensor.data_ptr()
        assert ref.fingerprint.shape == tuple(ref.tensor.shape)
        assert ref.restorable == (ref.reason is None)


class Layer(nn.Module):
    """A CPU layer with a parameter and a buffer, so the default devices are {cpu}."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("scale", torch.ones(1))


class Obj:
    """A plain object; attributes go into its __dict__."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class Slotted:
    __slots__ = ("s0", "s1", "s2", "s3")


class SlottedChild(Slotted):
    __slots__ = ("__dict__", "extra")


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenCfg:
    scale: torch.Tensor
    name: str = "cfg"


class Scales(NamedTuple):
    a: Any
    b: Any
    c: Any


LegacyNT = collections.namedtuple("LegacyNT", "x y")


class Color(enum.Enum):
    RED = 1


def make_closure(values: list[Any]) -> types.FunctionType:
    """A function whose closure cells hold ``values`` (cell i holds values[i])."""
    names = [f"v{i}" for i in range(len(values))]
    src = "def outer():\n"
    src += "".join(f"    {name} = None\n" for name in names)
    src += "    def inner():\n        return (" + "".join(f"{name}, " for name in names) + ")\n    return inner\n"
    scope: dict[str, Any] = {}
    exec(src, scope)
    code = scope["outer"]().__code__
    cells = tuple(types.CellType(v) for v in values)
    assert len(code.co_freevars) == len(cells)
    return types.FunctionType(code, {}, "inner", None, cells or None)


# ----------------------------------------------------------------------------------------------------------------
# Traps: anything the walker must never call.


class CountingMeta(type):
    def __hash__(cls) -> int:
        CALLS["meta.__hash__"] += 1
        return type.__hash__(cls)

    def __eq__(cls, other: object) -> bool:
        CALLS["meta.__eq__"] += 1
        return type.__eq__(cls, other)  # type: ignore[no-any-return]

    def __instancecheck__(cls, instance: Any) -> bool:
        CALLS["meta.__instancecheck__"] += 1
        return type.__instancecheck__(cls, instance)


class Trap(metaclass=CountingMeta):
    """Attributes in __dict__, plus every hook the walker must not run."""

    @property
    def planted(self) -> torch.Tensor:
        CALLS["property"] += 1
        return torch.zeros(1)

    def __getattr__(self, name: str) -> Any:
        CALLS["__getattr__"] += 1
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        CALLS["__eq__"] += 1
        return self is other

    def __hash__(self) -> int:
        CALLS["__hash__"] += 1
        return id(self)

    def __len__(self) -> int:
        CALLS["__len__"] += 1
        return 0

    def __iter__(self) -> Any:
        CALLS["__iter__"] += 1
        return iter(())

    def __bool__(self) -> bool:
        CALLS["__bool__"] += 1
        return True


class SlotTrap:
    __slots__ = ("w", "x")

    @property
    def planted(self) -> torch.Tensor:
        CALLS["slot property"] += 1
        return torch.zeros(1)

    def __getattr__(self, name: str) -> Any:
        CALLS["slot __getattr__"] += 1
        raise AttributeError(name)


class TrapDict(dict[Any, Any]):
    def __iter__(self) -> Any:
        CALLS["dict.__iter__"] += 1
        return super().__iter__()

    def __len__(self) -> int:
        CALLS["dict.__len__"] += 1
        return super().__len__()

    def items(self) -> Any:
        CALLS["dict.items"] += 1
        return super().items()

    def keys(self) -> Any:
        CALLS["dict.keys"] += 1
        return super().keys()

    def values(self) -> Any:
        CALLS["dict.values"] += 1
        return super().values()

    def __eq__(self, other: object) -> bool:
        CALLS["dict.__eq__"] += 1
        return dict.__eq__(self, other)  # type: ignore[no-any-return]

    __hash__ = None  # type: ignore[assignment]


class TrapList(list[Any]):
    def __iter__(self) -> Any:
        CALLS["list.__iter__"] += 1
        return super().__iter__()

    def __len__(self) -> int:
        CALLS["list.__len__"] += 1
        return super().__len__()


class DictProperty:
    """Defines ``__dict__`` as a property: reading it would run user code."""

    @property  # type: ignore[misc]
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        CALLS["__dict__ property"] += 1
        return {}


class TracedTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        CALLS["__torch_function__"] += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture(autouse=True)
def _reset_calls() -> None:
    CALLS.clear()


# ----------------------------------------------------------------------------------------------------------------
# Which attributes of the layer are walked


def test_underscore_prefixed_attributes_are_found() -> None:
    layer = Layer()
    layer._fc2_input_scale = torch.ones(1)
    layer._permute_scratch = torch.empty(8)
    layer.w_t = layer.weight.detach().t()
    result = walk(layer)
    assert paths(result) == ["_fc2_input_scale", "_permute_scratch", "w_t"]
    check_refs(layer, result)
    assert result.exhausted is None


def test_parameters_and_buffers_are_not_reported_but_plain_tensor_attributes_are() -> None:
    layer = Layer()
    assert walk(layer).refs == ()
    layer.w_data = layer.weight.data  # a plain tensor sharing the parameter's storage
    result = walk(layer)
    assert paths(result) == ["w_data"]
    assert type(result.refs[0].tensor) is torch.Tensor


def test_parameter_held_outside_parameters_is_reported() -> None:
    layer = Layer()
    layer.quant_method = Obj(weight=layer.weight, bias=layer.scale)
    result = walk(layer)
    assert paths(result) == ["quant_method.weight", "quant_method.bias"]
    assert result.refs[0].tensor is layer.weight
    check_refs(layer, result)


def test_module_internals_come_from_a_bare_module() -> None:
    assert set(nn.Module().__dict__) <= MODULE_INTERNALS
    for name in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_state_dict_pre_hooks", "training"):
        assert name in MODULE_INTERNALS
    assert "_fc2_input_scale" not in MODULE_INTERNALS


def test_module_internals_and_hooks_but_forward_hooks_are_not_walked() -> None:
    # Forward (pre-)hooks run inside the captured region, so what they hold is walked.
    layer = Layer()
    hidden = torch.ones(3)
    post = layer.register_forward_hook(lambda *_: hidden.sum())
    pre = layer.register_forward_pre_hook(lambda *_: hidden.sum())
    layer.register_full_backward_hook(lambda *_: hidden.sum())
    layer.register_state_dict_pre_hook(lambda *_: hidden.sum())
    layer.register_load_state_dict_post_hook(lambda *_: hidden.sum())
    layer.register_buffer("nonpersistent", torch.ones(2), persistent=False)
    result = walk(layer)
    assert sorted(paths(result)) == [
        f"_forward_hooks[{post.id}].__closure__[0]",
        f"_forward_pre_hooks[{pre.id}].__closure__[0]",
    ]
    check_refs(layer, result)
    # The layer, the two forward hook dicts and their two hooks; no other hook dict was entered.
    assert result.objects_visited == 5
    # Without forward hooks the hook dicts are not even entered.
    post.remove()
    pre.remove()
    assert walk(layer).objects_visited == 1


# ----------------------------------------------------------------------------------------------------------------
# What is recursed into


def test_dict_and_slots_objects_dataclasses_and_namespaces() -> None:
    layer = Layer()
    slotted = SlottedChild()
    slotted.s0 = torch.ones(1)
    slotted.s2 = torch.ones(2)  # s1 and s3 stay unset
    slotted.extra = torch.ones(3)
    slotted.in_dict = torch.ones(4)
    layer.kernel = Obj(slots=slotted, frozen=FrozenCfg(torch.ones(5)), ns=types.SimpleNamespace(t=torch.ones(6)))
    result = walk(layer)
    assert sorted(paths(result)) == sorted(
        [
            "kernel.slots.in_dict",
            "kernel.slots.extra",
            "kernel.slots.s0",
            "kernel.slots.s2",
            "kernel.frozen.scale",
            "kernel.ns.t",
        ]
    )
    check_refs(layer, result)
    assert all(ref.restorable for ref in result.refs)


def test_dict_keys_the_grammar_writes_produce_paths_other_keys_do_not() -> None:
    # Bool and tuple keys of plain scalars are path keys now (``ws[(8, torch.float32)]``).
    layer = Layer()
    layer.table = {
        "plain": torch.ones(2),
        "it's \\ odd": torch.ones(3),
        7: torch.ones(4),
        -1: torch.ones(5),
        True: torch.ones(1),
        ("a", 1): torch.ones(6),
        (8, torch.float32): torch.ones(8),
        Color.RED: torch.ones(7),
        (Color.RED, 1): torch.ones(9),
    }
    result = walk(layer)
    assert paths(result) == [
        "table['plain']",
        "table['it\\'s \\\\ odd']",
        "table[7]",
        "table[-1]",
        "table[True]",
        "table[('a', 1)]",
        "table[(8, torch.float32)]",
    ]
    check_refs(layer, result)
    assert any("Color dict key" in note for note in result.notes)
    assert any("tuple dict key" in note for note in result.notes)  # a tuple holding an enum is no path key


def test_lists_tuples_and_namedtuples() -> None:
    layer = Layer()
    layer.strides = [torch.ones(1), (torch.ones(2), [torch.ones(3)])]
    layer.scales = Scales(torch.ones(4), None, (torch.ones(5),))
    layer.legacy = LegacyNT(1, torch.ones(6))
    layer.queue = collections.deque([torch.ones(7)])
    result = walk(layer)
    assert paths(result) == [
        "strides[0]",
        "strides[1][0]",
        "strides[1][1][0]",
        "scales.a",
        "scales.c[0]",
        "legacy.y",
        "queue[0]",
    ]
    check_refs(layer, result)
    assert all(ref.restorable for ref in result.refs)


def test_partials_closures_and_function_defaults() -> None:
    layer = Layer()
    perm = torch.arange(4)
    ws = torch.empty(8)
    kernel = make_closure([ws, 3])
    layer.act_fn = functools.partial(kernel, torch.ones(2), perm=perm)
    layer.closure = make_closure([None, perm])

    def with_defaults(x: Any, scratch: torch.Tensor = ws, *, bias: torch.Tensor = perm) -> Any:
        return x

    layer.with_defaults = with_defaults
    result = walk(layer)
    assert paths(result) == [
        "act_fn.func.__closure__[0]",
        "act_fn.args[0]",
        "act_fn.keywords['perm']",
        "closure.__closure__[1]",
        "with_defaults.__defaults__[0]",
        "with_defaults.__kwdefaults__['bias']",
    ]
    check_refs(layer, result)
    assert all(ref.restorable for ref in result.refs)


def test_empty_closure_cells_are_skipped() -> None:
    fn = make_closure([torch.ones(1), torch.ones(2)])
    assert fn.__closure__ is not None
    del fn.__closure__[0].cell_contents  # an empty cell, as a not-yet-assigned free variable leaves it
    layer = Layer()
    layer.fn = fn
    assert paths(walk(layer)) == ["fn.__closure__[1]"]


def test_bound_methods_walk_func_and_self_but_never_a_module_self() -> None:
    class Kernel:
        def __init__(self) -> None:
            self.ws = torch.ones(3)

        def run(self) -> Any:
            return self.ws

    layer = Layer()
    kernel = Kernel()
    captured = torch.ones(2)
    layer.run = kernel.run
    layer.closure_method = types.MethodType(make_closure([captured]), kernel)
    layer.on_layer = types.MethodType(make_closure([captured]), layer)
    layer.on_child = nn.Linear(2, 2).forward
    result = walk(layer)
    assert paths(result) == [
        "run.__self__.ws",
        "closure_method.__func__.__closure__[0]",
        "closure_method.__self__.ws",
        "on_layer.__func__.__closure__[0]",
    ]
    check_refs(layer, result)
    assert all(ref.restorable for ref in result.refs)  # the cell and the attribute are written in place


def test_child_modules_are_never_entered() -> None:
    layer = Layer()
    child = nn.Linear(2, 2)
    child.derived = torch.ones(3)
    child.holder = Obj(t=torch.ones(4))
    layer.child = child
    layer.in_list = [child, nn.ReLU()]
    layer.in_dict = {"m": child}
    layer.in_closure = make_closure([child])
    layer.in_partial = functools.partial(print, child)
    layer.raw = object.__new__(nn.Module)  # even a half-built module is a module
    result = walk(layer)
    assert result.refs == ()
    assert result.exhausted is None


def test_leaf_types_are_never_entered() -> None:
    class Holder:
        planted = torch.ones(1)

    holder = Obj(t=torch.ones(3))
    t_gen = torch.ones(4)
    layer = Layer()
    layer.dtype = torch.float16
    layer.device = torch.device("cpu")
    layer.size = torch.Size([1, 2])
    layer.file = io.BytesIO(b"x")
    layer.text = "tensor"
    layer.generator = torch.Generator()
    result = walk(layer)
    assert result.refs == ()
    assert result.objects_visited == 1
    # A generator's frame and a weak proxy's referent are no leaves: what they hold is untrackable (no path names it).
    layer.gen = (t_gen for _ in range(1))
    layer.proxy = weakref.proxy(holder)
    result = walk(layer)
    assert result.refs == ()
    assert [note.split(":")[0] for note in result.notes] == ["gen", "proxy"]
    # A class held as a value is no leaf either (a kernel class with class-level state): its class
    # attributes are read, never restorable; an enum member of a user enum is read for what hangs on it.
    del layer.gen, layer.proxy
    layer.cls = Holder
    layer.color = Color.RED
    result = walk(layer)
    assert [(ref.path, ref.restorable) for ref in result.refs] == [("cls.planted", False)]
    assert result.notes == ()
    # An enum member is read for what hangs on it only (not its class's member maps): one object, no deeper level.
    del layer.cls
    result = walk(layer, budget=WalkBudget(max_depth=1))
    assert result.objects_visited == 2 and result.exhausted is None
    # A Python module is no leaf: one made at run time (a kernel namespace) is read for its globals, restorable by
    # attribute; a library's (math) only for its direct device tensors, one object whatever its size.
    del layer.color
    module = types.ModuleType("fake")
    module.planted = torch.ones(2)  # type: ignore[attr-defined]
    layer.mod = module
    layer.lib = math
    result = walk(layer)
    assert [(ref.path, ref.restorable) for ref in result.refs] == [("mod.planted", True)]
    assert result.objects_visited == 3 and result.notes == ()
    check_refs(layer, result)


# ----------------------------------------------------------------------------------------------------------------
# Never runs user code


def test_no_user_code_runs() -> None:
    layer = Layer()
    trap = Trap()
    trap.t = torch.ones(1)
    slot_trap = SlotTrap()
    slot_trap.w = torch.ones(2)
    tdict = TrapDict(k=torch.ones(3), nested=trap)
    tlist = TrapList([torch.ones(4), slot_trap])
    traced = torch.ones(5).as_subclass(TracedTensor)
    layer.trap = trap
    layer.slot_trap = slot_trap
    layer.tdict = tdict
    layer.tlist = tlist
    layer.in_set = {trap, slot_trap}
    layer.frozen = frozenset([trap])
    layer.method = types.MethodType(make_closure([tdict]), trap)
    layer.traced = traced
    layer.dict_property = DictProperty()
    CALLS.clear()
    result = walk(layer)
    assert not CALLS, CALLS
    assert set(paths(result)) >= {
        "trap.t",
        "slot_trap.w",
        "tdict['k']",
        "tdict['nested'].t",
        "tlist[0]",
        "tlist[1].w",
        "method.__self__.t",
        "method.__func__.__closure__[0]['k']",
        "traced",
    }
    check_refs(layer, result)


def test_getattribute_override_is_reported_but_not_restorable() -> None:
    class Proxyish:
        def __getattribute__(self, name: str) -> Any:
            CALLS["__getattribute__"] += 1
            return object.__getattribute__(self, name)

    holder = Proxyish()
    object.__setattr__(holder, "t", torch.ones(1))
    layer = Layer()
    layer.holder = holder
    CALLS.clear()
    result = walk(layer)
    assert not CALLS
    (ref,) = result.refs
    assert ref.path == "holder.t"
    assert not ref.restorable
    assert ref.reason is not None and "__getattribute__" in ref.reason
    assert SlotPath(ref.path).resolve(layer) is ref.tensor


def test_attribute_shadowed_by_a_property_is_a_note_not_a_ref() -> None:
    layer = Layer()
    trap = Trap()
    trap.__dict__["planted"] = torch.ones(1)  # getattr(trap, "planted") would run the property instead
    layer.trap = trap
    result = walk(layer)
    assert result.refs == ()
    assert not CALLS
    assert any("'planted'" in note and "shadowed" in note for note in result.notes)


# ----------------------------------------------------------------------------------------------------------------
# Aliases, sharing, cycles


def test_a_tensor_is_reported_under_every_path() -> None:
    layer = Layer()
    strides = torch.zeros(4, dtype=torch.int64)
    layer.ab_strides1 = strides
    layer.c_strides2 = strides
    result = walk(layer)
    assert paths(result) == ["ab_strides1", "c_strides2"]
    assert result.refs[0].tensor is result.refs[1].tensor
    assert result.refs[0].fingerprint is result.refs[1].fingerprint  # fingerprinted once


def test_a_shared_container_is_read_once_but_its_tensors_get_every_path() -> None:
    layer = Layer()
    shared = {"ws": torch.ones(2)}
    layer.a = Obj(cfg=shared)
    layer.b = (shared,)
    result = walk(layer)
    assert paths(result) == ["a.cfg['ws']", "b[0]['ws']"]
    check_refs(layer, result)
    assert result.objects_visited == 4  # layer, a, the tuple, the shared dict


def test_cycles_terminate_and_report_simple_paths() -> None:
    layer = Layer()
    node = Obj(t=torch.ones(1))
    node.me = node
    loop: list[Any] = [torch.ones(2)]
    loop.append(loop)
    d: dict[str, Any] = {}
    d["self"] = d
    d["other"] = node
    node.back = d
    layer.node = node
    layer.loop = loop
    layer.d = d
    result = walk(layer)
    # node.back['other'] is node itself: not a simple path. From d, node is new, so d['other'].t is one.
    assert sorted(paths(result)) == sorted(["node.t", "loop[0]", "d['other'].t"])
    check_refs(layer, result)
    assert result.exhausted is None


# ----------------------------------------------------------------------------------------------------------------
# Devices


def test_default_devices_come_from_parameters_and_buffers() -> None:
    layer = Layer()
    layer.cpu = torch.ones(1)
    layer.meta = torch.empty(2, device="meta")
    assert paths(walk(layer)) == ["cpu"]
    assert paths(walk(layer, devices=["cpu"])) == ["cpu"]
    assert paths(walk(layer, devices=[torch.device("cpu")])) == ["cpu"]
    assert walk(layer, devices=["cuda"]).refs == ()
    assert walk(layer, devices=["meta"]).refs == ()  # meta tensors are never reported
    assert walk(layer, devices=[]).refs == ()
    assert paths(walk(layer, devices="cpu")) == ["cpu"]  # one device, not its characters


def test_a_layer_without_tensors_of_its_own_reports_every_device() -> None:
    bare = nn.Module()
    bare.cpu = torch.ones(1)
    bare.meta = torch.empty(1, device="meta")
    assert paths(walk(bare)) == ["cpu"]
    on_meta = nn.Linear(2, 2, device="meta")
    on_meta.cpu = torch.ones(1)
    assert paths(walk(on_meta)) == ["cpu"]


def test_layer_devices_include_submodules() -> None:
    outer = nn.Module()
    outer.inner = nn.Linear(2, 2, device="meta")
    outer.cpu = torch.ones(1)
    # The only parameters are on meta, so "every device" applies; a cuda-only filter reports nothing.
    assert paths(walk(outer)) == ["cpu"]
    assert walk(outer, devices=["cuda:0"]).refs == ()


# ----------------------------------------------------------------------------------------------------------------
# Sets, mappingproxies, restorability


def test_sets_are_noted_not_reported() -> None:
    layer = Layer()
    layer.members = {torch.ones(1)}
    layer.frozen = frozenset([Obj(t=torch.ones(2))])
    result = walk(layer)
    assert result.refs == ()
    assert any(note.startswith("members:") and "member of a set" in note for note in result.notes)
    assert any(note.startswith("frozen:") and "member of a frozenset" in note for note in result.notes)


def test_mappingproxy_items_are_reported_but_not_restorable() -> None:
    layer = Layer()
    layer.view = types.MappingProxyType({"t": torch.ones(1)})
    result = walk(layer)
    (ref,) = result.refs
    assert ref.path == "view['t']"
    assert not ref.restorable
    assert ref.reason is not None and "mappingproxy" in ref.reason
    check_refs(layer, result)
    with pytest.raises(PathError):
        SlotPath(ref.path).assign(layer, torch.zeros(1))


def test_builtin_method_self_is_reported_but_not_restorable() -> None:
    layer = Layer()
    target = torch.zeros(3)
    layer.fill = target.fill_
    layer.append = [torch.ones(1)].append
    result = walk(layer)
    refs = by_path(result)
    assert set(refs) == {"fill.__self__", "append.__self__[0]"}
    assert not refs["fill.__self__"].restorable
    assert refs["fill.__self__"].reason is not None and "__self__" in refs["fill.__self__"].reason
    assert refs["append.__self__[0]"].restorable  # the list is written in place
    check_refs(layer, result)


def test_a_tuple_under_a_method_self_is_not_restorable() -> None:
    layer = Layer()
    layer.m = types.MethodType(make_closure([]), (torch.ones(1),))
    (ref,) = walk(layer).refs
    assert ref.path == "m.__self__[0]"
    assert not ref.restorable
    with pytest.raises(PathError):
        SlotPath(ref.path).assign(layer, torch.zeros(1))


def test_a_tuple_subclass_with_a_constructor_is_not_restorable() -> None:
    class Pair(tuple[Any, ...]):
        def __new__(cls, a: Any, b: Any) -> Pair:
            return super().__new__(cls, (a, b))

    layer = Layer()
    layer.pair = Pair(torch.ones(1), 2)
    (ref,) = walk(layer).refs
    assert ref.path == "pair[0]"
    assert not ref.restorable


def build_rich_layer() -> nn.Module:
    layer = Layer()
    ws = torch.empty(4)
    layer._ws = ws
    layer.qm = Obj(
        w=layer.weight,
        strides=[torch.ones(2), (torch.ones(3), Scales(torch.ones(1), ws, 0))],
        table={"a": torch.ones(5), 3: LegacyNT(ws, torch.ones(6))},
        kern=functools.partial(make_closure([ws]), torch.ones(7), k=(torch.ones(8),)),
        frozen=FrozenCfg(torch.ones(9)),
    )
    slotted = Slotted()
    slotted.s1 = (ws,)
    layer.slotted = slotted
    layer.method = types.MethodType(make_closure([(ws,)]), Obj(t=ws))
    return layer


def test_every_restorable_path_can_be_assigned() -> None:
    result = walk(build_rich_layer())
    assert len(result.refs) >= 15
    assert all(ref.restorable for ref in result.refs)
    for ref in result.refs:
        fresh = build_rich_layer()  # assign may rebuild tuples; each check gets its own layer
        new = torch.full((1,), 42.0)
        SlotPath(ref.path).assign(fresh, new)
        assert SlotPath(ref.path).resolve(fresh) is new, ref.path


# ----------------------------------------------------------------------------------------------------------------
# Budgets


def chain(depth: int, leaf: Any) -> Any:
    node: Any = leaf
    for _ in range(depth):
        node = Obj(next=node)
    return node


def test_max_depth_is_reported_with_the_path() -> None:
    layer = Layer()
    layer.deep = chain(9, torch.ones(1))  # deep.next x9 : a path of 10 steps
    result = walk(layer)
    assert result.refs == ()
    assert result.exhausted is not None
    assert "max_depth=8" in result.exhausted
    assert "deep.next.next.next.next.next.next.next" in result.exhausted
    full = walk(layer, budget=WalkBudget(max_depth=10))
    assert paths(full) == ["deep" + ".next" * 9]
    assert full.exhausted is None
    assert walk(layer, budget=WalkBudget(max_depth=9)).exhausted is not None


def test_depth_counts_path_steps_not_objects() -> None:
    layer = Layer()
    layer.a = [[torch.ones(1)]]  # a[0][0]: three steps
    assert paths(walk(layer, budget=WalkBudget(max_depth=3))) == ["a[0][0]"]
    short = walk(layer, budget=WalkBudget(max_depth=2))
    assert short.refs == ()
    assert short.exhausted is not None and "max_depth=2" in short.exhausted


def test_a_long_alias_path_past_max_depth_is_reported_as_exhaustion() -> None:
    layer = Layer()
    t = torch.ones(1)
    layer.short = t
    layer.long = chain(4, t)
    result = walk(layer, budget=WalkBudget(max_depth=3))
    assert paths(result) == ["short"]
    assert result.exhausted is not None and "max_depth=3" in result.exhausted


def test_max_objects_is_reported_with_the_path() -> None:
    layer = Layer()
    layer.many = [Obj(t=torch.ones(1)) for _ in range(50)]
    result = walk(layer, budget=WalkBudget(max_objects=10))
    assert result.objects_visited == 10
    assert result.exhausted is not None
    assert "max_objects=10" in result.exhausted
    assert "many[" in result.exhausted
    assert set(paths(result)) < {f"many[{i}].t" for i in range(50)}
    full = walk(layer)
    assert full.objects_visited == 52 and full.exhausted is None
    assert len(full.refs) == 50


def test_budgets_are_validated() -> None:
    with pytest.raises(ValueError):
        walk(Layer(), budget=WalkBudget(max_depth=-1))
    with pytest.raises(ValueError):
        walk(Layer(), budget=WalkBudget(max_objects=-1))
    assert walk(Layer(), budget=WalkBudget(max_objects=0)).exhausted is not None


def test_collect_is_the_list_of_refs() -> None:
    layer = build_rich_layer()
    assert paths(collect(layer)) == paths(walk(layer))
    assert paths(collect(layer, budget=WalkBudget(max_depth=2))) == paths(walk(layer, budget=WalkBudget(max_depth=2)))


# ----------------------------------------------------------------------------------------------------------------
# Property-based: generated object graphs against a brute-force enumeration

# Node kinds. Mutable ones are built empty and filled last (so they can form cycles); immutable ones are built in
# index order from already-built nodes.
MUTABLE = ("obj", "trap", "slots", "dict", "tdict", "list", "tlist", "func")
IMMUTABLE = ("tuple", "ntuple", "partial", "method", "fset")
TERMINAL = ("tensor", "meta", "leaf", "module")
KINDS = MUTABLE + IMMUTABLE + TERMINAL
# Containers written in place by assign (a path ending in one is restorable); the rest are rebuilt into a parent
# or, for methods, cannot be written.
IN_PLACE = {"root", "obj", "trap", "slots", "dict", "tdict", "list", "tlist", "func", "pdict"}
REBUILT = {"tuple", "ntuple", "partial", "ptuple"}
HASHABLE = {"obj", "trap", "slots", "func", "tensor", "meta", "leaf", "module"}
NOOP = 0  # node 0 is the plain function every partial calls unless it got a func node


@dataclasses.dataclass
class Spec:
    kinds: list[str]
    children: list[list[int]]  # per node; labels are derived from the kind and position
    root: list[int]
    root_names: list[str]


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    n = draw(st.integers(1, 11))
    kinds = ["noop"] + [draw(st.sampled_from(KINDS)) for _ in range(n)]
    kinds += ["tensor"] * draw(st.integers(1, 5))
    children: list[list[int]] = [[] for _ in kinds]
    count = len(kinds)

    def pick(i: int, allowed: Callable[[int], bool], most: int) -> list[int]:
        pool = [j for j in range(1, count) if allowed(j)]
        pool += [j for j in pool if kinds[j] == "tensor"]  # tensors twice as likely: more refs, more aliases
        if not pool:
            return []
        return draw(st.lists(st.sampled_from(pool), max_size=most))

    def immutable_ok(i: int) -> Callable[[int], bool]:
        return lambda j: kinds[j] not in IMMUTABLE or j < i

    for i in range(1, count):
        kind = kinds[i]
        if kind in ("obj", "trap", "slots", "dict", "tdict", "list", "tlist"):
            children[i] = pick(i, lambda j: True, 4)
        elif kind == "func":
            children[i] = pick(i, lambda j: True, 3) or [count - 1]
        elif kind in ("tuple", "ntuple"):  # () and frozenset() are singletons: keep every node its own object
            children[i] = pick(i, immutable_ok(i), 3) or [count - 1]
        elif kind == "fset":
            children[i] = pick(i, lambda j: kinds[j] in HASHABLE, 3) or [count - 1]
        elif kind == "method":
            funcs = [j for j in range(count) if kinds[j] == "func"]
            if not funcs:
                kinds[i] = "leaf"
                continue
            children[i] = [draw(st.sampled_from(funcs)), draw(st.sampled_from(range(1, count)))]
            if kinds[children[i][1]] in IMMUTABLE and children[i][1] >= i:
                children[i][1] = count - 1  # a tensor
        elif kind == "partial":
            funcs = [j for j in range(count) if kinds[j] == "func"]
            func = draw(st.sampled_from(funcs)) if funcs and draw(st.booleans()) else NOOP
            args = pick(i, immutable_ok(i), 2) or [count - 1]  # never the shared empty tuple
            kw = pick(i, immutable_ok(i), 2)
            children[i] = [func, *args, -1, *kw]  # -1 separates args from keywords
    root = draw(st.lists(st.sampled_from(range(1, count)), min_size=2, max_size=6))
    names = [f"{'_' if k % 2 else ''}a{k}" for k in range(len(root))]
    return _expand_partials(Spec(kinds, children, root, names))


def _expand_partials(spec: Spec) -> Spec:
    """Give each partial explicit nodes for its ``args`` tuple and ``keywords`` dict (real objects too)."""
    for i, kind in enumerate(list(spec.kinds)):
        if kind != "partial":
            continue
        func, *rest = spec.children[i]
        cut = rest.index(-1)
        args, kw = rest[:cut], rest[cut + 1 :]
        spec.kinds += ["ptuple", "pdict"]
        spec.children += [args, kw]
        spec.children[i] = [func, len(spec.kinds) - 2, len(spec.kinds) - 1]
    return spec


def labels(kind: str, position: int) -> str:
    """The path text of child ``position`` of a ``kind`` node (written independently of the walker)."""
    if kind in ("obj", "trap"):
        return f".t{position}"
    if kind == "slots":
        return f".s{position}"
    if kind in ("dict", "tdict"):
        return f"['k\\'{position}']" if position % 2 == 0 else f"[{position}]"
    if kind == "pdict":
        return f"['kw{position}']"
    if kind in ("list", "tlist", "tuple", "ptuple"):
        return f"[{position}]"
    if kind == "ntuple":
        return "." + "abc"[position]
    if kind == "func":
        return f".__closure__[{position}]"
    if kind == "method":
        return (".__func__", ".__self__")[position]
    if kind == "partial":
        return (".func", ".args", ".keywords")[position]
    raise AssertionError(kind)


def build(spec: Spec) -> tuple[nn.Module, list[Any]]:
    objs: list[Any] = [None] * len(spec.kinds)

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    objs[NOOP] = noop
    for i, kind in enumerate(spec.kinds):
        if kind == "obj":
            objs[i] = Obj()
        elif kind == "trap":
            objs[i] = Trap()
        elif kind == "slots":
            objs[i] = Slotted()
        elif kind == "dict":
            objs[i] = {}
        elif kind == "tdict":
            objs[i] = TrapDict()
        elif kind == "list":
            objs[i] = []
        elif kind == "tlist":
            objs[i] = TrapList()
        elif kind == "func":
            objs[i] = make_closure([None] * len(spec.children[i]))
        elif kind == "tensor":
            objs[i] = torch.full((1,), float(i))
        elif kind == "meta":
            objs[i] = torch.empty(1, device="meta")
        elif kind == "leaf":
            objs[i] = 1000 + i
        elif kind == "module":
            objs[i] = nn.Module()
    for i, kind in enumerate(spec.kinds):  # immutables, in index order (children were built before)
        vals = [objs[c] for c in spec.children[i]]
        if kind == "tuple":
            objs[i] = tuple(vals)
        elif kind == "ntuple":
            objs[i] = Scales(*(vals + [None] * (3 - len(vals))))
        elif kind == "fset":
            objs[i] = frozenset(vals)
        elif kind == "method":
            objs[i] = types.MethodType(vals[0], vals[1])
        elif kind == "partial":
            func, args_node, kw_node = spec.children[i]
            args = [objs[c] for c in spec.children[args_node]]
            kw = {f"kw{p}": objs[c] for p, c in enumerate(spec.children[kw_node])}
            objs[i] = functools.partial(objs[func], *args, **kw)
            objs[args_node], objs[kw_node] = objs[i].args, objs[i].keywords
    for i, kind in enumerate(spec.kinds):  # fill the mutables last: cycles are now possible
        vals = [objs[c] for c in spec.children[i]]
        for p, v in enumerate(vals):
            if kind in ("obj", "trap"):
                setattr(objs[i], f"t{p}", v)
            elif kind == "slots":
                setattr(objs[i], f"s{p}", v)
            elif kind in ("dict", "tdict"):
                objs[i][f"k'{p}" if p % 2 == 0 else p] = v
            elif kind in ("list", "tlist"):
                objs[i].append(v)
            elif kind == "func":
                objs[i].__closure__[p].cell_contents = v
            elif kind == "module":
                object.__setattr__(objs[i], f"t{p}", v)
    layer = Layer()
    for name, c in zip(spec.root_names, spec.root, strict=True):
        object.__setattr__(layer, name, objs[c])
    return layer, objs


WALKABLE = set(MUTABLE) | set(IMMUTABLE) | {"noop", "ptuple", "pdict"}


class TooManyPaths(Exception):
    pass


def brute_force(spec: Spec, max_depth: int) -> dict[str, Any]:
    """Enumerate simple paths recursively on the spec (not on the objects), as an independent oracle."""
    kinds, children = spec.kinds, spec.children
    # Reachability over every edge (set members included), and BFS distances over every edge.
    dist: dict[int, int] = {}
    frontier = [(c, 1) for c in spec.root]
    while frontier:
        nxt = []
        for node, d in frontier:
            if node in dist or kinds[node] not in WALKABLE | {"tensor"}:
                continue
            dist[node] = d
            if kinds[node] in WALKABLE:
                nxt += [(c, d + 1) for c in children[node]]
        frontier = sorted(nxt, key=lambda x: x[1])
    reachable = [n for n in dist if kinds[n] in WALKABLE]

    def leads_to_tensor(node: int, seen: set[int]) -> bool:
        if kinds[node] == "tensor":
            return True
        if kinds[node] not in WALKABLE or node in seen:
            return False
        seen.add(node)
        return any(leads_to_tensor(c, seen) for c in children[node])

    expected: dict[str, tuple[int, bool]] = {}
    lost = False
    longest = 0
    simple_paths = 0
    useful_fset = False

    def restorable(writes: tuple[str, ...]) -> bool:
        for kind in reversed(writes):
            if kind in IN_PLACE:
                return True
            if kind not in REBUILT:
                return False
        raise AssertionError("the layer is written in place")

    def dfs(
        node: int, kind: str, kids: list[int], text: str, on_path: tuple[int, ...], writes: tuple[str, ...]
    ) -> None:
        nonlocal lost, longest, simple_paths, useful_fset
        if kind == "fset":  # members have no path; one leading to a tensor (off this path) makes a note
            useful_fset = useful_fset or any(m not in on_path and leads_to_tensor(m, set()) for m in children[node])
            return
        for position, child in enumerate(kids):
            ckind = kinds[child]
            if (ckind not in WALKABLE and ckind != "tensor") or child in on_path:
                continue
            simple_paths += 1
            if simple_paths > 3000:
                raise TooManyPaths
            path = text + (spec.root_names[position] if kind == "root" else labels(kind, position))
            steps = len(on_path)  # the root is on the path too, so this counts the steps to child
            longest = max(longest, steps)
            if ckind == "tensor":
                if steps > max_depth:
                    lost = True
                else:
                    expected[path] = (child, restorable((*writes, kind)))
            else:
                dfs(child, ckind, children[child], path, (*on_path, child), (*writes, kind))

    dfs(-1, "root", spec.root, "", (-1,), ())
    return {
        "expected": expected,
        "lost": lost,
        "longest": longest,
        "simple_paths": simple_paths,
        "reachable": len(reachable),
        "max_dist": max(dist.values(), default=0),
        "useful_fset": useful_fset,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=specs(),
    max_depth=st.sampled_from([1, 2, 3, 4, 8, 8, 8, 8]),
    max_objects=st.sampled_from([1, 4, 10, 100_000, 100_000, 100_000]),
)
def test_generated_graphs_match_brute_force(spec: Spec, max_depth: int, max_objects: int) -> None:
    try:
        oracle = brute_force(spec, max_depth)
    except TooManyPaths:
        event("rejected: too many simple paths")
        assume(False)
        raise
    layer, objs = build(spec)
    CALLS.clear()
    result = walk(layer, budget=WalkBudget(max_depth, max_objects))
    assert not CALLS, CALLS

    check_refs(layer, result)
    got = {ref.path: ref for ref in result.refs}
    expected = oracle["expected"]
    assert set(got) <= set(expected)
    for path, ref in got.items():
        node, restorable = expected[path]
        assert ref.tensor is objs[node]
        assert ref.restorable == restorable, path

    fits = (
        oracle["reachable"] + 1 <= max_objects
        and oracle["max_dist"] <= max_depth
        and oracle["longest"] <= max_depth
        and oracle["simple_paths"] <= max_objects
    )
    must_exhaust = oracle["lost"] or oracle["reachable"] + 1 > max_objects
    if fits:
        assert result.exhausted is None
    if must_exhaust:
        assert result.exhausted is not None
    if result.exhausted is None:
        assert set(got) == set(expected)
        assert result.objects_visited == oracle["reachable"] + 1
        assert bool(result.notes) == oracle["useful_fset"]
    else:
        assert ("max_depth" in result.exhausted) or ("max_objects" in result.exhausted)
    assert result.objects_visited <= max_objects
    event(f"exhausted: {result.exhausted.split('=')[0] if result.exhausted else None}")
    event(f"refs: {min(len(got), 5)}{'+' if len(got) >= 5 else ''}")
    event(f"aliases: {len(got) > len({id(r.tensor) for r in got.values()})}")
    event(f"not restorable: {any(not r.restorable for r in got.values())}")
    event(f"notes: {bool(result.notes)}")

    # Restorable paths really are: assign on a freshly built copy of the same graph.
    for ref in list(got.values())[:3]:
        fresh, _ = build(spec)
        new = torch.full((1,), -1.0)
        if ref.restorable:
            SlotPath(ref.path).assign(fresh, new)
            assert SlotPath(ref.path).resolve(fresh) is new
        else:
            with pytest.raises(PathError):
                SlotPath(ref.path).assign(fresh, new)


keys = st.one_of(st.text(max_size=6), st.integers(-(10**12), 10**12))


@settings(max_examples=60, deadline=None)
@given(items=st.dictionaries(keys, st.booleans(), max_size=5), nesting=st.integers(0, 3))
def test_generated_dict_keys_render_canonical_paths(items: dict[Any, bool], nesting: int) -> None:
    layer = Layer()
    table: dict[Any, Any] = {}
    planted = {}
    for key, has_tensor in items.items():
        value: Any = torch.ones(1) if has_tensor else "x"
        for _ in range(nesting):
            value = [value]
        table[key] = value
        if has_tensor:
            planted[key] = value
    layer.table = table
    result = walk(layer)
    check_refs(layer, result)
    assert len(result.refs) == len(planted)
    for ref in result.refs:
        assert format_path(parse_path(ref.path)) == ref.path


# ----------------------------------------------------------------------------------------------------------------
# What the walk works out once (per walk, per class, per container) must never hide a change.


def test_class_attributes_are_read_afresh_at_every_walk_and_shadowed_per_instance() -> None:
    class Holder:
        pass

    layer = Layer()
    layer.a = Holder()
    layer.b = Holder()
    assert walk(layer).refs == ()
    Holder.cache = torch.ones(2)  # type: ignore[attr-defined]
    layer.b.cache = None  # b's own attribute shadows the class's, a's does not
    result = walk(layer)
    assert paths(result) == ["a.cache"]
    assert not result.refs[0].restorable and "class attribute" in (result.refs[0].reason or "")
    Holder.cache = torch.ones(3)  # type: ignore[attr-defined]  # replaced on the class: the next walk sees it
    assert [ref.tensor for ref in walk(layer).refs] == [Holder.cache]  # type: ignore[attr-defined]


def test_containers_of_leaves_are_read_once_and_counted() -> None:
    layer = Layer()
    meta = (1, "bf16", 128.0, None)
    layer.a = {"meta": meta, "cfg": {"block": 64}, "empty": [], "t": torch.ones(1)}
    layer.b = [meta, meta]
    result = walk(layer)
    assert paths(result) == ["a['t']"]
    check_refs(layer, result)
    assert result.objects_visited == 6  # layer, a, the shared meta tuple (once), cfg, empty, b
    assert result.exhausted is None
    for budget in range(1, 6):  # every budget short of 6 says it cut, and never reads past it
        cut = walk(layer, budget=WalkBudget(max_objects=budget))
        assert cut.objects_visited == budget and cut.exhausted is not None and "max_objects" in cut.exhausted


def test_skip_paths_are_listed_when_reached_and_never_fingerprinted(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphsafe.collectors.walker import _enumerate

    layer = Layer()
    shared = torch.ones(2)
    layer.ws = torch.ones(3)
    layer.args = Obj(ws=shared, other=shared)
    layer.gone = torch.empty(1, device="meta")
    printed: list[torch.Tensor] = []
    real = _enumerate.fingerprint
    monkeypatch.setattr(_enumerate, "fingerprint", lambda t: printed.append(t) or real(t))
    result = walk(layer, skip_paths={"ws", "args.ws", "missing", "gone"})
    assert paths(result) == ["args.other"]
    assert result.skipped == ("ws", "args.ws")  # reached; "missing" is not there, "gone" is on no walked device
    assert [id(t) for t in printed] == [id(shared)]  # once, through args.other; never for ws


def test_classify_marks_declared_paths_walked_and_leaves_their_fingerprint_to_the_declaration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from graphsafe import register_derived
    from graphsafe.collectors import classify
    from graphsafe.collectors.walker import _enumerate

    layer = Layer()
    layer.ws = torch.ones(3)
    layer.args = Obj(scale=torch.ones(1))
    layer.loose = torch.zeros(2)
    register_derived(layer, "ws")
    register_derived(layer, "args.scale")
    walker_prints: list[torch.Tensor] = []
    real = _enumerate.fingerprint
    monkeypatch.setattr(_enumerate, "fingerprint", lambda t: walker_prints.append(t) or real(t))
    found = {entry.path.text: entry for entry in classify(layer).tensors}
    assert found["ws"].walked and found["args.scale"].walked and found["loose"].walked
    assert not found["weight"].walked  # the layer's own parameter: never a walker find
    assert [id(t) for t in walker_prints] == [id(layer.loose)]  # declared ones: fingerprinted by their declaration


def test_a_class_attribute_is_shadowed_by_the_same_name_nearer_along_the_mro() -> None:
    class Base:
        cache = torch.ones(2)
        table = torch.ones(3)

    class Derived(Base):
        cache = None  # shadows Base.cache: instances read None

    layer = Layer()
    layer.base = Base()
    layer.derived = Derived()
    result = walk(layer)
    assert paths(result) == ["base.cache", "base.table", "derived.table"]
    assert result.refs[2].tensor is Base.table


def test_holders_read_since_round_s6_run_no_user_code() -> None:
    """A numpy object array (a subclass whose Python ``__getattribute__`` must not run), a raw storage, a property
    over a partial and a class under a metaclass that counts its hooks: read through C getters only."""
    import numpy as np

    class TrapArray(np.ndarray):  # type: ignore[type-arg]
        def __getattribute__(self, name: str) -> Any:
            CALLS["ndarray.__getattribute__"] += 1
            return super().__getattribute__(name)

    table = np.empty(1, dtype=object).view(TrapArray)
    np.ndarray.__setitem__(table, 0, torch.ones(1))
    layer = Layer()
    layer.table = table
    layer.pool = torch.ones(2).untyped_storage()
    layer.trap_class = Trap
    type(layer).prop = property(functools.partial(lambda t, s: t, torch.ones(3)))  # type: ignore[attr-defined]
    CALLS.clear()  # (setting the attributes ran nn.Module.__setattr__'s isinstance tests)
    try:
        result = walk(layer)
    finally:
        del type(layer).prop  # type: ignore[attr-defined]
    assert not CALLS, dict(CALLS)
    assert sorted(note.split(":")[0] for note in result.notes) == ["<layer>", "pool", "table"]


def test_class_code_wrappers_add_no_walk_level() -> None:
    """A ``classmethod``/``staticmethod``/``property`` over a plain function is class code, like a method, also
    when the wrapper carries the function's metadata (``__wrapped__``, ``__annotations__``: vLLM's
    ``CustomOp.register`` cut every layer's walk at ``max_depth`` on a real engine while it was followed)."""

    class Op:
        @classmethod
        def register(cls, name: str) -> Any:
            return name

        @staticmethod
        def helper(x: int) -> int:
            return x

        @property
        def size(self) -> int:
            return 1

    Op.__dict__["register"].__annotations__ = {"name": str}  # what functools.wraps-style copying leaves there
    layer = Layer()
    layer.op = Op()
    result = walk(layer, budget=WalkBudget(max_depth=1))
    assert result.exhausted is None and result.objects_visited == 2
