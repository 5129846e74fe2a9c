"""Sealing a contract: the layers and slots it tracks (``GraphContract.seal``/``reseal``), the storages they share,
and the late declarations and unsealed modules found at a reload. Functions of a
:class:`~graphsafe.contract.GraphContract`, bound there as its methods."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.collectors import Classified, classify, classify_walk, module_names, walk
from graphsafe.contract._carved import mark_inside_loaded
from graphsafe.contract._copy import overlapping_pairs
from graphsafe.contract._late import LateModule, note_late
from graphsafe.contract._owned import owned_memory
from graphsafe.contract._slots import SealedLayer, SealedSlot
from graphsafe.contract._tensorref import TensorRef
from graphsafe.contract._unmaterialised import refuse_unmaterialised
from graphsafe.contract._unnamed import Unnamed
from graphsafe.errors import DeclarationError, GraphSafeError, NotServingSafeError, hide_frames_in_pytest
from graphsafe.outcome import Finding, FindingKind, Origin, SlotRef, fingerprint
from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_generation, declarations_of

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

if TYPE_CHECKING:
    from graphsafe.contract._contract import GraphContract

__all__: list[str] = []


def _sealed_slot(entry: Classified) -> SealedSlot:
    return SealedSlot(
        entry.path,
        entry.fingerprint,
        TensorRef.of(entry.tensor),
        entry.origin,
        entry.declaration,
        restorable=entry.restorable,
        reason=entry.reason,
        alias_of=entry.alias_of,
        # A tensor only the walker found is watched until a recording of the initial load says PWAL leaves it
        # alone: one that appeared after that recording (a warm-up's lazy cache) was seen by none.
        unrecorded=entry.origin is Origin.WALKER,
    )


def _storages_sharing_memory(storages: Mapping[int, Any]) -> list[tuple[int, int]]:
    """Pairs of ids of storage objects whose memory overlaps (a DLPack import of a captured tensor, a tensor carved
    out of an arena: a second storage object on the same bytes): storage identity cannot tell that they share it."""
    return overlapping_pairs(
        (str(storage.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes(), key)
        for key, storage in storages.items()
    )


_LOADED = (Origin.PARAMETER, Origin.BUFFER)


def _seal_alone(self: GraphContract, *, recaptured: bool) -> GraphContract:
    """``_seal`` under the transaction lock: a reload begun on another thread while a seal walks the model
    would snapshot the old seal and finish against the new one, taken mid-load. The thread that holds the lock
    while its reload acts (a listener, an ``on_recapture`` callback) seals as before."""
    if self._lock.acquire(blocking=False):
        self._lock_owner = threading.get_ident()
        try:
            return self._seal(recaptured=recaptured)
        finally:
            self._lock_owner = None
            self._lock.release()
    if self._lock_owner != threading.get_ident() or self._active is not None:
        raise GraphSafeError(
            f"graphsafe contract of {self._model_name()}: seal() while a reload transaction is open (begun, not "
            "finished, possibly on another thread); finish() it, then seal"
        )
    return self._seal(recaptured=recaptured)


def _seal(self: GraphContract, *, recaptured: bool) -> GraphContract:
    if self._active is not None:
        raise GraphSafeError("seal() inside a reload transaction")
    if self._recapture_after is not None and self._captures <= self._recapture_after and not recaptured:
        raise NotServingSafeError(
            f"graphsafe contract of {self._model_name()}: reseal() refused: {self._unsafe_reason}; the captured "
            "graphs still read the storage they were captured on, so sealing the model's current tensors would "
            "not make replay safe: recapture the graphs, then reseal() (graphsafe.adapters.torch and "
            "record_capture report their captures; after a capture of your own call contract.note_capture(), "
            "or reseal(recaptured=True))",
            self.last_outcome,
        )
    self._refuse_foreign_devices()
    refuse_unmaterialised(self.model)
    layers: list[SealedLayer] = []
    self._units = frozenset(id(module) for module in self.model.modules())
    self._also = {
        key: [tuple(name.split(".")) for name in names[1:]]
        for key, names in module_names(self.model).items()
        if len(names) > 1
    }
    try:
        for qualname, layer in self.model.named_modules():
            sealed = self._seal_layer(qualname, layer)
            if sealed is not None:
                layers.append(sealed)
    except BaseException:
        if self._recapture_after is not None:
            # What blocks the seal (a declared path gone) gets fixed in the model after the capture that was
            # the evidence, so that capture did not see the model that will be sealed: capture again.
            self._recapture_after = self._captures
        raise
    # What PWAL was seen reading belongs to the layers, not to one seal: a reseal keeps it (and that a recording
    # was blind to a slot, which must not make it a fixed table).
    # So does a slot a reload left stale: sealing its tensor does not make its values fresh (SealedSlot.owed).
    recorded = {
        (id(sealed.layer_ref()), slot.path.text): (sealed.layer_ref, slot.inputs, slot.unrecorded, slot.owed)
        for sealed in self._layers
        for slot in sealed.slots
        if slot.tracks_freshness
    }
    for sealed in layers:
        for slot in sealed.slots:
            entry = recorded.get((id(sealed.layer_ref()), slot.path.text)) if slot.tracks_freshness else None
            if entry is not None and entry[0]() is sealed.layer_ref():
                slot.inputs, slot.unrecorded, slot.owed = entry[1], entry[2], entry[3]
    self._layers = layers
    self._slot_keys = {(sealed.qualname, slot.path.text) for sealed in layers for slot in sealed.slots}
    self._manifest_slots = {}
    self._index_layers()
    pending, self._pending = self._pending, None
    if pending is not None:
        self._learn_initial_inputs(*pending)
    self._quarantine.clear()
    self._sealed = True
    self._recapture_after = None
    self._unsafe_reason = None if any(sealed.slots for sealed in layers) else self._tracks_nothing()
    if self.manifest is not None:
        self.manifest.reindex(self)
    return self


def _model_name(self: GraphContract) -> str:
    model = self._model_ref()
    return type(model).__name__ if model is not None else "a collected model"


def _refuse_foreign_devices(self: GraphContract) -> None:
    """A ``devices`` list that matches none of the model's loaded tensors (its parameters, buffers and declared
    slots; a rank and local-rank mix-up) would seal the declared slots only and let a loader rebind the weights
    the graphs read: refused, in one line."""
    devices = self.devices
    if devices is None:
        return
    model = self.model
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for declaration in declarations_of(module).values():
            value = declaration.path.resolve_or(module, None)
            if isinstance(value, torch.Tensor):
                tensors.append(value)
    held = sorted({str(t.device) for t in tensors if t.device.type != "meta"})
    if held and not any(t.device in devices for t in tensors):
        wanted = ", ".join(str(d) for d in devices.devices or ())
        raise GraphSafeError(
            f"graphsafe seal of {type(model).__name__}: devices=[{wanted}] matches none of its tensors (they are "
            f'on {", ".join(held)}); pass devices= naming the device the graphs read ("cuda" matches every '
            "cuda:N), or leave devices out"
        )


def _tracks_nothing(self: GraphContract) -> str:
    """Why an empty seal is not serving-safe, naming the setting that made it empty and what to do."""
    model = self.model
    tensors = (*model.parameters(), *model.buffers())
    held = sorted({str(t.device) for t in tensors if t.device.type != "meta"})
    # Meta tensors have no storage a graph could read: a model only on meta is not loaded yet.
    on_meta = not held and bool(tensors)
    where = (
        f"its parameters and buffers are on {', '.join(held)}"
        if held
        else "its parameters and buffers are on meta: it is not loaded yet"
        if on_meta
        else "it has no parameter or buffer"
    )
    devices = "every device" if self.devices is None else ", ".join(str(d) for d in self.devices.devices or ())
    advice = ["load its weights off meta"] if on_meta else []
    if self.devices is not None:
        advice.append('pass devices= naming the device the graphs read ("cuda" matches every cuda:N)')
    if self.detect == "declared-only":
        advice.append(
            'declare the graph-visible tensors (@graph_visible, register_derived) or use detect="sealed-paths"'
        )
    advice.append("then reseal()")
    return (
        f"the contract tracks nothing: the seal of {type(model).__name__} found no tensor on devices="
        f"[{devices}] with detect={self.detect!r} ({where}), so no captured address is kept; " + ", ".join(advice)
    )


def _index_layers(self: GraphContract) -> None:
    """Precompute what per-reload lookups need: entries by layer, and the captured storages several slots read
    (in one layer or across layers), which a restore checks as one (``RestorePlan.watch``)."""
    by_layer: dict[int, list[int]] = {}
    readers: dict[int, list[tuple[SealedLayer, int]]] = {}
    storages: dict[int, Any] = {}
    for position, sealed in enumerate(self._layers):
        by_layer.setdefault(id(sealed.layer_ref()), []).append(position)
        for index, slot in enumerate(sealed.slots):  # live storages have distinct ids
            for part in slot.fp.memory():  # a wrapper subclass reads its inner tensors' storages
                storage = part.storage_ref()
                if storage is not None:
                    readers.setdefault(id(storage), []).append((sealed, index))
                    storages[id(storage)] = storage
    shared = {key: entries for key, entries in readers.items() if len(entries) > 1}
    for entries in shared.values():
        if any(sealed is not entries[0][0] for sealed, _ in entries):
            for sealed, _ in entries:
                sealed.shared_across_layers = True
    self._by_layer = by_layer
    self._shared = shared
    mark_inside_loaded(self._layers)
    # Two storage objects on one memory, each read by a slot the contract restores from PWAL's tensors (not
    # loaded state: an arena buffer a tensor is carved from holds that tensor's values): a tie no restore can
    # check, since every check of shared memory goes by storage identity.
    derived = {
        key
        for key, entries in readers.items()
        if any(sealed.slots[index].origin not in _LOADED for sealed, index in entries)
    }
    sharing = _storages_sharing_memory(storages)
    self._owned = owned_memory(readers, storages, sharing)
    self._cross = {
        (id(sealed), index)
        for pair in sharing
        if derived.issuperset(pair)
        for key in pair
        for sealed, index in readers[key]
    }


def _seal_layer(self: GraphContract, qualname: str, layer: nn.Module) -> SealedLayer | None:
    generation = declarations_generation(layer)
    classified = classify(
        layer,
        walk_layer=self.detect != "declared-only",
        budget=self.budget,
        devices=self.devices,
        units=self._units,
    )
    for missing in classified.unresolved:
        raise DeclarationError(
            f"{SlotRef(qualname, '')} ({type(layer).__name__}): declared slot {missing.path!r} {missing.what} "
            f"at seal (declared by {missing.declaration.source}); assign it before seal() or remove the declaration"
        )
    for entry in classified.tensors:
        declaration = entry.declaration
        if declaration is None:
            continue
        for source in declaration.derived_from or ():
            if not isinstance(SlotPath(source).resolve_or(layer, None), torch.Tensor):
                raise DeclarationError(
                    f"{SlotRef(qualname, entry.path.text)} ({type(layer).__name__}): declared slot "
                    f"{entry.path.text!r} names derived_from {source!r}, which does not resolve to a tensor at "
                    f"seal (declared by {declaration.source}); name the tensor it is computed from, or drop "
                    "derived_from and let graphsafe record what PWAL reads"
                )
    slots = [_sealed_slot(entry) for entry in classified.tensors]
    exhausted = classified.exhausted
    if not slots and exhausted is None and not classified.notes and self.detect != "every-reload":
        # Nothing to track now; with every-reload the layer stays, so tensors it allocates later (scratch on a
        # first forward) are still walked at each reload.
        return None
    return SealedLayer(
        weakref.ref(layer), qualname, type(layer).__name__, slots, generation, exhausted, classified.notes
    )


# -- internals used by the transaction --------------------------------------------------------------------
def _layer_entries(self: GraphContract, layer: nn.Module) -> list[SealedLayer]:
    """The sealed entries of ``layer`` and the modules under it, in seal order."""
    positions: list[int] = []
    for module in layer.modules():
        for position in self._by_layer.get(id(module), ()):
            if self._layers[position].layer_ref() is module:
                positions.append(position)
    if len(positions) > 1:
        positions = sorted(set(positions))
    return [self._layers[p] for p in positions]


def _adopt_late_declarations(self: GraphContract, sealed: SealedLayer, layer: nn.Module) -> None:
    """Declarations made after the seal (``register_derived`` on a first forward) join the seal as declared."""
    generation = declarations_generation(layer)
    if generation == sealed.declared_generation:
        return
    by_path = {slot.path.text: index for index, slot in enumerate(sealed.slots)}
    for text, declaration in list(declarations_of(layer).items()):
        index = by_path.get(text)
        if index is not None and sealed.slots[index].origin is Origin.DECLARED:
            continue
        value = declaration.path.resolve_or(layer, None)
        if not isinstance(value, torch.Tensor):
            continue  # verified at the next seal, which raises DeclarationError for it
        slot = SealedSlot(declaration.path, fingerprint(value), TensorRef.of(value), Origin.DECLARED, declaration)
        if index is not None:
            # Known to the walker since the seal: keep the sealed fingerprint, now as a declared slot.
            old = sealed.slots[index]
            slot = SealedSlot(old.path, old.fp, old.tensor_ref, Origin.DECLARED, declaration)
            sealed.slots[index] = slot
        else:
            sealed.slots.append(slot)
    sealed.declared_generation = generation
    sealed.slots_changed()  # the walker must now skip the new paths; a new slot may share a storage
    self._index_layers()  # a new slot may read a storage other slots read


def _outer(self: GraphContract, qualname: str) -> list[tuple[str, nn.Module]]:
    """The modules above ``qualname``, nearest first (the model itself last)."""
    found: list[tuple[str, nn.Module]] = []
    name = qualname
    while name:
        name = name.rpartition(".")[0]
        try:
            found.append((name, self.model.get_submodule(name) if name else self.model))
        except AttributeError:
            break
    return found


def _walker_extras(
    self: GraphContract, sealed: SealedLayer, layer: nn.Module
) -> tuple[list[SealedSlot], str | None, tuple[str, ...], Unnamed]:
    """Tensors the walker finds now but the seal did not know, where it finds untrackable ones now, and the
    tensors behind those places (``every-reload``; in the other modes only the last, for a layer the seal's walk
    found untrackable places in)."""
    if self.detect != "every-reload":
        return [], None, (), self._unnamed_now(layer) if sealed.untrackable else ()
    known = sealed.known_paths
    # known paths are neither reported nor fingerprinted by the walk
    result = walk(layer, budget=self.budget, devices=self.devices, skip_paths=known, units=self._units)
    tracked = [(slot.path.text, slot.origin, part.storage_ref()) for slot in sealed.slots for part in slot.fp.memory()]
    extras = [_sealed_slot(entry) for entry in classify_walk(result, known, tracked)]
    return extras, result.exhausted, result.notes, result.unnamed


def _unnamed_now(self: GraphContract, layer: nn.Module) -> Unnamed:
    """The device tensors ``layer`` holds behind steps no path can name, as a walk finds them now
    (``contract._unnamed``)."""
    return walk(layer, budget=self.budget, devices=self.devices, units=self._units).unnamed


def _unsealed_modules(self: GraphContract, notes: list[LateModule] | None = None) -> list[Finding]:
    """Modules registered after the seal (a layer appended to a ``ModuleList``, an adapter) that hold tensors a
    seal would track: no seal entry knows them and the walk never enters a module, so a graph captured since may
    read them at addresses no reload keeps. Reported, not sealed now: the contract cannot tell what a graph
    captured of them (a seal must come before the capture)."""
    late = [(qualname, module) for qualname, module in self.model.named_modules() if id(module) not in self._units]
    if not late:
        return []
    units = self._units | {id(module) for _, module in late}
    replaced = {sealed.qualname for sealed in self._layers}  # their own findings say so (vanished)
    findings: list[Finding] = []
    for qualname, module in late:
        if qualname in replaced and notes is None:
            continue
        classified = classify(
            module, walk_layer=self.detect != "declared-only", budget=self.budget, devices=self.devices, units=units
        )
        if notes is not None:  # their freshness, from the state when the reload began (contract._late)
            note = note_late(qualname, module, classified)
            if note is not None:
                notes.append(note)
        if qualname in replaced:
            continue
        if classified.tensors or classified.unresolved or classified.notes or classified.exhausted:
            findings.append(
                Finding(
                    FindingKind.UNTRACKABLE,
                    layer=qualname,
                    layer_class=type(module).__name__,
                    path="",
                    declared=True,
                    detail="registered after the seal: none of its tensors is sealed, so no reload keeps the "
                    "addresses a graph captured since reads; recapture the graphs, then reseal()",
                )
            )
    return findings
