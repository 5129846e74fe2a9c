"""The contract's freshness judgement and the batched value samples (contract/_samples.py): a rotation written
through ``.data`` is ``stale`` (a changed sample counts as a write where the version counter did not move), a
second ``before_layer`` keeps the first snapshot (a snapshot taken after the load would see it as the old state),
and a partial in-place refresh, which value samples cannot tell from a legitimate write whose new values agree with
the old ones in places, is found by the recording every reload takes.

Every reload loads DIFFERENT weights; the oracle is an eager recomputation of what PWAL should produce. The promise
checked: (1) a COMMITTED reload leaves every declared path on its captured tensor holding the values a fresh PWAL
computes (no stale slot commits); (2) nothing outside what the reload produced is written.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphsafe import (
    FindingKind,
    GraphContract,
    ReloadFailedError,
    ReloadOutcome,
    ReloadTransaction,
    Status,
    register_derived,
)
from graphsafe.errors import GraphSafeError


def _reload(contract: GraphContract, body: Callable[[], None]):
    try:
        with contract.reload(), torch.no_grad():
            body()
    except (ReloadFailedError, GraphSafeError):
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def _assert_promise(outcome, checks: list[tuple[str, Callable[[], torch.Tensor], torch.Tensor, torch.Tensor]]):
    """``checks``: (name, current tensor at the path, captured tensor, expected values)."""
    if outcome.status is not Status.COMMITTED:
        return
    for name, get, captured, expected in checks:
        now = get()
        assert now.data_ptr() == captured.data_ptr(), f"{name}: COMMITTED but the path left its captured memory"
        assert torch.equal(captured, expected), (
            f"{name}: COMMITTED but the captured memory holds values other than what PWAL computes "
            f"({[(f.kind.value, f.path) for f in outcome.findings]})"
        )


# ---------------------------------------------------------------------------------------------------------------
# 1. Rotation through ``.data``: a skipped slot whose memory another slot's new tensor wrote without moving the
#    version counter passes for refreshed.
# ---------------------------------------------------------------------------------------------------------------


class _Rot(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(n), requires_grad=False)
        self.bug = False
        self.via_data = True

    def pwal(self) -> None:
        if not hasattr(self, "a"):
            self.a = self.w1 * 2
            self.b = self.w2 * 3
            register_derived(self, "a", self.a, derived_from="w1")
            register_derived(self, "b", self.b, derived_from="w2")
            return
        if self.bug:
            # A buggy ping-pong: a's new tensor is b's captured tensor; b is skipped ("already processed").
            self.a = self.b
            target = self.a.data if self.via_data else self.a
            target.copy_(self.w1 * 2)
        else:
            self.a = self.w1 * 2
            self.b = self.w2 * 3


@pytest.mark.parametrize("via_data", [True, False])
def test_rotation_written_through_data_does_not_commit_stale(via_data: bool) -> None:
    layer = _Rot()
    layer.pwal()
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    a_cap, b_cap = layer.a, layer.b
    torch.manual_seed(1)
    n1, n2 = torch.randn(8), torch.randn(8)
    layer.bug, layer.via_data = True, via_data

    def body() -> None:
        layer.w1.data.copy_(n1)
        layer.w2.data.copy_(n2)
        layer.pwal()

    outcome = _reload(contract, body)
    _assert_promise(
        outcome,
        [("a", lambda: layer.a, a_cap, n1 * 2), ("b", lambda: layer.b, b_cap, n2 * 3)],
    )


# ---------------------------------------------------------------------------------------------------------------
# 2. Many slots of mixed dtypes and sizes (whole and strided samples, joined per dtype) with a policy each.
# ---------------------------------------------------------------------------------------------------------------

_DTYPES = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "i8": torch.int8,
    "bool": torch.bool,
    "c64": torch.complex64,
    "i64": torch.int64,
}


def _derive(w: torch.Tensor, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """A value of ``n`` elements of ``dtype`` that changes wherever ``w`` changes (every element depends on w)."""
    if n == 0:
        return torch.empty(0, dtype=dtype)
    idx = (torch.arange(n) * 7 + salt) % w.numel()
    base = w[idx] * (salt + 1) + w.sum() * 1e-3
    if dtype is torch.bool:
        return base > 0
    if dtype is torch.int8:
        return (base * 50).clamp(-127, 127).to(torch.int8)
    if dtype is torch.int64:
        return (base * 1000).to(torch.int64)
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


class _Mixed(nn.Module):
    def __init__(self, specs: list[tuple[str, int]], wn: int = 300, requires_grad: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(wn), requires_grad=requires_grad)
        self.specs = specs
        self.policy: dict[int, str] = {}

    def expected(self, i: int) -> torch.Tensor:
        kind, n = self.specs[i]
        return _derive(self.w.detach(), n, _DTYPES[kind], i)

    def pwal(self) -> None:
        for i, _ in enumerate(self.specs):
            name = f"s{i}"
            if not hasattr(self, name):
                setattr(self, name, self.expected(i))
                register_derived(self, name, getattr(self, name), derived_from="w")
                continue
            policy = self.policy.get(i, "rebuild")
            if policy == "rebuild":
                setattr(self, name, self.expected(i))
            elif policy == "in_place":
                getattr(self, name).copy_(self.expected(i))
            elif policy == "in_place_data":
                getattr(self, name).data.copy_(self.expected(i))


SIZES = [1, 255, 256, 257, 4095, 4096, 4097, 8192, 8193]


def _mixed_case(seed: int, layerwise: bool, n_layers: int = 2):
    g = torch.Generator().manual_seed(seed)

    def pick(seq):
        return seq[int(torch.randint(len(seq), (1,), generator=g))]

    layers = nn.ModuleList()
    for _ in range(n_layers):
        specs = [(pick(list(_DTYPES)), pick(SIZES)) for _ in range(int(torch.randint(1, 7, (1,), generator=g)))]
        layers.append(_Mixed(specs, wn=pick([3, 255, 256, 257, 5000])))
    model = nn.Module()
    model.layers = layers
    for layer in layers:
        layer.pwal()
    return model, g, pick


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_mixed_dtype_batches_never_commit_a_stale_or_wrong_slot(seed: int, layerwise: bool) -> None:
    model, g, pick = _mixed_case(seed, layerwise)
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    captured = {
        (li, i): getattr(layer, f"s{i}") for li, layer in enumerate(model.layers) for i in range(len(layer.specs))
    }
    for round_ in range(3):
        for layer in model.layers:
            layer.policy = {i: pick(["rebuild", "in_place", "in_place_data"]) for i in range(len(layer.specs))}
        if float(torch.rand((), generator=g)) < 0.3:  # now and then one skipped slot
            layer = pick(list(model.layers))
            layer.policy[pick(range(len(layer.specs)))] = "skip"
        new = [torch.randn(layer.w.shape, generator=g) for layer in model.layers]
        before = {k: v.clone() for k, v in captured.items()}

        def body(txn: ReloadTransaction, new: list[torch.Tensor] = new) -> None:
            for layer, w in zip(model.layers, new, strict=True):
                if layerwise:
                    txn.before_layer(layer)
                layer.w.data.copy_(w)
                layer.pwal()
                if layerwise:
                    txn.after_layer(layer)

        try:
            with contract.reload(layerwise=layerwise) as txn, torch.no_grad():
                body(txn)
        except (ReloadFailedError, GraphSafeError):
            pass
        outcome = contract.last_outcome
        stale_expected = any(
            layer.policy[i] == "skip" and not torch.equal(before[(li, i)], layer.expected(i))
            for li, layer in enumerate(model.layers)
            for i in range(len(layer.specs))
        )
        if outcome.status is Status.COMMITTED:
            assert not stale_expected, f"round {round_}: a skipped slot with changed inputs committed"
            for (li, i), cap in captured.items():
                layer = model.layers[li]
                assert getattr(layer, f"s{i}").data_ptr() == cap.data_ptr()
                assert torch.equal(cap, layer.expected(i)), f"round {round_}: slot {(li, i)} wrong"
        else:
            return  # the contract is not serving-safe any more


# ---------------------------------------------------------------------------------------------------------------
# 3. A PWAL that rewrites in place only part of a slot: its value sample changed, so the sample alone takes it for
#    refreshed. A recorded reload (the first, or one after record_inputs()) sees which bytes PWAL's writes covered.
# ---------------------------------------------------------------------------------------------------------------


class _Partial(nn.Module):
    def __init__(self, n: int, writes: tuple[slice, ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n), requires_grad=False)
        self.writes = writes
        self.s = self.w.detach() * 2
        register_derived(self, "s", self.s, derived_from="w")

    def pwal(self) -> None:
        for part in self.writes:  # an "incremental" refresh: only these parts
            self.s[part].copy_((self.w.detach() * 2)[part])


_PARTS = pytest.mark.parametrize(
    ("n", "writes"),
    [
        (8192, (slice(0, 4096),)),  # the first half only (e.g. one of two fused experts)
        (4097, (slice(0, 4096),)),  # all but the last element (sampled since the sample spreads over the tail)
        (64, (slice(0, 1),)),  # one element of a small slot (whole-tensor sample)
        (8192, (slice(0, 2048), slice(4096, 8192))),  # two writes, a hole between them
    ],
    ids=["half", "all-but-last", "one-element", "two-parts-and-a-hole"],
)


def _partial_reload(layer: _Partial, contract: GraphContract, seed: int) -> ReloadOutcome:
    captured = layer.s
    new = torch.randn(layer.w.numel(), generator=torch.Generator().manual_seed(seed))

    def body() -> None:
        layer.w.data.copy_(new)
        layer.pwal()

    outcome = _reload(contract, body)
    _assert_promise(outcome, [("s", lambda: layer.s, captured, new * 2)])
    return outcome


@_PARTS
def test_a_partial_in_place_refresh_on_a_recorded_reload_does_not_commit_stale(
    n: int, writes: tuple[slice, ...]
) -> None:
    layer = _Partial(n, writes)
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    outcome = _partial_reload(layer, contract, 3)  # the first reload records PWAL
    assert outcome.status is not Status.COMMITTED
    assert any(f.kind is FindingKind.STALE and "only in part" in f.detail for f in outcome.findings), outcome


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_an_in_place_refresh_written_in_parts_that_cover_it_commits(mode: str) -> None:
    """Two writes, one per half, leave no byte out: refreshed."""
    layer = _Partial(8192, (slice(4096, 8192), slice(0, 4096)))
    contract = GraphContract(layer, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    for seed in (3, 4):
        outcome = _partial_reload(layer, contract, seed)
        assert outcome.status is Status.COMMITTED, outcome.summary()


@_PARTS
def test_a_partial_in_place_refresh_on_a_later_reload_does_not_commit_stale(n: int, writes: tuple[slice, ...]) -> None:
    """Every reload is recorded (``record_reloads="every"``, the default): a later reload's partial write is
    counted as on the first."""
    layer = _Partial(n, (slice(0, n),))  # whole the first times
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    for seed in (3, 4):
        assert _partial_reload(layer, contract, seed).status is Status.COMMITTED
    layer.writes = writes
    outcome = _partial_reload(layer, contract, 5)
    assert outcome.status is not Status.COMMITTED
    assert any(f.kind is FindingKind.STALE and "only in part" in f.detail for f in outcome.findings), outcome


# ---------------------------------------------------------------------------------------------------------------
# 4. Layouts the batch does not join (conj, neg, transposed, Parameter subclass with grad), mixed with joined ones.
# ---------------------------------------------------------------------------------------------------------------


class _Views(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(48, 40), requires_grad=False)
        self.policy = "rebuild"
        self.s = self.expected()
        self.plain = self.w.detach() + 1  # joined with the others of its dtype
        register_derived(self, "s", self.s, derived_from="w")
        register_derived(self, "plain", self.plain, derived_from="w")

    def expected(self) -> torch.Tensor:
        w = self.w.detach()
        if self.kind == "conj":
            return torch.complex(w, w * 0.5).conj()
        if self.kind == "neg":
            return torch._neg_view(torch.complex(w, -w))
        if self.kind == "transposed":
            return (w * 3).t()
        if self.kind == "param_grad":
            return nn.Parameter(w * 3, requires_grad=True)
        if self.kind == "offset_view":
            return (w * 3).reshape(-1)[7:1207]
        raise AssertionError(self.kind)

    def pwal(self) -> None:
        if self.policy == "rebuild":
            self.s = self.expected()
        elif self.policy == "in_place":
            with torch.no_grad():
                self.s.copy_(self.expected())
        self.plain.copy_(self.w.detach() + 1)


@pytest.mark.parametrize("kind", ["conj", "neg", "transposed", "param_grad", "offset_view"])
@pytest.mark.parametrize("policy", ["rebuild", "in_place", "skip"])
def test_unjoined_layouts_are_judged_like_joined_ones(kind: str, policy: str) -> None:
    layer = _Views(kind)
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    captured, plain = layer.s, layer.plain
    layer.policy = policy
    new = torch.randn(48, 40, generator=torch.Generator().manual_seed(5))

    def body() -> None:
        layer.w.data.copy_(new)
        layer.pwal()

    outcome = _reload(contract, body)
    expected = layer.expected()
    if policy == "skip":
        assert outcome.status is not Status.COMMITTED
    _assert_promise(
        outcome,
        [("s", lambda: layer.s, captured, expected.detach()), ("plain", lambda: layer.plain, plain, new + 1)],
    )


# ---------------------------------------------------------------------------------------------------------------
# 5. The "same weights written again" exception: inputs only *maybe* written (version moved, sampled values the
#    same) and the slot's version moved (a no-op in-place write) pass for a same-weights reload.
# ---------------------------------------------------------------------------------------------------------------


class _Clamp(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n), requires_grad=False)
        self.s = self.w.detach() * 2
        self.noop = True
        register_derived(self, "s", self.s, derived_from="w")

    def pwal(self) -> None:
        # "already processed": the recompute is skipped, a final in-place clamp still runs
        if self.noop:
            self.s.clamp_(-1e30, 1e30)


@pytest.mark.parametrize("noop", [True, False], ids=["noop-write", "untouched"])
@pytest.mark.parametrize("how", ["param.copy_", "new-parameter"])
def test_a_weight_change_outside_its_sample_with_a_noop_slot_write_does_not_commit_stale(noop: bool, how: str) -> None:
    n = 1024  # the input sample is every 4th element (1024 // 256)
    layer = _Clamp(n)
    layer.noop = noop
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    captured = layer.s
    new = layer.w.detach().clone()
    new[1::4] += 1.0  # every element the input sample skips changes

    def body() -> None:
        if how == "param.copy_":
            layer.w.copy_(new)  # through the parameter: its version counter moves
        else:
            layer.w = nn.Parameter(new.clone(), requires_grad=False)  # a new storage, same sampled values
        layer.pwal()

    outcome = _reload(contract, body)
    _assert_promise(outcome, [("s", lambda: layer.s, captured, new * 2)])


# ---------------------------------------------------------------------------------------------------------------
# 6. Layerwise: a second before_layer() over a layer already snapshotted (a parent visited after its child, a
#    loader that calls before_layer per weight) re-takes its samples after its load.
# ---------------------------------------------------------------------------------------------------------------


class _Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16), requires_grad=False)
        self.s = self.w.detach() * 2
        self.skip = False
        register_derived(self, "s", self.s, derived_from="w")

    def pwal(self) -> None:
        if not self.skip:
            self.s = self.w.detach() * 2


class _Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = _Child()
        self.v = nn.Parameter(torch.randn(4), requires_grad=False)


@pytest.mark.parametrize("order", ["child-then-parent", "twice-same-layer"])
def test_a_second_before_layer_after_the_load_does_not_hide_a_stale_slot(order: str) -> None:
    model = _Parent()
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    captured = model.child.s
    model.child.skip = True
    new = torch.randn(16, generator=torch.Generator().manual_seed(9))

    def body() -> None:
        txn = contract._active
        txn.before_layer(model.child)
        model.child.w.data.copy_(new)
        model.child.pwal()
        if order == "child-then-parent":
            txn.before_layer(model)  # covers the child again, already loaded
            model.v.data.copy_(model.v + 1)
            txn.after_layer(model)
        else:
            txn.before_layer(model.child)  # e.g. a loader calling it once per weight of the layer
            txn.after_layer(model.child)

    try:
        with contract.reload(layerwise=True), torch.no_grad():
            body()
    except (ReloadFailedError, GraphSafeError):
        pass
    outcome = contract.last_outcome
    _assert_promise(outcome, [("child.s", lambda: model.child.s, captured, new * 2)])


# ---------------------------------------------------------------------------------------------------------------
# 7. Layerwise, two layers whose slots are views of one pool (restored together at finish): sampled at each
#    before_layer(), judged at finish(), after other layers' after_layer() copies landed.
# ---------------------------------------------------------------------------------------------------------------


class _PoolUser(nn.Module):
    def __init__(self, pool: torch.Tensor, start: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n), requires_grad=False)
        self.s = pool[start : start + n]
        self.s.copy_(self.w.detach() * 2)
        self.policy = "in_place"
        register_derived(self, "s", self.s, derived_from="w")

    def pwal(self) -> None:
        if self.policy == "in_place":
            self.s.copy_(self.w.detach() * 2)
        elif self.policy == "rebuild":
            self.s = self.w.detach() * 2


class _Lone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5000), requires_grad=False)
        self.s = self.w.detach() + 1
        register_derived(self, "s", self.s, derived_from="w")

    def pwal(self) -> None:
        self.s = self.w.detach() + 1


@pytest.mark.parametrize(
    "policies", [("in_place", "in_place"), ("rebuild", "in_place"), ("in_place", "skip"), ("skip", "rebuild")]
)
def test_layers_sharing_a_pool_are_sampled_early_and_judged_at_finish(policies: tuple[str, str]) -> None:
    pool = torch.zeros(600)
    model = nn.Module()
    model.a = _PoolUser(pool, 0, 300)
    model.mid = _Lone()
    model.b = _PoolUser(pool, 300, 300)
    contract = GraphContract(model, "recapture", detect="declared-only").seal()
    caps = (model.a.s, model.mid.s, model.b.s)
    model.a.policy, model.b.policy = policies
    g = torch.Generator().manual_seed(11)
    news = [torch.randn(300, generator=g), torch.randn(5000, generator=g), torch.randn(300, generator=g)]
    try:
        with contract.reload(layerwise=True) as txn, torch.no_grad():
            for layer, w in zip((model.a, model.mid, model.b), news, strict=True):
                txn.before_layer(layer)
                layer.w.data.copy_(w)
                layer.pwal()
                txn.after_layer(layer)
    except (ReloadFailedError, GraphSafeError):
        pass
    outcome = contract.last_outcome
    if "skip" in policies:
        assert outcome.status is not Status.COMMITTED
    _assert_promise(
        outcome,
        [
            ("a.s", lambda: model.a.s, caps[0], news[0] * 2),
            ("mid.s", lambda: model.mid.s, caps[1], news[1] + 1),
            ("b.s", lambda: model.b.s, caps[2], news[2] * 2),
        ],
    )
    if outcome.status is Status.COMMITTED:
        assert torch.equal(pool, torch.cat([news[0] * 2, news[2] * 2]))


class _Empty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4), requires_grad=False)
        self.s = self.w.detach()[:0] * 2  # a declared slot with no elements (an empty expert list, say)
        self.t = self.w.detach() * 2
        register_derived(self, "s", self.s, derived_from="w")
        register_derived(self, "t", self.t, derived_from="w")

    def pwal(self) -> None:
        self.s.mul_(1)  # written in place: nothing to hold
        self.t.copy_(self.w.detach() * 2)


def test_an_empty_slot_on_no_memory_written_in_place_commits() -> None:
    """An empty slot on a storage of no bytes (``w[:0] * 2``: a new tensor, nothing allocated) holds no value for
    a change of its inputs to leave old: PWAL writing it in place commits, and its non-empty partner is restored as
    usual. (An empty *view* into a storage with bytes stays watched: it can be the only witness of a tensor PWAL
    skipped, ``test_a_skipped_tensor_whose_only_declared_view_is_empty_is_stale`` in tests/fuzz/test_regressions.py.)"""
    layer = _Empty()
    assert layer.s.untyped_storage().nbytes() == 0
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    captured = layer.t

    def body() -> None:
        layer.w.data.copy_(torch.arange(4.0))
        layer.pwal()

    outcome = _reload(contract, body)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(captured, torch.arange(4.0) * 2)
