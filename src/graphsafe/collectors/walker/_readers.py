"""Readers: one per kind of container, each listing an object's children as :data:`~._edges.Kid` edges.

:data:`READERS` maps a kind to its reader; :func:`read_attributes` reads instance state (``__dict__`` and slots)
of plain objects and of container subclasses alike. Readers go through the C-level accessors of
:mod:`._plans` only, never hash or compare a user object, and drop leaves and modules where the child's kind is
at hand. The loops over dict items, sequence items and attributes are written out: they run once per child.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Callable, Iterable
from typing import Any, Final

from torch import nn

from graphsafe.collectors.walker._edges import (
    ATTR,
    CELL,
    INPLACE,
    ITEM,
    NAMEABLE,
    NO_WRITE,
    REBUILD,
    UNNAMED,
    Kid,
    nameable,
)
from graphsafe.collectors.walker._plans import (
    BUILTIN,
    BUILTIN_SELF,
    CELL_CONTENTS,
    CONTEXTVAR_GET,
    CVAR,
    DEQUE,
    DEQUE_ITER,
    DICT,
    DICT_ITEMS,
    FROZENSET_ITER,
    FSET,
    FUNC_CLOSURE,
    FUNC_DEFAULTS,
    FUNC_KWDEFAULTS,
    FUNCTION,
    KINDS,
    KLASS,
    LIST,
    LIST_ITER,
    LRU,
    METHOD,
    METHOD_FUNC,
    METHOD_SELF,
    NDARRAY,
    NTUPLE,
    OPAQUE,
    PARTIAL,
    PARTIAL_ARGS,
    PARTIAL_FUNC,
    PARTIAL_KEYWORDS,
    PROXY,
    PROXY_REFERENT,
    REF,
    REF_REFERENT,
    SET,
    SET_ITER,
    SKIP,
    TUPLE,
    TUPLE_ITER,
    TYPE_DICT,
    TYPE_NAME,
    WPROXY,
    WRAPPER,
    WRAPPER_SELF,
    Plan,
    is_descriptor,
    kind_of,
    numpy_ndarray,
    plan_of,
)
from graphsafe.collectors.walker._plans import (
    FUNCTION as FUNCTION_KIND,
)
from graphsafe.paths import is_path_key

# torch's own per-instance Module state; anything a subclass adds (with or without a leading underscore) is walked.
MODULE_INTERNALS: Final = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}
# But the forward hooks are walked when there are any (the graph reader adds them): a forward (pre-)hook runs in
# the captured region, so what it holds (a partial's arguments, a closure) is graph-visible, and
# ``_forward_pre_hooks[id].args[0]`` names it.
WALKED_HOOKS: Final = ("_forward_pre_hooks", "_forward_hooks")

Reader = Callable[[Any, Plan, list[Kid]], None]


def add_kid(kids: list[Kid], kind: int, key: Any, child: Any, mode: int, reason: str | None) -> None:
    """Append ``child`` unless it is a leaf or a module (the general, not written-out, form of the loops)."""
    ck = KINDS.get(id(type(child)))
    if ck is None:
        ck = plan_of(type(child)).kind
    if ck > SKIP:
        kids.append((kind, key, child, ck, mode, reason))


def read_attributes(obj: Any, plan: Plan, kids: list[Kid], exclude: frozenset[str] | None) -> None:
    """Instance attributes: ``__dict__`` entries (but ``exclude``), then slots. Only ``str`` names make paths."""
    mode, reason = plan.attr_mode, plan.attr_reason
    if plan.dict_get is not None:
        state = plan.dict_get(obj)
        if type(state) is dict or kind_of(state) == DICT:
            append = kids.append
            kinds_get, known_names = KINDS.get, NAMEABLE.get
            shadow = plan.data_descriptors
            for name, value in DICT_ITEMS(state):
                # torch's own Module state first: a layer's dict holds more of it than of anything else
                if exclude is not None and type(name) is str and name in exclude:
                    continue
                ck = kinds_get(id(type(value)))
                if ck is None:
                    ck = plan_of(type(value)).kind
                if ck <= SKIP:
                    continue
                if type(name) is not str:  # possible through __dict__ tricks; never hash or repr it
                    why = f"an attribute keyed by a {TYPE_NAME(type(name))}"
                    append((UNNAMED, why, value, ck, NO_WRITE, None))
                    continue
                ok = known_names(name)
                if ok is None:
                    ok = nameable(name)
                if not ok:
                    append((UNNAMED, f"attribute {name!r} is not a path name", value, ck, NO_WRITE, None))
                elif name in shadow:
                    why = f"attribute {name!r} is shadowed by a data descriptor of {plan.name}"
                    append((UNNAMED, why, value, ck, NO_WRITE, None))
                else:
                    append((ATTR, name, value, ck, mode, reason))
    for name, get in plan.slots:
        try:
            value = get(obj)
        except AttributeError:  # an unset slot
            continue
        add_kid(kids, ATTR, name, value, mode, reason)
    for why, get in plan.shadowed_slots:
        try:
            value = get(obj)
        except AttributeError:
            continue
        add_kid(kids, UNNAMED, why, value, NO_WRITE, None)


def _read_items(items: Iterable[tuple[Any, Any]], plan: Plan, kids: list[Kid]) -> None:
    """``(key, value)`` items of a dict or (by index) a sequence; other keys than ``str``/``int`` make no paths."""
    append = kids.append
    kinds_get = KINDS.get
    mode, reason = plan.item_mode, plan.item_reason
    for key, value in items:
        ck = kinds_get(id(type(value)))
        if ck is None:
            ck = plan_of(type(value)).kind
        key_type = type(key)
        if key_type is str or key_type is int or is_path_key(key):  # a tuple of plain keys: (8, torch.float32)
            if ck > SKIP:
                append((ITEM, key, value, ck, mode, reason))
            continue
        key_name = TYPE_NAME(key_type)
        add_kid(kids, UNNAMED, f"a dict key of type {key_name}", key, NO_WRITE, None)
        if ck > SKIP:
            append((UNNAMED, f"the value under a {key_name} dict key", value, ck, NO_WRITE, None))


def holds_only_leaves(obj: Any) -> bool | None:
    """For an exact ``tuple``, ``list`` or ``dict``: whether every item (and dict key) is a leaf, so that reading it
    gives no child at all; ``None`` for any other object. Runs no user code: exact builtin types, C iteration."""
    kinds_get = KINDS.get
    cls = type(obj)
    if cls is tuple or cls is list:
        for value in TUPLE_ITER(obj) if cls is tuple else LIST_ITER(obj):
            ck = kinds_get(id(type(value)))
            if (plan_of(type(value)).kind if ck is None else ck) > SKIP:
                return False
        return True
    if cls is dict:
        for key, value in DICT_ITEMS(obj):
            ck = kinds_get(id(type(value)))
            if (plan_of(type(value)).kind if ck is None else ck) > SKIP:
                return False
            ck = kinds_get(id(type(key)))
            if (plan_of(type(key)).kind if ck is None else ck) > SKIP:
                return False
        return True
    return None


def read_dict(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    _read_items(DICT_ITEMS(obj), plan, kids)


def read_mappingproxy(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """The proxied dict, read as a dict under the proxy's plan (its items cannot be written through it)."""
    # The mapping is reachable only through the GC protocol (C code, no user hooks).
    inner = gc.get_referents(obj)
    _read_items(DICT_ITEMS(inner[0]) if len(inner) == 1 and kind_of(inner[0]) == DICT else (), plan, kids)


def read_list(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    _read_items(enumerate(LIST_ITER(obj)), plan, kids)


def read_deque(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    _read_items(enumerate(DEQUE_ITER(obj)), plan, kids)


def read_tuple(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    _read_items(enumerate(TUPLE_ITER(obj)), plan, kids)


def read_namedtuple(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """Fields by name where a path can use it, else by index."""
    fields = plan.fields
    for i, value in enumerate(TUPLE_ITER(obj)):
        name = fields[i] if i < len(fields) else None
        if name is None:
            add_kid(kids, ITEM, i, value, plan.item_mode, plan.item_reason)
        else:
            add_kid(kids, ATTR, name, value, plan.item_mode, plan.item_reason)


def read_function(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """Closure cells (empty ones skipped), ``__defaults__`` and ``__kwdefaults__``; all writable in place."""
    closure = FUNC_CLOSURE(obj)
    if closure is not None:
        for i, cell in enumerate(closure):
            try:
                value = CELL_CONTENTS(cell)
            except ValueError:  # an empty cell
                continue
            add_kid(kids, CELL, i, value, INPLACE, None)
    defaults = FUNC_DEFAULTS(obj)
    if defaults is not None:
        add_kid(kids, ATTR, "__defaults__", defaults, INPLACE, None)
    kwdefaults = FUNC_KWDEFAULTS(obj)
    if kwdefaults is not None:
        add_kid(kids, ATTR, "__kwdefaults__", kwdefaults, INPLACE, None)


def read_partial(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """``func``, ``args`` and ``keywords``; assign rebuilds the partial into its parent."""
    add_kid(kids, ATTR, "func", PARTIAL_FUNC(obj), REBUILD, None)
    add_kid(kids, ATTR, "args", PARTIAL_ARGS(obj), REBUILD, None)
    add_kid(kids, ATTR, "keywords", PARTIAL_KEYWORDS(obj), REBUILD, None)


_METHOD_FUNC_READ_ONLY: Final = "through the read-only __func__ of a method"
_METHOD_SELF_READ_ONLY: Final = "through the read-only __self__ of a method"
_BUILTIN_SELF_READ_ONLY: Final = "through the read-only __self__ of a builtin method"


def read_method(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """``__func__`` and ``__self__`` (a module ``__self__`` is dropped as every module is)."""
    add_kid(kids, ATTR, "__func__", METHOD_FUNC(obj), NO_WRITE, _METHOD_FUNC_READ_ONLY)
    add_kid(kids, ATTR, "__self__", METHOD_SELF(obj), NO_WRITE, _METHOD_SELF_READ_ONLY)


def read_builtin_method(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    add_kid(kids, ATTR, "__self__", BUILTIN_SELF(obj), NO_WRITE, _BUILTIN_SELF_READ_ONLY)


def read_method_wrapper(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    add_kid(kids, ATTR, "__self__", WRAPPER_SELF(obj), NO_WRITE, _BUILTIN_SELF_READ_ONLY)


def read_set(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """Members no path can name (read so the walk can say where unnamed tensors are)."""
    for value in SET_ITER(obj):
        add_kid(kids, UNNAMED, "a member of a set", value, NO_WRITE, None)


def read_frozenset(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    for value in FROZENSET_ITER(obj):
        add_kid(kids, UNNAMED, "a member of a frozenset", value, NO_WRITE, None)


_REFERENT: Final = "the referent of a weak reference"
_LRU_CACHE: Final = "the cache of an lru_cache"
_CONTEXT_VALUE: Final = "the value (or default) of a ContextVar in the current context"


def read_ref(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A weak reference's referent (if alive): no path can name it, and nothing can be assigned through it."""
    add_kid(kids, UNNAMED, _REFERENT, REF_REFERENT(obj), NO_WRITE, None)


def read_weak_proxy(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A weak proxy's referent (if alive), as a weak reference's."""
    add_kid(kids, UNNAMED, _REFERENT, PROXY_REFERENT(obj), NO_WRITE, None)


def read_opaque(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """What a C object without instance state holds, through the GC protocol (C code, no user hooks): no path can
    name it, so a device tensor in there makes the layer untrackable rather than unseen. A cell (a generator's
    closure variable) is read for its contents."""
    why = f"held by a {plan.name}"
    for referent in gc.get_referents(obj):
        if type(referent) is types.CellType:
            try:
                referent = CELL_CONTENTS(referent)
            except ValueError:  # an empty cell
                continue
        add_kid(kids, UNNAMED, why, referent, NO_WRITE, None)


def read_lru(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """An lru_cache's keys and results, through the GC protocol (C code; ``cache_info`` says nothing of values).

    The wrapper's ``__dict__`` (``__wrapped__``, read as attributes) and the wrapped function are left out.
    """
    own = plan.dict_get(obj) if plan.dict_get is not None else None
    for referent in gc.get_referents(obj):
        if referent is own or kind_of(referent) == FUNCTION_KIND:
            continue
        add_kid(kids, UNNAMED, _LRU_CACHE, referent, NO_WRITE, None)


def read_contextvar(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A ContextVar's value in the current context, or else the default it was made with; other threads' contexts
    are out of reach. (``get(sentinel)`` would hide the variable's own default: the argument takes precedence.)"""
    try:
        value = CONTEXTVAR_GET(obj)
    except LookupError:  # neither a value here nor a default
        return
    add_kid(kids, UNNAMED, _CONTEXT_VALUE, value, NO_WRITE, None)


# Attribute values a class holds as code, not state: not followed from its instances.
_CLASS_CODE: Final = frozenset({FUNCTION_KIND, METHOD, BUILTIN, WRAPPER})


def read_class_attributes(obj: Any, plan: Plan, kids: list[Kid], cache: dict[int, Any]) -> bool:
    """Attributes an instance reads from its class (``type(layer).cache = t``), unless the instance shadows them.

    ``layer.cache`` resolves to such a value, but assign would set an instance attribute, so they are never
    restorable; a descriptor (``__get__``: an lru_cache'd method, say) resolves to something else, so no path names
    what it holds. Dunder names and the classes' code (functions, methods) are skipped.

    ``cache``: one walk's :func:`class_attribute_kids` per plan (by id; the entry holds the plan, so the id stays
    its own). Per walk only: class attributes can change between walks, never during one (it runs no user code).
    Returns whether the class has any such attribute (False: no instance of it gives one, in this walk).
    """
    entry = cache.get(id(plan))
    if entry is None:
        entry = cache[id(plan)] = (plan, class_attribute_kids(plan))
    candidates: tuple[tuple[str, Kid], ...] = entry[1]
    if not candidates:
        return False
    own = plan.dict_get(obj) if plan.dict_get is not None else None
    if own is not None and type(own) is not dict:
        own = None
    for name, kid in candidates:
        if own is None or name not in own:
            kids.append(kid)
    return True


def _wraps_code(value: Any) -> bool:
    """Whether a C wrapper (``property``, ``staticmethod``, ``classmethod``) holds only code and leaves: then it is
    code like a method, and not followed (no edge, no depth). Its own ``__dict__``'s dunder entries (``__wrapped__``,
    ``__annotations__``, copied from the function) are the function's metadata."""
    for referent in gc.get_referents(value):
        if type(referent) is dict:
            for name, item in DICT_ITEMS(referent):
                kind = kind_of(item)
                dunder = type(name) is str and name[:2] == "__" and name[-2:] == "__"
                if kind > SKIP and kind not in _CLASS_CODE and not dunder:
                    return False
            continue
        kind = kind_of(referent)
        if kind > SKIP and kind not in _CLASS_CODE:
            return False
    return True


def class_attribute_kids(plan: Plan) -> tuple[tuple[str, Kid], ...]:
    """``(name, edge)`` for every class attribute of ``plan``'s class an instance may read (see
    :func:`read_class_attributes`); what does not depend on the instance, worked out once per class and walk."""
    found: list[tuple[str, Kid]] = []
    seen: set[str] = set()
    shadowing = len(plan.class_dicts) > 1  # a name of a class shadows the same name further along the MRO
    kinds_get = KINDS.get
    for class_name, d in plan.class_dicts:
        for name, value in DICT_ITEMS(d):
            if type(name) is not str:
                continue
            if shadowing:
                if name in seen:
                    continue
                seen.add(name)
            ck = kinds_get(id(type(value)))
            if ck is None:
                ck = plan_of(type(value)).kind
            # Most of a class dict is code and leaves; dunder names are tested only for what is left.
            if ck <= SKIP or ck in _CLASS_CODE or (name[:2] == "__" and name[-2:] == "__"):
                continue
            if ck == OPAQUE and _wraps_code(value):  # a property or staticmethod over a method: code as well
                continue
            if is_descriptor(value):
                why = f"class attribute {name!r} of {class_name}, a descriptor"
                found.append((name, (UNNAMED, why, value, ck, NO_WRITE, None)))
            elif name in plan.data_descriptors or not nameable(name):
                found.append((name, (UNNAMED, f"class attribute {name!r} of {class_name}", value, ck, NO_WRITE, None)))
            else:
                found.append((name, (ATTR, name, value, ck, NO_WRITE, plan.class_attr_reason)))
    return tuple(found)


def read_class(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A class held as a value (``self.kernel = KernelClass``, whose class attributes hold a workspace): the class
    attributes its instances would read (:func:`class_attribute_kids`; none for builtin or torch classes), never
    restorable. ``plan`` is the metaclass's: a Python ``__getattribute__`` there makes the paths unresolved."""
    for _, kid in class_attribute_kids(plan_of(obj)):
        if plan.attr_reason is not None:
            kid = (kid[0], kid[1], kid[2], kid[3], plan.attr_mode, plan.attr_reason)
        kids.append(kid)


def read_ndarray(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A numpy array of Python objects (per-expert tensors in an object array): numpy gives its items to no GC
    traversal, so they are read as a list (numpy's C ``tolist``); no path names them. Numeric arrays hold none."""
    ndarray = numpy_ndarray()  # numpy's own C getter and method: a subclass's Python overrides are not run
    if TYPE_DICT(ndarray)["dtype"].__get__(obj).hasobject:
        add_kid(kids, UNNAMED, "an item of a numpy object array", ndarray.tolist(obj), NO_WRITE, None)


# Kinds without a reader: leaves (never entered), tensors and modules and plain objects (attributes only).
READERS: Final[dict[int, Reader]] = {
    DICT: read_dict,
    PROXY: read_mappingproxy,
    LIST: read_list,
    DEQUE: read_deque,
    TUPLE: read_tuple,
    NTUPLE: read_namedtuple,
    FUNCTION: read_function,
    PARTIAL: read_partial,
    METHOD: read_method,
    BUILTIN: read_builtin_method,
    WRAPPER: read_method_wrapper,
    SET: read_set,
    FSET: read_frozenset,
    REF: read_ref,
    WPROXY: read_weak_proxy,
    OPAQUE: read_opaque,
    KLASS: read_class,
    NDARRAY: read_ndarray,
    LRU: read_lru,
    CVAR: read_contextvar,
}
