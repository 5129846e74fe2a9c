"""A loader's writes into the tensors ``after_layer()`` replaced (``_note_rebound`` / ``written_after_close``: a later
shard through a kept ``params`` dict is ``stale``, the same values written again, a reused scratch Parameter and a
shared staging buffer are not), the remap of attributes held elsewhere asking no class of the caller's anything, and
the recordings of every reload (``record_reloads="every"``) across interleaved contracts and threads.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, GraphContract, GraphSafeError, Status

N = 4
DETECTS = ("declared-only", "sealed-paths", "every-reload")


class _Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(N), requires_grad=False)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Leaf()
        self.b = _Leaf()


def _sealed() -> tuple[_Pair, GraphContract]:
    model = _Pair()
    return model, GraphContract(model, "strict", detect="declared-only").seal()


def _not_committed_while_stale(contract: GraphContract, model: _Pair, loaded: list[float]) -> None:
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert model.a.weight.tolist() == loaded, (
            f"COMMITTED while a.weight (the captured tensor the graph reads) is {model.a.weight.tolist()}; "
            f"the loader loaded {loaded}"
        )


# -- 1. the loader's params dict is gone by the time the reload finishes ---------------------------------------------
def _load_layerwise(model: _Pair, txn) -> dict[str, nn.Parameter]:  # type: ignore[no-untyped-def]
    """A loader's ``load_weights`` binding new Parameters and writing ``a``'s second shard after ``after_layer(a)``;
    its ``params`` dict is returned (a caller that drops it lets it go before ``finish``)."""
    params = {}
    for name in ("a", "b"):
        txn.before_layer(getattr(model, name))
    for name in ("a", "b"):
        layer = getattr(model, name)
        layer.weight = nn.Parameter(torch.zeros(N), requires_grad=False)
        params[name] = layer.weight
    with torch.no_grad():
        params["a"][:2] = 5.0  # shard 1
    txn.after_layer(model.a)
    with torch.no_grad():
        params["a"][2:] = 5.0  # shard 2: lands in the replaced new Parameter
        params["b"][:] = 6.0
    txn.after_layer(model.b)
    return params


def test_a_late_write_is_caught_even_when_the_loader_dropped_its_params_dict_before_finish() -> None:
    """The late shard of the last test in this file, but the loader's ``params`` dict is a local of its load
    function, gone when the reload finishes: the write is found at the next ``after_layer()``, while the dict still
    holds the replaced Parameter."""
    model, contract = _sealed()
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        _load_layerwise(model, txn)
    _not_committed_while_stale(contract, model, [5.0] * N)


# -- 2. the late write goes through .data (vLLM's default_weight_loader: param.data.copy_(w)) ------------------------
def test_a_late_write_through_dot_data_does_not_commit() -> None:
    """The loader keeps its ``params`` dict and writes the second shard through ``param.data`` (vLLM's
    ``default_weight_loader`` style), which moves no version counter of the Parameter: the reload's end compares the
    value samples and finds it."""
    model, contract = _sealed()
    params = {}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        txn.before_layer(model.b)
        model.a.weight = params["a"] = nn.Parameter(torch.zeros(N), requires_grad=False)
        params["a"].data[:2].copy_(torch.full((2,), 5.0))
        txn.after_layer(model.a)
        params["a"].data[2:].copy_(torch.full((2,), 5.0))  # shard 2, after the close
        txn.after_layer(model.b)
    _not_committed_while_stale(contract, model, [5.0] * N)


# -- 3. the loader runs under torch.inference_mode() -----------------------------------------------------------------
def test_a_late_write_into_an_inference_tensor_does_not_commit() -> None:
    """The loader builds and writes its new Parameters under ``torch.inference_mode()``: inference tensors count
    no writes; the reload's end compares the value samples and finds the second shard."""
    model, contract = _sealed()
    params = {}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        txn.before_layer(model.b)
        with torch.inference_mode():
            model.a.weight = params["a"] = nn.Parameter(torch.zeros(N), requires_grad=False)
            params["a"][:2] = 5.0
        txn.after_layer(model.a)
        with torch.inference_mode():
            params["a"][2:] = 5.0
        txn.after_layer(model.b)
    _not_committed_while_stale(contract, model, [5.0] * N)


# -- 4. false alarms: a late write that the captured tensor already holds, a scratch Parameter reused ----------------
def test_rewriting_the_same_values_after_close_is_no_stale_finding() -> None:
    """The loader writes the replaced Parameter again after ``after_layer(a)`` with the values it already had: the
    captured tensor holds them, so that is no finding."""
    model, contract = _sealed()
    params = {}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        txn.before_layer(model.b)
        model.a.weight = params["a"] = nn.Parameter(torch.zeros(N), requires_grad=False)
        with torch.no_grad():
            params["a"].fill_(5.0)
        txn.after_layer(model.a)
        with torch.no_grad():
            params["a"].fill_(5.0)  # the same values again
        txn.after_layer(model.b)
    outcome = contract.last_outcome
    assert outcome is not None
    assert model.a.weight.tolist() == [5.0] * N  # every captured read is right
    assert outcome.status is Status.COMMITTED, [(f.kind.name, f.layer, f.path) for f in outcome.findings]


def test_a_scratch_parameter_reused_for_the_next_layer_is_no_stale_finding() -> None:
    """A loader reuses one scratch Parameter: bound at ``a.weight``, filled, ``after_layer(a)`` copies it into
    a's captured tensor; then bound at ``b.weight`` and filled with b's values. It answers to ``b`` from then on:
    every captured tensor holds what a cold load gives, and that is no finding."""
    model, contract = _sealed()
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        txn.before_layer(model.b)
        scratch = nn.Parameter(torch.zeros(N), requires_grad=False)
        model.a.weight = scratch
        with torch.no_grad():
            scratch.fill_(5.0)
        txn.after_layer(model.a)
        model.b.weight = scratch
        with torch.no_grad():
            scratch.fill_(6.0)
        txn.after_layer(model.b)
    outcome = contract.last_outcome
    assert outcome is not None
    assert model.a.weight.tolist() == [5.0] * N and model.b.weight.tolist() == [6.0] * N
    assert outcome.status is Status.COMMITTED, [(f.kind.name, f.layer, f.path) for f in outcome.findings]


def test_a_write_into_the_next_layers_slice_of_a_shared_staging_buffer_is_no_stale_finding() -> None:
    """The loader stages every weight in one flat buffer and binds ``nn.Parameter(flat[i*N:(i+1)*N])`` views of
    it (one version counter for all): writing b's slice after ``after_layer(a)`` moves a's counter too, but a's
    values are the captured ones, so that is no finding."""
    model, contract = _sealed()
    params = {}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        txn.before_layer(model.b)
        flat = torch.zeros(2 * N)
        model.a.weight = params["a"] = nn.Parameter(flat[:N], requires_grad=False)
        model.b.weight = params["b"] = nn.Parameter(flat[N:], requires_grad=False)
        with torch.no_grad():
            flat[:N] = 5.0
        txn.after_layer(model.a)
        with torch.no_grad():
            flat[N:] = 6.0  # b's slice only
        txn.after_layer(model.b)
    outcome = contract.last_outcome
    assert outcome is not None
    assert model.a.weight.tolist() == [5.0] * N and model.b.weight.tolist() == [6.0] * N
    assert outcome.status is Status.COMMITTED, [(f.kind.name, f.layer, f.path) for f in outcome.findings]


# -- 5. remap_held_elsewhere: an attribute value whose class lookup raises ------------------------------------------
class _Lazy:
    """A user's lazy proxy: ``__class__`` evaluates a factory, which fails here (legal Python)."""

    @property
    def __class__(self):  # type: ignore[no-untyped-def, override]
        raise RuntimeError("lazy factory failed")


def test_a_lazy_proxy_in_another_layers_tensor_attributes_does_not_break_the_reload() -> None:
    """Layer ``b``'s weight carries a user attribute whose ``__class__`` property raises (legal Python): the
    remap of attributes naming a replaced tensor asks no value for its class, and nothing raises."""
    model, contract = _sealed()
    params = {}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        model.a.weight = params["a"] = nn.Parameter(torch.full((N,), 3.0), requires_grad=False)
        model.b.weight.meta = _Lazy()
        txn.after_layer(model.a)
    assert contract.last_outcome is not None


# -- 6. every reload recorded: two contracts reloaded interleaved (a draft and a target model) -------------------------
class _Partial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from graphsafe import register_derived

        self.w = nn.Parameter(torch.randn(8192), requires_grad=False)
        self.s = self.w.detach() * 2
        register_derived(self, "s", self.s, derived_from="w")


def test_a_recording_counts_a_partial_refresh_when_another_contract_finishes_first() -> None:
    """Two models (a draft and a target), each with its own contract recording every reload, reloaded together
    in one thread: A begins, B begins, A finishes, then B's PWAL refreshes half of ``s`` in place and B finishes.
    A's recording, under B's, is abandoned where it lies rather than popping B's; B counts its half refresh
    (``stale``) and A commits."""
    a, b = _Partial(), _Partial()
    ca = GraphContract(a, "recapture", detect="declared-only").seal()
    cb = GraphContract(b, "recapture", detect="declared-only").seal()
    ca.record_reloads = cb.record_reloads = "every"
    ta, tb = ca.reload(), cb.reload()
    ta.begin()
    tb.begin()
    with torch.no_grad():
        a.w.copy_(torch.randn(8192))
        a.s.copy_(a.w * 2)
        new = torch.randn(8192)
        b.w.copy_(new)
    ta.finish()
    with torch.no_grad():
        b.s[:4096].copy_((b.w * 2)[:4096])  # B's PWAL refreshes half of s in place
    with contextlib.suppress(GraphSafeError):  # recapture mode raises where the reload failed
        tb.finish()
    outcome = cb.last_outcome
    assert outcome is not None
    assert outcome.status is not Status.COMMITTED or torch.equal(b.s, new * 2), (
        "COMMITTED with b.s (what the graph reads) half stale"
    )
    assert ca.last_outcome is not None and ca.last_outcome.status is Status.COMMITTED, ca.last_outcome


def test_recording_every_reload_leaves_no_dispatch_modes_behind_when_finish_runs_in_another_thread() -> None:
    """A server begins each reload on its event-loop thread and finishes it from a worker thread: a dispatch mode
    can only be popped on the thread that pushed it, so each finish leaves its recording there, inert. The next
    reload begun on that thread pops it: with every reload recorded at most one is ever left (else every eager op
    of the thread would run through one more mode per reload)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    layer = _Partial()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    contract.record_reloads = "every"
    before = len(_get_current_dispatch_mode_stack())
    try:
        _reload_five_times_finishing_in_a_worker(contract, layer)
        left = len(_get_current_dispatch_mode_stack()) - before
    finally:  # leave this thread's stack as it was for the tests after this one
        from torch.utils._python_dispatch import _pop_mode

        while len(_get_current_dispatch_mode_stack()) > before:
            _pop_mode()
    assert left <= 1, f"{left} inert graphsafe dispatch modes left on the thread that began the reloads"


def _reload_five_times_finishing_in_a_worker(contract: GraphContract, layer: _Partial) -> None:
    for _ in range(5):
        txn = contract.reload()
        txn.begin()
        with torch.no_grad():
            layer.w.copy_(torch.randn(8192))
            layer.s.copy_(layer.w * 2)
        worker = threading.Thread(target=txn.finish)
        worker.start()
        worker.join()
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.COMMITTED


@pytest.mark.parametrize("detect", DETECTS)
def test_a_write_into_a_replaced_tensor_after_its_after_layer_does_not_commit(detect: str) -> None:
    """A layerwise loader binds new Parameters and keeps them in its own ``params`` dict (the usual
    ``params[name].copy_(shard)`` loop); ``a.weight`` is a fused weight whose second half comes in the next shard,
    after ``after_layer(a)``. ``after_layer(a)`` copied the first half into the captured Parameter and bound it back;
    the second shard's write lands in the replaced new Parameter (alive: ``params`` holds it), never in what the
    graph reads: ``stale``, not a commit with the graph reading [5, 5, 0, 0] (the closed layer's paths alone look
    right)."""
    model = _Pair()
    contract = GraphContract(model, "strict", detect=detect).seal()  # type: ignore[arg-type]
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        params = _load_layerwise(model, txn)  # kept until the reload finishes
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert torch.equal(model.a.weight, torch.full((N,), 5.0)), (
            f"COMMITTED while a.weight (what the graph reads) is {model.a.weight.tolist()}; the loader wrote "
            f"{params['a'].tolist()} (into the replaced new Parameter)"
        )
