"""Every qualified name of every module: a submodule held at two paths (``model.a is model.b``, or one layer under
two parents) is one module with two names. ``named_modules()`` yields only the first; a check that knows a module
by its first name alone misses a loader binding another module at the second. One walk of ``_modules``, each
module's children read once, cycles cut."""

from __future__ import annotations

from torch import nn

__all__ = ["module_names"]

#: How many names of one module are kept (a module reachable along exponentially many paths: a diamond lattice).
MAX_NAMES = 64


def module_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(module) -> [qualified name, ...]`` for every module of ``model``, the name ``named_modules()`` gives
    first, then the others in the same traversal order; at most :data:`MAX_NAMES` a module."""
    names: dict[int, list[str]] = {}
    # Depth first, children in registration order, like named_modules(); a module on its own ancestor path is a cycle.
    stack: list[tuple[str, nn.Module, frozenset[int]]] = [("", model, frozenset())]
    while stack:
        name, module, above = stack.pop()
        known = names.setdefault(id(module), [])
        if len(known) >= MAX_NAMES:
            continue
        known.append(name)
        if len(known) > 1 and not module._modules:
            continue
        inside = above | {id(module)}
        children = [(child_name, child) for child_name, child in module._modules.items() if child is not None]
        for child_name, child in reversed(children):
            if id(child) not in inside:
                stack.append((f"{name}.{child_name}" if name else child_name, child, inside))
    return names
