"""Captured parameters and buffers rebound away from their modules during a reload, and what they were when they left.

A loader writes a parameter in place, and PWAL may then give the module a new one (``layer.weight =
nn.Parameter(...)``): the old, captured parameter has the loader's write on it, which is the reload's own. A PWAL
that hands the old parameter to a table outside the model (a spare for the next step, a ping-pong pair) and writes
it there leaves the same evidence, except in time: that write comes after the parameter left. torch calls its global
parameter and buffer registration hooks just before a module takes a new one, with the old one still in place, so
the moment each captured tensor left is known: its version counter then, and a digest of every byte (a write
through ``.data``, ``set_``, a NumPy view or a DLPack import moves no counter; a view among others of one buffer
shares its counter with its siblings; an inference tensor has none). The restore asks
:meth:`Departures.written_since_left` before it copies into such a tensor held outside every walked path.

Only registrations through ``nn.Module.__setattr__``/``register_parameter``/``register_buffer`` are seen; a tensor
that left another way (``del`` or ``= None`` first, for which torch calls no hook; a write into
``module._parameters``) has no record (:meth:`Departures.left_unseen`), and the restore does not copy into it where
something outside the model holds it. Cost: two process-wide hooks installed at import (an empty loop per
registration while no reload is open); per registration during a reload, a dict lookup; per captured tensor that
leaves, a version read and its witness: a copy of up to 64 KiB, else a position-weighted digest (a few launches
on a GPU; on a host several times a plain read of its bytes, the widening to 64 bits, measured by
``benchmarks/departures.py`` beside the repack a PWAL does: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from graphsafe.contract._samples import every_byte, same_digests, version_of
from graphsafe.contract._tensorref import TensorRef

__all__ = ["Departures"]


#: The open reloads' departure records, by weak reference (a transaction never finished must not stay alive here).
#: Replaced whole, never changed in place, so a hook running in one thread never sees it change under it.
_OPEN: tuple[weakref.ReferenceType[Departures], ...] = ()
_OPEN_LOCK = threading.Lock()


def _note_open(table: dict[str, Any], name: str, value: Any) -> None:
    for ref in _OPEN:
        departures = ref()
        if departures is not None:
            departures._note(table, name, value)


def _on_parameter(module: nn.Module, name: str, value: Any) -> None:
    _note_open(module._parameters, name, value)


def _on_buffer(module: nn.Module, name: str, value: Any) -> None:
    _note_open(module._buffers, name, value)


# Installed once, at import, and never removed: torch iterates its hook table on every registration, so adding or
# removing a hook per reload raises "OrderedDict mutated during iteration" in a thread registering a parameter
# meanwhile (two ranks as threads, each reloading). While no reload is open a hook is one empty loop.
torch_module.register_module_parameter_registration_hook(_on_parameter)
torch_module.register_module_buffer_registration_hook(_on_buffer)


class Departures:
    """While entered, notes each tensor of ``captured()`` (the captured tensor objects, by ``id()``, asked once, at
    the first registration seen) that a module registration replaces, as it was then (the latest such moment, for
    one that left, came back and left again). Its witnesses are taken inside ``quiet()`` (the reload's recording of
    PWAL must not take them for PWAL's reads)."""

    __slots__ = ("__weakref__", "_captured", "_ids", "_quiet", "_written_away", "left")

    def __init__(
        self, captured: Callable[[], dict[int, TensorRef]], quiet: Callable[[], AbstractContextManager[Any]]
    ) -> None:
        self._captured = captured
        self._quiet = quiet
        self._ids: dict[int, TensorRef] | None = None
        #: id(captured tensor) -> (version counter when it left, -1 for none or one its siblings share; its bytes
        #: then as :func:`_witness` gives them, ``None`` for a layout no witness reads).
        self.left: dict[int, tuple[int, torch.Tensor | None]] = {}
        #: id() of each captured tensor written while away (after it left, before a registration brought it back):
        #: its next departure's record must not erase that evidence.
        self._written_away: set[int] = set()

    def __enter__(self) -> Departures:
        global _OPEN
        with _OPEN_LOCK:
            _OPEN = (*_OPEN, weakref.ref(self))
        return self

    def __exit__(self, *exc: object) -> None:
        global _OPEN
        with _OPEN_LOCK:
            _OPEN = tuple(ref for ref in _OPEN if ref() is not None and ref() is not self)

    def _note(self, table: dict[str, Any], name: str, value: Any) -> None:
        # Runs inside torch's own setattr: it must never make the user's assignment fail.
        try:
            old = table.get(name)
            if old is value:
                return
            if isinstance(value, torch.Tensor) and id(value) in self.left:
                with self._quiet():
                    if self.written_since_left(value):  # coming back written: a holder's values, whatever comes next
                        self._written_away.add(id(value))
            if not isinstance(old, torch.Tensor):
                return
            ids = self._ids
            if ids is None:
                ids = self._ids = self._captured()
            leaving = ids.get(id(old))
            if leaving is not None and leaving.holds(old):
                # Views of one buffer share a version counter: a write to a sibling's bytes moves it too, so such a
                # view's counter says nothing. A write through ``.data``, ``set_`` or a NumPy view moves no counter
                # at all: every departure is witnessed by its bytes too.
                version = -1 if _shares_its_storage(old) else version_of(old)
                with self._quiet():
                    witness = _witness(old)
                self.left[id(old)] = (version, witness)
        except Exception:  # no record: left unseen, so not copied into where something outside holds it
            self.left.pop(id(table.get(name)), None)

    def written_since_left(self, tensor: torch.Tensor) -> bool | None:
        """Whether ``tensor`` was written after a registration replaced it (its counter moved, its bytes as
        :func:`_witness` reads them changed, or it came back written once); ``None`` where it was not seen leaving.
        Where no witness could be taken (a layout it does not read), ``True``: nothing tells."""
        record = self.left.get(id(tensor))
        if record is None:
            return None
        if id(tensor) in self._written_away:
            return True
        version, witness = record
        if version >= 0 and version_of(tensor) != version:
            return True
        if witness is None:  # a layout no witness reads: nothing tells a write from none
            return True
        now = _witness(tensor)
        return now is None or not (now.shape == witness.shape and same_digests([(witness, now)])[0])

    def left_unseen(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``, a captured parameter or buffer its module no longer holds, left with no registration
        seen (``del``, ``= None`` first, a write into ``module._parameters``): nothing says when, so nothing tells
        a write after it from the loader's."""
        return id(tensor) not in self.left


#: A departing tensor of at most this many bytes is witnessed by a copy of them (a copy is cheaper than a digest's
#: reduction on a host; one launch either way on a GPU); a larger one by its digest (about 1/1024 of its size).
COPIED_BYTES = 1 << 16


def _witness(tensor: torch.Tensor) -> torch.Tensor | None:
    """What stands for every byte of ``tensor`` (:func:`every_byte`), or ``None`` where nothing can."""
    return every_byte(tensor, COPIED_BYTES)


def _shares_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` spans less than its whole storage (a view among others of one buffer)."""
    try:
        storage = tensor.untyped_storage()
        return tensor.storage_offset() != 0 or tensor.numel() * tensor.element_size() != storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no storage of its own (a wrapper subclass): no counter to trust
        return True
