"""Is a sealed layer still where the seal found it? Read through ``_modules`` where that is provably what
``get_submodule`` would do (once per layer per reload, so the fast path matters)."""

from __future__ import annotations

from typing import Any

from torch import nn

from graphsafe.paths import plain_child

__all__ = ["submodule_is"]


def submodule_is(model: nn.Module, atoms: tuple[str, ...], layer: nn.Module) -> bool | None:
    """``model.get_submodule(".".join(atoms)) is layer`` read through ``_modules``, or ``None`` when unsure.

    Sure only where ``getattr`` provably ends in ``nn.Module.__getattr__``'s ``_modules`` lookup
    (:func:`graphsafe.paths.plain_child`): no override of attribute access, and no instance, class, parameter or
    buffer entry of the same name shadowing the child.
    """
    module: Any = model
    for atom in atoms:
        module = plain_child(module, atom)
        if module is None:
            return None
    return module is layer
