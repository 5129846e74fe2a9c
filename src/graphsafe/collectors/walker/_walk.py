"""The entry points: :func:`walk` a layer (read, then enumerate paths) and :func:`collect` its refs."""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

import torch
from torch import nn

from graphsafe.collectors.walker._enumerate import enumerate_paths
from graphsafe.collectors.walker._graph import WalkGraph
from graphsafe.collectors.walker._plans import DICT_VALUES, TENSOR, TENSOR_DEVICE, kind_of, plan_of
from graphsafe.collectors.walker._results import TensorRef, WalkResult
from graphsafe.devices import DeviceSet, WalkBudget

__all__ = ["collect", "walk"]


_META: Final = torch.device("meta")
# DeviceSet per set of devices found: layers hold tensors on one or two devices, so a walk of every module of a
# model meets a handful of sets; a DeviceSet is never changed once made, so it can be shared.
_DEVICE_SETS: Final[dict[frozenset[torch.device], DeviceSet]] = {}


def _layer_devices(layer: object) -> set[torch.device]:
    """Devices of the parameters and buffers of ``layer`` and its submodules, read without running module code."""
    found: set[torch.device] = set()
    seen: set[int] = set()
    stack = [layer]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        plan = plan_of(type(module))
        state = plan.dict_get(module) if plan.dict_get is not None else {}
        for key in ("_parameters", "_buffers"):
            table = state.get(key)
            if type(table) is dict:
                for tensor in DICT_VALUES(table):
                    if kind_of(tensor) == TENSOR:
                        found.add(TENSOR_DEVICE(tensor))
        children = state.get("_modules")
        if type(children) is dict:
            stack.extend(child for child in DICT_VALUES(children) if child is not None)
    found.discard(_META)
    return found


def _device_set(
    layer: object, devices: DeviceSet | Collection[torch.device | str] | torch.device | str | None
) -> DeviceSet:
    if isinstance(devices, DeviceSet):
        return devices
    if devices is None:  # the layer's own devices; every device when it holds no tensor
        found = frozenset(_layer_devices(layer))
        device_set = _DEVICE_SETS.get(found)
        if device_set is None:
            if len(_DEVICE_SETS) >= 64:
                _DEVICE_SETS.clear()
            device_set = _DEVICE_SETS[found] = DeviceSet(found or None)
        return device_set
    return DeviceSet(devices)


def walk(
    layer: nn.Module,
    *,
    budget: WalkBudget | None = None,
    devices: DeviceSet | Collection[torch.device | str] | torch.device | str | None = None,
    skip_paths: Collection[str] = (),
    units: Collection[int] | None = None,
) -> WalkResult:
    """Find every device tensor reachable from ``layer``'s own non-parameter, non-buffer attributes.

    What is walked, the alias policy and the budgets: see :mod:`graphsafe.collectors.walker`.
    Each ref's ``path`` resolves on ``layer`` to exactly its tensor (``SlotPath(path).resolve(layer)``);
    ``restorable`` says whether ``SlotPath(path).assign(layer, t)`` can put a tensor back there.

    Args:
        layer: the reload unit. Its parameters and buffers are not walked (only attributes set on them), nor are
            modules that are reload units of their own.
        budget: how far to go (:class:`~graphsafe.devices.WalkBudget`; default ``WalkBudget()``).
        devices: report only tensors on these devices (the device rule of :mod:`graphsafe.devices`). ``None``: the
            devices of the layer's (and its submodules') parameters and buffers, or every device if it has none.
            Meta tensors are never reported.
        skip_paths: paths the caller already tracks (a set, for speed): no ref is made for them and their
            tensors are not fingerprinted unless another path reaches them; ``skipped`` lists those reached. The
            walk itself is unchanged.
        units: ids of the modules that are reload units of their own (the model's registered modules: each is
            walked by its own seal entry). A module not among them, reached through a plain list or attribute of
            an object, is walked like any object (its ``_parameters``, ``_buffers``, attributes). ``None``: every
            module is a unit (nothing tells which are registered).

    Returns:
        The refs (one per simple path to a tensor), how many objects were read, and ``exhausted``: ``None``, or a
        sentence naming the budget that was hit and where (the refs are then incomplete).
    """
    with torch._C.DisableTorchFunctionSubclass():
        graph = WalkGraph(layer, budget if budget is not None else WalkBudget(), _device_set(layer, devices), units)
        graph.read()
        refs = enumerate_paths(graph, skip_paths)
    return WalkResult(
        refs=tuple(refs),
        objects_visited=graph.objects_visited,
        exhausted=graph.exhausted(),
        notes=tuple(graph.notes),
        skipped=tuple(graph.skipped),
        storages=tuple(graph.storages),
        unnamed=tuple(graph.unnamed),
    )


def collect(
    layer: nn.Module,
    *,
    budget: WalkBudget | None = None,
    devices: DeviceSet | Collection[torch.device | str] | torch.device | str | None = None,
    units: Collection[int] | None = None,
) -> list[TensorRef]:
    """The refs of :func:`walk` as a list (check ``walk(...).exhausted`` when completeness matters)."""
    return list(walk(layer, budget=budget, devices=devices, units=units).refs)
