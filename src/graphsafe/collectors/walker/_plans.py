"""Per-class plans: what the walker reads of a class's instances, worked out once per class without running its code.

A class's kind (leaf, tensor, module, object, or which container) comes from :data:`KIND_BASES` along its MRO;
its :class:`Plan` adds where instance state lives (``__dict__``, slots), which attribute names a data descriptor
shadows, and how assign can write through its attributes and items. Every accessor here is a C-level descriptor
taken from a builtin type's dictionary, so none of them can dispatch to Python code defined by a user class.
"""

from __future__ import annotations

import _io
import abc
import collections
import contextvars
import ctypes
import enum
import functools
import gc
import io
import logging
import sys
import threading
import types
import weakref
from typing import Any, Final

import torch
from torch import nn

from graphsafe.collectors.walker._edges import INPLACE, NO_WRITE, REBUILD, UNRESOLVED, nameable
from graphsafe.registry import CopyHook

# --------------------------------------------------------------------------------------------------------------
# C-level accessors.

TYPE_DICT: Final = type.__dict__["__dict__"].__get__
TYPE_MRO: Final = type.__dict__["__mro__"].__get__
TYPE_NAME: Final = type.__dict__["__qualname__"].__get__

FUNC_CLOSURE: Final = types.FunctionType.__dict__["__closure__"].__get__
FUNC_DEFAULTS: Final = types.FunctionType.__dict__["__defaults__"].__get__
FUNC_KWDEFAULTS: Final = types.FunctionType.__dict__["__kwdefaults__"].__get__
CELL_CONTENTS: Final = types.CellType.__dict__["cell_contents"].__get__
METHOD_FUNC: Final = types.MethodType.__dict__["__func__"].__get__
METHOD_SELF: Final = types.MethodType.__dict__["__self__"].__get__
BUILTIN_SELF: Final = types.BuiltinFunctionType.__dict__["__self__"].__get__
WRAPPER_SELF: Final = types.MethodWrapperType.__dict__["__self__"].__get__
PARTIAL_FUNC: Final = functools.partial.__dict__["func"].__get__
PARTIAL_ARGS: Final = functools.partial.__dict__["args"].__get__
PARTIAL_KEYWORDS: Final = functools.partial.__dict__["keywords"].__get__
TENSOR_DEVICE: Final = torch._C.TensorBase.__dict__["device"].__get__
STORAGE_DEVICE: Final = torch._C.StorageBase.__dict__["device"].__get__
#: The referent of a weak reference: the C call of ``weakref.ref`` (a subclass's Python ``__call__`` is not run).
REF_REFERENT: Final = weakref.ReferenceType.__call__
#: The referent of a weak proxy (None once dead), through the C API, since every Python-level operation on a
#: proxy is forwarded to (and may run the code of) its referent. Called with the proxy's address, so that ctypes
#: does not convert (and so touch) the proxy. ``PyWeakref_GetRef`` (3.13+) gives a new reference, let go once
#: ``.value`` holds its own; the older ``PyWeakref_GetObject`` (removed in 3.15) a borrowed one.
_WEAKREF_GET_REF: Final[Any] = getattr(ctypes.pythonapi, "PyWeakref_GetRef", None)
_WEAKREF_GET_OBJECT: Final[Any] = None if _WEAKREF_GET_REF is not None else ctypes.pythonapi.PyWeakref_GetObject
if _WEAKREF_GET_REF is not None:
    _WEAKREF_GET_REF.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    _WEAKREF_GET_REF.restype = ctypes.c_int
    ctypes.pythonapi.Py_DecRef.argtypes = [ctypes.c_void_p]
    ctypes.pythonapi.Py_DecRef.restype = None
else:
    _WEAKREF_GET_OBJECT.argtypes = [ctypes.c_void_p]
    _WEAKREF_GET_OBJECT.restype = ctypes.c_void_p


def PROXY_REFERENT(proxy: object) -> object:
    if _WEAKREF_GET_REF is None:
        return ctypes.cast(_WEAKREF_GET_OBJECT(id(proxy)), ctypes.py_object).value
    out = ctypes.c_void_p()
    if _WEAKREF_GET_REF(id(proxy), ctypes.byref(out)) != 1 or not out.value:
        return None  # dead
    referent = ctypes.cast(out.value, ctypes.py_object).value
    ctypes.pythonapi.Py_DecRef(out.value)
    return referent


#: A ContextVar's value in the current context (C code; ContextVar cannot be subclassed).
CONTEXTVAR_GET: Final = contextvars.ContextVar.get
LRU_WRAPPER: Final[type | None] = getattr(functools, "_lru_cache_wrapper", None)  # the C lru_cache, when built

DICT_ITEMS: Final = dict.items
DICT_VALUES: Final = dict.values
LIST_ITER: Final = list.__iter__
TUPLE_ITER: Final = tuple.__iter__
DEQUE_ITER: Final = collections.deque.__iter__
SET_ITER: Final = set.__iter__
FROZENSET_ITER: Final = frozenset.__iter__

_DESCRIPTOR_TYPES: Final = (types.GetSetDescriptorType, types.MemberDescriptorType)
_TUPLEGETTER: Final = type(TYPE_DICT(collections.namedtuple("_NT", "a"))["a"])  # a NamedTuple field's descriptor
_C_CODE_TYPES: Final = (
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
)

# --------------------------------------------------------------------------------------------------------------
# Kinds. LEAF and SKIP are the lowest codes: a child of kind <= SKIP is never followed.

LEAF, SKIP, TENSOR, OBJECT, DICT, LIST, DEQUE, TUPLE, NTUPLE, SET, FSET, PROXY = range(12)
PARTIAL, FUNCTION, METHOD, BUILTIN, WRAPPER = range(12, 17)
# Weak references, lru_cache wrappers, ContextVars, and modules: a module is entered only where it is no reload
# unit of its own (one held in a plain list, say); which modules are units is the walk's ``units`` argument.
REF, LRU, CVAR, MODULE = range(17, 21)
# A weak proxy (its referent read as a weak reference's), and a C object without instance state of its own that
# may still hold objects (an itertools iterator, a methodcaller, a dict view, a generator's frame): what it holds
# is read through the GC protocol, and no path can name it.
WPROXY, OPAQUE = range(21, 23)
# A class held as a value (a kernel class with class-level state): its class attributes are read. A raw storage
# (a storage pool): no path can name a tensor in it, so the walk reports it like an unprintable tensor. A numpy
# array: its items, when it holds Python objects (numpy does not expose them to the GC protocol).
KLASS, STORAGE, NDARRAY = range(23, 26)
# A Python module (the device tensors among its globals, no global entered), and a thread of the stdlib's own
# classes (the arguments it was given): see ``read_module`` and ``read_thread``.
PYMODULE, THREAD = range(26, 28)


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
    CopyHook,  # the declarations' copy hook in a declaring layer's __dict__ (it holds the layer weakly)
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
    types.CodeType,
    types.FrameType,
    types.TracebackType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    io.IOBase,
    _io._IOBase,  # the C base of every file object (io.IOBase is an ABC they are only registered with)
    logging.Logger,
    logging.Handler,
    logging.Manager,
    threading.Thread,
    type(threading.Lock()),
    type(threading.RLock()),
    # An ABC's caches and registry (``_abc_impl``): weak references to the classes isinstance() was asked about, no
    # state of any instance; read through, every quant-method class leads to the next one's and the walk's depth.
    *((type(abc.ABC.__dict__["_abc_impl"]),) if "_abc_impl" in abc.ABC.__dict__ else ()),  # C abc only
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
            "torch._ops.OperatorBase",
            "torch._ops.OpOverloadPacket",
            # A hook handle only removes its hook; the hooks are read where they are registered (a module's hook
            # dicts). Through its weak references it reaches registries such as dynamo's bytecode hooks.
            "torch.utils.hooks.RemovableHandle",
            "torch._ops._OpNamespace",
            # torch's own module objects of operator and class namespaces (``torch.ops``, ``torch.classes``):
            # registries of operators, no state of a model.
            "torch._ops._Ops",
            "torch._classes._Classes",
            "torch.SymInt",
            "torch.SymFloat",
            "torch.SymBool",
        )
    ),
)

# Checked in this order along the MRO (first match wins), so a Module or tensor subclass is never a plain object.
KIND_BASES: Final[tuple[tuple[type, int], ...]] = (
    (torch._C.TensorBase, TENSOR),
    (nn.Module, MODULE),
    (weakref.ReferenceType, REF),
    (weakref.ProxyType, WPROXY),
    (weakref.CallableProxyType, WPROXY),
    (contextvars.ContextVar, CVAR),
    *(((LRU_WRAPPER, LRU),) if LRU_WRAPPER is not None else ()),
    (type, KLASS),
    *((base, STORAGE) for base in _resolve_names(("torch._C.StorageBase",))),
    # C objects that hold any object, read through the GC protocol like OPAQUE ones (no path names what they hold):
    # a descriptor class attribute (``staticmethod(partial(op, workspace))``), a cell held as a value. (A slice
    # stays a leaf: common, and a tensor in one is not worth a node per slice.)
    (staticmethod, OPAQUE),
    (classmethod, OPAQUE),
    (property, OPAQUE),
    (types.CellType, OPAQUE),
    *((base, LEAF) for base in _LEAF_BASES),
    (types.ModuleType, PYMODULE),  # after the leaves: torch's own module subclasses above stay leaves
    (dict, DICT),
    (list, LIST),
    (collections.deque, DEQUE),
    (tuple, TUPLE),
    (set, SET),
    (frozenset, FSET),
    (types.MappingProxyType, PROXY),
    (functools.partial, PARTIAL),
    (types.FunctionType, FUNCTION),
    (types.MethodType, METHOD),
    (types.BuiltinFunctionType, BUILTIN),
    (types.MethodWrapperType, WRAPPER),
)
_KIND_BY_ID: Final = {id(base): kind for base, kind in KIND_BASES}
_KIND_ORDER: Final = {id(base): order for order, (base, _) in enumerate(KIND_BASES)}
# Containers whose subclasses may carry instance state of their own (the builtin types themselves have none).
_CONTAINERS: Final[dict[int, type]] = {
    DICT: dict,
    LIST: list,
    DEQUE: collections.deque,
    TUPLE: tuple,
    NTUPLE: tuple,
    PARTIAL: functools.partial,
}


# Leaf bases whose subclasses' instances carry state of their own in ``__dict__`` (an enum member with a workspace
# hung on it, a prefetch thread keeping its buffer): instances of a subclass defined outside the base's own modules
# are read as plain objects. The bases themselves (and the stdlib's subclasses) stay leaves: a logger reaches the
# whole logging tree, a thread its target's object (the stdlib's threads are read for their arguments only: THREAD).
_STATEFUL_LEAVES: Final[dict[int, tuple[str, ...]]] = {
    id(enum.Enum): ("enum",),
    id(threading.Thread): ("threading",),
    id(logging.Logger): ("logging",),
    id(logging.Handler): ("logging",),
    id(io.IOBase): ("io", "_io", "_pyio"),
    id(_io._IOBase): ("io", "_io", "_pyio"),
}
# Attributes of such instances not read: an enum member's class (the enum's machinery, not the member's state).
_STATEFUL_INTERNALS: Final = frozenset({"__objclass__"})


def _stateful_subclass(mro: tuple[type, ...], d: Any) -> bool:
    """Whether a leaf class is a subclass of a stateful leaf base defined outside that base's modules."""
    module = d.get("__module__")
    if type(module) is not str or module == "builtins" or module == "torch" or module.startswith("torch."):
        return False
    homes = [_STATEFUL_LEAVES[id(klass)] for klass in mro[1:] if id(klass) in _STATEFUL_LEAVES]
    return bool(homes) and id(mro[0]) not in _STATEFUL_LEAVES and not any(module in home for home in homes)


def numpy_ndarray() -> Any:
    """numpy's ndarray class, or None while numpy is not imported (then no array exists)."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "ndarray", None) if numpy is not None else None


def _is_ndarray(mro: tuple[type, ...]) -> bool:
    """Whether a class is numpy's ndarray or a subclass."""
    ndarray = numpy_ndarray()
    return ndarray is not None and any(klass is ndarray for klass in mro)


def _base_kind(mro: tuple[type, ...]) -> int:
    """The kind of the most specific known base (a dict subclass of a leaf type stays a leaf); else OBJECT."""
    best: tuple[int, int] | None = None
    for klass in mro:
        order = _KIND_ORDER.get(id(klass))
        if order is not None and (best is None or order < best[0]):
            best = (order, _KIND_BY_ID[id(klass)])
    return best[1] if best is not None else OBJECT


#: Where compiled artifacts come from: torch.compile's wrappers, guards and caches (dynamo, AOT autograd, Inductor,
#: FX graphs) and vLLM's compilation wrappers and backends. Their instances are opaque to the walker: the tensors
#: a compiled callable runs on are the module's own, walked through the module; constants an artifact holds
#: itself are the graph truth's to see (the captured graph's kernel arguments), not the walker's.
COMPILED_ARTIFACT_MODULES: Final[tuple[str, ...]] = (
    "torch._dynamo",
    "torch._C._dynamo",
    "torch._inductor",
    "torch._functorch",
    "torch._guards",
    "torch.fx",
    "vllm.compilation",
)


#: Where a distributed tensor's layout bookkeeping comes from: a DTensor's spec and device mesh (placements, the
#: mesh's rank map: host-side topology, never memory a kernel reads for the model). Opaque to the walker like
#: compiled artifacts; the DTensor's local shard is its memory (its flatten protocol), and the placements and mesh
#: are compared as its flatten metadata.
DISTRIBUTED_LAYOUT_MODULES: Final[tuple[str, ...]] = (
    "torch.distributed.device_mesh",
    "torch.distributed.tensor._dtensor_spec",
    "torch.distributed.tensor.placement_types",
)


def _compiled_artifact(d: Any) -> bool:
    """Whether the class whose dictionary is ``d`` was defined by a compiler (see COMPILED_ARTIFACT_MODULES) or is
    a distributed tensor's layout bookkeeping (DISTRIBUTED_LAYOUT_MODULES)."""
    module = d.get("__module__")
    return type(module) is str and any(
        module == prefix or module.startswith(prefix + ".")
        for prefix in (*COMPILED_ARTIFACT_MODULES, *DISTRIBUTED_LAYOUT_MODULES)
    )


def _python_owner(pairs: list[tuple[type, Any]], name: str) -> str | None:
    """The class that defines ``name`` (first along the MRO) when that definition is Python code, else None."""
    for klass, d in pairs:
        if name in d:
            # type identity, not isinstance: isinstance may consult a user-defined __class__
            return None if any(type(d[name]) is t for t in _C_CODE_TYPES) else TYPE_NAME(klass)
    return None


def _user_class(klass: type, d: Any) -> bool:
    """Whether a class's own attributes may be a model's state: not ``object``, builtins or torch's classes."""
    module = d.get("__module__")
    return type(module) is str and module != "builtins" and module != "torch" and not module.startswith("torch.")


def _class_dict(proxy: Any) -> dict[str, Any]:
    """The dict behind a class's mappingproxy (through the GC protocol: no user hooks)."""
    inner = gc.get_referents(proxy)
    return inner[0] if len(inner) == 1 and type(inner[0]) is dict else {}


def is_descriptor(value: object) -> bool:
    """Whether ``value``'s class defines ``__get__``: reading it through an instance runs that, not returns it."""
    return any("__get__" in d for d in map(TYPE_DICT, TYPE_MRO(type(value))))


def _is_data_descriptor(value: object) -> bool:
    return any("__set__" in d or "__delete__" in d for d in map(TYPE_DICT, TYPE_MRO(type(value))))


def _item_writes(kind: int, caveat: str | None, rebuild_reason: str | None) -> tuple[int, str | None]:
    """How assign writes an item of a container of ``kind`` (write mode, reason)."""
    if caveat is not None:
        return UNRESOLVED, caveat
    if kind == PROXY:
        return NO_WRITE, "inside a mappingproxy"
    if kind in (TUPLE, NTUPLE):
        return (NO_WRITE, rebuild_reason) if rebuild_reason is not None else (REBUILD, None)
    return INPLACE, None


class Plan:
    """What the walker needs to know about one class, computed once."""

    __slots__ = (
        "attr_mode",
        "attr_reason",
        "attrs",
        "class_attr_reason",
        "class_dicts",
        "cls",
        "data_descriptors",
        "dict_get",
        "fields",
        "internals",
        "item_mode",
        "item_reason",
        "kind",
        "name",
        "shadowed_slots",
        "slots",
    )

    def __init__(self, cls: type) -> None:
        self.cls = cls  # keeps the class (and so its id) alive while the plan is cached
        self.name: str = TYPE_NAME(cls)
        mro: tuple[type, ...] = TYPE_MRO(cls)
        dicts = [TYPE_DICT(klass) for klass in mro]
        pairs = list(zip(mro, dicts, strict=True))
        kind = _base_kind(mro)
        if kind == OBJECT and _compiled_artifact(dicts[0]):
            kind = LEAF  # a compiled artifact: opaque (see COMPILED_ARTIFACT_MODULES)
        #: Instance attributes not read (see _STATEFUL_INTERNALS); None: every one.
        self.internals: frozenset[str] | None = None
        if kind == LEAF and _stateful_subclass(mro, dicts[0]):
            kind = OBJECT
            self.internals = _STATEFUL_INTERNALS
        elif kind == LEAF and any(klass is threading.Thread for klass in mro):
            kind = THREAD  # the stdlib's own thread classes: the arguments a thread was given
        elif kind == OBJECT and _is_ndarray(mro):
            kind = NDARRAY

        # First definition of every name along the MRO: what attribute lookup would find on the class.
        first: dict[str, Any] = {}
        for d in reversed(dicts):
            first.update(d)

        owner = _python_owner(pairs, "__getattribute__")
        self.attr_reason: str | None = None if owner is None else f"resolving it runs {owner}.__getattribute__"
        self.attr_mode: int = INPLACE if owner is None else UNRESOLVED

        item_caveat: str | None = None
        if kind in (DICT, LIST, DEQUE, TUPLE):
            owner = _python_owner(pairs, "__getitem__")
            if owner is not None:
                item_caveat = f"resolving it runs {owner}.__getitem__"

        # Per position of a NamedTuple: the field name a path uses, or None where only the index can name it.
        self.fields: tuple[str | None, ...] = ()
        rebuild_reason: str | None = None
        if kind == TUPLE:
            fields = first.get("_fields")
            if type(fields) is tuple and all(type(f) is str for f in fields) and "_make" in first:
                kind = NTUPLE
                self.fields = tuple(f if type(first.get(f)) is _TUPLEGETTER and nameable(f) else None for f in fields)
            elif _python_owner(pairs, "__new__") or _python_owner(pairs, "__init__"):
                rebuild_reason = f"inside a {self.name} (a tuple subclass assign cannot rebuild)"
        self.item_mode, self.item_reason = _item_writes(kind, item_caveat, rebuild_reason)
        self.kind = kind

        self.dict_get: Any = None
        self.slots: tuple[tuple[str, Any], ...] = ()  # (name, getter)
        self.shadowed_slots: tuple[tuple[str, Any], ...] = ()  # (why no path names it, getter)
        self.data_descriptors: frozenset[str] = frozenset()
        # Instance state of plain objects, modules, tensors (attributes set on a parameter, a wrapper subclass's
        # inner tensors), lru_cache wrappers, and of user subclasses of containers (builtin containers have none);
        # of Python modules and stdlib threads, which their readers read (``attrs`` stays False for them).
        if kind in (OBJECT, MODULE, TENSOR, LRU, PYMODULE, THREAD) or (
            kind in _CONTAINERS and _CONTAINERS[kind] is not cls
        ):
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
                        why = f"slot {name!r} of {TYPE_NAME(klass)} is shadowed by a class attribute"
                        shadowed.append((why, getter))
            self.slots = tuple(slots)
            self.shadowed_slots = tuple(shadowed)
            self.data_descriptors = frozenset(
                name
                for name, value in first.items()
                if type(name) is str and not name.startswith("__") and _is_data_descriptor(value)
            )
            if kind == OBJECT and self.dict_get is None and not slots and not shadowed:
                # A C type without instance state we could read; what it holds (gc.get_referents) is read, unnamed.
                self.kind = OPAQUE
        self.attrs = kind not in (PYMODULE, THREAD) and (
            self.dict_get is not None or bool(self.slots) or bool(self.shadowed_slots)
        )
        # Class attributes of plain objects and modules: the dicts of the classes along the MRO that are neither
        # builtin nor torch's own (whose class state is no model's), read at every walk since they can change.
        self.class_dicts: tuple[tuple[str, dict[str, Any]], ...] = ()
        self.class_attr_reason = (
            f"a class attribute of {self.name}: assigning through an instance would shadow it, not restore it"
        )
        # (Not for a stateful leaf's subclass: an enum's class attributes are its members and their maps, which
        # would add two levels under every member; what hangs on the instance is read.)
        if kind in (OBJECT, MODULE) and self.internals is None:
            self.class_dicts = tuple((TYPE_NAME(klass), _class_dict(d)) for klass, d in pairs if _user_class(klass, d))


# The caches, by id(cls): hashing a class could run a metaclass's __hash__. KINDS is the hot loops' leaf test.
PLANS: Final[dict[int, Plan]] = {}
KINDS: Final[dict[int, int]] = {}
_PLAN_CACHE_LIMIT: Final = 20_000


def plan_of(cls: type) -> Plan:
    """The plan of ``cls``, from the cache or made now."""
    plan = PLANS.get(id(cls))
    if plan is None:
        if len(PLANS) >= _PLAN_CACHE_LIMIT:  # dynamically created classes must not accumulate forever
            PLANS.clear()
            KINDS.clear()
        plan = PLANS[id(cls)] = Plan(cls)
        KINDS[id(cls)] = plan.kind
    return plan


def kind_of(obj: object) -> int:
    """The kind of ``obj``'s class."""
    kind = KINDS.get(id(type(obj)))
    return plan_of(type(obj)).kind if kind is None else kind
