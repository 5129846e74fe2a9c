"""Rank agreement: every rank of a process group ends a reload with the same outcome.

With tensor or pipeline parallelism every rank reloads its own shard and owns its own captured graphs, and those
graphs contain collectives. One rank recapturing alone deadlocks in its collectives; one rank failing while the
others resume serves garbage. So with ``contract.reload(group=..., timeout=...)`` each rank prepares locally
(restore + verify), then :func:`agree` gives every rank the worst status of the group (``FAILED`` >
``NEEDS_RECAPTURE`` > ``COMMITTED``) before anyone commits, recaptures or raises.

How ranks exchange (one round per reload, through the group's key-value store, never a collective):

1. Each rank takes the next round number from its own counter in the store (``next/<rank>``). Round *n* pairs the
   *n*-th group reload of every rank, so ranks must make the same sequence of group reloads; the contract makes a
   rank that refuses to begin a reload still take part (as ``FAILED``), which keeps the counters paired.
2. It posts a short JSON summary under ``<n>/rank/<rank>``: status, mode, problem count, the error's ``repr`` and
   the first :data:`SUMMARY_FINDINGS` findings (kind, layer, path, detail).
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

Extension point: :class:`AgreementGroup` names the ranks and the store. :func:`agreement_group` builds one from a
``torch.distributed`` process group (``None`` and ``dist.group.WORLD`` mean the default group); an adapter whose
ranks are not a torch process group (vLLM's ``StatelessProcessGroup``, for example) passes its own
``AgreementGroup(store, rank, world_size, name)`` as ``group=``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from graphsafe.errors import GraphSafeError
from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, Status

__all__ = ["DEFAULT_TIMEOUT", "SUMMARY_FINDINGS", "AgreementGroup", "agree", "agreement_group"]

#: How long a rank waits for its peers when ``timeout`` is ``None``.
DEFAULT_TIMEOUT = timedelta(seconds=300)
#: How many findings of a rank travel to its peers (the rest are counted).
SUMMARY_FINDINGS = 5
_DETAIL_CHARS = 400
_PREFIX = "graphsafe/agree"


@dataclass(frozen=True, slots=True)
class AgreementGroup:
    """The ranks that must agree on a reload, and the key-value store they agree through.

    ``name`` namespaces the keys: two groups sharing a store must have different names, and every rank of one
    group must use the same name. ``rank`` is the rank within the group (``0 .. world_size - 1``).
    """

    store: Store = field(repr=False)
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


def agreement_group(group: Any = None) -> AgreementGroup:
    """The :class:`AgreementGroup` of ``group``: ``None`` or ``dist.group.WORLD`` (the default group), a
    ``torch.distributed`` process group (its ranks in group numbering, keys under its group name in the default
    store), or an :class:`AgreementGroup` (returned as is)."""
    if isinstance(group, AgreementGroup):
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise GraphSafeError(
            "rank agreement needs torch.distributed initialised (init_process_group) before the reload, "
            "or an AgreementGroup with its own store"
        )
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group() if group is None or group is dist.GroupMember.WORLD else group
    rank = dist.get_rank(pg)
    if rank < 0:
        raise GraphSafeError(f"this process (global rank {dist.get_rank()}) is not a member of group {pg!r}")
    name = getattr(pg, "group_name", None) or ",".join(map(str, dist.get_process_group_ranks(pg)))
    return AgreementGroup(c10d._get_default_store(), rank, dist.get_world_size(pg), str(name))


def agree(local: ReloadOutcome, *, group: Any = None, timeout: float | timedelta | None = None) -> ReloadOutcome:
    """Every rank of ``group`` passes its locally prepared outcome; every rank gets the group's outcome.

    The result is ``local`` with the worst status of the group, ``rank_statuses`` (each rank's own status, and
    ``FAILED`` for ranks that did not arrive) and, appended to ``local.findings``, the findings of the ranks that
    did not commit, with ``rank`` set. A rank that does not arrive within ``timeout`` (seconds or a
    ``timedelta``; ``None``: :data:`DEFAULT_TIMEOUT`) fails the reload on every rank, itself included when it
    finally arrives (it then returns at once). Never raises for a peer's failure: the contract turns a ``FAILED``
    outcome into the error.
    """
    seconds = _timeout_seconds(timeout)
    peers = agreement_group(group)
    if peers.world_size == 1:
        return replace(local, rank_statuses=((peers.rank, local.status),))
    result = _exchange(peers, json.dumps(_summary(local)), seconds)
    return _merge(local, peers, result, seconds)


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
    store = PrefixStore(f"{_PREFIX}/{peers.name}/{peers.world_size}/", peers.store)
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
        status, findings = _remote_findings(rank, result.summaries[rank])
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
