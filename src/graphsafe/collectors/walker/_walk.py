"""The walker: every device tensor reachable from a layer, named by a slot path.

After a reload, ``process_weights_after_loading`` re-creates derived tensors (workspaces, strides, permutations,
scales) wherever it likes under a layer; a captured graph keeps reading the old memory. :func:`walk` finds those
tensors so undeclared drift can be detected.

What is walked: the layer's own instance attributes that are not torch's ``nn.Module`` bookkeeping (parameters,
buffers and child modules are someone else's business), then, recursively, plain objects (``__dict__`` and
``__slots__``), dicts (``str``/``int`` keys), lists, deques, tuples, NamedTuples, ``functools.partial``
(``func``, ``args``, ``keywords``), functions (closure cells, ``__defaults__``, ``__kwdefaults__``), bound
methods (``__func__``, and ``__self__`` unless it is a module), builtin methods (``__self__``) and
mappingproxies. Never entered: child modules (each is its own reload unit), classes, Python modules, enums,
streams/events/graphs, dtypes, devices, scalars, strings, weak references, generators and files.

The walker never runs user code: attributes are read through the C-level ``__dict__``/slot descriptors found in
the class dictionaries, containers through the builtin methods of ``dict``/``list``/``tuple``/``set``, type
tests compare ids along the MRO, and no user object is hashed or compared. Tensor metadata is read with
subclass ``__torch_function__`` disabled.

Alias policy: every distinct object is read once (``objects_visited`` counts them, which also makes cycles
harmless), but a tensor is reported under *every* simple path (one that passes through no object twice) from the
layer to it, through whatever containers: an aliased workspace, or a dict shared by two owners, shows up under
each path. Restoring needs all of them, since a rebound tuple or a replaced attribute only changes one parent.
Tensors that no path can name (members of sets, values under non-``str``/``int`` dict keys, attributes shadowed
by a data descriptor) are not reported; :attr:`WalkResult.notes` says where they are.

Budgets: ``max_objects`` bounds how many distinct objects are read (each container is read in full) and how many
path steps the alias enumeration takes; ``max_depth`` bounds path length. Hitting either is never silent:
:attr:`WalkResult.exhausted` names the budget and the first path where it cut.
"""

from __future__ import annotations

import _io
import collections
import enum
import functools
import gc
import io
import logging
import re
import threading
import types
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.outcome import Fingerprint, fingerprint

__all__ = ["TensorRef", "WalkResult", "collect", "walk"]


# Not frozen: construction is per tensor on the walk's hot path, and a frozen dataclass pays an
# object.__setattr__ per field. Treat instances as immutable.
@dataclass(slots=True, eq=False)
class TensorRef:
    """One device tensor and one path to it (a tensor reachable by several paths gets one ref per path).

    ``eq=False``: comparing two refs field by field would compare tensors elementwise.
    """

    path: str
    tensor: torch.Tensor
    fingerprint: Fingerprint
    restorable: bool
    reason: str | None


@dataclass(frozen=True, slots=True)
class WalkResult:
    """What :func:`walk` found, how much it read, and whether a budget cut it short."""

    refs: tuple[TensorRef, ...]
    objects_visited: int
    exhausted: str | None
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------------------------
# Pure, C-level accessors (none of them can dispatch to Python code defined by a user class).

_TYPE_DICT: Final = type.__dict__["__dict__"].__get__
_TYPE_MRO: Final = type.__dict__["__mro__"].__get__
_TYPE_NAME: Final = type.__dict__["__qualname__"].__get__
_DESCRIPTOR_TYPES: Final = (types.GetSetDescriptorType, types.MemberDescriptorType)

_FUNC_CLOSURE: Final = types.FunctionType.__dict__["__closure__"].__get__
_FUNC_DEFAULTS: Final = types.FunctionType.__dict__["__defaults__"].__get__
_FUNC_KWDEFAULTS: Final = types.FunctionType.__dict__["__kwdefaults__"].__get__
_CELL_CONTENTS: Final = types.CellType.__dict__["cell_contents"].__get__
_METHOD_FUNC: Final = types.MethodType.__dict__["__func__"].__get__
_METHOD_SELF: Final = types.MethodType.__dict__["__self__"].__get__
_BUILTIN_SELF: Final = types.BuiltinFunctionType.__dict__["__self__"].__get__
_WRAPPER_SELF: Final = types.MethodWrapperType.__dict__["__self__"].__get__
_PARTIAL_FUNC: Final = functools.partial.__dict__["func"].__get__
_PARTIAL_ARGS: Final = functools.partial.__dict__["args"].__get__
_PARTIAL_KEYWORDS: Final = functools.partial.__dict__["keywords"].__get__
_TENSOR_DEVICE: Final = torch._C.TensorBase.__dict__["device"].__get__
_TUPLEGETTER: Final = type(_TYPE_DICT(collections.namedtuple("_NT", "a"))["a"])

_DICT_ITEMS: Final = dict.items
_LIST_ITER: Final = list.__iter__
_TUPLE_ITER: Final = tuple.__iter__
_DEQUE_ITER: Final = collections.deque.__iter__
_SET_ITER: Final = set.__iter__
_FROZENSET_ITER: Final = frozenset.__iter__

_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# torch's own per-instance Module state; anything a subclass adds (with or without a leading underscore) is walked.
_MODULE_INTERNALS: Final = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}

# --------------------------------------------------------------------------------------------------------------
# Per-class plans.

_LEAF, _SKIP, _TENSOR, _OBJECT, _DICT, _LIST, _DEQUE, _TUPLE, _NTUPLE, _SET, _FSET, _PROXY = range(12)
_PARTIAL, _FUNCTION, _METHOD, _BUILTIN, _WRAPPER = range(12, 17)

# Edge token kinds; _UNNAMED edges carry the reason no path can name the child.
_TK_ATTR, _TK_ITEM, _TK_CELL, _TK_UNNAMED = range(4)
# How assign writes through an edge: in place (done), by rebuilding the container into its parent, not at all.
_W_INPLACE, _W_REBUILD, _W_NONE, _W_UNRESOLVED = range(4)


def _resolve_names(dotted: tuple[str, ...]) -> list[type]:
    """Classes by dotted name, skipping those this torch build lacks."""
    found: list[type] = []
    for name in dotted:
        obj: Any = torch if name.startswith("torch.") else None
        parts = name.split(".")[1:] if obj is not None else []
        for part in parts:
            obj = getattr(obj, part, None)
        if isinstance(obj, type):
            found.append(obj)
    return found


_LEAF_BASES: Final[tuple[type, ...]] = (
    type,
    types.ModuleType,
    str,
    bytes,
    bytearray,
    memoryview,
    int,
    float,
    complex,
    type(None),
    type(Ellipsis),
    type(NotImplemented),
    range,
    slice,
    enum.Enum,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.CodeType,
    types.FrameType,
    types.TracebackType,
    types.CellType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    property,
    weakref.ReferenceType,
    weakref.ProxyType,
    weakref.CallableProxyType,
    io.IOBase,
    _io._IOBase,  # the C base of every file object (io.IOBase is an ABC they are only registered with)
    logging.Logger,
    logging.Handler,
    logging.Manager,
    threading.Thread,
    type(threading.Lock()),
    type(threading.RLock()),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    torch.Generator,
    torch.finfo,
    torch.iinfo,
    *_resolve_names(
        (
            "torch.qscheme",
            "torch.Stream",
            "torch.Event",
            "torch.cuda.Stream",
            "torch.cuda.Event",
            "torch.cuda.CUDAGraph",
            "torch._C._CudaStreamBase",
            "torch._C._CudaEventBase",
            "torch._C._CUDAGraph",
            "torch._utils._CudaStreamBase",
            "torch._utils._CudaEventBase",
            "torch._utils._CUDAGraph",
            "torch.UntypedStorage",
            "torch.TypedStorage",
            "torch._C.StorageBase",
            "torch._ops.OperatorBase",
            "torch._ops.OpOverloadPacket",
            "torch._ops._OpNamespace",
            "torch.SymInt",
            "torch.SymFloat",
            "torch.SymBool",
        )
    ),
)

# Checked in this order along the MRO (first match wins), so a Module or tensor subclass is never a plain object.
_KIND_BASES: Final[tuple[tuple[type, int], ...]] = (
    (torch._C.TensorBase, _TENSOR),
    (nn.Module, _SKIP),
    *((base, _LEAF) for base in _LEAF_BASES),
    (dict, _DICT),
    (list, _LIST),
    (collections.deque, _DEQUE),
    (tuple, _TUPLE),
    (set, _SET),
    (frozenset, _FSET),
    (types.MappingProxyType, _PROXY),
    (functools.partial, _PARTIAL),
    (types.FunctionType, _FUNCTION),
    (types.MethodType, _METHOD),
    (types.BuiltinFunctionType, _BUILTIN),
    (types.MethodWrapperType, _WRAPPER),
)
_CONTAINERS: Final[dict[int, type]] = {
    _DICT: dict,
    _LIST: list,
    _DEQUE: collections.deque,
    _TUPLE: tuple,
    _NTUPLE: tuple,
    _PARTIAL: functools.partial,
}
_KIND_BY_ID: Final = {id(base): kind for base, kind in _KIND_BASES}
_KIND_ORDER: Final = {id(base): order for order, (base, _) in enumerate(_KIND_BASES)}


_C_CODE_TYPES: Final = (
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
)


def _python_owner(pairs: list[tuple[type, Any]], name: str) -> str | None:
    """The class that defines ``name`` (first along the MRO) when that definition is Python code, else None."""
    for klass, d in pairs:
        if name in d:
            # type identity, not isinstance: isinstance may consult a user-defined __class__
            return None if any(type(d[name]) is t for t in _C_CODE_TYPES) else _TYPE_NAME(klass)
    return None


class _Plan:
    """What the walker needs to know about one class, computed once."""

    __slots__ = (
        "attr_caveat",
        "attrs",
        "cls",
        "data_descriptors",
        "dict_get",
        "fields",
        "item_caveat",
        "kind",
        "name",
        "rebuild_reason",
        "shadowed_slots",
        "slots",
    )

    def __init__(self, cls: type) -> None:
        self.cls = cls  # keeps the class (and so its id) alive while the plan is cached
        self.name: str = _TYPE_NAME(cls)
        mro: tuple[type, ...] = _TYPE_MRO(cls)
        dicts = [_TYPE_DICT(klass) for klass in mro]
        pairs = list(zip(mro, dicts, strict=True))

        # The most specific known base decides the kind (a dict subclass of a leaf type stays a leaf).
        best: tuple[int, int] | None = None
        for klass in mro:
            order = _KIND_ORDER.get(id(klass))
            if order is not None and (best is None or order < best[0]):
                best = (order, _KIND_BY_ID[id(klass)])
        kind = best[1] if best is not None else _OBJECT

        # First definition of every name along the MRO: what attribute lookup would find on the class.
        first: dict[str, Any] = {}
        for d in reversed(dicts):
            first.update(d)

        def data_descriptor(value: Any) -> bool:
            return any("__set__" in d or "__delete__" in d for d in map(_TYPE_DICT, _TYPE_MRO(type(value))))

        self.attr_caveat: str | None = None
        self.item_caveat: str | None = None
        self.dict_get: Any = None
        self.slots: tuple[tuple[str, Any], ...] = ()
        self.shadowed_slots: tuple[tuple[str, Any], ...] = ()  # (why no path names it, getter)
        self.data_descriptors: frozenset[str] = frozenset()
        self.fields: tuple[tuple[int, str | None], ...] = ()
        self.rebuild_reason: str | None = None

        owner = _python_owner(pairs, "__getattribute__")
        if owner is not None:
            self.attr_caveat = f"resolving it runs {owner}.__getattribute__"
        if kind in (_DICT, _LIST, _DEQUE, _TUPLE):
            owner = _python_owner(pairs, "__getitem__")
            if owner is not None:
                self.item_caveat = f"resolving it runs {owner}.__getitem__"

        if kind == _TUPLE:
            fields = first.get("_fields")
            if type(fields) is tuple and all(type(f) is str for f in fields) and "_make" in first:
                kind = _NTUPLE
                self.fields = tuple(
                    (i, f if type(first.get(f)) is _TUPLEGETTER and _NAME_RE.fullmatch(f) else None)
                    for i, f in enumerate(fields)
                )
            elif _python_owner(pairs, "__new__") or _python_owner(pairs, "__init__"):
                self.rebuild_reason = f"inside a {self.name} (a tuple subclass assign cannot rebuild)"
        self.kind = kind

        # Instance state of plain objects, and of user subclasses of containers (builtin containers have none).
        if kind in (_OBJECT, _SKIP) or (kind in _CONTAINERS and _CONTAINERS[kind] is not cls):
            dict_descr: Any = first.get("__dict__")
            if any(type(dict_descr) is t for t in _DESCRIPTOR_TYPES):
                self.dict_get = dict_descr.__get__
            slots: list[tuple[str, Any]] = []
            shadowed: list[tuple[str, Any]] = []
            for klass, d in pairs:
                if "__slots__" not in d:  # C types' own members (partial.func, ...) are not instance slots
                    continue
                for name, value in d.items():
                    if type(value) is not types.MemberDescriptorType or name in ("__dict__", "__weakref__"):
                        continue
                    getter: Any = value.__get__
                    if first.get(name) is value:
                        slots.append((name, getter))
                    else:
                        why = f"slot {name!r} of {_TYPE_NAME(klass)} is shadowed by a class attribute"
                        shadowed.append((why, getter))
            self.slots = tuple(slots)
            self.shadowed_slots = tuple(shadowed)
            self.data_descriptors = frozenset(
                name
                for name, value in first.items()
                if type(name) is str and not name.startswith("__") and data_descriptor(value)
            )
            if kind == _OBJECT and self.dict_get is None and not slots and not shadowed:
                self.kind = _LEAF  # a C type without instance state we could read
        self.attrs = self.dict_get is not None or bool(self.slots) or bool(self.shadowed_slots)


_PLANS: dict[int, _Plan] = {}  # by id(cls): hashing a class could run a metaclass's __hash__
_KINDS: dict[int, int] = {}  # the same, kind only: the hot loops' leaf test
_PLAN_CACHE_LIMIT: Final = 20_000


def _plan_for(cls: type) -> _Plan:
    if len(_PLANS) >= _PLAN_CACHE_LIMIT:  # dynamically created classes must not accumulate forever
        _PLANS.clear()
        _KINDS.clear()
    plan = _Plan(cls)
    _PLANS[id(cls)] = plan
    _KINDS[id(cls)] = plan.kind
    return plan


# --------------------------------------------------------------------------------------------------------------
# Devices.


class _DeviceFilter:
    """Which devices to report; a device without an index (``"cuda"``) stands for every index of its type."""

    __slots__ = ("any_index", "everything", "exact")

    def __init__(self, devices: Collection[torch.device | str] | None) -> None:
        self.everything = devices is None
        self.exact: set[torch.device] = set()
        self.any_index: set[str] = set()
        for device in devices or ():
            dev = torch.device(device)
            if dev.index is None:
                self.any_index.add(dev.type)
                if dev.type == "cpu":
                    self.exact.add(dev)
            else:
                self.exact.add(dev)


def _layer_devices(layer: object) -> set[torch.device]:
    """Devices of the parameters and buffers of ``layer`` and its submodules, read without running module code."""
    found: set[torch.device] = set()
    seen: set[int] = set()
    stack = [layer]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        plan = _PLANS.get(id(type(module))) or _plan_for(type(module))
        state = plan.dict_get(module) if plan.dict_get is not None else {}
        for key in ("_parameters", "_buffers"):
            table = state.get(key)
            if type(table) is dict:
                for tensor in dict.values(table):
                    if _kind_of(tensor) == _TENSOR:
                        found.add(_TENSOR_DEVICE(tensor))
        children = state.get("_modules")
        if type(children) is dict:
            stack.extend(child for child in dict.values(children) if child is not None)
    found.discard(torch.device("meta"))
    return found


def _kind_of(obj: object) -> int:
    cls = type(obj)
    plan = _PLANS.get(id(cls)) or _plan_for(cls)
    return plan.kind


# --------------------------------------------------------------------------------------------------------------
# The walk.

_Kid = tuple[int, Any, Any, int, int, str | None]  # token kind, key, child, child kind, write mode, reason


def _segment(kind: int, key: Any, first: bool) -> str:
    """One token's text, exactly as :func:`format_path` writes it (the tests hold the two together)."""
    if kind == _TK_ATTR:
        name: str = key
        return name if first else "." + name
    if kind == _TK_CELL:
        return f"__closure__[{key}]" if first else f".__closure__[{key}]"
    if type(key) is int:
        return f"[{key}]"
    text: str = key
    return "['" + text.replace("\\", "\\\\").replace("'", "\\'") + "']"


def _render(steps: list[tuple[int, Any]]) -> str:
    """A path for messages; steps no path can name are shown as ``<reason>``."""
    text = ""
    for kind, key in steps:
        if kind == _TK_UNNAMED:
            text += f" <{key}> "
        else:
            text += _segment(kind, key, not text or text.endswith(" "))
    return text.strip() or "<layer>"


_UNSEEN: Final[Any] = object()
_NAMEABLE: dict[str, bool] = {}  # attribute names seen so far; names repeat across objects and walks


def _nameable(name: str) -> bool:
    """Whether the path grammar can name this attribute (ASCII identifier, and not ``__closure__``)."""
    if len(_NAMEABLE) > 100_000:  # bounded: names are usually a small, repeating set
        _NAMEABLE.clear()
    return name.isidentifier() and name.isascii() and name != "__closure__"


def _kid(kids: list[_Kid], kind: int, key: Any, child: Any, mode: int, reason: str | None) -> None:
    """Append ``child`` unless it is a leaf or a module (the general, not inlined, form of the hot loops)."""
    cls = type(child)
    plan = _PLANS.get(id(cls)) or _plan_for(cls)
    if plan.kind > _SKIP:
        kids.append((kind, key, child, plan.kind, mode, reason))


class _Walk:
    """One walk's state.

    Phase 1 (:meth:`read`) reads every reachable object once, breadth first, recording edges between objects and
    tensors; phase 2 (:meth:`useful`) marks the objects that lead to a tensor; phase 3 (:meth:`enumerate_paths`)
    follows every simple path through marked objects and emits one ref per path that ends at a tensor.

    Edges live in flat parallel lists (a node's edges are the contiguous range ``estart[n]:eend[n]``) rather than
    in a tuple per edge: per-edge container objects would feed the cyclic GC, which then costs as much as the walk.
    """

    def __init__(self, layer: object, max_depth: int, max_objects: int, devices: _DeviceFilter) -> None:
        self.max_depth = max_depth
        self.max_objects = max_objects
        self.devices = devices
        # Node tables; node 0 is the layer. Holding the objects keeps their ids unique until the walk ends.
        self.objs: list[Any] = [layer]
        self.kinds: list[int] = [_OBJECT]
        self.parent: list[int] = [-1]  # the node each node was first discovered from
        self.estart: list[int] = [-1]  # -1: not read (a tensor, or cut by a budget)
        self.eend: list[int] = [-1]
        # Edge columns: token kind, name/key/index (or, for unnamed edges, why), child node, write mode, reason.
        self.e_tk: list[int] = []
        self.e_key: list[Any] = []
        self.e_child: list[int] = []
        self.e_mode: list[int] = []
        self.e_reason: list[str | None] = []
        self.extra_in: dict[int, list[int]] = {}  # further parents of shared objects
        self.objects_visited = 0
        self.depth_cut: str | None = None  # the first place the depth budget cut a path
        self.depth_cuts = 0
        self.objects_cut: str | None = None
        self.paths_cut: str | None = None
        self.notes: dict[str, None] = {}  # an ordered set

    def path_of(self, node: int, extra: tuple[int, Any] | None = None) -> str:
        """The discovery path of ``node`` (for messages only: it searches the parents' edges)."""
        steps: list[tuple[int, Any]] = []
        while node > 0:
            pnode = self.parent[node]
            e = next(e for e in range(self.estart[pnode], self.eend[pnode]) if self.e_child[e] == node)
            steps.append((self.e_tk[e], self.e_key[e]))
            node = pnode
        steps.reverse()
        if extra is not None:
            steps.append(extra)
        return _render(steps)

    def cut_depth(self, where: Callable[[], str]) -> None:
        self.depth_cuts += 1
        if self.depth_cut is None:
            self.depth_cut = where()

    # -- phase 1 -----------------------------------------------------------------------------------------------

    def read(self) -> None:
        objs, kinds, parent, estart, eend = self.objs, self.kinds, self.parent, self.estart, self.eend
        e_tk, e_key, e_child, e_mode, e_reason = self.e_tk, self.e_key, self.e_child, self.e_mode, self.e_reason
        index: dict[int, int] = {id(objs[0]): 0}
        extra_in = self.extra_in
        plans_get = _PLANS.get
        kinds_get = _KINDS.get
        plan_for = _plan_for
        device_of = _TENSOR_DEVICE
        everything, exact, any_index = self.devices.everything, self.devices.exact, self.devices.any_index
        max_depth, max_objects = self.max_depth, self.max_objects
        dict_items = _DICT_ITEMS
        nameable = _NAMEABLE
        head = 0
        visited = 0
        level, boundary = 0, 1  # breadth first: nodes before `boundary` are at depth <= `level`
        while head < len(objs):
            node = head
            head += 1
            if node == boundary:
                level += 1
                boundary = len(objs)
            if kinds[node] == _TENSOR:
                continue
            if visited >= max_objects:
                queued = sum(1 for k in kinds[node:] if k != _TENSOR)
                self.objects_cut = (
                    f"max_objects={max_objects} reached at {self.path_of(node)!r}; "
                    f"{queued} queued object(s) and whatever lies beyond them were not read"
                )
                break
            visited += 1
            obj = objs[node]
            plan = plans_get(id(type(obj))) or plan_for(type(obj))
            pk = plan.kind
            kids: list[_Kid] = []
            append = kids.append

            # Instance attributes (__dict__ and __slots__) of objects, of the layer, and of container subclasses.
            if plan.attrs:
                exclude = _MODULE_INTERNALS if node == 0 and pk == _SKIP else None
                caveat = plan.attr_caveat
                amode = _W_UNRESOLVED if caveat else _W_INPLACE
                if plan.dict_get is not None:
                    shadow = plan.data_descriptors
                    state = plan.dict_get(obj)
                    attrs = dict_items(state) if type(state) is dict or _kind_of(state) == _DICT else ()
                    for name, value in attrs:
                        ck = kinds_get(id(type(value)))
                        if ck is None:
                            ck = plan_for(type(value)).kind
                        if ck <= _SKIP:
                            continue
                        if type(name) is not str:  # possible through __dict__ tricks; never hash or repr it
                            why = f"an attribute keyed by a {_TYPE_NAME(type(name))}"
                            append((_TK_UNNAMED, why, value, ck, _W_NONE, None))
                            continue
                        if exclude is not None and name in exclude:
                            continue
                        ok = nameable.get(name)
                        if ok is None:
                            ok = nameable[name] = _nameable(name)
                        if not ok:
                            append((_TK_UNNAMED, f"attribute {name!r} is not a path name", value, ck, _W_NONE, None))
                        elif name in shadow:
                            why = f"attribute {name!r} is shadowed by a data descriptor of {plan.name}"
                            append((_TK_UNNAMED, why, value, ck, _W_NONE, None))
                        else:
                            append((_TK_ATTR, name, value, ck, amode, caveat))
                for name, get in plan.slots:
                    try:
                        value = get(obj)
                    except AttributeError:  # an unset slot
                        continue
                    _kid(kids, _TK_ATTR, name, value, amode, caveat)
                for why, get in plan.shadowed_slots:
                    try:
                        value = get(obj)
                    except AttributeError:
                        continue
                    _kid(kids, _TK_UNNAMED, why, value, _W_NONE, None)

            if node == 0:
                pk = _OBJECT  # the layer itself: only its attributes (paths start with a name)
            if pk in (_DICT, _PROXY):
                target: Any = obj
                if pk == _PROXY:
                    # A mappingproxy's mapping is reachable only through the GC protocol (C code, no user hooks).
                    inner = gc.get_referents(obj)
                    target = inner[0] if len(inner) == 1 and _kind_of(inner[0]) == _DICT else {}
                    imode, ireason = _W_NONE, "inside a mappingproxy"
                elif plan.item_caveat:
                    imode, ireason = _W_UNRESOLVED, plan.item_caveat
                else:
                    imode, ireason = _W_INPLACE, None
                for key, value in dict_items(target):
                    ck = kinds_get(id(type(value)))
                    if ck is None:
                        ck = plan_for(type(value)).kind
                    kt = type(key)
                    if kt is str or kt is int:
                        if ck > _SKIP:
                            append((_TK_ITEM, key, value, ck, imode, ireason))
                        continue
                    kname = _TYPE_NAME(kt)
                    _kid(kids, _TK_UNNAMED, f"a dict key of type {kname}", key, _W_NONE, None)
                    if ck > _SKIP:
                        append((_TK_UNNAMED, f"the value under a {kname} dict key", value, ck, _W_NONE, None))
            elif pk in (_LIST, _TUPLE, _NTUPLE, _DEQUE):
                if pk == _LIST:
                    items: Iterator[Any] = obj.__iter__() if type(obj) is list else _LIST_ITER(obj)
                    imode, ireason = _W_INPLACE, None
                elif pk == _DEQUE:
                    items = _DEQUE_ITER(obj)
                    imode, ireason = _W_INPLACE, None
                else:
                    items = obj.__iter__() if type(obj) is tuple else _TUPLE_ITER(obj)
                    imode, ireason = (_W_NONE, plan.rebuild_reason) if plan.rebuild_reason else (_W_REBUILD, None)
                if plan.item_caveat:
                    imode, ireason = _W_UNRESOLVED, plan.item_caveat
                fields = plan.fields
                for i, value in enumerate(items):
                    ck = kinds_get(id(type(value)))
                    if ck is None:
                        ck = plan_for(type(value)).kind
                    if ck <= _SKIP:
                        continue
                    if fields and i < len(fields) and fields[i][1] is not None:
                        append((_TK_ATTR, fields[i][1], value, ck, imode, ireason))
                    else:
                        append((_TK_ITEM, i, value, ck, imode, ireason))
            elif pk == _FUNCTION:
                closure = _FUNC_CLOSURE(obj)
                if closure is not None:
                    for i, cell in enumerate(closure):
                        try:
                            value = _CELL_CONTENTS(cell)
                        except ValueError:  # an empty cell
                            continue
                        _kid(kids, _TK_CELL, i, value, _W_INPLACE, None)
                defaults = _FUNC_DEFAULTS(obj)
                if defaults is not None:
                    _kid(kids, _TK_ATTR, "__defaults__", defaults, _W_INPLACE, None)
                kwdefaults = _FUNC_KWDEFAULTS(obj)
                if kwdefaults is not None:
                    _kid(kids, _TK_ATTR, "__kwdefaults__", kwdefaults, _W_INPLACE, None)
            elif pk == _PARTIAL:
                _kid(kids, _TK_ATTR, "func", _PARTIAL_FUNC(obj), _W_REBUILD, None)
                _kid(kids, _TK_ATTR, "args", _PARTIAL_ARGS(obj), _W_REBUILD, None)
                _kid(kids, _TK_ATTR, "keywords", _PARTIAL_KEYWORDS(obj), _W_REBUILD, None)
            elif pk == _METHOD:
                why = "through the read-only {} of a method"
                _kid(kids, _TK_ATTR, "__func__", _METHOD_FUNC(obj), _W_NONE, why.format("__func__"))
                _kid(kids, _TK_ATTR, "__self__", _METHOD_SELF(obj), _W_NONE, why.format("__self__"))
            elif pk in (_BUILTIN, _WRAPPER):
                owner = _BUILTIN_SELF(obj) if pk == _BUILTIN else _WRAPPER_SELF(obj)
                _kid(kids, _TK_ATTR, "__self__", owner, _W_NONE, "through the read-only __self__ of a builtin method")
            elif pk in (_SET, _FSET):
                what = "a member of a set" if pk == _SET else "a member of a frozenset"
                for value in (_SET_ITER if pk == _SET else _FROZENSET_ITER)(obj):
                    _kid(kids, _TK_UNNAMED, what, value, _W_NONE, None)

            # Link the children: new ones become nodes (unless too deep), known ones just gain an edge.
            estart[node] = len(e_child)
            child_depth = level + 1
            for tk, key, child, ck, mode, reason in kids:
                if ck == _TENSOR:
                    try:
                        dev = device_of(child)
                    except Exception as exc:  # an exotic tensor subclass: say so rather than fail the walk
                        where = self.path_of(node, (tk, key))
                        self.notes[f"{where}: cannot read the device of a {_TYPE_NAME(type(child))} ({exc})"] = None
                        continue
                    if dev.type == "meta" or not (everything or dev in exact or dev.type in any_index):
                        continue
                cid = id(child)
                idx = index.get(cid)
                if idx is None:
                    if child_depth > max_depth:
                        self.cut_depth(lambda n=node, t=tk, k=key: self.path_of(n, (t, k)))  # type: ignore[misc]
                        continue
                    idx = len(objs)
                    index[cid] = idx
                    objs.append(child)
                    kinds.append(ck)
                    parent.append(node)
                    estart.append(-1)
                    eend.append(-1)
                elif idx in extra_in:
                    extra_in[idx].append(node)
                else:
                    extra_in[idx] = [node]
                e_tk.append(tk)
                e_key.append(key)
                e_child.append(idx)
                e_mode.append(mode)
                e_reason.append(reason)
            eend[node] = len(e_child)
        self.objects_visited = visited

    # -- phases 2 and 3 ----------------------------------------------------------------------------------------

    def useful(self) -> bytearray:
        """1 for every node from which some tensor node can be reached (tensors included)."""
        marks = bytearray(len(self.objs))
        parent, extra_in = self.parent, self.extra_in
        stack = [i for i, kind in enumerate(self.kinds) if kind == _TENSOR]
        while stack:
            node = stack.pop()
            # Climb the discovery tree until a marked node; shared nodes queue their other parents.
            while not marks[node]:
                marks[node] = 1
                if node == 0:
                    break
                more = extra_in.get(node)
                if more:
                    stack.extend(more)
                node = parent[node]
        return marks

    def enumerate_paths(self, skip: Collection[str] = ()) -> list[TensorRef]:
        marks = self.useful()
        refs: list[TensorRef] = []
        if not marks[0] or self.estart[0] < 0:
            return refs
        kinds, objs, estart, eend = self.kinds, self.objs, self.estart, self.eend
        e_tk, e_key, e_child, e_mode = self.e_tk, self.e_key, self.e_child, self.e_mode
        max_depth, budget = self.max_depth, self.max_objects
        prints: dict[int, Fingerprint | None] = {}  # per tensor node: one fingerprint however many paths
        pos, ends = [estart[0]], [eend[0]]  # per level of the current path: next edge, end of the node's edges
        trail: list[int] = []  # the edges of the current path
        texts = [""]  # texts[k]: the path text of the first k edges of the trail
        clean = [True]  # clean[k]: no edge among the first k makes resolution run user code
        on_trail = {0}
        steps = 0
        while pos:
            e = pos[-1]
            if e >= ends[-1]:
                pos.pop()
                ends.pop()
                if trail:
                    on_trail.discard(e_child[trail.pop()])
                    texts.pop()
                    clean.pop()
                continue
            pos[-1] = e + 1
            child = e_child[e]
            if not marks[child] or child in on_trail:
                continue
            tk, key, mode = e_tk[e], e_key[e], e_mode[e]
            if tk == _TK_UNNAMED:  # not a path step: no slot path goes through it
                where = texts[-1] or "<layer>"
                self.notes[f"{where}: {key} leads to device tensors that no slot path can name"] = None
                continue
            steps += 1
            if steps > budget:
                where = self.render([*trail, e])
                self.paths_cut = f"max_objects={budget} reached while enumerating alias paths at {where!r}"
                break
            if len(trail) >= max_depth:
                self.cut_depth(lambda e=e: self.render([*trail, e]))  # type: ignore[misc]
                continue
            if tk == _TK_ATTR:
                text = texts[-1] + "." + key if trail else key
            else:
                text = texts[-1] + _segment(tk, key, not trail)
            if kinds[child] == _TENSOR:
                if skip and text in skip:
                    continue  # the caller knows this path: no ref, no fingerprint
                tensor = objs[child]
                print_ = prints.get(child, _UNSEEN)
                if print_ is _UNSEEN:
                    print_ = self._fingerprint(child, tensor, text, prints)
                if print_ is None:
                    continue
                if mode == _W_INPLACE and clean[-1]:  # the common case: written in place, plainly resolved
                    refs.append(TensorRef(text, tensor, print_, True, None))
                else:
                    restorable, reason = self.restorability([*trail, e], texts)
                    refs.append(TensorRef(text, tensor, print_, restorable, reason))
                continue
            if estart[child] < 0:  # not read: cut by a budget
                continue
            trail.append(e)
            texts.append(text)
            clean.append(clean[-1] and mode != _W_UNRESOLVED)
            on_trail.add(child)
            pos.append(estart[child])
            ends.append(eend[child])
        return refs

    def render(self, steps: list[int]) -> str:
        return _render([(self.e_tk[e], self.e_key[e]) for e in steps])

    def restorability(self, steps: list[int], texts: list[str]) -> tuple[bool, str | None]:
        """Whether assign can write a tensor at the end of ``steps`` (edges; ``texts[i]``: the path before i)."""
        modes, reasons = self.e_mode, self.e_reason
        for i, e in enumerate(steps):
            if modes[e] == _W_UNRESOLVED:  # resolving the path runs user code: no guarantee it finds this tensor
                return False, f"{reasons[e]} at {texts[i] or '<layer>'!r}"
        # assign writes the last step; immutable containers are rebuilt into their parents, upwards.
        for i in range(len(steps) - 1, -1, -1):
            mode = modes[steps[i]]
            if mode == _W_INPLACE:
                return True, None
            if mode == _W_NONE:
                return False, f"{reasons[steps[i]]} at {texts[i] or '<layer>'!r}"
        return True, None  # unreachable: the layer's own attributes are written in place

    def _fingerprint(
        self, node: int, tensor: torch.Tensor, path: str, prints: dict[int, Fingerprint | None]
    ) -> Fingerprint | None:
        try:
            print_: Fingerprint | None = fingerprint(tensor)
        except Exception as exc:  # sparse, or a wrapper subclass without storage
            print_ = None
            self.notes[f"{path}: cannot fingerprint a {_TYPE_NAME(type(tensor))} ({exc})"] = None
        prints[node] = print_
        return print_

    def exhausted(self) -> str | None:
        parts: list[str] = []
        if self.depth_cut is not None:
            more = self.depth_cuts - 1
            tail = f" and {more} more place(s)" if more else ""
            parts.append(f"max_depth={self.max_depth} reached at {self.depth_cut!r}{tail}; nothing deeper was read")
        if self.objects_cut:
            parts.append(self.objects_cut)
        if self.paths_cut:
            parts.append(self.paths_cut)
        return "; ".join(parts) if parts else None


def walk(
    layer: nn.Module,
    *,
    budget: WalkBudget | None = None,
    devices: DeviceSet | Collection[torch.device | str] | torch.device | str | None = None,
    skip_paths: Collection[str] = (),
) -> WalkResult:
    """Find every device tensor reachable from ``layer``'s own non-parameter, non-buffer attributes.

    Each ref's ``path`` resolves on ``layer`` to exactly its tensor (``SlotPath(path).resolve(layer)``);
    ``restorable`` says whether ``SlotPath(path).assign(layer, t)`` can put a tensor back there.

    Args:
        layer: the reload unit. Its parameters, buffers and child modules are not walked.
        budget: how far to go (:class:`~graphsafe.devices.WalkBudget`; default ``WalkBudget()``).
        devices: report only tensors on these devices (the device rule of :mod:`graphsafe.devices`). ``None``: the
            devices of the layer's (and its submodules') parameters and buffers, or every device if it has none.
            Meta tensors are never reported.
        skip_paths: paths the caller already tracks (a set, for speed): no ref is made for them and their
            tensors are not fingerprinted unless another path reaches them. The walk itself is unchanged.

    Returns:
        The refs (one per simple path to a tensor), how many objects were read, and ``exhausted``: ``None``, or a
        sentence naming the budget that was hit and where (the refs are then incomplete).
    """
    budget = budget if budget is not None else WalkBudget()
    with torch._C.DisableTorchFunctionSubclass():
        if devices is None:
            found = _layer_devices(layer)
            dev_filter = _DeviceFilter(found if found else None)
        elif isinstance(devices, DeviceSet):
            dev_filter = _DeviceFilter(devices.devices)
        else:
            dev_filter = _DeviceFilter(DeviceSet(devices).devices)
        state = _Walk(layer, budget.max_depth, budget.max_objects, dev_filter)
        state.read()
        refs = state.enumerate_paths(skip_paths)
    return WalkResult(
        refs=tuple(refs),
        objects_visited=state.objects_visited,
        exhausted=state.exhausted(),
        notes=tuple(state.notes),
    )


def collect(
    layer: nn.Module,
    *,
    budget: WalkBudget | None = None,
    devices: DeviceSet | Collection[torch.device | str] | torch.device | str | None = None,
) -> list[TensorRef]:
    """The refs of :func:`walk` as a list (check ``walk(...).exhausted`` when completeness matters)."""
    return list(walk(layer, budget=budget, devices=devices).refs)
