"""A loader's writes into the tensors ``after_layer()`` replaced (``_note_rebound`` / ``written_after_close``: a later
shard through a kept ``params`` dict is ``stale``, the same values written again, a reused scratch Parameter and a
shared staging buffer are not), the remap of attributes held elsewhere asking no class of the caller's anything, and
the recordings of ``record_every_reload`` across interleaved contracts and threads.
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
def _load_layerwise(model: _Pair, txn) -> None:  # type: ignore[no-untyped-def]
    """A loader's ``load_weights``: its ``params`` dict is a local, gone when it returns (before ``finish``)."""
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


def test_a_late_write_is_caught_even_when_the_loader_dropped_its_params_dict_before_finish() -> None:
    """the same late shard as test_remap_elsewhere section 8, but the loader's ``params`` dict is a local of
    its ``load_weights()`` (the usual shape: the engine calls ``model.load_weights(...)`` inside the reload and
    ``after_layer`` runs from its per-layer hook). ``written_after_close`` only looks at the weak references when the
    reload finishes; by then the new Parameter is freed, ``ref()`` is ``None`` and the write is skipped: the reload
    COMMITS with the graph reading [5, 5, 0, 0] while a cold load gives [5, 5, 5, 5]. Promise: never COMMITTED while
    a graph reads memory other than what the reload produced."""
    model, contract = _sealed()
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        _load_layerwise(model, txn)
    _not_committed_while_stale(contract, model, [5.0] * N)


# -- 2. the late write goes through .data (vLLM's default_weight_loader: param.data.copy_(w)) ------------------------
def test_a_late_write_through_dot_data_does_not_commit() -> None:
    """the loader keeps its params dict alive, but writes the second shard through ``param.data`` (vLLM's
    ``default_weight_loader`` does ``param.data.copy_(loaded_weight)``; many loaders narrow ``param.data``). ``.data``
    is a tensor with its own version counter, so ``new._version`` never moves and ``written_after_close`` sees no
    write: COMMITTED with the graph reading [5, 5, 0, 0]. Promise: never COMMITTED while a graph reads stale memory."""
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
    """the loader builds and writes its new Parameters under ``torch.inference_mode()`` (engines load under
    it). An inference tensor has no version counter: ``_note_rebound`` catches the RuntimeError and records nothing,
    so the second shard written after ``after_layer(a)`` is never seen: COMMITTED with the graph reading [5, 5, 0, 0].
    Promise: never COMMITTED while a graph reads stale memory (fail closed where the write cannot be counted)."""
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
    """No false alarm: the loader writes the replaced new Parameter again after ``after_layer(a)`` with the values
    it already had (a loader that re-applies a shard, or a quantizer's idempotent ``fill_``). The captured tensor the
    graph reads holds exactly those values, and a cold load gives the same, yet the version counter moved and the
    reload FAILS ``stale``. Promise: false alarms (not COMMITTED although every captured read is right) are a cost;
    values equal to what the graph reads are no stale read."""
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
    """No false alarm: a loader reuses one scratch Parameter: bound at ``a.weight``, filled, ``after_layer(a)``
    copies it into a's captured tensor; then bound at ``b.weight``, filled with b's values, ``after_layer(b)`` copies
    those into b's. Every captured tensor holds what a cold load gives ([5]*4, [6]*4), yet the write for b moved the
    scratch's version counter and the reload FAILS ``stale`` on ``a.weight``. Promise: false alarms are a cost."""
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
    """No false alarm: the loader stages every weight in one flat buffer (a checkpoint blob, a pinned staging
    tensor) and binds ``nn.Parameter(flat[i*N:(i+1)*N])`` views of it; ``nn.Parameter`` of a view shares the blob's
    version counter. Writing b's slice after ``after_layer(a)`` moves a's replaced Parameter's counter too, so
    ``written_after_close`` flags ``a.weight`` stale, although nothing wrote a's bytes and every captured tensor holds
    what a cold load gives. Promise: false alarms are a cost (this one hits every layer but the last)."""
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
    """layer ``b``'s weight carries a user attribute ``meta = _Lazy()`` (set after the seal; nothing of
    graphsafe's looks at it until the end). A layerwise loader replaces ``a.weight`` and keeps the new Parameter (its
    params dict). At the end ``remap_held_elsewhere`` walks every model tensor's ``__dict__`` and calls
    ``isinstance(value, torch.Tensor)`` on each value, which reads the proxy's ``__class__``: its RuntimeError escapes
    the reload's exit (after the restore). Promise: graphsafe never makes a legal operation on the user's model
    raise a foreign exception."""
    model, contract = _sealed()
    params = {}
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn:
        txn.before_layer(model.a)
        model.a.weight = params["a"] = nn.Parameter(torch.full((N,), 3.0), requires_grad=False)
        model.b.weight.meta = _Lazy()
        txn.after_layer(model.a)
    assert contract.last_outcome is not None


# -- 6. record_every_reload: two contracts reloaded interleaved (a draft and a target model) -------------------------
class _Partial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from graphsafe import register_derived

        self.w = nn.Parameter(torch.randn(8192), requires_grad=False)
        self.s = self.w.detach() * 2
        register_derived(self, "s", self.s, derived_from="w")


def test_record_every_reload_counts_a_partial_refresh_when_another_contract_finishes_first() -> None:
    """two models (a speculative-decoding draft and target), each with its own contract and
    ``record_every_reload = True``, reloaded together in one thread: A.begin(), B.begin(), ..., A.finish(),
    B's PWAL, B.finish(). Each transaction pushes its Dataflow dispatch mode; A's ``_stop_recording`` pops the TOP of
    torch's mode stack, which is B's, so B's PWAL (refreshing only half of ``s`` in place) is recorded by A's
    orphaned mode and B's own recording misses it. B COMMITS with ``s`` half stale (the same partial refresh alone is
    found ``stale ... only in part``, test_freshness_samples section 3). Promise: never COMMITTED while a graph reads
    values other than the reload produced (the flag promises a partial refresh is counted on every reload)."""
    a, b = _Partial(), _Partial()
    ca = GraphContract(a, "recapture", detect="declared-only").seal()
    cb = GraphContract(b, "recapture", detect="declared-only").seal()
    ca.record_every_reload = cb.record_every_reload = True
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


def test_record_every_reload_leaves_no_dispatch_modes_behind_when_finish_runs_in_another_thread() -> None:
    """a server begins each reload on its event-loop thread and finishes it from a worker thread (a supported
    case: ``_stop_recording`` makes the mode inert because a dispatch mode can only be popped on the thread that
    pushed it). With ``record_every_reload`` every reload leaves one more inert Dataflow mode on the begin thread's
    stack, forever: each eager op of that thread then runs through all of them (measured: 2000 ``x + 1`` on a
    256x256 CPU tensor, 25 ms before, 390 ms after 20 reloads, 2070 ms after 100). With only the first reload
    recorded it is one mode, once. Promise: graphsafe must not degrade the user's torch ops without bound."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    layer = _Partial()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    contract.record_every_reload = True
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
        txn.before_layer(model.a)
        txn.before_layer(model.b)
        params = {}
        for name, layer in (("a", model.a), ("b", model.b)):
            layer.weight = nn.Parameter(torch.zeros(N), requires_grad=False)
            params[name] = layer.weight
        with torch.no_grad():
            params["a"][:2] = 5.0  # shard 1
        txn.after_layer(model.a)
        with torch.no_grad():
            params["a"][2:] = 5.0  # shard 2
            params["b"][:] = 6.0
        txn.after_layer(model.b)
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert torch.equal(model.a.weight, torch.full((N,), 5.0)), (
            f"COMMITTED while a.weight (what the graph reads) is {model.a.weight.tolist()}; the loader wrote "
            f"{params['a'].tolist()} (into the replaced new Parameter)"
        )
