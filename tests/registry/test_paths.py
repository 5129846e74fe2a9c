"""Slot paths: parsing, formatting, resolution and assignment (CPU only)."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from graphsafe.errors import GraphSafeError, PathError, PathSyntaxError
from graphsafe.paths import Attr, Cell, Item, SlotPath, Token, format_path, parse_path

# ----------------------------------------------------------------------------------------------------
# Fixtures: containers of every kind
# ----------------------------------------------------------------------------------------------------


class NS:
    """A plain attribute bag (has an instance ``__dict__``)."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    if TYPE_CHECKING:  # attributes are dynamic

        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...


class Layer(NS):
    """Stands in for a model layer; error messages must name this class."""


class Slotted:
    __slots__ = ("other", "workspace")

    def __init__(self, workspace: Any, other: Any = None) -> None:
        self.workspace = workspace
        self.other = other


@dataclass(frozen=True)
class FrozenCfg:
    workspace: Any
    shape: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class FrozenSlotted:
    workspace: Any


class Pair(NamedTuple):
    a: Any
    b: Any

    @property
    def both(self) -> tuple[Any, Any]:
        return (self.a, self.b)


class MyTuple(tuple):  # type: ignore[type-arg]
    """A plain tuple subclass (no ``_make``)."""


class ReadOnlyNoDict:
    """A property without a setter on a class with no instance dict and no slot for it."""

    __slots__ = ()

    @property
    def value(self) -> torch.Tensor:
        return torch.zeros(1)


class ReadOnlyWithDict:
    def __init__(self) -> None:
        self.other = 1

    @property
    def value(self) -> torch.Tensor:
        return torch.zeros(1)


class TupleBehindProperty:
    """A tuple reachable only through a read-only property: the rebuilt tuple has nowhere to go."""

    __slots__ = ("_pair",)

    def __init__(self) -> None:
        self._pair = (torch.zeros(1), torch.zeros(1))

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pair


class SelfFrozen:
    """Refuses ``setattr`` with AttributeError (like attrs' frozen classes); graphsafe writes the slot."""

    def __init__(self, workspace: Any) -> None:
        object.__setattr__(self, "workspace", workspace)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")


def make_closure(first: Any, second: Any) -> Any:
    def act_fn() -> tuple[Any, Any]:
        return first, second

    return act_fn


def make_empty_cell_closure() -> Any:
    """A function whose only closure cell is empty (as when the variable is deleted after capture)."""
    template = make_closure(None, None)
    cells = tuple(types.CellType() for _ in template.__closure__)
    return types.FunctionType(template.__code__, template.__globals__, "act_fn", None, cells)


def act(x: Any, y: Any, *, perm: Any = None, scale: Any = None) -> Any:
    return (x, y, perm, scale)


class TaggedPartial(functools.partial):  # type: ignore[type-arg]
    """A partial subclass: the rebuilt partial must keep it."""


def t() -> torch.Tensor:
    return torch.empty(4)


def assign_and_check(root: object, path: str, value: Any) -> None:
    """Assign, then check the value resolves back by identity (through parse and through a SlotPath copy)."""
    sp = SlotPath(path)
    sp.assign(root, value)
    assert sp.resolve(root) is value
    assert SlotPath(sp).resolve(root) is value
    assert sp.resolve_or(root, "default") is value


# ----------------------------------------------------------------------------------------------------
# Parsing and formatting: every path form
# ----------------------------------------------------------------------------------------------------

PATH_FORMS: list[tuple[str, tuple[Token, ...], str]] = [
    ("workspace", (Attr("workspace"),), "workspace"),
    (
        "quant_method.kernel.workspace",
        (Attr("quant_method"), Attr("kernel"), Attr("workspace")),
        "quant_method.kernel.workspace",
    ),
    (
        "quant_method.moe_kernel.fused_experts.ab_strides1",
        (Attr("quant_method"), Attr("moe_kernel"), Attr("fused_experts"), Attr("ab_strides1")),
        "quant_method.moe_kernel.fused_experts.ab_strides1",
    ),
    ("experts[3].scale", (Attr("experts"), Item(3), Attr("scale")), "experts[3].scale"),
    ("cache['w1']", (Attr("cache"), Item("w1")), "cache['w1']"),
    ('cache["k"]', (Attr("cache"), Item("k")), "cache['k']"),
    ("act_fn.__closure__[0]", (Attr("act_fn"), Cell(0)), "act_fn.__closure__[0]"),
    ("act_fn.args[1]", (Attr("act_fn"), Attr("args"), Item(1)), "act_fn.args[1]"),
    ("act_fn.keywords['perm']", (Attr("act_fn"), Attr("keywords"), Item("perm")), "act_fn.keywords['perm']"),
    ("x[-1]", (Attr("x"), Item(-1)), "x[-1]"),
    ("x[007]", (Attr("x"), Item(7)), "x[7]"),
    ("x['3']", (Attr("x"), Item("3")), "x['3']"),
    ("x['']", (Attr("x"), Item("")), "x['']"),
    ("x[0][1]['k'].y", (Attr("x"), Item(0), Item(1), Item("k"), Attr("y")), "x[0][1]['k'].y"),
    ("__closure__[2]", (Cell(2),), "__closure__[2]"),
    ("f.__closure__[-1]", (Attr("f"), Cell(-1)), "f.__closure__[-1]"),
    ("f.__closure__[0][1]", (Attr("f"), Cell(0), Item(1)), "f.__closure__[0][1]"),
    (
        "f.__closure__[0].__closure__[1].w",
        (Attr("f"), Cell(0), Cell(1), Attr("w")),
        "f.__closure__[0].__closure__[1].w",
    ),
    ("f['__closure__'][0]", (Attr("f"), Item("__closure__"), Item(0)), "f['__closure__'][0]"),
    ("_private.__dunder__", (Attr("_private"), Attr("__dunder__")), "_private.__dunder__"),
    ("x['it\\'s']", (Attr("x"), Item("it's")), "x['it\\'s']"),
    ('x["say \\"hi\\""]', (Attr("x"), Item('say "hi"')), "x['say \"hi\"']"),
    ("x['back\\\\slash']", (Attr("x"), Item("back\\slash")), "x['back\\\\slash']"),
    ("x['a]b.c[d']", (Attr("x"), Item("a]b.c[d")), "x['a]b.c[d']"),
    ("x['\\q']", (Attr("x"), Item("q")), "x['q']"),  # an escape of any other char is that char
    ('x["it\'s"]', (Attr("x"), Item("it's")), "x['it\\'s']"),
]


@pytest.mark.parametrize(("text", "tokens", "canonical"), PATH_FORMS, ids=[f[0] for f in PATH_FORMS])
def test_parse_every_form(text: str, tokens: tuple[Token, ...], canonical: str) -> None:
    assert parse_path(text) == tokens
    assert format_path(tokens) == canonical
    assert format_path(list(tokens)) == canonical
    # Round trip through the canonical text.
    assert parse_path(format_path(parse_path(text))) == tokens
    assert format_path(parse_path(canonical)) == canonical
    sp = SlotPath(text)
    assert sp.tokens == tokens
    assert sp.text == canonical
    assert str(sp) == canonical
    assert repr(sp) == f"SlotPath({canonical!r})"


def test_parse_is_cached_and_tokens_are_immutable() -> None:
    assert parse_path("a.b[0]") is parse_path("a.b[0]")
    tokens = parse_path("a.b[0]")
    assert isinstance(tokens, tuple)
    first = tokens[0]
    assert isinstance(first, Attr)
    with pytest.raises(AttributeError):
        first.name = "z"  # type: ignore[misc]


def test_parse_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="is a str"):
        parse_path(cast(Any, 3))
    with pytest.raises(TypeError):
        SlotPath(cast(Any, b"workspace"))


def test_format_empty_tokens_is_empty_string() -> None:
    assert format_path(()) == ""


def test_slotpath_equality_hash_prefix_and_copy() -> None:
    a = SlotPath('cache["k"].x')
    b = SlotPath("cache['k'].x")
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != SlotPath("cache['k'].y")
    assert a != "cache['k'].x"  # a str is not a SlotPath
    copy = SlotPath(a)
    assert copy == a and copy.text == a.text and copy.tokens is a.tokens
    assert a.prefix(0) == ""
    assert a.prefix(1) == "cache"
    assert a.prefix(2) == "cache['k']"
    assert a.prefix(3) == "cache['k'].x"
    f = SlotPath("act_fn.__closure__[0].w")
    assert f.prefix(2) == "act_fn.__closure__[0]"


# ----------------------------------------------------------------------------------------------------
# Syntax errors
# ----------------------------------------------------------------------------------------------------

SYNTAX_ERRORS: list[tuple[str, int, str]] = [
    ("", 0, "empty"),
    ("a.", 2, "ends with '.'"),
    ("a.b.", 4, "ends with '.'"),
    ("a..b", 2, "attribute name"),
    (".a", 0, "attribute name"),
    ("a.[0]", 2, "attribute name"),
    ("a.-1", 2, "attribute name"),  # digits name a ParameterList entry (``a.1``); a sign does not
    ("a[", 2, "expected a key"),
    ("a['x", 2, "unterminated"),
    ('a["x', 2, "unterminated"),
    ("a['x\\'", 2, "unterminated"),
    ("a['x\"]", 2, "unterminated"),
    ("a[x]", 2, "integer or a quoted string"),
    ("a[]", 2, "integer or a quoted string"),
    ("a[ 0]", 2, "integer or a quoted string"),
    ("a[-]", 2, "integer or a quoted string"),
    ("a[0", 3, "expected ']'"),
    ("a['x'", 5, "expected ']'"),
    ("a[1.5]", 3, "expected ']'"),
    ("a['x'y]", 5, "expected ']'"),
    ("1abc", 1, "unexpected 'a'"),  # ``1`` is a name (digits), then a letter cannot follow
    ("[0]", 0, "attribute name"),
    ("a b", 1, "unexpected ' '"),
    ("a[0]b", 4, "unexpected 'b'"),
    ("a-b", 1, "unexpected '-'"),
    ("a.b()", 3, "unexpected '('"),
    ("·a", 0, "attribute name"),  # a Unicode identifier is a name (``échelle``); a middle dot cannot start one
    ("__closure__", 11, "cell index"),
    ("a.__closure__", 13, "cell index"),
    ("a.__closure__.b", 13, "cell index"),
    ("a.__closure__[0].__closure__", 28, "cell index"),
    ("a.__closure__['x']", 14, "closure cell index is an integer"),
    ('a.__closure__["0"]', 14, "closure cell index is an integer"),
    ("__closure__['x']", 12, "closure cell index is an integer"),
]


@pytest.mark.parametrize(("text", "position", "reason"), SYNTAX_ERRORS, ids=[e[0] or "<empty>" for e in SYNTAX_ERRORS])
def test_syntax_errors(text: str, position: int, reason: str) -> None:
    with pytest.raises(PathSyntaxError) as info:
        parse_path(text)
    err = info.value
    assert err.path == text
    assert err.position == position
    assert 0 <= err.position <= len(text)
    assert reason in err.reason
    message = str(err)
    assert f"column {position}" in message
    assert repr(text) in message
    assert message.endswith(" " * position + "^")
    assert isinstance(err, ValueError)
    assert isinstance(err, GraphSafeError)
    # SlotPath parses the same way.
    with pytest.raises(PathSyntaxError):
        SlotPath(text)


def test_syntax_error_is_not_a_path_error() -> None:
    with pytest.raises(PathSyntaxError) as info:
        parse_path("a..b")
    assert not isinstance(info.value, PathError)


# ----------------------------------------------------------------------------------------------------
# Resolve and assign: every container kind
# ----------------------------------------------------------------------------------------------------


def test_attribute() -> None:
    old = t()
    layer = Layer(workspace=old)
    assert SlotPath("workspace").resolve(layer) is old
    new = t()
    assign_and_check(layer, "workspace", new)
    assert layer.workspace is new


def test_nested_attributes() -> None:
    kernel = NS(workspace=t())
    qm = NS(kernel=kernel, moe_kernel=NS(fused_experts=NS(ab_strides1=t())))
    layer = Layer(quant_method=qm)
    new = t()
    assign_and_check(layer, "quant_method.kernel.workspace", new)
    assert layer.quant_method is qm and qm.kernel is kernel and kernel.workspace is new
    new2 = t()
    assign_and_check(layer, "quant_method.moe_kernel.fused_experts.ab_strides1", new2)
    assert qm.moe_kernel.fused_experts.ab_strides1 is new2


def test_class_attribute_is_shadowed_on_the_instance_only() -> None:
    class WithClassAttr(Layer):
        workspace = torch.zeros(1)

    layer = WithClassAttr()
    class_value = WithClassAttr.workspace
    assert SlotPath("workspace").resolve(layer) is class_value
    new = t()
    assign_and_check(layer, "workspace", new)
    assert WithClassAttr.workspace is class_value


def test_slots_object() -> None:
    other = t()
    obj = Slotted(t(), other)
    layer = Layer(kernel=obj)
    new = t()
    assign_and_check(layer, "kernel.workspace", new)
    assert layer.kernel is obj
    assert obj.workspace is new and obj.other is other
    assert not hasattr(obj, "__dict__")


@pytest.mark.parametrize("cls", [FrozenCfg, FrozenSlotted])
def test_frozen_dataclass(cls: type) -> None:
    cfg = cls(workspace=t())
    layer = Layer(cfg=cfg)
    new = t()
    assign_and_check(layer, "cfg.workspace", new)
    assert layer.cfg is cfg  # written in place, not rebuilt
    assert cfg.workspace is new


def test_object_whose_setattr_raises_attribute_error() -> None:
    obj = SelfFrozen(t())
    layer = Layer(obj=obj)
    new = t()
    assign_and_check(layer, "obj.workspace", new)
    assert layer.obj is obj


def test_dict() -> None:
    w1, k, other = t(), t(), t()
    cache = {"w1": w1, "k": k, "other": other, 3: t()}
    layer = Layer(cache=cache)
    assert SlotPath("cache['w1']").resolve(layer) is w1
    assert SlotPath('cache["k"]').resolve(layer) is k
    new_w1, new_k, new_3 = t(), t(), t()
    assign_and_check(layer, "cache['w1']", new_w1)
    assign_and_check(layer, 'cache["k"]', new_k)
    assign_and_check(layer, "cache[3]", new_3)
    assert layer.cache is cache
    assert cache["w1"] is new_w1 and cache["k"] is new_k and cache[3] is new_3 and cache["other"] is other


def test_list() -> None:
    experts = [NS(scale=t()) for _ in range(5)]
    items = [t(), t(), t()]
    layer = Layer(experts=experts, items=items)
    new = t()
    assign_and_check(layer, "experts[3].scale", new)
    assert layer.experts is experts and experts[3].scale is new
    first, new_last = items[0], t()
    assign_and_check(layer, "items[-1]", new_last)
    assert layer.items is items and items[2] is new_last and items[0] is first
    new_first = t()
    assign_and_check(layer, "items[0]", new_first)
    assert items[0] is new_first


def test_tuple_is_rebuilt_into_parent() -> None:
    a, b = t(), t()
    old = (a, b)
    layer = Layer(pair=old)
    new = t()
    assign_and_check(layer, "pair[1]", new)
    assert layer.pair is not old
    assert type(layer.pair) is tuple
    assert layer.pair[0] is a and layer.pair[1] is new
    assert old[1] is b  # the original tuple is untouched
    newer = t()
    assign_and_check(layer, "pair[-2]", newer)
    assert layer.pair[0] is newer and layer.pair[1] is new


def test_tuple_subclass_keeps_its_type() -> None:
    a, b = t(), t()
    layer = Layer(tup=MyTuple((a, b)))
    new = t()
    assign_and_check(layer, "tup[0]", new)
    assert type(layer.tup) is MyTuple
    assert layer.tup[0] is new and layer.tup[1] is b


@pytest.mark.parametrize("path", ["nt[1]", "nt.b", "nt[-1]"])
def test_namedtuple(path: str) -> None:
    a, b = t(), t()
    old = Pair(a, b)
    layer = Layer(nt=old)
    new = t()
    assign_and_check(layer, path, new)
    assert layer.nt is not old
    assert type(layer.nt) is Pair
    assert layer.nt.a is a and layer.nt.b is new
    assert old.b is b


def test_namedtuple_first_field_by_attribute() -> None:
    a, b = t(), t()
    layer = Layer(nt=Pair(a, b))
    new = t()
    assign_and_check(layer, "nt.a", new)
    assert type(layer.nt) is Pair and layer.nt.a is new and layer.nt.b is b


def test_nested_tuple_inside_tuple() -> None:
    x, y, z = t(), t(), t()
    inner = (x, y)
    outer = (inner, z)
    layer = Layer(nest=outer)
    new = t()
    assign_and_check(layer, "nest[0][1]", new)
    assert layer.nest is not outer and layer.nest[0] is not inner
    assert type(layer.nest) is tuple and type(layer.nest[0]) is tuple
    assert layer.nest[0][0] is x and layer.nest[0][1] is new and layer.nest[1] is z
    assert outer[0] is inner and inner[1] is y


def test_namedtuple_inside_tuple_inside_namedtuple() -> None:
    x, y, z = t(), t(), t()
    layer = Layer(nt=Pair((Pair(x, y),), z))
    new = t()
    assign_and_check(layer, "nt.a[0].b", new)
    assert type(layer.nt) is Pair and type(layer.nt.a) is tuple and type(layer.nt.a[0]) is Pair
    assert layer.nt.a[0].a is x and layer.nt.a[0].b is new and layer.nt.b is z


def test_tuple_inside_list_mutates_the_list() -> None:
    x, y = t(), t()
    lst = [(x, y)]
    layer = Layer(lst=lst)
    new = t()
    assign_and_check(layer, "lst[0][1]", new)
    assert layer.lst is lst
    assert lst[0] == (x, new) and lst[0][0] is x and lst[0][1] is new


def test_tuple_inside_dict_mutates_the_dict() -> None:
    x, y = t(), t()
    d = {"p": (x, y)}
    layer = Layer(d=d)
    new = t()
    assign_and_check(layer, "d['p'][0]", new)
    assert layer.d is d and d["p"][0] is new and d["p"][1] is y


def test_tuple_inside_frozen_dataclass() -> None:
    x, y = t(), t()
    cfg = FrozenCfg(workspace=None, shape=(x, y))
    layer = Layer(cfg=cfg)
    new = t()
    assign_and_check(layer, "cfg.shape[0]", new)
    assert layer.cfg is cfg and cfg.shape[0] is new and cfg.shape[1] is y


def test_tuple_inside_slots_object() -> None:
    x, y = t(), t()
    obj = Slotted((x, y))
    layer = Layer(obj=obj)
    new = t()
    assign_and_check(layer, "obj.workspace[1]", new)
    assert layer.obj is obj and obj.workspace[0] is x and obj.workspace[1] is new


def test_closure_cell() -> None:
    first, second = t(), t()
    fn = make_closure(first, second)
    layer = Layer(act_fn=fn)
    names = fn.__code__.co_freevars
    i_first, i_second = names.index("first"), names.index("second")
    assert SlotPath(f"act_fn.__closure__[{i_first}]").resolve(layer) is first
    new = t()
    assign_and_check(layer, f"act_fn.__closure__[{i_second}]", new)
    assert layer.act_fn is fn  # the function is kept; only the cell changes
    assert fn() == (first, new) and fn()[1] is new
    newer = t()
    assign_and_check(layer, f"act_fn.__closure__[{i_second - len(names)}]", newer)  # negative index
    assert fn()[1] is newer


def test_closure_cell_on_the_root_function() -> None:
    value = t()
    fn = make_closure(value, value)
    new = t()
    assign_and_check(fn, "__closure__[0]", new)
    assert new in [c.cell_contents for c in fn.__closure__]


def test_tuple_inside_closure_cell() -> None:
    x, y = t(), t()
    fn = make_closure((x, y), None)
    i = fn.__code__.co_freevars.index("first")
    layer = Layer(act_fn=fn)
    new = t()
    assign_and_check(layer, f"act_fn.__closure__[{i}][0]", new)
    assert fn()[0][0] is new and fn()[0][1] is y


def test_closure_cell_of_bound_method() -> None:
    value = t()

    class Holder:
        def method(self) -> Any:
            return value

    holder = Holder()
    layer = Layer(m=holder.method)
    new = t()
    assign_and_check(layer, "m.__closure__[0]", new)
    assert holder.method() is new


def test_partial_args_rebuilds_partial_into_parent() -> None:
    x, y, perm, scale = t(), t(), t(), t()
    old = functools.partial(act, x, y, perm=perm, scale=scale)
    old.tag = "kept"  # type: ignore[attr-defined]
    layer = Layer(act_fn=old)
    assert SlotPath("act_fn.args[1]").resolve(layer) is y
    new = t()
    assign_and_check(layer, "act_fn.args[1]", new)
    part = layer.act_fn
    assert part is not old
    assert type(part) is functools.partial
    assert part.func is act
    assert part.args[0] is x and part.args[1] is new
    assert part.keywords == {"perm": perm, "scale": scale}
    assert part.keywords["perm"] is perm and part.keywords["scale"] is scale
    assert part.__dict__ == {"tag": "kept"}
    assert part()[1] is new
    # The old partial is untouched.
    assert old.args[1] is y


def test_partial_subclass_keeps_its_type() -> None:
    x = t()
    layer = Layer(act_fn=TaggedPartial(act, x, None))
    new = t()
    assign_and_check(layer, "act_fn.args[0]", new)
    assert type(layer.act_fn) is TaggedPartial and layer.act_fn.func is act


def test_partial_keywords() -> None:
    x, y, perm, scale = t(), t(), t(), t()
    part = functools.partial(act, x, y, perm=perm, scale=scale)
    layer = Layer(act_fn=part)
    assert SlotPath("act_fn.keywords['perm']").resolve(layer) is perm
    new = t()
    assign_and_check(layer, "act_fn.keywords['perm']", new)
    assert layer.act_fn.func is act
    assert layer.act_fn.args[0] is x and layer.act_fn.args[1] is y
    assert layer.act_fn.keywords["perm"] is new and layer.act_fn.keywords["scale"] is scale
    assert layer.act_fn()[2] is new


def test_partial_whole_args_keywords_and_func() -> None:
    x, y, perm = t(), t(), t()
    old = functools.partial(act, x, perm=perm)
    layer = Layer(act_fn=old)
    new_args = (y, None)
    SlotPath("act_fn.args").assign(layer, new_args)
    # partial() copies its positional args into a fresh tuple: equal, with the same elements.
    assert layer.act_fn.args == new_args and layer.act_fn.args[0] is y
    assert layer.act_fn.func is act and layer.act_fn.keywords == {"perm": perm}
    new_kw = {"scale": x}
    SlotPath("act_fn.keywords").assign(layer, new_kw)
    assert layer.act_fn.keywords == new_kw and layer.act_fn.keywords["scale"] is x
    assert layer.act_fn.args == new_args and layer.act_fn.args[0] is y

    def other(*args: Any, **kwargs: Any) -> Any:
        return args, kwargs

    assign_and_check(layer, "act_fn.func", other)
    assert layer.act_fn.args[0] is y and layer.act_fn.keywords["scale"] is x


def test_partial_inside_dict_and_namedtuple_inside_partial() -> None:
    x, y, z = t(), t(), t()
    part = functools.partial(act, Pair(x, y), z)
    fns = {"silu": part}
    layer = Layer(fns=fns)
    new = t()
    assign_and_check(layer, "fns['silu'].args[0].b", new)
    assert layer.fns is fns
    rebuilt = fns["silu"]
    assert rebuilt is not part and rebuilt.func is act
    assert type(rebuilt.args[0]) is Pair
    assert rebuilt.args[0].a is x and rebuilt.args[0].b is new and rebuilt.args[1] is z


def test_partial_inside_closure_cell() -> None:
    x = t()
    fn = make_closure(functools.partial(act, x, None), None)
    i = fn.__code__.co_freevars.index("first")
    layer = Layer(act_fn=fn)
    new = t()
    assign_and_check(layer, f"act_fn.__closure__[{i}].args[0]", new)
    assert fn()[0].args[0] is new and fn()[0].func is act


class Kernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("workspace", torch.zeros(4))
        self.weight = nn.Parameter(torch.zeros(2))
        self.plain = torch.zeros(3)  # a plain (unregistered) tensor attribute


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))


class ModLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant_method = NS(kernel=Kernel())
        self.experts = nn.ModuleList(Expert() for _ in range(4))
        self.moe = nn.ModuleDict({"w1": Expert()})
        self.sub = Kernel()


def test_module_plain_attribute() -> None:
    layer = ModLayer()
    new = t()
    assign_and_check(layer, "sub.plain", new)
    assert layer.sub.__dict__["plain"] is new


def test_module_registered_buffer() -> None:
    layer = ModLayer()
    new = t()
    assign_and_check(layer, "quant_method.kernel.workspace", new)
    kernel = layer.quant_method.kernel
    assert kernel._buffers["workspace"] is new
    assert "workspace" not in kernel.__dict__
    assert kernel.state_dict(keep_vars=True)["workspace"] is new
    new2 = t()
    assign_and_check(layer, "sub.workspace", new2)
    assert layer.sub._buffers["workspace"] is new2
    assert layer.state_dict(keep_vars=True)["sub.workspace"] is new2


def test_module_parameter_with_a_parameter() -> None:
    layer = ModLayer()
    new = nn.Parameter(torch.ones(2))
    assign_and_check(layer, "sub.weight", new)
    assert layer.sub._parameters["weight"] is new
    assert "weight" not in layer.sub.__dict__


def test_module_list_and_module_dict() -> None:
    layer = ModLayer()
    new = t()
    assign_and_check(layer, "experts[3].scale", new)
    assert layer.experts[3]._buffers["scale"] is new
    assert layer.state_dict(keep_vars=True)["experts.3.scale"] is new
    new2 = t()
    assign_and_check(layer, "moe['w1'].scale", new2)
    assert layer.moe["w1"]._buffers["scale"] is new2
    expert = Expert()
    assign_and_check(layer, "experts[-1]", expert)
    assert layer.experts[3] is expert and layer.experts._modules["3"] is expert


def test_chain_lists_every_object() -> None:
    layer = ModLayer()
    objs = SlotPath("experts[1].scale").chain(layer)
    assert objs[0] is layer and objs[1] is layer.experts and objs[2] is layer.experts[1]
    assert objs[3] is layer.experts[1].scale
    assert len(objs) == 4


def test_resolve_none_as_final_value() -> None:
    layer = Layer(quant_method=NS(kernel=None))
    assert SlotPath("quant_method.kernel").resolve(layer) is None
    new = t()
    assign_and_check(layer, "quant_method.kernel", new)


# ----------------------------------------------------------------------------------------------------
# Paths that do not resolve
# ----------------------------------------------------------------------------------------------------


def expect_path_error(root: object, path: str, prefix: str, *fragments: str) -> PathError:
    sp = SlotPath(path)
    for action in (lambda: sp.resolve(root), lambda: sp.chain(root), lambda: sp.assign(root, t())):
        with pytest.raises(PathError) as info:
            action()
        err = info.value
        assert err.owner == type(root).__name__
        assert err.path == sp.text
        assert err.prefix == prefix
        assert err.failed_at == prefix
        message = str(err)
        assert message.startswith(f"{type(root).__name__}: ")
        assert repr(sp.text) in message
        assert f"at {prefix!r}" in message
        for fragment in fragments:
            assert fragment in message
        assert isinstance(err, LookupError) and isinstance(err, GraphSafeError)
    sentinel = object()
    assert sp.resolve_or(root, sentinel) is sentinel
    assert sp.resolve_or(root) is None
    return err


def test_none_in_the_middle() -> None:
    layer = Layer(quant_method=NS(kernel=None))
    err = expect_path_error(layer, "quant_method.kernel.workspace", "quant_method.kernel", "Layer")
    assert "None at 'quant_method.kernel'" in str(err)
    assert err.reason == "None"


def test_none_in_the_middle_of_a_module() -> None:
    layer = ModLayer()
    layer.quant_method.kernel = None
    err = expect_path_error(layer, "quant_method.kernel.workspace", "quant_method.kernel", "ModLayer")
    assert "None at 'quant_method.kernel'" in str(err)


def test_none_then_item() -> None:
    layer = Layer(cache={"w1": None})
    err = expect_path_error(layer, "cache['w1'][0]", "cache['w1']")
    assert "None at \"cache['w1']\"" in str(err)


def test_missing_first_attribute_fails_at_the_layer() -> None:
    err = expect_path_error(Layer(), "workspace", "<layer>", "no attribute 'workspace' on Layer")
    assert err.owner == "Layer"


def test_missing_nested_attribute() -> None:
    layer = Layer(quant_method=NS(kernel=NS()))
    expect_path_error(layer, "quant_method.kernel.workspace", "quant_method.kernel", "no attribute 'workspace' on NS")
    expect_path_error(layer, "quant_method.kernal.workspace", "quant_method", "no attribute 'kernal'")


def test_missing_module_attribute() -> None:
    expect_path_error(ModLayer(), "sub.nope", "sub", "no attribute 'nope' on Kernel")


def test_missing_dict_key() -> None:
    layer = Layer(cache={"w1": t()})
    expect_path_error(layer, "cache['w9']", "cache", "no item ['w9'] in dict")
    expect_path_error(layer, "cache[0]", "cache", "no item [0] in dict")


def test_index_out_of_range() -> None:
    layer = Layer(experts=[NS(scale=t())], pair=(t(), t()))
    expect_path_error(layer, "experts[3].scale", "experts", "no item [3] in list")
    expect_path_error(layer, "experts[-2]", "experts", "in list")
    expect_path_error(layer, "pair[2]", "pair", "no item [2] in tuple")
    expect_path_error(ModLayer(), "experts[9].scale", "experts", "in ModuleList")
    expect_path_error(ModLayer(), "moe['w2']", "moe", "in ModuleDict")


def test_wrong_key_type() -> None:
    layer = Layer(experts=[t()], n=3, nt=Pair(1, 2))
    expect_path_error(layer, "experts['0']", "experts", "no item ['0'] in list")
    expect_path_error(layer, "n[0]", "n", "in int")
    expect_path_error(layer, "nt['a']", "nt", "in Pair")


def test_closure_misses() -> None:
    def no_closure() -> None:
        return None

    fn = make_closure(1, 2)
    layer = Layer(plain=no_closure, fn=fn, empty=make_empty_cell_closure(), part=functools.partial(act, 1))
    expect_path_error(layer, "plain.__closure__[0]", "plain", "no closure cell 0 on function")
    expect_path_error(layer, "fn.__closure__[2]", "fn", "no closure cell 2")
    expect_path_error(layer, "fn.__closure__[-3]", "fn", "no closure cell -3")
    expect_path_error(layer, "empty.__closure__[0]", "empty", "no closure cell 0")
    expect_path_error(layer, "part.__closure__[0]", "part", "on partial")
    expect_path_error(Layer(), "__closure__[0]", "<layer>", "on Layer")


def test_partial_misses() -> None:
    layer = Layer(act_fn=functools.partial(act, 1, perm=2))
    expect_path_error(layer, "act_fn.args[1]", "act_fn.args", "in tuple")
    expect_path_error(layer, "act_fn.keywords['scale']", "act_fn.keywords", "in dict")


def test_failing_prefix_after_a_cell() -> None:
    fn = make_closure(None, None)
    layer = Layer(act_fn=fn)
    err = expect_path_error(layer, "act_fn.__closure__[0].w", "act_fn.__closure__[0]")
    assert "None at 'act_fn.__closure__[0]'" in str(err)


# ----------------------------------------------------------------------------------------------------
# Assignment into something that cannot take it
# ----------------------------------------------------------------------------------------------------


def expect_assign_error(root: object, path: str, prefix: str, *fragments: str, stable: bool = True) -> PathError:
    """Assignment fails with PathError; with ``stable``, the value at the path is left as it was."""
    sp = SlotPath(path)
    before = sp.resolve(root)  # resolution works; only assignment fails
    with pytest.raises(PathError) as info:
        sp.assign(root, t())
    err = info.value
    assert err.owner == type(root).__name__
    assert err.path == sp.text
    assert err.prefix == prefix
    message = str(err)
    assert message.startswith(f"{type(root).__name__}: ")
    assert f"at {prefix!r}" in message
    for fragment in fragments:
        assert fragment in message
    if stable:
        assert sp.resolve(root) is before
    return err


def test_assign_into_str_item() -> None:
    err = expect_assign_error(Layer(name="abc"), "name[0]", "name", "cannot assign into str")
    assert isinstance(err.__cause__, TypeError)


def test_assign_into_mappingproxy() -> None:
    layer = Layer(ro=types.MappingProxyType({"k": 1}))
    expect_assign_error(layer, "ro['k']", "ro", "cannot assign into mappingproxy")


@pytest.mark.parametrize("cls", [ReadOnlyNoDict, ReadOnlyWithDict])
def test_assign_to_property_without_setter(cls: type) -> None:
    obj = cls()
    err = expect_assign_error(Layer(obj=obj), "obj.value", "obj", f"cannot assign into {cls.__name__}", stable=False)
    assert isinstance(err.__cause__, AttributeError)
    assert "value" not in getattr(obj, "__dict__", {})
    expect_assign_error(obj, "value", "<layer>", f"cannot assign into {cls.__name__}", stable=False)


def test_rebuilt_tuple_cannot_reach_its_parent() -> None:
    obj = TupleBehindProperty()
    old = obj.pair
    expect_assign_error(Layer(obj=obj), "obj.pair[0]", "obj", "cannot assign into TupleBehindProperty")
    assert obj.pair is old


def test_namedtuple_non_field_attribute() -> None:
    layer = Layer(nt=Pair(t(), t()))
    old = layer.nt
    expect_assign_error(layer, "nt.both", "nt", "cannot assign into Pair", stable=False)
    assert layer.nt is old


def test_layer_itself_immutable() -> None:
    root = Pair(t(), t())
    err = expect_assign_error(root, "a", "<layer>", "the layer itself is an immutable container")
    assert err.owner == "Pair"


def test_cells_are_always_writable() -> None:
    fn = make_closure((t(),), None)
    i = fn.__code__.co_freevars.index("first")
    new = t()
    assign_and_check(fn, f"__closure__[{i}][0]", new)
    assert fn()[0][0] is new


def test_module_parameter_refuses_a_plain_tensor_without_shadowing() -> None:
    layer = ModLayer()
    old = layer.sub.weight
    err = expect_assign_error(layer, "sub.weight", "sub", "cannot assign into Kernel", "TypeError")
    assert isinstance(err.__cause__, TypeError)
    assert layer.sub.weight is old
    assert layer.sub._parameters["weight"] is old
    assert "weight" not in layer.sub.__dict__


def test_module_buffer_refuses_a_non_tensor_without_shadowing() -> None:
    layer = ModLayer()
    old = layer.sub.workspace
    with pytest.raises(PathError, match="cannot assign into Kernel") as info:
        SlotPath("sub.workspace").assign(layer, 3)
    assert info.value.prefix == "sub"
    assert layer.sub.workspace is old and layer.sub._buffers["workspace"] is old
    assert "workspace" not in layer.sub.__dict__


def test_module_submodule_refuses_a_tensor() -> None:
    layer = ModLayer()
    old = layer.sub
    expect_assign_error(layer, "sub", "<layer>", "cannot assign into ModLayer")
    assert layer.sub is old and "sub" not in layer.__dict__
    expect_assign_error(layer, "experts[0]", "experts", "cannot assign into ModuleList")


# ----------------------------------------------------------------------------------------------------
# Property tests
# ----------------------------------------------------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True).filter(lambda n: n != "__closure__")
TRICKY_TEXT = st.text(alphabet=st.sampled_from(["'", '"', "\\", "[", "]", ".", " ", "a", "0", "é", "\n"]))
STR_KEYS = TRICKY_TEXT | st.text()
INT_KEYS = st.integers(min_value=-(10**20), max_value=10**20)
ATTRS = NAMES.map(Attr)
ITEMS = (INT_KEYS | STR_KEYS).map(Item)
CELLS = st.integers(min_value=-50, max_value=10**6).map(Cell)
FIRST = ATTRS | CELLS
TOKENS = st.tuples(FIRST, st.lists(ATTRS | ITEMS | CELLS, max_size=8)).map(lambda p: (p[0], *p[1]))


@given(TOKENS)
def test_format_parse_round_trip(tokens: tuple[Token, ...]) -> None:
    text = format_path(tokens)
    assert parse_path(text) == tokens
    assert format_path(parse_path(text)) == text
    sp = SlotPath(text)
    assert sp.tokens == tokens and sp.text == text
    assert sp.prefix(0) == ""
    for n in range(1, len(tokens) + 1):
        assert parse_path(sp.prefix(n)) == tokens[:n]


@given(STR_KEYS)
def test_double_quoted_keys_parse_to_the_same_item(key: str) -> None:
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    assert parse_path(f'x["{escaped}"]') == (Attr("x"), Item(key))
    assert parse_path(f'x["{escaped}"]') == parse_path(format_path((Attr("x"), Item(key))))


PATHISH = st.lists(st.sampled_from([*"ab_0-1.[]'\"\\ ", "__closure__"]), max_size=30).map("".join)


@given(PATHISH | st.text())
def test_arbitrary_text_parses_or_raises_syntax_error(text: str) -> None:
    try:
        tokens = parse_path(text)
    except PathSyntaxError as err:
        assert err.path == text
        assert 0 <= err.position <= len(text)
        return
    assert tokens and isinstance(tokens[0], (Attr, Cell))
    assert Attr("__closure__") not in tokens
    assert parse_path(format_path(tokens)) == tokens
