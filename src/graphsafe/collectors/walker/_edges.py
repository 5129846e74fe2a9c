"""Edges of a walk: how a parent names a child (a path token), how assign writes through it, and its path text.

Path text is the grammar of :mod:`graphsafe.paths` (:func:`~graphsafe.paths.format_token`,
:func:`~graphsafe.paths.parse_path`); the walker keeps no formatting rules of its own. The same names and keys
recur on every object of every walk, so their texts are computed once and cached. Edges that no path can name
carry the reason instead of a key, and show as ``<reason>`` in messages only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from graphsafe.errors import PathSyntaxError
from graphsafe.paths import Attr, Cell, Item, Token, format_token, parse_path

# Token kinds (they index TOKEN_TYPES and STEP_TEXTS); an UNNAMED edge's key is why no path can name the child.
ATTR, ITEM, CELL, UNNAMED = range(4)

# How assign writes a value at the end of an edge: in place; by rebuilding the (immutable) container into its
# parent; not at all (NO_WRITE, with a reason); or with no guarantee (UNRESOLVED: resolving it runs user code).
# STATE: the edge from the layer to one of its own parameters or buffers, followed only for the attributes set on
# it (``weight.g_idx``); the tensor itself is the seal's parameter or buffer slot, never a walker find.
INPLACE, REBUILD, NO_WRITE, UNRESOLVED, STATE = range(5)

# One child as a reader reports it: token kind, key (or reason), child, child's kind, write mode, reason.
Kid = tuple[int, Any, Any, int, int, str | None]

TOKEN_TYPES: Final[tuple[type[Attr], type[Item], type[Cell]]] = (Attr, Item, Cell)

# By token kind: key -> the text of that step anywhere but first (".name", "[key]", ".__closure__[i]"), and as the
# first step of a path ("name"). Only exact str and int keys are cached (hashing them runs no user code; other path
# keys, True or (8, torch.float32), are formatted each time, since True == 1 would share 1's text).
STEP_TEXTS: Final[tuple[dict[Any, str], dict[Any, str], dict[Any, str]]] = ({}, {}, {})
FIRST_STEP_TEXTS: Final[tuple[dict[Any, str], dict[Any, str], dict[Any, str]]] = ({}, {}, {})
NAMEABLE: Final[dict[str, bool]] = {}  # attribute name -> whether a path can name it
_CACHE_LIMIT: Final = 100_000  # names and keys are usually a small recurring set; bounded all the same


def token(kind: int, key: Any) -> Token:
    """The path token of a named edge."""
    return TOKEN_TYPES[kind](key)


def step_text(kind: int, key: Any) -> str:
    """The text of a named edge that is not the first step of its path (cached in :data:`STEP_TEXTS`)."""
    return _cached_text(STEP_TEXTS[kind], kind, key, False)


def first_step_text(kind: int, key: Any) -> str:
    """The text of a named edge that starts its path (cached in :data:`FIRST_STEP_TEXTS`)."""
    return _cached_text(FIRST_STEP_TEXTS[kind], kind, key, True)


def _cached_text(texts: dict[Any, str], kind: int, key: Any, first: bool) -> str:
    if type(key) is not str and type(key) is not int:  # True == 1: only exact str/int keys share cached texts
        return format_token(token(kind, key), first)
    text = texts.get(key)
    if text is None:
        if len(texts) >= _CACHE_LIMIT:
            texts.clear()
        text = texts[key] = format_token(token(kind, key), first)
    return text


def nameable(name: str) -> bool:
    """Whether a path can name attribute ``name``: the grammar reads it back as the one token ``Attr(name)``."""
    known = NAMEABLE.get(name)
    if known is None:
        if len(NAMEABLE) >= _CACHE_LIMIT:
            NAMEABLE.clear()
        try:
            known = parse_path(format_token(Attr(name), True)) == (Attr(name),)
        except PathSyntaxError:  # "__closure__" (which needs a cell index)
            known = False
        NAMEABLE[name] = known
    return known


def render(steps: Iterable[tuple[int, Any]]) -> str:
    """A path for messages, from ``(token kind, key)`` steps; a step no path can name shows as ``<reason>``."""
    text = ""
    for kind, key in steps:
        if kind == UNNAMED:
            text += f" <{key}> "
        else:
            text += format_token(token(kind, key), not text or text.endswith(" "))
    return text.strip() or "<layer>"
