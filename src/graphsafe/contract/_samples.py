"""Value samples: a fixed set of a tensor's elements, as bytes, taken before the load and compared after it.

Loaders commonly write through ``param.data.copy_``, which does not move the parameter's version counter, so the
values themselves are the only witness of a write. A sample is a strided pick of at most ``elements`` values spread
over the whole tensor, so it is a tiny copy; a change confined to unsampled elements can escape it, and so can a
write that refreshes only part of a slot (both documented in docs/fault-matrix.md). Samples
are compared as bytes: NaN equals NaN, and -0.0 differs from 0.0 (a write that changes any bit is a write).

Each tensor op is a launch on a GPU (5-20 us of host time on an H200 host), so samples are taken and compared in
batches rather than one by one:

* :class:`SampleBatch` collects the samples of one snapshot step (the whole model in ``begin()``, one layer in
  ``before_layer()``) and takes them in one copy per dtype and device at :meth:`SampleBatch.flush`;
* :func:`unchanged` compares many samples with the tensors as they are now: the current samples joined per dtype,
  brought to the host with the old ones in one transfer per device (one synchronisation), compared there.

A sample misses a change confined to the elements it skips. For the tensors a derived slot is computed from (the
weights) a :func:`digest` of every byte is kept too: where the sample says "the same values", the digests decide.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from graphsafe.outcome import inner_tensors, memory_tensors

__all__ = [
    "DIGEST_ROW",
    "INPUT_ELEMENTS",
    "SLOT_ELEMENTS",
    "Digest",
    "Sample",
    "SampleBatch",
    "digest",
    "digests",
    "every_byte",
    "flat_copy",
    "same_digests",
    "signature",
    "unchanged",
    "version_of",
]

#: Elements sampled of a tensor a derived slot is computed from (a weight).
INPUT_ELEMENTS = 256
#: Elements sampled of a derived slot: larger, since a real in-place write that leaves every sampled element as it
#: was would be taken for a no-op (stale), e.g. a requantization of a small weight delta that flips few values.
SLOT_ELEMENTS = 4096

_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def _stride(numel: int, elements: int) -> tuple[int, int]:
    """``(count, step)`` of the sample of ``numel`` contiguous elements: every ``step``-th, spread over all of them
    (the last ``step`` elements always hold a sampled one), at most ``elements``."""
    step = max(1, -(-numel // elements))
    return -(-numel // step), step


def signature(tensor: torch.Tensor, elements: int) -> torch.Tensor:
    """The sample of ``tensor`` taken on its own: a new contiguous uint8 tensor on its device."""
    flat = _flat(tensor, elements)
    if flat is not None:  # the common case in as few tensor ops as possible (each is a launch on CUDA)
        return flat.clone(memory_format=torch.contiguous_format).view(torch.uint8)
    parts = memory_tensors(tensor)
    if parts[0] is not tensor:  # a wrapper subclass: the values are its inner tensors'
        return torch.cat([signature(part, elements) for part in parts])
    value = tensor.detach()
    if value.is_contiguous():
        flat = value.reshape(-1)
        sample = flat[:: _stride(flat.numel(), elements)[1]]
    else:  # a grid of about ``elements`` points: ``reshape(-1)`` of the whole view would copy all of it
        per_dim = max(1, int(elements ** (1 / max(1, value.dim()))))
        index = tuple(slice(None, None, max(1, n // per_dim)) for n in value.shape)
        sample = value[index].reshape(-1)
    # A contiguous copy: a strided sample (a respecified stride) cannot be viewed as bytes.
    return sample.clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _dense(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as a plain dense tensor on the same memory, whose sample is a flat pick of its elements (joinable)
    and whose bytes a digest reads, or ``None``. A subclass that owns its storage (a ``Parameter`` subclass, as
    vLLM's weight parameters) is read through a plain alias; a wrapper subclass (no storage of its own) is not."""
    if type(tensor) not in _PLAIN_TYPES:
        try:
            if inner_tensors(tensor) is not None:
                return None
        except TypeError:
            return None
        tensor = tensor.as_subclass(torch.Tensor)
    if tensor.is_nested and tensor.layout is torch.strided:  # torch.nested's strided layout: its one flat buffer
        flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))
    if tensor.layout is not torch.strided or tensor.is_conj() or tensor.is_neg() or not tensor.is_contiguous():
        return None
    if tensor.is_quantized:  # its bytes as integers (a copy): torch cannot make or view an empty quantized tensor
        return tensor.int_repr()
    return tensor


def _flat(tensor: torch.Tensor, elements: int) -> torch.Tensor | None:
    """The elements of a dense tensor's sample as one flat view (no copy), or ``None`` for any other tensor."""
    plain = _dense(tensor)
    if plain is None:
        return None
    value = plain.detach() if plain.requires_grad else plain
    numel = value.numel()
    if numel <= elements:
        return value.reshape(-1)
    count, step = _stride(numel, elements)
    return value.as_strided((count,), (step,))


class Sample:
    """One tensor's sample: bytes ``[start, end)`` of ``joined`` (a uint8 tensor that may hold other samples too).

    Taken through a :class:`SampleBatch`, it holds nothing until the batch is flushed; reading it before is a bug
    of the caller (the values would be the ones after the load) and raises.
    """

    __slots__ = ("end", "joined", "start")

    def __init__(self, joined: torch.Tensor | None = None, start: int = 0, end: int = 0) -> None:
        self.joined, self.start, self.end = joined, start, end

    def get(self) -> torch.Tensor:
        """The sample's bytes (a uint8 view; what :func:`signature` gives for the tensor as it was)."""
        if self.joined is None:
            raise RuntimeError("graphsafe contract: a value sample was read before its batch was taken (a bug)")
        return self.joined[self.start : self.end]


class Digest:
    """One tensor's :func:`digest`, taken through a :class:`SampleBatch`: it holds nothing until the batch is
    flushed, and reading it before is a bug of the caller (the bytes would be the ones after the load)."""

    __slots__ = ("taken", "value")

    def __init__(self) -> None:
        self.taken = False
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor | None:
        """The digest of the tensor as it was when the batch was flushed (``None``: a tensor without one)."""
        if not self.taken:
            raise RuntimeError("graphsafe contract: a digest was read before its batch was taken (a bug)")
        return self.value


class SampleBatch:
    """The samples of one snapshot step, taken together: :meth:`take` notes a tensor, :meth:`flush` copies the
    samples of every dense tensor noted since the last flush in one ``torch.cat`` per dtype and device, and
    computes the digests noted by :meth:`digest` in a few reductions per device (see :func:`digests`).

    Call :meth:`flush` before anything can write the sampled tensors (before the load): until then a sample is
    only a promise.
    """

    __slots__ = ("_digests", "_handles", "_pending", "_weighted")

    def __init__(self) -> None:
        # (dtype, device, whole) -> the tensors and their samples; ``whole``: the sample is the whole tensor, which
        # is joined in C++ (flatten_dense_tensors) without a Python view per tensor.
        self._pending: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[Sample]]] = {}
        self._digests: tuple[list[torch.Tensor], list[Digest]] = ([], [])
        self._weighted: tuple[list[torch.Tensor], list[Digest]] = ([], [])
        # (id(tensor), weighted) -> its handle, for the tensors in ``_digests`` and ``_weighted``
        self._handles: dict[tuple[int, bool], Digest] = {}

    def digest(self, tensor: torch.Tensor, *, weighted: bool = False) -> Digest:
        """The :func:`digest` of ``tensor`` (``weighted``: position-weighted), taken at the next :meth:`flush` with
        every other one noted. A tensor noted twice before a flush (a weight that is both a layer's own and a derived
        slot's input) is read once: both get one handle (the batch holds the tensor, so its ``id`` is not reused
        meanwhile)."""
        key = (id(tensor), weighted)
        handle = self._handles.get(key)
        if handle is not None:
            return handle
        handle = self._handles[key] = Digest()
        pending = self._weighted if weighted else self._digests
        pending[0].append(tensor)
        pending[1].append(handle)
        return handle

    def take(self, tensor: torch.Tensor, elements: int) -> Sample:
        """The sample of ``tensor`` (``elements`` values), taken at the next :meth:`flush` where it can be joined,
        now otherwise."""
        plain = _dense(tensor)
        if plain is None:
            taken = signature(tensor, elements)
            return Sample(taken, 0, taken.numel())
        tensor = plain
        numel = tensor.numel()
        whole = numel <= elements
        if whole:
            part = tensor
        else:
            value = tensor.detach() if tensor.requires_grad else tensor
            count, step = _stride(numel, elements)
            part = value.as_strided((count,), (step,))
        sample = Sample()
        key = (tensor.dtype, tensor.device, whole)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = ([], [])
        pending[0].append(part)
        pending[1].append(sample)
        return sample

    def flush(self) -> None:
        """Take every pending sample (one copy per dtype, device and kind) and every pending digest."""
        pending, self._pending = self._pending, {}
        plain, self._digests = self._digests, ([], [])
        weighted, self._weighted = self._weighted, ([], [])
        self._handles = {}
        for (tensors, handles), weigh in ((plain, False), (weighted, True)):
            if tensors:
                for handle, value in zip(handles, digests(tensors, weighted=weigh), strict=True):
                    handle.value, handle.taken = value, True
        with torch.no_grad():
            for (dtype, _, whole), (parts, samples) in pending.items():
                joined = (_flatten(parts) if whole else torch.cat(parts)).view(torch.uint8)
                width = dtype.itemsize
                start = 0
                for part, sample in zip(parts, samples, strict=True):
                    end = start + part.numel() * width
                    sample.joined, sample.start, sample.end = joined, start, end
                    start = end


def _flatten(parts: list[torch.Tensor]) -> torch.Tensor:
    """The elements of contiguous ``parts`` one after another, in a new tensor (one copy)."""
    if len(parts) == 1:  # flatten_dense_tensors returns a view of a lone tensor, not a copy
        return flat_copy(parts[0])
    return torch._C._nn.flatten_dense_tensors(parts)


def flat_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements in a new 1-D contiguous tensor (one copy) that can always be viewed as bytes:
    ``clone()`` and ``contiguous()`` keep a size-1 dimension's odd stride, which ``view(torch.uint8)`` refuses.
    A quantized tensor gives its stored integers (its scale is how they are read: ``outcome.read_params``)."""
    if tensor.is_quantized:
        tensor = tensor.int_repr()
    return torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device).copy_(tensor.reshape(-1))


def _host_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a contiguous uint8 tensor in host memory."""
    count = tensor.numel()
    return ctypes.string_at(tensor.data_ptr(), count) if count else b""


def unchanged(pairs: Sequence[tuple[Sample, torch.Tensor]], elements: int) -> list[bool]:
    """For each ``(sample taken before, tensor now)``: whether the tensor's sample now has the same bytes.

    Dense tensors whose sample was taken joined are compared in a batch: their current samples are joined per
    dtype and device, put with the old samples' joined tensors into one uint8 tensor per device and brought to the
    host in one transfer; each pair is compared there. Any other pair is compared on its own.
    """
    result = [False] * len(pairs)
    # device -> (dtype, whole) -> (positions in ``pairs``, tensors or their strided sample views)
    batched: dict[Any, dict[tuple[Any, bool], tuple[list[int], list[torch.Tensor]]]] = {}
    for position, (sample, tensor) in enumerate(pairs):
        plain = _dense(tensor) if sample.joined is not None else None
        if plain is not None:
            tensor = plain
            numel = tensor.numel()
            whole = numel <= elements
            if whole:
                part = tensor  # joined in C++ below, no view per tensor
            else:
                value = tensor.detach() if tensor.requires_grad else tensor
                count, step = _stride(numel, elements)
                part = value.as_strided((count,), (step,))
            if part.numel() * part.element_size() == sample.end - sample.start:
                entry = batched.setdefault(tensor.device, {}).setdefault((tensor.dtype, whole), ([], []))
                entry[0].append(position)
                entry[1].append(part)
                continue
        before, now = sample.get(), signature(tensor, elements)
        result[position] = before.shape == now.shape and torch.equal(before, now)
    with torch.no_grad():
        for by_dtype in batched.values():
            pieces: list[torch.Tensor] = []
            where: list[tuple[int, int, int]] = []  # (position, offset of its current bytes, their length)
            offset = 0
            for (_, whole), (positions, parts) in by_dtype.items():
                now = (_flatten(parts) if whole else torch.cat(parts)).view(torch.uint8)
                pieces.append(now)
                width = parts[0].element_size()
                for position, part in zip(positions, parts, strict=True):
                    count = part.numel() * width
                    where.append((position, offset, count))
                    offset += count
            base: dict[int, int] = {}  # position -> offset of its old bytes
            needed: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(joined) -> (joined, positions)
            for position, _, _ in where:
                joined = pairs[position][0].joined
                assert joined is not None
                needed.setdefault(id(joined), (joined, []))[1].append(position)
            for joined, positions in needed.values():
                samples = [pairs[position][0] for position in positions]
                if 2 * sum(sample.end - sample.start for sample in samples) < joined.numel():
                    for position, sample in zip(positions, samples, strict=True):  # a few of many: their bytes only
                        pieces.append(joined[sample.start : sample.end])
                        base[position] = offset
                        offset += sample.end - sample.start
                else:
                    for position, sample in zip(positions, samples, strict=True):
                        base[position] = offset + sample.start
                    pieces.append(joined)
                    offset += joined.numel()
            both = torch.cat(pieces)
            data = _host_bytes(both.cpu() if both.device.type != "cpu" else both)
            for position, start, count in where:
                old = base[position]
                result[position] = data[start : start + count] == data[old : old + count]
    return result


#: Words (4 bytes where the tensor's bytes allow) summed into one entry of a :func:`digest`.
DIGEST_ROW = 1024
#: Rows widened per step of a weighted digest: on a host 128 (1 MiB of float64 words, which stay in cache), on a
#: device 1024 (8 MiB of int64 words and as much of products: the temporaries stay small beside a loaded engine).
_HOST_ROWS_PER_STEP = 128
_DEVICE_ROWS_PER_STEP = 1024
_WEIGHTS: dict[Any, torch.Tensor] = {}


def _row_weights(device: Any) -> torch.Tensor:
    """The weight of each word position in a row: 1 to 1,024 in a fixed pseudo-random order (int64), each once. A
    row's weighted sum of its words (sign-extended, below 2**31) stays below 2**51, so it is exact in int64 and in
    float64 alike. Distinct weights make an exchange of two unequal words in a row always show, and two sign flips;
    a change of more words cancels only where the weights times the changes sum to zero exactly (a whole row negated:
    about one chance in 50,000, and a tensor digested spans several rows)."""
    weights = _WEIGHTS.get(device)
    if weights is None:
        drawn = torch.randperm(DIGEST_ROW, generator=torch.Generator().manual_seed(0x5EED)) + 1
        weights = _WEIGHTS[device] = drawn.to(device)
    return weights


def _row_sums(rows: torch.Tensor, total: torch.dtype, weighted: bool) -> torch.Tensor:
    """Per row of ``rows`` (words, ``[n, k]``, ``k <= DIGEST_ROW``), the wrapping sum of its words in ``total``, or
    (``weighted``) the exact int64 sum of each word times its position's weight."""
    if not weighted:
        return rows.sum(1, dtype=total)
    weights = _row_weights(rows.device)[: rows.shape[1]]
    # Widened a block of rows at a time: on a host the widened words stay in cache (a whole tensor widened at once
    # is several times slower), on a device the temporaries stay bounded.
    if rows.device.type != "cpu":  # an int64 multiply and sum: no BLAS call (and no BLAS workspace) on a device
        step = _DEVICE_ROWS_PER_STEP
        blocks = [(rows[i : i + step].to(torch.int64) * weights).sum(1) for i in range(0, rows.shape[0], step)]
        return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64, device=rows.device)
    # Float64 matrix-vector products (BLAS), exact below 2**53: the int64 sums, in any order of summation.
    weights = weights.to(torch.float64)
    sums = torch.empty(rows.shape[0], dtype=torch.float64)
    for start in range(0, rows.shape[0], _HOST_ROWS_PER_STEP):
        stop = start + _HOST_ROWS_PER_STEP
        torch.mv(rows[start:stop].to(torch.float64), weights, out=sums[start:stop])
    return sums.to(torch.int64)


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter, or -1 where it has none: a tensor made under ``torch.inference_mode()`` (an
    engine's warm-up or PWAL) counts no writes, so its value samples and digests alone say whether it changed."""
    if tensor.is_inference():
        return -1
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor repointed with ``.data =``: torch refuses its counter too
        return -1


def every_byte(tensor: torch.Tensor, copy_bytes: int) -> torch.Tensor | None:
    """A witness of every byte a strided tensor holds (a wrapper's inner tensors in turn), as one new uint8 tensor:
    a copy of a part of at most ``copy_bytes`` bytes, the :func:`digest` of a larger one; ``None`` for another
    layout or the meta device. The same tensor with the same bytes always gives an equal witness; a change to any
    byte changes it (as a digest's row sums change). A non-contiguous part is read through a contiguous copy."""
    pieces = []
    for part in memory_tensors(tensor):
        plain = _dense(part)
        if plain is None:
            if part.layout is not torch.strided or part.device.type == "meta":
                return None
            plain = part.detach().as_subclass(torch.Tensor).resolve_conj().resolve_neg()
            plain = torch.clone(plain, memory_format=torch.contiguous_format)
        if plain.device.type == "meta":
            return None
        if plain.numel() * plain.element_size() <= copy_bytes:
            pieces.append(plain.detach().clone().reshape(-1).view(torch.uint8))  # detached: no autograd record
        else:
            pieces.append(_digest_raw(*_raw_dense(plain), True).view(torch.uint8))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _raw(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A dense tensor's bytes as one flat uint8 view and the word width its digest sums (4 or 2 bytes where the
    byte count allows, else 1), or ``None`` for any other tensor."""
    plain = _dense(tensor)
    if plain is None or plain.device.type == "meta":
        return None
    return _raw_dense(plain)


def _raw_dense(plain: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`_raw` of a tensor :func:`_dense` already gave (not on the meta device)."""
    # Contiguous: its elements lie one after another from its offset (a one-element tensor may still carry any
    # stride, which a byte view refuses), so one flat view of them reads every byte.
    raw = plain.detach().as_strided((plain.numel(),), (1,), plain.storage_offset()).view(torch.uint8)
    count = raw.numel()
    # The word size follows the byte count only, so the same bytes give the same digest wherever they lie.
    return raw, 4 if count % 4 == 0 else 2 if count % 2 == 0 else 1


def _words(raw: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.dtype]:
    """``raw`` (uint8, starting where a word can) as words of ``width`` bytes, and the dtype they are summed in."""
    if width == 4:
        return raw.view(torch.int32), torch.int32
    if width == 2:
        return raw.view(torch.int16), torch.int16
    return raw, torch.int32  # an odd byte count: bytes summed as int32 (odd sizes are small)


def _digest_raw(raw: torch.Tensor, width: int, weighted: bool = False) -> torch.Tensor:
    if raw.storage_offset() % width:
        raw = raw.clone()  # a view at an offset the words cannot start at (a slice of a packed tensor): copied
    words, total = _words(raw, width)
    count = words.numel()
    full = count // DIGEST_ROW * DIGEST_ROW
    if full == count:  # whole rows
        return _row_sums(words.view(-1, DIGEST_ROW), total, weighted)
    # the last row is short: its sum is what the zero-padded row of :func:`digests` sums to
    rows = _row_sums(words[:full].view(-1, DIGEST_ROW), total, weighted)
    return torch.cat([rows, _row_sums(words[full:].view(1, -1), total, weighted)])


def digest(tensor: torch.Tensor, *, weighted: bool = False) -> torch.Tensor | None:
    """A digest of every byte of a dense tensor: wrapping integer sums of its raw words in rows of
    :data:`DIGEST_ROW` words, the last row as long as what is left (a new tensor about 1/1024 of its size, on its
    device), or ``None`` for any other tensor.

    Any change to one word changes its row's sum; changes that cancel within one row escape, among them words
    exchanged within it and two sign flips. ``weighted``: the exact int64 sum of each word times a pseudo-random
    weight of its position (:func:`_row_weights`), so exchanges, negations and bit flips show too (about three times
    the cost of a plain sum on a host: the witnesses of writes by holders use it, the inputs' digests do not). Integer
    sums are the same in any order, so equal bytes always give equal digests.
    Reads the whole tensor (one reduction, bandwidth-bound on a GPU). :func:`digests` gives the same values for
    many tensors at once.
    """
    raw = _raw(tensor)
    if raw is None:
        return None
    with torch.no_grad():
        return _digest_raw(*raw, weighted)


#: Tensors of at most this many bytes are digested together (one copy of their bytes, one reduction per device and
#: word width): each is launch-bound alone. Larger ones are read in place, one reduction each (bandwidth-bound).
DIGEST_JOIN_BYTES = 1 << 20


def digests(tensors: Sequence[torch.Tensor], *, weighted: bool = False) -> list[torch.Tensor | None]:
    """:func:`digest` of each tensor, equal value for value, in a few launches: small tensors of one device, dtype
    and word width are joined in their own dtype (no byte view per tensor), each followed by zeros up to a whole row
    (zeros add nothing to a row's sum), and summed in one reduction over their bytes."""
    result: list[torch.Tensor | None] = [None] * len(tensors)
    # (device, dtype, word width) -> (positions, the tensors as plain dense ones)
    joined: dict[tuple[Any, Any, int], tuple[list[int], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for position, tensor in enumerate(tensors):
            plain = _dense(tensor)
            if plain is None or plain.device.type == "meta":
                continue
            count = plain.numel() * plain.element_size()
            width = 4 if count % 4 == 0 else 2 if count % 2 == 0 else 1
            if count > DIGEST_JOIN_BYTES:
                result[position] = _digest_raw(*_raw_dense(plain), weighted)
                continue
            key = (plain.device, plain.dtype, width)
            members = joined.get(key)
            if members is None:
                members = joined[key] = ([], [])
            members[0].append(position)
            members[1].append(plain)
        for (device, dtype, width), (positions, plains) in joined.items():
            row_bytes = DIGEST_ROW * width
            itemsize = dtype.itemsize
            counts = [plain.numel() for plain in plains]
            rows = [-(-(count * itemsize) // row_bytes) for count in counts]
            # (a whole number of elements: a row holds whole words, and the bytes of a tensor of this width do too)
            pads = [(row * row_bytes) // itemsize - count for row, count in zip(rows, counts, strict=True)]
            widest = max(pads)
            pieces = plains
            if widest:
                zeros = torch.zeros(widest, dtype=dtype, device=device)
                pieces = []
                for plain, pad in zip(plains, pads, strict=True):
                    pieces.append(plain)
                    if pad:
                        pieces.append(zeros[:pad])
            flat = torch._C._nn.flatten_dense_tensors(pieces) if len(pieces) > 1 else flat_copy(pieces[0])
            words, total = _words(flat.view(torch.uint8), width)
            sums = _row_sums(words.view(-1, DIGEST_ROW), total, weighted)
            for position, part in zip(positions, torch.split(sums, rows), strict=True):
                result[position] = part
    return result


def same_digests(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each pair of digests: whether they are equal; compared on the host after one transfer per device."""
    result = [False] * len(pairs)
    by_device: dict[Any, list[int]] = {}
    for position, (a, b) in enumerate(pairs):
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            continue
        by_device.setdefault(a.device, []).append(position)
    with torch.no_grad():
        for positions in by_device.values():
            pieces = [t.view(-1).view(torch.uint8) for p in positions for t in pairs[p]]
            both = torch.cat(pieces)
            data = _host_bytes(both.cpu() if both.device.type != "cpu" else both)
            start = 0
            for position in positions:
                count = pairs[position][0].numel() * pairs[position][0].element_size()
                result[position] = data[start : start + count] == data[start + count : start + 2 * count]
                start += 2 * count
    return result
