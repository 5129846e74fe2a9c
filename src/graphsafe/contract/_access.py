"""Slot paths compiled into accessors once, at seal, for the per-reload hot loop.

``compile_getter(path)(root)`` is ``path.resolve_or(root, MISSING)`` and ``compile_setter(path)(root, value)`` is
``path.assign(root, value)``: same results, same errors. They skip the per-call token dispatch, and the setter
takes shortcuts only where the outcome is provably the one ``assign`` would reach (a plain tensor put where
``nn.Module.__setattr__`` would end in ``object.__setattr__``; a plain mutable container). Anything else, and every
failure, goes through :meth:`SlotPath.assign`, so messages and rebuild semantics stay those of the registry.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Final

import torch
from torch import nn

from graphsafe.registry._paths import Attr, Cell, Item, SlotPath, Token

__all__ = ["MISSING", "Getter", "Setter", "compile_getter", "compile_setter", "submodule_is"]

MISSING: Final[Any] = object()

Getter = Callable[[Any], Any]
Setter = Callable[[Any, torch.Tensor], None]

_ITEM_MISS: Final = (KeyError, IndexError, TypeError)
_REBUILT: Final = (functools.partial, tuple)  # assign rebuilds these into their parent instead of mutating them
_MODULE_SETATTR: Final[Any] = nn.Module.__setattr__
_OBJECT_SETATTR: Final = object.__setattr__
_TENSOR: Final = torch.Tensor


def _step(token: Token) -> Getter:
    """One resolution step as :func:`graphsafe.registry._paths._step` takes it; ``MISSING`` when absent."""
    if isinstance(token, Attr):
        name = token.name

        def attr(obj: Any) -> Any:
            return getattr(obj, name, MISSING)

        return attr
    if isinstance(token, Cell):
        index = token.index

        def cell(obj: Any) -> Any:
            closure = getattr(obj, "__closure__", None)
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
        except _ITEM_MISS:
            return MISSING

    return item


def _compile_tokens(tokens: tuple[Token, ...]) -> Getter:
    if not tokens:
        return lambda root: root
    if all(isinstance(t, Attr) for t in tokens):
        if len(tokens) == 1:
            name = tokens[0].name  # type: ignore[union-attr]

            def one(root: Any) -> Any:
                return getattr(root, name, MISSING)

            return one
        # attrgetter raises AttributeError exactly where getattr(obj, name, default) returns the default
        dotted = operator.attrgetter(".".join(t.name for t in tokens))  # type: ignore[union-attr]

        def attrs(root: Any) -> Any:
            try:
                return dotted(root)
            except AttributeError:
                return MISSING

        return attrs
    steps = tuple(_step(t) for t in tokens)
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
            resolves = parent is not MISSING and getattr(parent, name, MISSING) is not MISSING
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


def submodule_is(model: nn.Module, atoms: tuple[str, ...], layer: nn.Module) -> bool | None:
    """``model.get_submodule(".".join(atoms)) is layer`` read through ``_modules``, or ``None`` when unsure.

    Sure only where ``getattr`` provably ends in ``nn.Module.__getattr__``'s ``_modules`` lookup: no override of
    attribute access, and no instance, class, parameter or buffer entry of the same name shadowing the child.
    """
    module: Any = model
    for atom in atoms:
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
        module = child
    return module is layer
