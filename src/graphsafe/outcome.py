"""The shared values of graphsafe: what a reload produces and what every layer above compares.

Everything here is a value (an enum or a frozen record), computed once and compared by identity or equality,
never parsed back from text: the contract makes them, the report, the manifest, the toolkit, the demo and the CLI
read them.

* :class:`Fingerprint`: what a captured graph depends on for one tensor (storage identity and liveness, pointers,
  offset, shape, stride, dtype, device, and how the bytes are read: conjugate and negative bits, layout, tensor
  subclass; a wrapper subclass's inner tensors). ``key`` packs the comparable fields into one tuple.
* :class:`Origin`: why a slot is tracked. :class:`SlotRef`: ``layer:path``, the one way a slot is named.
* :class:`FindingKind` (with its severity order), :class:`Finding`, :class:`Status`, :class:`ReloadOutcome`.
* :class:`SlotInfo`: a tracked slot as the contract sealed it.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "Finding",
    "FindingKind",
    "Fingerprint",
    "Origin",
    "ReloadOutcome",
    "SlotInfo",
    "SlotNamed",
    "SlotRef",
    "Status",
    "fingerprint",
    "geometry_key",
    "inner_tensors",
    "memory_tensors",
    "read_params",
    "storage_ids",
    "tensor_kind",
]


def _significant_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    # A stride of a size-1 dimension is never used to address memory; torch is free to pick any value for it.
    return tuple(s if n != 1 else 0 for n, s in zip(shape, stride, strict=True))


def tensor_kind(tensor: torch.Tensor) -> type:
    """The class of ``tensor`` as it matters to a kernel: a plain ``Parameter`` (or ``Buffer``) is a ``Tensor``.

    ``nn.Parameter(x)`` of a subclass ``x`` keeps ``x``'s class, so a subclass is seen whether or not it is a
    parameter; a plain ``Parameter`` replaced by a plain tensor (or back) reads the same bytes the same way.
    """
    cls = type(tensor)
    return torch.Tensor if cls in _PLAIN_KINDS else cls


_PLAIN_KINDS: frozenset[type] = frozenset(
    cls for cls in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None)) if isinstance(cls, type)
)


def inner_tensors(tensor: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...] | None:
    """A wrapper subclass's inner tensors by attribute name (``__tensor_flatten__``), or ``None`` for a tensor
    with storage of its own (plain tensors, parameters, plain subclasses).

    A wrapper (``_make_wrapper_subclass``, as torchao's quantized tensors) owns no storage: the memory a graph
    reads is its inner tensors'. Raises :class:`TypeError` when the flatten protocol does not give tensors.
    """
    if type(tensor) in _PLAIN_KINDS or not is_traceable_wrapper_subclass(tensor):
        return None
    names, _ = tensor.__tensor_flatten__()
    # A flatten may name opaque objects beside the tensors (a DTensor's device mesh): how the bytes are read, not
    # memory. They are compared with the metadata (``flatten_meta``).
    inner = tuple((name, value) for name in names if isinstance(value := getattr(tensor, name), torch.Tensor))
    if not inner:
        raise TypeError(f"{type(tensor).__name__} is a wrapper subclass with no inner tensors: no memory to track")
    return inner


def flatten_meta(tensor: torch.Tensor) -> Any:
    """A wrapper subclass's flatten metadata and the non-tensor objects its flatten names (a DTensor's placements
    and device mesh), comparable: part of how its inner bytes are read."""
    names, meta = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    opaque = tuple(
        (name, _comparable(value)) for name in names if not isinstance(value := getattr(tensor, name), torch.Tensor)
    )
    return _comparable((meta, opaque) if opaque else meta)


def memory_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages ``tensor`` reads: itself, or a wrapper's inner tensors (recursively), in flatten
    order."""
    inner = inner_tensors(tensor)
    if inner is None:
        return [tensor]
    return [part for _, value in inner for part in memory_tensors(value)]


def storage_ids(tensor: torch.Tensor) -> list[int]:
    """``id()`` of each storage holding ``tensor``'s memory (a wrapper's: its inner tensors'), in flatten order."""
    return [id(part.untyped_storage()) for part in memory_tensors(tensor)]


def shape_and_stride(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A tensor's shape and stride; a nested tensor of the strided layout (``torch.nested``, which has neither) is
    read as its one flat buffer, and its components' sizes, strides and offsets are its :func:`read_params`."""
    if tensor.is_nested:
        return (tensor.numel(),), (1,)
    return tuple(tensor.shape), tuple(tensor.stride())


def read_params(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """How a quantized tensor's bytes are read (its scheme, scale and zero point, per tensor or per channel), or
    ``None`` for any other tensor. A kernel gets them at launch, so a captured graph keeps the ones it saw, and a
    ``copy_`` into a quantized tensor takes its source's: like a lazy bit, they must match for a copy to restore.
    For a nested tensor of the strided layout: its components' sizes, strides and offsets in its buffer."""
    if not tensor.is_quantized:
        if tensor.is_nested and tensor.layout is torch.strided:
            return (
                "nested",
                tuple(map(tuple, tensor._nested_tensor_size().tolist())),
                tuple(map(tuple, tensor._nested_tensor_strides().tolist())),
                tuple(tensor._nested_tensor_storage_offsets().tolist()),
            )
        return None
    scheme = tensor.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return (scheme, float(tensor.q_scale()), int(tensor.q_zero_point()))
    return (
        scheme,
        int(tensor.q_per_channel_axis()),
        tuple(tensor.q_per_channel_scales().tolist()),
        tuple(tensor.q_per_channel_zero_points().tolist()),
    )


def _comparable(meta: Any) -> Any:
    # A wrapper's flatten metadata is part of how its bytes are read (a block size, an original dtype). Compare it
    # by value where that gives a plain bool, else by its text.
    try:
        if bool(meta == meta):
            hash(meta)
            return meta
    except Exception:
        pass
    return repr(meta)


# Not frozen: a frozen dataclass pays an object.__setattr__ per field on construction, and the walker and the seal
# build one fingerprint per tensor. Treat instances as immutable.
@dataclass(slots=True, eq=False)
class Fingerprint:
    """What a captured graph depends on for one tensor.

    For a wrapper subclass (``inner`` not empty) the storage fields are those of its first inner tensor and
    ``inner`` holds every inner tensor's own fingerprint: the captured memory is theirs.
    """

    storage_ptr: int
    storage_nbytes: int
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    storage_ref: weakref.ReferenceType[Any] = field(repr=False)
    #: How the bytes are read: the lazy conjugate and negative bits, the layout and the class (see tensor_kind).
    conj: bool = False
    neg: bool = False
    layout: torch.layout = torch.strided
    kind: type = torch.Tensor
    #: A wrapper subclass's inner tensors ``(name, fingerprint)`` and its flatten metadata (comparable form); a
    #: quantized tensor's :func:`read_params`.
    inner: tuple[tuple[str, Fingerprint], ...] = ()
    meta: Any = None

    @property
    def key(self) -> tuple[Any, ...]:
        """Every comparable field in one tuple (equal keys mean the same memory seen the same way)."""
        return (
            self.storage_ptr,
            self.storage_nbytes,
            self.data_ptr,
            self.storage_offset,
            self.shape,
            _significant_stride(self.shape, self.stride),
            self.dtype,
            self.device,
            self.conj,
            self.neg,
            self.layout,
            self.kind,
            tuple((name, fp.key) for name, fp in self.inner),
            self.meta,
        )

    @property
    def alive(self) -> bool:
        """Whether the fingerprinted storage (every inner storage of a wrapper) still exists."""
        return self.storage_ref() is not None and all(fp.alive for _, fp in self.inner)

    @property
    def nbytes(self) -> int:
        """Bytes of the view (elements times element size; a wrapper's inner views summed)."""
        if self.inner:
            return sum(fp.nbytes for _, fp in self.inner)
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize

    def memory(self) -> list[Fingerprint]:
        """The fingerprints of the tensors whose storages this one reads (see :func:`memory_tensors`)."""
        if not self.inner:
            return [self]
        return [part for _, fp in self.inner for part in fp.memory()]

    def same_storage(self, other: Fingerprint) -> bool:
        """Whether both fingerprints name the same live storage objects (a wrapper's, inner by inner)."""
        mine = self.storage_ref()
        if mine is None or mine is not other.storage_ref() or len(self.inner) != len(other.inner):
            return False
        return all(a.same_storage(b) for (_, a), (_, b) in zip(self.inner, other.inner, strict=True))

    def describe(self) -> str:
        """A short human-readable rendering used in error messages and reports."""
        state = "" if self.alive else " (freed)"
        bits = "".join(f" {bit}" for bit, on in (("conj", self.conj), ("neg", self.neg)) if on)
        kind = "" if self.kind is torch.Tensor else f" {self.kind.__name__}"
        if self.layout is not torch.strided:
            kind += f" {self.layout}"
        text = (
            f"{_dtype_name(self.dtype)}{list(self.shape)}{kind}{bits} stride={list(self.stride)} "
            f"offset={self.storage_offset} @0x{self.data_ptr:x} on {self.device}{state}"
        )
        if self.inner:
            text += " {" + "; ".join(f"{name}: {fp.describe()}" for name, fp in self.inner) + "}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering."""
        out: dict[str, Any] = {
            "data_ptr": self.data_ptr,
            "storage_ptr": self.storage_ptr,
            "storage_nbytes": self.storage_nbytes,
            "storage_offset": self.storage_offset,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "dtype": _dtype_name(self.dtype),
            "device": str(self.device),
            "alive": self.alive,
            "conj": self.conj,
            "neg": self.neg,
        }
        if self.layout is not torch.strided:
            out["layout"] = str(self.layout).removeprefix("torch.")
        if self.kind is not torch.Tensor:
            out["kind"] = f"{self.kind.__module__}.{self.kind.__qualname__}"
        if self.inner:
            out["inner"] = [{"name": name, **fp.to_dict()} for name, fp in self.inner]
            out["meta"] = repr(self.meta)
        return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """Fingerprint ``tensor`` (a plain tensor, a view, a parameter, a subclass; a wrapper through its inner tensors).

    Raises :class:`TypeError` or :class:`RuntimeError` for a tensor without storage that is no flattenable wrapper
    (sparse, meta-less fakes); callers that meet arbitrary tensors catch them.
    """
    if type(tensor) in _PLAIN_KINDS and not tensor.is_nested:  # the common case, spelled out: no wrapper test
        storage = tensor.untyped_storage()
        return Fingerprint(
            storage.data_ptr(),
            storage.nbytes(),
            tensor.data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
            weakref.ref(storage),
            tensor.is_conj(),
            tensor.is_neg(),
            tensor.layout,
            torch.Tensor,
            (),
            read_params(tensor),  # a quantized tensor's scale and zero point (None for any other)
        )
    inner = inner_tensors(tensor)
    if inner is not None:
        parts = tuple((name, fingerprint(value)) for name, value in inner)
        first = parts[0][1]
        return Fingerprint(
            storage_ptr=first.storage_ptr,
            storage_nbytes=first.storage_nbytes,
            data_ptr=first.data_ptr,
            storage_offset=int(tensor.storage_offset()),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            dtype=tensor.dtype,
            device=tensor.device,
            storage_ref=first.storage_ref,
            conj=False,  # a wrapper's bits live in its inner tensors (compared there)
            neg=False,
            layout=tensor.layout,
            kind=type(tensor),
            inner=parts,
            meta=flatten_meta(tensor),
        )
    storage = tensor.untyped_storage()
    shape, stride = shape_and_stride(tensor)
    return Fingerprint(
        storage_ptr=storage.data_ptr(),
        storage_nbytes=storage.nbytes(),
        data_ptr=tensor.data_ptr(),
        storage_offset=int(tensor.storage_offset()),
        shape=shape,
        stride=stride,
        dtype=tensor.dtype,
        device=tensor.device,
        storage_ref=weakref.ref(storage),
        conj=tensor.is_conj(),
        neg=tensor.is_neg(),
        layout=tensor.layout,
        kind=tensor_kind(tensor),
        meta=read_params(tensor),
    )


def geometry_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Shape, significant stride, dtype, device and how the bytes are read (conjugate and negative bits, layout,
    class; a wrapper's metadata and its inner tensors' geometry and offsets): what must match for a copy to be a
    faithful restore."""
    shape, stride = shape_and_stride(tensor)
    inner = inner_tensors(tensor)
    if inner is None:
        extra: tuple[Any, ...] = (read_params(tensor),)
        bits = (tensor.is_conj(), tensor.is_neg())
    else:
        extra = (
            flatten_meta(tensor),
            tuple((name, geometry_key(value), int(value.storage_offset())) for name, value in inner),
        )
        bits = (False, False)
    return (
        shape,
        _significant_stride(shape, stride),
        tensor.dtype,
        tensor.device,
        *bits,
        tensor.layout,
        tensor_kind(tensor),
        *extra,
    )


class Origin(enum.Enum):
    """Why a slot is tracked."""

    DECLARED = "declared"  # named by the author
    #: A registered parameter or buffer of the layer (what a loader writes): the graph reads it at its captured
    #: address, so a loader that binds a new tensor there instead of copying into it is restored like a
    #: declared slot, never taken for undeclared drift.
    PARAMETER = "parameter"
    BUFFER = "buffer"  # a registered buffer of the layer: tracked like a parameter
    ALIAS = "alias"  # an undeclared path to a declared slot's (or a parameter's or buffer's) storage: restored with it
    WALKER = "walker"  # found only by the collector

    @property
    def declared(self) -> bool:
        """Whether an author (or the layer's own parameters and buffers) vouches for the slot; ``False`` only for
        walker finds."""
        return self is not Origin.WALKER

    @property
    def is_state(self) -> bool:
        """Whether the slot is a registered parameter or buffer (what a loader writes)."""
        return self is Origin.PARAMETER or self is Origin.BUFFER


@dataclass(frozen=True, slots=True)
class SlotRef:
    """A slot's name in the model: the layer's qualified name and the slot path relative to it.

    ``str(ref)`` is ``layer:path`` (``<model>`` for the root module; the path is left out for a finding about the
    layer as a whole). This is the only place that spelling is made.
    """

    layer: str
    path: str

    def __str__(self) -> str:
        owner = self.layer or "<model>"
        return f"{owner}:{self.path}" if self.path else owner


class Status(enum.Enum):
    """How a reload ended. Ordered: ``FAILED`` is worse than ``NEEDS_RECAPTURE``, which is worse than
    ``COMMITTED``."""

    COMMITTED = "committed"
    NEEDS_RECAPTURE = "needs_recapture"
    FAILED = "failed"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]

    @classmethod
    def worst(cls, *statuses: Status) -> Status:
        """The most severe of ``statuses`` (``COMMITTED`` when none)."""
        return max(statuses, key=lambda s: s.severity, default=cls.COMMITTED)


_SEVERITY = {Status.COMMITTED: 0, Status.NEEDS_RECAPTURE: 1, Status.FAILED: 2}


class FindingKind(enum.Enum):
    """What went wrong (or, for ``AUTO_RESTORED``, what graphsafe repaired) at one slot."""

    MOVED = "moved"
    VANISHED = "vanished"
    RESPECIFIED = "respecified"
    DEAD = "dead"
    ALIAS_BROKEN = "alias-broken"
    ORPHANED = "orphaned"
    STALE = "stale"
    BUDGET_EXHAUSTED = "budget-exhausted"
    #: The walker reached device tensors that no slot path can name, resolve or restore (a set member, a weak
    #: reference's referent, an lru_cache's results, a ContextVar's value, ...): nothing can tell whether the
    #: graph still reads their memory, so no reload of that layer commits. A recapture reads them as they are now.
    UNTRACKABLE = "untrackable"
    RELOAD_ERROR = "reload-error"
    AUTO_RESTORED = "auto-restored"
    #: An undeclared tensor drifted (moved, re-created, left stale, gone) where graph truth proves that no captured
    #: graph reads its captured memory: reported, not a problem (replay is unchanged).
    UNREAD_DRIFT = "unread-drift"

    @property
    def recapture_fixes(self) -> bool:
        """Whether capturing the graphs again makes replay correct.

        A new capture reads the model's current tensors, so it fixes any address problem. It cannot fix wrong
        *values* (``stale``) nor a reload that raised halfway (the weights themselves are suspect).
        """
        return self not in (FindingKind.STALE, FindingKind.RELOAD_ERROR)

    @property
    def is_problem(self) -> bool:
        """``False`` only for records: repairs (``auto-restored``) and drift no graph reads (``unread-drift``)."""
        return self is not FindingKind.AUTO_RESTORED and self is not FindingKind.UNREAD_DRIFT

    @property
    def rank(self) -> int:
        """Where this kind stands when one slot has several findings and one is shown: 0 is the most telling.

        A slot that is gone (vanished, dead) tells more than one whose layout changed, which tells more than one
        that moved or kept stale values; a repair record (``auto-restored``) tells least.
        """
        return _KIND_ORDER.index(self)


#: The order of :attr:`FindingKind.rank`, most telling first.
_KIND_ORDER: tuple[FindingKind, ...] = (
    FindingKind.VANISHED,
    FindingKind.DEAD,
    FindingKind.RESPECIFIED,
    FindingKind.ALIAS_BROKEN,
    FindingKind.MOVED,
    FindingKind.STALE,
    FindingKind.ORPHANED,
    FindingKind.UNTRACKABLE,
    FindingKind.BUDGET_EXHAUSTED,
    FindingKind.RELOAD_ERROR,
    FindingKind.AUTO_RESTORED,
    FindingKind.UNREAD_DRIFT,
)


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (Fingerprint, Finding)):
        return value.to_dict()
    if isinstance(value, BaseException):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return [_json_value(item) for item in value]
    return value


def _record_json(record: Any) -> dict[str, Any]:
    """Every field of a dataclass record, made JSON-friendly (the one encoder of the shared values)."""
    return {item.name: _json_value(getattr(record, item.name)) for item in fields(record)}


class SlotNamed:
    """A record that names a slot by ``layer`` and ``path`` (findings, report entries, manifest holders)."""

    __slots__ = ()
    layer: str
    path: str

    @property
    def slot(self) -> SlotRef:
        """The slot (an empty path for a record about the layer as a whole)."""
        return SlotRef(self.layer, self.path)

    @property
    def where(self) -> str:
        """``layer:path`` (see :class:`SlotRef`)."""
        return str(SlotRef(self.layer, self.path))


@dataclass(frozen=True, slots=True)
class Finding(SlotNamed):
    """One slot's problem: which layer (qualified name in the model), which path, what kind, before vs after."""

    kind: FindingKind
    layer: str
    layer_class: str
    path: str
    declared: bool
    before: Fingerprint | None = None
    after: Fingerprint | None = None
    detail: str = ""
    rank: int | None = None

    def describe(self) -> str:
        """One line naming the layer, the path, what changed and (when known) the old and new fingerprints."""
        who = "declared" if self.declared else "undeclared"
        rank = f"[rank {self.rank}] " if self.rank is not None else ""
        owner = f"{SlotRef(self.layer, '')} ({self.layer_class})"
        text = f"{rank}{self.kind.value}: " + (f"{who} slot {self.path!r} of {owner}" if self.path else owner)
        if self.detail:
            text += f": {self.detail}"
        if self.before is not None:
            text += f"\n    captured: {self.before.describe()}"
        if self.after is not None:
            text += f"\n    now:      {self.after.describe()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering: every field, enums as their values, fingerprints as dicts."""
        return _record_json(self)


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """The result of one reload under a :class:`~graphsafe.GraphContract`."""

    status: Status
    mode: str
    findings: tuple[Finding, ...] = ()
    slots_restored: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    layers: int = 0
    error: BaseException | None = field(default=None, repr=False, compare=False)
    #: One-time set-up this reload paid on top of ``seconds``, once per process: torch's Python dispatch machinery,
    #: loaded on its first use (the recording of what PWAL computes). Not a per-reload cost.
    setup_seconds: float = 0.0
    rank_statuses: tuple[tuple[int, Status], ...] = ()
    #: The name of the contract this outcome decides (``GraphContract.name``), set for a rank agreement: every rank
    #: of a round must decide the same contract.
    contract: str = ""
    #: Slots whose storage no captured graph reads, by the kernel scan (``None``: not every capture was
    #: kernel-scanned, so what is unread is not known).
    slots_unread: int | None = None
    #: Slots whose restore copy was skipped because no captured graph reads them (``GraphContract(unread="skip")``):
    #: the new tensor PWAL made stays at the path and the contract adopted it as the slot's sealed memory.
    slots_skipped: int = 0
    #: With ``unread="skip"``: why no copy was skipped at all (what the graphs read is not fully known, naming the
    #: capture), or ``None``.
    skip_refused: str | None = None
    #: With ``unread="skip"``: unread slots restored anyway, each with why (an alias path left on the captured
    #: storage, the captured storage still held elsewhere, the new tensor on memory a graph reads).
    skip_notes: tuple[str, ...] = ()

    @property
    def needs_recapture(self) -> bool:
        """Whether the captured graphs must be captured again before the next replay."""
        return self.status is Status.NEEDS_RECAPTURE

    @property
    def committed(self) -> bool:
        """Whether every graph-visible address was kept and verified."""
        return self.status is Status.COMMITTED

    @property
    def problems(self) -> tuple[Finding, ...]:
        """The findings that are problems (excludes ``auto-restored`` records)."""
        return tuple(f for f in self.findings if f.kind.is_problem)

    @property
    def auto_restored(self) -> tuple[Finding, ...]:
        """Undeclared slots that ``migrate`` mode restored."""
        return tuple(f for f in self.findings if f.kind is FindingKind.AUTO_RESTORED)

    def summary(self) -> str:
        """A few lines: status, counts and the first findings."""
        lines = [
            f"reload {self.status.value} (mode={self.mode}): {self.slots_restored} slot(s) restored, "
            f"{self.bytes_copied} bytes copied, {len(self.problems)} problem(s) in {self.seconds * 1e3:.2f} ms"
            + (
                f" (+ {self.setup_seconds:.2f} s one-time set-up: torch's dispatch machinery, loaded once per process)"
                if self.setup_seconds >= 0.001
                else ""
            )
            + (
                f"; {self.slots_skipped} unread slot(s) not copied (no captured graph reads them)"
                if self.slots_skipped
                else ""
            )
        ]
        if self.skip_refused is not None:
            lines.append(f"  unread slots restored, not skipped: {self.skip_refused}")
        for note in self.skip_notes[:5]:
            lines.append(f"  unread slot restored, not skipped: {note}")
        if len(self.skip_notes) > 5:
            lines.append(f"  ... and {len(self.skip_notes) - 5} more unread slot(s) restored")
        for finding in self.problems[:10]:
            lines.append("  - " + finding.describe().replace("\n", "\n    "))
        if len(self.problems) > 10:
            lines.append(f"  ... and {len(self.problems) - 10} more")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering: every field (the error as its ``repr``) and ``needs_recapture``."""
        return {**_record_json(self), "needs_recapture": self.needs_recapture}


@dataclass(frozen=True, slots=True)
class SlotInfo(SlotNamed):
    """A tracked slot as the contract sealed it (for reports, the manifest and tools)."""

    layer: str
    layer_class: str
    path: str
    origin: Origin
    fingerprint: Fingerprint
    restorable: bool
    alias_of: str | None
    source: str | None
