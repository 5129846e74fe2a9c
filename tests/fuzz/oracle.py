"""The independent oracle: what a captured graph reads, what it would read after a reload, and what is right.

Nothing here imports graphsafe. A CUDA graph replays the exact addresses its kernels read at capture, with the
geometry (dtype, shape, stride, offset) they were launched with. So:

* :class:`ReadRecorder` runs the model's forward under a ``TorchDispatchMode`` and records every tensor an op reads
  whose storage was not allocated inside the forward (model state, not the input or intermediates): a weak
  reference to its storage, its pointer and geometry, and its values (raw bytes as a kernel reads them, and the
  logical values torch would compute with). Reads are keyed by ``(label, n)``: the label the forward announced
  before the read and the read's number under it, so two forwards of the same model structure line up.
* **Replay**: after the reload, the bytes at each captured storage, read with the captured geometry, must equal the
  values a model built cold on the new weights reads at the same position. A freed storage reads garbage.
* **The model's own values** (what a recapture would read): every read of the reloaded model's forward must have
  the cold model's values (compared logically, after casting to the cold dtype and shape).

:func:`judge` turns a reload's status and these facts into a verdict: ``silent`` (committed while a replay would
read wrong values, a recapture asked for while the model holds wrong values, or the model's values corrupted
although PWAL produced the right ones), ``crash`` (set by the harness), ``false-alarm`` (not committed although PWAL
left every captured read at its captured address with the right values) or ``ok``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

Key = tuple[str, int]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The elements a kernel reads at the tensor's pointer with its geometry: no conj/neg bit, no subclass."""
    plain = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    plain.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return plain.clone()


def _logical(tensor: torch.Tensor) -> torch.Tensor:
    """The values torch computes with (conj and neg bits resolved), as a plain tensor."""
    return tensor.as_subclass(torch.Tensor).resolve_conj().resolve_neg().clone()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    # A fresh 1-D copy: a size-1 dimension may carry any stride, and a byte view needs stride 1.
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return flat.view(torch.uint8)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of the logical elements (``b``'s dtype and shape win; NaNs compare by bits)."""
    if a.numel() != b.numel():
        return False
    if a.dtype != b.dtype:
        if a.is_complex() and not b.is_complex():
            return False
        a = a.to(b.dtype)
    return torch.equal(_bytes(a.reshape(b.shape)), _bytes(b))


def kernel_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors a kernel reads for ``tensor``: itself, or a wrapper subclass's inner tensors (a torchao-style
    wrapper, a DTensor's local shard), flattened through ``__tensor_flatten__``."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # a DTensor's flatten names its device mesh too
                yield from kernel_tensors(inner)
    else:
        yield tensor


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``tensor`` spans (``(start, start)`` when empty)."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return start, start
    extent = sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    return start, start + extent * size


def _significant(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s if n != 1 else 0 for n, s in zip(shape, stride, strict=True))


@dataclass
class Read:
    """One tensor one op read: where (a weak storage reference and the pointer) and how (geometry)."""

    storage: weakref.ReferenceType[Any]
    data_ptr: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    lazy_bits: bool  # a conj or neg bit: the memory holds other values than torch computes with
    raw: torch.Tensor | None = None
    logical: torch.Tensor | None = None

    @property
    def geometry(self) -> tuple[Any, ...]:
        return (self.data_ptr, self.offset, self.shape, _significant(self.shape, self.stride), self.dtype)

    def replay(self) -> torch.Tensor | None:
        """What a replay reads now at this captured address with this geometry; ``None`` if the storage is freed."""
        storage = self.storage()
        if storage is None:
            return None
        plain = torch.empty(0, dtype=self.dtype)
        plain.set_(storage, self.offset, self.shape, self.stride)
        return plain.clone()


class ReadRecorder(TorchDispatchMode):
    """Records every model-state tensor the ops inside the block read (see the module docs)."""

    def __init__(self, ignore: tuple[torch.Tensor, ...] = (), values: bool = True) -> None:
        super().__init__()
        self.reads: dict[Key, Read] = {}
        self.label = "?"
        self._counts: dict[str, int] = {}
        self._values = values
        # The ignored inputs by their own bytes: a model tensor in the same storage is still model state.
        self._ignore = {(id(t.untyped_storage()), *_byte_range(t)) for t in ignore}
        self._made: list[Any] = []  # storages allocated inside the block (strong: their ids stay unique)
        self._made_ids: set[int] = set()
        self._keep = [t.untyped_storage() for t in ignore]

    def note(self, label: str) -> None:
        self.label = label

    def _ignored(self, tensor: torch.Tensor, storage: Any) -> bool:
        start, end = _byte_range(tensor)
        return any(key == id(storage) and lo <= start and end <= hi for key, lo, hi in self._ignore)

    def saw(self, label: str, tensor: torch.Tensor) -> None:
        """A read no dispatched op shows (a custom op reading a table it is not passed): the forward says so."""
        self.note(label)
        for plain in kernel_tensors(tensor):
            self._record(plain)

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if id(storage) in self._made_ids or self._ignored(tensor, storage):
            return
        n = self._counts.get(self.label, 0)
        self._counts[self.label] = n + 1
        self.reads[(self.label, n)] = Read(
            weakref.ref(storage),
            tensor.data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.is_conj() or tensor.is_neg(),
            _raw(tensor) if self._values else None,
            _logical(tensor) if self._values else None,
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        plain = [p for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for p in kernel_tensors(t)]
        inputs = {id(t.untyped_storage()) for t in plain}
        for tensor in plain:
            self._record(tensor)
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            for made in kernel_tensors(tensor):
                storage = made.untyped_storage()
                if id(storage) not in inputs:  # a view shares its input's storage: not allocated here
                    self._made.append(storage)
                    self._made_ids.add(id(storage))
        return out


_active = threading.local()


def saw(label: str, tensor: torch.Tensor) -> None:
    """Tell the innermost recorder of this thread (if any) of a read its dispatch mode cannot see."""
    stack = getattr(_active, "stack", ())
    if stack:
        stack[-1].saw(label, tensor)


@contextmanager
def recording(ignore: tuple[torch.Tensor, ...] = (), values: bool = True) -> Iterator[ReadRecorder]:
    recorder = ReadRecorder(ignore, values)
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(recorder)
    try:
        with recorder:
            yield recorder
    finally:
        stack.pop()
    recorder._made.clear()
    recorder._keep.clear()


def record(
    forward: Callable[[Callable[[str], None]], Any], ignore: tuple[torch.Tensor, ...] = (), values: bool = True
) -> dict[Key, Read]:
    """Run ``forward(note)`` under a recorder and return its reads."""
    with recording(ignore, values) as recorder:
        forward(recorder.note)
    return recorder.reads


# --------------------------------------------------------------------------------------------------------------
# Facts and verdicts


def replay_wrong(captured: dict[Key, Read], cold: dict[Key, Read]) -> list[str]:
    """Captured reads whose bytes now differ from the cold model's (or whose storage is freed)."""
    wrong = []
    for key, read in captured.items():
        now = read.replay()
        want = cold.get(key)
        if now is None:
            wrong.append(f"{key[0]}: captured storage freed")
        elif want is None or want.raw is None or not same_values(now, want.raw):
            wrong.append(f"{key[0]}: replay reads other values than a cold model")
    return wrong


def is_attribute(key: Key) -> bool:
    """A read through a Python attribute hung on a tensor (``d0.fz_attr``, ``weight.fz_scale``)."""
    return "." in key[0].split(":", 1)[-1]


def values_wrong(reads: dict[Key, Read], cold: dict[Key, Read]) -> dict[Key, str]:
    """Reads whose logical values differ from the cold model's (a missing read is not a wrong value; nor is a read
    through an attribute the cold model lacks: whether an attribute is there is the attribute check's)."""
    wrong = {}
    for key, read in reads.items():
        want = cold.get(key)
        if want is None and is_attribute(key):
            continue
        if want is None or read.logical is None or want.logical is None or not same_values(read.logical, want.logical):
            wrong[key] = f"{key[0]}: holds other values than a cold model"
    return wrong


def in_place(after: dict[Key, Read], captured: dict[Key, Read], cold: dict[Key, Read]) -> bool:
    """Whether the forward now reads exactly the captured addresses, geometry and raw values a cold model reads."""
    if after.keys() != captured.keys():
        return False
    for key, read in after.items():
        was = captured[key]
        storage = read.storage()
        if storage is None or storage is not was.storage() or read.geometry != was.geometry or read.lazy_bits:
            return False
        want = cold.get(key)
        if want is None or read.raw is None or want.raw is None or not same_values(read.raw, want.raw):
            return False
    return True


AttrKey = tuple[str, str]


def same_attribute(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None, *, identity: bool = True) -> bool:
    """Whether two described attributes (see ``fuzz.models.attributes``) are the same: both absent, equal plain
    values (the same object for a function), the same slot paths for a tensor some slot holds, or equal values.
    ``identity=False``: a tensor is judged by its values alone (which slot's object it is does not matter)."""
    a = a or ("absent",)
    b = b or ("absent",)
    tensors = ("tensor", "ref")
    if a[0] in tensors and b[0] in tensors and (not identity or a[0] == b[0] == "tensor"):
        x, y = a[-1], b[-1]
        return bool(x.dtype == y.dtype and x.shape == y.shape and same_values(x, y))
    if a[0] != b[0]:
        return False
    if a[0] == "absent":
        return True
    if a[0] == "ref":
        return bool(a[1] == b[1])
    try:
        return a[1] is b[1] or bool(a[1] == b[1])
    except Exception:
        return False


def attributes_wrong(
    post: dict[AttrKey, tuple[Any, ...]],
    pwal: dict[AttrKey, tuple[Any, ...]] | None,
    cold: dict[AttrKey, tuple[Any, ...]],
) -> list[str]:
    """Attributes the reloaded model carries that neither a cold model carries nor PWAL left (graphsafe moves a new
    tensor's attributes onto the captured one it binds back; a tensor naming another slot's new tensor must then
    name that slot's captured tensor, which is what its path holds). Where PWAL itself left something else than a
    cold model (an attribute set only at the first load), PWAL's is right too: graphsafe does not redo PWAL."""
    wrong = []
    for key in sorted(set(post) | set(cold) | set(pwal or {})):
        now = post.get(key)
        if same_attribute(now, cold.get(key)):
            continue
        if pwal is not None and same_attribute(now, pwal.get(key)):
            continue
        what = (now or ("absent",))[0]
        wrong.append(f"{key[0]}.{key[1]}: {what}, neither a cold model's nor what PWAL left")
    return wrong


def attributes_changed(
    post: dict[AttrKey, tuple[Any, ...]],
    pwal: dict[AttrKey, tuple[Any, ...]] | None,
    cold: dict[AttrKey, tuple[Any, ...]],
) -> list[str]:
    """Attributes PWAL left as a cold model has them that the reloaded model no longer has, whatever the status:
    graphsafe wrote them (the attribute twin of "a value PWAL got right was overwritten"). Tensors by value here:
    which object an attribute names is judged after a commit only (:func:`attributes_wrong`)."""
    if pwal is None:
        return []
    changed = []
    for key in sorted(set(pwal) | set(cold)):
        want = cold.get(key)
        if same_attribute(pwal.get(key), want, identity=False) and not same_attribute(
            post.get(key), want, identity=False
        ):
            changed.append(f"{key[0]}.{key[1]}: {(post.get(key) or ('absent',))[0]}, PWAL left a cold model's")
    return changed


SILENT = "silent"
CRASH = "crash"
FALSE_ALARM = "false-alarm"
OK = "ok"
VERDICTS = (SILENT, CRASH, FALSE_ALARM, OK)


@dataclass
class Facts:
    """What the oracle saw around one reload. ``pwal_wrong`` is ``None`` when PWAL raised (not comparable)."""

    status: str  # COMMITTED, NEEDS_RECAPTURE, FAILED, or REFUSED (raised before any reload)
    replay_wrong: list[str]
    model_wrong: dict[Key, str]
    pwal_wrong: dict[Key, str] | None
    pwal_in_place: bool
    attrs_wrong: list[str] = field(default_factory=list)  # see attributes_wrong
    attrs_changed: list[str] = field(default_factory=list)  # see attributes_changed
    pwal_keys: frozenset[Key] = frozenset()  # the reads PWAL's state made (an attribute read PWAL lacks is no value
    # it got right)


def judge(facts: Facts) -> tuple[str, str]:
    """``(verdict, reason)`` for one reload."""
    if facts.status == "COMMITTED" and facts.replay_wrong:
        return SILENT, "committed, replay wrong: " + facts.replay_wrong[0]
    if facts.status == "COMMITTED" and facts.attrs_wrong:
        return SILENT, "committed, attribute wrong: " + facts.attrs_wrong[0]
    if facts.pwal_wrong is not None:
        # Reads PWAL got right and the model holds wrong after the reload: graphsafe wrote them.
        corrupted = [
            why
            for key, why in facts.model_wrong.items()
            if key not in facts.pwal_wrong and (key in facts.pwal_keys or not is_attribute(key))
        ]
        if corrupted:
            return SILENT, f"{facts.status}, a value PWAL got right was overwritten: " + corrupted[0]
    if facts.attrs_changed:
        return SILENT, f"{facts.status}, an attribute PWAL got right was changed: " + facts.attrs_changed[0]
    if facts.status == "NEEDS_RECAPTURE" and facts.model_wrong:
        return SILENT, "needs-recapture, but a recapture reads wrong values: " + next(iter(facts.model_wrong.values()))
    if facts.status != "COMMITTED" and facts.pwal_in_place:
        return FALSE_ALARM, f"{facts.status} although PWAL left every captured read in place with the right values"
    return OK, ""
