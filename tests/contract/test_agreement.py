"""Rank agreement (``graphsafe.contract.StoreAgreement``): one outcome for all ranks, coordinated recapture, timeouts.

Two kinds of tests. In-process ones run the agreement protocol on threads sharing a ``HashStore`` (cheap, exact
control of arrival order). Spawned ones run 2-4 real processes on gloo (CPU) with ``torch.distributed``
initialised: each rank owns a shard with a declared derived tensor (re-created by every PWAL) and an undeclared
scratch tensor, seals a ``GraphContract`` and reloads DIFFERENT weights under ``contract.reload(group=...)``.
Every process has a hard deadline: a hung rank fails the test, it never hangs the suite.
"""

from __future__ import annotations

import json
import re
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

from _ranks import on_threads
from graphsafe import (
    ContractViolation,
    DeclaredDriftError,
    Finding,
    FindingKind,
    GraphContract,
    GraphSafeError,
    NotServingSafeError,
    RankAgreementError,
    ReloadOutcome,
    Status,
    graph_visible,
)
from graphsafe.adapters.distributed import agreement, agreement_group
from graphsafe.contract import SUMMARY_FINDINGS, AgreementGroup, StoreAgreement

C, R, F = Status.COMMITTED, Status.NEEDS_RECAPTURE, Status.FAILED


# ----------------------------------------------------------------------------------------------------
# A model shard: one declared derived tensor, one undeclared scratch tensor
# ----------------------------------------------------------------------------------------------------


class Shard(nn.Module):
    """One rank's shard. PWAL re-creates ``weight_t`` (declared) on every run; ``scratch`` (undeclared) is
    allocated once unless a fault asks PWAL to re-create it."""

    weight_t: torch.Tensor

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3 + rank, 4), requires_grad=False)  # shards differ in shape
        self.t_dtype = torch.float32

    @graph_visible("weight_t")
    def process_weights_after_loading(self, fault: str | None = None) -> None:
        if fault == "raise":
            raise ValueError("shard checkpoint is corrupt")
        if fault == "respecify":
            self.t_dtype = torch.float64  # the declared slot changes dtype: only a recapture fixes that
        self.weight_t = self.weight.detach().t().contiguous().to(self.t_dtype)
        if fault == "undeclared" or not hasattr(self, "scratch"):
            self.scratch = torch.zeros(8)


def _load(model: Shard, seed: int, fault: str | None = None) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=generator))
    model.process_weights_after_loading(fault=fault)


def _shard(rank: int, mode: str = "recapture", detect: str = "declared-only") -> tuple[Shard, GraphContract]:
    model = Shard(rank)
    contract = GraphContract(model, mode, detect=detect)  # type: ignore[arg-type]
    with contract.record_inputs():  # the contract learns that PWAL makes the undeclared scratch from nothing
        _load(model, seed=rank)
    return model, contract.seal()


# ----------------------------------------------------------------------------------------------------
# In-process: the protocol on threads
# ----------------------------------------------------------------------------------------------------


def _finding(kind: FindingKind, path: str, detail: str = "") -> Finding:
    return Finding(kind, layer="layers.0", layer_class="QuantLinear", path=path, declared=True, detail=detail)


def _local(status: Status, findings: tuple[Finding, ...] = (), error: BaseException | None = None) -> ReloadOutcome:
    return ReloadOutcome(status, "recapture", findings=findings, error=error)


@pytest.mark.timeout(30)
def test_the_worst_status_wins_and_every_rank_learns_who_did_not_commit() -> None:
    local = {
        0: _local(C),
        1: _local(R, (_finding(FindingKind.MOVED, "weight_t", "moved to new storage"),)),
        2: _local(F, (_finding(FindingKind.RELOAD_ERROR, "", "the reload raised ValueError('bad shard')"),)),
    }
    results = on_threads(3, lambda g: StoreAgreement(g, 10)(local[g.rank]))
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, ReloadOutcome), outcome
        assert outcome.status is F
        assert outcome.rank_statuses == ((0, C), (1, R), (2, F))
        assert outcome.findings[: len(local[rank].findings)] == local[rank].findings  # own findings first, as is
        remote = {(f.rank, f.kind, f.path) for f in outcome.findings if f.rank is not None}
        peers_problems = {(1, FindingKind.MOVED, "weight_t"), (2, FindingKind.RELOAD_ERROR, "")}
        assert remote == {p for p in peers_problems if p[0] != rank}  # a rank's own findings keep rank=None
    assert "bad shard" in " ".join(f.describe() for f in results[0].findings)


@pytest.mark.timeout(30)
def test_recapture_on_one_rank_is_recapture_on_all_and_clean_ranks_stay_committed() -> None:
    moved = _local(R, (_finding(FindingKind.RESPECIFIED, "weight_t"),))
    results = on_threads(4, lambda g: StoreAgreement(g, 10)(moved if g.rank == 2 else _local(C)))
    assert [o.status for o in results] == [R] * 4
    assert all(o.rank_statuses == ((0, C), (1, C), (2, R), (3, C)) for o in results)
    assert [f.rank for f in results[0].findings] == [2]

    clean = on_threads(3, lambda g: StoreAgreement(g, 10)(_local(C)))
    assert [o.status for o in clean] == [C] * 3
    assert all(o.findings == () for o in clean)


@pytest.mark.timeout(30)
def test_a_failed_rank_without_an_error_finding_is_still_named_by_a_reload_error() -> None:
    strict_drift = ReloadOutcome(F, "strict", findings=(_finding(FindingKind.MOVED, "scale"),))
    results = on_threads(2, lambda g: StoreAgreement(g, 10)(strict_drift if g.rank == 1 else _local(C)))
    kinds = [(f.rank, f.kind) for f in results[0].findings]
    assert kinds == [(1, FindingKind.RELOAD_ERROR), (1, FindingKind.MOVED)]
    assert "strict mode" in results[0].findings[0].detail


@pytest.mark.timeout(30)
def test_only_the_first_findings_travel_and_the_rest_are_counted() -> None:
    many = tuple(_finding(FindingKind.MOVED, f"slot{i}") for i in range(SUMMARY_FINDINGS + 7))
    results = on_threads(2, lambda g: StoreAgreement(g, 10)(_local(R, many) if g.rank == 1 else _local(C)))
    remote = [f for f in results[0].findings if f.rank == 1]
    assert [f.path for f in remote] == [f"slot{i}" for i in range(SUMMARY_FINDINGS)]
    assert "+7 more on rank 1" in remote[-1].detail
    assert len(results[1].findings) == len(many)  # the rank's own findings are never cut


@pytest.mark.timeout(30)
def test_successive_rounds_do_not_see_each_others_summaries() -> None:
    def two_rounds(group: AgreementGroup) -> list[Status]:
        first = StoreAgreement(group, 10)(_local(F if group.rank == 1 else C))
        second = StoreAgreement(group, 10)(_local(C))
        third = StoreAgreement(group, 10)(_local(R if group.rank == 0 else C))
        return [first.status, second.status, third.status]

    assert on_threads(3, two_rounds) == [[F, C, R]] * 3


@pytest.mark.timeout(30)
def test_a_missing_rank_fails_the_round_and_a_late_rank_fails_at_once_without_waiting() -> None:
    timeout = 0.4
    elapsed: dict[int, float] = {}
    gave_up = threading.Barrier(3, timeout=20)  # rank 2 arrives only once ranks 0 and 1 have given up

    def run(group: AgreementGroup) -> tuple[ReloadOutcome, ReloadOutcome]:
        if group.rank == 2:
            gave_up.wait()
        start = time.monotonic()
        first = StoreAgreement(group, timeout)(_local(C))
        elapsed[group.rank] = time.monotonic() - start
        if group.rank != 2:
            gave_up.wait()
        # The next round pairs the ranks again: the late rank is not out of step.
        second = StoreAgreement(group, 5)(_local(C))
        return first, second

    results = on_threads(3, run)
    for rank, (first, second) in enumerate(results):
        assert first.status is F, rank
        assert (2, F) in first.rank_statuses
        assert [f.rank for f in first.findings] == [2]
        assert second.status is C
    assert "did not reach the agreement within 0.4 s" in results[0][0].findings[0].detail
    assert "gave up waiting for rank(s) 2" in results[2][0].findings[0].detail
    assert elapsed[2] < timeout  # the late rank read the decision and did not wait
    assert timeout * 0.9 <= elapsed[0] < timeout + 2.0  # a correctness bound, not a benchmark


@pytest.mark.timeout(30)
def test_a_late_rank_does_not_wait_for_a_peer_that_never_comes() -> None:
    timeout = 0.4
    gave_up = threading.Barrier(2, timeout=20)  # rank 1 arrives only once rank 0 has given up

    def run(group: AgreementGroup) -> tuple[ReloadOutcome, float] | None:
        if group.rank == 2:
            return None  # crashed before the agreement: never arrives
        if group.rank == 1:
            gave_up.wait()
        start = time.monotonic()
        outcome = StoreAgreement(group, 5.0 if group.rank == 1 else timeout)(_local(C))
        elapsed = time.monotonic() - start
        if group.rank == 0:
            gave_up.wait()
        return outcome, elapsed

    on_time, late, _ = on_threads(3, run)
    assert on_time[0].status is F and late[0].status is F
    assert {f.rank for f in on_time[0].findings} == {1, 2}
    assert "gave up waiting for rank(s) 1, 2" in late[0].findings[0].detail
    assert late[1] < 2.0  # read rank 0's decision instead of waiting 5 s for rank 2


@pytest.mark.timeout(30)
def test_an_unreadable_peer_summary_reads_as_a_failed_rank() -> None:
    store = dist.HashStore()
    # A peer on a broken build wrote garbage where its summary belongs (agreement step 0, rank 1).
    store.set("graphsafe/agree/garbled/2/0/rank/1", b"\xff not json")
    outcome = StoreAgreement(AgreementGroup(store, 0, 2, "garbled"), 5)(_local(C))
    assert outcome.status is F
    assert [(f.rank, f.kind) for f in outcome.findings] == [(1, FindingKind.RELOAD_ERROR)]
    assert "could not be read" in outcome.findings[0].detail


def test_single_rank_group_agrees_with_itself_and_bad_arguments_are_refused() -> None:
    store = dist.HashStore()
    outcome = StoreAgreement(AgreementGroup(store, 0, 1, "solo"), 1)(_local(R))
    assert outcome.status is R and outcome.rank_statuses == ((0, R),)
    for bad in (0, -1.0, timedelta(0), float("nan")):
        with pytest.raises(ValueError, match="timeout must be positive"):
            StoreAgreement(AgreementGroup(store, 0, 1, "solo"), bad)
    with pytest.raises(ValueError, match="outside"):
        AgreementGroup(store, 2, 2, "g")
    with pytest.raises(ValueError, match="name"):
        AgreementGroup(store, 0, 2, "")


def test_a_process_group_needs_torch_distributed_initialised() -> None:
    assert not dist.is_initialized()
    with pytest.raises(GraphSafeError, match="init_process_group"):
        agreement_group(None)
    with pytest.raises(GraphSafeError, match="init_process_group"):
        agreement(dist.group.WORLD, timeout=1)


# ----------------------------------------------------------------------------------------------------
# In-process: the contract on threads (each thread a rank with its own shard and contract)
# ----------------------------------------------------------------------------------------------------


def _contract_reload(
    group: AgreementGroup, contract: GraphContract, model: Shard, seed: int, fault: str | None, timeout: float
) -> BaseException | None:
    try:
        with contract.reload(agreement=StoreAgreement(group, timeout)):
            _load(model, seed, fault)
    except Exception as exc:
        return exc
    return None


@pytest.mark.timeout(30)
def test_a_rank_that_refuses_to_begin_still_takes_part_so_rounds_stay_paired() -> None:
    def run(group: AgreementGroup) -> tuple[BaseException | None, float, Status, Status]:
        model, contract = _shard(group.rank)
        if group.rank == 1:
            contract.mark_unsafe("an earlier recapture failed on this rank")
        start = time.monotonic()
        refused = _contract_reload(group, contract, model, seed=10 + group.rank, fault=None, timeout=10)
        elapsed = time.monotonic() - start
        # The refusing rank has no outcome of its own for this reload (it never began one).
        first = contract.last_outcome.status if contract.last_outcome is not None else F
        contract.note_capture()  # every rank captures its graphs again, then reseals
        contract.reseal()
        again = _contract_reload(group, contract, model, seed=20 + group.rank, fault=None, timeout=10)
        assert again is None, again
        assert contract.last_outcome is not None
        return refused, elapsed, first, contract.last_outcome.status

    (error0, elapsed0, first0, second0), (error1, _, _, second1) = on_threads(2, run)
    assert isinstance(error1, NotServingSafeError)
    assert isinstance(error0, RankAgreementError)
    assert "because of rank(s) 1," in str(error0) and "NotServingSafeError" in str(error0)
    assert first0 is F
    assert elapsed0 < 5  # told by the refusing rank, not by the 10 s timeout
    assert second0 is C and second1 is C


class _FailingCopies(TorchFunctionMode):
    """On the thread that enters it: every copy raises (a restore that fails mid-way, as a CUDA error would)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if "copy" in getattr(func, "__name__", ""):
            raise RuntimeError(self.message)
        return func(*args, **(kwargs or {}))


def _group_reloads(plan: list[tuple[str, ...]], timeout: float = 3.0) -> list[list[str]]:
    """Run ``plan`` on threads: ``plan[k][r]`` is what rank ``r`` does at its ``k``-th group reload: ``ok``,
    ``raise`` (its load raises, naming ``k``), ``busy`` (``begin()`` raises before any agreement: a reload
    transaction without agreement is already open on its contract) or ``restore`` (``finish()``'s restore raises
    before the agreement, naming ``k``). Returns, per rank, what each reload ended as."""

    def run(group: AgreementGroup) -> list[str]:
        model, contract = _shard(group.rank)
        seen: list[str] = []
        for k, actions in enumerate(plan):
            if not contract.serving_safe:  # after a failed group reload every rank recaptures and reseals
                contract.note_capture()
                contract.reseal()
            action = actions[group.rank]
            side = contract.reload().begin() if action == "busy" else None
            failing = _FailingCopies(f"reload {k} failed on rank {group.rank}: a copy raised")
            try:
                with contract.reload(agreement=StoreAgreement(group, timeout)):
                    _load(model, seed=100 * k + group.rank)
                    if action == "raise":
                        raise ValueError(f"reload {k} failed on rank {group.rank}")
                    if action == "restore":
                        failing.__enter__()
                assert contract.last_outcome is not None
                seen.append(contract.last_outcome.status.value)
            except Exception as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
            finally:
                if action == "restore":
                    failing.__exit__(None, None, None)
                if side is not None:
                    side.finish()
        return seen

    return on_threads(len(plan[0]), run, limit=20 + timeout * len(plan))


def _assert_paired(plan: list[tuple[str, ...]], seen: list[Any]) -> None:
    """Every group reload k ends COMMITTED on every rank or on none, and no rank hears of a peer reload but k."""
    for rank, result in enumerate(seen):
        assert isinstance(result, list), f"rank {rank}: {result!r}"
    for k, actions in enumerate(plan):
        ends = [seen[r][k] for r in range(len(actions))]
        committed = [e == "committed" for e in ends]
        assert all(committed) or not any(committed), f"reload {k}: plan {actions}, ranks ended {ends}"
        if all(a == "ok" for a in actions):
            assert all(committed), f"reload {k}: every rank reloaded cleanly, yet ranks ended {ends}"
        for rank, end in enumerate(ends):
            heard = {int(n) for n in re.findall(r"reload (\d+) failed on rank", end)}
            assert heard <= {k}, f"reload {k} on rank {rank} describes peer reload(s) {sorted(heard)}: {end}"


@pytest.mark.timeout(60)
def test_a_rank_whose_begin_or_restore_raises_before_agreeing_keeps_later_rounds_paired() -> None:
    plan = [("ok", "busy"), ("ok", "ok"), ("ok", "raise"), ("ok", "ok"), ("busy", "ok"), ("raise", "ok")]
    plan += [("restore", "ok"), ("ok", "ok"), ("ok", "restore"), ("busy", "restore"), ("ok", "ok")]
    seen = _group_reloads(plan)
    _assert_paired(plan, seen)
    assert seen[1][0].startswith("GraphSafeError: ") and "already open" in seen[1][0]
    assert seen[0][0].startswith("RankAgreementError: ") and "because of rank(s) 1," in seen[0][0]


@pytest.mark.timeout(240)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(*[st.sampled_from(["ok", "ok", "raise", "busy", "restore"])] * 2),
        min_size=1,
        max_size=5,
    )
)
def test_any_sequence_of_early_and_late_failures_keeps_every_reload_all_or_nothing(
    plan: list[tuple[str, ...]],
) -> None:
    _assert_paired(plan, _group_reloads(plan))


@pytest.mark.timeout(30)
def test_a_rank_that_fails_on_its_own_keeps_its_own_error_class() -> None:
    def run(group: AgreementGroup) -> BaseException | None:
        model, contract = _shard(group.rank, mode="strict")
        fault = "respecify" if group.rank == 1 else None
        return _contract_reload(group, contract, model, seed=10 + group.rank, fault=fault, timeout=10)

    error0, error1 = on_threads(2, run)
    assert type(error1) is DeclaredDriftError  # its own drift, not an agreement problem
    assert "weight_t" in str(error1)
    assert type(error0) is RankAgreementError
    assert "because of rank(s) 1," in str(error0) and "weight_t" in str(error0)


# ----------------------------------------------------------------------------------------------------
# Spawned processes on gloo
# ----------------------------------------------------------------------------------------------------


def _attempt(
    contract: GraphContract,
    model: Shard,
    *,
    seed: int,
    timeout: float,
    fault: str | None = None,
    group: Any = None,
    before_load: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One group reload; what the rank saw, as JSON."""
    captured = model.weight_t.data_ptr()
    record: dict[str, Any] = {"error": None, "message": ""}
    body_end = None
    try:
        with contract.reload(agreement=agreement(dist.group.WORLD if group is None else group, timeout=timeout)):
            if before_load is not None:
                before_load()
            _load(model, seed, fault)
            body_end = time.monotonic()
    except Exception as exc:
        record["error"], record["message"] = type(exc).__name__, str(exc)
        record["contract_violation"] = isinstance(exc, ContractViolation)
    record["finish_s"] = time.monotonic() - body_end if body_end is not None else None
    outcome = contract.last_outcome
    assert outcome is not None
    record["status"] = outcome.status.value
    record["rank_statuses"] = [[r, s.value] for r, s in outcome.rank_statuses]
    record["remote"] = sorted({(f.rank, f.kind.value) for f in outcome.findings if f.rank is not None})
    record["serving_safe"] = contract.serving_safe
    record["kept_storage"] = model.weight_t.data_ptr() == captured
    record["values_ok"] = torch.equal(model.weight_t, model.weight.detach().t().to(model.t_dtype))
    return record


def _recaptures(contract: GraphContract, calls: list[dict[str, Any]]) -> None:
    def recapture(outcome: ReloadOutcome) -> None:
        calls.append(
            {
                "status": outcome.status.value,
                "rank_statuses": [[r, s.value] for r, s in outcome.rank_statuses],
                "remote": sorted({(f.rank, f.kind.value) for f in outcome.findings if f.rank is not None}),
            }
        )

    contract.on_recapture(recapture)


def _scenario_clean(rank: int, world: int, timeout: float, out: dict[str, Any]) -> None:
    model, contract = _shard(rank)
    out["world"] = [_attempt(contract, model, seed=seed + rank, timeout=timeout) for seed in (10, 20)]
    if world >= 3:
        # A subgroup without rank 0: its ranks are numbered 0..world-2 inside the group.
        sub = dist.new_group(list(range(1, world)))
        if rank >= 1:
            out["sub"] = _attempt(contract, model, seed=30 + rank, timeout=timeout, group=sub)
            out["sub_rank"] = dist.get_rank(sub)


def _scenario_drift(rank: int, world: int, timeout: float, out: dict[str, Any]) -> None:
    model, contract = _shard(rank, detect="every-reload")
    calls: list[dict[str, Any]] = []
    _recaptures(contract, calls)
    last = world - 1
    out["undeclared"] = _attempt(
        contract, model, seed=10 + rank, timeout=timeout, fault="undeclared" if rank == last else None
    )
    out["undeclared_calls"] = list(calls)
    calls.clear()
    out["declared"] = _attempt(
        contract, model, seed=20 + rank, timeout=timeout, fault="respecify" if rank == 0 else None
    )
    out["declared_calls"] = list(calls)
    calls.clear()
    out["after"] = _attempt(contract, model, seed=30 + rank, timeout=timeout)
    out["after_calls"] = list(calls)


def _scenario_raise(rank: int, world: int, timeout: float, out: dict[str, Any]) -> None:
    model, contract = _shard(rank)
    out["failed"] = _attempt(contract, model, seed=10 + rank, timeout=timeout, fault="raise" if rank == 1 else None)
    dist.barrier()
    contract.note_capture()  # every rank reloads in full, recaptures and reseals after a failed group reload
    contract.reseal()
    out["after"] = _attempt(contract, model, seed=20 + rank, timeout=timeout)


def _scenario_timeout(rank: int, world: int, timeout: float, out: dict[str, Any]) -> None:
    model, contract = _shard(rank)
    late = world - 1
    out["late_rank"] = late
    store = dist.distributed_c10d._get_default_store()
    gave_up = [f"test/gave-up/{r}" for r in range(world) if r != late]

    def until_the_others_gave_up() -> None:  # late for sure, however loaded the machine is
        store.wait(gave_up, timedelta(seconds=30))

    hook = until_the_others_gave_up if rank == late else None
    dist.barrier()  # start together, so only the late rank can miss the 2 s window
    out["first"] = _attempt(contract, model, seed=10 + rank, timeout=timeout, before_load=hook)
    if rank != late:
        store.set(gave_up[rank], "1")
    dist.barrier()
    contract.note_capture()  # every rank captures its graphs again, then reseals
    contract.reseal()
    out["after"] = _attempt(contract, model, seed=20 + rank, timeout=timeout)


SCENARIOS: dict[str, Callable[[int, int, float, dict[str, Any]], None]] = {
    "clean": _scenario_clean,
    "drift": _scenario_drift,
    "raise": _scenario_raise,
    "timeout": _scenario_timeout,
}


def _worker(rank: int, world: int, port: int, scenario: str, outdir: str, timeout: float) -> None:
    out: dict[str, Any] = {"rank": rank}
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
        SCENARIOS[scenario](rank, world, timeout, out)
    except BaseException:
        out["crash"] = traceback.format_exc()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world: int, scenario: str, tmp_path: Path, *, timeout: float, limit: float = 75.0) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` spawned ranks; every rank must finish within ``limit`` seconds."""
    # The parent hosts the store (port 0: no race for a free port); the ranks connect to it.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, world, server.port, scenario, str(tmp_path), timeout), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + limit
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    assert not hung, f"{scenario}: rank(s) {hung} did not finish within {limit} s"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    crashed = {r["rank"]: r["crash"] for r in results if "crash" in r}
    assert not crashed, f"{scenario}: rank(s) crashed:\n" + "\n".join(f"rank {k}:\n{v}" for k, v in crashed.items())
    return results


def _statuses(world: int, status: str, *, odd: dict[int, str] | None = None) -> list[list[Any]]:
    return [[r, (odd or {}).get(r, status)] for r in range(world)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_spawned_clean_reloads_commit_on_every_rank(world: int, tmp_path: Path) -> None:
    results = _spawn(world, "clean", tmp_path, timeout=20)
    for res in results:
        for attempt in res["world"]:
            assert attempt["error"] is None, attempt["message"]
            assert attempt["status"] == "committed"
            assert attempt["rank_statuses"] == _statuses(world, "committed")
            assert attempt["remote"] == []
            assert attempt["kept_storage"] and attempt["values_ok"] and attempt["serving_safe"]
    if world >= 3:
        for res in results[1:]:
            sub = res["sub"]
            assert sub["error"] is None, sub["message"]
            assert sub["status"] == "committed"
            assert sub["rank_statuses"] == _statuses(world - 1, "committed")  # group numbering, rank 0 absent
            assert res["sub_rank"] == res["rank"] - 1


@pytest.mark.timeout(120)
def test_spawned_drift_on_one_rank_recaptures_on_every_rank(tmp_path: Path) -> None:
    world = 4
    results = _spawn(world, "drift", tmp_path, timeout=20)
    for step, faulty, kind in (("undeclared", world - 1, "moved"), ("declared", 0, "respecified")):
        for res in results:
            attempt = res[step]
            assert attempt["error"] is None, attempt["message"]
            assert attempt["status"] == "needs_recapture"
            assert attempt["rank_statuses"] == _statuses(world, "committed", odd={faulty: "needs_recapture"})
            # Recaptured, then resealed: serving-safe again on every rank.
            assert attempt["serving_safe"]
            calls = res[f"{step}_calls"]
            assert len(calls) == 1, f"rank {res['rank']}: on_recapture ran {len(calls)} time(s) after {step}"
            assert calls[0]["status"] == "needs_recapture"
            expected_remote = [] if res["rank"] == faulty else [[faulty, kind]]
            assert calls[0]["remote"] == expected_remote
    for res in results:
        assert res["after"]["status"] == "committed" and res["after_calls"] == []
        assert res["after"]["kept_storage"] and res["after"]["values_ok"]


@pytest.mark.timeout(120)
def test_spawned_error_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    world = 4
    results = _spawn(world, "raise", tmp_path, timeout=20)
    for res in results:
        failed = res["failed"]
        assert failed["status"] == "failed"
        assert failed["rank_statuses"] == _statuses(world, "committed", odd={1: "failed"})
        assert not failed["serving_safe"]
        if res["rank"] == 1:
            # The failing rank re-raises its own error, untouched.
            assert failed["error"] == "ValueError" and failed["message"] == "shard checkpoint is corrupt"
        else:
            assert failed["error"] == "RankAgreementError" and failed["contract_violation"]
            assert "because of rank(s) 1," in failed["message"]
            assert "shard checkpoint is corrupt" in failed["message"]
            assert failed["remote"] == [[1, "reload-error"]]
        after = res["after"]
        assert after["error"] is None, after["message"]
        assert after["status"] == "committed" and after["kept_storage"] and after["values_ok"]


@pytest.mark.timeout(120)
def test_spawned_late_rank_fails_every_rank_within_the_timeout(tmp_path: Path) -> None:
    world, timeout, margin = 3, 2.0, 2.0
    results = _spawn(world, "timeout", tmp_path, timeout=timeout)
    late = results[0]["late_rank"]
    for res in results:
        first = res["first"]
        assert first["status"] == "failed"
        assert first["error"] == "RankAgreementError", first["message"]
        assert f"because of rank(s) {late}," in first["message"]
        assert not first["serving_safe"]
        if res["rank"] == late:
            assert "gave up waiting" in first["message"]
            assert first["finish_s"] < timeout  # it does not wait for peers that already gave up
        else:
            assert "did not reach the agreement within 2 s" in first["message"]
            # Correctness bound on the wait (not a speed benchmark): no earlier than the timeout, not much later.
            assert timeout * 0.9 <= first["finish_s"] < timeout + margin
        after = res["after"]
        assert after["error"] is None, after["message"]
        assert after["status"] == "committed"
