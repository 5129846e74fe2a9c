"""Unusual tensors on the restore path: copy-intercepting classes, quantized slots, lazy bits, nested tensors.

Every test is a minimal reproduction of one way the promise could break, and pins the rule that holds it. The
oracle is independent of graphsafe: what a cold model computes from the same final weights (recomputed here), set
against the captured tensors (the objects a graph captured, held from before the reload) after the reload: their
bytes, and how those bytes are read.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import ContractViolation, GraphContract, ReloadOutcome, Status, register_derived

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

MODES = ("strict", "recapture", "migrate")


def _outcome(contract: GraphContract) -> ReloadOutcome:
    out = contract.last_outcome
    assert out is not None
    return out


def _reload(contract: GraphContract, step: Any) -> BaseException | None:
    """Run one reload of ``step``; what it raised other than the contract's own verdict."""
    try:
        with contract.reload():
            step()
    except ContractViolation:
        return None
    except Exception as exc:
        return exc
    return None


# ---------------------------------------------------------------------------------------------------------------
# 1. A tensor class with its own ``__torch_function__`` (a loader-facing class whose copy_ stores a transformed
#    value, or one that refuses in-place writes). graphsafe's restore copies go through torch's Python dispatch, so
#    the class intercepts them: the captured memory gets values the reload never produced (COMMITTED), or the
#    class's own error escapes from deep inside the restore with no outcome and half the copies landed.
# ---------------------------------------------------------------------------------------------------------------


class Doubling(torch.Tensor):
    """A class whose copy_ stores twice its source (its loader semantics: the class scales what it is given)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].copy_(args[1] * 2)
        return super().__torch_function__(func, types, args, kwargs or {})


class ReadOnly(torch.Tensor):
    """A class that refuses every in-place op."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            raise RuntimeError(f"{cls.__name__} refuses {name}")
        return super().__torch_function__(func, types, args, kwargs or {})


class Classed(nn.Module):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls
        self.weight = nn.Parameter(torch.arange(4.0), requires_grad=False)
        self.process_weights_after_loading()
        register_derived(self, "plain")
        register_derived(self, "classed")

    def process_weights_after_loading(self) -> None:
        self.plain = self.weight * 5.0  # another slot, in another copy group (float32 vs float64)
        with torch._C.DisableTorchFunctionSubclass():
            self.classed = (self.weight.double() * 3.0).as_subclass(self.cls)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor).clone()


@pytest.mark.parametrize("cls", [Doubling, ReadOnly], ids=["copy-transforms", "copy-refused"])
@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_class_that_intercepts_copy_never_gets_other_values_or_a_raw_error(mode: str, cls: type) -> None:
    model = Classed(cls)
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    captured_plain, captured = model.plain, model.classed
    new = torch.arange(4.0) + 10.0

    def step() -> None:
        with torch.no_grad():
            model.weight.copy_(new)
        model.process_weights_after_loading()

    raised = _reload(contract, step)
    errors = []
    if raised is not None:
        errors.append(f"the restore raised {raised!r}; last outcome {contract.last_outcome}")
    out = contract.last_outcome
    if out is not None and out.status is Status.COMMITTED:
        for name, cap, exp in (("classed", captured, new.double() * 3.0), ("plain", captured_plain, new * 5.0)):
            if not torch.equal(_raw(cap), exp):
                errors.append(f"COMMITTED, but the captured {name} holds {_raw(cap).tolist()}, not {exp.tolist()}")
    assert not errors, errors


# ---------------------------------------------------------------------------------------------------------------
# 2. A quantized slot (torch.quantize_per_tensor: int8 bytes read with a scale and zero point). The scale and zero
#    point are how its bytes are read, baked into a captured kernel's arguments like a lazy neg bit. PWAL gives it
#    new values quantized with another scale: the restore copies them (copy_ also swaps the captured tensor's
#    quantizer), and the contract commits, so the graph reads the new int8 bytes with the captured scale.
# ---------------------------------------------------------------------------------------------------------------


class Quantized(nn.Module):
    def __init__(self, static: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4.0), requires_grad=False)
        self.process_weights_after_loading()
        # Derived (watched for freshness: its values are sampled at every reload), or static (only restored).
        register_derived(self, "q", static=static)

    def process_weights_after_loading(self) -> None:
        scale = float(self.weight.abs().max()) / 64.0 or 1.0  # a per-load scale, as dynamic quantization makes
        self.q = torch.quantize_per_tensor(self.weight * 2.0, scale, 0, torch.qint8)


@pytest.mark.parametrize("static", [False, True], ids=["derived", "static"])
@pytest.mark.parametrize("in_place", [False, True], ids=["rebuilt", "written-in-place"])
@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_slot_given_another_scale_is_not_committed(mode: str, in_place: bool, static: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates the quantized creation functions (still supported)
        model = Quantized(static)
        contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
        captured = model.q
        sealed = (captured.q_scale(), captured.q_zero_point())
        new = torch.arange(4.0) * 10.0 + 1.0

        def step() -> None:
            with torch.no_grad():
                model.weight.copy_(new)
            if in_place:  # PWAL requantizes into the existing tensor (copy_ takes the source's quantizer)
                scale = float(model.weight.abs().max()) / 64.0
                model.q.copy_(torch.quantize_per_tensor(model.weight * 2.0, scale, 0, torch.qint8))
            else:
                model.process_weights_after_loading()

        raised = _reload(contract, step)
    # (A derived slot's value sample, taken at every reload, raised torch's internal assert from inside begin().)
    assert raised is None, f"the reload raised {raised!r}"
    out = _outcome(contract)
    cold = torch.quantize_per_tensor(new * 2.0, float(new.abs().max()) / 64.0, 0, torch.qint8)
    # What a graph captured before the reload reads: the captured bytes, with the scale it was captured with.
    graph_reads = (captured.int_repr().float() - sealed[1]) * sealed[0]
    if out.status is Status.COMMITTED:
        assert torch.equal(graph_reads, cold.dequantize()), (
            f"COMMITTED, but the graph reads {graph_reads.tolist()} (captured scale {sealed[0]}), "
            f"the cold model {cold.dequantize().tolist()} (scale {cold.q_scale()})"
        )


# ---------------------------------------------------------------------------------------------------------------
# 3. Two slots read through a lazy negative (or conjugate) bit, exchanged by PWAL (a ping-pong swap, which the
#    restore plan supports for plain tensors). Each source reads the other's destination, so protect() clones it,
#    and the clone loses the lazy bit (clone() resolves it). The two copies then share one _foreach_copy_ group whose
#    destinations carry the bit and whose sources do not, which torch refuses: a raw RuntimeError escapes from the
#    middle of the restore, with no outcome. (The same on CUDA, checked on the H200.)
# ---------------------------------------------------------------------------------------------------------------


def _lazy(values: list[float], bit: str) -> torch.Tensor:
    if bit == "neg":
        return torch._neg_view(torch.tensor(values))
    return torch.tensor(values, dtype=torch.complex64).conj()


class LazyPair(nn.Module):
    def __init__(self, bit: str) -> None:
        super().__init__()
        self.p = _lazy([1.0, 2.0, 3.0, 4.0], bit)
        self.q = _lazy([5.0, 6.0, 7.0, 8.0], bit)
        register_derived(self, "p", static=True)
        register_derived(self, "q", static=True)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("bit", ["neg", "conj"])
@pytest.mark.parametrize("mode", MODES)
def test_a_swap_of_two_slots_read_through_a_lazy_bit_commits_the_swapped_values(
    mode: str, bit: str, layerwise: bool
) -> None:
    model = LazyPair(bit)
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    cap_p, cap_q = model.p, model.q
    exp_p, exp_q = cap_q.clone(), cap_p.clone()  # the values as read (clone() resolves the bit)
    raised: BaseException | None = None
    try:
        with contract.reload(layerwise=layerwise) as txn:
            if layerwise:
                txn.before_layer(model)
            model.p, model.q = model.q, model.p
            if layerwise:
                txn.after_layer(model)
    except ContractViolation:
        pass
    except Exception as exc:
        raised = exc
    assert raised is None, f"the restore raised {raised!r}; last outcome {contract.last_outcome}"
    out = _outcome(contract)
    assert out.status is Status.COMMITTED, out.summary()  # a permutation of captured tensors is restored
    assert torch.equal(cap_p, exp_p) and torch.equal(cap_q, exp_q), (cap_p, cap_q)
    assert cap_p.is_neg() == (bit == "neg") and cap_p.is_conj() == (bit == "conj")


class LazyMany(nn.Module):
    def __init__(self, bit: str, n: int) -> None:
        super().__init__()
        self.n = n
        for i in range(n):
            setattr(self, f"s{i}", _lazy([10.0 * i + k for k in range(4)], bit))
            register_derived(self, f"s{i}", static=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.integers(2, 4).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(0, n - 1), min_size=n, max_size=n),  # slot i takes slot pick[i]'s captured tensor
            st.lists(st.booleans(), min_size=n, max_size=n),  # or a fresh tensor
            st.sampled_from(["neg", "conj"]),
            st.booleans(),
        )
    )
)
def test_permutations_of_slots_read_through_a_lazy_bit_never_raise_or_commit_wrong_values(
    case: tuple[int, list[int], list[bool], str, bool],
) -> None:
    """Property: PWAL hands each slot another slot's captured tensor (repeats allowed) or a fresh one, all read
    through the same lazy bit. Oracle: the values each path holds after the same reload with no contract."""
    n, pick, fresh, bit, layerwise = case
    model = LazyMany(bit, n)
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    captured = [getattr(model, f"s{i}") for i in range(n)]
    new = [_lazy([100.0 + 10.0 * i + k for k in range(4)], bit) if fresh[i] else captured[pick[i]] for i in range(n)]
    expected = [t.clone() for t in new]
    raised: BaseException | None = None
    try:
        with contract.reload(layerwise=layerwise) as txn:
            if layerwise:
                txn.before_layer(model)
            for i in range(n):
                setattr(model, f"s{i}", new[i])
            if layerwise:
                txn.after_layer(model)
    except Exception as exc:
        raised = exc
    assert raised is None, f"the restore raised {raised!r}"
    out = _outcome(contract)
    for i in range(n):
        assert torch.equal(getattr(model, f"s{i}"), expected[i]), f"path s{i}; {out.summary()}"
        if out.status is Status.COMMITTED:
            assert torch.equal(captured[i], expected[i]), f"COMMITTED, captured s{i} holds {captured[i]}"


# ---------------------------------------------------------------------------------------------------------------
# 4. A layer that also holds a tensor with no strided storage (a sparse mask or routing table, an mkldnn or a
#    nested tensor) next to a declared derived slot. The freshness check's fallback inputs are every tensor the
#    layer holds, and taking their "before" state asks each for its storage: EVERY reload raises torch's
#    NotImplementedError from begin(), though PWAL rebuilt the slot correctly. (A jagged nested tensor already
#    breaks seal() under the default detect policy.)
# ---------------------------------------------------------------------------------------------------------------


def _odd(kind: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that their API is a prototype
        if kind == "sparse-coo":
            return torch.eye(3).to_sparse()
        if kind == "sparse-csr":
            return torch.eye(3).to_sparse_csr()
        if kind == "mkldnn":
            return torch.arange(4.0).to_mkldnn()
        if kind == "nested":
            return torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
        return torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)


class WithOdd(nn.Module):
    def __init__(self, kind: str, buffer: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4.0), requires_grad=False)
        if buffer:
            self.register_buffer("mask", _odd(kind))
        else:
            self.mask = _odd(kind)
        self.process_weights_after_loading()
        register_derived(self, "w2")

    def process_weights_after_loading(self) -> None:
        self.w2 = self.weight * 2.0


@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("buffer", [False, True], ids=["attribute", "buffer"])
@pytest.mark.parametrize(
    "kind",
    ["sparse-coo", "sparse-csr", "mkldnn", "nested", "jagged"],
)
def test_a_layer_holding_a_tensor_without_strided_storage_still_reloads(kind: str, buffer: bool, detect: str) -> None:
    """A jagged nested tensor (a wrapper whose attributes are its own machinery) is not entered by the walker: it
    is noted untrackable at its path, never walked into as slots (seal raised, or every reload was stale)."""
    if kind == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn in this torch build")
    raised: BaseException | None = None
    out: ReloadOutcome | None = None
    model = WithOdd(kind, buffer)
    try:
        contract = GraphContract(model, "recapture", detect=detect).seal()  # type: ignore[arg-type]
        captured = model.w2
        with contract.reload():
            with torch.no_grad():
                model.weight.copy_(torch.arange(4.0) + 10.0)
            model.process_weights_after_loading()
        out = contract.last_outcome
    except Exception as exc:
        raised = exc
    assert raised is None, f"{type(raised).__name__}: {raised}"
    assert out is not None and out.status is not Status.FAILED, out
    if out.status is Status.COMMITTED:
        assert torch.equal(captured, (torch.arange(4.0) + 10.0) * 2.0)
    if kind == "jagged" and (buffer or detect == "every-reload"):
        untrackable = [f for f in out.findings if f.kind.value == "untrackable"]
        assert untrackable and untrackable[0].detail.startswith("mask: "), out.summary()
        assert not any(f.path.startswith("mask") for f in out.findings), out.summary()


# ---------------------------------------------------------------------------------------------------------------
# 5. PWAL gives a declared slot a nested tensor (torch.nested's default layout reports itself as strided): the
#    restore asks it for its shape and torch's internal error escapes from inside the restore, with no outcome.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_slot_given_a_nested_tensor_is_a_finding_not_a_raw_error(mode: str) -> None:
    model = WithOdd("sparse-coo", buffer=False)
    del model.mask
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]

    def step() -> None:
        with torch.no_grad():
            model.weight.copy_(torch.arange(4.0) + 10.0)
        model.w2 = _odd("nested")

    raised = _reload(contract, step)
    assert raised is None, f"{type(raised).__name__}: {raised}"
    out = _outcome(contract)
    assert out.status is not Status.COMMITTED
    assert any(f.path == "w2" for f in out.findings), out.summary()
