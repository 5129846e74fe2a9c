"""The one classification of a layer's tensors: declared, parameter, buffer, alias of one of those, or found by
the walker alone.

The seal, the migration report, the manifest's index and the toolkit all ask :func:`classify`, so a tensor gets one
answer wherever it is looked at. The rules, in order:

1. **declared**: a path in the layer's declarations (``graph_visible``, ``register_derived``, ``stable_empty``). A
   declared path that does not hold a tensor is listed in :attr:`LayerTensors.unresolved` (the seal raises on it).
   What torch's own forward pre-hooks recompute before every forward (``weight_norm``'s and ``spectral_norm``'s
   ``weight``: the graph writes it before it reads it) is declared static on torch's behalf
   (:func:`hook_declarations`), unless the author declared the path.
2. **parameter** / **buffer**: a registered parameter or buffer of the layer itself (not ``None``, not lazy,
   strided, not on ``meta``, on ``devices`` when given) that is not also declared under its name.
3. **alias**: a path the walker found whose storage is the storage of a declared, parameter or buffer slot of
   the same layer: it is restored with that slot (``alias_of`` names it), never "undeclared". A transposed view of
   a weight (``self.w_t = self.weight.data.t()``) is an alias of ``weight``.
4. **walker**: any other path the walker found: undeclared.

Static is a property of a declaration (:attr:`Classified.static`), not a class of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from graphsafe.collectors.walker import WalkResult, walk
from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.outcome import Fingerprint, Origin, fingerprint, memory_tensors, storage_ids
from graphsafe.paths import Attr, SlotPath, format_path
from graphsafe.registry import Declaration, declarations_of

__all__ = [
    "UNTRACKABLE_ADVICE",
    "Classified",
    "LayerTensors",
    "TrackedStorage",
    "Unresolved",
    "classify",
    "classify_walk",
]

#: What an author does about a place the walker found device tensors at but no slot path can name, resolve or
#: restore (each of :attr:`LayerTensors.notes`): the contract's ``untrackable`` finding and the report say it.
UNTRACKABLE_ADVICE = (
    "nothing can check that the graph still reads their memory, so no reload of this layer commits: hold them "
    "where a slot path reaches them (an attribute, a list, a dict under a str, int or tuple key) and declare "
    "that path, or write them in place in PWAL and keep no other reference"
)


@dataclass(slots=True, eq=False)
class Classified:
    """One path to one tensor of a layer, and why it is tracked (compared by identity, never by value)."""

    path: SlotPath
    tensor: torch.Tensor
    fingerprint: Fingerprint
    origin: Origin
    declaration: Declaration | None = None
    #: For an alias: the path of the declared, parameter or buffer slot whose storage it shares.
    alias_of: str | None = None
    #: Whether a copy into the captured tensor can be put back at the path (walker finds only; see the walker).
    restorable: bool = True
    reason: str | None = None
    #: Whether the walker reached this path too (a declared attribute is usually also walked).
    walked: bool = False

    @property
    def static(self) -> bool:
        """Whether the author declared the contents independent of the weights (``static=True``)."""
        return self.declaration is not None and self.declaration.static


@dataclass(frozen=True, slots=True)
class Unresolved:
    """A declared path that does not hold a tensor on the layer (``what`` says what it holds instead)."""

    path: str
    declaration: Declaration
    what: str


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """Every tracked tensor of one layer, classified, and what the walk could not see."""

    tensors: tuple[Classified, ...]
    unresolved: tuple[Unresolved, ...] = ()
    #: Whether the walker ran (``False`` under ``walk=False``: undeclared tensors were not looked for).
    walked: bool = False
    #: The walker's sentence when a budget cut it short, else ``None``.
    exhausted: str | None = None
    #: Where the walker saw device tensors no slot path can name (or fingerprint): each is untrackable (the
    #: contract's ``untrackable`` finding, see :data:`UNTRACKABLE_ADVICE`).
    notes: tuple[str, ...] = ()

    def of(self, *origins: Origin) -> tuple[Classified, ...]:
        """The entries of the given origins, in classification order."""
        return tuple(entry for entry in self.tensors if entry.origin in origins)

    @property
    def undeclared(self) -> tuple[Classified, ...]:
        """What an author should declare: the walker's finds that are neither declared nor aliases."""
        return self.of(Origin.WALKER)


def _state_entries(
    layer: nn.Module, declared: Collection[str], devices: DeviceSet | None, notes: list[str]
) -> list[Classified]:
    """The layer's own parameters and buffers not already declared under their name. One without storage
    (sparse, nested, a wrapper subclass without the flatten protocol) cannot be fingerprinted or restored: it goes
    to ``notes`` (untrackable), as a walker find does."""
    entries: list[Classified] = []
    for origin, table in ((Origin.PARAMETER, layer._parameters), (Origin.BUFFER, layer._buffers)):
        for name, tensor in table.items():
            # A ParameterList's "0" or a ParameterDict's "b c" is a path as the grammar writes it: 0, 'b c'.
            path = SlotPath(format_path((Attr(name),)))
            if (
                path.text in declared
                or not isinstance(tensor, torch.Tensor)
                or is_lazy(tensor)  # an uninitialised lazy parameter: no storage yet
                or tensor.device.type == "meta"
                or (devices is not None and tensor.device not in devices)
            ):
                continue
            if tensor.layout is not torch.strided:  # no storage to fingerprint (sparse, a jagged nested tensor)
                what = "nested" if tensor.is_nested else tensor.layout
                notes.append(f"{path.text}: cannot fingerprint a {what} {origin.value} (it has no storage)")
                continue
            try:
                print_ = fingerprint(tensor)
            except (TypeError, RuntimeError) as exc:  # no storage and no flatten protocol to reach its memory
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                notes.append(f"{path.text}: cannot fingerprint a {type(tensor).__name__} {origin.value} ({first})")
                continue
            entries.append(Classified(path, tensor, print_, origin))
    return entries


#: ``(path, origin, untyped storage)`` of a tracked slot, one per storage it reads (a wrapper subclass reads
#: several): what :func:`classify_walk` needs to find aliases.
TrackedStorage = tuple[str, Origin, Any]


def _alias_targets(tracked: Iterable[TrackedStorage]) -> dict[int, str]:
    """Rule 3's targets: storage id -> the path of the first declared, parameter or buffer slot on it."""
    targets: dict[int, str] = {}
    for path, origin, storage in tracked:
        if storage is not None and (origin is Origin.DECLARED or origin.is_state):
            targets.setdefault(id(storage), path)
    return targets


def classify_walk(result: WalkResult, known: Collection[str], tracked: Iterable[TrackedStorage]) -> list[Classified]:
    """The walker's finds not in ``known``: an alias (rule 3) where the storage is a ``tracked`` declared,
    parameter or buffer slot's, else a walker slot (rule 4)."""
    storages = _alias_targets(tracked)
    entries: list[Classified] = []
    for ref in result.refs:
        if ref.path in known:
            continue
        alias_of = next((storages[s] for s in storage_ids(ref.tensor) if s in storages), None)
        entries.append(
            Classified(
                SlotPath(ref.path),
                ref.tensor,
                ref.fingerprint,
                Origin.ALIAS if alias_of is not None else Origin.WALKER,
                alias_of=alias_of,
                restorable=ref.restorable,
                reason=ref.reason,
                walked=True,
            )
        )
    return entries


#: torch's forward pre-hooks that bind a tensor attribute (``hook.name``) recomputed from the layer's parameters
#: before every forward: the hook's class, and who declares the attribute in findings.
_RECOMPUTING_HOOKS: tuple[tuple[type, str], ...] = (
    (WeightNorm, "torch.nn.utils.weight_norm (recomputed by its forward pre-hook)"),
    (SpectralNorm, "torch.nn.utils.spectral_norm (recomputed by its forward pre-hook)"),
)


def hook_declarations(layer: nn.Module) -> dict[str, Declaration]:
    """The attributes torch's own forward pre-hooks recompute before every forward, declared static: a captured
    graph recomputes them (it writes them before it reads them) and so does every eager forward, so neither a new
    tensor there (an eager forward in the reload) nor old values (no forward yet) is wrong; a copy into the
    captured tensor restores the address."""
    hooks = layer._forward_pre_hooks
    if not hooks:
        return {}
    found: dict[str, Declaration] = {}
    for hook in hooks.values():
        for kind, source in _RECOMPUTING_HOOKS:
            name = getattr(hook, "name", None)
            if isinstance(hook, kind) and isinstance(name, str) and name.isidentifier():
                path = SlotPath(name)
                found[path.text] = Declaration(path=path, source=source, static=True)
    return found


def classify(
    layer: nn.Module,
    *,
    walk_layer: bool = True,
    budget: WalkBudget | None = None,
    devices: DeviceSet | None = None,
    units: Collection[int] | None = None,
) -> LayerTensors:
    """Classify every tensor ``layer`` holds (see the module docs for the rules).

    ``walk_layer=False`` classifies declared slots, parameters and buffers only. ``devices`` (the contract's
    device set) limits parameters, buffers and walker finds; declared slots are tracked wherever they are.
    ``units``: ids of the model's registered modules (see :func:`~graphsafe.collectors.walk`); modules held
    elsewhere (a plain list) are walked into.
    """
    declarations = dict(declarations_of(layer))
    if layer._forward_pre_hooks:
        declarations = {**hook_declarations(layer), **declarations}
    entries: list[Classified] = []
    unresolved: list[Unresolved] = []
    for text, declaration in declarations.items():
        value = declaration.path.resolve_or(layer, None)
        if not isinstance(value, torch.Tensor):
            why = declaration.path.why_missing(layer) if value is None else ""
            what = (
                f"does not resolve ({why})"
                if why
                else "does not resolve"
                if value is None
                else f"holds {type(value).__name__}, not a tensor"
            )
            unresolved.append(Unresolved(text, declaration, what))
            continue
        try:
            print_ = fingerprint(value)
        except Exception as exc:  # sparse, or a wrapper subclass without storage: the seal refuses it
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            what = f"holds a {value.layout} {type(value).__name__} that cannot be fingerprinted ({first})"
            unresolved.append(Unresolved(text, declaration, what))
            continue
        entries.append(Classified(declaration.path, value, print_, Origin.DECLARED, declaration))
    notes: list[str] = []
    entries.extend(_state_entries(layer, declarations.keys(), devices, notes))
    if not walk_layer:
        return LayerTensors(tuple(entries), tuple(unresolved), notes=tuple(notes))
    # Declared paths are skipped: classified above, they need no walker fingerprint; `skipped` says which it reached.
    result = walk(layer, budget=budget, devices=devices, skip_paths=declarations.keys(), units=units)
    by_path = {entry.path.text: entry for entry in entries}
    for path in result.skipped:
        entry = by_path.get(path)
        if entry is not None:  # None: a declared path that did not resolve to a tensor (see `unresolved`)
            entry.walked = True
    tracked = [
        (entry.path.text, entry.origin, part.untyped_storage())
        for entry in entries
        for part in memory_tensors(entry.tensor)
    ]
    entries.extend(classify_walk(result, declarations.keys(), tracked))
    return LayerTensors(tuple(entries), tuple(unresolved), True, result.exhausted, (*notes, *result.notes))
