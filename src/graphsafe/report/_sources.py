"""What each of the three sources says: a model (classified now), a contract (its seal, its last reload, and what
appeared after the seal) and a reload outcome (its findings).

The model and the contract ask the one classification, :func:`graphsafe.collectors.classify` (the contract's
seal asked it too), so a path gets the same answer from both: a walker find (``Origin.WALKER``) is an undeclared
tensor to declare, an alias (``Origin.ALIAS``) is restored with the slot it aliases and is listed as such.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from torch import nn

from graphsafe.collectors import UNTRACKABLE_ADVICE, Classified, LayerTensors, Manifest, classify
from graphsafe.contract import GraphContract
from graphsafe.devices import DeviceSet, WalkBudget
from graphsafe.errors import GraphSafeError
from graphsafe.outcome import Finding, FindingKind, Origin, ReloadOutcome, SlotRef
from graphsafe.report._drafts import Draft, dtype_name, in_model_order, strip_addresses
from graphsafe.report._entries import AliasEntry, DeclaredProblem, Evidence, UnownedEntry

__all__ = ["Collected", "from_contract", "from_model", "from_outcome", "unowned_storage"]


@dataclass(slots=True)
class Collected:
    """What one source yields, in model order, before owners, storage sharing and fixes are worked out."""

    drafts: list[Draft]
    #: The layer objects by qualified name (empty when the source has no model).
    layers: dict[str, nn.Module]
    aliases: list[AliasEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    declared_problems: int = 0
    declared: list[DeclaredProblem] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# A reload's findings.


@dataclass(slots=True)
class _Findings:
    """An outcome's findings on undeclared slots (the most telling one per slot), notes for the findings that
    name no slot, and the problems on declared slots (listed apart, with their count)."""

    by_slot: dict[tuple[str, str], Finding] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    declared_problems: int = 0
    declared: list[DeclaredProblem] = field(default_factory=list)


def _finding_note(finding: Finding) -> str:
    """A finding that names no slot (a reload error, an exhausted walk, unowned storage) as one line."""
    where = f"{SlotRef(finding.layer, '')} ({finding.layer_class})"
    return strip_addresses(f"{finding.kind.value} at {where}: {finding.detail}".splitlines()[0])


def _declared_problem(finding: Finding) -> DeclaredProblem:
    """A problem on a declared slot, its detail (which says what to do) without device addresses."""
    detail = strip_addresses(" ".join(line.strip() for line in finding.detail.splitlines() if line.strip()))
    return DeclaredProblem(finding.layer, finding.layer_class, finding.path, finding.kind.value, detail)


def _index_findings(outcome: ReloadOutcome | None) -> _Findings:
    index = _Findings()
    for finding in outcome.findings if outcome is not None else ():
        if finding.declared:
            if finding.kind.is_problem and finding.path:
                index.declared_problems += 1
                index.declared.append(_declared_problem(finding))
            elif finding.kind.is_problem:
                index.notes.append(_finding_note(finding))
        elif not finding.path:
            index.notes.append(_finding_note(finding))
        else:
            current = index.by_slot.get((finding.layer, finding.path))
            if current is None or finding.kind.rank < current.kind.rank:
                index.by_slot[finding.layer, finding.path] = finding
    return index


def _draft_from_finding(finding: Finding, *, lazy: bool, evidence: Evidence) -> Draft | None:
    fp = finding.before if finding.before is not None else finding.after
    if fp is None:
        return None
    return Draft(
        finding.layer,
        finding.layer_class,
        finding.path,
        fp,
        finding.kind,
        True if finding.kind is FindingKind.AUTO_RESTORED else None,
        lazy or finding.kind is FindingKind.VANISHED,
        evidence,
        detail=finding.detail,
    )


# ----------------------------------------------------------------------------------------------------------------
# Classifying a model now.


def _classified(
    model: nn.Module, budget: WalkBudget, devices: DeviceSet | None, notes: list[str]
) -> Iterator[tuple[str, nn.Module, LayerTensors]]:
    """Every module classified now; what its walk could not see goes to ``notes``."""
    units = frozenset(id(module) for module in model.modules())  # as the contract's seal walks
    for qualname, layer in model.named_modules():
        tensors = classify(layer, budget=budget, devices=devices, units=units)
        name = SlotRef(qualname, "")
        if tensors.exhausted:
            notes.append(
                strip_addresses(f"{name}: walk budget exhausted ({tensors.exhausted}); tensors past it are not listed")
            )
        notes.extend(
            # as _finding_note writes the contract's untrackable finding, so a place seen by both is one note
            strip_addresses(
                f"{FindingKind.UNTRACKABLE.value} at {name} ({type(layer).__name__}): {note}; {UNTRACKABLE_ADVICE}"
            )
            for note in tensors.notes
        )
        yield qualname, layer, tensors


def _alias(layer: str, layer_class: str, path: str, alias_of: str | None) -> list[AliasEntry]:
    # Every alias names the slot it aliases; the guard only narrows the type.
    return [AliasEntry(layer, layer_class, path, alias_of)] if alias_of is not None else []


def _walked_draft(qualname: str, layer: nn.Module, entry: Classified, *, lazy: bool, evidence: Evidence) -> Draft:
    return Draft(
        qualname,
        type(layer).__name__,
        entry.path.text,
        entry.fingerprint,
        None,
        entry.restorable,
        lazy,
        evidence,
        entry.reason,
    )


def from_model(model: nn.Module, budget: WalkBudget, devices: DeviceSet | None) -> Collected:
    """Every walker find of every module (what to declare) and every alias (nothing to declare); no drift."""
    collected = Collected([], dict(model.named_modules()))
    for qualname, layer, tensors in _classified(model, budget, devices, collected.notes):
        collected.drafts += (_walked_draft(qualname, layer, e, lazy=False, evidence="walk") for e in tensors.undeclared)
        for entry in tensors.of(Origin.ALIAS):
            collected.aliases += _alias(qualname, type(layer).__name__, entry.path.text, entry.alias_of)
    return collected


def _live_model(contract: GraphContract) -> nn.Module | None:
    try:
        return contract.model
    except GraphSafeError:  # held weakly, and collected
        return None


def from_contract(contract: GraphContract) -> Collected:
    """The seal's walker finds (drift from the last reload) and aliases, then what appeared after the seal: found
    by the last reload, or by classifying the model now (both lazy: seal() runs right after the load and its
    PWAL, so these were not made by PWAL)."""
    findings = _index_findings(contract.last_outcome)
    collected = Collected([], dict(contract.sealed_layers()), notes=findings.notes)
    collected.declared_problems = findings.declared_problems
    collected.declared = findings.declared
    known: set[tuple[str, str]] = set()
    # What PWAL made or wrote while the contract recorded it (the input tracing of the freshness check).
    recorded = {(ref.layer, ref.path) for ref in contract.recorded_inputs()} if contract.inputs_recorded else None
    for slot in contract.slots():
        known.add((slot.layer, slot.path))
        if slot.origin is Origin.ALIAS:
            collected.aliases += _alias(slot.layer, slot.layer_class, slot.path, slot.alias_of)
        if slot.origin is not Origin.WALKER:
            continue
        finding = findings.by_slot.get((slot.layer, slot.path))
        drift = finding.kind if finding is not None else None
        collected.drafts.append(
            Draft(
                slot.layer,
                slot.layer_class,
                slot.path,
                slot.fingerprint,
                drift,
                slot.restorable,
                drift is FindingKind.VANISHED,
                "seal",
                detail=finding.detail if finding is not None else "",
                written=(slot.layer, slot.path) in recorded if recorded is not None else None,
            )
        )
    for where, finding in findings.by_slot.items():
        draft = _draft_from_finding(finding, lazy=True, evidence="after-seal") if where not in known else None
        if draft is not None:
            collected.drafts.append(draft)
    model = _live_model(contract)
    if not contract.sealed:
        collected.notes.append("the contract is not sealed yet: seal() collects the undeclared tensors")
    elif contract.detect == "declared-only":
        collected.notes.append(
            "the contract was sealed with detect='declared-only': undeclared tensors were not collected"
        )
    elif model is None:
        collected.notes.append(
            "the contract's model was garbage-collected: only what the seal and the last reload saw is listed"
        )
    else:
        collected.layers = dict(model.named_modules())
        skip = known | findings.by_slot.keys()
        for qualname, layer, tensors in _classified(model, contract.budget, contract.devices, collected.notes):
            for entry in tensors.of(Origin.WALKER, Origin.ALIAS):
                if (qualname, entry.path.text) in skip:
                    continue
                if entry.origin is Origin.WALKER:
                    collected.drafts.append(_walked_draft(qualname, layer, entry, lazy=True, evidence="after-seal"))
                else:
                    collected.aliases += _alias(qualname, type(layer).__name__, entry.path.text, entry.alias_of)
    manifest = contract.manifest
    if isinstance(manifest, Manifest):  # what a capture wrote is scratch the graph overwrites (static evidence)
        # By storage, not holder: a tensor allocated after the seal (lazy scratch) has no holder in the manifest.
        wrote = {id(live) for e in manifest.storages() if e.written and (live := e.storage_ref()) is not None}
        collected.drafts = [
            replace(d, graph_writes=True) if (live := d.fp.storage_ref()) is not None and id(live) in wrote else d
            for d in collected.drafts
        ]
    collected.drafts = in_model_order(collected.drafts, collected.layers)
    collected.aliases = in_model_order(collected.aliases, collected.layers)
    return collected


def from_outcome(outcome: ReloadOutcome, model: nn.Module | None) -> Collected:
    """The undeclared slots the outcome has findings on; owners are exact only with the model."""
    findings = _index_findings(outcome)
    drafts = [_draft_from_finding(f, lazy=False, evidence="finding") for f in findings.by_slot.values()]
    collected = Collected([d for d in drafts if d is not None], {}, notes=findings.notes)
    collected.declared_problems = findings.declared_problems
    collected.declared = findings.declared
    if model is not None:
        wanted = {d.layer for d in collected.drafts}
        collected.layers = {name: module for name, module in model.named_modules() if name in wanted}
    elif collected.drafts:
        collected.notes.append(
            "owners are layer classes: a reload outcome does not say which quant method ran PWAL "
            "(pass model= for exact owners)"
        )
    return collected


# ----------------------------------------------------------------------------------------------------------------
# Unowned captured storage.


def unowned_storage(contract: GraphContract, drafts: list[Draft]) -> list[UnownedEntry]:
    """The storage the contract's capture manifest recorded that no model path held, minus storage a draft already
    names (the manifest ties storage to paths at capture; a scratch first walked later is not unowned)."""
    manifest = contract.manifest
    if not isinstance(manifest, Manifest):  # no capture recorded (or a manifest of another kind)
        return []
    named = {(d.fp.storage_ptr, d.fp.device) for d in drafts}
    unowned: list[UnownedEntry] = []
    for storage in manifest.unowned():
        if (storage.data_ptr, storage.device) in named:
            continue
        access = "read/written" if storage.written else "read"
        description = (
            f"capture {storage.capture!r} {access} bytes [{storage.lo}, {storage.hi}) of a {storage.nbytes}-byte "
            f"storage no layer path holds (first by {storage.op})"
        )
        view = storage.first_view
        unowned.append(
            UnownedEntry(
                strip_addresses(description),
                view.shape,
                dtype_name(view.dtype),
                str(storage.device),
                storage.nbytes,
                storage.data_ptr,
            )
        )
    return unowned
