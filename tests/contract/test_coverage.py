"""Fail closed for real: every place a layer can hold a device tensor that its forward reads.

For each place, the tensor is read by the forward (a captured graph reads its memory), and PWAL moves it to a new
tensor with DIFFERENT values. The oracle is the captured memory itself: a reload may report ``COMMITTED`` only if
the memory the graph captured now holds the new values (graphsafe restored it); anything else must be
``NEEDS_RECAPTURE`` or ``FAILED``. Whatever the outcome, the model must read the values PWAL produced (graphsafe
never writes other values), and nothing but a graphsafe error may escape.

Places the walker can name are restored by ``migrate``; places no path can name give an ``untrackable`` finding.
The crash cases (``ParameterList``/``ParameterDict`` models, a ``__getattr__``/``__getattribute__`` that raises or
recurses on a slot path) must seal and reload, or end in a graphsafe error or finding with a one-line message.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import (
    ContractViolation,
    DeclarationError,
    FindingKind,
    GraphContract,
    GraphSafeError,
    Status,
    graph_visible,
    migration_report,
)
from graphsafe.collectors import walk
from graphsafe.errors import PathError
from graphsafe.paths import Attr, Cell, Item, SlotPath, format_path, parse_path

MODES = ("strict", "recapture", "migrate")
N = 4

# Strong references the walker cannot see (module globals are never walked): what a weak reference points at.
OUTSIDE: dict[tuple[int, str], torch.Tensor] = {}
_NEXT: list[torch.Tensor] = []  # what the lru_cache'd producer hands out next


def values(seed: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + 10.0 * seed + 1.0


class Host(nn.Module):
    """A layer with a weight (so the walker's devices are {cpu}); the place under test holds a second tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(N), requires_grad=False)


class Model(nn.Module):
    def __init__(self, host: nn.Module) -> None:
        super().__init__()
        self.layer = host


def fresh_host() -> Host:
    # A class of its own per test: class attributes and class-level caches must not leak between tests.
    return type("FreshHost", (Host,), {})()


class Helper(nn.Module):
    """A module held in a plain list: not registered anywhere, so no seal sees it as a layer."""

    def __init__(self) -> None:
        super().__init__()


class Wrapper(torch.Tensor):
    """A wrapper tensor subclass: no storage of its own, the data lives in an inner tensor."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        made._inner = inner
        return made  # type: ignore[no-any-return]

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_inner"], None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x._inner if isinstance(x, Wrapper) else x

        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _hook_scale(scale: torch.Tensor, module: nn.Module, args: Any) -> None:
    return None  # a real hook would read `scale`; the test reads it where the hook holds it


def _produce(key: str) -> torch.Tensor:
    return _NEXT.pop()


@dataclass(frozen=True)
class Place:
    """Where a layer holds the tensor: install it at build, read it as forward does, move it as PWAL does."""

    install: Callable[[Host, torch.Tensor], None]
    read: Callable[[Host], torch.Tensor]
    move: Callable[[Host, torch.Tensor], None]
    #: Whether a slot path can name it (then migrate restores it); otherwise an untrackable finding is due.
    nameable: bool


def _weak_install(layer: Host, t: torch.Tensor) -> None:
    OUTSIDE[id(layer), "ref"] = t
    layer.ref = weakref.ref(t)


def _weak_move(layer: Host, t: torch.Tensor) -> None:
    OUTSIDE[id(layer), "ref"] = t
    layer.ref = weakref.ref(t)


def _wvd_install(layer: Host, t: torch.Tensor) -> None:
    OUTSIDE[id(layer), "wvd"] = t
    layer.cache = weakref.WeakValueDictionary({"ws": t})


def _wvd_move(layer: Host, t: torch.Tensor) -> None:
    OUTSIDE[id(layer), "wvd"] = t
    layer.cache["ws"] = t


def _helper_install(layer: Host, t: torch.Tensor) -> None:
    helper = Helper()
    helper.buf = t
    layer.helpers = [helper]


def _helper_buffer_install(layer: Host, t: torch.Tensor) -> None:
    helper = Helper()
    helper.register_buffer("b", t)
    layer.helpers = [helper]


def _hook_install(kind: str) -> Callable[[Host, torch.Tensor], None]:
    def install(layer: Host, t: torch.Tensor) -> None:
        register = layer.register_forward_pre_hook if kind == "pre" else layer.register_forward_hook
        layer.hook_id = register(functools.partial(_hook_scale, t)).id

    return install


def _hooks(layer: Host, kind: str) -> Any:
    return layer._forward_pre_hooks if kind == "pre" else layer._forward_hooks


def _lru_install(maxsize: int | None) -> Callable[[Host, torch.Tensor], None]:
    def install(layer: Host, t: torch.Tensor) -> None:
        layer.get_ws = functools.lru_cache(maxsize=maxsize)(_produce)
        _NEXT.append(t)
        layer.get_ws("ws")

    return install


def _lru_move(layer: Host, t: torch.Tensor) -> None:
    layer.get_ws.cache_clear()
    _NEXT.append(t)
    layer.get_ws("ws")


def _cv_install(layer: Host, t: torch.Tensor) -> None:
    layer.cv = contextvars.ContextVar(f"ws{id(layer)}")
    layer.cv.set(t)


KEY = (8, torch.float32)

PLACES: dict[str, Place] = {
    "weakref": Place(_weak_install, lambda layer: layer.ref(), _weak_move, False),
    "weak_value_dict": Place(_wvd_install, lambda layer: layer.cache["ws"], _wvd_move, False),
    "class_attribute": Place(
        lambda layer, t: setattr(type(layer), "table", t),
        lambda layer: type(layer).table,
        lambda layer, t: setattr(type(layer), "table", t),
        False,  # `table` names it, but assigning through an instance would shadow, not restore, it
    ),
    "parameter_attribute": Place(
        lambda layer, t: setattr(layer.weight, "g_idx", t),
        lambda layer: layer.weight.g_idx,
        lambda layer, t: setattr(layer.weight, "g_idx", t),
        True,
    ),
    "module_in_list": Place(
        _helper_install, lambda layer: layer.helpers[0].buf, lambda layer, t: setattr(layer.helpers[0], "buf", t), True
    ),
    "module_in_list_buffer": Place(
        _helper_buffer_install,
        lambda layer: layer.helpers[0].b,
        lambda layer, t: setattr(layer.helpers[0], "b", t),
        True,
    ),
    "forward_pre_hook_partial": Place(
        _hook_install("pre"),
        lambda layer: _hooks(layer, "pre")[layer.hook_id].args[0],
        lambda layer, t: _hooks(layer, "pre").__setitem__(layer.hook_id, functools.partial(_hook_scale, t)),
        True,
    ),
    "forward_hook_partial": Place(
        _hook_install("post"),
        lambda layer: _hooks(layer, "post")[layer.hook_id].args[0],
        lambda layer, t: _hooks(layer, "post").__setitem__(layer.hook_id, functools.partial(_hook_scale, t)),
        True,
    ),
    "lru_cache": Place(_lru_install(None), lambda layer: layer.get_ws("ws"), _lru_move, False),
    "lru_cache_bounded": Place(_lru_install(8), lambda layer: layer.get_ws("ws"), _lru_move, False),
    "contextvar": Place(_cv_install, lambda layer: layer.cv.get(), lambda layer, t: layer.cv.set(t), False),
    "wrapper_subclass": Place(
        lambda layer, t: setattr(layer, "w", Wrapper(t)),
        lambda layer: layer.w._inner,
        lambda layer, t: setattr(layer, "w", Wrapper(t)),
        True,
    ),
    "set_member": Place(
        lambda layer, t: setattr(layer, "members", {t}),
        lambda layer: next(iter(layer.members)),
        lambda layer, t: setattr(layer, "members", {t}),
        False,
    ),
    "tuple_key": Place(
        lambda layer, t: setattr(layer, "ws", {KEY: t}),
        lambda layer: layer.ws[KEY],
        lambda layer, t: layer.ws.__setitem__(KEY, t),
        True,
    ),
    "non_ascii_attribute": Place(
        lambda layer, t: setattr(layer, "échelle", t),
        lambda layer: layer.échelle,
        lambda layer, t: setattr(layer, "échelle", t),
        True,
    ),
    "non_identifier_attribute": Place(
        lambda layer, t: setattr(layer, "ws 8", t),
        lambda layer: getattr(layer, "ws 8"),
        lambda layer, t: setattr(layer, "ws 8", t),
        True,
    ),
}


def reload_place(place: Place, mode: str) -> tuple[Any, torch.Tensor]:
    """Seal, take the memory the graph captured, reload with PWAL moving the tensor; check the oracle."""
    host = fresh_host()
    model = Model(host)
    place.install(host, values(0))
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    captured = place.read(host)
    assert torch.equal(captured, values(0))
    new = values(1)
    try:
        with contract.reload():
            place.move(host, new.clone())
    except ContractViolation:
        pass  # strict: the outcome says why; only graphsafe's own errors may escape
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, new), "COMMITTED while the captured memory holds the old values"
    assert torch.equal(place.read(host), new), "the model must read the values PWAL produced"
    return outcome, captured


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PLACES))
def test_a_moved_tensor_is_never_committed_at_stale_memory(name: str, mode: str) -> None:
    place = PLACES[name]
    outcome, _captured = reload_place(place, mode)
    if mode == "migrate" and place.nameable:
        # A path names it and assign can write it: migrate restores it into the captured memory.
        assert outcome.status is Status.COMMITTED, outcome.summary()
        assert [f.kind for f in outcome.findings] == [FindingKind.AUTO_RESTORED]
    elif mode == "strict":
        assert outcome.status is Status.FAILED
    else:
        assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    if not place.nameable and name != "class_attribute":
        assert FindingKind.UNTRACKABLE in {f.kind for f in outcome.problems}, outcome.summary()


@pytest.mark.parametrize("name", sorted(name for name, place in PLACES.items() if not place.nameable))
def test_untrackable_places_are_findings_with_advice_and_in_the_report(name: str) -> None:
    place = PLACES[name]
    host = fresh_host()
    model = Model(host)
    place.install(host, values(0))
    contract = GraphContract(model, "strict").seal()
    with pytest.raises(ContractViolation) as info, contract.reload():
        place.move(host, values(1))
    problems = info.value.outcome.problems if info.value.outcome else ()
    if name == "class_attribute":
        assert [(f.kind, f.path) for f in problems] == [(FindingKind.MOVED, "table")]
        (ref,) = walk(host).refs
        assert ref.path == "table" and not ref.restorable and "class attribute" in (ref.reason or "")
        return
    untrackable = [f for f in problems if f.kind is FindingKind.UNTRACKABLE]
    assert untrackable and all(f.layer == "layer" and not f.declared for f in untrackable)
    for finding in untrackable:
        assert "\n" not in finding.detail and "declare" in finding.detail
    assert "untrackable" in str(info.value)
    report = migration_report(model)
    # A finding of the report with its fix , not a note.
    assert any(u.where.startswith("layer ") for u in report.untrackable), report.untrackable
    assert not any("untrackable" in note for note in report.notes), report.notes


def test_an_untrackable_tensor_fails_every_reload_not_only_the_one_that_moved_it() -> None:
    """Nothing can tell whether an unnameable tensor moved, so even a reload that leaves it alone is not COMMITTED."""
    host = fresh_host()
    model = Model(host)
    PLACES["set_member"].install(host, values(0))
    contract = GraphContract(model, "recapture").seal()
    with contract.reload():
        pass
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.NEEDS_RECAPTURE


def test_a_tensor_reachable_by_a_path_and_a_set_is_still_untrackable() -> None:
    host = fresh_host()
    model = Model(host)
    host.ws = values(0)
    host.members = {host.ws}
    contract = GraphContract(model, "migrate").seal()
    with contract.reload():
        host.ws = values(1)  # the path is restored; the set still holds the new tensor the forward may read
        host.members = {host.ws}
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE
    assert FindingKind.UNTRACKABLE in {f.kind for f in outcome.problems}


def test_untrackable_ranks_and_is_fixed_by_a_recapture() -> None:
    kind = FindingKind.UNTRACKABLE
    assert kind.value == "untrackable" and kind.is_problem and kind.recapture_fixes
    assert kind.rank < FindingKind.AUTO_RESTORED.rank


# ----------------------------------------------------------------------------------------------------------------
# Walker: the new places, named where a path can name them


def test_walker_names_the_new_places() -> None:
    host = fresh_host()
    for name in ("parameter_attribute", "module_in_list", "tuple_key", "wrapper_subclass"):
        PLACES[name].install(host, values(0))
    host.helpers[0].register_buffer("b", values(0))
    PLACES["forward_pre_hook_partial"].install(host, values(0))
    PLACES["non_ascii_attribute"].install(host, values(0))
    result = walk(host, units={id(host)})
    found = {ref.path: ref for ref in result.refs}
    hook = f"_forward_pre_hooks[{host.hook_id}].args[0]"
    expected = {
        "weight.g_idx",
        "helpers[0].buf",
        "helpers[0]._buffers['b']",
        "ws[(8, torch.float32)]",
        "w._inner",
        hook,
        "échelle",
    }
    assert expected <= set(found), sorted(found)
    for path in expected:
        assert SlotPath(path).resolve(host) is found[path].tensor, path
        assert found[path].restorable, (path, found[path].reason)
    assert "weight" not in found  # the parameter itself is the seal's, not a walker find
    assert result.notes == (), result.notes  # the wrapper has no storage, but its inner tensor is tracked


def test_walker_without_units_still_treats_every_module_as_its_own_unit() -> None:
    host = fresh_host()
    PLACES["module_in_list"].install(host, values(0))
    assert "helpers[0].buf" not in {ref.path for ref in walk(host).refs}
    assert "helpers[0].buf" in {ref.path for ref in walk(host, units=()).refs}


def test_walker_does_not_enter_registered_modules_held_in_a_list() -> None:
    model = nn.Module()
    model.a = fresh_host()
    model.b = fresh_host()
    model.b.peers = [model.a]  # a reference to a sibling layer: that layer is its own reload unit
    model.a.t = values(0)
    units = {id(m) for m in model.modules()}
    assert walk(model.b, units=units).refs == ()


def test_walker_sees_referents_contextvars_and_caches_without_calling_user_code() -> None:
    host = fresh_host()
    for name in ("weakref", "weak_value_dict", "lru_cache", "lru_cache_bounded", "contextvar", "set_member"):
        PLACES[name].install(host, values(0))
    notes = walk(host).notes
    for attribute in ("ref", "cache", "get_ws", "cv", "members"):
        assert any(note.startswith(attribute) for note in notes), (attribute, notes)


def test_a_class_level_lru_cache_method_is_seen() -> None:
    class Cached(Host):
        @functools.cache  # noqa: B019 (the pattern under test)
        def workspace(self, n: int) -> torch.Tensor:
            return torch.zeros(n)

    host = Cached()
    host.workspace(3)
    assert any("workspace" in note for note in walk(host).notes)


# ----------------------------------------------------------------------------------------------------------------
# Crashes


class ListModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(N)), nn.Parameter(torch.zeros(N))])
        self.pd = nn.ParameterDict({"a": nn.Parameter(torch.zeros(N)), "b c": nn.Parameter(torch.zeros(N))})


@pytest.mark.parametrize("rebind", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_parameter_list_and_dict_models_seal_and_reload(mode: str, rebind: bool) -> None:
    model = ListModel()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    assert {s.path for s in contract.slots()} >= {"0", "1", "a", "'b c'"}
    captured = [model.ps[0], model.ps[1], model.pd["a"], model.pd["b c"]]
    with contract.reload():
        for seed, p in enumerate(captured):
            if rebind:  # a loader that binds new parameters instead of copying into the captured ones
                new = nn.Parameter(values(seed + 1))
                if p is model.ps[0] or p is model.ps[1]:
                    model.ps[0 if p is model.ps[0] else 1] = new
                else:
                    model.pd["a" if p is model.pd["a"] else "b c"] = new
            else:
                p.data.copy_(values(seed + 1))
    assert contract.last_outcome is not None and contract.last_outcome.committed, contract.last_outcome.summary()
    now = [model.ps[0], model.ps[1], model.pd["a"], model.pd["b c"]]
    for seed, (old, current) in enumerate(zip(captured, now, strict=True)):
        assert current is old and torch.equal(old, values(seed + 1))


class Touchy:
    """A kernel object whose attribute access runs user code that may raise."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.broken = False

    def __getattribute__(self, name: str) -> Any:
        if name == "t" and object.__getattribute__(self, "broken"):
            raise RuntimeError("kernel handle closed")
        return object.__getattribute__(self, name)


class Delegating(Host):
    """A layer whose ``__getattr__`` delegates to an inner object that is not there: it recurses."""

    def __init__(self) -> None:
        super().__init__()
        self.delegating = True

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not self.__dict__.get("delegating"):
                raise
            return getattr(self.inner, name)


@pytest.mark.parametrize("mode", MODES)
def test_a_raising_getattribute_on_a_slot_path_is_a_finding(mode: str) -> None:
    host = fresh_host()
    model = Model(host)
    host.kernel = Touchy(values(0))
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    try:
        with contract.reload():
            host.kernel.broken = True
    except ContractViolation:
        pass
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED
    (finding,) = outcome.problems
    assert finding.path == "kernel.t" and finding.kind is FindingKind.VANISHED
    assert "RuntimeError" in finding.detail and "kernel handle closed" in finding.detail
    assert "\n" not in finding.detail


@pytest.mark.parametrize("mode", MODES)
def test_a_recursing_getattr_on_the_layer_is_a_finding(mode: str) -> None:
    host = Delegating()
    model = Model(host)
    host.ws = values(0)
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    try:
        with contract.reload():
            del host.ws
    except ContractViolation:
        pass
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED
    (finding,) = outcome.problems
    assert finding.path == "ws" and finding.kind is FindingKind.VANISHED
    assert "RecursionError" in finding.detail


def test_a_declared_path_whose_getattr_raises_is_a_declaration_error() -> None:
    class Method:
        @graph_visible("kernel.t")
        def process_weights_after_loading(self, layer: Host) -> None:
            layer.kernel = Touchy(values(0))

    host = fresh_host()
    Method().process_weights_after_loading(host)
    host.kernel.broken = True
    model = Model(host)
    with pytest.raises(DeclarationError) as info:
        GraphContract(model).seal()
    message = str(info.value)
    assert "kernel.t" in message and "RuntimeError" in message and "\n" not in message


def test_resolving_through_a_raising_getattr_is_a_path_error() -> None:
    box = Touchy(values(0))
    box.broken = True
    holder = fresh_host()
    holder.box = box
    with pytest.raises(PathError, match="RuntimeError"):
        SlotPath("box.t").resolve(holder)
    assert SlotPath("box.t").resolve_or(holder, None) is None
    with pytest.raises(GraphSafeError):
        SlotPath("box.t").assign(holder, values(1))


# ----------------------------------------------------------------------------------------------------------------
# Paths: the extended grammar


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("0", (Attr("0"),)),
        ("ps.12", (Attr("ps"), Attr("12"))),
        ("échelle", (Attr("échelle"),)),
        ("'ws 8'", (Attr("ws 8"),)),
        ("a.'b.c'[0]", (Attr("a"), Attr("b.c"), Item(0))),
        ("ws[(8, torch.float32)]", (Attr("ws"), Item((8, torch.float32)))),
        ("ws[('a', (1, None), True)]", (Attr("ws"), Item(("a", (1, None), True)))),
        ("ws[(1,)]", (Attr("ws"), Item((1,)))),
        ("ws[()]", (Attr("ws"), Item(()))),
        ("ws[torch.int8]", (Attr("ws"), Item(torch.int8))),
        ("f.__closure__[0]", (Attr("f"), Cell(0))),
    ],
)
def test_extended_grammar_parses_and_formats_back(text: str, tokens: tuple[Any, ...]) -> None:
    assert parse_path(text) == tokens
    assert format_path(tokens) == text


@pytest.mark.parametrize("text", ["ws[(8 torch.float32)]", "ws[torch.nope]", "ws[(1, 2]", "'unterminated", "a.'b'c"])
def test_extended_grammar_rejects_bad_text(text: str) -> None:
    from graphsafe.errors import PathSyntaxError

    with pytest.raises(PathSyntaxError):
        parse_path(text)


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
_SCALARS = st.one_of(
    st.integers(-(10**6), 10**6), st.text(max_size=6), st.booleans(), st.none(), st.sampled_from(_DTYPES)
)
_KEYS = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)
_NAMES = st.text(min_size=0, max_size=8).filter(lambda name: not (name.startswith("__") and name.endswith("__")))


@settings(max_examples=300, deadline=None)
@given(names=st.lists(_NAMES, min_size=1, max_size=3), keys=st.lists(_KEYS, max_size=3))
def test_every_attribute_name_and_plain_key_round_trips_and_resolves(names: list[str], keys: list[Any]) -> None:
    """An independent oracle: build the object graph by hand, then resolve/assign the formatted path on it."""
    tokens = (*(Attr(n) for n in names), *(Item(k) for k in keys))
    text = format_path(tokens)
    assert parse_path(text) == tokens
    # Build objects along the path: plain objects for attributes, dicts for keys.
    leaf = torch.zeros(1)
    root = type("Root", (), {})()
    node: Any = root
    for index, token in enumerate(tokens):
        last = index == len(tokens) - 1
        nxt: Any = leaf if last else (type("Obj", (), {})() if isinstance(tokens[index + 1], Attr) else {})
        if isinstance(token, Attr):
            node.__dict__[token.name] = nxt
        else:
            node[token.key] = nxt
        node = nxt
    path = SlotPath(text)
    assert path.resolve(root) is leaf
    other = torch.ones(1)
    path.assign(root, other)
    assert path.resolve(root) is other


def test_the_report_of_a_contract_says_each_untrackable_place_once() -> None:
    """The seal's walk, the reload's finding and the report's own walk see one place: one untrackable finding of the
    report, with its fix."""
    host = fresh_host()
    model = Model(host)
    PLACES["set_member"].install(host, values(0))
    contract = GraphContract(model, "recapture").seal()
    with contract.reload():
        PLACES["set_member"].move(host, values(1))
    places = migration_report(contract).untrackable
    assert len(places) == 1, places
    assert places[0].where == "layer (FreshHost)" and "a member of a set" in places[0].detail
    assert "declare that path" in places[0].fix
