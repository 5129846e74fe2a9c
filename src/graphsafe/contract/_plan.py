"""The order of a restore step's copies (:class:`RestorePlan`): which copy reads bytes another writes, which slots
reading one storage must agree, and what a copy would clobber that someone else still reads."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphsafe.contract._copy import (
    CopyBatch,
    byte_span,
    clone_laid_out,
    distinct_views,
    overlapping_pairs,
    spans_overlap,
)
from graphsafe.contract._memory import (
    _hits,
    _memory,
    _overlap,
    _same_values,
    _sorted_ranges,
    reads_as_captured,
    storage_covers,
)
from graphsafe.contract._samples import version_of
from graphsafe.contract._slots import SealedLayer, SealedSlot, _is_wrapper
from graphsafe.outcome import Finding, FindingKind, Origin, SlotRef, fingerprint, geometry_key, memory_tensors

if TYPE_CHECKING:
    from graphsafe.contract._snapshot import LayerSnapshot

__all__ = ["RestorePlan", "SharedIndex"]


#: Captured storage id -> ``(sealed layer, slot position)`` of every slot reading it, for storages two or more slots
#: read (in one layer or several). Built at seal (``GraphContract._index_layers``).
SharedIndex = Mapping[int, Sequence[tuple[SealedLayer, int]]]


@dataclass(slots=True, eq=False)
class _Move:
    """One planned copy into a captured storage, and the rebind that follows it."""

    snapshot: LayerSnapshot
    index: int
    dst: torch.Tensor  # the captured tensor
    new: torch.Tensor  # the tensor PWAL left at the path
    src: torch.Tensor  # what is copied: ``new``, or a clone of its values taken before anything was written
    group: tuple[Any, ...]
    nbytes: int
    copy: bool  # False for a repeat of a (captured, new) pair already planned
    storage: int  # id() of the captured tensor's storage (alive while the plan is: the move holds the tensor)
    plain: bool | None  # whether a plain copy_ writes every byte of dst (None: the batch finds out)
    #: id() of ``src``'s storage where the planner knew it (alive: the move holds ``src``); ``None``: ask ``src``.
    src_storage: int | None = None
    #: Where ``dst``'s bytes lie: ``(device, first address, end)`` (its storage's address plus its byte span).
    memory: tuple[Any, int, int] = (None, 0, 0)

    @property
    def ref(self) -> str:
        return str(SlotRef(self.snapshot.sealed.qualname, self.snapshot.slots[self.index].path.text))


@dataclass(slots=True, eq=False)
class _Reader:
    """A tensor the model keeps that reads bytes a plan writes (a slot left in place, a new tensor left at its
    path): the bytes it read before the copies, which it must read again after them."""

    view: torch.Tensor
    before: torch.Tensor  # a clone of its values, taken before any copy of the plan was launched
    #: The slot left in place that reads ``view`` (its captured tensor), or ``None`` for a new tensor.
    owner: tuple[SealedLayer, SealedSlot] | None = None
    #: Whether the reload wrote its memory (the captured tensor's version counter moved, or a loaded parameter or
    #: buffer): bytes nobody wrote are the old values, which a slot that shared them with a moved one may still
    #: need to follow.
    written: bool = True
    #: The names of the owner slot's freshness inputs that the reload changed (asked only when a copy changed it).
    changed_inputs: Callable[[], list[str]] | None = None
    #: Whether the captured tensor's version counter moved during the reload (some write reached its memory).
    versioned: bool = False


class RestorePlan:
    """Every copy of one restore step, planned before any is launched: the whole model in ``finish()``, the layers
    of one ``after_layer()``. One transaction over the storages of the whole model:

    * **order.** A source can be another slot's captured storage (a ping-pong swap ``cur, prev = prev, cur``,
      tensors exchanged between layers, a rotation) or a view into one. Copies launched one after another would
      overwrite sources still needed, so :meth:`protect` clones every source whose bytes overlap any destination of
      the plan before any copy is launched: then no order can be wrong. Where nothing overlaps (the common case)
      this costs one dict lookup per copy.
    * **aliasing.** Slots in any layers that read overlapping bytes of a destination's captured storage (a tied
      embedding and head, a workspace shared by layers, a view into a packed tensor) must all read their own new
      values after the copies (:meth:`watch` before launching, :meth:`check` after). A slot left in place keeps
      its bytes; a moved slot whose values the storage then does not hold is ``alias-broken`` and keeps its new
      values. Where the slot left in place cannot vouch for its bytes (nothing wrote them during the reload, or
      another slot's new tensor now owns them: PWAL re-derived its partner but not it), it is ``stale`` too: a
      recapture would read values nobody produced for it.
    """

    __slots__ = ("_dst_memory", "_dst_spans", "_held", "_readers", "_shared", "findings", "moves")

    def __init__(self, shared: SharedIndex) -> None:
        self.moves: list[_Move] = []
        self._dst_spans: dict[int, list[tuple[int, int]]] = {}  # storage id -> byte spans written
        #: device -> (starts, running max of ends) of the addresses written, sorted by start; built when first asked
        self._dst_memory: dict[Any, tuple[list[int], list[int]]] | None = None
        self._readers: list[_Reader] = []
        self._shared = shared
        #: id -> references the moves hold to it, with the list and length it counts (see :meth:`holds`)
        self._held: tuple[list[_Move], int, dict[int, int]] | None = None
        #: Findings on slots outside any move (a slot left in place that cannot vouch for its bytes).
        self.findings: list[Finding] = []

    def add(
        self,
        snapshot: LayerSnapshot,
        index: int,
        dst: torch.Tensor,
        new: torch.Tensor,
        src: torch.Tensor,
        group: tuple[Any, ...],
        nbytes: int,
        *,
        copy: bool,
        span: tuple[int, int] | None = None,
        plain: bool | None = None,
        storage: Any = None,
        source_storage: Any = None,
    ) -> None:
        """Plan ``dst.copy_(src)`` for slot ``index`` of ``snapshot`` (``new`` is the tensor at its path); ``span``
        (``byte_span(dst)``), ``plain`` (see :meth:`CopyBatch.add`) and the storages of ``dst`` and ``src`` where
        the caller knows them already."""
        if storage is None:
            storage = dst.untyped_storage()
        key = id(storage)
        source_key = None if source_storage is None else id(source_storage)
        if span is None:
            span = byte_span(dst)
        base = storage.data_ptr()
        memory = (dst.device, base + span[0], base + span[1])
        held = self._held
        self.moves.append(_Move(snapshot, index, dst, new, src, group, nbytes, copy, key, plain, source_key, memory))
        if held is not None and held[0] is self.moves and held[1] == len(self.moves) - 1:
            counts = held[2]
            for tensor in (dst, new, src):
                counts[id(tensor)] = counts.get(id(tensor), 0) + 1
            self._held = (self.moves, len(self.moves), counts)
        spans = self._dst_spans.get(key)
        if spans is None:
            spans = self._dst_spans[key] = []
        spans.append(span)
        self._dst_memory = None

    def crossing(self) -> list[_Move]:
        """The moves whose destination bytes overlap another move's under another storage object (a DLPack import, a
        tensor carved out of a parameter with ``from_numpy``): every check of shared memory here goes by storage
        identity, so these cannot be checked, and the last copy would win."""
        found: dict[int, _Move] = {}
        for first, second in overlapping_pairs((*move.memory, move) for move in self.moves):
            if first.storage != second.storage:
                found[id(first)], found[id(second)] = first, second
        return list(found.values())

    def holds(self, tensor: torch.Tensor) -> int:
        """How many references to ``tensor`` the planned copies hold (as destination, new tensor or source).

        Counted once per plan and kept up to date by :meth:`add` (a scan per call made planning quadratic); counted
        again where the moves changed otherwise (taken back, a source cloned)."""
        held = self._held
        if held is None or held[0] is not self.moves or held[1] != len(self.moves):
            counts: dict[int, int] = {}
            for move in self.moves:
                for part in (move.dst, move.new, move.src):
                    counts[id(part)] = counts.get(id(part), 0) + 1
            held = self._held = (self.moves, len(self.moves), counts)
        return held[2].get(id(tensor), 0)

    def overlaps_destination(self, tensor: torch.Tensor, storage: int | None = None) -> bool:
        """Whether ``tensor`` (on the storage whose id() is ``storage``, where known) reads bytes a copy of this
        plan writes."""
        spans = self._dst_spans.get(id(tensor.untyped_storage()) if storage is None else storage)
        span = byte_span(tensor)
        if spans is not None and any(spans_overlap(span, written) for written in spans):
            return True
        # By address too: another storage object on the same bytes (a DLPack or from_numpy import) is the same memory.
        memory = self._dst_memory
        if memory is None:
            memory = self._dst_memory = _sorted_ranges(move.memory for move in self.moves)
        return _hits(memory, _memory(tensor, span))

    def protect(self) -> None:
        """Clone every source that reads bytes some copy of the plan writes (before any copy is launched)."""
        clones: dict[int, torch.Tensor] = {}
        for move in self.moves:
            src = move.src
            if self.overlaps_destination(src, move.src_storage if src is move.new else None):
                clone = clones.get(id(src))
                if clone is None:
                    clone = clones[id(src)] = clone_laid_out(src)
                move.src = clone
                self._held = None

    def watch(
        self,
        captured_of: Callable[[SealedLayer, int], torch.Tensor | None],
        version_at_begin: Callable[[SealedLayer, int], int | None],
        local: Sequence[LayerSnapshot] = (),
        kept: Iterable[torch.Tensor] = (),
        changed_inputs: Callable[[SealedLayer, int], list[str]] | None = None,
    ) -> None:
        """Before launching: remember every reader of a written storage other than the move writing it.

        Readers are slots the plan does not move whose captured tensor overlaps a write, found through the seal's
        index (any layer) and ``local`` snapshots (walker extras, unknown at seal), and the ``kept`` tensors: new
        tensors left at their paths (a respecified slot, a path the contract does not track) that read memory a
        copy writes. ``version_at_begin`` gives a captured tensor's version counter when the reload began;
        ``changed_inputs`` the names of a slot's freshness inputs the reload changed.
        """
        moved = {(id(m.snapshot.sealed), m.index) for m in self.moves}
        seen: set[tuple[int, int]] = set()
        readers = self._readers

        def hold(
            view: torch.Tensor | None, owner: tuple[SealedLayer, SealedSlot, int | None, int] | None = None
        ) -> None:
            if view is None or not self.overlaps_destination(view) or not storage_covers(view):
                return  # (a storage PWAL freed or shrank has no bytes to keep: verify flags its slot)
            if owner is None:
                readers.append(_Reader(view, clone_laid_out(view)))
                return
            sealed, slot, version, position = owner
            # Loaded state (parameters, buffers) and static slots own their bytes whoever wrote them.
            versioned = version is not None and version >= 0 and version_of(view) != version
            written = not slot.tracks_freshness or versioned
            changed = functools.partial(changed_inputs, sealed, position) if changed_inputs is not None else None
            readers.append(_Reader(view, clone_laid_out(view), (sealed, slot), written, changed, versioned))

        def hold_slot(
            slot: SealedSlot,
            layer: nn.Module | None,
            view: torch.Tensor | None,
            owner: tuple[SealedLayer, SealedSlot, int | None, int],
        ) -> None:
            # Only a slot whose path still reads its captured tensor keeps bytes there (a vanished or respecified
            # one is a finding already). An alias path (the walker found the storage of a tracked slot) follows
            # its slot: "rebind every alias path", so it reads whatever that slot's new values are.
            if view is None or layer is None or slot.origin is Origin.ALIAS:
                return
            current = slot.get(layer)
            if slot.wrapped:  # a wrapper in place keeps the bytes of each of its inner tensors
                if current is view:
                    for part in memory_tensors(view):
                        hold(part)
                return
            if current is view or (
                isinstance(current, torch.Tensor)
                and current.untyped_storage() is view.untyped_storage()
                and current.data_ptr() == view.data_ptr()
                and geometry_key(current) == geometry_key(view)
            ):
                hold(view, owner)

        for key in self._dst_spans:
            for sealed, position in self._shared.get(key, ()):
                entry = (id(sealed), position)
                if entry in moved or entry in seen:
                    continue
                seen.add(entry)
                slot = sealed.slots[position]
                view = captured_of(sealed, position)
                if view is not None and (slot.wrapped or slot.fp.storage_ref() is view.untyped_storage()):
                    owner = (sealed, slot, version_at_begin(sealed, position), position)
                    hold_slot(slot, sealed.layer_ref(), view, owner)
        for snapshot in local:
            for position, view in enumerate(snapshot.captured):
                entry = (id(snapshot.sealed), position)
                if entry not in moved and entry not in seen:
                    seen.add(entry)
                    slot = snapshot.slots[position]
                    version = snapshot.versions[position] if position < len(snapshot.versions) else None
                    hold_slot(slot, snapshot.layer, view, (snapshot.sealed, slot, version, position))
        for tensor in kept:
            hold(tensor)

    def writing(self) -> contextlib.AbstractContextManager[Any]:
        """Where the plan writes (its copies, a reader's bytes written back) and compares what it wrote: with the
        ``__torch_function__`` of tensor subclasses off, so a class's own ``copy_`` (one that transforms what it
        is given, one that refuses) cannot turn a copy of bytes into another write; and under
        ``torch.inference_mode()`` when some destination is an inference tensor (made there: an engine's warm-up,
        a PWAL run there), which torch lets no one write outside it; plain tensors take the same writes either
        way."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch._C.DisableTorchFunctionSubclass())
        if torch.is_inference_mode_enabled():
            return stack
        if any(move.dst.is_inference() for move in self.moves) or any(r.view.is_inference() for r in self._readers):
            stack.enter_context(torch.inference_mode())
        return stack

    def launch(self, batch: CopyBatch) -> None:
        """Launch every planned copy through ``batch`` (grouped ``_foreach_copy_``) and flush it."""
        add = batch.add
        for move in self.moves:
            if move.copy:
                add(move.dst, move.src, move.group, move.nbytes, plain=move.plain)
        batch.flush()

    def check(self) -> None:
        """After the copies: every slot reading a written storage must read its own new values.

        A reader (a slot left in place, a new tensor left at its path) keeps its bytes: they are its values, and
        whoever reads it reads them there; if a copy changed them, they are written back. A moved slot whose
        captured tensor then does not hold its source is ``alias-broken`` (a finding on its snapshot) and keeps its
        new values: its new tensor, or a clone when a copy overwrote the memory that tensor reads. Its new tensor
        then becomes a reader in turn, so this runs to a fixed point (each round breaks at least one move).
        """
        by_storage: dict[int, list[_Move]] = {}
        for move in self.moves:
            by_storage.setdefault(move.storage, []).append(move)
        readers = self._readers
        broken: set[int] = set()
        flagged: set[int] = set()
        while True:
            changed = [r for r in readers if not _same_values(r.view, r.before)]
            if changed:
                for reader in changed:
                    if reader.owner is not None and id(reader) not in flagged:
                        flagged.add(id(reader))
                        self._doubt(reader)
                with torch.no_grad():
                    for reader in readers:  # byte for byte: a broadcast reader is written through its distinct elements
                        view, before = distinct_views(reader.view, reader.before)
                        view.copy_(before)
            read = {id(r.view.untyped_storage()) for r in readers}
            read_memory = _sorted_ranges(m for m in map(_memory, (r.view for r in readers)) if m is not None)
            fresh: list[_Move] = []
            for key, moves in by_storage.items():
                if len(moves) < 2 and key not in read and not _hits(read_memory, moves[0].memory):
                    continue  # one slot writes it, nobody else reads it (by address either): the copy is all there is
                for move in moves:
                    if id(move) not in broken and not _same_values(move.dst, move.src):
                        fresh.append(move)
            if not fresh:
                return
            for move in fresh:
                broken.add(id(move))
                self._break(move, by_storage[move.storage])
                if move.src is not move.new:  # its tensor reads memory the plan writes: it keeps the clone
                    readers.append(_Reader(move.src, clone_laid_out(move.src)))

    def unbound(self) -> None:
        """After the step's rebinds: a moved slot whose path could not be rebound (a holder refusing assignment)
        still holds its new tensor, and where that reads memory a copy of the plan wrote (PWAL handed it another
        slot's captured tensor: a ping-pong swap), it now reads that slot's values, which graphsafe wrote there.

        Its values (the clone :meth:`protect` took) are written back where no path rebound onto that memory reads
        it: the model is then as PWAL left it, which a recapture reads. Where one does (its partner was rebound),
        both cannot hold their values: ``stale``, since a recapture would read the wrong ones."""
        for move in self.moves:
            snapshot, new, src = move.snapshot, move.new, move.src
            slot = snapshot.slots[move.index]
            if src is new or _is_wrapper(new) or slot.get(snapshot.layer) is not new or _same_values(new, src):
                continue  # rebound, or nothing a copy wrote is read through its new tensor
            saved = snapshot.overrides.get(move.index)
            earlier = saved is not None and saved[0] is new  # an earlier step's copy wrote it: its slot reads it
            partners = [
                other.ref
                for other in self.moves
                if other is not move
                and _overlap(new, other.dst)
                and reads_as_captured(other.snapshot.slots[other.index].get(other.snapshot.layer), other.dst)
            ]
            if earlier or partners:
                why = f"{', '.join(map(repr, partners))} was rebound onto it" if partners else "another slot reads it"
                snapshot.findings.append(
                    snapshot.sealed.finding(
                        FindingKind.STALE,
                        slot,
                        detail=f"its captured tensor could not be bound back, and the new tensor it keeps reads "
                        f"memory the restore wrote with another slot's values, where {why}: this path reads wrong "
                        "values, and so would a recapture. Let PWAL's holder take assignment, then reload again",
                    )
                )
                continue
            with torch.no_grad():
                new.copy_(src)

    def _doubt(self, reader: _Reader) -> None:
        """A slot left in place whose bytes a copy would change: ``stale`` where nothing wrote it although its
        inputs changed.

        The restore's own copy into the shared memory would otherwise pass for PWAL's write (the freshness
        check compares values), and the reader's write-back then leaves its old values under a recapture.
        """
        assert reader.owner is not None
        sealed, slot = reader.owner
        view = reader.view
        if reader.written:
            if not (slot.tracks_freshness and reader.versioned):
                return  # loaded state or a static slot: its bytes are its own whoever wrote them
            # Written, but through another slot's new tensor (PWAL rebound that slot onto this memory and wrote
            # it): the values are that slot's, not this one's.
            owners = [f"the new tensor of {m.ref!r}" for m in self.moves if _overlap(m.new, view)]
            # or through a new tensor PWAL left at another path (a respecified slot keeps it): a rotation that gave
            # this memory to another slot, which wrote its own values there
            if any(r.owner is None and r.view is not view and _overlap(r.view, view) for r in self._readers):
                owners.append("a new tensor another path holds")
            if not owners:
                return  # written by the reload as itself: its own values (the moved slot breaks away)
            why = f"the reload wrote its bytes through {', '.join(owners)}"
        else:
            changed = reader.changed_inputs() if reader.changed_inputs is not None else []
            # Or what its moved partner is computed from (a tie to another layer's slot reads that layer's weights).
            for move in self.moves:
                if not changed and _overlap(move.dst, view):
                    changed = move.snapshot.changed_inputs(move.index)
            if not changed:
                return  # nothing it or its partner is computed from changed: its old values are its values
            why = f"nothing wrote it although {', '.join(changed)} changed"
        partners = sorted({m.ref for m in self.moves if _overlap(m.dst, view)})
        self.findings.append(
            sealed.finding(
                FindingKind.STALE,
                slot,
                detail=f"it shares captured memory with {', '.join(map(repr, partners))}, which the reload gave "
                f"new values, but PWAL left it on that memory and {why}: its values are stale and a recapture "
                "would read them. Re-derive it in PWAL together with its partner",
            )
        )

    def _break(self, move: _Move, sharing: list[_Move]) -> None:
        snapshot = move.snapshot
        slot = snapshot.slots[move.index]
        others = [m.ref for m in sharing if m is not move]
        where = f"shared captured storage with {', '.join(map(repr, others))}" if others else "its captured storage"
        snapshot.findings.append(
            snapshot.sealed.finding(
                FindingKind.ALIAS_BROKEN,
                slot,
                after=fingerprint(move.new),
                detail=f"{where} is also read by another slot or tensor, but the reload produced values that no "
                "longer agree",
            )
        )
        if move.src is not move.new and not _is_wrapper(move.new):
            # The object PWAL made, on the clone's memory: its class (a Parameter subclass) and its Python
            # attributes (a loader's ``output_dim``, ``weight_loader``) are part of what the reload produced.
            new = move.new
            kept = move.src
            if type(kept) is torch.Tensor:  # a fresh object of PWAL's class (one clone can serve several moves)
                grad = new.requires_grad if isinstance(new, nn.Parameter) else kept.requires_grad
                kept = torch.Tensor._make_subclass(type(new), kept, grad)
            elif isinstance(new, nn.Parameter) and not isinstance(kept, nn.Parameter):
                kept = nn.Parameter(kept, requires_grad=new.requires_grad)
            if new.__dict__:
                kept.__dict__.update(new.__dict__)
            snapshot.keep[move.index] = kept
        else:
            snapshot.kept.append(move.new)  # left at its path: a later restore step must not write what it reads
