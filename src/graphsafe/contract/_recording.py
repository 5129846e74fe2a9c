"""The inputs of declared slots, recorded at the first reload (``GraphContract.record_inputs``) and learnt by the
sealed slots. Functions of a :class:`~graphsafe.contract.GraphContract`, bound there as its methods."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.collectors import Dataflow, walk
from graphsafe.contract._inputs import ValuesBefore
from graphsafe.contract._slots import InputRef, SealedLayer, SealedSlot
from graphsafe.errors import GraphSafeError, hide_frames_in_pytest
from graphsafe.outcome import Origin, SlotRef
from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_of

#: pytest shows the test's line and graphsafe's message, not this module's frames (``errors.hide_frames_in_pytest``).
__tracebackhide__ = hide_frames_in_pytest

if TYPE_CHECKING:
    from graphsafe.contract._contract import GraphContract

__all__ = ["InputIndex"]


# -- what PWAL reads -----------------------------------------------------------------------------------------
@contextmanager
def record_inputs(self: GraphContract) -> Iterator[None]:
    """Record what the initial load and PWAL compute each derived slot from: ``with contract.record_inputs():
    load(); pwal()``, then :meth:`seal`.

    Optional: without it the first reload transaction records the same (once; later reloads do not pay for
    the recording). Recording the initial load means even that first reload checks each slot against what its
    PWAL really reads rather than against the whole layer.
    """
    if self._sealed:
        raise GraphSafeError(
            "record_inputs() records the initial load before seal(); this contract is sealed, and its first "
            "reload records what PWAL reads by itself"
        )
    # What the walk finds now, before the load: a slot the recording does not see computed but whose values
    # changed was computed where it could not see (another thread, a raw kernel), not left as a fixed table.
    before = ValuesBefore.take(walked_tensors(self))
    Dataflow.prepare()  # torch's one-time dispatch set-up, before the caller's load starts
    dataflow = Dataflow()
    Dataflow.drop_abandoned()
    dataflow.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
    try:
        yield
    finally:
        whole = dataflow.stop()  # (not ``with``: its exit pops whatever mode is on top, another's recording)
    if whole:
        self._pending = (dataflow, before)


def walked_tensors(self: GraphContract) -> Iterator[torch.Tensor]:
    """Every device tensor the walker reaches from each of the model's modules (its own attributes, each module a
    unit of its own), as the model holds them now."""
    units = frozenset(id(module) for module in self.model.modules())
    for module in self.model.modules():
        for ref in walk(module, budget=self.budget, devices=self.devices, units=units).refs:
            yield ref.tensor


def recorded_inputs(self: GraphContract) -> dict[SlotRef, tuple[SlotRef, ...]]:
    """For every declared slot a recording saw PWAL compute: the tensors (as the model holds them) it was
    computed from. Slots missing here are checked against their ``derived_from``, else the whole layer."""
    return {
        SlotRef(sealed.qualname, slot.path.text): tuple(ref.ref for ref in slot.inputs)
        for sealed in self._layers
        for slot in sealed.slots
        if slot.inputs is not None
    }


class InputIndex:
    """Every tensor the model holds, by storage, as the first path found (parameters and buffers, then plain
    tensor attributes, then the seal's deeper paths), for the walks back from each slot PWAL recomputed; and by
    module id, the storages of its weights (anything but its declared slots) the recording saw written.

    Built once per recorded reload: each ``after_layer()`` step reads its own layers again (:meth:`refresh`: what
    their load and PWAL bound), not the whole model (a walk of every module per layer made a layerwise reload
    quadratic in its layers). A storage the walk asks about that is not found where the index saw it (bound since
    by a module no step read again, or moved to another path) has the whole model read again, once per step."""

    def __init__(self, contract: GraphContract, dataflow: Dataflow) -> None:
        self._contract = contract
        self._dataflow = dataflow
        # id(storage) -> (the storage, where the model holds it: module, qualified name, path), weakly: the index
        # lives as long as the reload, and a reference of its own would pass for a holder of captured memory. The
        # InputRef is made when a walk finds it (a few of the thousands of tensors a model holds are some slot's
        # inputs).
        self._index: dict[int, tuple[weakref.ref[Any], weakref.ref[nn.Module], str, SlotPath]] = {}
        self._found: dict[int, InputRef] = {}
        self._paths: dict[str, SlotPath | None] = {}  # parsed once per attribute name
        self._updated: dict[int, set[int]] = {}
        self._read_model()

    def refresh(self, layers: list[tuple[str, nn.Module]]) -> None:
        """Read again the modules under ``layers`` (qualified name, module) and their sealed slots' paths."""
        modules = [entry for qualname, layer in layers for entry in layer.named_modules(prefix=qualname)]
        for _, module in modules:
            self._updated.pop(id(module), None)
        ids = {id(layer) for _, layer in layers}
        self._read(modules, [sealed for sealed in self._contract._layers if id(sealed.layer_ref()) in ids])
        self._read_whole = False

    def held(self, storage: Any) -> InputRef | None:
        """Where the model holds ``storage`` (the first path found, still holding it), or ``None``."""
        ref = self._lookup(storage)
        if ref is None and not self._read_whole:
            # Not where the index saw it: bound since by a module no step read again (made before the reload, on
            # another thread, or moved from another path), or not the model's at all. Read the whole model again,
            # once per step.
            self._read_model()
            ref = self._lookup(storage)
        return ref

    def _read_model(self) -> None:
        """Read the whole model afresh: every module and every sealed slot's path."""
        self._index.clear()
        self._found.clear()
        self._updated.clear()
        self._read(list(self._contract.model.named_modules()), self._contract._layers)
        self._read_whole = True  # the whole model read since the last refresh

    def _lookup(self, storage: Any) -> InputRef | None:
        entry = self._index.get(id(storage))
        if entry is None or entry[0]() is not storage:
            return None
        ref = self._found.get(id(storage))
        if ref is None:  # one InputRef per storage: walks tell inputs apart by identity
            _, module, qualname, path = entry
            ref = self._found[id(storage)] = InputRef(module, path, SlotRef(qualname, path.text))
        held = ref.resolve()  # the path may hold another tensor since (the old one moved elsewhere)
        if not (isinstance(held, torch.Tensor) and held.layout is torch.strided):
            return None
        return ref if held.untyped_storage() is storage else None

    def written(self, layer: nn.Module) -> set[int]:
        """The storages of the weights of ``layer`` and the modules under it that the recording saw written."""
        return {storage for module in layer.modules() for storage in self._updated.get(id(module), ())}

    def _read(self, modules: list[tuple[str, nn.Module]], layers: list[SealedLayer]) -> None:
        add = self._add
        for qualname, module in modules:
            for name, value in (*module._parameters.items(), *module._buffers.items()):
                add(module, qualname, name, value, True)
        for qualname, module in modules:
            declared = declarations_of(module)
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):  # (most attributes are not: no call for those)
                    add(module, qualname, name, value, name not in declared)
        for sealed in layers:
            layer = sealed.layer_ref()
            if layer is not None:
                for slot in sealed.slots:
                    add(layer, sealed.qualname, slot.path.text, slot.get(layer), False)

    def _add(self, module: nn.Module, qualname: str, text: str, value: Any, weight: bool) -> None:
        if not isinstance(value, torch.Tensor) or value.layout is not torch.strided or value.device.type == "meta":
            return
        storage = value.untyped_storage()
        if weight and self._dataflow.updated(value):
            self._updated.setdefault(id(module), set()).add(id(storage))
        entry = self._index.get(id(storage))
        if entry is not None and entry[0]() is storage:
            return
        paths = self._paths
        if text in paths:
            path = paths[text]
        else:
            try:
                path = paths[text] = SlotPath(text)
            except GraphSafeError:  # an attribute name outside the path grammar cannot be watched by path
                path = paths[text] = None
        if path is not None:
            self._index[id(storage)] = (weakref.ref(storage), weakref.ref(module), qualname, path)
            self._found.pop(id(storage), None)


def _learn_initial_inputs(self: GraphContract, dataflow: Dataflow, before: ValuesBefore) -> None:
    """Keep what the recorded initial load computed each declared slot from (see :meth:`record_inputs`)."""
    held = InputIndex(self, dataflow).held
    unseen: list[tuple[SealedSlot, torch.Tensor]] = []  # walker slots the recording did not see computed
    for sealed in self._layers:
        layer = sealed.layer_ref()
        for slot in sealed.slots:
            current = slot.get(layer) if slot.tracks_freshness and layer is not None else None
            if isinstance(current, torch.Tensor) and dataflow.updated(current):
                slot.inputs = tuple(dataflow.reads(current, held))
            elif isinstance(current, torch.Tensor) and slot.origin is Origin.WALKER:
                unseen.append((slot, current))
    if unseen:
        for (slot, _), blind in zip(unseen, before.written_unseen([t for _, t in unseen]), strict=True):
            slot.unrecorded = blind  # a blind recording keeps it watched (the fallback inputs)
    self._recorded = True
