"""Slot paths: parse once into tokens, then resolve and assign on a layer.

Grammar (relative to a layer)::

    path   := name ( "." name | "[" key "]" )*
    key    := integer | 'text' | "text"

``f.__closure__[i]`` names the *contents* of closure cell ``i`` of function ``f``. Assignment works wherever
the value sits: attributes (``__slots__`` and frozen dataclasses included), dicts, lists, tuples and
NamedTuples (rebuilt and assigned to their parent), closure cells, and ``functools.partial`` args/keywords
(the partial is rebuilt into its parent).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Final

from graphsafe.errors import PathError, PathSyntaxError

__all__ = ["Attr", "Cell", "Item", "SlotPath", "Token", "format_path", "parse_path"]


@dataclass(frozen=True, slots=True)
class Attr:
    """``.name``: an attribute."""

    name: str


@dataclass(frozen=True, slots=True)
class Item:
    """``[key]``: a mapping key or sequence index."""

    key: int | str


@dataclass(frozen=True, slots=True)
class Cell:
    """``.__closure__[index]``: the contents of a function's closure cell."""

    index: int


Token = Attr | Item | Cell

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = re.compile(r"-?[0-9]+")
_MISSING: Final = object()


def _parse_key(path: str, pos: int) -> tuple[int | str, int]:
    """Parse the key after ``[`` at ``pos``; return it and the position after ``]``."""
    if pos >= len(path):
        raise PathSyntaxError(path, pos, "expected a key after '['")
    quote = path[pos]
    if quote in "'\"":
        end = pos + 1
        chars: list[str] = []
        while end < len(path) and path[end] != quote:
            if path[end] == "\\" and end + 1 < len(path):
                end += 1
            chars.append(path[end])
            end += 1
        if end >= len(path):
            raise PathSyntaxError(path, pos, "unterminated string key")
        end += 1
        key: int | str = "".join(chars)
    else:
        match = _INT.match(path, pos)
        if match is None:
            raise PathSyntaxError(path, pos, "a key is an integer or a quoted string")
        key, end = int(match.group()), match.end()
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
            match = _NAME.match(path, pos)
            if match is None:
                raise PathSyntaxError(path, pos, "expected an attribute name")
            tokens.append(Attr(match.group()))
            pos = match.end()
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


def format_path(tokens: tuple[Token, ...] | list[Token]) -> str:
    """Render tokens back into the canonical path text (``parse_path(format_path(t)) == t``)."""
    parts: list[str] = []
    for token in tokens:
        if isinstance(token, Attr):
            parts.append(("." if parts else "") + token.name)
        elif isinstance(token, Cell):
            parts.append(("." if parts else "") + f"__closure__[{token.index}]")
        elif isinstance(token.key, int):
            parts.append(f"[{token.key}]")
        else:
            escaped = token.key.replace("\\", "\\\\").replace("'", "\\'")
            parts.append(f"['{escaped}']")
    return "".join(parts)


def _owner_name(root: object) -> str:
    return type(root).__name__


def _step(obj: Any, token: Token) -> Any:
    """One resolution step; returns ``_MISSING`` when the step does not exist."""
    if isinstance(token, Attr):
        return getattr(obj, token.name, _MISSING)
    if isinstance(token, Cell):
        closure = getattr(obj, "__closure__", None)
        if closure is None or not -len(closure) <= token.index < len(closure):
            return _MISSING
        try:
            return closure[token.index].cell_contents
        except ValueError:  # an empty cell
            return _MISSING
    try:
        return obj[token.key]
    except (KeyError, IndexError, TypeError):
        return _MISSING


def _describe_miss(obj: Any, token: Token) -> str:
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
    """Set ``obj.name``; return a rebuilt container when ``obj`` is immutable, else ``_MISSING``."""
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
    return _MISSING


def _set_item(obj: Any, key: int | str, value: Any) -> Any:
    if isinstance(obj, tuple):
        items = list(obj)
        items[key] = value  # type: ignore[index]
        if hasattr(obj, "_make"):
            return obj._make(items)
        return type(obj)(items) if type(obj) is not tuple else tuple(items)
    obj[key] = value
    return _MISSING


def _set(obj: Any, token: Token, value: Any) -> Any:
    if isinstance(token, Attr):
        return _set_attr(obj, token.name, value)
    if isinstance(token, Cell):
        obj.__closure__[token.index].cell_contents = value
        return _MISSING
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
        obj: Any = root
        for index, token in enumerate(self.tokens):
            nxt = _step(obj, token)
            if nxt is _MISSING:
                where = self.prefix(index) if index else "<layer>"
                raise PathError(_owner_name(root), self.text, where, _describe_miss(obj, token))
            objects.append(nxt)
            obj = nxt
        return objects

    def resolve(self, root: object) -> Any:
        """The value at this path on ``root``. Raises :class:`PathError` naming the failing prefix."""
        obj: Any = root
        for index, token in enumerate(self.tokens):
            nxt = _step(obj, token)
            if nxt is _MISSING:
                where = self.prefix(index) if index else "<layer>"
                raise PathError(_owner_name(root), self.text, where, _describe_miss(obj, token))
            obj = nxt
        return obj

    def resolve_or(self, root: object, default: Any = None) -> Any:
        """The value at this path, or ``default`` when it does not resolve."""
        obj: Any = root
        for token in self.tokens:
            obj = _step(obj, token)
            if obj is _MISSING:
                return default
        return obj

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
            if rebuilt is _MISSING:
                return
            if depth == 0:
                raise PathError(_owner_name(root), self.text, "<layer>", "the layer itself is an immutable container")
            pending = rebuilt
