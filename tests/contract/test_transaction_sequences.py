"""The reload transaction across reloads, its error paths and "nothing lost": sequences of reloads, retries after a
failure, threads.

Every test reloads DIFFERENT weights (or retries the same ones after a failure) and judges with an oracle that does
not use graphsafe's reasoning: the tensors a captured graph reads (the objects, and so the storages, the model held
when the graph was captured) against what a cold load + PWAL of the model's current weights computes
(``weight * 2 + 1`` and friends, recomputed here). Each docstring states the rule its test pins.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from torch import nn
from torch.overrides import TorchFunctionMode

from graphsafe import GraphContract, ReloadOutcome, Status, register_derived

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
# 1. A slot a reload found stale, resealed as it is (recapture + reseal, the documented way back), then a retry of
#    the same weights whose PWAL skips it again: "same weights, skipped rebuild" is taken for fresh.


class Guarded(nn.Module):
    """A declared ``w_t`` and the classic "already processed" guard bug: with ``skip`` PWAL leaves ``w_t`` as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.w_t = self.weight * 2.0 + 1.0
        register_derived(self, "w_t")
        self.skip = False

    def process_weights_after_loading(self) -> None:
        if not self.skip:
            self.w_t = self.weight * 2.0 + 1.0


@pytest.mark.parametrize("first", ["stale", "loader-raised"])
@pytest.mark.parametrize("mode", MODES)
def test_a_stale_slot_resealed_after_a_failed_reload_is_not_committed_by_a_same_weights_retry(
    mode: str, first: str
) -> None:
    """Reload N loads weights B; PWAL's guard skips ``w_t`` (``stale``: FAILED, fine), or the loader raises
    after writing B and before PWAL (FAILED, fine). The RL loop does what the error says: recapture the graphs and
    ``reseal()``; the captured graph now reads ``w_t`` computed from weights A. Then it retries the step: the same
    weights B, written through ``param.data.copy_`` (the usual loader path, no version bump), and PWAL's guard skips
    ``w_t`` again. The freshness check sees inputs that did not change since the snapshot and a slot left as it was:
    "a same-weights reload whose PWAL skipped a slot ... is safe: the slot was derived from exactly these input values"
    (docs/fault-matrix.md). Not after a reseal of a slot the contract itself found stale, or whose inputs a failed
    reload wrote: it COMMITS while the graph reads ``A * 2 + 1`` and a cold model on B computes ``B * 2 + 1``.

    Promise 1. Without the rule: what a reload learned about a slot's freshness is dropped by the reseal
    (``LayerSnapshot._check_fresh`` judges against the inputs at the snapshot only; nothing carries "this slot's
    values are not derived from the inputs it has now" from the failed reload through ``GraphContract._seal``)."""
    net = nn.Sequential(Guarded())
    layer = net[0]
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]

    def load(seed: int, *, skip: bool, raise_before_pwal: bool = False) -> None:
        with torch.no_grad():
            layer.weight.data.copy_(w(seed))
            if raise_before_pwal:
                raise KeyError("checkpoint shard missing")
            layer.skip = skip
            layer.process_weights_after_loading()

    def failed() -> None:
        with contract.reload():
            load(2, skip=True, raise_before_pwal=first == "loader-raised")

    assert _status(contract, failed) in ("ReloadFailedError", "KeyError", Status.FAILED)
    assert not contract.serving_safe
    contract.note_capture()  # the graphs were captured again, from the model as it is
    contract.reseal()
    graph_reads = layer.w_t

    def retry() -> None:
        with contract.reload():
            load(2, skip=True)

    status = _status(contract, retry)
    cold = w(2) * 2.0 + 1.0
    assert not torch.equal(graph_reads, cold)  # the graph reads w_t of the first weights
    assert status is not Status.COMMITTED, (
        f"committed although the graph reads w_t={graph_reads.tolist()} and a cold model computes {cold.tolist()}"
    )


# ----------------------------------------------------------------------------------------------------------------
# 2. A failed first reload teaches the contract that an undeclared tensor it found stale is a fixed table.


class Scaled(nn.Module):
    """``scale`` (undeclared: only the walker finds it) is derived from ``weight``; ``skip`` is the guard bug."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.scale = self.weight * 3.0
        self.skip = False

    def process_weights_after_loading(self) -> None:
        if not self.skip:
            self.scale = self.weight * 3.0


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
@pytest.mark.parametrize("mode", MODES)
def test_a_reload_that_found_an_undeclared_tensor_stale_does_not_teach_that_it_is_a_fixed_table(
    mode: str, detect: str
) -> None:
    """PWAL's guard skips the undeclared ``scale`` on every reload (the bug). The first reload (new weights) reports it
    ``stale``: FAILED, fine. Its recording saw PWAL not compute ``scale`` while the weights changed, and concluded that
    ``scale`` is a fixed table (``unrecorded`` cleared, no inputs). The loop recaptures and reseals, and every later
    reload with NEW weights commits while the graph reads ``scale`` of the first weights: the contract stopped watching
    the very tensor it had just found stale.

    Promise 1 ("an undeclared tensor that the graph reads and that a reload with new weights leaves as it was is
    reported stale, because nothing says it does not depend on the weights"): a PWAL that skipped a tensor during a
    reload says nothing about whether it depends on the weights (the initial load's recording, ``record_inputs()``,
    is evidence: a first PWAL runs in full). Without the rule: ``LayerSnapshot._learn_recorded`` (contract/_snapshot.py)
    takes "not computed while its inputs changed" for "a fixed table"."""
    net = nn.Sequential(Scaled())
    layer = net[0]
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]

    def reload(seed: int) -> Status | str:
        def run() -> None:
            with contract.reload(), torch.no_grad():
                layer.weight.copy_(w(seed))
                layer.skip = True
                layer.process_weights_after_loading()

        return _status(contract, run)

    assert reload(2) is not Status.COMMITTED  # stale, fail-closed
    contract.note_capture()
    contract.reseal()
    graph_reads = layer.scale
    status = reload(3)
    cold = w(3) * 3.0
    assert not torch.equal(graph_reads, cold)
    assert status is not Status.COMMITTED, (
        f"committed although the graph reads scale={graph_reads.tolist()} and a cold model computes {cold.tolist()}"
    )


# ----------------------------------------------------------------------------------------------------------------
# 3. The restore itself raises (an out-of-memory in its clone/copy, a device error): the previous COMMITTED outcome
#    stands, no listener hears of the reload, and the rank agreement is skipped (the peers wait for this rank).


class Flaky(torch.Tensor):
    """A tensor subclass (a quantized-weight wrapper, say) whose copies fail inside ``_armed()``: the CPU twin of a
    CUDA out-of-memory or device error inside graphsafe's own ``_foreach_copy_``. The restore writes with subclass
    dispatch off (a subclass must not change what is written), so the failure is injected by a torch-function
    mode, which still sees every call."""


def _holds_flaky(args: Any) -> bool:
    if isinstance(args, Flaky):
        return True
    if isinstance(args, (list, tuple)):
        return any(_holds_flaky(a) for a in args)
    return False


class _FailFlakyCopies(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "copy" in getattr(func, "__name__", "") and _holds_flaky(args):
            raise RuntimeError("CUDA error: out of memory (simulated inside the restore's copy)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _armed() -> Iterator[None]:
    with _FailFlakyCopies():
        yield


def _flaky_net() -> nn.Module:
    net = nn.Module()
    net.layers = nn.ModuleList()
    for seed in (1, 2):
        layer = nn.Module()
        layer.weight = nn.Parameter(w(seed), requires_grad=False)
        layer.w_t = (layer.weight * 2.0 + 1.0).as_subclass(Flaky)
        register_derived(layer, "w_t")
        net.layers.append(layer)
    return net


def _reload_flaky(contract: GraphContract, net: nn.Module, seed: int, agreement: Any = None) -> None:
    with contract.reload(agreement=agreement), torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(seed + index))
            layer.w_t = (layer.weight * 2.0 + 1.0).as_subclass(Flaky)


@pytest.mark.parametrize("mode", MODES)
def test_a_restore_that_raises_records_a_failed_outcome_tells_the_listeners_and_the_peers(mode: str) -> None:
    """Reload 1 commits. Reload 2's restore raises inside graphsafe's own copy (a CUDA OOM in ``_foreach_copy_``; here a
    tensor subclass whose copy raises). The contract is marked unsafe (good), but ``last_outcome`` is still reload 1's
    COMMITTED, ``txn.outcome`` is ``None``, no ``on_outcome`` listener (the serving gate's log, metrics) hears anything,
    and the agreement is never called: with ``StoreAgreement`` every peer waits for this rank until its timeout, and
    this rank's round counter falls one behind its peers' for good (every later group reload pairs it with the wrong
    round).

    Promise 3 (no reload leaves a model half-restored without saying so); the same lie the transaction refuses for an
    interrupt in the ``with`` body (``test_an_interrupt_in_the_reload_body_records_a_failed_outcome...``), and the rule
    ``begin()`` follows for a refused reload ("take part as FAILED so agreement rounds stay paired"). Without the rule:
    ``ReloadTransaction._finish`` (contract/_transaction.py) lets an error of ``_settle`` escape before the outcome is
    recorded, agreed and announced."""
    net = _flaky_net()
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    heard: list[ReloadOutcome] = []
    agreed: list[ReloadOutcome] = []

    def agreement(local: ReloadOutcome) -> ReloadOutcome:
        agreed.append(local)
        return local

    contract.on_outcome(heard.append)
    _reload_flaky(contract, net, 10, agreement)
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.COMMITTED
    graph_reads = [layer.w_t for layer in net.layers]
    with _armed(), pytest.raises(RuntimeError, match="out of memory"):
        _reload_flaky(contract, net, 20, agreement)
    assert not any(torch.equal(t, w(20 + i) * 2.0 + 1.0) for i, t in enumerate(graph_reads))  # not restored
    assert not contract.serving_safe
    last = contract.last_outcome
    assert last is not None and last.status is Status.FAILED, (
        f"the restore raised and the captured memory holds the old values, yet last_outcome is "
        f"{last.status if last else None} (the previous reload's)"
    )
    assert len(heard) == 2 and heard[-1] is last, "no on_outcome listener heard of the failed reload"
    assert len(agreed) == 2 and agreed[-1].status is Status.FAILED, "the peers never heard from this rank"


# ----------------------------------------------------------------------------------------------------------------
# 4. A capture reported while a reload is open (an engine thread capturing a graph for a new batch size): the
#    graph reads PWAL's new tensors, which the restore then drops; the reload commits.


class Layer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.w_t = self.weight * 2.0 + 1.0
        register_derived(self, "w_t")


@pytest.mark.parametrize("mode", MODES)
def test_a_capture_reported_while_a_reload_is_open_does_not_commit(mode: str) -> None:
    """While the RL thread's reload is open (weights loaded, PWAL done, restore not yet run), the serving
    thread captures a graph of its own (a new batch size) and reports it with ``contract.note_capture()``, as the
    docs tell code that captures graphs itself. That graph reads the tensors the model holds at that moment: PWAL's
    new ``w_t``. The restore then copies their values into the captured storage, binds the captured tensors back
    and drops the new ones: the reload COMMITS while the new graph reads memory the model no longer holds (freed on a
    GPU). The contract was told of the capture, during its own transaction, and ignored it.

    Promise 1. Without the rule: ``GraphContract.note_capture`` (contract/_contract.py) does not tell an open
    transaction, whose outcome cannot then be COMMITTED (a recapture after it fixes the graph)."""
    net = nn.Sequential(Layer(1), Layer(2))
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    captured: list[list[torch.Tensor]] = []

    def engine() -> None:  # the serving thread: capture, then report the capture
        captured.append([layer.w_t for layer in net])
        contract.note_capture()

    def reload() -> None:
        with contract.reload(), torch.no_grad():
            for index, layer in enumerate(net):
                layer.weight.copy_(w(10 + index))
                layer.w_t = layer.weight * 2.0 + 1.0
            thread = threading.Thread(target=engine)
            thread.start()
            thread.join()

    status = _status(contract, reload)
    graph_reads = captured[0]
    moved = [i for i, layer in enumerate(net) if graph_reads[i].untyped_storage() is not layer.w_t.untyped_storage()]
    assert moved == [0, 1]  # the new graph reads tensors the model no longer holds
    assert status is not Status.COMMITTED, f"committed although the graph captured mid-reload reads layers {moved}"


# ----------------------------------------------------------------------------------------------------------------
# 5. seal() on another thread races a reload: the reload's finish() restores against the new seal, taken mid-load.


class SlowWalk(nn.Module):
    """A model whose module walk can be paused at a chosen point (the CPU stand-in for a seal that takes a while on
    a large model while another thread runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(1), Layer(2)])
        self.pause: threading.Event | None = None
        self.resume = threading.Event()

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        pause = self.pause
        if pause is not None:
            self.pause = None
            pause.set()  # the seal is walking the model now
            self.resume.wait(10)
        return super().named_modules(*args, **kwargs)


def test_a_seal_running_while_a_reload_begins_does_not_let_the_reload_commit_unrestored() -> None:
    """The serving thread calls ``contract.seal()`` (re-seal after adding a graph; the contract is serving-safe, so
    nothing refuses it) while the RL thread begins a reload. ``_seal`` checks ``_active`` once, before its walk; the
    reload begins during the walk (nothing stops it: ``begin()`` takes the transaction lock, ``seal()`` does not),
    snapshots the old seal, loads and runs PWAL. The seal then finishes on the model as it is mid-reload (PWAL's new
    ``w_t``) and replaces the contract's layers; ``finish()`` restores against that seal, finds everything in place and
    COMMITS, while the graphs captured before read the old ``w_t``, never restored.

    Promise 1. Without the rule: ``GraphContract.seal``/``reseal`` (contract/_contract.py) do not take the transaction
    lock: a seal and a reload can interleave."""
    net = SlowWalk()
    contract = GraphContract(net, "recapture").seal()
    graph_reads = [layer.w_t for layer in net.layers]
    walking = threading.Event()
    net.pause = walking
    sealed: list[BaseException | None] = []

    def serving() -> None:
        try:
            contract.seal()
            sealed.append(None)
        except BaseException as exc:  # a refusal is fine-closed; we only record it
            sealed.append(exc)

    thread = threading.Thread(target=serving)
    thread.start()
    assert walking.wait(10)
    try:
        txn = contract.reload().begin()
    except Exception:
        net.resume.set()
        thread.join()
        return  # refused while a seal runs: fail-closed
    with torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(10 + index))
            layer.w_t = layer.weight * 2.0 + 1.0
    net.resume.set()
    thread.join()
    status: Status | str
    try:
        status = txn.finish().status
    except Exception as exc:
        status = type(exc).__name__
    wrong = [i for i, t in enumerate(graph_reads) if not torch.equal(t, w(10 + i) * 2.0 + 1.0)]
    assert wrong == [0, 1]  # the graphs captured before read the old values
    assert status is not Status.COMMITTED, (
        f"committed (the concurrent seal {'succeeded' if sealed == [None] else sealed}) while the graphs read the "
        f"old w_t of layers {wrong}"
    )


# ----------------------------------------------------------------------------------------------------------------
# 6. The property behind 1, 2 and 9: any sequence of reloads (rebuilt, written in place, skipped, raising; retried),
#    recaptures + reseals after failures, layers reordered, and declarations removed and added again. After every
#    COMMITTED outcome every captured tensor holds what a cold model on the model's current weights computes.


def _val(seed: int, index: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + 100.0 * seed + 10.0 * index + 0.5


class SmLayer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_val(1, index), requires_grad=False)
        self.w_t = self.weight * 2.0 + 1.0
        self.scale = self.weight * 3.0  # undeclared: the walker's
        self.handle = register_derived(self, "w_t")
        self.how = "rebuild"

    def process_weights_after_loading(self) -> None:
        if self.how == "rebuild":
            self.w_t = self.weight * 2.0 + 1.0
            self.scale = self.weight * 3.0
        elif self.how == "in-place":
            self.w_t.copy_(self.weight * 2.0 + 1.0)
            self.scale.copy_(self.weight * 3.0)
        elif self.how == "raise":
            self.w_t = self.weight * 2.0 + 1.0
            raise RuntimeError("PWAL failed halfway")
        # "skip": the guard bug, nothing rebuilt


HOWS = st.sampled_from(["rebuild", "in-place", "skip", "raise"])


class ReloadSequences(RuleBasedStateMachine):
    @initialize(
        mode=st.sampled_from(MODES), detect=st.sampled_from(["every-reload", "sealed-paths"]), callback=st.booleans()
    )
    def start(self, mode: str, detect: str, callback: bool) -> None:
        self.net = nn.Module()
        self.net.layers = nn.ModuleList([SmLayer(0), SmLayer(1)])
        self.contract = GraphContract(self.net, mode, detect=detect).seal()  # type: ignore[arg-type]
        self.log = [f"GraphContract({mode!r}, detect={detect!r}, on_recapture={callback})"]
        self.seed = 1
        self.capture()
        if callback:
            self.contract.on_recapture(lambda outcome: self.capture())

    def capture(self) -> None:
        self.graph = [(layer.w_t, layer.scale) for layer in self.net.layers]

    def reload(self, seed: int, hows: list[str], loader: str) -> None:
        self.log.append(f"reload(seed={seed}, pwal={hows}, loader={loader})")
        if not self.contract.serving_safe:
            return
        self.seed = seed
        with contextlib.suppress(Exception), self.contract.reload(), torch.no_grad():
            for index, layer in enumerate(self.net.layers):
                if loader == "data":
                    layer.weight.data.copy_(_val(seed, index))
                else:
                    layer.weight.copy_(_val(seed, index))
                layer.how = hows[index]
                layer.process_weights_after_loading()
        outcome = self.contract.last_outcome
        assert outcome is not None
        self.log.append(f"  -> {outcome.status.value} {[(f.kind.value, f.layer, f.path) for f in outcome.problems]}")
        if outcome.status is Status.COMMITTED or self.contract.serving_safe:
            for index, (layer, (w_t, scale)) in enumerate(zip(self.net.layers, self.graph, strict=True)):
                for name, read, cold in (("w_t", w_t, layer.weight * 2.0 + 1.0), ("scale", scale, layer.weight * 3.0)):
                    assert torch.equal(read, cold), (
                        f"{outcome.status.value}: the graph reads layers.{index}.{name}={read.tolist()}, a cold model "
                        f"computes {cold.tolist()}\n" + "\n".join(self.log)
                    )

    @rule(seed=st.integers(1, 3), hows=st.lists(HOWS, min_size=2, max_size=2), loader=st.sampled_from(["copy", "data"]))
    def new_weights(self, seed: int, hows: list[str], loader: str) -> None:
        self.reload(seed, hows, loader)

    @rule(hows=st.lists(HOWS, min_size=2, max_size=2))
    def retry_the_same_weights(self, hows: list[str]) -> None:
        self.reload(self.seed, hows, "data")

    @precondition(lambda self: not self.contract.serving_safe)
    @rule()
    def recapture_and_reseal(self) -> None:
        self.log.append("recapture; note_capture(); reseal()")
        self.capture()
        self.contract.note_capture()
        try:
            self.contract.reseal()
        except Exception as exc:  # a refusal keeps the contract unsafe: fine
            self.log.append(f"  reseal raised {type(exc).__name__}")

    @rule()
    def reorder_layers(self) -> None:
        self.log.append("layers[0], layers[1] = layers[1], layers[0]")
        first, second = self.net.layers[0], self.net.layers[1]
        self.net.layers[0], self.net.layers[1] = second, first

    @rule(index=st.integers(0, 1))
    def remove_declaration(self, index: int) -> None:
        self.log.append(f"layers.{index}: register_derived(...).remove()")
        self.net.layers[index].handle.remove()

    @rule(index=st.integers(0, 1))
    def declare_again(self, index: int) -> None:
        self.log.append(f"layers.{index}: register_derived(layer, 'w_t')")
        self.net.layers[index].handle = register_derived(self.net.layers[index], "w_t")


TestReloadSequences = ReloadSequences.TestCase
TestReloadSequences.settings = settings(
    max_examples=300,
    stateful_step_count=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


# ----------------------------------------------------------------------------------------------------------------
# 7. While the ranks agree, a rank whose own reload did not commit reads as serving-safe.


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_waiting_for_agreement_on_a_reload_it_could_not_restore_is_not_serving_safe(mode: str) -> None:
    """A rank's PWAL respecified its declared ``w_t`` (a shorter tensor: no copy restores it), so its local
    outcome is NEEDS_RECAPTURE and its captured memory keeps the old values. It then waits in the rank agreement
    (``StoreAgreement`` waits up to 300 s for slow peers). ``_settle`` has already cleared the open transaction and
    nothing has marked the contract unsafe yet: for the whole wait ``serving_safe`` is True and ``unsafe_reason`` is
    None, so the serving thread (the torch adapter's ``replay()``, the vLLM serving gate, which ask exactly that)
    replays graphs that read the old values.

    Promise 1 (``serving_safe``: "never while a reload transaction is open: its layers may be half-restored").
    Without the rule: ``ReloadTransaction._settle``/``_finish`` (contract/_transaction.py) mark the contract unsafe only
    after the agreement returns, although this rank's own outcome already says it is not."""
    net = nn.Sequential(Layer(1), Layer(2))
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    graph_reads = [layer.w_t for layer in net]
    seen: list[tuple[bool, str | None]] = []

    def agreement(local: ReloadOutcome) -> ReloadOutcome:
        # What the serving thread sees while this rank waits for its peers.
        seen.append((contract.serving_safe, contract.unsafe_reason))
        return local

    def reload() -> None:
        with contract.reload(agreement=agreement), torch.no_grad():
            for index, layer in enumerate(net):
                layer.weight.copy_(w(10 + index))
                layer.w_t = (layer.weight * 2.0 + 1.0)[:3].clone()  # respecified: no copy restores it

    status = _status(contract, reload)
    assert status is not Status.COMMITTED
    assert not any(torch.equal(t[:3], w(10 + i)[:3] * 2.0 + 1.0) for i, t in enumerate(graph_reads))
    assert seen and not seen[0][0], (
        f"while waiting for the peers the contract said serving_safe={seen[0][0]} (unsafe_reason={seen[0][1]!r}) "
        "although its own reload left the captured memory with the old values"
    )


# ----------------------------------------------------------------------------------------------------------------
# 8. A tensor built lazily from the weights by the warm-up forward, after a recording: the default policy finds it
#    at every reload and never checks it.


class LazyScale(nn.Module):
    """``_x`` is built from the weight on the first forward (the warm-up, after the seal), never by PWAL: the
    pattern the fault matrix's "lazily allocated tensor" row and ``detect="every-reload"`` exist for."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(1), requires_grad=False)
        self.w_t = self.weight * 2.0 + 1.0
        register_derived(self, "w_t")

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * 2.0 + 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_x", None) is None:
            self._x = self.weight * 3.0  # lazily, from the weight, once
        return x * self.w_t + self._x


@pytest.mark.parametrize("recorded", ["record_inputs", "first_reload"])
@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_that_appeared_after_the_recording_is_checked_for_freshness(mode: str, recorded: str) -> None:
    """The initial load is recorded (``record_inputs()``, the README's advice; or the contract's first
    reload records by itself), then the warm-up forward builds ``_x`` from the weight, and the graphs are captured.
    A reload with new weights leaves ``_x`` as it was (nothing rebuilds it). ``detect="every-reload"`` (the default)
    finds ``_x`` at every reload, but a walker slot's ``unrecorded`` defaults to False, so "a recording exists and
    did not see PWAL compute it" makes it a fixed table it never saw: every reload COMMITS while the graph reads
    ``_x`` of the first weights.

    Promise 1, and the docs: a tensor only the walker found "is checked like a declared derived slot until a
    recording shows PWAL does not compute it ... (or it appeared unseen): then ... it stays watched". Without the rule:
    ``_sealed_slot`` (contract/_sealing.py) makes walker slots ``unrecorded=False``: "no recording saw it" reads as
    "a recording saw PWAL leave it"."""
    net = nn.Sequential(LazyScale())
    layer = net[0]
    contract = GraphContract(net, mode)  # type: ignore[arg-type]

    def load(seed: int) -> None:
        with torch.no_grad():
            layer.weight.copy_(w(seed))
            layer.process_weights_after_loading()

    if recorded == "record_inputs":
        with contract.record_inputs():
            load(1)
        contract.seal()
    else:
        contract.seal()
        with contract.reload():
            load(1)
    with torch.no_grad():
        net(torch.ones(4))  # warm-up: _x is built
    graph_reads = layer._x

    def reload() -> None:
        with contract.reload():
            load(2)

    status = _status(contract, reload)
    cold = w(2) * 3.0
    assert not torch.equal(graph_reads, cold)
    assert status is not Status.COMMITTED, (
        f"committed although the graph reads _x={graph_reads.tolist()} and a cold model computes {cold.tolist()}"
    )


# ----------------------------------------------------------------------------------------------------------------
# 9. A ModuleList reordered between reloads: the moved layers are "vanished", never snapshotted, so a stale slot
#    of theirs goes unchecked and NEEDS_RECAPTURE sends the recapture to read it.


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_reordered_layer_is_still_checked_for_stale_values_before_a_recapture(mode: str) -> None:
    """The engine reorders ``layers`` between reloads (swaps two entries of the ``ModuleList``). The next
    reload loads each position's weights into the module now there, and the PWAL of one of them skips ``w_t`` (the
    guard bug). Both sealed layers are ``vanished`` at their qualnames ("the layer itself was replaced or removed"),
    so neither is snapshotted: no freshness check runs on them, the outcome is NEEDS_RECAPTURE (every finding is
    recapture-fixable), the ``on_recapture`` callback recaptures and the contract reseals serving-safe on a model
    whose ``layers.1.w_t`` was computed from other weights than ``layers.1.weight``.

    Promise 1 ("NEEDS_RECAPTURE after which a recapture would read wrong values"). Without the rule:
    ``ReloadTransaction._snapshot`` (contract/_steps.py) drops a sealed layer that left its qualname even when
    the same module object is still in the model: a stale value in it can then never be found."""
    net = nn.Module()
    net.layers = nn.ModuleList([Guarded(), Guarded()])
    for index, layer in enumerate(net.layers):
        with torch.no_grad():
            layer.weight.copy_(w(1 + index))
            layer.process_weights_after_loading()
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    recaptured: list[list[torch.Tensor]] = []
    contract.on_recapture(lambda outcome: recaptured.append([layer.w_t for layer in net.layers]))
    first, second = net.layers[0], net.layers[1]
    net.layers[0], net.layers[1] = second, first

    def reload() -> None:
        with contract.reload(), torch.no_grad():
            for index, layer in enumerate(net.layers):
                layer.weight.copy_(w(10 + index))
                layer.skip = index == 1  # the guard bug, in the module now at layers.1
                layer.process_weights_after_loading()

    status = _status(contract, reload)
    stale = net.layers[1].w_t
    assert not torch.equal(stale, w(11) * 2.0 + 1.0)  # layers.1 holds w_t of other weights
    assert status is not Status.NEEDS_RECAPTURE and not recaptured, (
        f"{status}: the recapture reads layers.1.w_t={stale.tolist()}, a cold model computes "
        f"{(w(11) * 2.0 + 1.0).tolist()}"
    )


# ----------------------------------------------------------------------------------------------------------------
# 10. The same for a layer replaced by a new module after the seal: no seal entry, no snapshot, no freshness check.


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_layer_replaced_after_the_seal_is_checked_for_stale_values_before_a_recapture(mode: str) -> None:
    """The engine replaces ``layers.1`` by a new module (same class, built from the same weights) between
    reloads. The next reload loads new weights into it and its PWAL's guard skips ``w_t``. The old module is
    ``vanished``, the new one ``untrackable`` ("registered after the seal ... recapture the graphs, then reseal()"):
    NEEDS_RECAPTURE, and the recapture reads ``w_t`` of the old weights.

    Promise 1 ("NEEDS_RECAPTURE after which a recapture would read wrong values"). ``begin()`` now notes the new
    module's weights and derived tensors (``contract._late``): ``w_t`` left unwritten while its weight changed is
    ``stale``, FAILED."""
    net = nn.Module()
    net.layers = nn.ModuleList([Guarded(), Guarded()])
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    recaptured: list[list[torch.Tensor]] = []
    contract.on_recapture(lambda outcome: recaptured.append([layer.w_t for layer in net.layers]))
    net.layers[1] = Guarded()

    def reload() -> None:
        with contract.reload(), torch.no_grad():
            for index, layer in enumerate(net.layers):
                layer.weight.copy_(w(10 + index))
                layer.skip = index == 1
                layer.process_weights_after_loading()

    status = _status(contract, reload)
    stale = net.layers[1].w_t
    assert not torch.equal(stale, w(11) * 2.0 + 1.0)
    assert status == "ReloadFailedError" and contract.last_outcome is not None, status
    assert contract.last_outcome.status is Status.FAILED
    assert any(
        f.kind.value == "stale" and (f.layer, f.path) == ("layers.1", "w_t") for f in contract.last_outcome.problems
    ), contract.last_outcome.summary()
    assert status is not Status.NEEDS_RECAPTURE and not recaptured, (
        f"{status}: the recapture reads layers.1.w_t={stale.tolist()}, a cold model computes "
        f"{(w(11) * 2.0 + 1.0).tolist()}"
    )


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_layer_replaced_after_the_seal_whose_pwal_rebuilds_is_recaptured(mode: str) -> None:
    """The legitimate twin: the new module's PWAL rebuilds ``w_t``: ``untrackable``, NEEDS_RECAPTURE (a recapture
    reads the rebuilt tensor), no ``stale``."""
    net = nn.Module()
    net.layers = nn.ModuleList([Guarded(), Guarded()])
    contract = GraphContract(net, mode).seal()  # type: ignore[arg-type]
    contract.on_recapture(lambda outcome: None)
    net.layers[1] = Guarded()
    with contract.reload(), torch.no_grad():
        for index, layer in enumerate(net.layers):
            layer.weight.copy_(w(10 + index))
            layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE, outcome
    assert "stale" not in {f.kind.value for f in outcome.problems}, outcome.summary()
