"""The inputs a declared slot is computed from, and whether they changed during a reload: the values taken
before the load (:class:`ValuesBefore`, the per-input ``_InputBefore``) and a layer's inputs resolved once per
snapshot (:class:`_Inputs`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe.contract._samples import (
    INPUT_ELEMENTS,
    SLOT_ELEMENTS,
    Digest,
    Sample,
    SampleBatch,
    digests,
    same_digests,
    unchanged,
    version_of,
)
from graphsafe.contract._slots import _MISSING, InputRef, SealedSlot, _getter, _path, _view
from graphsafe.contract._tensorref import TensorRef
from graphsafe.registry import declarations_of

__all__ = ["ValuesBefore"]

# How an input changed: not at all; written with maybe the same values (its version counter moved, or another
# storage now holds the same values); or for sure (other values, gone).
_UNCHANGED, _MAYBE, _CHANGED = 0, 1, 2


def _strided(value: Any) -> bool:
    """Whether ``value`` is a tensor with strided storage whose values can be sampled (not sparse, mkldnn, meta, or
    nested: torch's nested tensors report a strided layout but have no sizes or strides to read)."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout is torch.strided
        and value.device.type != "meta"
        and not value.is_nested
    )


def written_unseen(entries: Sequence[tuple[torch.Tensor | None, int, Sample | None, Any]]) -> list[bool]:
    """For each ``(tensor at a slot's path before a recorded load or None, its version counter then, its value
    sample then, the value there now)`` that the recording saw neither made nor written: whether it was made or
    written all the same (another tensor, a moved version counter, another value sample).

    Then the recording was blind to it (PWAL on another thread, a write past torch's dispatcher: ``.numpy()``, a
    raw kernel launch) and says nothing about whether PWAL computes it: it must not make the slot a fixed table.
    """
    result = [True] * len(entries)
    asked: list[tuple[int, Sample, torch.Tensor]] = []
    for position, (before, version, sample, now) in enumerate(entries):
        if before is None or sample is None or not _strided(now) or not _strided(before):
            continue  # made (or given a tensor without storage) where the recording did not see it
        if now is not before and (
            now.untyped_storage() is not before.untyped_storage()
            or now.data_ptr() != before.data_ptr()
            or _view(now) != _view(before)
        ):
            continue
        if version_of(now) != version:
            continue
        asked.append((position, sample, now))
    if asked:
        same = unchanged([(sample, now) for _, sample, now in asked], SLOT_ELEMENTS)
        for (position, _, _), kept in zip(asked, same, strict=True):
            result[position] = not kept
    return result


@dataclass(slots=True)
class ValuesBefore:
    """The tensors found before a recorded initial load (``record_inputs()``), each by identity with its version
    counter and value sample: what :func:`written_unseen` checks a slot the recording did not see computed
    against, since the seal (and so the slot) comes only after that load."""

    taken: dict[int, tuple[TensorRef, int, Sample]]

    @classmethod
    def take(cls, tensors: Iterable[torch.Tensor]) -> ValuesBefore:
        batch = SampleBatch()
        taken: dict[int, tuple[TensorRef, int, Sample]] = {}
        for tensor in tensors:
            if _strided(tensor) and id(tensor) not in taken:
                taken[id(tensor)] = (TensorRef.of(tensor), version_of(tensor), batch.take(tensor, SLOT_ELEMENTS))
        batch.flush()
        return cls(taken)

    def written_unseen(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """:func:`written_unseen` for each tensor now at a slot's path (one that was not there before: made)."""
        entries: list[tuple[torch.Tensor | None, int, Sample | None, Any]] = []
        for tensor in tensors:
            entry = self.taken.get(id(tensor))
            if entry is None or not entry[0].holds(tensor):
                entries.append((None, -1, None, tensor))
            else:
                entries.append((tensor, entry[1], entry[2], tensor))
        return written_unseen(entries)


# An input before PWAL: (storage, version, value sample, digest of every byte or None), or None where the path held
# no tensor.
_InputBefore = tuple["weakref.ReferenceType[Any]", int, Sample, Digest] | None


def _input_before(value: Any, samples: SampleBatch) -> _InputBefore:
    # A tensor without strided storage to sample (sparse, mkldnn, nested, meta) is taken as no tensor before: where
    # it is one now, it counts as changed (fail closed: a slot left in place beside it is judged stale).
    if not _strided(value):
        return None
    sample, whole = samples.take(value, INPUT_ELEMENTS), samples.digest(value)
    return weakref.ref(value.untyped_storage()), version_of(value), sample, whole


def _reads_storage(before: _InputBefore, storage: Any) -> bool:
    return before is not None and storage is not None and before[0]() is storage


def _input_change(before: _InputBefore, value: Any) -> int:
    return _input_changes([(before, value)])[0]


def _input_changes(asked: Sequence[tuple[_InputBefore, Any]]) -> list[int]:
    """How each input ``(before, now)`` changed; the value samples, then the digests, of all compared in a batch."""
    changes: list[int] = []
    sampled: list[tuple[int, tuple[Any, int, Sample, Digest], torch.Tensor]] = []
    for position, (before, value) in enumerate(asked):
        change = _input_change_unsampled(before, value)
        changes.append(_CHANGED if change is None else change)
        if change is None:
            assert before is not None
            sampled.append((position, before, value))
    same = unchanged([(before[2], value) for _, before, value in sampled], INPUT_ELEMENTS)
    kept = [entry for entry, sampled_same in zip(sampled, same, strict=True) if sampled_same]
    for (position, _, _), change in zip(kept, _changes_of_same_samples([(b, v) for _, b, v in kept]), strict=True):
        changes[position] = change
    return changes


def _input_change_unsampled(before: _InputBefore, value: Any) -> int | None:
    """How an input changed where that is plain without comparing values; ``None`` where the values decide."""
    if before is None:
        return _UNCHANGED if not isinstance(value, torch.Tensor) else _CHANGED
    if not isinstance(value, torch.Tensor):
        return _CHANGED
    return None


def _changes_of_same_samples(asked: Sequence[tuple[Any, torch.Tensor]]) -> list[int]:
    """How inputs whose value sample is as it was changed: for sure where the digest of every byte differs (a change
    the sample skipped), else not at all or maybe (written again: the version counter or the storage)."""
    changes: list[int] = []
    compared: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, digest before, tensor now)
    for position, (before, value) in enumerate(asked):
        storage, version, _, old = before
        changes.append(_UNCHANGED if storage() is value.untyped_storage() and version_of(value) == version else _MAYBE)
        old_digest = old.get()
        if old_digest is not None:
            compared.append((position, old_digest, value))
    now = digests([value for _, _, value in compared])
    # no digest now (a layout without one): the sample alone decides
    pairs = [(position, (old, new)) for (position, old, _), new in zip(compared, now, strict=True) if new is not None]
    for (position, _), same in zip(pairs, same_digests([pair for _, pair in pairs]), strict=True):
        if not same:
            changes[position] = _CHANGED
    return changes


_Input = tuple[str, Callable[[], Any], _InputBefore]


# A declared slot before PWAL: (tensor at the path, its version, its value sample, the keys of its inputs).
_Freshness = tuple[torch.Tensor, int, Sample, tuple[Any, ...]]


def _attribute(module: nn.Module, name: str) -> Callable[[], Any]:
    module_ref = weakref.ref(module)

    def resolve() -> Any:
        owner = module_ref()
        return _MISSING if owner is None else getattr(owner, name, _MISSING)

    return resolve


def _input(module: nn.Module, name: str, prefix: str = "") -> tuple[Any, str, Callable[[], Any]]:
    """``(key, name, resolve)`` of the tensor at ``module.name``: one key however it is reached, so that an input two
    watches share is sampled once."""
    return (id(module), name), f"{prefix}.{name}" if prefix else name, _attribute(module, name)


def state_inputs(module: nn.Module, prefix: str = "") -> list[tuple[Any, str, Callable[[], Any]]]:
    """:func:`_input` of each of ``module``'s own parameters and buffers (not its children's)."""
    return [
        _input(module, name, prefix)
        for table in (module._parameters, module._buffers)
        for name, v in table.items()
        if v is not None
    ]


def _layer_inputs(layer: nn.Module) -> list[tuple[Any, str, Callable[[], Any]]]:
    """The fallback inputs of ``layer``: ``(key, name, resolve)`` for every parameter, buffer and plain tensor
    attribute of the layer and the modules under it, except each module's own declared slots."""
    found: list[tuple[Any, str, Callable[[], Any]]] = []
    for prefix, module in layer.named_modules():
        declared = declarations_of(module)
        found += state_inputs(module, prefix)
        plain = [n for n, v in vars(module).items() if isinstance(v, torch.Tensor) and n not in declared]
        found.extend(_input(module, name, prefix) for name in plain)
    return found


@dataclass(slots=True)
class _Inputs:
    """The inputs a layer's snapshot watches, each resolved and sampled once however many slots read it."""

    layer: nn.Module
    qualname: str
    samples: SampleBatch
    inputs: dict[Any, _Input] = field(default_factory=dict)
    fallback: tuple[Any, ...] | None = None  # the keys of _layer_inputs, computed on first need
    loaded: set[Any] = field(default_factory=set)  # the keys of those that are parameters or buffers
    live: dict[Any, bool] = field(default_factory=dict)  # recorded input key -> whether it resolves to a tensor
    #: The modules above the layer, nearest first, ``(qualified name, module)``: where a layer with no weights of
    #: its own (a child holding a cache) takes its fallback inputs from.
    outer: Callable[[], list[tuple[str, nn.Module]]] | None = None

    def _add(self, key: Any, name: str, resolve: Callable[[], Any]) -> Any:
        if key not in self.inputs:
            self.inputs[key] = (name, resolve, _input_before(resolve(), self.samples))
        return key

    def _outer_fallback(self) -> tuple[Any, ...]:
        """The fallback inputs of the nearest module above the layer that holds loaded state (parameters or
        buffers): a layer without weights of its own would otherwise never be stale."""
        for name, module in self.outer() if self.outer is not None else ():
            entries = _layer_inputs(module)
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                return tuple(
                    self._add(key, f"{name}:{label}" if name else label, resolve) for key, label, resolve in entries
                )
        return ()

    def _resolves(self, ref: InputRef) -> bool:
        """Whether a recorded input resolves to a tensor now (asked once per input and snapshot: slots share them)."""
        live = self.live.get(ref.key)
        if live is None:
            live = self.live[ref.key] = isinstance(ref.resolve(), torch.Tensor)
        return live

    def _recorded_keys(self, recorded: tuple[InputRef, ...]) -> tuple[Any, ...]:
        """The keys of recorded inputs, each resolved and sampled once per layer and reload (named only then)."""
        inputs = self.inputs
        keys: list[Any] = []
        for ref in recorded:
            key = ref.key
            if key not in inputs:
                self._add(key, ref.label(self.qualname), ref.resolve)
            if key not in keys:
                keys.append(key)
        return tuple(keys)

    def layer_keys(self, own: Any = None) -> tuple[Any, ...]:
        """The keys of the layer's fallback inputs: every parameter, buffer and plain tensor attribute of the layer
        and the modules under it, but plain tensors on storage ``own`` (the watched tensor's own memory); with the
        nearest module above's where the layer holds no loaded state."""
        if self.fallback is None:
            self.fallback = tuple(self._add(*entry) for entry in _layer_inputs(self.layer))
            self.loaded = {(id(m), n) for _, m in self.layer.named_modules() for n in (*m._parameters, *m._buffers)}
        # An undeclared plain attribute is in the fallback, and so is any other plain path to its memory (an alias):
        # none of them is its own input. Loaded state is, even where it is a view of it (weight.t()).
        others = tuple(
            key for key in self.fallback if key in self.loaded or not _reads_storage(self.inputs[key][2], own)
        )
        if any(key in self.loaded for key in others):
            return others
        # No loaded state in the layer (a child holding derived tensors): its tensors are computed from the weights
        # of a module above it; its plain tensors stay inputs too.
        return tuple(dict.fromkeys((*others, *self._outer_fallback())))

    def of(self, slot: SealedSlot) -> tuple[Any, ...]:
        """The keys of ``slot``'s inputs (see the section comment for which).

        A recorded input or a ``derived_from`` name that no longer resolves to a tensor (a module replaced, a
        tensor deleted) makes the slot fall back to the whole layer: an input that cannot be watched must not
        make the slot look fresh.
        """
        layer = self.layer
        sources = slot.declaration.derived_from if slot.declaration is not None else None
        recorded = slot.inputs
        if recorded is not None and not all(map(self._resolves, recorded)):
            recorded = None
        if recorded is not None and not sources:
            return self._recorded_keys(recorded)  # the common case after a recording
        paths = [_path(source) for source in sources or ()]
        if (recorded is None and sources is None) or not all(
            isinstance(_getter(path)(layer), torch.Tensor) for path in paths
        ):
            current = slot.get(layer)
            return self.layer_keys(current.untyped_storage() if isinstance(current, torch.Tensor) else None)
        keys = list(self._recorded_keys(recorded)) if recorded is not None else []
        for path in paths:
            keys.append(self._add((id(layer), path.text), path.text, functools.partial(_getter(path), layer)))
        return tuple(dict.fromkeys(keys))
