"""The TARGET of ``graphsafe report``: a ``module:callable`` that returns a loaded model and how to reload it.

:func:`load_target` imports and calls it and checks what comes back; anything unusable is a :class:`TargetError`
whose message is one sentence for the user. The zoo targets (:func:`legacy_zoo`, :func:`migrated_zoo`) are the
built-in ones; :func:`legacy_zoo` is the default.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsafe.cli._exit import first_line
from graphsafe.testing.zoo import EXAMPLES, Variant

__all__ = [
    "DEFAULT_TARGET",
    "TARGET_HELP",
    "ReloadTarget",
    "TargetError",
    "legacy_zoo",
    "load_target",
    "migrated_zoo",
    "zoo_target",
]

#: What ``graphsafe report`` reports on without a TARGET.
DEFAULT_TARGET = "graphsafe.cli:legacy_zoo"

#: The protocol, as ``graphsafe report --help`` states it.
TARGET_HELP = (
    "'module:callable' (e.g. mypkg.serving:reload_target). Calling it with no arguments returns either an object "
    "with `model` (an nn.Module, already loaded) and `reload(model, seed)` (loads weights made from seed, in "
    "place, then PWAL), optionally `warmup(model)` (one forward), or a tuple (model, reload) or (model, reload, "
    f"warmup). Default: the example zoo, legacy variants ({DEFAULT_TARGET})."
)

_EXPECTED = "expected an object with `model` (nn.Module) and `reload(model, seed)`, or a tuple (model, reload_fn)"


@dataclass(frozen=True)
class ReloadTarget:
    """What ``graphsafe report`` needs of a model: loaded, reloadable with other weights, and warmed up.

    ``reload(model, seed)`` loads weights made from ``seed`` into the model the way the engine does (in place,
    then PWAL). ``warmup(model)``, if given, runs a forward: the CLI seals right after the load, then warms up
    (as an engine does before capture), so tensors the first forward allocates show as allocated after PWAL.
    """

    model: nn.Module
    reload: Callable[[nn.Module, int], None]
    warmup: Callable[[nn.Module], None] | None = None


class TargetError(Exception):
    """A TARGET that cannot be imported, called or used; the message is one sentence for the user."""


def load_target(spec: str) -> ReloadTarget:
    """Import ``module:callable``, call it, and check what it returns (raises :class:`TargetError`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"TARGET {spec!r} is not of the form 'module:callable' (e.g. mypkg.serving:make_target)")
    # A console script's sys.path starts at its bin directory; make the current directory importable as with -m.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"cannot import module {module_name!r} of TARGET {spec!r} ({first_line(exc)})") from exc
    except Exception as exc:
        raise TargetError(f"importing module {module_name!r} of TARGET {spec!r} raised {first_line(exc)}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise TargetError(f"module {module_name!r} has no attribute {attr!r} (TARGET {spec!r})") from exc
        except Exception as exc:  # a module __getattr__ or property of the user's: their TARGET, not a graphsafe bug
            raise TargetError(f"looking up {attr!r} in module {module_name!r} raised {first_line(exc)}") from exc
    if not callable(obj):
        raise TargetError(f"TARGET {spec!r} names an object of type {type(obj).__name__}, which is not callable")
    try:
        value = obj()
    except Exception as exc:
        raise TargetError(f"calling TARGET {spec}() raised {first_line(exc)}") from exc
    return _as_target(value, spec)


def _as_target(value: Any, spec: str) -> ReloadTarget:
    """``value`` (an object with ``model`` and ``reload``, or a tuple) as a checked :class:`ReloadTarget`."""
    if isinstance(value, ReloadTarget):
        return value
    try:
        return _unpack_target(value, spec)
    except TargetError:
        raise
    except Exception as exc:  # a property of the user's that raises: their TARGET, not a graphsafe bug
        raise TargetError(f"reading model/reload/warmup of what {spec}() returned raised {first_line(exc)}") from exc


def _unpack_target(value: Any, spec: str) -> ReloadTarget:
    """:func:`_as_target`'s checks; what the user's object raises on the way is turned into a TargetError there."""
    warmup: Any = None
    if isinstance(value, tuple):
        if len(value) not in (2, 3):
            raise TargetError(f"{spec}() returned a tuple of {len(value)} item(s); {_EXPECTED}")
        model, reload = value[0], value[1]
        warmup = value[2] if len(value) == 3 else None
    elif hasattr(value, "model") and hasattr(value, "reload"):
        model, reload, warmup = value.model, value.reload, getattr(value, "warmup", None)
    else:
        raise TargetError(f"{spec}() returned {type(value).__name__}; {_EXPECTED}")
    if not isinstance(model, nn.Module):
        raise TargetError(f"{spec}() returned a model of type {type(model).__name__}, not an nn.Module; {_EXPECTED}")
    if not callable(reload):
        raise TargetError(f"{spec}() returned a reload of type {type(reload).__name__}, which is not callable")
    if warmup is not None and not callable(warmup):
        raise TargetError(f"{spec}() returned a warmup of type {type(warmup).__name__}, which is not callable")
    return ReloadTarget(model, reload, warmup)


# ----------------------------------------------------------------------------------------------------------------
# The built-in targets: the example zoo.


def zoo_target(variant: Variant, names: Iterable[str] | None = None, *, seed: int = 0) -> ReloadTarget:
    """Every example (or those in ``names``) of ``variant`` in one model, loaded with weights from ``seed``.

    ``model[name]`` is that example's model.
    """
    examples = {name: EXAMPLES[name] for name in (names if names is not None else EXAMPLES)}
    model = nn.ModuleDict({name: ex.build(variant, seed=seed) for name, ex in examples.items()})

    def reload(model: nn.Module, seed: int) -> None:
        for name, ex in examples.items():
            sub = model.get_submodule(name)
            ex.load_weights(sub, ex.make_weights(sub, seed))

    def warmup(model: nn.Module) -> None:
        with torch.no_grad():
            for name, ex in examples.items():
                sub = model.get_submodule(name)
                ex.forward(sub, ex.example_input(sub))

    return ReloadTarget(model, reload, warmup)


def legacy_zoo() -> ReloadTarget:
    """The zoo as sites are written today (nothing declared): ``graphsafe report graphsafe.cli:legacy_zoo``."""
    return zoo_target("legacy")


def migrated_zoo() -> ReloadTarget:
    """The zoo with graphsafe declarations added: its migration report is empty."""
    return zoo_target("migrated")
