"""What a walk returns: one :class:`TensorRef` per path to a device tensor, gathered in a :class:`WalkResult`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphsafe.outcome import Fingerprint


# Not frozen: construction is per tensor on the walk's hot path, and a frozen dataclass pays an
# object.__setattr__ per field. Treat instances as immutable.
@dataclass(slots=True, eq=False)
class TensorRef:
    """One device tensor and one path to it (a tensor reachable by several paths gets one ref per path).

    ``eq=False``: comparing two refs field by field would compare tensors elementwise.
    """

    path: str
    tensor: torch.Tensor
    fingerprint: Fingerprint
    restorable: bool
    reason: str | None


@dataclass(frozen=True, slots=True)
class WalkResult:
    """What :func:`~graphsafe.collectors.walker.walk` found, how much it read, and whether a budget cut it short."""

    refs: tuple[TensorRef, ...]
    objects_visited: int
    exhausted: str | None
    notes: tuple[str, ...] = ()
    #: The ``skip_paths`` the walk reached at a tensor, in walk order (no ref made, no fingerprint taken for them).
    skipped: tuple[str, ...] = ()
    #: The raw storages (``UntypedStorage``: a storage pool) the walk reached, each with its first path (each is
    #: also a note: no slot path can name a tensor in it); a holder search matches their memory.
    storages: tuple[tuple[str, Any], ...] = ()
    #: ``(where, what, tensor)`` for each device tensor reached only through a step no path can name: the path to
    #: the object that holds it, what that step is ("a member of a set", "the value (or default) of a ContextVar
    #: ..."), and the tensor (a reload's freshness check of those places compares them: ``contract._unnamed``). A
    #: tensor behind several such steps is listed once per step.
    unnamed: tuple[tuple[str, str, torch.Tensor], ...] = ()
