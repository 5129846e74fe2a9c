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
    DICT_VALUES,
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
    PYMODULE,
    REF,
    REF_REFERENT,
    SET,
    SET_ITER,
    SKIP,
    STORAGE,
    TENSOR,
    THREAD,
    TUPLE,
    TUPLE_ITER,
    TYPE_DICT,
    TYPE_MRO,
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
    """``__func__`` and ``__self__``."""
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


# Attribute values a class holds as code: followed only where they hold a tensor (see holds_tensor).
_CLASS_CODE: Final = frozenset({FUNCTION_KIND, METHOD, BUILTIN, WRAPPER})
#: How deep :func:`holds_tensor` looks through code that holds code (a decorator's wrapper over the method).
_CODE_DEPTH: Final = 4


def holds_tensor(code: Any, depth: int = _CODE_DEPTH) -> bool:
    """Whether code (a function, a bound method, a builtin or a method-wrapper) holds a tensor or a raw storage
    itself, so that a class holding it is read for it rather than passing it over as code: in a function's closure
    cell, ``__defaults__`` or ``__kwdefaults__``, as a method's or builtin's ``__self__`` (``ws.mul``), or the same
    in code it holds (a decorator's wrapper over the method), through ``depth`` levels (past them: as if it did).

    Only what the code holds itself: a method's closure over a config object or a decorator's declarations is not
    read from the class (read, a ``@graph_visible`` method's specs alone spend the depth budget of every layer).
    Runs no user code (C accessors only)."""
    kind = kind_of(code)
    held: list[Any] = []
    if kind == FUNCTION_KIND:
        closure = FUNC_CLOSURE(code)
        if closure is not None:
            for cell in closure:
                try:
                    held.append(CELL_CONTENTS(cell))
                except ValueError:  # an empty cell
                    continue
        defaults = FUNC_DEFAULTS(code)
        if defaults is not None:
            held += TUPLE_ITER(defaults)
        kwdefaults = FUNC_KWDEFAULTS(code)
        if kwdefaults is not None:
            held += DICT_VALUES(kwdefaults)
    elif kind == METHOD:
        held += (METHOD_FUNC(code), METHOD_SELF(code))
    elif kind == BUILTIN:
        held.append(BUILTIN_SELF(code))
    elif kind == WRAPPER:
        held.append(WRAPPER_SELF(code))
    for value in held:
        vk = kind_of(value)
        if vk in (TENSOR, STORAGE):
            return True
        if vk in _CLASS_CODE and (depth <= 0 or holds_tensor(value, depth - 1)):
            return True
    return False


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
    """Whether a C wrapper (``property``, ``staticmethod``, ``classmethod``) holds only leaves and code without state
    (:func:`holds_tensor`): then it is code like a method, and not followed (no edge, no depth). Its own
    ``__dict__``'s dunder entries (``__wrapped__``, ``__annotations__``, copied from the function) are the
    function's metadata."""
    for referent in gc.get_referents(value):
        if type(referent) is dict:
            for name, item in DICT_ITEMS(referent):
                kind = kind_of(item)
                dunder = type(name) is str and name[:2] == "__" and name[-2:] == "__"
                if kind > SKIP and (kind not in _CLASS_CODE or holds_tensor(item)) and not dunder:
                    return False
            continue
        kind = kind_of(referent)
        if kind > SKIP and (kind not in _CLASS_CODE or holds_tensor(referent)):
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
            # Most of a class dict is leaves and code; dunder names (the class's protocol and metadata) are skipped.
            if ck <= SKIP or (name[:2] == "__" and name[-2:] == "__"):
                continue
            if ck in _CLASS_CODE:
                if not holds_tensor(value):  # a method: code; one that holds a tensor itself is read
                    continue
            elif ck == OPAQUE and _wraps_code(value):  # a property or staticmethod over a method: code as well
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
    restorable. ``plan`` is the metaclass's: a Python ``__getattribute__`` there makes the paths unresolved.

    A method that holds a tensor (:func:`holds_tensor`: a class made per load whose method closes over the workspace)
    is a descriptor to an instance (no path names it there: untrackable), but read on the class itself a plain
    function is itself: ``kernel.scale.__closure__[0]`` names the cell, which is written in place."""
    own = plan_of(obj)
    for name, kid in class_attribute_kids(own):
        if (
            kid[0] == UNNAMED
            and type(kid[2]) is types.FunctionType
            and nameable(name)
            and not any(name in d for d in map(TYPE_DICT, TYPE_MRO(type(obj))))  # no metaclass attribute wins
        ):
            kid = (ATTR, name, kid[2], kid[3], NO_WRITE, own.class_attr_reason)
        if plan.attr_reason is not None:
            kid = (kid[0], kid[1], kid[2], kid[3], plan.attr_mode, plan.attr_reason)
        kids.append(kid)


def read_ndarray(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A numpy array of Python objects (per-expert tensors in an object array): numpy gives its items to no GC
    traversal, so they are read as a list (numpy's C ``tolist``); no path names them. Numeric arrays hold none."""
    ndarray = numpy_ndarray()  # numpy's own C getter and method: a subclass's Python overrides are not run
    if TYPE_DICT(ndarray)["dtype"].__get__(obj).hasobject:
        add_kid(kids, UNNAMED, "an item of a numpy object array", ndarray.tolist(obj), NO_WRITE, None)


def read_module(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A Python module held as a value (``self.ops = my_kernels``, whose global holds the workspace): the device
    tensors (and raw storages) among its globals, as attributes (``ops.workspace`` resolves and assigns as an
    attribute: restorable; every holder of the module shares it, as any shared object). No global is entered:
    not its functions, classes, containers or imports, so that a layer holding ``torch``, ``numpy`` or ``math``
    costs the walk one object and one pass in C over the module's namespace, never a walk of the library, and so
    that a kernel module's ``lru_cache``'d getters and registries are not read at every reload. The same rule for
    every module, wherever it was loaded from. (A tensor in a module global's container, a module-level cache, is
    the capture manifest's to see, like one that no path from the layer reaches.)

    Cost: a layer holding ``torch`` and ``numpy`` reads 3 objects where it read 1 (both modules were leaves), plus
    the pass over their ~2,000 globals: about 0.3 ms a walk on a slow shared core (0.016 ms before), linear in the
    size of each module's namespace and nothing beyond it."""
    state = plan.dict_get(obj) if plan.dict_get is not None else None
    if type(state) is not dict:
        return
    # The kinds of the values' classes, in C; the items are read only when a tensor or storage class (or a class
    # without a plan yet) is among them.
    kinds_get = KINDS.get
    found = set(map(kinds_get, map(id, map(type, DICT_VALUES(state)))))
    if TENSOR not in found and STORAGE not in found and None not in found:
        return
    for name, value in DICT_ITEMS(state):
        ck = kinds_get(id(type(value)))
        if ck is None:
            ck = plan_of(type(value)).kind
        if ck != TENSOR and ck != STORAGE:
            continue
        if type(name) is str and nameable(name):
            kids.append((ATTR, name, value, ck, plan.attr_mode, plan.attr_reason))
        else:
            kids.append((UNNAMED, "a module global that is not a path name", value, ck, NO_WRITE, None))


#: What a stdlib thread holds of the arguments it was given: ``Thread(target, args, kwargs)`` keeps ``_args`` and
#: ``_kwargs`` (until it has run), ``threading.Timer`` ``args`` and ``kwargs``.
_THREAD_ARGUMENTS: Final = ("_args", "_kwargs", "args", "kwargs")


def read_thread(obj: Any, plan: Plan, kids: list[Kid]) -> None:
    """A thread of the stdlib's own classes (``threading.Thread(target=fill, args=(buf,))``): the arguments it was
    given (:data:`_THREAD_ARGUMENTS`), as attributes (``prefetch._args[0]``: the tuple is rebuilt into the thread).
    Not its target (or a Timer's ``function``): a bound method reaches the object that runs the engine, and a
    function's state is what it closes over, not what the thread holds. (Instances of a user's Thread subclass are
    read as plain objects, target included.)"""
    state = plan.dict_get(obj) if plan.dict_get is not None else None
    if type(state) is not dict:
        return
    for name, value in DICT_ITEMS(state):  # iterated, not looked up: no user object's __eq__ is called
        if type(name) is str and name in _THREAD_ARGUMENTS:
            add_kid(kids, ATTR, name, value, plan.attr_mode, plan.attr_reason)


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
    PYMODULE: read_module,
    THREAD: read_thread,
}
