"""The graph of one walk: every reachable object read once (phase 1), the edges between them, and what was cut.

Phase 1 (:meth:`WalkGraph.read`) reads objects breadth first, each with the reader :data:`~._readers.READERS`
holds for its kind, and links their children: a new child becomes a node (unless the depth budget cuts it), a
known one only gains an edge. Tensors become nodes when the device set holds their device, and are read only for
attributes set on them. An exact tuple, list or dict that holds leaves only (a config dict, a metadata tuple) is
read when it is found: it counts as visited, once, but becomes no node, since nothing in it can lead to a tensor.
(Under a tight ``max_objects`` this reads such containers earlier than breadth-first order would; a cut is still
reported, with the path where it happened.)

The class attributes an instance may read are worked out once per class per walk (they can change between walks),
unlike the plans of :mod:`._plans`, which are kept across walks.

Edges live in flat parallel lists (a node's edges are the contiguous range ``estart[n]:eend[n]``) rather than in
a tuple per edge: per-edge container objects would feed the cyclic GC, which then costs as much as the walk.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final

import torch

from graphsafe.collectors.walker._edges import ATTR, STATE, Kid, nameable, render
from graphsafe.collectors.walker._plans import (
    DICT,
    DICT_ITEMS,
    LIST,
    MODULE,
    OBJECT,
    PLANS,
    STORAGE,
    STORAGE_DEVICE,
    TENSOR,
    TENSOR_DEVICE,
    TUPLE,
    TYPE_NAME,
    plan_of,
)
from graphsafe.collectors.walker._readers import (
    MODULE_INTERNALS,
    READERS,
    WALKED_HOOKS,
    add_kid,
    holds_only_leaves,
    read_attributes,
    read_class_attributes,
)
from graphsafe.devices import DeviceSet, WalkBudget

# Containers of leaves are read when found, not queued: ``index`` maps them to this (no node).
_READ_EMPTY: Final = -1
_LEAF_HOLDERS: Final = frozenset({TUPLE, LIST, DICT})


class WalkGraph:
    """One walk's nodes (node 0 is the layer), edges, notes and budget cuts."""

    def __init__(
        self, layer: object, budget: WalkBudget, devices: DeviceSet, units: Collection[int] | None = None
    ) -> None:
        self.max_depth = budget.max_depth
        self.max_objects = budget.max_objects
        self.devices = devices
        #: ids of the modules that are reload units of their own (never entered); ``None``: every module.
        self.units = units
        # Node columns. Holding the objects keeps their ids unique until the walk ends.
        self.objs: list[Any] = [layer]
        self.kinds: list[int] = [OBJECT if plan_of(type(layer)).kind != MODULE else MODULE]
        self.parent: list[int] = [-1]  # the node each node was first discovered from
        self.estart: list[int] = [-1]  # -1: not read (a tensor, or cut by a budget)
        self.eend: list[int] = [-1]
        # Edge columns: token kind, name/key/index (or, for unnamed edges, why), child node, write mode, reason.
        self.e_tk: list[int] = []
        self.e_key: list[Any] = []
        self.e_child: list[int] = []
        self.e_mode: list[int] = []
        self.e_reason: list[str | None] = []
        self.extra_in: dict[int, list[int]] = {}  # further parents of shared objects
        self.objects_visited = 0
        self.depth_cut: str | None = None  # the first place the depth budget cut a path
        self.depth_cuts = 0
        self.objects_cut: str | None = None
        self.paths_cut: str | None = None
        self.notes: dict[str, None] = {}  # an ordered set
        self.storages: list[tuple[str, Any]] = []  # the raw storages reached (each noted): (first path, storage)
        self.skipped: list[str] = []  # the caller's skip paths that phase 3 reached (each path once)
        self.unnamed: list[tuple[str, str, Any]] = []  # (where, what, tensor) behind each unnamed step reached

    # -- messages ----------------------------------------------------------------------------------------------

    def render(self, edges: list[int]) -> str:
        """The path of a list of edges, for messages."""
        return render((self.e_tk[e], self.e_key[e]) for e in edges)

    def path_of(self, node: int, extra: tuple[int, Any] | None = None) -> str:
        """The discovery path of ``node`` (for messages only: it searches the parents' edges)."""
        steps: list[tuple[int, Any]] = []
        while node > 0:
            pnode = self.parent[node]
            e = next(e for e in range(self.estart[pnode], self.eend[pnode]) if self.e_child[e] == node)
            steps.append((self.e_tk[e], self.e_key[e]))
            node = pnode
        steps.reverse()
        if extra is not None:
            steps.append(extra)
        return render(steps)

    def cut_depth(self) -> bool:
        """Count one more place the depth budget cut; True for the first, whose path the caller then records."""
        self.depth_cuts += 1
        return self.depth_cuts == 1

    def exhausted(self) -> str | None:
        """Every budget that cut the walk, and where; None when none did."""
        parts: list[str] = []
        if self.depth_cut is not None:
            more = self.depth_cuts - 1
            tail = f" and {more} more place(s)" if more else ""
            parts.append(f"max_depth={self.max_depth} reached at {self.depth_cut!r}{tail}; nothing deeper was read")
        if self.objects_cut:
            parts.append(self.objects_cut)
        if self.paths_cut:
            parts.append(self.paths_cut)
        return "; ".join(parts) if parts else None

    # -- phase 1 -----------------------------------------------------------------------------------------------

    def read(self) -> None:
        """Read every object reachable within the budgets once, recording the edges to its children."""
        objs, kinds, parent, estart, eend = self.objs, self.kinds, self.parent, self.estart, self.eend
        e_tk, e_key, e_child, e_mode, e_reason = self.e_tk, self.e_key, self.e_child, self.e_mode, self.e_reason
        index: dict[int, int] = {id(objs[0]): 0}
        extra_in = self.extra_in
        plans_get, readers_get = PLANS.get, READERS.get
        devices, units = self.devices, self.units
        wanted: dict[torch.device, bool] = {}  # the device set's answer per device, asked once per walk
        class_kids: dict[int, Any] = {}  # per plan: its class attributes, worked out once per walk
        max_depth, max_objects = self.max_depth, self.max_objects
        # The nodes to read, in discovery order (breadth first). A tensor is read only for attributes set on it (a
        # wrapper subclass's inner tensors, g_idx on a parameter); most have none, never enter the queue, and cost
        # no object of the budget.
        queue = [0]
        # The plain tensor class, tested by identity before any plan lookup: most tensors are plain.
        plain, tensor_device, storage_device = torch.Tensor, TENSOR_DEVICE, STORAGE_DEVICE  # read once per child
        tensor_plan = plan_of(plain)
        plain_dict = tensor_plan.dict_get if not tensor_plan.slots and tensor_plan.dict_get is not None else None
        no_class_kids: set[int] = set()  # plans whose classes give no class attribute (class_kids keeps them alive)
        head = 0
        visited = 0
        level, boundary = 0, 1  # queue entries before `boundary` are at depth <= `level`
        while head < len(queue):
            if head == boundary:
                level += 1
                boundary = len(queue)
            node = queue[head]
            head += 1
            if visited >= max_objects:
                queued = sum(1 for k in kinds[node:] if k != TENSOR)
                self.objects_cut = (
                    f"max_objects={max_objects} reached at {self.path_of(node)!r}; "
                    f"{queued} queued object(s) and whatever lies beyond them were not read"
                )
                break
            visited += 1
            obj = objs[node]
            plan = plans_get(id(type(obj))) or plan_of(type(obj))
            kids: list[Kid] = []
            root_module = node == 0 and plan.kind == MODULE
            if plan.attrs:
                read_attributes(obj, plan, kids, MODULE_INTERNALS if root_module else plan.internals)
            if (
                plan.class_dicts
                and id(plan) not in no_class_kids
                and not read_class_attributes(obj, plan, kids, class_kids)
            ):
                no_class_kids.add(id(plan))
            if root_module:
                self._module_extras(obj, plan, kids)
            if node:  # the layer itself contributes only its attributes (a path starts with a name)
                reader = readers_get(plan.kind)
                if reader is not None:
                    reader(obj, plan, kids)

            estart[node] = len(e_child)
            child_depth = level + 1
            for tk, key, child, ck, mode, reason in kids:
                if ck in (TENSOR, STORAGE):
                    if mode != STATE:
                        try:
                            # A raw storage (a storage pool) is a terminal like a tensor, on its device; it cannot
                            # be fingerprinted, so the enumeration notes it (untrackable).
                            device = tensor_device(child) if ck == TENSOR else storage_device(child)
                        except Exception as exc:  # an exotic tensor subclass: say so rather than fail the walk
                            where = self.path_of(node, (tk, key))
                            self.notes[f"{where}: cannot read the device of a {TYPE_NAME(type(child))} ({exc})"] = None
                            continue
                        ok = wanted.get(device)
                        if ok is None:
                            ok = wanted[device] = device in devices
                        if not ok:
                            continue
                    ck = TENSOR
                elif ck == MODULE and (units is None or id(child) in units):
                    continue  # a reload unit of its own (a registered module): its own seal entry walks it
                cid = id(child)
                idx = index.get(cid)
                if idx is None:
                    if child_depth > max_depth:
                        if self.cut_depth():
                            self.depth_cut = self.path_of(node, (tk, key))
                        continue
                    if ck == TENSOR:  # queued only with attributes of its own (most tensors have none)
                        idx = index[cid] = len(objs)
                        if type(child) is plain and plain_dict is not None:
                            if plain_dict(child):
                                queue.append(idx)
                        else:
                            tplan = plans_get(id(type(child))) or plan_of(type(child))
                            # A jagged nested tensor (torch.jagged) is a wrapper whose attributes are its own
                            # machinery (values, offsets, a metadata cache of symbolic sizes): not entered, it is
                            # noted as a tensor no slot can fingerprint (untrackable).
                            if (tplan.slots or (tplan.dict_get is not None and tplan.dict_get(child))) and not (
                                child.is_nested
                            ):
                                queue.append(idx)
                    elif ck in _LEAF_HOLDERS and visited < max_objects and holds_only_leaves(child):
                        # A tuple, list or dict of leaves (a config, a metadata tuple): read now, once (it counts
                        # as visited), and no node: no child of it could lead to a tensor.
                        index[cid] = _READ_EMPTY
                        visited += 1
                        continue
                    else:
                        idx = index[cid] = len(objs)
                        queue.append(idx)
                    objs.append(child)
                    kinds.append(ck)
                elif idx == _READ_EMPTY:
                    continue  # read already (a container of leaves): nothing to link
                elif idx in extra_in:
                    extra_in[idx].append(node)
                else:
                    extra_in[idx] = [node]
                e_tk.append(tk)
                e_key.append(key)
                e_child.append(idx)
                e_mode.append(mode)
                e_reason.append(reason)
            eend[node] = len(e_child)
            added = len(objs) - len(parent)
            if added:  # the node columns of the children found just now, in one step
                parent += [node] * added
                estart += [-1] * added
                eend += [-1] * added
        self.objects_visited = visited

    def _module_extras(self, layer: Any, plan: Any, kids: list[Kid]) -> None:
        """What the layer's torch state adds: its forward hooks (when it has any), and its own parameters and
        buffers that carry attributes (``weight.g_idx = t``), as STATE edges."""
        state = plan.dict_get(layer) if plan.dict_get is not None else None
        if type(state) is not dict:
            return
        for name in WALKED_HOOKS:
            hooks = state.get(name)
            if hooks:  # an OrderedDict (a dict subclass: C truth test); most layers have none
                add_kid(kids, ATTR, name, hooks, plan.attr_mode, plan.attr_reason)
        for table in ("_parameters", "_buffers"):
            entries = state.get(table)
            if type(entries) is not dict:
                continue
            for name, tensor in DICT_ITEMS(entries):
                if type(name) is not str or not nameable(name):
                    continue
                tplan = plan_of(type(tensor))
                if tplan.kind != TENSOR or ((tplan.dict_get is None or not tplan.dict_get(tensor)) and not tplan.slots):
                    continue
                kids.append((ATTR, name, tensor, TENSOR, STATE, None))
