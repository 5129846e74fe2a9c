"""The report's values: what is undeclared (:class:`ReportEntry`), what restores with a tracked slot
(:class:`AliasEntry`), what no layer holds (:class:`UnownedEntry`), the code to add (:class:`Fix`), and the
report that holds them all (:class:`MigrationReport`).

Every value is frozen and renders itself to the JSON document described by ``schema.json``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final, Literal

from graphsafe.outcome import FindingKind, SlotNamed, SlotRef, Status
from graphsafe.report._fix_kind import FixKind, Placement
from graphsafe.report._render import render
from graphsafe.report._schema import SCHEMA_ID

__all__ = [
    "STABLE",
    "AliasEntry",
    "Choice",
    "DeclaredProblem",
    "Evidence",
    "Fix",
    "MigrationReport",
    "ReportEntry",
    "SourceKind",
    "Undecided",
    "UnownedEntry",
]

#: Drift of an entry no reload was seen to move.
STABLE: Final = "stable so far"

#: Where an entry comes from: a walk now, the seal, a walk or a reload after the seal, or an outcome's finding.
Evidence = Literal["walk", "seal", "after-seal", "finding"]
#: What a report was built from.
SourceKind = Literal["model", "contract", "outcome"]


def _json_fields(record: object, keys: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object of one of this module's records: its attributes under ``keys``, in that order (``bytes``
    is read from ``nbytes``), tuples as lists."""
    document: dict[str, Any] = {}
    for key in keys:
        value = getattr(record, "nbytes" if key == "bytes" else key)
        if isinstance(value, enum.Enum):
            value = value.value
        document[key] = list(value) if isinstance(value, tuple) else value
    return document


#: The keys of an entry's JSON object, in the order of ``schema.json``.
_ENTRY_KEYS: Final = (
    "layer",
    "layer_class",
    "path",
    "shape",
    "dtype",
    "device",
    "bytes",
    "drift",
    "restorable",
    "reason",
    "owner",
    "pwal",
    "lazy",
    "evidence",
    "shares_storage_with",
    "via",
    "detail",
    "data_ptr",
)


@dataclass(frozen=True, slots=True)
class ReportEntry(SlotNamed):
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
    #: The finding kind a reload produced here (the most telling one), ``None`` when none did.
    drift_kind: FindingKind | None
    #: Whether a copy plus rebind can restore the path (``None``: the source did not say).
    restorable: bool | None
    #: Qualified class name of the object whose PWAL runs for the layer.
    owner: str
    #: Qualified name of the PWAL to decorate, ``None`` when there is none (or the layer is unknown).
    pwal: str | None
    #: Not at its path right after PWAL (vanished in a reload, or appeared after the seal).
    lazy: bool
    #: Where the entry comes from.
    evidence: Evidence
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
    #: Whether PWAL wrote it (made it, or wrote it in place) while the contract recorded what PWAL does; ``None``
    #: when no recording says. What decides ``static=True`` in the fixes (never the absence of a finding).
    written: bool | None = None
    #: Whether a recorded capture wrote its storage (the graph overwrites it: scratch); JSON leaves it out.
    graph_writes: bool = False
    #: How the owner's code names the layer in a fix's lines (:attr:`Owner.receiver`); JSON leaves it out.
    receiver: str = "layer"

    @property
    def drift(self) -> str:
        """The drift as the JSON document spells it: the finding kind's value, or ``"stable so far"``."""
        return STABLE if self.drift_kind is None else self.drift_kind.value

    @property
    def problem(self) -> bool:
        """Whether the drift left the captured graphs unsafe (anything but stable or auto-restored)."""
        return self.drift_kind is not None and self.drift_kind.is_problem

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, _ENTRY_KEYS)


@dataclass(frozen=True, slots=True)
class AliasEntry(SlotNamed):
    """An undeclared path onto the storage of a tracked slot of the same layer (a declared slot, a parameter or a
    buffer): restored with that slot, so there is nothing to declare. ``self.w_t = self.weight.data.t()`` is an
    alias of ``weight``."""

    layer: str
    layer_class: str
    path: str
    #: The path of the tracked slot whose storage it shares.
    alias_of: str

    @property
    def target(self) -> SlotRef:
        """The tracked slot it is restored with."""
        return SlotRef(self.layer, self.alias_of)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, ("layer", "layer_class", "path", "alias_of"))


@dataclass(frozen=True, slots=True)
class Fix:
    """The code to add for one owner: one ``@graph_visible`` line, or ``register_derived`` calls."""

    kind: FixKind
    #: Qualified class name of the owner.
    owner: str
    #: For ``graph_visible``, the function to decorate; for ``register_derived``, where to call it.
    target: str
    paths: tuple[str, ...]
    layers: tuple[str, ...]
    #: The exact lines to add.
    lines: tuple[str, ...]
    note: str = ""
    #: Where the lines go (what ``graphsafe fix`` reads; the JSON document leaves it out).
    placement: Placement = Placement.AFTER_ASSIGNMENT
    #: Qualified name of the function the lines go on or in (the PWAL), ``None`` when the owner class is the place.
    function: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, ("kind", "owner", "target", "paths", "layers", "lines", "note"))

    @property
    def code(self) -> str:
        """The lines to add, joined."""
        return "\n".join(self.lines)


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
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, ("description", "shape", "dtype", "device", "bytes", "data_ptr"))


@dataclass(frozen=True, slots=True)
class UntrackableEntry:
    """A place where device tensors sit that no slot path can name (a dict under an object key, a weak reference's
    referent, an lru_cache's results...): a finding, not a note. Nothing can check that a graph still reads their
    memory, so no reload of the layer commits until the code changes."""

    #: ``layer (Class)``.
    where: str
    #: The place and what is there, as the walker or the reload found it.
    detail: str
    #: The concrete change that makes the tensors nameable (and the line that declares them).
    fix: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, ("where", "detail", "fix"))


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the ways to declare an :class:`Undecided` group: when it applies, where, and the exact lines."""

    #: When this choice is the right one (what the author knows about the tensor and the report does not).
    when: str
    #: Where the lines go.
    target: str
    lines: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, ("when", "target", "lines"))


@dataclass(frozen=True, slots=True)
class Undecided:
    """Undeclared tensors whose declaration depends on what the report cannot know from what it saw (whether a
    lazily created tensor's contents derive from the weights, without a capture to tell): not a fix, but the
    choices, each with its lines. Declaring one the wrong way fails strict mode, so the report does not guess."""

    owner: str
    paths: tuple[str, ...]
    layers: tuple[str, ...]
    #: What the report saw and why that does not decide it; how to let graphsafe decide.
    reason: str
    choices: tuple[Choice, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        document = _json_fields(self, ("owner", "paths", "layers", "reason"))
        document["choices"] = [choice.to_dict() for choice in self.choices]
        return document


@dataclass(frozen=True, slots=True)
class DeclaredProblem:
    """A problem the last reload had on a declared slot (the author declared it; the declaration or the code around
    it is wrong): listed so a report that has nothing left to migrate still says what failed and what to do."""

    layer: str
    layer_class: str
    path: str
    #: The finding kind's value (``stale``, ``moved``, ...).
    drift: str
    #: The finding, as the contract wrote it, with what to do (device addresses removed).
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly rendering (see ``schema.json``)."""
        return _json_fields(self, ("layer", "layer_class", "path", "drift", "detail"))


@dataclass(frozen=True)
class MigrationReport:
    """What is undeclared, how it drifted, and the grouped fixes; ``render(fmt)`` for people and tools."""

    entries: tuple[ReportEntry, ...]
    fixes: tuple[Fix, ...]
    unowned: tuple[UnownedEntry, ...] = ()
    notes: tuple[str, ...] = ()
    source: SourceKind = "model"
    #: The contract's mode, when the source has one.
    mode: str | None = None
    #: The last reload's status, when one was seen.
    status: Status | None = None
    #: Whether the report saw a reload (otherwise every drift is "stable so far" by construction).
    reloaded: bool = False
    #: Problem findings on declared slots are no entries (nothing to declare): listed in :attr:`declared`, counted here.
    declared_problems: int = 0
    #: Undeclared paths restored with the tracked slot they alias: nothing to declare, listed so an author sees
    #: why a path the walker reaches is not an entry.
    aliases: tuple[AliasEntry, ...] = ()
    #: Places with device tensors no slot path can name: each one keeps every reload of its layer from committing.
    untrackable: tuple[UntrackableEntry, ...] = ()
    #: Undeclared tensors the report cannot write one fix for without more evidence: the choices, each with its lines.
    undecided: tuple[Undecided, ...] = ()
    #: The last reload's problems on declared slots (counted in :attr:`declared_problems`).
    declared: tuple[DeclaredProblem, ...] = ()

    @property
    def clean(self) -> bool:
        """Nothing to migrate: no undeclared tensor, no unowned captured storage and no untrackable place (aliases
        need no work)."""
        return not self.entries and not self.unowned and not self.untrackable

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
        """The JSON document: ``{"schema": "graphsafe.migration-report/1", ...}`` (see ``schema.json``)."""
        return {
            "schema": SCHEMA_ID,
            "source": {
                "kind": self.source,
                "mode": self.mode,
                "status": self.status.value if self.status is not None else None,
                "reloaded": self.reloaded,
            },
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
            "aliases": [a.to_dict() for a in self.aliases],
            "untrackable": [u.to_dict() for u in self.untrackable],
            "undecided": [u.to_dict() for u in self.undecided],
            "declared_problems": [d.to_dict() for d in self.declared],
            "notes": list(self.notes),
        }

    def render(self, fmt: str = "text") -> str:
        """The report as ``"text"`` (terminal table), ``"markdown"``, ``"json"``, ``"tree"`` or ``"dot"``.

        Only ``json`` includes device addresses; the others are stable across runs for the same model.
        """
        return render(self, fmt)

    def __str__(self) -> str:
        return self.render("text")
