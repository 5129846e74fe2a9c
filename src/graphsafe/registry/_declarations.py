"""Declaring graph-visible derived tensors: ``graph_visible``, ``register_derived`` and ``stable_empty``."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from graphsafe.errors import DeclarationError, PathError, PathSyntaxError
from graphsafe.handles import RemovableHandle
from graphsafe.paths import SlotPath
from graphsafe.registry._store import Declaration, layer_store

P = ParamSpec("P")
R = TypeVar("R")

#: Attribute the ``graph_visible`` marker sets on the function it wraps (read it with :func:`graph_visible_spec`).
GRAPH_VISIBLE_ATTR = "graphsafe_graph_visible"


@dataclass(frozen=True, slots=True)
class GraphVisibleSpec:
    """What ``@graph_visible`` recorded on a function, readable without running it."""

    paths: tuple[str, ...]
    derived_from: tuple[str, ...] | None
    static: bool
    layer_arg: str | None


def _normalize_derived_from(derived_from: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if derived_from is None:
        return None
    items = (derived_from,) if isinstance(derived_from, str) else tuple(derived_from)
    for item in items:
        SlotPath(item)  # syntax check at declaration time
    return items


def _qualified(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def graph_visible_spec(fn: Callable[..., Any]) -> GraphVisibleSpec | None:
    """What ``@graph_visible`` recorded on ``fn`` (a function, method or bound method), or ``None``."""
    target = getattr(fn, "__func__", fn)
    spec = getattr(target, GRAPH_VISIBLE_ATTR, None)
    return spec if isinstance(spec, GraphVisibleSpec) else None


def layer_of_call(
    signature: inspect.Signature | None, layer_arg: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> nn.Module | None:
    """The layer a PWAL call works on: the ``layer_arg`` (or ``layer``) parameter, else ``(self, layer, ...)``'s
    layer, else ``self`` when it is a module. Shared by ``@graph_visible`` and the vLLM declarations pack."""
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            name = layer_arg or ("layer" if "layer" in bound.arguments else None)
            if name is not None:
                value = bound.arguments.get(name)
                return value if isinstance(value, nn.Module) else None
    # No parameter named "layer": a quant method's (self, layer, ...) or a layer's own (self, ...).
    if len(args) >= 2 and isinstance(args[1], nn.Module):
        return args[1]
    if args and isinstance(args[0], nn.Module):
        return args[0]
    return None


def graph_visible(
    *paths: str,
    derived_from: str | Sequence[str] | None = None,
    static: bool = False,
    layer_arg: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare the graph-visible tensors a ``process_weights_after_loading`` creates.

    Decorates a method ``(self, layer, ...)``, a function ``(layer, ...)`` or a layer's own method ``(self, ...)``;
    ``layer_arg`` names the parameter holding the layer when none of these fit. After the wrapped call returns,
    each path is resolved on the layer and declared for it. A path that does not resolve to a tensor then raises
    :class:`~graphsafe.DeclarationError`. ``derived_from`` names the tensors (paths on the layer) they are computed
    from; it must resolve, else :class:`~graphsafe.DeclarationError`. Without it the contract records what PWAL
    really reads on the first reload (until then: the layer's parameters, buffers and tensor attributes).
    ``static=True`` marks contents PWAL legitimately leaves alone (zeroed scratch).
    """
    if not paths:
        raise DeclarationError("graph_visible() needs at least one slot path")
    _require_bool("graph_visible", "static", static)
    parsed = tuple(SlotPath(p) for p in paths)  # PathSyntaxError at import time, where the bug is
    sources = _normalize_derived_from(derived_from)
    spec = GraphVisibleSpec(tuple(p.text for p in parsed), sources, static, layer_arg)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        where = _qualified(fn)
        source = f"@graph_visible on {where}"

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            result = fn(*args, **kwargs)
            layer = layer_of_call(signature, layer_arg, args, kwargs)
            if layer is None:
                raise DeclarationError(
                    f"{where}: @graph_visible could not find the layer among the call's arguments; "
                    "name it with @graph_visible(..., layer_arg='name')"
                )
            for path in parsed:
                _declare(layer, path, None, sources, static, source, where)
            return result

        setattr(wrapper, GRAPH_VISIBLE_ATTR, spec)
        return wrapper

    return decorate


def _require_bool(where: str, name: str, value: object) -> None:
    """``static='yes'`` would be truthy and silently turn off the staleness check: only ``True``/``False``."""
    if not isinstance(value, bool):
        raise DeclarationError(f"{where}: {name} must be True or False, got {value!r}")


def _declare(
    layer: nn.Module,
    path: SlotPath,
    tensor: torch.Tensor | None,
    derived_from: tuple[str, ...] | None,
    static: bool,
    source: str,
    where: str,
) -> Declaration:
    try:
        value = path.resolve(layer)
    except PathError as exc:
        raise DeclarationError(
            f"{where}: declared slot {path.text!r} on {type(layer).__name__} does not resolve: "
            f"{exc.reason} at {exc.prefix!r}. Declare it after the tensor is assigned."
        ) from exc
    if not isinstance(value, torch.Tensor):
        raise DeclarationError(
            f"{where}: declared slot {path.text!r} on {type(layer).__name__} holds {type(value).__name__}, not a tensor"
        )
    if tensor is not None and not _same_view(value, tensor):
        raise DeclarationError(
            f"{where}: register_derived({path.text!r}, tensor) on {type(layer).__name__}: the path resolves to a "
            "different tensor (storage, offset, shape or stride differ) than the one passed"
        )
    store = layer_store(layer)
    assert store is not None
    existing = store.slots.get(path.text)
    if (
        existing is not None
        and existing.source == source
        and existing.derived_from == derived_from
        and existing.static == static
    ):
        return existing  # the common case: PWAL re-declaring the same slot on every reload
    for item in derived_from or ():
        if not isinstance(_slot_path(item).resolve_or(layer, None), torch.Tensor):
            raise DeclarationError(
                f"{where}: declared slot {path.text!r} on {type(layer).__name__} names derived_from {item!r}, which "
                "does not resolve to a tensor of the layer; name the tensor the slot is computed from (a path "
                "relative to the layer), or drop derived_from and let graphsafe record what PWAL reads"
            )
    declaration = Declaration(path=path, source=source, derived_from=derived_from, static=static)
    store.put(declaration)
    return declaration


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage() is b.untyped_storage()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class _DeclarationHandle(RemovableHandle):
    """Undeclares one path on one layer, holding the layer weakly (the handle does not keep it alive).

    Made on every ``register_derived`` call, so it is a plain object with two fields (no closures, no message
    formatted until asked).
    """

    __slots__ = ("_layer_ref", "_path")

    def __init__(self, layer: nn.Module, path: SlotPath) -> None:  # no super().__init__: nothing of it is used
        self._layer_ref = weakref.ref(layer)
        self._path = path

    @property
    def active(self) -> bool:
        owner = self._layer_ref()
        entry = layer_store(owner, create=False) if owner is not None else None
        return entry is not None and self._path.text in entry.slots

    def remove(self) -> None:
        owner = self._layer_ref()
        if owner is not None:
            undeclare(owner, self._path.text)

    @property
    def description(self) -> str:
        owner = self._layer_ref()
        name = type(owner).__name__ if owner is not None else "a collected layer"
        return f"register_derived({name}, {self._path.text!r})"


def _caller() -> str:
    frame = inspect.currentframe()
    try:
        outer = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if outer is None:
            return "register_derived"
        return f"register_derived at {outer.f_code.co_filename}:{outer.f_lineno}"
    finally:
        del frame


@functools.lru_cache(maxsize=65536)
def _slot_path(text: str) -> SlotPath:
    # SlotPath is immutable: one object per path text spares re-parsing and re-formatting on every reload.
    return SlotPath(text)


def register_derived(
    layer: nn.Module,
    path: str,
    tensor: torch.Tensor | None = None,
    *,
    derived_from: str | Sequence[str] | None = None,
    static: bool = False,
) -> RemovableHandle:
    """Declare the graph-visible tensor at ``path`` on ``layer`` imperatively.

    Use it inside PWAL or lazily (a scratch buffer allocated on the first forward). When ``tensor`` is given it
    must be exactly what the path resolves to. Re-declaring on every reload is idempotent. Returns a handle whose
    ``remove()`` undeclares the slot.
    """
    if not isinstance(layer, nn.Module):
        raise DeclarationError(f"register_derived needs an nn.Module layer, got {type(layer).__name__}")
    _require_bool(f"register_derived({type(layer).__name__}, {path!r})", "static", static)
    try:
        slot = _slot_path(path)
    except PathSyntaxError as exc:
        raise DeclarationError(f"register_derived on {type(layer).__name__}: {exc}") from exc
    source = _caller()
    _declare(layer, slot, tensor, _normalize_derived_from(derived_from), static, source, source)
    return _DeclarationHandle(layer, slot)


def declare(
    layer: nn.Module,
    path: str | SlotPath,
    *,
    source: str,
    derived_from: str | Sequence[str] | None = None,
    static: bool = False,
) -> Declaration:
    """Declare ``path`` on ``layer`` for a tool that declares on an author's behalf (a declarations pack).

    ``source`` says who declared it (it appears in reports and errors). The path must resolve to a tensor now,
    else :class:`~graphsafe.DeclarationError`. Re-declaring the same slot the same way is a no-op. Authors use
    :func:`graph_visible` or :func:`register_derived` instead.
    """
    if not isinstance(layer, nn.Module):
        raise DeclarationError(f"declare needs an nn.Module layer, got {type(layer).__name__}")
    _require_bool(f"declare({type(layer).__name__}, {path!r})", "static", static)
    try:
        slot = path if isinstance(path, SlotPath) else _slot_path(path)
    except PathSyntaxError as exc:
        raise DeclarationError(f"declare on {type(layer).__name__} ({source}): {exc}") from exc
    return _declare(layer, slot, None, _normalize_derived_from(derived_from), static, source, source)


def undeclare(layer: nn.Module, path: str | SlotPath) -> bool:
    """Remove the declaration of ``path`` on ``layer``; ``False`` when there was none. Stable storage handed out by
    :func:`stable_empty` stays with the layer."""
    text = path.text if isinstance(path, SlotPath) else SlotPath(path).text
    entry = layer_store(layer, create=False)
    return entry is not None and entry.drop(text)


def stable_empty(
    layer: nn.Module,
    name: str,
    shape: Sequence[int] | torch.Size,
    dtype: torch.dtype,
    device: torch.device | str,
    zero: bool = False,
) -> torch.Tensor:
    """A tensor whose storage is the same every time PWAL re-runs for ``(layer, name)``, already declared.

    The constructive twin of declaring: for workspaces and lazily allocated scratch, allocate through this and
    assign the result at path ``name`` (e.g. ``layer._permute_scratch = stable_empty(layer, "_permute_scratch",
    ...)``). ``zero=True`` zeroes it in place on every call. The slot is declared ``static`` (its contents are
    not derived from the weights). Asking again with another shape, dtype or device raises
    :class:`~graphsafe.DeclarationError` (that would need a new capture).
    """
    if not isinstance(layer, nn.Module):
        raise DeclarationError(f"stable_empty needs an nn.Module layer, got {type(layer).__name__}")
    slot = SlotPath(name)
    if not isinstance(dtype, torch.dtype):
        raise DeclarationError(
            f"stable_empty({type(layer).__name__}, {slot.text!r}): dtype must be a torch.dtype such as "
            f"torch.float32, got {dtype!r}"
        )
    wanted_shape = tuple(int(n) for n in shape)
    wanted_device = torch.device(device)
    store = layer_store(layer)
    assert store is not None
    tensor = store.stable.get(slot.text)
    if tensor is not None:
        same_device = tensor.device.type == wanted_device.type and (
            wanted_device.index is None or tensor.device.index == wanted_device.index
        )
        if tuple(tensor.shape) != wanted_shape or tensor.dtype != dtype or not same_device:
            raise DeclarationError(
                f"stable_empty({type(layer).__name__}, {slot.text!r}): first allocated as "
                f"{tensor.dtype}{list(tensor.shape)} on {tensor.device}, now asked for {dtype}{list(wanted_shape)} "
                f"on {wanted_device}; a captured graph cannot follow a new allocation: recapture instead"
            )
        if zero:
            tensor.zero_()
    else:
        tensor = (torch.zeros if zero else torch.empty)(wanted_shape, dtype=dtype, device=wanted_device)
        store.stable[slot.text] = tensor
    store.put(Declaration(path=slot, source=f"stable_empty({slot.text!r})", static=True))
    return tensor
