"""The unseen-write rule (a watched slot still at its captured memory whose values changed by no write a recorded
reload saw, in a layer whose load it saw, is judged by its inputs) and the recording's place on the dispatch-mode
stack (``Dataflow.stop``/``abandon``, ``ReloadTransaction._stop_recording``, ``record_inputs()``): a slot given new
memory is ``moved``, not blamed on an unseen write; a rewrite the recording cannot count fails closed with what to do;
a recording another mode took off the stack counts for nothing, one finished on another thread still counts."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode

from contract.test_partial_refresh import N, _Slot
from graphsafe import FindingKind, GraphContract, ReloadFailedError, Status
from graphsafe.errors import GraphSafeError


class _User(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _new() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(7))


@pytest.fixture(autouse=True)
def _clean_stack():
    yield
    while _get_current_dispatch_mode_stack():
        _pop_mode()


def _details(outcome) -> list[str]:
    return [f"{f.kind.value}: {f.detail[:110]}" for f in outcome.findings]


# --- 1. a slot given new memory is moved, not an unseen write -------------------------------------------------------


@pytest.mark.parametrize(
    "move",
    [
        lambda layer, v: setattr(layer.s, "data", v.clone()),  # `param.data = new`, common in PWAL code
        lambda layer, v: layer.s.set_(v.clone()),
        lambda layer, v: torch.utils.swap_tensors(layer.s, v.clone()),
    ],
    ids=["data_assign", "set_", "swap_tensors"],
)
def test_a_slot_given_new_storage_in_place_is_moved_not_stale(move) -> None:
    """PWAL gives the slot's own tensor object new storage holding exactly the right values (``.data =``, ``set_``,
    ``swap_tensors``); the graph still reads the old memory. The object left its captured memory, whose writes the
    recording watched: ``moved`` (a recapture serves it), not a write the recording could not see."""
    layer = _Slot()
    graph_view = layer.s.detach().view(-1)  # what a captured graph keeps reading
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    v = _new()
    try:
        with contract.reload(), torch.no_grad():
            layer.w.data.copy_(v)
            move(layer, v * 2)
    except (ReloadFailedError, GraphSafeError):
        pass
    outcome = contract.last_outcome
    assert torch.equal(layer.s, v * 2)  # the model holds the right values
    assert graph_view.data_ptr() != layer.s.data_ptr()
    assert not any(f.kind is FindingKind.STALE for f in outcome.findings), _details(outcome)
    assert outcome.status is Status.NEEDS_RECAPTURE, (outcome.status, _details(outcome))


# --- 2. rewrites the recording cannot count fail closed, saying what to do ------------------------------------------


def _in_thread(layer, v):
    t = threading.Thread(target=lambda: layer.s.copy_(v))
    t.start()
    t.join()


_FILL = None


def _custom_op(layer, v):
    global _FILL
    if _FILL is None:

        @torch.library.custom_op("graphsafe_tests::fill_from", mutates_args=("dst",))
        def fill_from(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst.copy_(src)

        _FILL = fill_from
    _FILL(layer.s, v)


@pytest.mark.parametrize(
    "write",
    [
        lambda layer, v: layer.s.numpy().__setitem__(slice(None), v.numpy()),
        _in_thread,
        _custom_op,
    ],
    ids=["numpy_whole", "thread_whole", "custom_op_whole"],
)
def test_a_whole_rewrite_the_recording_cannot_count_fails_closed_with_what_to_do(write) -> None:
    """PWAL rewrites the whole slot in place with the right values where the recording cannot count it: through a
    NumPy view, on a worker thread while the load ran on the recording's (its writes unseen: how much of the slot
    is new nothing says), or through a ``torch.library`` custom op with ``mutates_args`` (its mutable argument may be
    read: nothing provably new). The GPU twin is a raw Triton or CUDA launch. Not committed (a false alarm where the
    values are right: the price of a write nothing can count), and the finding says what to do."""
    layer = _Slot()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    captured, v = layer.s, _new()
    try:
        with contract.reload(), torch.no_grad():
            layer.w.data.copy_(v)
            write(layer, v * 2)
    except (ReloadFailedError, GraphSafeError):
        pass
    assert torch.equal(captured, v * 2)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED
    assert any(
        f.kind is FindingKind.STALE and "(or rebuild it as a new tensor)" in f.detail for f in outcome.findings
    ), _details(outcome)


# --- 3. the recording's place on the dispatch-mode stack ------------------------------------------------------------


def test_a_recording_a_user_mode_took_off_the_stack_counts_for_nothing() -> None:
    """The user enters their own dispatch mode, begins the reload (graphsafe pushes its recording on top), then exits
    their mode before PWAL: torch's ``__exit__`` pops the top mode, graphsafe's recording (the user's own stays on,
    torch's doing). The recording missed PWAL: it counts for nothing (the reload is judged as an unrecorded one) and
    is not popped again, rather than blaming PWAL's torch-op rewrite on an unseen write."""
    layer = _Slot()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    v, user = _new(), _User()
    user.__enter__()
    txn = contract.reload()
    txn.__enter__()
    with torch.no_grad():
        layer.w.data.copy_(v)
        user.__exit__(None, None, None)
        layer.s.copy_(v * 2)
    with contextlib.suppress(ReloadFailedError):
        txn.__exit__(None, None, None)
    assert any(m is user for m in _get_current_dispatch_mode_stack())  # torch's semantics, not graphsafe's
    assert contract.last_outcome is not None
    assert contract.last_outcome.status is Status.COMMITTED, _details(contract.last_outcome)


def test_record_inputs_of_another_contract_closed_while_a_reload_is_open() -> None:
    """Contract B's ``record_inputs()`` block is open, contract A's reload begins inside it and B's block closes
    before A's PWAL (not nested: a draft model set up while the target model reloads). B's recording, under A's,
    is abandoned where it lies (its exit must not pop A's), A records its PWAL and commits, and nothing is left on
    the stack."""
    a, b = _Slot(), _Slot()
    ca = GraphContract(a, "recapture", detect="declared-only").seal()
    cb = GraphContract(b, "recapture", detect="declared-only")
    v = _new()
    recording = cb.record_inputs()
    recording.__enter__()
    txn = ca.reload()
    txn.__enter__()
    recording.__exit__(None, None, None)
    with torch.no_grad():
        a.w.data.copy_(v)
        a.s.copy_(v * 2)
    with contextlib.suppress(ReloadFailedError):
        txn.__exit__(None, None, None)
    left = _get_current_dispatch_mode_stack()
    assert ca.last_outcome.status is Status.COMMITTED, _details(ca.last_outcome)
    assert left == [], f"modes left on the stack: {left}"


# --- 4. a reload finished on another thread still counts what its recording saw -------------------------------------


def test_a_partial_refresh_finished_on_another_thread_is_not_committed() -> None:
    """``record_reloads="every"``; the reload begins on the main thread (the recording sees the whole load and
    PWAL there) and is finished from a worker thread (an executor). The recording cannot leave the main thread's
    stack from there, but what it saw counts: the half refresh is stale, as when finished on the main thread."""
    layer = _Slot()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    contract.record_reloads = "every"
    captured, v = layer.s, _new()
    txn = contract.reload()
    txn.__enter__()
    with torch.no_grad():
        layer.w.data.copy_(v)
        layer.s[: N // 2].copy_(v[: N // 2] * 2)  # PWAL forgets the second half
    thread = threading.Thread(target=_finish, args=(txn,))
    thread.start()
    thread.join()
    stale = int((captured != v * 2).sum())
    assert not (contract.last_outcome.status is Status.COMMITTED and stale), f"COMMITTED with {stale} stale elements"


def _finish(txn) -> None:
    with contextlib.suppress(ReloadFailedError, GraphSafeError):
        txn.__exit__(None, None, None)
