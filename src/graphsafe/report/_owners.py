"""Who writes a layer's tensors: the object whose ``process_weights_after_loading`` (PWAL) runs for it, and the
class whose body defines that PWAL (where a decorator goes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from torch import nn

from graphsafe.paths import SlotPath

__all__ = ["PWAL", "Owner", "owner_of", "unknown_owner", "via"]

PWAL: Final = "process_weights_after_loading"


@dataclass(frozen=True, slots=True)
class Owner:
    """The owner of a layer's derived tensors."""

    #: Qualified class name of the object whose PWAL runs for the layer (a bare layer class name when unknown).
    name: str
    #: Qualified name of the PWAL to decorate, ``None`` when there is none or the layer is unknown.
    pwal: str | None
    #: ``False`` when the layer object was not available (an outcome without its model).
    known: bool = True
    #: How the owner's code names the layer: ``"layer"`` in a quant method's ``(self, layer)``, ``"self"`` when the
    #: owner is the layer itself (a fix's line pasted into its own methods has no ``layer``).
    receiver: str = "layer"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _pwal_of(cls: type) -> str | None:
    """The PWAL along ``cls``'s MRO, named on the class whose body defines it (where a decorator goes)."""
    for klass in cls.__mro__:
        if PWAL in vars(klass):
            return f"{_qualified(klass)}.{PWAL}"
    return None


def unknown_owner(layer_class: str) -> Owner:
    """The owner of a layer known only by its class name: the class itself, no PWAL to name."""
    return Owner(layer_class, None, known=False)


def owner_of(layer: nn.Module) -> Owner:
    """The layer's ``quant_method`` when it has one that defines PWAL, else the layer itself."""
    quant_method = layer.__dict__.get("quant_method")  # a plain attribute; never run a module's __getattr__
    if quant_method is not None and not isinstance(quant_method, nn.Module):
        pwal = _pwal_of(type(quant_method))
        if pwal is not None:
            return Owner(_qualified(type(quant_method)), pwal)
    return Owner(_qualified(type(layer)), _pwal_of(type(layer)), receiver="self")


def via(layer: nn.Module, path: str) -> tuple[str, ...]:
    """Class names of the objects between the layer and the tensor (empty when the path does not resolve)."""
    try:
        chain = SlotPath(path).chain(layer)
    except Exception:  # gone (it vanished) or a user property raised: the tree then shows names only
        return ()
    return tuple(type(obj).__name__ for obj in chain[1:-1])
