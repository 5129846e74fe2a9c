"""The code an author should write: entries grouped by the code to edit, one :class:`Fix` per group.

* one ``@graph_visible(...)`` line per PWAL for the paths every layer it runs for has (a second line with
  ``static=True`` for tensors a reload left alone), and ``register_derived`` calls for the paths only some have;
* ``register_derived`` right after the assignment for lazy tensors (not there when PWAL returns), with a
  ``stable_empty`` call when the tensor vanished;
* ``register_derived`` where the owner assigns the tensor when nobody defines a PWAL;
* no fix but the choices (:class:`~graphsafe.report.Undecided`) for a lazy tensor a reload left as it was, which no
  capture was seen writing: whether it derives from the weights decides the code, and nothing seen tells.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Sequence
from typing import Final, Literal

from graphsafe.collectors import UNTRACKABLE_ADVICE
from graphsafe.outcome import FindingKind
from graphsafe.report._drafts import Drafted
from graphsafe.report._entries import Choice, Fix, ReportEntry, Undecided, UntrackableEntry
from graphsafe.report._fix_kind import FixKind, Placement
from graphsafe.report._owners import PWAL

__all__ = ["fixes", "split_untrackable"]

_STATIC_NOTE: Final = (
    "static=True: PWAL was not seen writing {paths}, so {it} {does} not follow the weights (declared without it, "
    "graphsafe would flag {them} stale); if PWAL does rebuild {them} in place, drop static=True so graphsafe "
    "checks that"
)


def _static_note(frozen: Sequence[str]) -> str:
    many = len(frozen) > 1
    return _STATIC_NOTE.format(
        paths=", ".join(frozen),
        it="they" if many else "it",
        does="do" if many else "does",
        them="them" if many else "it",
    )


_Group = Literal["lazy", "no-pwal", "pwal"]


def _quote(path: str) -> str:
    return json.dumps(path)  # a double-quoted string literal, valid Python for every slot path


def _register_lines(paths: Iterable[str], static: Collection[str] = (), receiver: str = "layer") -> tuple[str, ...]:
    return tuple(f"register_derived({receiver}, {_quote(p)}{', static=True' if p in static else ''})" for p in paths)


def _decorator(paths: Sequence[str], static: bool) -> str:
    return "@graph_visible(" + ", ".join(_quote(p) for p in paths) + (", static=True" if static else "") + ")"


def _stable_empty_call(entry: ReportEntry) -> str:
    shape = "(" + ", ".join(str(n) for n in entry.shape) + ("," if len(entry.shape) == 1 else "") + ")"
    return f"stable_empty({entry.receiver}, {_quote(entry.path)}, {shape}, torch.{entry.dtype}, {_quote(entry.device)})"


_ATTRIBUTES: Final = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _keep_vanished(members: Sequence[ReportEntry]) -> tuple[list[Fix], list[ReportEntry]]:
    """Lazy tensors PWAL drops (they vanished in the reload) whose path is a plain attribute chain and whose PWAL is
    known: one fix that re-binds each to its stable storage at the end of that PWAL (``stable_empty`` declares it
    static and hands back the same storage every time), so the path holds what the graph reads when PWAL returns.
    Declaring alone is not enough there. Returns those fixes and the members left to the usual lazy fix."""
    vanished: dict[str, list[ReportEntry]] = {}
    rest: list[ReportEntry] = []
    for entry in members:
        # Only scratch a capture was seen writing: a static storage nothing fills would leave a lazily computed,
        # weight-derived tensor (``if self._w_t is None: compute``) uninitialised, as the forward finds it there.
        plain = (
            entry.drift_kind is FindingKind.VANISHED
            and entry.pwal is not None
            and entry.graph_writes
            and _ATTRIBUTES.fullmatch(entry.path)
        )
        if plain:
            vanished.setdefault(str(entry.pwal), []).append(entry)
        else:
            rest.append(entry)
    kept: list[Fix] = []
    for pwal, entries in vanished.items():
        by_path = list({e.path: e for e in entries}.values())
        names = ", ".join(e.path for e in by_path)
        kept.append(
            Fix(
                FixKind.REGISTER_DERIVED,
                entries[0].owner,
                f"{pwal}, at its end (it drops {names}, which the graph still reads)",
                tuple(e.path for e in by_path),
                tuple(dict.fromkeys(e.layer for e in entries)),
                tuple(f"{e.receiver}.{e.path} = {_stable_empty_call(e)}" for e in by_path),
                "the same storage, declared static, is at the path again when PWAL returns; the code that allocates "
                "it lazily then finds it there (or, simpler, stop resetting it in PWAL and declare it where it is "
                "allocated)",
                Placement.FUNCTION_END,
                pwal,
            )
        )
    return kept, rest


def _lazy_note(members: Sequence[ReportEntry]) -> str:
    vanished = list({e.path: e for e in members if e.drift_kind is FindingKind.VANISHED}.values())
    if not vanished:
        return (
            "scratch whose contents are not derived from the weights can instead be allocated with stable_empty(layer, "
            "path, shape, dtype, device), which hands back the same storage every time"
        )
    calls = "; ".join(_stable_empty_call(e) for e in vanished)
    names = ", ".join(e.path for e in vanished)
    if not all(e.graph_writes for e in vanished):
        return (
            f"{names} vanished during the reload (something dropped it; the graph still reads the old storage) and "
            "no capture was seen writing it, so it may be computed from the weights: compute it in PWAL at every "
            "load instead of dropping it (then declare it there), so a reload refreshes it at its captured address; "
            f"only if it is scratch whose contents do not derive from the weights, allocate it with {calls}, which "
            "hands back the same storage every time"
        )
    return (
        f"{names} vanished during the reload (something dropped it; the graph still reads the old storage), so "
        f"declaring is not enough: keep the storage, by not resetting it in PWAL or by allocating it with {calls}, "
        "which hands back the same storage every time"
    )


#: Drift that means PWAL put a new tensor at the path (it follows the weights), and drift that means it did not
#: touch the tensor (the contract's freshness check: "neither rebuilt it nor wrote it").
_REBUILT: Final = frozenset(
    {FindingKind.MOVED, FindingKind.RESPECIFIED, FindingKind.DEAD, FindingKind.ALIAS_BROKEN, FindingKind.AUTO_RESTORED}
)
_UNTOUCHED: Final = frozenset({FindingKind.STALE})


def _pwal_wrote(entry: ReportEntry) -> bool | None:
    """Whether PWAL wrote the tensor, from what the reload saw it do; ``None`` when nothing says."""
    if entry.written is not None:
        return entry.written
    if entry.drift_kind in _REBUILT:
        return True
    if entry.drift_kind in _UNTOUCHED:
        return False
    return None


def _static_paths(members: Sequence[ReportEntry], reloaded: bool) -> set[str]:
    """Paths PWAL was seen not to write: their contents do not follow the weights, so they are declared static
    (else the contract's freshness check would call them stale). Decided from what PWAL did (the recording of what
    it made and wrote, or a finding that says it left the tensor alone), never from the absence of a finding: a
    tensor PWAL writes in place keeps its address and has no finding, yet follows the weights. A lazy tensor (not
    there when PWAL returns) is static unless PWAL was seen writing it. Without a reload nothing is known."""
    if not reloaded:
        return set()
    wrote: dict[str, list[bool | None]] = {}
    for entry in members:
        wrote.setdefault(entry.path, []).append(_pwal_wrote(entry))
    lazy = {e.path for e in members if e.lazy}
    # Found stale: its inputs changed and nothing wrote it, so as far as anything knows its values follow the
    # weights (a PWAL "already processed" guard looks just like a fixed table). static=True would commit them stale.
    stale = _stale_paths(members)
    return {
        path
        for path, seen in wrote.items()
        if path not in stale and not any(w is True for w in seen) and (all(w is False for w in seen) or path in lazy)
    }


def _stale_paths(members: Sequence[ReportEntry]) -> list[str]:
    """Paths found stale, unless a capture wrote them (scratch the graph overwrites: its contents are its own)."""
    stale = {e.path for e in members if e.drift_kind in _UNTOUCHED}
    scratch = {e.path for e in members if e.graph_writes} - {e.path for e in members if not e.graph_writes}
    return [p for p in dict.fromkeys(e.path for e in members) if p in stale and p not in scratch]


def _stale_note(stale: Sequence[str]) -> str:
    names = ", ".join(stale)
    return (
        f"{names} went stale in the reload (its inputs changed, PWAL neither rebuilt nor wrote it): make PWAL rebuild "
        'it at every load (an "already processed" guard skips it); only if its contents do not derive from the '
        "weights (a fixed table), declare it static=True, or record the initial load with contract.record_inputs() "
        "so the report can tell"
    )


def _pwal_fixes(
    members: Sequence[ReportEntry], static: set[str], not_on_every_layer: Collection[tuple[str, str]]
) -> list[Fix]:
    """One decorator covers every layer the PWAL runs for, but only for the paths every such layer has (a declared
    path that does not resolve raises), those without an entry included; the rest get ``register_derived`` in that
    PWAL."""
    owner = members[0].owner
    layers = tuple(dict.fromkeys(e.layer for e in members))
    layers_with: dict[str, set[str]] = {}
    for entry in members:
        layers_with.setdefault(entry.path, set()).add(entry.layer)
    everywhere = {p for p in layers_with if (members[0].pwal, p) not in not_on_every_layer}
    common = tuple(p for p, have in layers_with.items() if len(have) == len(layers) and p in everywhere)
    partial = tuple(p for p in layers_with if p not in common)
    pwal = members[0].pwal
    where = pwal if pwal is not None else f"the {PWAL} that runs for {owner} (its quant_method's, if it has one)"
    fixes: list[Fix] = []
    if common:
        derived = [p for p in common if p not in static]
        frozen = [p for p in common if p in static]
        lines = tuple(_decorator(group, group is frozen) for group in (derived, frozen) if group)
        stale = [p for p in _stale_paths(members) if p in common]
        note = "; ".join(n for n in (_static_note(frozen) if frozen else "", _stale_note(stale) if stale else "") if n)
        fixes.append(Fix(FixKind.GRAPH_VISIBLE, owner, where, common, layers, lines, note, Placement.DECORATOR, pwal))
    if partial:
        having = set().union(*(layers_with[p] for p in partial))
        fixes.append(
            Fix(
                FixKind.REGISTER_DERIVED,
                owner,
                f"{where}, after it assigns each path",
                partial,
                tuple(n for n in layers if n in having),
                _register_lines(partial, static, members[0].receiver),
                "only some of its layers have these paths, so a decorator "
                "(which requires every path on every layer) cannot declare them",
                Placement.AFTER_ASSIGNMENT,
                pwal,
            )
        )
    return fixes


def _undecided(members: Sequence[ReportEntry], paths: Sequence[str]) -> Undecided:
    """Lazy tensors a reload with new weights left as they were, which no capture was seen writing: scratch (or a
    fixed table) wants ``static=True``, a tensor computed from the weights wants computing in PWAL at every load;
    what the report saw tells the two apart only with a capture (the graph writes scratch)."""
    owner, receiver = members[0].owner, members[0].receiver
    layers = tuple(dict.fromkeys(e.layer for e in members if e.path in paths))
    names = ", ".join(paths)
    one = len(paths) == 1
    pwal = members[0].pwal or f"the {PWAL} that runs for {owner} (its quant_method's, if it has one)"
    reason = (
        f"{names} {'is' if one else 'are'} created lazily (not there when PWAL returns) and a reload with new "
        f"weights left {'it' if one else 'them'} as {'it was' if one else 'they were'}; without a capture graphsafe "
        f"cannot tell whether {'its' if one else 'their'} contents derive from the weights (declared the wrong way, "
        "strict mode fails the reload). Run `graphsafe report --capture` (or assert_reload_stable with an "
        "example_input) to let graphsafe tell, or choose"
    )
    return Undecided(
        owner,
        tuple(paths),
        layers,
        reason,
        (
            Choice(
                "its contents do not derive from the weights (scratch, a fixed table)",
                f"{owner}: right after the code that creates each path",
                _register_lines(paths, paths, receiver),
            ),
            Choice(
                "its contents derive from the weights",
                f"{pwal}: compute each path there at every load, instead of lazily on a forward, then declare it",
                _register_lines(paths, (), receiver),
            ),
        ),
    )


def fixes(drafted: Drafted, reloaded: bool) -> tuple[tuple[Fix, ...], tuple[Undecided, ...]]:
    """Group the entries by the code to edit, in order of first appearance, and write each group's fix; where what
    the report saw does not decide the code, the choices instead (:class:`Undecided`)."""
    undecided: list[Undecided] = []
    groups: dict[tuple[_Group, str], list[ReportEntry]] = {}
    for entry, owner_known in zip(drafted.entries, drafted.owner_known, strict=True):
        if entry.lazy:
            key: tuple[_Group, str] = ("lazy", entry.owner)
        elif entry.pwal is None and owner_known:
            key = ("no-pwal", entry.owner)
        else:
            key = ("pwal", entry.pwal or entry.owner)
        groups.setdefault(key, []).append(entry)
    result: list[Fix] = []
    for (group, _), members in groups.items():
        owner = members[0].owner
        layers = tuple(dict.fromkeys(e.layer for e in members))
        paths = tuple(dict.fromkeys(e.path for e in members))
        static = _static_paths(members, reloaded)
        if group == "lazy":
            kept, members = _keep_vanished(members)
            result += kept
            unknown = _stale_paths(members)  # left as it was, and no capture wrote it: scratch or weight-derived?
            if unknown:
                undecided.append(_undecided(members, unknown))
                members = [e for e in members if e.path not in unknown]
            if not members:
                continue
            layers = tuple(dict.fromkeys(e.layer for e in members))
            paths = tuple(dict.fromkeys(e.path for e in members))
            target = (
                f"{owner}: right after the code that assigns each path (it is not "
                "there when PWAL returns, e.g. the first forward allocates it)"
            )
            lines = _register_lines(paths, static, members[0].receiver)
            result.append(Fix(FixKind.REGISTER_DERIVED, owner, target, paths, layers, lines, _lazy_note(members)))
        elif group == "no-pwal":
            target = f"{owner}: where it assigns each path ({owner} has no {PWAL})"
            lines = _register_lines(paths, static, members[0].receiver)
            result.append(Fix(FixKind.REGISTER_DERIVED, owner, target, paths, layers, lines))
        else:
            result += _pwal_fixes(members, static, drafted.not_on_every_layer)
    return tuple(result), tuple(undecided)


#: How the walker and the reload's finding spell an untrackable place: ``untrackable at LAYER (Class): DETAIL``.
_UNTRACKABLE: Final = re.compile(r"untrackable at (?P<where>.+? \([^)]*\)): (?P<detail>.+)")
#: A dict whose keys no slot path can spell (the walker says "the value under a ... dict key").
_DICT_KEY: Final = re.compile(r"^(?P<place>[^:]+): the value under an? [^:]*dict key")


def split_untrackable(notes: Iterable[str]) -> tuple[list[UntrackableEntry], list[str]]:
    """The untrackable places among a report's notes, as findings with a concrete fix; the other notes."""
    found: dict[tuple[str, str], UntrackableEntry] = {}
    rest: list[str] = []
    for note in notes:
        match = _UNTRACKABLE.fullmatch(note)
        if match is None:
            rest.append(note)
            continue
        detail = match["detail"].removesuffix(UNTRACKABLE_ADVICE).rstrip("; ")
        found.setdefault((match["where"], detail), UntrackableEntry(match["where"], detail, _untrackable_fix(detail)))
    return list(found.values()), rest


def _untrackable_fix(detail: str) -> str:
    keyed = _DICT_KEY.match(detail)
    if keyed is None:
        return UNTRACKABLE_ADVICE.split(": ", 1)[-1]
    place = keyed["place"].strip()
    return (
        f"key {place} by a plain int or str (the batch size, say) so that a slot path names each tensor, and "
        f'declare each where it is assigned: register_derived(layer, "{place}[4]") for the key 4; or keep the '
        f'tensor at an attribute of its own and register_derived(layer, "that_attribute")'
    )
