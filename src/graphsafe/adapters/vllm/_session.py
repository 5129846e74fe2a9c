"""One reload of one model under its contract: open, fail, finish, record; and which runner owns a model.

The hooks in :mod:`graphsafe.adapters.vllm._hooks` call these at vLLM's lifecycle points; nothing here knows
which vLLM function it is called from.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

from torch import nn

from graphsafe.adapters.distributed import agreement
from graphsafe.adapters.vllm._guard import vllm_module
from graphsafe.adapters.vllm._state import AdapterState, Session
from graphsafe.contract import GraphContract
from graphsafe.errors import ContractViolation, GraphSafeError
from graphsafe.outcome import Finding, FindingKind, ReloadOutcome, Status

__all__ = ["abort", "begin", "bind", "ensure_contract", "finish", "rejected"]

log = logging.getLogger("graphsafe.vllm")


def _tp_group() -> Any:
    """vLLM's tensor-parallel CPU group when TP > 1 (ranks then agree on one outcome), else ``None``."""
    try:
        parallel_state = vllm_module("vllm.distributed.parallel_state")
    except ImportError:
        return None
    try:
        group = parallel_state.get_tp_group()
    except AssertionError:  # model parallel not initialised: a single process
        return None
    if group.world_size <= 1:
        return None
    return group.cpu_group


def ensure_contract(state: AdapterState, model: nn.Module) -> GraphContract:
    """The contract of ``model``, created and sealed now if it has none."""
    contract = state.contracts.get(model)
    if contract is not None:
        return contract
    from graphsafe.adapters.vllm._recapture import graphless_reason, recapture_callback

    mode = state.config.mode
    assert mode != "off"
    if state.pack is not None:
        from graphsafe.adapters.vllm._pack import declare_loaded

        declare_loaded(state.pack, model)  # a model loaded before the plugin was on: its PWAL ran undeclared
    contract = GraphContract(model, mode=mode, detect=state.config.detect, record_reloads=state.config.record_reloads)
    contract.on_recapture(recapture_callback(state, model))
    contract.graphless = graphless_reason(state, model)
    contract.seal()
    state.contracts[model] = contract
    log.info("graphsafe: sealed %s (%d slots, mode=%s)", type(model).__name__, sum(1 for _ in contract.slots()), mode)
    return contract


def begin(state: AdapterState, model: nn.Module, *, layerwise: bool = True) -> Session:
    """Open the reload transaction of ``model``, settling first one that was opened and never finalized.
    ``layerwise=False``: one whole-model transaction, snapshotted now (a reload vLLM runs without its layerwise
    hooks: weights copied in kernel format).

    vLLM may initialize a reload and put the layers back itself, with no finalize: the sharded RDT weight-transfer
    engine bakes its plan that way, and a caller may drop an initialize whose layers were all processed. The open
    transaction is then settled by what is true: :func:`finish` restores and verifies every layer as it is now,
    so layers vLLM processed or put back commit, and only what really drifted fails (and, failing, refuses this
    reload as any failed reload does).
    """
    stale = state.sessions.get(model)
    if stale is not None:
        log.info(
            "graphsafe: a reload of %s began before the previous one was finalized; settling it", type(model).__name__
        )
        with contextlib.suppress(ContractViolation):  # recorded by finish(); the begin() below then refuses
            finish(state, stale)
    contract = ensure_contract(state, model)
    group = _tp_group()
    txn = contract.reload(layerwise=layerwise, agreement=agreement(group) if group is not None else None)
    txn.begin()  # NotServingSafeError propagates: fail closed until reseal/recapture
    session = Session(weakref.ref(model), contract, txn)
    state.sessions[model] = session
    return session


def _close(state: AdapterState, session: Session) -> None:
    model = session.model_ref()
    if model is not None and state.sessions.get(model) is session:
        del state.sessions[model]
    for layer, owner in list(state.layer_sessions.items()):
        if owner is session:
            del state.layer_sessions[layer]
    if state.initializing is session:
        state.initializing = None


def abort(state: AdapterState, session: Session, error: BaseException) -> None:
    """Finish ``session`` as failed because the reload raised ``error`` (the caller re-raises it)."""
    _close(state, session)
    outcome: ReloadOutcome | None
    try:
        outcome = session.txn.finish(error=error)
    except ContractViolation as violation:  # e.g. rank agreement failed on top
        outcome = violation.outcome
    if outcome is not None:
        _record(state, session, outcome)


def finish(state: AdapterState, session: Session) -> ReloadOutcome:
    """Finish ``session``: restore what is left, verify, agree, then commit, recapture or raise."""
    _close(state, session)
    try:
        outcome = session.txn.finish()
    except ContractViolation as violation:
        if violation.outcome is not None:
            _record(state, session, violation.outcome)
        raise
    _record(state, session, outcome)
    return outcome


def rejected(state: AdapterState, model: nn.Module, error: Exception, *, finished: bool) -> None:
    """vLLM raised ``error`` out of a reload of ``model`` that graphsafe had no open transaction for: the reload
    is ``FAILED``, carrying vLLM's error.

    ``finished``: a transaction ended during the call (vLLM finalized, then rejected the reload, as expert
    substitution does after putting the old weights back). Its verification stands: the contract stays as that
    transaction left it (serving-safe when every slot was verified), and only the outcome changes. With none
    finished, vLLM refused before the model was touched. graphsafe's own errors (a refusal, a strict violation)
    already carry their outcome.
    """
    contract = state.contracts.get(model)
    if contract is None or isinstance(error, GraphSafeError):
        return
    last = contract.last_outcome
    if last is not None and last.error is error:
        return  # recorded already, by the wrapper of an inner call
    findings = tuple(last.findings) if finished and last is not None else ()
    failure = Finding(
        FindingKind.RELOAD_ERROR,
        layer="",
        layer_class=type(model).__name__,
        path="",
        declared=True,
        detail=f"vLLM rejected the reload: {error!r}",
    )
    outcome = ReloadOutcome(
        Status.FAILED,
        contract.mode,
        findings=(*findings, failure),
        slots_restored=last.slots_restored if finished and last is not None else 0,
        bytes_copied=last.bytes_copied if finished and last is not None else 0,
        layers=last.layers if finished and last is not None else 0,
        error=error,
    )
    contract.last_outcome = outcome
    session = Session(weakref.ref(model), contract, contract.reload(layerwise=True, agreement=None))
    _record(state, session, outcome)


def _record(state: AdapterState, session: Session, outcome: ReloadOutcome) -> None:
    from graphsafe.adapters.vllm._report import build_report, write_report

    state.last_outcome = outcome
    report = build_report(state, session, outcome)
    state.last_report = report
    if state.config.report_path:
        try:
            write_report(state.config.report_path, report)
        except OSError as exc:  # the report is an aid; never mask the reload's own result
            log.warning("graphsafe: could not write the reload report to %s: %s", state.config.report_path, exc)
    log.info("graphsafe: %s", outcome.summary().splitlines()[0])


def bind(state: AdapterState, model: nn.Module, runner: Any = None, worker: Any = None) -> None:
    """Bind ``model`` to the vLLM model runner (and worker) that capture its graphs."""
    if runner is not None:
        state.runners[model] = weakref.ref(runner)
    if worker is not None:
        state.workers[model] = weakref.ref(worker)
