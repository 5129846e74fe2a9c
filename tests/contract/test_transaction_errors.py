"""The reload transaction, its error paths and "nothing lost": what each must hold.

Every test reloads DIFFERENT weights and judges with an oracle that does not use graphsafe's reasoning: the tensor a
captured graph reads (the object, and so the storage, held at capture time) against what a cold load + PWAL of the
same final weights computes (``w(seed) * 3`` and friends, recomputed here). Each docstring states the rule its
test pins.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, GraphSafeError, Status, register_derived

MODES = ("strict", "recapture", "migrate")


def w(seed: int, n: int = 4) -> torch.Tensor:
    """Distinct values per seed, so a stale value can never pass by accident."""
    return torch.arange(n, dtype=torch.float32) + 100.0 * seed + 0.5


def _status(contract: GraphContract, run: Any) -> Status | str:
    """Run one reload; its status, or the name of what it raised (a raise is fail-closed)."""
    try:
        run()
    except Exception as exc:  # strict raises its ContractViolation: not committed
        return type(exc).__name__
    assert contract.last_outcome is not None
    return contract.last_outcome.status


# ----------------------------------------------------------------------------------------------------------------
# 1. A recording of PWAL that cannot see PWAL's ops (PWAL on a worker thread, or writing through numpy: the CPU
#    twin of a raw Triton/CUDA launch) teaches the contract that an undeclared, graph-read tensor is a fixed table.


class ScaledLayer(nn.Module):
    """``scale`` (undeclared: only the walker finds it) is derived from ``weight``; PWAL writes it in place.
    ``skip`` is the classic "already processed" guard bug: PWAL leaves ``scale`` as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.scale = torch.zeros(4)
        self.skip = False
        self.writer = "thread"

    def process_weights_after_loading(self) -> None:
        if self.skip:
            return
        if self.writer == "numpy":  # bypasses torch's dispatcher, like a raw kernel launch on a GPU
            self.scale.numpy()[:] = (self.weight * 3.0).numpy()
        else:
            self.scale.copy_(self.weight * 3.0)


@pytest.mark.parametrize("writer", ["thread", "numpy"])
@pytest.mark.parametrize("recorded", ["record_inputs", "first_reload"])
@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
def test_a_recording_that_cannot_see_pwal_does_not_make_a_stale_undeclared_tensor_static(
    detect: str, recorded: str, writer: str
) -> None:
    """The engine runs load + PWAL on a worker thread (``executor.submit(load).result()`` inside the
    transaction), or PWAL writes ``scale`` outside the dispatcher. The recording (``record_inputs()`` of the initial
    load, or the first reload's automatic one) sees nothing of PWAL, concludes that PWAL never computes ``scale``,
    and from then on treats it as a fixed table. The next reload whose PWAL skips ``scale`` (weights changed) commits
    while the graph reads the old ``scale``.

    Promise 1, and the docs: "an undeclared tensor that the graph reads and that a reload with new weights leaves as
    it was is reported stale"; "ops on other threads are not recorded; a slot they compute has no record and keeps
    the fallback inputs". The same model with PWAL on the calling thread fails closed (stale).
    Without the rule: ``LayerSnapshot._learn_recorded`` / ``LayerSnapshot.take`` (contract/_snapshot.py) and
    ``GraphContract._learn_initial_inputs``: a walker slot the recording did not see computed is static, even when
    its values changed during the recorded load (the recording was blind, not PWAL idle)."""
    net = nn.Sequential(ScaledLayer())
    layer = net[0]
    layer.writer = writer
    pool = ThreadPoolExecutor(1)

    def load(seed: int, skip: bool) -> None:
        def body() -> None:
            with torch.no_grad():
                layer.weight.copy_(w(seed))
                layer.skip = skip
                layer.process_weights_after_loading()

        if writer == "thread":
            pool.submit(body).result()
        else:
            body()

    contract = GraphContract(net, "strict", detect=detect)  # type: ignore[arg-type]
    if recorded == "record_inputs":
        with contract.record_inputs():
            load(1, skip=False)
        contract.seal()
    else:
        load(1, skip=False)
        contract.seal()

        def first() -> None:
            with contract.reload():
                load(2, skip=False)  # PWAL refreshes scale in place: right values, but the recording saw nothing

        if writer == "numpy":
            # The recording saw the weight loaded and no write to scale, whose values changed: how much of it is
            # new it cannot tell, so the reload is judged by scale's inputs (it changed): not committed.
            assert _status(contract, first) is not Status.COMMITTED  # strict raises
            assert contract.last_outcome is not None and contract.last_outcome.status is not Status.COMMITTED
            assert any("saw no write" in f.detail for f in contract.last_outcome.findings), contract.last_outcome
            pool.shutdown()
            return
        assert _status(contract, first) is Status.COMMITTED
    graph_reads = layer.scale  # the captured tensor
    assert torch.equal(graph_reads, (layer.weight * 3.0))

    def stale() -> None:
        with contract.reload():
            load(7, skip=True)  # new weights, PWAL's guard skips scale

    status = _status(contract, stale)
    pool.shutdown()
    cold = w(7) * 3.0
    assert not torch.equal(graph_reads, cold)  # the graph reads the old scale
    assert status is not Status.COMMITTED, (
        f"committed although the graph reads scale={graph_reads.tolist()} and a cold model computes {cold.tolist()}"
    )


# ----------------------------------------------------------------------------------------------------------------
# 2. PWAL hands a declared slot a tensor without a strided storage (sparse, mkldnn): graphsafe's own restore
#    crashes with a raw NotImplementedError (promise 3).


def _flat() -> nn.Module:
    net = nn.Module()
    net.layers = nn.ModuleList()
    for seed in (1, 2):
        layer = nn.Module()
        layer.weight = nn.Parameter(w(seed), requires_grad=False)
        layer.w_t = layer.weight * 2.0 + 1.0
        register_derived(layer, "w_t")
        net.layers.append(layer)
    return net


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("kind", ["sparse", "mkldnn"])
@pytest.mark.parametrize("mode", MODES)
def test_a_declared_slot_given_a_tensor_without_storage_is_a_finding_not_a_raw_crash(
    mode: str, kind: str, layerwise: bool
) -> None:
    """PWAL of ``layers.1`` re-creates its declared ``w_t`` as a sparse COO tensor (or a oneDNN/mkldnn
    prepacked tensor, what CPU inference kernels prepack weights into): no strided storage, so no copy can restore
    it. The restore calls ``current.untyped_storage()`` on it unguarded and a raw ``NotImplementedError: Cannot
    access storage of SparseTensorImpl`` escapes from deep inside graphsafe (whole-model: out of ``finish()``, with no
    outcome anywhere, ``txn.outcome`` and ``last_outcome`` both ``None``; layerwise: out of ``after_layer()``, and the
    outcome then blames the loader: "the reload raised ... the weights may be half-loaded").

    Promise 3: bad input gets a clear graphsafe error naming the layer, the path and what to do (here: a
    ``respecified`` finding, as for any other new tensor no copy can restore, like a ``meta`` tensor already is).
    Without the rule: ``LayerSnapshot.restore`` (contract/_restore.py) calls ``untyped_storage()`` before checking that
    the new value has a strided storage (``verify`` catches the same error, ``restore`` does not)."""
    net = _flat()
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    raised: BaseException | None = None
    txn = contract.reload(layerwise=layerwise)
    try:
        with txn, torch.no_grad():
            for index, layer in enumerate(net.layers):
                if layerwise:
                    txn.before_layer(layer)
                layer.weight.copy_(w(10 + index))
                new = layer.weight * 2.0 + 1.0
                if index == 1:
                    new = new.to_sparse() if kind == "sparse" else new.to_mkldnn()
                layer.w_t = new
                if layerwise:
                    txn.after_layer(layer)
    except Exception as exc:
        raised = exc
    assert not contract.serving_safe  # fail-closed it is: the question is how it says so
    assert raised is None or isinstance(raised, GraphSafeError), (
        f"a raw {type(raised).__name__} escaped graphsafe's restore: {raised}"
    )
    outcome = txn.outcome if txn.outcome is not None else contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED
    assert any(f.layer == "layers.1" and f.path == "w_t" for f in outcome.problems), outcome.summary()


# ----------------------------------------------------------------------------------------------------------------
# 3. before_layer()/after_layer() given something that is not a module (a layer's name): raw AttributeError.


@pytest.mark.parametrize("step", ["before_layer", "after_layer"])
@pytest.mark.parametrize("value", ["layers.0", None])
def test_a_layer_name_passed_to_before_or_after_layer_gets_a_clear_error(step: str, value: Any) -> None:
    """A layerwise loader that knows its layers by name (vLLM's loaders iterate ``named_modules()`` and
    weight names) calls ``txn.before_layer("layers.0")``; or a lookup that found nothing passes ``None``.

    Promise 3: a clear one-line graphsafe error naming what was passed and what to pass. Without it:
    ``AttributeError: 'str' object has no attribute 'modules'`` from ``GraphContract._layer_entries``, and the
    ``with`` block turns it into a FAILED reload whose finding says "the reload raised AttributeError(...)".
    Without the rule: ``ReloadTransaction.before_layer``/``after_layer`` (contract/_transaction.py) never check that
    ``layer`` is an ``nn.Module`` (``GraphContract.__init__`` and ``register_derived`` do)."""
    net = _flat()
    contract = GraphContract(net, "recapture").seal()
    txn = contract.reload(layerwise=True).begin()
    try:
        with pytest.raises(GraphSafeError) as info:
            getattr(txn, step)(value)
        assert repr(value) in str(info.value) or str(value) in str(info.value)
    finally:
        with contextlib.suppress(Exception):
            txn.finish(RuntimeError("test cleanup"))


# ----------------------------------------------------------------------------------------------------------------
# 4. A layer added to the model after the seal (and read by a graph captured after it): every-reload never looks.


@pytest.mark.parametrize("mode", MODES)
def test_every_reload_sees_a_layer_added_after_the_seal(mode: str) -> None:
    """After the seal, the engine adds a layer (an adapter/LoRA-style module appended to the model, a
    ModuleList grown by one) and captures a graph that reads it, without a capture manifest (a ``torch.cuda.graph``
    of its own). Each reload's PWAL re-creates the new layer's declared ``w_t``.

    ``detect="every-reload"`` promises to "walk each layer at every reload (finds tensors that appeared after the
    seal)". Registered modules are reload units the walk never enters, and a module registered after the seal is
    no seal entry either, so nothing looks at it: the reload commits while the graph reads the old ``w_t`` of the new
    layer (strict included). With ``record_capture`` it fails closed (the manifest sees the storage die), so the gap
    is the walk's. Without the rule: ``GraphContract._seal``/``ReloadTransaction._snapshot`` (contract/_sealing.py,
    _steps.py): modules that are not in ``_units`` (registered after the seal) are neither sealed nor walked; a
    reload could report them (``vanished``-style "not sealed: reseal") or walk them."""
    net = _flat()
    contract = GraphContract(net, mode, detect="every-reload").seal()  # type: ignore[arg-type]
    added = nn.Module()
    added.weight = nn.Parameter(w(3), requires_grad=False)
    added.w_t = added.weight * 2.0 + 1.0
    register_derived(added, "w_t")
    net.layers.append(added)
    graph_reads = [layer.w_t for layer in net.layers]  # a graph captured now

    def reload() -> None:
        with contract.reload(), torch.no_grad():
            for index, layer in enumerate(net.layers):
                layer.weight.copy_(w(10 + index))
                layer.w_t = layer.weight * 2.0 + 1.0

    status = _status(contract, reload)
    wrong = [i for i, t in enumerate(graph_reads) if not torch.equal(t, w(10 + i) * 2.0 + 1.0)]
    assert wrong == [2]
    assert status is not Status.COMMITTED, f"committed although the graph reads the old w_t of layers.{wrong}"


# ----------------------------------------------------------------------------------------------------------------
# 5. The adapter's ``graphless`` hook raises while the reload decides: the contract stays serving-safe on a model
#    whose captured memory was not restored.


@pytest.mark.parametrize("mode", MODES)
def test_a_graphless_hook_that_raises_does_not_leave_an_unrestored_model_serving_safe(mode: str) -> None:
    """The engine adapter's ``contract.graphless`` hook (vLLM's asks the runner bound to the model and
    vLLM's platform) raises while a reload decides, here on a reload whose PWAL respecified every declared ``w_t``
    (a shorter tensor: no copy can restore it, so the model keeps PWAL's new tensors and the captured storage keeps
    the old values).

    ``_decide`` runs after ``_settle``'s guarded block has already cleared the open transaction, so the hook's error
    escapes with the contract never marked unsafe: ``serving_safe`` stays True (the torch adapter's ``replay()`` and the
    vLLM serving gate go ahead), no outcome is recorded anywhere (``txn.outcome`` and ``last_outcome`` are ``None``),
    and every captured address holds the old values. A rank agreement that raises at the same point is guarded
    (``mark_unsafe``); the graphless hook is not. Promise 1/3: no reload leaves a model half-restored without saying so.
    Without the rule: ``ReloadTransaction._settle`` (contract/_transaction.py) calls ``contract._decide`` (which calls
    ``graphless()``), and the manifest's ``unread``, outside its ``except BaseException: mark_unsafe`` guard."""
    net = _flat()
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    graph_reads = [layer.w_t for layer in net.layers]

    def graphless() -> str | None:
        raise RuntimeError("the model runner bound to this model was torn down")

    contract.graphless = graphless
    with contextlib.suppress(Exception), contract.reload(), torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(10 + index))
            layer.w_t = (layer.weight * 2.0 + 1.0)[:3].clone()  # respecified: no copy restores it
    wrong = [i for i, t in enumerate(graph_reads) if not torch.equal(t[:3], w(10 + i)[:3] * 2.0 + 1.0)]
    assert wrong == [0, 1]  # the graph reads the old values everywhere
    assert not contract.serving_safe, (
        f"the graph reads old values at layers {wrong}, yet the contract is serving-safe "
        f"(last_outcome={contract.last_outcome})"
    )


# ----------------------------------------------------------------------------------------------------------------
# 6. A rebind that raises (a write-once owner) after the plan's copies landed, on a PWAL that swaps its captured
#    tensors (ping-pong): the slots keep new tensors whose memory graphsafe just overwrote with the other slot's values.


class WriteOnce:
    """A kernel-parameter holder that refuses reassignment (as pydantic's frozen models do, with a non-Attribute
    error): attributes are set once, at construction."""

    def __init__(self, **values: torch.Tensor) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is immutable: build a new one")


class PingPong(nn.Module):
    """Two declared slots under a write-once holder PWAL rebuilds at every load; PWAL reuses the old holder's
    tensors as spares (ping-pong): each slot's new tensor is the other slot's captured one, written with its values."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.params = WriteOnce(a=self.weight * 2.0, b=self.weight + 1.0)
        register_derived(self, "params.a")
        register_derived(self, "params.b")

    def process_weights_after_loading(self) -> None:
        old = self.params
        old.b.copy_(self.weight * 2.0)  # slot a's new values, into b's old tensor
        old.a.copy_(self.weight + 1.0)  # slot b's new values, into a's old tensor
        self.params = WriteOnce(a=old.b, b=old.a)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_rebind_after_a_swap_does_not_leave_the_model_on_memory_graphsafe_overwrote(mode: str) -> None:
    """PWAL swaps the captured tensors of ``params.a`` and ``params.b`` (ping-pong, a supported pattern:
    "Permuted storages ... commit with the right values") under a holder whose ``__setattr__`` refuses the
    restore's rebind. The plan copies a's new values (read from b's old tensor, cloned first) into a's captured
    storage and b's into b's: exactly the memory PWAL's new tensors of the OTHER slot occupy. Then both rebinds raise
    and each slot keeps its new tensor ("moved: could not rebind the captured tensor"), which now holds the other
    slot's values: after the reload ``params.a`` reads ``weight + 1`` and ``params.b`` reads ``weight * 2``.

    Promise 2 (graphsafe wrote slot a's values into the tensor PWAL made for b, and b's into a's) and promise 1:
    recapture/migrate report NEEDS_RECAPTURE (strict: a DeclaredDriftError saying recapture and reseal), and the
    recapture reads the swapped values (with the torch adapter its on_recapture callback does so at once and the
    contract reseals serving-safe on them). Without the swap the same failed rebind leaves right values.
    Without the rule: ``LayerSnapshot.rebind`` (contract/_rebind.py): a slot whose rebind fails keeps ``new`` even when
    the plan's copies overwrote the memory ``new`` reads (the broken-alias branch binds ``keep`` for that case; this
    one binds nothing, and no finding says the values at the path are wrong)."""
    net = nn.Sequential(PingPong())
    layer = net[0]
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]

    def reload() -> None:
        with contract.reload(), torch.no_grad():
            layer.weight.copy_(w(5))
            layer.process_weights_after_loading()

    status = _status(contract, reload)
    assert status is not Status.COMMITTED  # the rebinds failed: fail-closed so far
    cold_a, cold_b = w(5) * 2.0, w(5) + 1.0
    now_a, now_b = layer.params.a, layer.params.b
    assert torch.equal(now_a, cold_a) and torch.equal(now_b, cold_b), (
        f"after the reload ({status}) the model holds params.a={now_a.tolist()} (cold: {cold_a.tolist()}) and "
        f"params.b={now_b.tolist()} (cold: {cold_b.tolist()}): graphsafe's copies overwrote what PWAL left there, "
        "and a recapture reads it"
    )


# ----------------------------------------------------------------------------------------------------------------
# 7. (Noted in triage, fixed with its test.) An interrupt in the ``with`` body: the previous COMMITTED outcome
#    stood for a half-loaded model, and on_outcome listeners never heard of the reload.


def test_an_interrupt_in_the_reload_body_records_a_failed_outcome_and_tells_the_listeners() -> None:
    """Ctrl-C lands in the loader after layer 0's weight was written. The contract was already marked unsafe; but
    ``last_outcome`` stayed the previous reload's COMMITTED and no ``on_outcome`` listener (metrics, the serving
    gate's log) heard anything. Promise 3: no reload leaves a model half-restored without saying so."""
    net = _flat()
    contract = GraphContract(net, "recapture").seal()
    heard: list[Any] = []
    contract.on_outcome(heard.append)
    with contract.reload(), torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(10 + index))
            layer.w_t = layer.weight * 2.0 + 1.0
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.COMMITTED
    with pytest.raises(KeyboardInterrupt), contract.reload() as txn, torch.no_grad():
        net.layers[0].weight.copy_(w(20))
        raise KeyboardInterrupt
    assert not contract.serving_safe
    assert txn.outcome is not None and txn.outcome is contract.last_outcome
    assert txn.outcome.status is Status.FAILED, txn.outcome.summary()
    assert heard == [heard[0], txn.outcome]
