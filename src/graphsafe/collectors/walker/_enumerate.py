"""Phases 2 and 3 of a walk: which objects lead to a tensor, and one ref per simple path from the layer to each.

Phase 2 (:func:`useful`) marks, from every tensor upwards, the nodes some tensor can be reached from; phase 3
(:func:`enumerate_paths`) follows every simple path (one that passes through no node twice) through marked nodes,
depth first, and makes a :class:`~._results.TensorRef` wherever one ends at a tensor. A ref is restorable when
assign can write its last step in place, possibly after rebuilding immutable containers into their parents, and
resolving the path runs no user code.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final

import torch

from graphsafe.collectors.walker._edges import (
    ATTR,
    INPLACE,
    NO_WRITE,
    STATE,
    STEP_TEXTS,
    UNNAMED,
    UNRESOLVED,
    first_step_text,
    step_text,
)
from graphsafe.collectors.walker._graph import WalkGraph
from graphsafe.collectors.walker._plans import TENSOR, TYPE_NAME
from graphsafe.collectors.walker._results import TensorRef
from graphsafe.outcome import Fingerprint, fingerprint

_UNSEEN: Final[Any] = object()


def useful(graph: WalkGraph) -> bytearray:
    """1 for every node from which some tensor node can be reached (tensors included)."""
    marks = bytearray(len(graph.objs))
    parent, extra_in = graph.parent, graph.extra_in
    stack = [i for i, kind in enumerate(graph.kinds) if kind == TENSOR]
    while stack:
        node = stack.pop()
        # Climb the discovery tree until a marked node; shared nodes queue their other parents.
        while not marks[node]:
            marks[node] = 1
            if node == 0:
                break
            more = extra_in.get(node)
            if more:
                stack.extend(more)
            node = parent[node]
    return marks


def enumerate_paths(graph: WalkGraph, skip: Collection[str] = ()) -> list[TensorRef]:
    """One ref per simple path to a tensor, but those whose text is in ``skip``; records notes and cuts."""
    marks = useful(graph)
    refs: list[TensorRef] = []
    if not marks[0] or graph.estart[0] < 0:
        return refs
    kinds, objs, estart, eend = graph.kinds, graph.objs, graph.estart, graph.eend
    e_tk, e_key, e_child, e_mode = graph.e_tk, graph.e_key, graph.e_child, graph.e_mode
    max_depth, budget = graph.max_depth, graph.max_objects
    step_texts, skipped = STEP_TEXTS, graph.skipped
    prints: dict[int, Fingerprint | None] = {}  # per tensor node: one fingerprint however many paths
    pos, ends = [estart[0]], [eend[0]]  # per level of the current path: next edge, end of the node's edges
    trail: list[int] = []  # the edges of the current path
    texts = [""]  # texts[k]: the path text of the first k edges of the trail
    clean = [True]  # clean[k]: no edge among the first k makes resolution run user code
    on_trail = {0}
    steps = 0
    while pos:
        e = pos[-1]
        if e >= ends[-1]:
            pos.pop()
            ends.pop()
            if trail:
                on_trail.discard(e_child[trail.pop()])
                texts.pop()
                clean.pop()
            continue
        pos[-1] = e + 1
        child = e_child[e]
        if not marks[child] or child in on_trail:
            continue
        tk, key, mode = e_tk[e], e_key[e], e_mode[e]
        if tk == UNNAMED:  # not a path step: no slot path goes through it
            where = texts[-1] or "<layer>"
            graph.notes[f"{where}: {key} leads to device tensors that no slot path can name"] = None
            graph.unnamed.extend((where, key, tensor) for tensor in _tensors_under(graph, marks, child))
            continue
        steps += 1
        if steps > budget:
            where = graph.render([*trail, e])
            graph.paths_cut = f"max_objects={budget} reached while enumerating alias paths at {where!r}"
            break
        if len(trail) >= max_depth:
            if graph.cut_depth():
                graph.depth_cut = graph.render([*trail, e])
            continue
        if trail:
            kt = type(key)  # only str and int keys are cached: True == 1 and (True,) == (1,) would share a text
            cached = step_texts[tk].get(key) if kt is str or kt is int else None
            text = texts[-1] + (cached or step_text(tk, key))
        else:
            text = first_step_text(tk, key)
        if kinds[child] == TENSOR:
            if (
                trail
                and tk == ATTR
                and kinds[e_child[trail[-1]]] == TENSOR  # the rare case (an attribute of a tensor) tested inline
                and _inner_of_a_slot(objs, prints, e_child[trail[-1]], key)
            ):
                continue  # a fingerprinted wrapper's inner tensor: the wrapper's slot restores and verifies it
            # A tensor with attributes (a wrapper's inner tensors, g_idx set on a parameter) is also a step on.
            inner = estart[child] >= 0 and any(marks[e_child[x]] for x in range(estart[child], eend[child]))
            # STATE: the layer's own parameter or buffer, the seal's slot; skipped: the caller knows the path.
            if mode == STATE:
                pass
            elif skip and text in skip:
                skipped.append(text)
            else:
                tensor = objs[child]
                print_ = prints.get(child, _UNSEEN)
                if print_ is _UNSEEN:
                    try:
                        if tensor.is_nested:  # only a registered nested buffer is a slot (classify's)
                            raise TypeError("a nested tensor held outside the layer's buffers")
                        print_ = fingerprint(tensor)
                    except Exception as exc:  # sparse, or a wrapper subclass without storage
                        print_ = None
                        _unprintable(graph, tensor, text, exc, inner)
                    prints[child] = print_
                if print_ is None:
                    pass
                elif mode == INPLACE and clean[-1]:  # the common case: written in place, plainly resolved
                    refs.append(TensorRef(text, tensor, print_, True, None))
                else:
                    restorable, reason = _restorability(graph, [*trail, e], texts)
                    refs.append(TensorRef(text, tensor, print_, restorable, reason))
            if not inner:
                continue
        elif estart[child] < 0:  # not read: cut by a budget
            continue
        trail.append(e)
        texts.append(text)
        clean.append(clean[-1] and mode != UNRESOLVED)
        on_trail.add(child)
        pos.append(estart[child])
        ends.append(eend[child])
    return refs


def _tensors_under(graph: WalkGraph, marks: bytearray, node: int) -> list[torch.Tensor]:
    """The tensors reachable from ``node`` through marked nodes, each once (the graph is already read: no object is
    read again)."""
    kinds, objs, estart, eend, e_child = graph.kinds, graph.objs, graph.estart, graph.eend, graph.e_child
    found: list[torch.Tensor] = []
    seen = {node}
    stack = [node]
    while stack:
        current = stack.pop()
        if kinds[current] == TENSOR and isinstance(objs[current], torch.Tensor):
            found.append(objs[current])
        if estart[current] < 0:
            continue
        for e in range(estart[current], eend[current]):
            child = e_child[e]
            if marks[child] and child not in seen:
                seen.add(child)
                stack.append(child)
    return found


def _inner_of_a_slot(objs: list[Any], prints: dict[int, Fingerprint | None], parent: int, name: object) -> bool:
    """Whether attribute ``name`` of tensor node ``parent`` is an inner tensor (``__tensor_flatten__``) of a wrapper
    subclass that is a slot (one the walker could fingerprint): then it is the wrapper's memory, no slot of its
    own."""
    # Not fingerprinted here at all: the layer's own parameter or buffer, or a path the caller seals itself.
    if parent in prints and prints[parent] is None:
        return False
    flatten = getattr(type(objs[parent]), "__tensor_flatten__", None)
    if flatten is None:
        return False
    try:
        names = flatten(objs[parent])[0]
    except Exception:  # a flatten protocol that does not run: its attributes stay slots of their own
        return False
    return name in names


def _restorability(graph: WalkGraph, edges: list[int], texts: list[str]) -> tuple[bool, str | None]:
    """Whether assign can write a tensor at the end of ``edges`` (``texts[i]``: the path before edge i)."""
    modes, reasons = graph.e_mode, graph.e_reason
    for i, e in enumerate(edges):
        if modes[e] == UNRESOLVED:  # resolving the path runs user code: no guarantee it finds this tensor
            return False, f"{reasons[e]} at {texts[i] or '<layer>'!r}"
    # assign writes the last step; immutable containers are rebuilt into their parents, upwards.
    for i in range(len(edges) - 1, -1, -1):
        mode = modes[edges[i]]
        if mode in (INPLACE, STATE):
            return True, None
        if mode == NO_WRITE:
            return False, f"{reasons[edges[i]]} at {texts[i] or '<layer>'!r}"
    return True, None  # unreachable: the layer's own attributes are written in place


def _unprintable(graph: WalkGraph, tensor: torch.Tensor, path: str, exc: Exception, inner: bool) -> None:
    """A tensor that cannot be fingerprinted (no ref is made for it): a note, unless it holds tensors of its own
    (``inner``: a wrapper subclass, whose inner tensors are the slots)."""
    if not isinstance(tensor, torch.Tensor):  # a raw storage (see WalkGraph.read)
        graph.notes[f"{path}: a raw {TYPE_NAME(type(tensor))}, in which no slot path can name a tensor"] = None
        graph.storages.append((path, tensor))
    elif not inner:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        graph.notes[f"{path}: cannot fingerprint a {TYPE_NAME(type(tensor))} ({first})"] = None
