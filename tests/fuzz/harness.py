"""Run one scenario under a ``GraphContract`` (graphsafe's public API only) and let the oracle judge it.

1. Build the model on the old weights, seal the contract (``record_capture`` around a forward when the scenario
   says so), and record what the forward reads: the "capture".
2. Build a model cold on the new weights and record what its forward reads: the truth.
3. Reload under the contract: the loader and the mutated PWAL; still inside the transaction, record what the
   forward reads now (PWAL's own result, before graphsafe restores anything).
4. After the transaction: the status (or the exception), what a replay reads at the captured addresses, and what the
   reloaded model's forward reads. :func:`fuzz.oracle.judge` gives the verdict; an exception that is not a
   ``graphsafe.errors`` error is a crash.
"""

from __future__ import annotations

import gc
import re
import traceback
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from fuzz import models, oracle
from fuzz.models import FuzzerBug, Scenario
from graphsafe import GraphContract, GraphSafeError, record_capture
from graphsafe.contract import Agreement

OLD_SEED = 1
NEW_SEED = 2
FINAL_SEED = 3  # a layerwise touch that writes a layer's weight again with other values writes these


@dataclass
class Result:
    scenario: Scenario
    verdict: str
    reason: str
    status: str = ""
    detail: str = ""  # the exception of a crash, with where it was raised
    #: What the reload left, comparable between two runs of one scenario (see :func:`evidence`); empty for a
    #: scenario the seal refused or that crashed.
    evidence: tuple[object, ...] = ()


def _seeds(scenario: Scenario) -> tuple[int, ...]:
    """The weights a loader's first pass writes, per layer."""
    return tuple(OLD_SEED if layer.loader == "keep" else NEW_SEED for layer in scenario.layers)


def _final_seeds(scenario: Scenario) -> tuple[int, ...]:
    """The weights the model holds when the reload is over (what the cold model is built on)."""
    seeds = list(_seeds(scenario))
    if scenario.layerwise in ("rewrite_new", "rewrite_new_repwal"):
        seeds[scenario.touch] = FINAL_SEED
    return tuple(seeds)


def _crash(scenario: Scenario, exc: BaseException, when: str) -> Result:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {where.filename.rsplit('/src/', 1)[-1]}:{where.lineno}" if where else ""
    return Result(scenario, oracle.CRASH, f"{when}: {type(exc).__name__}", detail=f"{exc!r}{at}")


def _reads(
    model: models.FuzzModel, x: torch.Tensor, values: bool = True, only: int | None = None
) -> dict[oracle.Key, oracle.Read]:
    """What the forward reads (``values=False``: only where, for the capture: no strong reference is kept;
    ``only``: one layer's reads)."""
    return oracle.record(lambda note: models.forward(model, x, note, only), (x,), values=values)


def _same_read(a: oracle.Read, b: oracle.Read) -> bool:
    """The same place, geometry and logical values."""
    if a.geometry != b.geometry or (a.logical is None) != (b.logical is None):
        return False
    return a.logical is None or b.logical is None or oracle.same_values(a.logical, b.logical)


class _Unguarded:
    """The transaction of a reload run without any contract (the ground truth of a refused seal)."""

    def before_layer(self, layer: object) -> None:
        pass

    def after_layer(self, layer: object) -> None:
        pass


TxnFactory = Callable[[bool], AbstractContextManager[Any]]


def _layerwise(
    scenario: Scenario,
    transaction: TxnFactory,
    model: models.FuzzModel,
    first: list[dict[str, torch.Tensor]],
    final: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
) -> tuple[dict[oracle.Key, oracle.Read], dict[oracle.AttrKey, tuple[object, ...]]]:
    """A layerwise reload: before_layer, the layer's loader and PWAL, after_layer, layer by layer; then the touch.
    Returns what PWAL left, layer by layer, as the forward reads it and with its attributes: each layer looked at
    right after its PWAL (before after_layer restores it), the touched layer again after the touch. The call-order
    faults (``fuzz.models.CALL_ORDER``) move or drop the touched layer's before_layer/after_layer."""
    reads: dict[oracle.Key, oracle.Read] = {}
    attrs: dict[oracle.AttrKey, tuple[object, ...]] = {}
    how, touch = scenario.layerwise, scenario.touch
    with transaction(True) as txn:
        for index, layer in enumerate(model.layers):
            assert isinstance(layer, models.FuzzLayer)
            here = how if index == touch else "plain"
            if here not in ("no_before", "late_before", "late_before_pwal", "neither"):
                txn.before_layer(layer)
            models.load_layer(layer, first[index], layer.fuzz_spec.loader)
            if here == "late_before":
                txn.before_layer(layer)
            models.pwal_layer(model, layer, reload=True)
            if here == "late_before_pwal":
                txn.before_layer(layer)
            reads.update(_reads(model, x, only=index))
            attrs.update(models.attributes(model, only=index))
            if here not in ("no_after", "neither"):
                txn.after_layer(layer)
        if how in ("repwal", "rewrite_same", "rewrite_new", "rewrite_new_repwal"):
            layer = model.layers[touch]
            assert isinstance(layer, models.FuzzLayer)
            untouched = _reads(model, x)  # every layer, just before the touch
            if how != "repwal":  # the weight written again (a late shard): the same values, or the final ones
                models.load_layer(layer, (first if how == "rewrite_same" else final)[touch], "copy")
            if how in ("repwal", "rewrite_new_repwal"):
                models.pwal_layer(model, layer, reload=True)
            prefix = f"layers.{touch}:"
            reads = {key: read for key, read in reads.items() if not key[0].startswith(prefix)}
            # The touch is the model's own code (graphsafe does nothing meanwhile): where it changed a read of
            # another layer (PWAL again moves a tensor object a later layer's tie still holds), that layer now holds
            # what the model left, not a value PWAL got right that graphsafe overwrote.
            for key, read in _reads(model, x).items():
                if key[0].startswith(prefix) or key not in reads:
                    continue
                was = untouched.get(key)
                if was is None or not _same_read(was, read):
                    reads[key] = read
            reads.update(_reads(model, x, only=touch))
            attrs = {key: value for key, value in attrs.items() if not key[0].startswith(prefix)}
            attrs.update(models.attributes(model, only=touch))
        if models.after_reload(model):  # the class's own late step (a shared layer replaced at one path)
            reads = _reads(model, x)
            attrs = models.attributes(model)
    return reads, attrs


def _reload(
    scenario: Scenario,
    transaction: TxnFactory,
    model: models.FuzzModel,
    new: list[dict[str, torch.Tensor]],
    final: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    left: list[Any],
) -> None:
    """The reload of ``scenario`` inside ``transaction``; puts what PWAL left (reads and attributes) in ``left``,
    for a whole-model reload before the transaction ends (so a reload that then raises still has it)."""
    if scenario.layerwise != "none":
        left.extend(_layerwise(scenario, transaction, model, new, final, x))
        return
    with transaction(False):
        models.reload(model, new)
        models.after_reload(model)
        left.extend((_reads(model, x), models.attributes(model)))


@dataclass
class Prepared:
    """A scenario sealed and captured, with the oracle's record of the capture and of a cold model."""

    scenario: Scenario
    contract: GraphContract
    model: models.FuzzModel
    x: torch.Tensor
    new: list[dict[str, torch.Tensor]]
    final: list[dict[str, torch.Tensor]]
    captured: dict[oracle.Key, oracle.Read]
    cold: dict[oracle.Key, oracle.Read]
    cold_attrs: dict[oracle.AttrKey, tuple[object, ...]]


def _input(model: models.FuzzModel) -> torch.Tensor:
    """The static input the forward reads (the class may carve it out of a storage the model also uses)."""
    held = models.static_input(model)
    return held if held is not None else torch.ones(1)


def _cold(
    scenario: Scenario, final: list[dict[str, torch.Tensor]]
) -> tuple[dict[oracle.Key, oracle.Read], dict[oracle.AttrKey, tuple[object, ...]]]:
    cold_model = models.build_cold(scenario, final)
    try:
        return _reads(cold_model, _input(cold_model)), models.attributes(cold_model)
    finally:
        models.release(cold_model)


def prepare(
    scenario: Scenario,
    *,
    unread: str = "restore",
    capture: Callable[[GraphContract, models.FuzzModel, torch.Tensor], set[oracle.Key]] | None = None,
    fast_tier: bool = True,
    name: str | None = None,
) -> Prepared | Result:
    """Build, seal and capture ``scenario``; a refused seal or a crash is returned as its :class:`Result`."""
    graph_reads: set[oracle.Key] | None = None
    old = models.weights(scenario, (OLD_SEED,) * len(scenario.layers))
    new = models.weights(scenario, _seeds(scenario))
    final = models.weights(scenario, _final_seeds(scenario))
    model = models.build(scenario, old)
    x = _input(model)
    contract = GraphContract(
        model,
        scenario.mode,
        detect=scenario.detect,
        unread=unread,
        name=name,  # type: ignore[arg-type]
    )
    contract.fast_tier = fast_tier
    contract.record_reloads = scenario.record  # type: ignore[assignment]
    try:
        contract.seal()
        models.warm(model)
        if capture is not None:
            graph_reads = capture(contract, model, x)
        elif scenario.manifest:
            with record_capture(contract, ignore=[x]) as manifest:
                models.forward(model, x)
                models.vouch(model, manifest)
    except FuzzerBug:
        models.release(model)
        raise
    except GraphSafeError as exc:
        try:
            return _refused(scenario, model, x, new, final, exc)
        finally:
            models.release(model)
    except Exception as exc:
        models.release(model)
        return _crash(scenario, exc, "seal")
    captured = _reads(model, x, values=False)
    if graph_reads is not None:
        captured = {key: read for key, read in captured.items() if key in graph_reads}
    cold, cold_attrs = _cold(scenario, final)
    if scenario.mode != "strict":
        contract.on_recapture(lambda outcome: None)  # a CPU "recapture": the contract reseals after it
    return Prepared(scenario, contract, model, x, new, final, captured, cold, cold_attrs)


def _refused(
    scenario: Scenario,
    model: models.FuzzModel,
    x: torch.Tensor,
    new: list[dict[str, torch.Tensor]],
    final: list[dict[str, torch.Tensor]],
    exc: GraphSafeError,
) -> Result:
    """A refused seal, judged by ground truth: the forward runs as the capture would, the reload runs with no
    contract at all; if it leaves every captured read in place with the right values, the refusal was a false
    alarm, else a correct refusal (a graph left alone would have read wrong memory)."""
    models.warm(model)
    captured = _reads(model, x, values=False)
    cold, _ = _cold(scenario, final)
    left: list[Any] = []
    try:
        _reload(scenario, lambda layerwise: nullcontext(_Unguarded()), model, new, final, x, left)
        after = left[0]
    except FuzzerBug:
        raise
    except Exception:  # the reload itself fails with no contract: nothing a graph could replay
        return Result(scenario, oracle.OK, "seal refused", "REFUSED", str(exc))
    if oracle.in_place(after, captured, cold):
        return Result(
            scenario,
            oracle.FALSE_ALARM,
            f"seal refused: {type(exc).__name__}, although a reload with no contract leaves every captured read in "
            "place with the right values",
            "REFUSED",
            str(exc),
        )
    return Result(scenario, oracle.OK, "seal refused", "REFUSED", str(exc))


def finish(
    prepared: Prepared,
    after_reload: Callable[[models.FuzzModel], None] | None = None,
    *,
    keep_evidence: bool = False,
    agreement: Agreement | None = None,
) -> Result:
    """Reload a prepared scenario under its contract and return the oracle's verdict."""
    scenario, contract, model, x = prepared.scenario, prepared.contract, prepared.model, prepared.x
    captured, cold, cold_attrs = prepared.captured, prepared.cold, prepared.cold_attrs
    after: dict[oracle.Key, oracle.Read] | None = None
    after_attrs: dict[oracle.AttrKey, tuple[object, ...]] | None = None
    status = ""
    crash: Result | None = None

    def transaction(layerwise: bool) -> AbstractContextManager[Any]:
        return contract.reload(layerwise=layerwise, agreement=agreement)

    left: list[Any] = []
    try:
        _reload(scenario, transaction, model, prepared.new, prepared.final, x, left)
    except FuzzerBug:
        raise
    except GraphSafeError:
        pass
    except Exception as exc:
        crash = _crash(scenario, exc, "reload")
    if left:
        after, after_attrs = left
    outcome = contract.last_outcome
    status = outcome.status.name if outcome is not None else "REFUSED"
    if crash is not None:
        crash.status = status
        return crash
    if after_reload is not None:
        after_reload(model)
    if status == "COMMITTED":
        gc.collect(1)  # a storage only garbage holds (an exception's frames) must read as freed; young is enough
    post = _reads(model, x)
    post_attrs = models.attributes(model)
    facts = oracle.Facts(
        status=status,
        replay_wrong=oracle.replay_wrong(captured, cold),
        model_wrong=oracle.values_wrong(post, cold),
        pwal_wrong=oracle.values_wrong(after, cold) if after is not None else None,
        pwal_in_place=after is not None and oracle.in_place(after, captured, cold),
        attrs_wrong=oracle.attributes_wrong(post_attrs, after_attrs, cold_attrs),
        attrs_changed=oracle.attributes_changed(post_attrs, after_attrs, cold_attrs),
        pwal_keys=frozenset(after or ()),
    )
    verdict, reason = oracle.judge(facts)
    kept = evidence(outcome, captured, post) if keep_evidence else ()
    return Result(scenario, verdict, reason, status, evidence=kept)


def run(
    scenario: Scenario,
    after_reload: Callable[[models.FuzzModel], None] | None = None,
    *,
    unread: str = "restore",
    capture: Callable[[GraphContract, models.FuzzModel, torch.Tensor], set[oracle.Key]] | None = None,
    fast_tier: bool = True,
    keep_evidence: bool = False,
) -> Result:
    """Run ``scenario`` and return the oracle's verdict. Raises :class:`FuzzerBug` for the generator's own bugs.

    ``after_reload(model)`` runs once the reload is over, before the oracle looks (the oracle's own tests inject a
    lie there). ``unread`` is the contract's policy; ``capture(contract, model, x)``, when given, records the
    capture in place of ``record_capture`` around a forward, for every scenario, and returns the reads (keys) the
    captured graph makes: the oracle then judges a replay by those alone (the kernel scan's skip test).
    ``fast_tier`` is the contract's (``GraphContract.fast_tier``); ``keep_evidence`` fills :attr:`Result.evidence`.
    A scenario of the ``contracts`` class runs as two contracts on two ranks (:func:`fuzz.classes.run_contracts`);
    its result is the worst of its four reloads.
    """
    if scenario.klass == "contracts":
        return max(run_all(scenario), key=lambda r: RANK[r.verdict])
    prepared = prepare(scenario, unread=unread, capture=capture, fast_tier=fast_tier)
    if isinstance(prepared, Result):
        return prepared
    try:
        return finish(prepared, after_reload, keep_evidence=keep_evidence)
    finally:
        models.release(prepared.model)


RANK = {oracle.OK: 0, oracle.FALSE_ALARM: 1, oracle.CRASH: 2, oracle.SILENT: 3}


def run_all(scenario: Scenario) -> list[Result]:
    """Every reload of ``scenario`` judged: one, or four for the ``contracts`` class (two contracts, two ranks)."""
    if scenario.klass == "contracts":
        from fuzz.classes import run_contracts

        return run_contracts(scenario)
    return [run(scenario)]


_ADDRESS = re.compile(r"0x[0-9a-f]+|capture-\d+")  # what differs between two runs of one scenario


def evidence(
    outcome: object, captured: dict[oracle.Key, oracle.Read], post: dict[oracle.Key, oracle.Read]
) -> tuple[object, ...]:
    """What a reload left, in values only (no addresses, so two runs of one scenario compare): the outcome's status,
    findings (kind and slot), counts; per captured read, the bytes a replay reads there (``None``: freed); per read
    of the reloaded model's forward, its bytes and whether it reads its captured address."""
    findings = sorted(
        (f.kind.name, f.layer, f.path, _ADDRESS.sub("@", f.detail)) for f in getattr(outcome, "findings", ())
    )
    counts = (
        getattr(outcome, "status", None),
        getattr(outcome, "slots_restored", 0),
        getattr(outcome, "bytes_copied", 0),
    )

    def raw(tensor: torch.Tensor | None) -> tuple[object, ...] | None:
        if tensor is None:
            return None
        # (a fresh tensor has standard strides: a contiguous one of one element can carry any stride)
        plain = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.resolve_conj().resolve_neg())
        return (
            str(plain.dtype),
            tuple(plain.shape),
            plain.view(-1).view(torch.uint8).tolist() if plain.numel() else [],
        )

    replays = sorted((str(key), raw(read.replay())) for key, read in captured.items())
    reads = sorted(
        (str(key), raw(read.logical), key in captured and captured[key].data_ptr == read.data_ptr)
        for key, read in post.items()
    )
    return (counts, findings, replays, reads)


#: What a reload came to, per class: the oracle's silent and crash verdicts, a false alarm, and among the honest rest
#: a commit or a correct refusal (a recapture, a failure or a refused seal where the oracle agrees a graph left alone
#: would read wrong memory).
OUTCOMES = ("silent", "crash", "false-alarm", "inherited", "refusal", "commit")


def outcome_of(result: Result) -> str:
    """The result's outcome; a false alarm of a class whose base scenario alone (the class's feature taken away) is
    a false alarm too is ``inherited``: the base class's (its known kinds are in docs/fault-matrix.md)."""
    if result.verdict == oracle.FALSE_ALARM and result.scenario.klass != "base" and _base_false_alarm(result):
        return "inherited"
    if result.verdict != oracle.OK:
        return result.verdict
    return "commit" if result.status == "COMMITTED" else "refusal"


def _base_false_alarm(result: Result) -> bool:
    from dataclasses import replace

    from fuzz.classes import second

    scenario = result.scenario
    if scenario.klass == "contracts" and "second contract" in result.reason:
        base = second(scenario)
    else:
        base = replace(scenario, klass="base", variant="", fault="", at=0)
    return run(base).verdict == oracle.FALSE_ALARM


@dataclass
class Tally:
    """Verdict counts, by verdict, by class of scenario and by mutation kind, with the first few scenarios of each
    distinct reason."""

    runs: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    by_class: dict[str, Counter[str]] = field(default_factory=dict)
    by_mutation: dict[str, Counter[str]] = field(default_factory=dict)
    examples: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    keep: int = 2

    def add(self, result: Result) -> None:
        self.runs += 1
        self.verdicts[result.verdict] += 1
        self.by_class.setdefault(result.scenario.klass, Counter())[outcome_of(result)] += 1
        for mutation in result.scenario.mutations():
            self.by_mutation.setdefault(mutation, Counter())[result.verdict] += 1
        if result.verdict != oracle.OK:
            # One bucket per distinct reason (the first words of it: the kind of lie, not the slot's name).
            reason = result.reason.split(":")[0] + (f" {result.status}" if result.verdict == oracle.CRASH else "")
            bucket = self.examples.setdefault((result.verdict, reason), [])
            if len(bucket) < self.keep:
                bucket.append(result)

    @property
    def failures(self) -> int:
        return self.verdicts[oracle.SILENT] + self.verdicts[oracle.CRASH]

    def classes(self) -> dict[str, dict[str, float]]:
        """Per class: the count of each outcome, the reloads, and the false-alarm rate (a fraction)."""
        out: dict[str, dict[str, float]] = {}
        for klass in sorted(self.by_class):
            counts = self.by_class[klass]
            runs = sum(counts.values())
            out[klass] = {
                **{o: counts[o] for o in OUTCOMES},
                "reloads": runs,
                # the class's own false alarms (not those its base scenario has alone)
                "false_alarm_rate": counts["false-alarm"] / runs if runs else 0.0,
            }
        return out

    def class_table(self) -> str:
        """The per-class table (markdown)."""
        head = "| class | reloads | " + " | ".join(OUTCOMES) + " | own false-alarm rate |"
        lines = [head, "|" + "---|" * (len(OUTCOMES) + 3)]
        for klass, row in self.classes().items():
            cells = " | ".join(str(int(row[o])) for o in OUTCOMES)
            lines.append(f"| {klass} | {int(row['reloads'])} | {cells} | {100 * row['false_alarm_rate']:.1f} % |")
        return "\n".join(lines)

    def report(self) -> str:
        lines = [
            f"graphsafe differential fuzzer: {self.runs} reloads: "
            + ", ".join(f"{v} {self.verdicts[v]}" for v in oracle.VERDICTS)
        ]
        lines.append("by class of scenario:")
        lines.append(self.class_table())
        lines.append("by mutation kind (a reload counts once for every kind it applies):")
        width = max((len(m) for m in self.by_mutation), default=8)
        for mutation in sorted(self.by_mutation):
            counts = self.by_mutation[mutation]
            lines.append(f"  {mutation:<{width}}  " + "  ".join(f"{v} {counts[v]:>4}" for v in oracle.VERDICTS))
        for (verdict, reason), results in sorted(self.examples.items()):
            lines.append(f"{verdict}: {reason} (first {len(results)}):")
            for result in results:
                lines.append(f"  - {result.reason} {result.detail}".rstrip())
                lines.append("    " + result.scenario.describe().replace("\n", "\n    "))
        return "\n".join(lines)
