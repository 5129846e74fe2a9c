"""Rank agreement: every rank of a process group ends a reload with the same outcome.

With tensor or pipeline parallelism every rank reloads its own shard and owns its own captured graphs, and those
graphs contain collectives. One rank recapturing alone deadlocks in its collectives; one rank failing while the
others resume serves garbage. So with ``contract.reload(agreement=...)`` each rank prepares locally
(restore + verify), then a :class:`StoreAgreement` gives every rank the worst status of the group (``FAILED`` >
``NEEDS_RECAPTURE`` > ``COMMITTED``) before anyone commits, recaptures or raises.

How ranks exchange (one round per reload, through the group's key-value store, never a collective):

1. Each rank takes the next round number from its own counter in the store (``next/<rank>``). Round *n* pairs the
   *n*-th group reload of every rank, so ranks must make the same sequence of group reloads; the contract makes a
   reload that leaves before agreeing (``begin()`` raised, or ``finish()``'s restore did) still take part (as
   ``FAILED``), which keeps the counters paired.
2. It posts a short JSON summary under ``<n>/rank/<rank>``: the contract it decides (``ReloadOutcome.contract``),
   status, mode, problem count, the error's ``repr`` and the first :data:`SUMMARY_FINDINGS` findings (kind,
   layer, path, detail). A peer whose summary names another contract (two contracts sharing the group, reloaded
   in different orders) counts as ``FAILED``, with a finding naming both: a round never decides one model by
   another's outcome.
3. It waits for every rank's summary with ``store.wait(keys, remaining timeout)``.
4. It proposes a decision with ``compare_set(<n>/decision, "", proposal)``: ``{"missing": []}`` if every summary is
   there, else the ranks still missing. The first proposal wins and every rank adopts it, so all ranks that get
   this far see the same decision even when a rank arrives exactly at the deadline.
5. Missing ranks make the round ``FAILED`` (a :class:`~graphsafe.RankAgreementError` on the ranks that waited,
   naming the missing ranks); otherwise the status is the worst of the summaries, and the findings of ranks that
   did not commit are added to the outcome with their ``rank`` set (a failed rank is always named by a
   ``reload-error`` finding).

A **late** rank (one that arrives after a peer gave up) finds the round's decision already written before it
waits: it does not wait at all, ends ``FAILED`` at once and raises a :class:`~graphsafe.RankAgreementError`
saying which rank gave up on it. Its next group reload uses round *n + 1*, the same round as its peers' next one.

Why the store and not a collective: a timed-out collective cannot be taken back. On NCCL the late rank's
collective would later match whatever collective its peers issue next (a recapture's all-reduce, say) and turn a
timeout into silent corruption or a hang; a store round has no such tail and works the same for gloo and NCCL,
CPU and GPU. It costs a few small requests per rank to the store server per reload.

The contract needs only the :class:`Agreement` protocol: a callable from the local outcome to the group's.
:class:`StoreAgreement` is the implementation above, over any :class:`KeyValueStore` (``torch.distributed``'s
``TCPStore``/``FileStore``/``HashStore`` are ones). Building an :class:`AgreementGroup` from a ``torch.distributed``
process group is the adapter's job (:func:`graphsafe.adapters.distributed.agreement`); an engine whose ranks are not
a torch process group (vLLM's ``StatelessProcessGroup``, say) builds ``AgreementGroup(store, rank, world_size,
name)`` itself.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol

from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, Status

__all__ = [
    "DEFAULT_TIMEOUT",
    "SUMMARY_FINDINGS",
    "Agreement",
    "AgreementGroup",
    "KeyValueStore",
    "StoreAgreement",
]

#: How long a rank waits for its peers when ``timeout`` is ``None``.
DEFAULT_TIMEOUT = timedelta(seconds=300)
#: How many findings of a rank travel to its peers (the rest are counted).
SUMMARY_FINDINGS = 5
_DETAIL_CHARS = 400
_PREFIX = "graphsafe/agree"


class Agreement(Protocol):
    """Turns this rank's locally prepared outcome into the outcome every rank of the group ends with."""

    def __call__(self, local: ReloadOutcome) -> ReloadOutcome: ...


class KeyValueStore(Protocol):
    """The store operations the agreement uses (``torch.distributed.Store`` has them all)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class AgreementGroup:
    """The ranks that must agree on a reload, and the key-value store they agree through.

    ``name`` namespaces the keys: two groups sharing a store must have different names, and every rank of one
    group must use the same name. ``rank`` is the rank within the group (``0 .. world_size - 1``).
    """

    store: KeyValueStore = field(repr=False)
    rank: int
    world_size: int
    name: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"AgreementGroup {self.name!r}: world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"AgreementGroup {self.name!r}: rank {self.rank} is outside 0..{self.world_size - 1}")
        if not self.name:
            raise ValueError("AgreementGroup needs a non-empty name (it namespaces the store keys)")


class StoreAgreement:
    """Rank agreement through the group's key-value store (the protocol in the module docs).

    ``StoreAgreement(group, timeout)(local)``: every rank passes its locally prepared outcome and gets the group's:
    ``local`` with the worst status of the group, ``rank_statuses`` (each rank's own status, and ``FAILED`` for
    ranks that did not arrive) and, appended to ``local.findings``, the findings of the ranks that did not commit,
    with ``rank`` set. A rank that does not arrive within ``timeout`` (seconds or a ``timedelta``; ``None``:
    :data:`DEFAULT_TIMEOUT`) fails the reload on every rank, itself included when it finally arrives (it then
    returns at once). Never raises for a peer's failure: the contract turns a ``FAILED`` outcome into the error.
    """

    __slots__ = ("group", "seconds")

    def __init__(self, group: AgreementGroup, timeout: float | timedelta | None = None) -> None:
        if not isinstance(group, AgreementGroup):
            raise TypeError(
                f"StoreAgreement needs an AgreementGroup, not {type(group).__name__}; for a torch.distributed "
                "process group use graphsafe.adapters.distributed.agreement(group)"
            )
        self.group = group
        self.seconds = _timeout_seconds(timeout)

    def __call__(self, local: ReloadOutcome) -> ReloadOutcome:
        peers = self.group
        if peers.world_size == 1:
            return replace(local, rank_statuses=((peers.rank, local.status),))
        result = _exchange(peers, json.dumps(_summary(local)), self.seconds)
        return _merge(local, peers, result, self.seconds)

    def __repr__(self) -> str:
        return f"StoreAgreement({self.group!r}, timeout={self.seconds:g})"


class _Keys:
    """The group's store with every key under one prefix (rounds of different groups never meet)."""

    __slots__ = ("prefix", "store")

    def __init__(self, prefix: str, store: KeyValueStore) -> None:
        self.prefix = prefix
        self.store = store

    def key(self, key: str) -> str:
        return self.prefix + key

    def keys(self, keys: Sequence[str]) -> list[str]:
        return [self.prefix + key for key in keys]

    def set(self, key: str, value: str) -> None:
        self.store.set(self.key(key), value)

    def get(self, key: str) -> bytes:
        return self.store.get(self.key(key))

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.key(key), amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(self.keys(keys))

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        self.store.wait(self.keys(keys), timeout)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.store.compare_set(self.key(key), expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self.key(key))


# -- the exchange ----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Round:
    """What one rank learned in one round."""

    number: int = -1
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)
    missing: tuple[int, ...] = ()
    gave_up: int | None = None  # the rank whose "missing" proposal won
    store_error: str | None = None


def _exchange(peers: AgreementGroup, payload: str, seconds: float) -> _Round:
    deadline = time.monotonic() + seconds
    store = _Keys(f"{_PREFIX}/{peers.name}/{peers.world_size}/", peers.store)
    result = _Round()
    try:
        number = store.add(f"next/{peers.rank}", 1) - 1
        result.number = number
        keys = [f"{number}/rank/{r}" for r in range(peers.world_size)]
        decision_key = f"{number}/decision"
        store.set(keys[peers.rank], payload)
        if not store.check([decision_key]):  # a written decision means a peer gave up already: do not wait
            remaining = deadline - time.monotonic()
            # Timing out raises DistStoreError (TCPStore) or RuntimeError (FileStore); who is missing is read below.
            with contextlib.suppress(RuntimeError):
                if remaining > 0:
                    store.wait(keys, timedelta(seconds=remaining))
        missing = [r for r in range(peers.world_size) if not store.check([keys[r]])]
        proposal = json.dumps({"missing": missing, "by": peers.rank})
        decision = json.loads(store.compare_set(decision_key, "", proposal))
        result.missing = tuple(int(r) for r in decision["missing"])
        if result.missing:
            result.gave_up = int(decision["by"])
        if peers.rank not in result.missing:
            # Read only on time: a late rank's peers may already be deleting this round's summaries.
            for r in range(peers.world_size):
                if r != peers.rank and r not in result.missing:
                    result.summaries[r] = _parse(store.get(keys[r]))
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # the store failed, or wrote garbage
        result.store_error = repr(exc)
        heard = set(result.summaries) | {peers.rank}
        result.missing = tuple(r for r in range(peers.world_size) if r not in heard)
        return result
    if result.number >= 2:
        # Two rounds back, every rank has read this rank's summary or given up on it. Housekeeping only.
        with contextlib.suppress(RuntimeError):
            store.delete_key(f"{result.number - 2}/rank/{peers.rank}")
    return result


def _parse(raw: bytes) -> dict[str, Any]:
    """A peer's summary; anything unreadable becomes an empty one (which reads as a failed rank)."""
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


# -- summaries -------------------------------------------------------------------------------------------------
def _clip(text: str) -> str:
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 3] + "..."


def _summary(local: ReloadOutcome) -> dict[str, Any]:
    problems = local.problems
    findings = []
    for f in problems[:SUMMARY_FINDINGS]:
        detail = f.detail
        # Fingerprints hold storage references and cannot travel: send their descriptions as text.
        if f.before is not None:
            detail += f"; captured {f.before.describe()}"
        if f.after is not None:
            detail += f"; now {f.after.describe()}"
        findings.append(
            {
                "kind": f.kind.value,
                "layer": f.layer,
                "layer_class": f.layer_class,
                "path": f.path,
                "declared": f.declared,
                "detail": _clip(detail),
            }
        )
    return {
        "contract": local.contract,
        "status": local.status.value,
        "mode": local.mode,
        "problems": len(problems),
        "error": _clip(repr(local.error)) if local.error is not None else None,
        "findings": findings,
    }


def _remote_findings(rank: int, summary: dict[str, Any]) -> tuple[Status, list[Finding]]:
    """A peer's status and its findings as this rank reports them (``rank`` set)."""
    try:
        status = Status(summary["status"])
        findings = [
            Finding(
                _kind(str(item["kind"])),
                layer=str(item["layer"]),
                layer_class=str(item["layer_class"]),
                path=str(item["path"]),
                declared=bool(item["declared"]),
                detail=str(item["detail"]),
                rank=rank,
            )
            for item in summary["findings"]
        ]
        problems = int(summary["problems"])
        error = summary.get("error")
    except (KeyError, TypeError, ValueError) as exc:
        return Status.FAILED, [_rank_failure(rank, f"its summary could not be read ({exc!r})")]
    if status is Status.COMMITTED:
        return status, []
    if problems > len(findings) and findings:
        last = findings[-1]
        findings[-1] = replace(last, detail=f"{last.detail} (+{problems - len(findings)} more on rank {rank})")
    if status is Status.FAILED and not any(f.kind is FindingKind.RELOAD_ERROR for f in findings):
        cause = f"raised {error}" if error else f"{problems} problem(s) in {summary.get('mode')} mode"
        findings.insert(0, _rank_failure(rank, f"its reload failed: {cause}"))
    return status, findings


def _kind(value: str) -> FindingKind:
    try:
        return FindingKind(value)
    except ValueError:  # a peer on another graphsafe version: still a problem, never silently dropped
        return FindingKind.RELOAD_ERROR


def _rank_failure(rank: int, detail: str) -> Finding:
    return Finding(
        FindingKind.RELOAD_ERROR, layer="", layer_class="rank", path="", declared=True, detail=detail, rank=rank
    )


def _merge(local: ReloadOutcome, peers: AgreementGroup, result: _Round, seconds: float) -> ReloadOutcome:
    statuses: dict[int, Status] = {peers.rank: local.status}
    added: list[Finding] = []
    for rank in sorted(result.summaries):
        summary = result.summaries[rank]
        theirs = summary.get("contract")
        if summary and theirs != local.contract:  # (an unreadable summary is reported as such below)
            # Paired with another contract's reload: neither decision is about the other's model.
            statuses[rank] = Status.FAILED
            added.append(
                _rank_failure(
                    rank,
                    f"decided contract {theirs!r} in round {result.number}, while this rank decided "
                    f"{local.contract!r}: the contracts sharing agreement group {peers.name!r} are reloaded in "
                    "different orders on its ranks; reload them in the same order on every rank, or give each "
                    "its own AgreementGroup name",
                )
            )
            continue
        status, findings = _remote_findings(rank, summary)
        statuses[rank] = status
        added.extend(findings)
    late = peers.rank in result.missing
    for rank in result.missing:
        statuses[rank] = Status.FAILED
        if result.store_error is not None:
            detail = f"not heard from: the agreement store failed ({result.store_error})"
        elif rank == peers.rank:
            others = ", ".join(str(r) for r in result.missing)
            detail = (
                f"this rank arrived after rank {result.gave_up} gave up waiting for rank(s) {others} "
                f"(round {result.number}); the whole group fails this reload"
            )
        else:
            detail = f"did not reach the agreement within {seconds:g} s (round {result.number})"
        added.append(_rank_failure(rank, detail))
    if late:
        # The peers ended FAILED because of this rank; their own summaries are not read (see _exchange).
        statuses.update({r: Status.FAILED for r in range(peers.world_size)})
    agreed = Status.worst(*statuses.values())
    return replace(
        local,
        status=agreed,
        findings=local.findings + tuple(added),
        rank_statuses=tuple(sorted(statuses.items())),
    )


def _timeout_seconds(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT.total_seconds()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:  # also rejects NaN
        raise ValueError(f"agreement timeout must be positive, got {timeout!r}")
    return seconds
