"""Slot paths: the one grammar, resolved and assigned on a layer, and compiled into accessors for hot loops.

Grammar (relative to a layer)::

    path   := name ( "." name | "[" key "]" )*
    name   := identifier | digits | 'text' | "text"
    key    := integer | 'text' | "text" | True | False | None | torch.<dtype> | "(" [ key ( "," key )* [","] ] ")"

A name is any attribute name: a (Unicode) identifier or a run of digits as it is (``échelle``, the ``0`` of an
``nn.ParameterList``), anything else quoted (``'ws 8'``). A key is a dict key or sequence index; tuple keys of
those scalars (``ws[(8, torch.float32)]``) hash and compare in C, so resolving them runs no user code. A one-element
tuple needs its trailing comma, as in Python. ``f.__closure__[i]`` names the *contents* of closure cell ``i`` of
function ``f``. Assignment works wherever
the value sits: attributes (``__slots__`` and frozen dataclasses included), dicts, lists, tuples and
NamedTuples (rebuilt and assigned to their parent), closure cells, and ``functools.partial`` args/keywords
(the partial is rebuilt into its parent).

:func:`compile_getter` and :func:`compile_setter` turn a path into accessors once (at seal) for the per-reload
loop: ``compile_getter(path)(root)`` is ``path.resolve_or(root, MISSING)`` and ``compile_setter(path)(root, value)``
is ``path.assign(root, value)``, with the same results and errors. They skip the per-call token dispatch, and the
setter takes shortcuts only where the outcome is provably the one ``assign`` would reach (a plain tensor put where
``nn.Module.__setattr__`` would end in ``object.__setattr__``; a plain mutable container). Anything else, and
every failure, goes through :meth:`SlotPath.assign`.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from graphsafe.errors import PathError, PathSyntaxError

__all__ = [
    "MISSING",
    "Attr",
    "Cell",
    "Getter",
    "Item",
    "Key",
    "Setter",
    "SlotPath",
    "Token",
    "compile_getter",
    "compile_setter",
    "format_path",
    "plain_child",
    "format_token",
    "is_path_key",
    "parse_path",
]


@dataclass(frozen=True, slots=True)
class Attr:
    """``.name``: an attribute."""

    name: str


#: A key the grammar can write: ``int``, ``str``, ``bool``, ``None``, a ``torch.dtype`` or a tuple of keys.
Key = Any


@dataclass(frozen=True, slots=True)
class Item:
    """``[key]``: a mapping key or sequence index (see :data:`Key`)."""

    key: Key


@dataclass(frozen=True, slots=True)
class Cell:
    """``.__closure__[index]``: the contents of a function's closure cell."""

    index: int


Token = Attr | Item | Cell

_NAME = re.compile(r"[^\W\d]\w*|[0-9]+")  # an identifier (Unicode) or digits; anything else is quoted
_INT = re.compile(r"-?[0-9]+")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")  # True, False, None, torch.<dtype>
_WORDS: Final[dict[str, Any]] = {"True": True, "False": False, "None": None}
_KEY_HELP: Final = "a key is an integer or a quoted string (or True, False, None, torch.<dtype>, or a tuple of those)"
MISSING: Final[Any] = object()
"""What a lookup returns where a path does not resolve (a value no model holds)."""


def _parse_string(path: str, pos: int) -> tuple[str, int]:
    """Parse the quoted string at ``pos``; return it and the position after the closing quote."""
    quote = path[pos]
    end = pos + 1
    chars: list[str] = []
    while end < len(path) and path[end] != quote:
        if path[end] == "\\" and end + 1 < len(path):
            end += 1
        chars.append(path[end])
        end += 1
    if end >= len(path):
        raise PathSyntaxError(path, pos, "unterminated string")
    return "".join(chars), end + 1


def _skip_spaces(path: str, pos: int) -> int:
    while pos < len(path) and path[pos] == " ":
        pos += 1
    return pos


def _parse_value(path: str, pos: int, in_tuple: bool) -> tuple[Key, int]:
    """Parse one key at ``pos`` (a scalar or a tuple); return it and the position after it."""
    if pos >= len(path):
        raise PathSyntaxError(path, pos, "expected a key after '['" if not in_tuple else "unterminated tuple key")
    char = path[pos]
    if char in "'\"":
        try:
            return _parse_string(path, pos)
        except PathSyntaxError:
            raise PathSyntaxError(path, pos, "unterminated string key") from None
    if char == "(":
        items: list[Key] = []
        at = _skip_spaces(path, pos + 1)
        comma = False
        while at < len(path) and path[at] != ")":
            item, at = _parse_value(path, at, True)
            items.append(item)
            at = _skip_spaces(path, at)
            comma = at < len(path) and path[at] == ","
            if comma:
                at = _skip_spaces(path, at + 1)
            elif at < len(path) and path[at] != ")":
                raise PathSyntaxError(path, at, "expected ',' or ')' in a tuple key")
        if at >= len(path):
            raise PathSyntaxError(path, pos, "unterminated tuple key")
        if len(items) == 1 and not comma:
            raise PathSyntaxError(path, pos, "a one-element tuple key needs a trailing comma")
        return tuple(items), at + 1
    match = _INT.match(path, pos)
    if match is not None:
        return int(match.group()), match.end()
    match = _WORD.match(path, pos)
    if match is not None:
        word = match.group()
        if word in _WORDS:
            return _WORDS[word], match.end()
        if word.startswith("torch.") and isinstance(getattr(torch, word[6:], None), torch.dtype):
            return getattr(torch, word[6:]), match.end()
    raise PathSyntaxError(path, pos, _KEY_HELP)


def _parse_key(path: str, pos: int) -> tuple[Key, int]:
    """Parse the key after ``[`` at ``pos``; return it and the position after ``]``."""
    key, end = _parse_value(path, pos, False)
    if end >= len(path) or path[end] != "]":
        raise PathSyntaxError(path, end, "expected ']'")
    return key, end + 1


@functools.lru_cache(maxsize=65536)
def parse_path(path: str) -> tuple[Token, ...]:
    """Parse ``path`` into tokens (cached). Raises :class:`PathSyntaxError` on bad syntax."""
    if not isinstance(path, str):
        raise TypeError(f"a slot path is a str, not {type(path).__name__}")
    if not path:
        raise PathSyntaxError(path, 0, "empty path")
    tokens: list[Token] = []
    pos = 0
    expect_name = True
    while pos < len(path):
        if expect_name:
            if path[pos] in "'\"":
                name, pos = _parse_string(path, pos)
            else:
                match = _NAME.match(path, pos)
                if match is None:
                    raise PathSyntaxError(path, pos, "expected an attribute name")
                name, pos = match.group(), match.end()
            tokens.append(Attr(name))
            expect_name = False
            continue
        char = path[pos]
        if char == ".":
            if tokens[-1] == Attr("__closure__"):
                raise PathSyntaxError(path, pos, "'__closure__' must be followed by a cell index")
            pos += 1
            expect_name = True
            if pos >= len(path):
                raise PathSyntaxError(path, pos, "path ends with '.'")
        elif char == "[":
            key_pos = pos + 1
            key, pos = _parse_key(path, key_pos)
            last = tokens[-1] if tokens else None
            if last == Attr("__closure__"):
                if not isinstance(key, int):
                    raise PathSyntaxError(path, key_pos, "a closure cell index is an integer")
                tokens[-1] = Cell(key)
            else:
                tokens.append(Item(key))
        else:
            raise PathSyntaxError(path, pos, f"unexpected {char!r}; expected '.' or '['")
    if tokens[-1] == Attr("__closure__"):
        raise PathSyntaxError(path, len(path), "'__closure__' must be followed by a cell index")
    return tuple(tokens)


def format_token(token: Token, first: bool) -> str:
    """The text of one token: ``name`` / ``.name``, ``[0]`` / ``['key']``, ``.__closure__[i]``.

    ``first`` says whether the token starts the path (no leading dot). A key is written quoted with ``'``, with
    backslashes and quotes escaped, so the text parses back into the same token.
    """
    if isinstance(token, Attr):
        name = token.name if _bare_name(token.name) else _quoted(token.name)
        return name if first else "." + name
    if isinstance(token, Cell):
        return f"__closure__[{token.index}]" if first else f".__closure__[{token.index}]"
    return f"[{_format_key(token.key)}]"


def _bare_name(name: str) -> bool:
    """Whether an attribute name reads back unquoted (an identifier or digits, no more)."""
    match = _NAME.fullmatch(name)
    return match is not None and (name[0] in "0123456789" or name.isidentifier())


def _quoted(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def _format_key(key: Key) -> str:
    """The text of a key (the inverse of :func:`_parse_value`)."""
    if key is None or key is True or key is False or type(key) is int:
        return repr(key)
    if type(key) is str:
        return _quoted(key)
    if type(key) is torch.dtype:
        return str(key)
    if type(key) is tuple:
        inner = ", ".join(_format_key(item) for item in key)
        return f"({inner},)" if len(key) == 1 else f"({inner})"
    raise TypeError(f"no slot path can name a key of type {type(key).__name__}")


def is_path_key(key: object) -> bool:
    """Whether the grammar can write ``key`` (checked by exact type: hashing it then runs no user code)."""
    kind = type(key)
    if kind is int or kind is str or kind is bool or key is None or kind is torch.dtype:
        return True
    return kind is tuple and all(is_path_key(item) for item in key)  # type: ignore[attr-defined]


def format_path(tokens: tuple[Token, ...] | list[Token]) -> str:
    """Render tokens back into the canonical path text (``parse_path(format_path(t)) == t``)."""
    return "".join(format_token(token, index == 0) for index, token in enumerate(tokens))


def _owner_name(root: object) -> str:
    return type(root).__name__


class _Raised:
    """What a step returns when the user code it ran (``__getattr__``, ``__getitem__``...) raised: the error."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _raised_text(error: Exception) -> str:
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _step(obj: Any, token: Token) -> Any:
    """One resolution step; ``MISSING`` when the step does not exist, a :class:`_Raised` when resolving raised.

    Resolution may run user code (a ``__getattr__``, ``__getattribute__`` or ``__getitem__`` on the path); whatever
    that raises, a recursion included, is caught here and reported as a miss, never raised to the caller raw.
    """
    try:
        if isinstance(token, Attr):
            return getattr(obj, token.name, MISSING)
        if isinstance(token, Cell):
            closure = getattr(obj, "__closure__", None)
            if closure is None or not -len(closure) <= token.index < len(closure):
                return MISSING
            try:
                return closure[token.index].cell_contents
            except ValueError:  # an empty cell
                return MISSING
        try:
            return obj[token.key]
        except (KeyError, IndexError, TypeError):
            return MISSING
    except Exception as exc:
        return _Raised(exc)


def _describe_miss(obj: Any, token: Token, raised: _Raised | None = None) -> str:
    if raised is not None:
        step = format_token(token, True)
        return f"resolving {step!r} on {type(obj).__name__} raised {_raised_text(raised.error)}"
    if obj is None:
        return "None"
    if isinstance(token, Attr):
        return f"no attribute {token.name!r} on {type(obj).__name__}"
    if isinstance(token, Cell):
        return f"no closure cell {token.index} on {type(obj).__name__}"
    return f"no item [{token.key!r}] in {type(obj).__name__}"


def _rebuild_partial(part: functools.partial[Any], **changes: Any) -> functools.partial[Any]:
    func = changes.get("func", part.func)
    args = changes.get("args", part.args)
    keywords = changes.get("keywords", part.keywords)
    rebuilt = type(part)(func, *args, **keywords)
    state = getattr(part, "__dict__", None)
    if state:
        rebuilt.__dict__.update(state)
    return rebuilt


def _set_attr(obj: Any, name: str, value: Any) -> Any:
    """Set ``obj.name``; return a rebuilt container when ``obj`` is immutable, else ``MISSING``."""
    if isinstance(obj, functools.partial) and name in ("func", "args", "keywords"):
        return _rebuild_partial(obj, **{name: value})
    if isinstance(obj, tuple) and hasattr(obj, "_replace"):
        return obj._replace(**{name: value})
    try:
        setattr(obj, name, value)
    except AttributeError:
        # Frozen dataclasses: write the instance slot directly, as the class's own __init__ does (a property
        # without a setter still refuses). Not on TypeError: nn.Module raises it for a plain tensor put where
        # a Parameter/buffer/submodule lives, and bypassing it would shadow the registered one in __dict__.
        object.__setattr__(obj, name, value)
    return MISSING


def _set_item(obj: Any, key: int | str, value: Any) -> Any:
    if isinstance(obj, tuple):
        items = list(obj)
        items[key] = value  # type: ignore[index]
        if hasattr(obj, "_make"):
            return obj._make(items)
        return type(obj)(items) if type(obj) is not tuple else tuple(items)
    obj[key] = value
    return MISSING


def _set(obj: Any, token: Token, value: Any) -> Any:
    if isinstance(token, Attr):
        return _set_attr(obj, token.name, value)
    if isinstance(token, Cell):
        obj.__closure__[token.index].cell_contents = value
        return MISSING
    return _set_item(obj, token.key, value)


class SlotPath:
    """A parsed slot path, resolvable and assignable on any layer.

    Instances are cheap to keep: parsing happens once, and :meth:`resolve` is a loop over tokens.
    """

    __slots__ = ("text", "tokens")

    def __init__(self, path: str | SlotPath) -> None:
        if isinstance(path, SlotPath):
            self.text: str = path.text
            self.tokens: tuple[Token, ...] = path.tokens
            return
        self.tokens = parse_path(path)
        self.text = format_path(self.tokens)

    def __repr__(self) -> str:
        return f"SlotPath({self.text!r})"

    def __str__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotPath) and other.tokens == self.tokens

    def __hash__(self) -> int:
        return hash(self.tokens)

    def prefix(self, length: int) -> str:
        """The path text of the first ``length`` tokens."""
        return format_path(self.tokens[:length])

    def chain(self, root: object) -> list[Any]:
        """Every object along the path: ``[root, step1, ..., value]``. Raises :class:`PathError`."""
        objects: list[Any] = [root]
        for index, token in enumerate(self.tokens):
            objects.append(self._step_or_raise(root, objects[-1], index, token))
        return objects

    def resolve(self, root: object) -> Any:
        """The value at this path on ``root``. Raises :class:`PathError` naming the failing prefix."""
        obj: Any = root
        for index, token in enumerate(self.tokens):
            obj = self._step_or_raise(root, obj, index, token)
        return obj

    def _step_or_raise(self, root: object, obj: Any, index: int, token: Token) -> Any:
        nxt = _step(obj, token)
        if nxt is MISSING or type(nxt) is _Raised:
            where = self.prefix(index) if index else "<layer>"
            raised = nxt if type(nxt) is _Raised else None
            error = PathError(_owner_name(root), self.text, where, _describe_miss(obj, token, raised))
            if raised is not None:
                raise error from raised.error
            raise error
        return nxt

    def resolve_or(self, root: object, default: Any = None) -> Any:
        """The value at this path, or ``default`` when it does not resolve (or resolving it raised)."""
        obj: Any = root
        for token in self.tokens:
            obj = _step(obj, token)
            if obj is MISSING or type(obj) is _Raised:
                return default
        return obj

    def why_missing(self, root: object) -> str:
        """Why this path does not resolve on ``root``, in one line (``""`` when it does)."""
        try:
            self.resolve(root)
        except PathError as exc:
            return f"{exc.reason} at {exc.prefix!r}"
        return ""

    def assign(self, root: object, value: Any) -> None:
        """Put ``value`` at this path, rebuilding immutable containers (tuples, partials) into parents."""
        objects = self.chain(root)[:-1]
        pending: Any = value
        for depth in range(len(self.tokens) - 1, -1, -1):
            container = objects[depth]
            try:
                rebuilt = _set(container, self.tokens[depth], pending)
            except Exception as exc:
                where = self.prefix(depth) if depth else "<layer>"
                raise PathError(
                    _owner_name(root),
                    self.text,
                    where,
                    f"cannot assign into {type(container).__name__} ({type(exc).__name__}: {exc})",
                ) from exc
            if rebuilt is MISSING:
                return
            if depth == 0:
                raise PathError(_owner_name(root), self.text, "<layer>", "the layer itself is an immutable container")
            pending = rebuilt


# -- compiled accessors -------------------------------------------------------------------------------------

Getter = Callable[[Any], Any]
Setter = Callable[[Any, torch.Tensor], None]

_REBUILT: Final = (functools.partial, tuple)  # assign rebuilds these into their parent instead of mutating them
_MODULE_SETATTR: Final[Any] = nn.Module.__setattr__
_OBJECT_SETATTR: Final = object.__setattr__
_TENSOR: Final = torch.Tensor


def _compiled_step(token: Token) -> Getter:
    """One resolution step as :func:`_step` takes it, as a function; ``MISSING`` when absent."""
    if isinstance(token, Attr):
        name = token.name

        def attr(obj: Any) -> Any:
            try:
                return getattr(obj, name, MISSING)
            except Exception:  # user code on the path raised (or recursed): the path does not resolve
                return MISSING

        return attr
    if isinstance(token, Cell):
        index = token.index

        def cell(obj: Any) -> Any:
            try:
                closure = getattr(obj, "__closure__", None)
            except Exception:
                return MISSING
            if closure is None or not -len(closure) <= index < len(closure):
                return MISSING
            try:
                return closure[index].cell_contents
            except ValueError:  # an empty cell
                return MISSING

        return cell
    key = token.key

    def item(obj: Any) -> Any:
        try:
            return obj[key]
        except Exception:  # a miss, or a user __getitem__ that raised
            return MISSING

    return item


def _compile_tokens(tokens: tuple[Token, ...]) -> Getter:
    if not tokens:
        return lambda root: root
    if all(isinstance(t, Attr) for t in tokens):
        if len(tokens) == 1:
            return _compiled_step(tokens[0])
        names = [t.name for t in tokens]  # type: ignore[union-attr]
        if not any("." in n for n in names):
            # attrgetter raises AttributeError exactly where getattr(obj, name, default) returns the default
            dotted = operator.attrgetter(".".join(names))

            def attrs(root: Any) -> Any:
                try:
                    return dotted(root)
                except Exception:  # absent, or user code on the path raised
                    return MISSING

            return attrs
    steps = tuple(_compiled_step(t) for t in tokens)
    if len(steps) == 2:
        first, second = steps

        def two(root: Any) -> Any:
            obj = first(root)
            return MISSING if obj is MISSING else second(obj)

        return two

    def many(root: Any) -> Any:
        obj = root
        for step in steps:
            obj = step(obj)
            if obj is MISSING:
                return MISSING
        return obj

    return many


def compile_getter(path: SlotPath) -> Getter:
    """``root -> path.resolve_or(root, MISSING)``, without re-dispatching on token types per call."""
    return _compile_tokens(path.tokens)


_CLASS_NAMES: dict[int, tuple[type, frozenset[str]]] = {}  # by id(cls): every name the class (MRO) defines
_MODULE_GETATTR: Final[Any] = nn.Module.__getattr__
_OBJECT_GETATTRIBUTE: Final[Any] = object.__getattribute__


def _class_names(cls: type) -> frozenset[str]:
    cached = _CLASS_NAMES.get(id(cls))
    if cached is not None and cached[0] is cls:
        return cached[1]
    names = frozenset(name for klass in cls.__mro__ for name in vars(klass))
    if len(_CLASS_NAMES) > 10_000:
        _CLASS_NAMES.clear()
    _CLASS_NAMES[id(cls)] = (cls, names)
    return names


def plain_child(module: Any, atom: str) -> nn.Module | None:
    """``getattr(module, atom)`` read straight from the module's ``_modules``, where that is provably what attribute
    access returns: no override of attribute access, and no instance, class, parameter or buffer entry of the same
    name shadowing the child. ``None`` when unsure, or when ``_modules`` has no module of that name."""
    cls = type(module)
    if cls.__getattr__ is not _MODULE_GETATTR or cls.__getattribute__ is not _OBJECT_GETATTRIBUTE:
        return None
    state = module.__dict__
    children = state.get("_modules")
    child = children.get(atom) if children is not None else None
    if (
        child is None
        or atom in state
        or atom in state.get("_parameters", ())
        or atom in state.get("_buffers", ())
        or atom in _class_names(cls)
    ):
        return None
    return child  # type: ignore[no-any-return]


_PLAIN_MODULE_CLASSES: dict[int, tuple[type, bool]] = {}  # by id(cls); the class is kept so its id stays unique


def _module_setattr_is_plain(cls: type) -> bool:
    """Whether ``nn.Module.__setattr__``'s final ``super().__setattr__`` is ``object.__setattr__`` for ``cls``."""
    cached = _PLAIN_MODULE_CLASSES.get(id(cls))
    if cached is not None and cached[0] is cls:
        return cached[1]
    mro = cls.__mro__
    plain = nn.Module in mro and all(
        "__setattr__" not in vars(klass) for klass in mro[mro.index(nn.Module) + 1 :] if klass is not object
    )
    if len(_PLAIN_MODULE_CLASSES) > 10_000:
        _PLAIN_MODULE_CLASSES.clear()
    _PLAIN_MODULE_CLASSES[id(cls)] = (cls, plain)
    return plain


def _set_module_attr_fast(module: Any, name: str, value: torch.Tensor) -> bool:
    """Do what ``nn.Module.__setattr__`` does for a plain tensor that is no parameter, buffer or module; else False."""
    cls = type(module)
    if cls.__setattr__ is not _MODULE_SETATTR or type(value) is not _TENSOR or value.__dict__:
        return False  # a tensor with instance attributes may claim to be a Parameter or Buffer (_is_param, ...)
    state = module.__dict__
    for table in ("_parameters", "_modules", "_buffers"):
        entries = state.get(table)
        if entries is not None and name in entries:
            return False
    if not _module_setattr_is_plain(cls):
        return False
    _OBJECT_SETATTR(module, name, value)
    return True


def compile_setter(path: SlotPath) -> Setter:
    """``(root, value) -> path.assign(root, value)``, with direct writes where they provably do the same."""
    tokens = path.tokens
    last = tokens[-1]
    parent_of = _compile_tokens(tokens[:-1])
    assign = path.assign

    if isinstance(last, Attr):
        name = last.name

        def set_attr(root: Any, value: torch.Tensor) -> None:
            parent = parent_of(root)
            # assign first resolves the whole path (and refuses if it no longer does), then writes the last step
            try:
                resolves = parent is not MISSING and getattr(parent, name, MISSING) is not MISSING
            except Exception:
                resolves = False  # assign resolves again and says why
            if resolves and not isinstance(parent, _REBUILT):
                if isinstance(parent, nn.Module):
                    if _set_module_attr_fast(parent, name, value):
                        return
                else:
                    try:
                        setattr(parent, name, value)
                        return
                    except Exception:
                        pass  # a frozen dataclass, a read-only property: assign knows what to do (or says why)
            assign(root, value)

        return set_attr
    if isinstance(last, Item):
        key = last.key

        def set_item(root: Any, value: torch.Tensor) -> None:
            parent = parent_of(root)
            kind = type(parent)
            if (kind is dict and key in parent) or (
                kind is list and type(key) is int and -len(parent) <= key < len(parent)
            ):
                parent[key] = value
                return
            assign(root, value)  # containers that rebuild or resolve in their own way; and every failure

        return set_item
    return assign
