"""Is a sealed layer still where the seal found it? Read through ``_modules`` where that is provably what
``get_submodule`` would do (once per layer per reload, so the fast path matters)."""

from __future__ import annotations

from typing import Any, Final

from torch import nn

__all__ = ["submodule_is"]

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
