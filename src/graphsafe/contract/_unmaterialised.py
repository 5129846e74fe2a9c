"""Tensors that are not there yet at seal: an uninitialised lazy parameter or buffer (``nn.LazyLinear`` before its
first forward) or a tensor on the ``meta`` device (deferred initialisation). None has memory to fingerprint, so a
seal would track the rest of the model, and the tensor that later takes its place (bound by the lazy module's
first forward, by ``to_empty`` and a load) would be one no slot names: a loader could rebind it and the reload
commit. The seal refuses such a model instead; sealing after the first forward (or after the load that
materialises it) tracks the real tensors."""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy

from graphsafe.errors import GraphSafeError

__all__ = ["refuse_unmaterialised"]


def refuse_unmaterialised(model: nn.Module) -> None:
    """Raise :class:`~graphsafe.GraphSafeError` naming the first parameter or buffer of ``model`` that is lazy and
    uninitialised or on ``meta``. O(parameters + buffers)."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if is_lazy(tensor):
                what = "an uninitialised lazy " + kind
            elif tensor.device.type == "meta":
                what = f"a {kind} on the meta device"
            else:
                continue
            raise GraphSafeError(
                f"graphsafe seal of {type(model).__name__}: {name!r} is {what}, so no memory of it can be sealed and "
                "a tensor bound there later would go untracked; seal after the model is materialised (after its "
                "first forward, or the load that materialises it)"
            )
