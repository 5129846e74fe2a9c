"""Everything that changes how the same bytes are read, and tensor subclasses.

The fingerprint must see the conjugate and negative bits, the storage offset, dtype, strides, layout and the tensor's
subclass: a change in any of them is ``respecified`` (a recapture), never a copy that commits. Wrapper subclasses
(torchao style: ``_make_wrapper_subclass`` plus ``__tensor_flatten__``) own no storage: their captured memory is
their inner tensors', which are restored one by one. A stride-0 (expanded) captured slot is restored through its
distinct elements.

Oracle: the addresses and the values. Every reload produces *different* values; after ``COMMITTED`` the captured
storages, read by address (a view rebuilt on the storage recorded at seal), hold exactly what PWAL produced.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_map

from graphsafe import FindingKind, GraphContract, ReloadOutcome, Status, register_derived
from graphsafe.outcome import fingerprint, geometry_key

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def reload(contract: GraphContract, body: Any) -> ReloadOutcome:
    """Run ``body`` under the contract in ``recapture`` mode and return the outcome (never raises for a finding)."""
    with contract.reload():
        body()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def kinds(outcome: ReloadOutcome) -> dict[str, FindingKind]:
    return {f.path: f.kind for f in outcome.problems}


def physical(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as stored, lazy conjugate and negative bits resolved away (a view, no copy)."""
    if tensor.is_conj():
        tensor = tensor.conj()  # clears the bit: the same memory read as stored
    if tensor.is_neg():
        tensor = torch._neg_view(tensor)
    return tensor


def at_address(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A fresh plain view of ``like``'s geometry on ``storage``: what a replaying graph reads there."""
    view = torch.empty(0, dtype=like.dtype, device=like.device)
    view.set_(storage, like.storage_offset(), like.shape, like.stride())
    return view


class Holder(nn.Module):
    """A layer with a weight and one declared derived slot ``x`` whose value each test sets."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.x = value
        register_derived(self, "x")


# ----------------------------------------------------------------------------------------------------
# Conjugate and negative bits
# ----------------------------------------------------------------------------------------------------


def test_a_lazy_conj_of_the_same_memory_is_respecified_not_committed() -> None:
    freqs = torch.randn(4, dtype=torch.complex64)
    layer = Holder(freqs)
    contract = GraphContract(layer, "recapture").seal()
    outcome = reload(contract, lambda: setattr(layer, "x", layer.x.conj()))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert kinds(outcome) == {"x": FindingKind.RESPECIFIED}
    assert "conj" in outcome.problems[0].detail


def test_a_neg_view_of_the_same_memory_is_respecified() -> None:
    layer = Holder(torch.randn(4, dtype=torch.complex64))
    contract = GraphContract(layer, "recapture").seal()
    outcome = reload(contract, lambda: setattr(layer, "x", torch._neg_view(layer.x)))
    assert kinds(outcome) == {"x": FindingKind.RESPECIFIED}
    assert "neg" in outcome.problems[0].detail


def test_the_imaginary_part_of_a_conj_view_carries_a_neg_bit_and_counts() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    layer = Holder(z.imag)  # a real view, no bit
    contract = GraphContract(layer, "recapture").seal()
    outcome = reload(contract, lambda: setattr(layer, "x", z.conj().imag))  # the same bytes, read negated
    assert kinds(outcome) == {"x": FindingKind.RESPECIFIED}


@settings(max_examples=40, deadline=None)
@given(
    sealed_conj=st.booleans(),
    sealed_neg=st.booleans(),
    new_conj=st.booleans(),
    new_neg=st.booleans(),
    same_memory=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conj_and_neg_bits_decide_commit_or_recapture(
    sealed_conj: bool, sealed_neg: bool, new_conj: bool, new_neg: bool, same_memory: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(5, dtype=torch.complex64, generator=generator)
    captured = _bits(base, sealed_conj, sealed_neg)
    layer = Holder(captured)
    storage = base.untyped_storage()
    contract = GraphContract(layer, "recapture").seal()
    new_base = base if same_memory else torch.randn(5, dtype=torch.complex64, generator=generator)
    new = _bits(new_base, new_conj, new_neg)
    expected_logical = new.clone()  # what the graph must read after a commit
    outcome = reload(contract, lambda: setattr(layer, "x", new))
    same_bits = (sealed_conj, sealed_neg) == (new_conj, new_neg)
    if same_bits:
        assert outcome.status is Status.COMMITTED, outcome.summary()
        assert layer.x.data_ptr() == captured.data_ptr()  # the captured object, or another view of the same memory
        # Independent oracle: the captured storage, read by address with the captured bits, holds the new values;
        # read raw, it holds the bytes the new tensor stores (no lazy bit materialised on the way).
        raw = at_address(storage, physical(captured))
        assert torch.equal(_bits(raw, sealed_conj, sealed_neg), expected_logical)
        assert torch.equal(raw, physical(new))
    else:
        assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
        assert kinds(outcome) == {"x": FindingKind.RESPECIFIED}
        assert layer.x is new  # the model keeps PWAL's tensor for the recapture
        if not same_memory:
            assert torch.equal(at_address(storage, base), base)  # nothing written into the captured storage


def _bits(base: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    view = base.conj() if conj else base
    return torch._neg_view(view) if neg else view


def test_fingerprint_and_geometry_key_see_every_read_bit() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    plain, conj, neg = fingerprint(z), fingerprint(z.conj()), fingerprint(torch._neg_view(z))
    assert len({plain.key, conj.key, neg.key}) == 3
    assert len({geometry_key(z), geometry_key(z.conj()), geometry_key(torch._neg_view(z))}) == 3
    assert conj.to_dict()["conj"] is True and neg.to_dict()["neg"] is True
    assert "conj" in conj.describe() and "neg" in neg.describe()


# ----------------------------------------------------------------------------------------------------
# Plain subclasses
# ----------------------------------------------------------------------------------------------------


class Marked(torch.Tensor):
    """A plain subclass (its own storage): an ordinary tensor whose type a kernel may dispatch on."""


class SubclassParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4).as_subclass(Marked), requires_grad=False)


def test_a_parameter_of_a_plain_subclass_replaced_by_the_same_subclass_commits_by_copy() -> None:
    layer = SubclassParam()
    captured = layer.weight
    storage = captured.untyped_storage()
    contract = GraphContract(layer, "recapture").seal()
    new = torch.randn(4) + 10
    outcome = reload(contract, lambda: setattr(layer, "weight", nn.Parameter(new.as_subclass(Marked), False)))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert layer.weight is captured
    assert torch.equal(at_address(storage, new), new)


def test_a_parameter_whose_subclass_changes_is_respecified() -> None:
    layer = SubclassParam()
    contract = GraphContract(layer, "recapture").seal()
    outcome = reload(contract, lambda: setattr(layer, "weight", nn.Parameter(torch.randn(4), False)))
    assert kinds(outcome) == {"weight": FindingKind.RESPECIFIED}
    assert "Marked" in outcome.problems[0].detail


def test_a_plain_subclass_of_the_same_memory_is_respecified() -> None:
    layer = Holder(torch.randn(4))
    contract = GraphContract(layer, "recapture").seal()
    outcome = reload(contract, lambda: setattr(layer, "x", layer.x.as_subclass(Marked)))
    assert kinds(outcome) == {"x": FindingKind.RESPECIFIED}


# ----------------------------------------------------------------------------------------------------
# Wrapper subclasses (torchao style)
# ----------------------------------------------------------------------------------------------------


class Quantized(torch.Tensor):
    """A torchao-style wrapper: no storage of its own, int8 ``qdata`` and a float ``scale`` inside."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, block: int = 1) -> Quantized:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, qdata.shape, dtype=torch.float32, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, block: int = 1) -> None:
        self.qdata = qdata
        self.scale = scale
        self.block = block

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], self.block

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], block: Any, size: Any, stride: Any) -> Quantized:
        return Quantized(inner["qdata"], inner["scale"], block)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Quantized(block={self.block})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            (self,) = args
            return Quantized(self.qdata, self.scale, self.block)
        # Anything else reads the dequantised values (enough for a test: no op here writes through a wrapper).

        def plain(x: Any) -> Any:
            return x.qdata.float() * x.scale if isinstance(x, Quantized) else x

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def quantized(seed: int, n: int = 6, block: int = 1) -> Quantized:
    generator = torch.Generator().manual_seed(seed)
    return Quantized(
        torch.randint(-100, 100, (n,), dtype=torch.int8, generator=generator),
        torch.rand(1, generator=generator) + 0.5,
        block,
    )


class WrapperSlot(nn.Module):
    """A declared wrapper slot rebuilt by PWAL, and a wrapper parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(quantized(0), requires_grad=False)
        self.packed = quantized(1)
        register_derived(self, "packed", derived_from=("weight",))  # not from the walker-found extras


def _inner_storages(tensor: Quantized) -> dict[str, tuple[torch.UntypedStorage, torch.Tensor]]:
    return {name: (getattr(tensor, name).untyped_storage(), getattr(tensor, name)) for name in ("qdata", "scale")}


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_declared_wrapper_rebuilt_by_pwal_commits_into_its_captured_inner_tensors(mode: str) -> None:
    layer = WrapperSlot()
    captured = layer.packed
    sealed = _inner_storages(captured)
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    new = quantized(7)
    expected = {name: getattr(new, name).clone() for name in ("qdata", "scale")}
    outcome = reload(contract, lambda: setattr(layer, "packed", new))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert layer.packed is captured
    for name, (storage, like) in sealed.items():
        assert getattr(layer.packed, name).untyped_storage() is storage
        assert torch.equal(at_address(storage, like), expected[name]), name
    assert outcome.bytes_copied == new.qdata.nbytes + new.scale.nbytes


def test_a_wrapper_parameter_replaced_by_the_loader_commits_by_copy() -> None:
    layer = WrapperSlot()
    captured = layer.weight
    sealed = _inner_storages(captured)  # type: ignore[arg-type]
    contract = GraphContract(layer, "strict").seal()
    new = quantized(9)

    def load() -> None:
        layer.weight = nn.Parameter(new, requires_grad=False)
        layer.packed = quantized(10)  # PWAL: the derived slot follows the weight

    outcome = reload(contract, load)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert layer.weight is captured
    for name, (storage, like) in sealed.items():
        assert torch.equal(at_address(storage, like), getattr(new, name)), name


def test_a_wrapper_written_in_place_commits_without_copies() -> None:
    layer = WrapperSlot()
    contract = GraphContract(layer, "strict").seal()
    new = quantized(3)

    def in_place() -> None:
        layer.packed.qdata.copy_(new.qdata)
        layer.packed.scale.copy_(new.scale)

    outcome = reload(contract, in_place)
    assert outcome.status is Status.COMMITTED and outcome.bytes_copied == 0
    assert torch.equal(layer.packed.qdata, new.qdata)


@pytest.mark.parametrize(
    "change",
    ["inner shape", "inner dtype", "metadata", "to plain", "inner swapped on the captured object"],
)
def test_a_wrapper_whose_reading_changes_is_never_committed(change: str) -> None:
    layer = WrapperSlot()
    captured = layer.packed
    sealed = _inner_storages(captured)
    before = {name: like.clone() for name, (_, like) in sealed.items()}
    contract = GraphContract(layer, "recapture").seal()
    new: torch.Tensor
    if change == "inner shape":
        q = quantized(4)
        new = Quantized(q.qdata, torch.rand(2))
    elif change == "inner dtype":
        q = quantized(4)
        new = Quantized(q.qdata.to(torch.int16), q.scale)
    elif change == "metadata":
        new = quantized(4, block=2)
    elif change == "to plain":
        new = torch.randn(6)
    else:
        new = captured

        def swap() -> None:
            captured.qdata = quantized(4).qdata  # the same wrapper object, another inner storage

    outcome = reload(contract, swap if change.startswith("inner swapped") else lambda: setattr(layer, "packed", new))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert set(kinds(outcome)) == {"packed"}
    assert layer.packed is new
    if new is not captured:
        for name, (storage, like) in sealed.items():  # nothing written into the captured inner storages
            assert torch.equal(at_address(storage, like), before[name]), name


def test_a_walker_found_wrapper_is_auto_restored_in_migrate_and_moved_in_strict() -> None:
    for mode, status in (("migrate", Status.COMMITTED), ("recapture", Status.NEEDS_RECAPTURE)):
        layer = WrapperSlot()
        layer.hidden = quantized(5)  # undeclared: only the walker finds it
        captured = layer.hidden
        sealed = _inner_storages(captured)
        contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
        new = quantized(6)
        outcome = reload(contract, lambda: setattr(layer, "hidden", new))  # noqa: B023
        assert outcome.status is status, outcome.summary()
        if mode == "migrate":
            assert [f.path for f in outcome.auto_restored] == ["hidden"]
            assert layer.hidden is captured
            for name, (storage, like) in sealed.items():
                assert torch.equal(at_address(storage, like), getattr(new, name))
        else:
            assert kinds(outcome) == {"hidden": FindingKind.MOVED}


def test_a_wrapper_fingerprint_names_its_inner_tensors() -> None:
    q = quantized(0)
    fp = fingerprint(q)
    assert [name for name, _ in fp.inner] == ["qdata", "scale"]
    assert fp.inner[0][1].data_ptr == q.qdata.data_ptr()
    other = Quantized(q.qdata, q.scale, 2)
    assert fingerprint(other).key != fp.key  # the flatten metadata is part of how the bytes are read
    assert fingerprint(Quantized(q.qdata, q.scale, 1)).key == fp.key
    assert fp.to_dict()["inner"][0]["name"] == "qdata"


# ----------------------------------------------------------------------------------------------------
# Expanded (stride-0) captured slots
# ----------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_an_expanded_scale_is_restored_through_its_distinct_elements(shape: list[int], data: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Which dimensions are broadcast (size 1 in the base, expanded to ``shape``).
    expanded = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    base_shape = [1 if e else n for n, e in zip(shape, expanded, strict=True)]
    base = torch.randn(base_shape, generator=generator)
    captured = base.expand(shape)
    storage = base.untyped_storage()
    layer = Holder(captured)
    contract = GraphContract(layer, "recapture").seal()
    how = data.draw(st.sampled_from(["same expansion", "materialised", "other expansion"]))
    new_base = torch.randn(base_shape, generator=generator) + 5
    if how == "same expansion":
        new = new_base.expand(shape)
    elif how == "materialised":
        new = new_base.expand(shape).contiguous()
    else:
        other = [n if e else 1 for n, e in zip(shape, expanded, strict=True)]  # broadcast the other dimensions
        new = torch.randn(other, generator=generator).expand(shape)
    outcome = reload(contract, lambda: setattr(layer, "x", new))
    if geometry_key(new) == geometry_key(captured):
        assert outcome.status is Status.COMMITTED, outcome.summary()
        assert layer.x is captured
        distinct = new[tuple(slice(0, 1) if e else slice(None) for e in expanded)]  # one element per broadcast
        assert torch.equal(at_address(storage, base), distinct)
        assert torch.equal(layer.x, new)
    else:
        assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
        assert kinds(outcome) == {"x": FindingKind.RESPECIFIED}
        assert layer.x is new
        assert torch.equal(at_address(storage, base), base)  # never written


def test_an_expanded_scale_rebuilt_expanded_commits() -> None:
    scale = torch.randn(1)
    layer = Holder(scale.expand(8))
    contract = GraphContract(layer, "strict").seal()
    new = torch.randn(1) + 3
    outcome = reload(contract, lambda: setattr(layer, "x", new.expand(8)))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(at_address(scale.untyped_storage(), scale), new)
    assert outcome.bytes_copied == new.nbytes  # the one distinct element, not eight


def test_a_capture_manifest_reads_a_wrapper_through_its_inner_tensors() -> None:
    from graphsafe.collectors import record_capture

    layer = WrapperSlot()
    contract = GraphContract(layer, "strict").seal()
    with record_capture(contract, ignore=[torch.zeros(1)]):
        layer.packed + layer.weight  # the wrappers reach the dispatch mode whole
    assert contract.manifest is not None
    new = quantized(11)
    outcome = reload(contract, lambda: setattr(layer, "packed", new))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    # A second reload leaves a plain tensor at the path: the slot and the manifest (which indexed the inner
    # storages under the slot's path) both see the graph's memory is no longer held there; no raw exception.
    contract.mode = "recapture"
    outcome = reload(contract, lambda: setattr(layer, "packed", torch.randn(6)))
    assert outcome.status is Status.NEEDS_RECAPTURE
    assert kinds(outcome)["packed"] is FindingKind.RESPECIFIED


class TwoWrappers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = WrapperSlot()
        self.b = WrapperSlot()


def test_wrappers_swapped_between_layers_commit_each_layers_new_values_at_its_captured_inner_memory() -> None:
    # PWAL hands layer a the captured wrapper of layer b and the other way round, after writing the new values
    # into them: each inner copy's source is another copy's destination, so the plan must clone first.
    model = TwoWrappers()
    captured_a, captured_b = model.a.packed, model.b.packed
    sealed_a, sealed_b = _inner_storages(captured_a), _inner_storages(captured_b)
    contract = GraphContract(model, "strict").seal()
    new_a, new_b = quantized(21), quantized(22)

    def pwal() -> None:
        with torch.no_grad():
            captured_b.qdata.copy_(new_a.qdata)
            captured_b.scale.copy_(new_a.scale)
            captured_a.qdata.copy_(new_b.qdata)
            captured_a.scale.copy_(new_b.scale)
        model.a.packed, model.b.packed = captured_b, captured_a

    outcome = reload(contract, pwal)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert model.a.packed is captured_a and model.b.packed is captured_b
    for sealed, new in ((sealed_a, new_a), (sealed_b, new_b)):
        for name, (storage, like) in sealed.items():
            assert torch.equal(at_address(storage, like), getattr(new, name)), name


def test_a_wrapper_tied_across_layers_given_two_values_is_not_committed() -> None:
    model = TwoWrappers()
    tied = model.a.packed
    model.b.packed = tied
    register_derived(model.b, "packed")
    contract = GraphContract(model, "recapture").seal()
    outcome = reload(
        contract, lambda: (setattr(model.a, "packed", quantized(31)), setattr(model.b, "packed", quantized(32)))
    )
    assert outcome.status is not Status.COMMITTED, outcome.summary()
    assert FindingKind.ALIAS_BROKEN in {f.kind for f in outcome.findings}
    # Each layer reads its own new values, in the captured memory or in the tensor it keeps.
    assert torch.equal(model.a.packed.qdata, quantized(31).qdata) and torch.equal(
        model.b.packed.qdata, quantized(32).qdata
    )
