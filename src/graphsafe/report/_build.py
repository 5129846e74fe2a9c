"""The migration report: every undeclared graph-visible tensor, and the exact line that declares it.

A report is built from one of three sources:

* a model: every module is walked now (:func:`graphsafe.collectors.walk`), minus declared slots and their aliases;
* a sealed :class:`~graphsafe.GraphContract`: its walker-found slots, plus what its last reload found;
* a :class:`~graphsafe.ReloadOutcome`: its findings on undeclared slots (what a strict-mode error carries).

Each entry names its owner: the class whose ``process_weights_after_loading`` (PWAL) ran for the layer (the
layer's ``quant_method`` when it has one with a PWAL, else the layer itself). Fixes are grouped by that PWAL so one
decorator line covers every layer it runs for. A tensor that is not at its path right after PWAL (it vanished
during a reload, or appeared only after the seal) gets a ``register_derived`` call instead: ``@graph_visible``
would raise on a path that does not resolve when PWAL returns. Rendering lives in :mod:`._report_render`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

from graphsafe.contract import GraphContract
from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.outcome import Fingerprint, Origin
from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_of

if TYPE_CHECKING:
    from graphsafe.collectors import TensorRef
    from graphsafe.outcome import Finding, ReloadOutcome

__all__ = [
    "FORMATS",
    "SCHEMA_ID",
    "STABLE",
    "Fix",
    "MigrationReport",
    "ReportEntry",
    "UnownedEntry",
    "migration_report",
    "report_schema",
]

#: The ``schema`` field of the JSON rendering; bumped on any incompatible change (see report_schema.json).
SCHEMA_ID: Final = "graphsafe.migration-report/1"
#: Drift of an entry no reload was seen to move.
STABLE: Final = "stable so far"
#: What :meth:`MigrationReport.render` accepts.
FORMATS: Final = ("text", "markdown", "json", "tree", "dot")

_PWAL: Final = "process_weights_after_loading"
_ADDRESS: Final = re.compile(r"@0x[0-9a-fA-F]+")
# Findings about a slot, most telling first; used to pick one drift per entry when a slot has several.
_DRIFT_ORDER: Final = (
    "vanished",
    "dead",
    "respecified",
    "alias-broken",
    "moved",
    "stale",
    "orphaned",
    "auto-restored",
)


@dataclass(frozen=True, slots=True)
class ReportEntry:
    """One undeclared graph-visible tensor at one path of one layer."""

    #: Qualified name of the layer in the model (``""`` for the root).
    layer: str
    #: The layer's class name.
    layer_class: str
    #: Slot path relative to the layer.
    path: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    #: Bytes of the view (elements times element size).
    nbytes: int
    #: The finding kind a reload produced here (``moved``, ``vanished``, ``auto-restored``...) or ``"stable so far"``.
    drift: str
    #: Whether a copy plus rebind can restore the path (``None``: the source did not say).
    restorable: bool | None
    #: Qualified class name of the object whose PWAL runs for the layer.
    owner: str
    #: Qualified name of the PWAL to decorate, ``None`` when there is none (or the layer is unknown).
    pwal: str | None
    #: Not at its path right after PWAL (vanished in a reload, or appeared after the seal).
    lazy: bool
    #: Where the entry comes from: ``walk``, ``seal``, ``after-seal`` or ``finding``.
    evidence: str
    #: Why it is not restorable, when known.
    reason: str | None = None
    #: An earlier undeclared path of the same layer on the same storage (one tensor, or views of one).
    shares_storage_with: str | None = None
    #: Class names of the objects along the path, between the layer and the tensor (empty when unknown).
    via: tuple[str, ...] = ()
    #: The finding's detail, when a finding produced the drift.
    detail: str = ""
    #: Device address of the tensor's data (JSON only: other formats never print addresses).
    data_ptr: int | None = None

    @property
    def where(self) -> str:
        """``layer:path`` (``<model>`` for the root)."""
        return f"{self.layer or '<model>'}:{self.path}"

    @property
    def problem(self) -> bool:
        """Whether the drift left the captured graphs unsafe (anything but stable or auto-restored)."""
        return self.drift not in (STABLE, "auto-restored")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see report_schema.json)."""
        return {
            "layer": self.layer,
            "layer_class": self.layer_class,
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "bytes": self.nbytes,
            "drift": self.drift,
            "restorable": self.restorable,
            "reason": self.reason,
            "owner": self.owner,
            "pwal": self.pwal,
            "lazy": self.lazy,
            "evidence": self.evidence,
            "shares_storage_with": self.shares_storage_with,
            "via": list(self.via),
            "detail": self.detail,
            "data_ptr": self.data_ptr,
        }


@dataclass(frozen=True, slots=True)
class Fix:
    """The code to add for one owner: one ``@graph_visible`` line, or ``register_derived`` calls."""

    #: ``"graph_visible"`` or ``"register_derived"``.
    kind: str
    #: Qualified class name of the owner.
    owner: str
    #: For ``graph_visible``, the function to decorate; for ``register_derived``, where to call it.
    target: str
    paths: tuple[str, ...]
    layers: tuple[str, ...]
    #: The exact lines to add.
    lines: tuple[str, ...]
    note: str = ""

    @property
    def code(self) -> str:
        """The lines to add, joined."""
        return "\n".join(self.lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see report_schema.json)."""
        return {
            "kind": self.kind,
            "owner": self.owner,
            "target": self.target,
            "paths": list(self.paths),
            "layers": list(self.layers),
            "lines": list(self.lines),
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class UnownedEntry:
    """Storage a captured graph read that no layer path reaches (from a capture manifest's ``unowned()``)."""

    description: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    nbytes: int | None = None
    data_ptr: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see report_schema.json)."""
        return {
            "description": self.description,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "device": self.device,
            "bytes": self.nbytes,
            "data_ptr": self.data_ptr,
        }


@dataclass(frozen=True)
class MigrationReport:
    """What is undeclared, how it drifted, and the grouped fixes; ``render(fmt)`` for people and tools."""

    entries: tuple[ReportEntry, ...]
    fixes: tuple[Fix, ...]
    unowned: tuple[UnownedEntry, ...] = ()
    notes: tuple[str, ...] = ()
    #: ``"model"``, ``"contract"`` or ``"outcome"``.
    source: str = "model"
    #: The contract's mode, when the source has one.
    mode: str | None = None
    #: The last reload's status (``committed``, ``needs_recapture``, ``failed``), when one was seen.
    status: str | None = None
    #: Whether the report saw a reload (otherwise every drift is "stable so far" by construction).
    reloaded: bool = False
    #: Entries of problem findings on declared slots are not listed; their count is kept for the summary.
    declared_problems: int = field(default=0)

    @property
    def clean(self) -> bool:
        """Nothing to migrate: no undeclared tensor and no unowned captured storage."""
        return not self.entries and not self.unowned

    @property
    def layers(self) -> tuple[str, ...]:
        """Qualified names of the layers with entries, in model order."""
        return tuple(dict.fromkeys(e.layer for e in self.entries))

    @property
    def nbytes(self) -> int:
        """Bytes of the entries, counting a storage shared by several paths once."""
        return sum(e.nbytes for e in self.entries if e.shares_storage_with is None)

    def by_drift(self) -> dict[str, int]:
        """Entry counts by drift, in order of first appearance."""
        counts: dict[str, int] = {}
        for entry in self.entries:
            counts[entry.drift] = counts.get(entry.drift, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: ``{"schema": "graphsafe.migration-report/1", ...}`` (see report_schema.json)."""
        return {
            "schema": SCHEMA_ID,
            "source": {"kind": self.source, "mode": self.mode, "status": self.status, "reloaded": self.reloaded},
            "summary": {
                "entries": len(self.entries),
                "layers": len(self.layers),
                "bytes": self.nbytes,
                "fixes": len(self.fixes),
                "unowned": len(self.unowned),
                "declared_problems": self.declared_problems,
                "by_drift": self.by_drift(),
            },
            "entries": [e.to_dict() for e in self.entries],
            "fixes": [f.to_dict() for f in self.fixes],
            "unowned": [u.to_dict() for u in self.unowned],
            "notes": list(self.notes),
        }

    def render(self, fmt: str = "text") -> str:
        """The report as ``"text"`` (terminal table), ``"markdown"``, ``"json"``, ``"tree"`` or ``"dot"``.

        Only ``json`` includes device addresses; the others are stable across runs for the same model.
        """
        from graphsafe.report import _render as _report_render

        renderers = {
            "text": _report_render.text,
            "markdown": _report_render.markdown,
            "json": lambda report: json.dumps(report.to_dict(), indent=2) + "\n",
            "tree": _report_render.tree,
            "dot": _report_render.dot,
        }
        renderer = renderers.get(fmt)
        if renderer is None:
            raise ValueError(f"unknown report format {fmt!r}: choose one of {', '.join(FORMATS)}")
        return renderer(self)

    def __str__(self) -> str:
        return self.render("text")


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :meth:`MigrationReport.to_dict`, from ``report_schema.json``."""
    from importlib import resources

    schema: dict[str, Any] = json.loads(
        resources.files("graphsafe.report").joinpath("schema.json").read_text(encoding="utf-8")
    )
    return schema


# ----------------------------------------------------------------------------------------------------------------
# Owners.


@dataclass(frozen=True, slots=True)
class _Owner:
    owner: str
    pwal: str | None
    known: bool = True  # False when the layer object was not available (an outcome without its model)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _pwal_definer(cls: type) -> type | None:
    """The class along ``cls``'s MRO whose body defines PWAL (where a decorator goes), or ``None``."""
    for klass in cls.__mro__:
        if _PWAL in vars(klass):
            return klass
    return None


def _owner_of(layer: nn.Module | None, layer_class: str) -> _Owner:
    if layer is None:
        return _Owner(layer_class, None, known=False)
    quant_method = layer.__dict__.get("quant_method")  # plain attribute; never run a module's __getattr__
    if quant_method is not None and not isinstance(quant_method, nn.Module):
        definer = _pwal_definer(type(quant_method))
        if definer is not None:
            return _Owner(_qualified(type(quant_method)), f"{_qualified(definer)}.{_PWAL}")
    definer = _pwal_definer(type(layer))
    return _Owner(_qualified(type(layer)), f"{_qualified(definer)}.{_PWAL}" if definer is not None else None)


def _via(layer: nn.Module | None, path: str) -> tuple[str, ...]:
    """Class names of the objects between the layer and the tensor (empty when the path does not resolve)."""
    if layer is None:
        return ()
    try:
        chain = SlotPath(path).chain(layer)
    except Exception:  # the path no longer resolves (e.g. it vanished): the tree then shows names only
        return ()
    return tuple(type(obj).__name__ for obj in chain[1:-1])


# ----------------------------------------------------------------------------------------------------------------
# Building entries.


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class _Draft:
    """An entry before owners, aliases and fixes are worked out."""

    layer: str
    layer_class: str
    path: str
    fp: Fingerprint
    drift: str
    restorable: bool | None
    lazy: bool
    evidence: str
    reason: str | None = None
    detail: str = ""


def _strip_addresses(text: str) -> str:
    """Text for people: device addresses change run to run (the JSON ``data_ptr`` fields keep them)."""
    return _ADDRESS.sub("@<address>", text)


def _finding_note(finding: Finding) -> str:
    """A finding that names no slot (a reload error, an exhausted walk, unowned storage) as one line."""
    where = f"{finding.layer or '<model>'} ({finding.layer_class})"
    return _strip_addresses(f"{finding.kind.value} at {where}: {finding.detail}".splitlines()[0])


def _rank(finding: Finding) -> int:
    kind = finding.kind.value
    return _DRIFT_ORDER.index(kind) if kind in _DRIFT_ORDER else len(_DRIFT_ORDER)


def _index_findings(outcome: ReloadOutcome | None) -> tuple[dict[tuple[str, str], Finding], list[str], int]:
    """Undeclared slot findings by ``(layer, path)`` (the most telling one), notes from the rest, and the count of
    declared problems."""
    by_slot: dict[tuple[str, str], Finding] = {}
    notes: list[str] = []
    declared_problems = 0
    if outcome is None:
        return by_slot, notes, 0
    for finding in outcome.findings:
        if finding.declared:
            if finding.kind.is_problem and finding.path:
                declared_problems += 1
            elif finding.kind.is_problem:
                notes.append(_finding_note(finding))
            continue
        if not finding.path:
            notes.append(_finding_note(finding))
            continue
        key = (finding.layer, finding.path)
        current = by_slot.get(key)
        if current is None or _rank(finding) < _rank(current):
            by_slot[key] = finding
    return by_slot, notes, declared_problems


def _draft_from_finding(finding: Finding, *, lazy: bool, evidence: str) -> _Draft | None:
    fp = finding.before or finding.after
    if fp is None:
        return None
    auto = finding.kind.value == "auto-restored"
    return _Draft(
        finding.layer,
        finding.layer_class,
        finding.path,
        fp,
        finding.kind.value,
        True if auto else None,
        lazy or finding.kind.value == "vanished",
        evidence,
        detail=finding.detail,
    )


@dataclass(frozen=True, slots=True)
class _Walk:
    max_depth: int = 8
    max_objects: int = 100_000
    devices: DeviceSet | None = None


def _walk_undeclared(
    model: nn.Module, settings: _Walk, notes: list[str], skip: Collection[tuple[str, str]] = ()
) -> Iterator[tuple[str, nn.Module, TensorRef]]:
    """``(qualname, layer, ref)`` for every walker-found tensor that is neither declared nor an alias of a
    declared slot (a path onto a declared slot's storage is restored with it), nor in ``skip``."""
    from graphsafe.collectors import walk

    for qualname, layer in model.named_modules():
        declared = declarations_of(layer)
        held = [v for v in (d.path.resolve_or(layer, None) for d in declared.values()) if isinstance(v, torch.Tensor)]
        declared_storages = {id(t.untyped_storage()) for t in held}
        result = walk(layer, budget=WalkBudget(settings.max_depth, settings.max_objects), devices=settings.devices)
        name = qualname or "<model>"
        if result.exhausted:
            notes.append(
                _strip_addresses(f"{name}: walk budget exhausted ({result.exhausted}); tensors past it are not listed")
            )
        notes.extend(_strip_addresses(f"{name}: {note}") for note in result.notes)
        for ref in result.refs:
            if ref.path in declared or (qualname, ref.path) in skip:
                continue
            if id(ref.tensor.untyped_storage()) in declared_storages:
                continue
            yield qualname, layer, ref


def _from_model(model: nn.Module, settings: _Walk) -> tuple[list[_Draft], dict[str, nn.Module], list[str]]:
    notes: list[str] = []
    drafts = [
        _Draft(name, type(layer).__name__, ref.path, ref.fingerprint, STABLE, ref.restorable, False, "walk", ref.reason)
        for name, layer, ref in _walk_undeclared(model, settings, notes)
    ]
    return drafts, dict(model.named_modules()), notes


def _live_model(contract: GraphContract) -> nn.Module | None:
    from graphsafe.errors import GraphSafeError

    try:
        return contract.model
    except GraphSafeError:
        return None


def _from_contract(contract: GraphContract) -> tuple[list[_Draft], dict[str, nn.Module], list[str], int]:
    outcome = contract.last_outcome
    by_slot, notes, declared_problems = _index_findings(outcome)
    layers = dict(contract.sealed_layers())
    drafts: list[_Draft] = []
    known: set[tuple[str, str]] = set()
    for slot in contract.slots():
        known.add((slot.layer, slot.path))
        if slot.origin is not Origin.WALKER:
            continue
        finding = by_slot.get((slot.layer, slot.path))
        drift = finding.kind.value if finding is not None else STABLE
        drafts.append(
            _Draft(
                slot.layer,
                slot.layer_class,
                slot.path,
                slot.fingerprint,
                drift,
                slot.restorable,
                drift == "vanished",
                "seal",
                detail=finding.detail if finding is not None else "",
            )
        )
    # Not sealed but found when the reload began (a finding), or now (a walk): allocated after the seal, i.e.
    # not by PWAL (seal() runs right after the load and its PWAL).
    for (layer, path), finding in by_slot.items():
        if (layer, path) not in known:
            draft = _draft_from_finding(finding, lazy=True, evidence="after-seal")
            if draft is not None:
                drafts.append(draft)
    if not contract.sealed:
        notes.append("the contract is not sealed yet: seal() collects the undeclared tensors")
    elif contract.detect == "declared-only":
        notes.append("the contract was sealed with detect='declared-only': undeclared tensors were not collected")
    elif (model := _live_model(contract)) is None:
        notes.append("the contract's model was garbage-collected: only what the seal and the last reload saw is listed")
    else:
        walk_settings = _Walk(contract.budget.max_depth, contract.budget.max_objects, contract.devices)
        layers = dict(model.named_modules())
        for name, module, ref in _walk_undeclared(model, walk_settings, notes, skip=known | by_slot.keys()):
            drafts.append(
                _Draft(
                    name,
                    type(module).__name__,
                    ref.path,
                    ref.fingerprint,
                    STABLE,
                    ref.restorable,
                    True,
                    "after-seal",
                    ref.reason,
                )
            )
    order = {name: index for index, name in enumerate(layers)}
    drafts.sort(key=lambda d: order.get(d.layer, len(order)))  # stable: keeps path order within a layer
    return drafts, layers, notes, declared_problems


def _from_outcome(
    outcome: ReloadOutcome, model: nn.Module | None
) -> tuple[list[_Draft], dict[str, nn.Module], list[str], int]:
    by_slot, notes, declared_problems = _index_findings(outcome)
    drafts = [
        d for d in (_draft_from_finding(f, lazy=False, evidence="finding") for f in by_slot.values()) if d is not None
    ]
    layers: dict[str, nn.Module] = {}
    if model is not None:
        wanted = {d.layer for d in drafts}
        layers = {name: module for name, module in model.named_modules() if name in wanted}
    elif drafts:
        notes.append(
            "owners are layer classes: a reload outcome does not say which quant method ran PWAL "
            "(pass model= for exact owners)"
        )
    return drafts, layers, notes, declared_problems


def _unowned(contract: GraphContract, drafts: Iterable[_Draft]) -> list[UnownedEntry]:
    """Unowned captured storage from the contract's capture manifest, if it has one (duck-typed), minus storage
    an entry already names (the manifest indexes paths at capture; a tensor first walked later is not unowned)."""
    manifest = getattr(contract, "manifest", None)
    unowned = getattr(manifest, "unowned", None)
    if not callable(unowned):
        return []
    named = {(d.fp.storage_ptr, str(d.fp.device)) for d in drafts}
    entries = [_unowned_entry(index, item) for index, item in enumerate(unowned())]
    return [e for e in entries if (e.data_ptr, e.device) not in named]


def _unowned_entry(index: int, item: Any) -> UnownedEntry:
    """One unowned storage: a tensor, a fingerprint, or a record with ``first_view``/``fingerprint`` and
    optionally ``capture``, ``op``, ``lo``/``hi``, ``written``, ``nbytes``, ``data_ptr``, ``device``."""
    if isinstance(item, torch.Tensor):
        return UnownedEntry(
            f"captured storage #{index}",
            tuple(item.shape),
            _dtype_name(item.dtype),
            str(item.device),
            item.untyped_storage().nbytes(),
            item.data_ptr(),
        )
    fp = (
        item
        if isinstance(item, Fingerprint)
        else next(
            (v for v in (getattr(item, n, None) for n in ("first_view", "fingerprint")) if isinstance(v, Fingerprint)),
            None,
        )
    )

    def number(name: str) -> int | None:
        value = getattr(item, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    capture, op = getattr(item, "capture", None), getattr(item, "op", None)
    lo, hi, nbytes = number("lo"), number("hi"), number("nbytes")
    if isinstance(capture, str):
        access = "read/written" if getattr(item, "written", False) else "read"
        span = f"bytes [{lo}, {hi}) of " if lo is not None and hi is not None else ""
        size = f"a {nbytes}-byte storage" if nbytes is not None else "a storage"
        first = f" (first by {op})" if isinstance(op, str) else ""
        description = f"capture {capture!r} {access} {span}{size} no layer path holds{first}"
    else:
        description = f"captured storage #{index}, held by no layer path"
    device = getattr(item, "device", None)
    return UnownedEntry(
        _strip_addresses(description),
        fp.shape if fp is not None else None,
        _dtype_name(fp.dtype) if fp is not None else None,
        str(device) if device is not None else (str(fp.device) if fp is not None else None),
        nbytes if nbytes is not None else (fp.storage_nbytes if fp is not None else None),
        number("data_ptr") if number("data_ptr") is not None else (fp.storage_ptr if fp is not None else None),
    )


# ----------------------------------------------------------------------------------------------------------------
# Entries and fixes.


def _same_storage(a: Fingerprint, b: Fingerprint) -> bool:
    if a.same_storage(b):
        return True
    # Freed storages: fall back to the recorded address (both sealed at once, so equal pointers were one storage).
    return not a.alive and not b.alive and a.storage_ptr == b.storage_ptr != 0 and a.device == b.device


def _finish(drafts: list[_Draft], layers: Mapping[str, nn.Module]) -> tuple[tuple[ReportEntry, ...], list[bool]]:
    """Entries, and for each whether its owner is known (the layer object was available)."""
    entries: list[ReportEntry] = []
    known: list[bool] = []
    seen: set[tuple[str, str]] = set()
    firsts: dict[str, list[tuple[str, Fingerprint]]] = {}
    for draft in drafts:
        key = (draft.layer, draft.path)
        if key in seen:  # one entry per path, even if a source lists it twice
            continue
        seen.add(key)
        layer = layers.get(draft.layer)
        owner = _owner_of(layer, draft.layer_class)
        shared = next((p for p, fp in firsts.get(draft.layer, ()) if _same_storage(fp, draft.fp)), None)
        firsts.setdefault(draft.layer, []).append((draft.path, draft.fp))
        known.append(owner.known)
        entries.append(
            ReportEntry(
                layer=draft.layer,
                layer_class=draft.layer_class,
                path=draft.path,
                shape=draft.fp.shape,
                dtype=_dtype_name(draft.fp.dtype),
                device=str(draft.fp.device),
                nbytes=draft.fp.nbytes,
                drift=draft.drift,
                restorable=draft.restorable,
                owner=owner.owner,
                pwal=owner.pwal,
                lazy=draft.lazy,
                evidence=draft.evidence,
                reason=draft.reason,
                shares_storage_with=shared,
                via=_via(layer, draft.path),
                detail=_strip_addresses(draft.detail),
                data_ptr=draft.fp.data_ptr,
            )
        )
    return tuple(entries), known


def _quote(path: str) -> str:
    return json.dumps(path)  # a double-quoted string literal, valid Python for every slot path


def _register_lines(paths: Iterable[str], static: Collection[str] = ()) -> tuple[str, ...]:
    return tuple(f"register_derived(layer, {_quote(p)}{', static=True' if p in static else ''})" for p in paths)


def _stable_empty_call(entry: ReportEntry) -> str:
    shape = "(" + ", ".join(str(n) for n in entry.shape) + ("," if len(entry.shape) == 1 else "") + ")"
    return f"stable_empty(layer, {_quote(entry.path)}, {shape}, torch.{entry.dtype}, {_quote(entry.device)})"


def _lazy_note(members: Sequence[ReportEntry]) -> str:
    vanished = list({e.path: e for e in members if e.drift == "vanished"}.values())
    if not vanished:
        return (
            "scratch whose contents are not derived from the weights can instead be allocated with stable_empty(layer, "
            "path, shape, dtype, device), which hands back the same storage every time"
        )
    calls = "; ".join(_stable_empty_call(e) for e in vanished)
    names = ", ".join(e.path for e in vanished)
    return (
        f"{names} vanished during the reload (something dropped it; the graph still reads the old storage), so "
        f"declaring is not enough: keep the storage, by not resetting it in PWAL or by allocating it with {calls}, "
        "which hands back the same storage every time"
    )


def _decorator(paths: Sequence[str], static: bool) -> str:
    return "@graph_visible(" + ", ".join(_quote(p) for p in paths) + (", static=True" if static else "") + ")"


_STATIC_NOTE = (
    "static=True: {paths} kept {their} storage and was not written in the reload, so {it} does not follow the "
    "weights (declared without it, graphsafe would flag it stale); if PWAL does rebuild {it} in place, drop "
    "static=True so graphsafe checks that"
)


def _fixes(entries: Sequence[ReportEntry], known: Sequence[bool], reloaded: bool) -> tuple[Fix, ...]:
    """Group entries by the code to edit, in order of first appearance."""
    groups: dict[tuple[str, str], list[ReportEntry]] = {}
    for entry, owner_known in zip(entries, known, strict=True):
        if entry.lazy:
            key = ("lazy", entry.owner)
        elif entry.pwal is None and owner_known:
            key = ("no-pwal", entry.owner)
        else:
            key = ("pwal", entry.pwal or entry.owner)
        groups.setdefault(key, []).append(entry)
    fixes: list[Fix] = []
    for (kind, target), members in groups.items():
        owner = members[0].owner
        layers = tuple(dict.fromkeys(e.layer for e in members))
        paths = tuple(dict.fromkeys(e.path for e in members))
        # A tensor a reload neither replaced nor wrote does not follow the weights: it is declared static, else
        # the contract's freshness check would call it stale. Without a reload nothing is known: not static.
        static = {p for p in paths if reloaded and all(e.drift == STABLE for e in members if e.path == p)}
        if kind == "lazy":
            fixes.append(
                Fix(
                    "register_derived",
                    owner,
                    f"{owner}: right after the code that assigns each path (it is not "
                    "there when PWAL returns, e.g. the first forward allocates it)",
                    paths,
                    layers,
                    _register_lines(paths, static),
                    _lazy_note(members),
                )
            )
            continue
        if kind == "no-pwal":
            fixes.append(
                Fix(
                    "register_derived",
                    owner,
                    f"{owner}: where it assigns each path ({owner} has no {_PWAL})",
                    paths,
                    layers,
                    _register_lines(paths, static),
                )
            )
            continue
        # One decorator covers every layer the PWAL runs for, but only paths every such layer has (a declared
        # path that does not resolve raises); the rest are declared per layer.
        per_layer = {name: {e.path for e in members if e.layer == name} for name in layers}
        common = tuple(p for p in paths if all(p in have for have in per_layer.values()))
        partial = tuple(p for p in paths if p not in common)
        where = (
            target
            if members[0].pwal is not None
            else (f"the {_PWAL} that runs for {owner} (its quant_method's, if it has one)")
        )
        if common:
            derived = [p for p in common if p not in static]
            frozen = [p for p in common if p in static]
            lines = tuple(_decorator(group, group is frozen) for group in (derived, frozen) if group)
            note = ""
            if frozen:
                many = len(frozen) > 1
                note = _STATIC_NOTE.format(
                    paths=", ".join(frozen), their="their" if many else "its", it="they" if many else "it"
                )
            fixes.append(Fix("graph_visible", owner, where, common, layers, lines, note))
        if partial:
            some = tuple(n for n in layers if per_layer[n] & set(partial))
            fixes.append(
                Fix(
                    "register_derived",
                    owner,
                    f"{where}, after it assigns each path",
                    partial,
                    some,
                    _register_lines(partial, static),
                    "only some of its layers have these paths, so a decorator "
                    "(which requires every path on every layer) cannot declare them",
                )
            )
    return tuple(fixes)


def migration_report(
    source: nn.Module | GraphContract | ReloadOutcome,
    *,
    model: nn.Module | None = None,
    max_depth: int = 8,
    max_objects: int = 100_000,
    devices: Collection[torch.device | str] | None = None,
) -> MigrationReport:
    """The migration report of a model, a sealed contract or a reload outcome.

    Args:
        source: an ``nn.Module`` (walked now: every drift is ``"stable so far"``), a
            :class:`~graphsafe.GraphContract` (its walker-found slots, what its last reload found, and what a
            walk finds now that the seal did not know, plus unowned captured storage when its ``manifest`` has
            ``unowned()``) or a :class:`~graphsafe.ReloadOutcome` (its findings on undeclared slots).

    An entry is lazy (it gets ``register_derived``, not a decorator) when it is not at its path right after PWAL:
    it vanished in a reload, or it appeared after the seal (seal right after the load, before warm-up).
        model: with an outcome source, the model it came from, so owners can be resolved exactly.
        max_depth, max_objects, devices: walk budgets and device filter for a model source.
    """
    from graphsafe.outcome import ReloadOutcome

    notes: list[str]
    unowned: list[UnownedEntry] = []
    declared_problems = 0
    mode: str | None = None
    status: str | None = None
    if isinstance(source, nn.Module):
        drafts, layers, notes = _from_model(
            source, _Walk(max_depth, max_objects, DeviceSet(devices) if devices is not None else None)
        )
        kind = "model"
        notes.insert(0, "no reload observed: drift is unknown until one (report a contract after a reload)")
        outcome = None
    elif isinstance(source, GraphContract):
        drafts, layers, notes, declared_problems = _from_contract(source)
        unowned = _unowned(source, drafts)
        kind, mode, outcome = "contract", source.mode, source.last_outcome
    elif isinstance(source, ReloadOutcome):
        drafts, layers, notes, declared_problems = _from_outcome(source, model)
        kind, mode, outcome = "outcome", source.mode, source
    else:
        raise TypeError(
            f"migration_report needs an nn.Module, a GraphContract or a ReloadOutcome, got {type(source).__name__}"
        )
    if outcome is not None:
        status = outcome.status.value
    entries, known = _finish(drafts, layers)
    return MigrationReport(
        entries=entries,
        fixes=_fixes(entries, known, outcome is not None),
        unowned=tuple(unowned),
        notes=tuple(dict.fromkeys(notes)),
        source=kind,
        mode=mode,
        status=status,
        reloaded=outcome is not None,
        declared_problems=declared_problems,
    )
