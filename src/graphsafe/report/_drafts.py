"""From what a source saw (a :class:`Draft` per undeclared slot) to report entries: owners, the classes along
each path, storage shared between paths, one entry per path, and text without device addresses."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import torch
from torch import nn

from graphsafe.outcome import FindingKind, Fingerprint
from graphsafe.paths import SlotPath
from graphsafe.report._entries import Evidence, ReportEntry
from graphsafe.report._owners import owner_of, unknown_owner, via

__all__ = ["Draft", "Drafted", "dtype_name", "in_model_order", "strip_addresses", "to_entries"]

_ADDRESS: Final = re.compile(r"@0x[0-9a-fA-F]+")


def strip_addresses(text: str) -> str:
    """Text for people: device addresses change run to run (the JSON ``data_ptr`` fields keep them)."""
    return _ADDRESS.sub("@<address>", text)


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``, not ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Draft:
    """One undeclared slot as a source saw it, before its owner and storage sharing are worked out."""

    layer: str
    layer_class: str
    path: str
    fp: Fingerprint
    #: The most telling finding kind a reload produced here, ``None`` when none did.
    drift: FindingKind | None
    restorable: bool | None
    lazy: bool
    evidence: Evidence
    reason: str | None = None
    detail: str = ""
    #: Whether PWAL wrote it (made it, or wrote it in place) while the contract recorded PWAL; ``None``: unknown.
    written: bool | None = None
    #: Whether a recorded capture wrote its storage (the graph overwrites it: scratch).
    graph_writes: bool = False


@dataclass(frozen=True, slots=True)
class Drafted:
    """The entries, and for each whether its owner is known (the layer object was available)."""

    entries: tuple[ReportEntry, ...]
    owner_known: tuple[bool, ...]
    #: ``(pwal, path)`` of entries whose path some other layer that PWAL runs for does not hold: a decorator
    #: listing it would raise there.
    not_on_every_layer: frozenset[tuple[str, str]] = frozenset()


class _InLayer(Protocol):
    @property
    def layer(self) -> str: ...


_T = TypeVar("_T", bound=_InLayer)


def in_model_order(items: Iterable[_T], order: Iterable[str]) -> list[_T]:
    """``items`` grouped by ``.layer`` in ``order`` (unknown layers last), keeping their order within a layer.

    Linear: one bucket per layer, no sort.
    """
    position = {name: index for index, name in enumerate(order)}
    buckets: list[list[_T]] = [[] for _ in range(len(position) + 1)]
    for item in items:
        buckets[position.get(item.layer, len(position))].append(item)
    return [item for bucket in buckets for item in bucket]


def _storage_key(fp: Fingerprint) -> tuple[Any, ...] | None:
    """What identifies the fingerprinted storage: the live object, or for a freed one its address and device
    (fingerprints taken at one seal with equal addresses were one storage). ``None``: nothing to compare."""
    storage = fp.storage_ref()
    if storage is not None:
        return ("live", id(storage))
    if fp.storage_ptr:
        return ("freed", fp.storage_ptr, fp.device)
    return None


def to_entries(drafts: Iterable[Draft], layers: Mapping[str, nn.Module]) -> Drafted:
    """One entry per ``(layer, path)`` (the first draft wins), with owner, classes along the path and the earlier
    path of the same layer on the same storage. One pass, one dict lookup per draft."""
    entries: list[ReportEntry] = []
    known: list[bool] = []
    seen: set[tuple[str, str]] = set()
    # (layer, storage key) -> the first path on that storage; the value keeps a live storage (and its id) alive.
    first_path: dict[tuple[str, tuple[Any, ...]], tuple[str, object]] = {}
    for draft in drafts:
        if (draft.layer, draft.path) in seen:  # a source may list a path twice
            continue
        seen.add((draft.layer, draft.path))
        shared: str | None = None
        key = _storage_key(draft.fp)
        if key is not None:
            first, _ = first_path.setdefault((draft.layer, key), (draft.path, draft.fp.storage_ref()))
            shared = first if first != draft.path else None
        layer = layers.get(draft.layer)
        owner = owner_of(layer) if layer is not None else unknown_owner(draft.layer_class)
        known.append(owner.known)
        entries.append(
            ReportEntry(
                layer=draft.layer,
                layer_class=draft.layer_class,
                path=draft.path,
                shape=draft.fp.shape,
                dtype=dtype_name(draft.fp.dtype),
                device=str(draft.fp.device),
                nbytes=draft.fp.nbytes,
                drift_kind=draft.drift,
                restorable=draft.restorable,
                owner=owner.name,
                pwal=owner.pwal,
                lazy=draft.lazy,
                evidence=draft.evidence,
                reason=draft.reason,
                shares_storage_with=shared,
                via=via(layer, draft.path) if layer is not None else (),
                detail=strip_addresses(draft.detail),
                data_ptr=draft.fp.data_ptr,
                written=draft.written,
                graph_writes=draft.graph_writes,
                receiver=owner.receiver,
            )
        )
    return Drafted(tuple(entries), tuple(known), _not_on_every_layer(entries, layers))


def _not_on_every_layer(entries: Iterable[ReportEntry], layers: Mapping[str, nn.Module]) -> frozenset[tuple[str, str]]:
    """``(pwal, path)`` of the entries whose path does not resolve to a tensor on every layer of ``layers`` that the
    same PWAL runs for (layers with no entry included: a layer without a bias, say)."""
    runs_for: dict[str, list[nn.Module]] = {}
    for module in layers.values():
        pwal = owner_of(module).pwal
        if pwal is not None:
            runs_for.setdefault(pwal, []).append(module)
    wanted = {(e.pwal, e.path) for e in entries if e.pwal is not None and not e.lazy}
    return frozenset((pwal, path) for pwal, path in wanted if not all(_holds(m, path) for m in runs_for.get(pwal, ())))


def _holds(layer: nn.Module, path: str) -> bool:
    try:
        return isinstance(SlotPath(path).resolve_or(layer, None), torch.Tensor)
    except Exception:  # a user property that raises: the decorator would not resolve it either
        return False
