"""Two settings every collector and the contract share: which devices count, and how far a walk may go.

**The device rule.** A device named without an index (``"cuda"``) stands for every index of its type
(``cuda:0``, ``cuda:1``, ...); a device with an index matches only itself. ``"cpu"`` matches CPU tensors (whose
device has no index). Meta tensors hold no memory and never match. :class:`DeviceSet` is the only implementation
of that rule.

**The walk budget.** :class:`WalkBudget` bounds a walk of one layer: the longest path in steps, and the number of
distinct objects read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["DeviceSet", "WalkBudget", "device_matches"]

DeviceLike = torch.device | str


def device_matches(device: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on ``device`` is on ``wanted`` (``wanted`` without an index matches every index)."""
    return device == wanted or (wanted.index is None and device.type == wanted.type)


class DeviceSet:
    """A set of devices under the device rule; ``DeviceSet(None)`` holds every device but ``meta``."""

    __slots__ = ("any_index", "devices", "exact")

    def __init__(self, devices: Iterable[DeviceLike] | DeviceLike | None) -> None:
        if isinstance(devices, (str, torch.device)):  # one device, not a collection of characters
            devices = (devices,)
        self.devices: tuple[torch.device, ...] | None = (
            None if devices is None else tuple(torch.device(d) for d in devices)
        )
        self.exact: frozenset[torch.device] = frozenset(
            d for d in self.devices or () if d.index is not None or d.type == "cpu"
        )
        self.any_index: frozenset[str] = frozenset(d.type for d in self.devices or () if d.index is None)

    @property
    def everything(self) -> bool:
        """Whether no device list was given (every device but ``meta`` matches)."""
        return self.devices is None

    def __contains__(self, device: object) -> bool:
        if not isinstance(device, torch.device) or device.type == "meta":
            return False
        if self.devices is None:
            return True
        return device in self.exact or device.type in self.any_index

    def __repr__(self) -> str:
        if self.devices is None:
            return "DeviceSet(every device)"
        return f"DeviceSet({', '.join(str(d) for d in self.devices)})"


@dataclass(frozen=True, slots=True)
class WalkBudget:
    """How far the walker may go from one layer.

    ``max_depth`` is the longest path, in steps (``a.b[0]`` is three), that is reported or read through;
    ``max_objects`` is how many distinct objects may be read (the same number bounds the enumeration of alias
    paths). A walk that hits either says so (``exhausted``), and the contract turns that into a finding.
    """

    max_depth: int = 8
    max_objects: int = 100_000

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_objects"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"WalkBudget: {name} must be an int >= 0, got {value!r}")
