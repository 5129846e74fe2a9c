"""Where a class named by the report lives: its module's source file and its qualified name in that module.

Reads only what the running interpreter already imported (the report's classes are live objects); nothing is
imported here. A class graphsafe cannot point at in a writable source file of the user's is either a
:class:`FixError` (installed code: site-packages) or :class:`Unplaceable` (defined in a function, no source).
"""

from __future__ import annotations

import inspect
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClassSite", "FixError", "Unplaceable", "installed", "locate_class", "writable"]


class FixError(Exception):
    """A fix that must not be applied at all (installed code, a file that cannot be written, no LibCST); the
    message is one line for the user."""


class Unplaceable(Exception):
    """One fix graphsafe does not place (code it does not understand); the message says why."""


@dataclass(frozen=True)
class ClassSite:
    """A class in a source file: the file and the class's qualified name in its module, split on dots."""

    path: Path
    qualname: tuple[str, ...]
    module: str


def _install_roots() -> list[Path]:
    roots = {sysconfig.get_paths().get(key) for key in ("purelib", "platlib")}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return [Path(root).resolve() for root in roots if root]


def installed(path: Path) -> bool:
    """Whether ``path`` is inside an installation directory (site-packages): not the user's source to edit."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in _install_roots()) or any(
        part in ("site-packages", "dist-packages") for part in resolved.parts
    )


def writable(path: Path) -> bool:
    """Whether ``path`` may be rewritten: the process can write it and it is not marked read-only (no write bit
    for anyone: even a superuser leaves such a file alone)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return os.access(path, os.W_OK) and bool(mode & 0o222)


def locate_class(qualified: str) -> ClassSite:
    """The source file and qualified name of the class ``module.Class`` (as the report names owners)."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            break
    else:
        raise Unplaceable(f"no imported module defines {qualified}")
    qualname = tuple(parts[cut:])
    if any(part.startswith("<") for part in qualname):
        raise Unplaceable(f"{qualified} is defined inside a function (no module-level class to edit)")
    obj: object = module
    for part in qualname:
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise Unplaceable(f"{qualified} is not a class reachable by that name in module {module.__name__}")
    try:
        source = inspect.getsourcefile(module)
    except TypeError:
        source = None
    if source is None or not source.endswith(".py"):
        raise Unplaceable(f"module {module.__name__} of {qualified} has no Python source file")
    path = Path(source)
    if installed(path):
        raise FixError(
            f"{qualified} is installed code ({path}): graphsafe fix edits only your own source; fix its project's "
            "checkout (or vendor the class) and run graphsafe fix there"
        )
    return ClassSite(path, qualname, module.__name__)
