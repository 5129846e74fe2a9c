"""A restore never ties two paths the model did not tie, judged by memory (``_holders.new_ties``): a keeping path
in an earlier ``after_layer()`` step, one memory under two storage objects, a captured object PWAL re-pointed,
keepers without strided memory, manifest holders; and no tie is claimed where no byte is shared.

Every reload loads weights other than the sealed ones. Oracle, independent of graphsafe: which paths share memory
(by address range of their storages, so two storage objects on one memory count) at the seal and as the model's
own last PWAL left them; a restore may leave no other sharing. Where a path's values are asserted, they are the
values a cold model built from the new weights holds (PWAL's formula applied to the loaded weights).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, ReloadFailedError, Status, register_derived
from graphsafe.errors import GraphSafeError

MODES = ("strict", "recapture", "migrate")
DETECTS = ("declared-only", "sealed-paths", "every-reload")


class Marked(torch.Tensor):
    """A tensor subclass without behaviour of its own."""


def _get(model: nn.Module, path: str) -> torch.Tensor:
    obj: object = model
    for atom in path.split("."):
        obj = getattr(obj, atom)
    assert isinstance(obj, torch.Tensor)
    return obj


def _memory(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _sharing(model: nn.Module, paths: tuple[str, ...]) -> set[tuple[str, str]]:
    """Pairs of paths whose storages' memory overlaps (by address: two storage objects on one memory count)."""
    spans = {p: _memory(_get(model, p)) for p in paths}
    return {
        (a, b)
        for a, b in itertools.combinations(paths, 2)
        if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1] and spans[a][0] != spans[a][1]
    }


def _outcome(contract: GraphContract):
    out = contract.last_outcome
    assert out is not None
    return out


def _new(seed: int) -> torch.Tensor:
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# 1. Across layerwise steps. Layer 0 is loaded with the weights layer 1 had at the seal, so layer 1's captured ``d``
#    already holds layer 0's new ``x`` values: layer 0's PWAL takes that tensor for its ``x`` (a pooled buffer;
#    respecified: another type) without writing it. Layer 1 is loaded and its PWAL gives ``d`` a fresh tensor of its
#    values (equal to the captured ones). after_layer(layer 1) copies into its captured ``d`` and binds it back:
#    ``layers.0.x`` and ``layers.1.d`` are tied, though neither the seal nor PWAL tied them. The keeping path is in
#    an earlier step: the rule keeps the paths each after_layer() left on new tensors.
# ---------------------------------------------------------------------------------------------------------------


class XD(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(seed), requires_grad=False)
        w = self.weight.detach()
        self.x = w.t().contiguous().as_subclass(Marked)
        self.d = w.t().contiguous()
        self.declare()

    def declare(self) -> None:
        register_derived(self, "x", derived_from="weight")
        register_derived(self, "d", derived_from="weight")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([XD(1), XD(2)])


PATHS = ("layers.0.x", "layers.0.d", "layers.1.x", "layers.1.d")


def _run_layerwise(contract: GraphContract, net: Net, steps) -> set[tuple[str, str]]:
    """``steps``: per layer, the load and PWAL to run in its window. Returns the sharing the model's last PWAL
    left."""
    left: set[tuple[str, str]] = set()
    try:
        with contract.reload(layerwise=True) as txn, torch.no_grad():
            for layer, pwal in zip(net.layers, steps, strict=True):
                txn.before_layer(layer)
                pwal()
                left = _sharing(net, PATHS)
                txn.after_layer(layer)
    except (ReloadFailedError, GraphSafeError):
        pass
    return left


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_keeper_in_an_earlier_step_is_not_tied_to_a_later_restore(mode: str, detect: str, layerwise: bool) -> None:
    """(whole: the same reload in one step.)"""
    net = Net()
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    sealed = _sharing(net, PATHS)
    l0, l1 = net.layers
    new0 = l1.weight.detach().clone()  # layer 0 gets what layer 1 had: other weights than layer 0's at the seal
    new1 = l1.weight.detach().clone()
    cold_x0 = new0.t().clone()

    def pwal0() -> None:
        l0.weight.copy_(new0)
        l0.x = l1.d  # a pooled tensor that already holds these values (layer 1's captured d), not written
        l0.d.copy_(new0.t())
        l0.declare()

    def pwal1() -> None:
        l1.weight.copy_(new1)
        l1.d = new1.t().contiguous()  # a fresh tensor: its captured one is restored
        l1.x.copy_(new1.t())
        l1.declare()

    if layerwise:
        left = _run_layerwise(contract, net, (pwal0, pwal1))
    else:
        left = set()
        try:
            with contract.reload(), torch.no_grad():
                pwal0()
                pwal1()
                left = _sharing(net, PATHS)
        except (ReloadFailedError, GraphSafeError):
            pass
    out = _outcome(contract)
    assert torch.equal(l0.x.as_subclass(torch.Tensor), cold_x0)
    made = _sharing(net, PATHS) - sealed - left
    assert not made, f"paths {made} share memory neither the seal nor PWAL shared ({out.status}: {out.summary()})"


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_no_tie_left_by_a_layerwise_restore_makes_the_reload_after_a_recapture_commit_wrong_values(
    mode: str, detect: str
) -> None:
    """The harm of the tie above: the reload ends NEEDS_RECAPTURE (FAILED in strict); the graphs are captured again
    from the model as it is and the contract resealed. The next reload (new weights for both layers, PWAL writing
    each derived tensor in place) COMMITS while ``layers.0.x`` reads layer 1's values, not a cold model's."""
    net = Net()
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l0, l1 = net.layers
    new0 = l1.weight.detach().clone()
    new1 = l1.weight.detach().clone()

    def pwal0() -> None:
        l0.weight.copy_(new0)
        l0.x = l1.d
        l0.d.copy_(new0.t())
        l0.declare()

    def pwal1() -> None:
        l1.weight.copy_(new1)
        l1.d = new1.t().contiguous()
        l1.x.copy_(new1.t())
        l1.declare()

    _run_layerwise(contract, net, (pwal0, pwal1))
    assert _outcome(contract).status is not Status.COMMITTED
    contract.reseal(recaptured=True)  # the graphs were captured again from the model as it is
    a, b = _new(21), _new(22)
    try:
        with contract.reload(), torch.no_grad():
            l0.weight.copy_(a)
            l1.weight.copy_(b)
            l0.x.copy_(a.t())
            l0.d.copy_(a.t())
            l1.x.copy_(b.t())
            l1.d.copy_(b.t())
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    if out.status is Status.COMMITTED:
        assert torch.equal(l0.x.as_subclass(torch.Tensor), a.t()), (
            f"COMMITTED while layers.0.x reads layer 1's values ({out.summary()})"
        )


# ---------------------------------------------------------------------------------------------------------------
# 3. A path the contract does not track (detect="declared-only", an undeclared attribute): PWAL hands it the
#    captured ``d`` and gives ``d`` a fresh copy of the same values. The restore binds the captured ``d`` back.
# ---------------------------------------------------------------------------------------------------------------


class DU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        w = self.weight.detach()
        self.d = w.t().contiguous()
        self.u = (w * 2).t().contiguous().as_subclass(Marked)  # never declared
        register_derived(self, "d", derived_from="weight")

    def pwal(self) -> None:
        w = self.weight.detach()
        old = self.d
        old.copy_(w.t())
        self.u = old  # kept by the untracked path
        self.d = old.clone()
        register_derived(self, "d", derived_from="weight")


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_an_untracked_keeper_is_not_tied(mode: str, detect: str, layerwise: bool) -> None:
    layer = DU()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    paths = ("d", "u")
    sealed = _sharing(layer, paths)
    left: set[tuple[str, str]] = set()
    try:
        with contract.reload(layerwise=layerwise) as txn, torch.no_grad():
            if layerwise:
                txn.before_layer(layer)
            layer.weight.copy_(_new(7))
            layer.pwal()
            left = _sharing(layer, paths)
            if layerwise:
                txn.after_layer(layer)
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    made = _sharing(layer, paths) - sealed - left
    assert not made, f"paths {made} share memory neither the seal nor PWAL shared ({out.status}: {out.summary()})"


# ---------------------------------------------------------------------------------------------------------------
# 4. One memory under two storage objects: the keeping path's new tensor is a from_numpy / DLPack import of part of
#    the captured tensor (its storage starts inside the captured one): the rule goes by address, not storage object.
#    ``k`` is computed from ``weight_k``, ``d`` from ``weight``; this reload loads the same new values into both,
#    so k's values are the bytes it shares with d's captured tensor.
# ---------------------------------------------------------------------------------------------------------------


class DK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        self.weight_k = nn.Parameter(_new(2), requires_grad=False)
        self.k = self.weight_k.detach().t().reshape(-1)[1:].clone().as_subclass(Marked)  # (7,)
        self.d = self.weight.detach().t().contiguous()
        self.declare()

    def declare(self) -> None:
        register_derived(self, "k", derived_from="weight_k")
        register_derived(self, "d", derived_from="weight")

    def load(self, w: torch.Tensor, wk: torch.Tensor) -> None:
        self.weight.copy_(w)
        self.weight_k.copy_(wk)

    def pwal(self, how: str) -> None:
        old = self.d
        old.copy_(self.weight.detach().t())
        flat = old.reshape(-1)
        if how == "numpy":
            self.k = torch.from_numpy(flat.numpy()[1:])  # its storage starts 4 bytes into d's captured one
        elif how == "dlpack":
            self.k = torch.from_dlpack(flat[1:])
        else:  # a view on the same storage object
            self.k = flat[1:]
        self.d = old.clone()
        self.declare()

    def pwal_in_place(self) -> None:
        self.k.copy_(self.weight_k.detach().t().reshape(-1)[1:])
        self.d.copy_(self.weight.detach().t())

    def cold(self) -> dict[str, torch.Tensor]:
        return {"k": self.weight_k.detach().t().reshape(-1)[1:], "d": self.weight.detach().t()}


@pytest.mark.parametrize("how", ["view", "numpy", "dlpack"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_keeper_on_captured_memory_under_another_storage_object_is_not_tied(mode: str, detect: str, how: str) -> None:
    layer = DK()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    paths = ("k", "d")
    sealed = _sharing(layer, paths)
    left: set[tuple[str, str]] = set()
    try:
        with contract.reload(), torch.no_grad():
            layer.load(_new(7), _new(7))
            layer.pwal(how)
            left = _sharing(layer, paths)
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    made = _sharing(layer, paths) - sealed - left
    assert not made, f"paths {made} share memory neither the seal nor PWAL shared ({out.status}: {out.summary()})"


# ---------------------------------------------------------------------------------------------------------------
# 5. The keeping path still holds its captured OBJECT, but PWAL re-pointed that object at another slot's captured
#    storage (``.data =``): the rule asks where a path reads, not which object it holds. ``a`` from ``weight_a``,
#    ``d`` from ``weight``, the same new values in both.
# ---------------------------------------------------------------------------------------------------------------


class DD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        self.weight_a = nn.Parameter(_new(2), requires_grad=False)
        self.a = self.weight_a.detach().t().contiguous()
        self.d = self.weight.detach().t().contiguous()
        self.declare()

    def declare(self) -> None:
        register_derived(self, "a", derived_from="weight_a")
        register_derived(self, "d", derived_from="weight")

    def load(self, w: torch.Tensor, wa: torch.Tensor) -> None:
        self.weight.copy_(w)
        self.weight_a.copy_(wa)

    def pwal(self, how: str = "") -> None:
        old = self.d
        old.copy_(self.weight.detach().t())
        self.a.data = old  # a's captured object now reads d's captured storage (its values: weight_a's = weight's)
        self.d = old.clone()
        self.declare()

    def pwal_in_place(self) -> None:
        self.a.copy_(self.weight_a.detach().t())
        self.d.copy_(self.weight.detach().t())

    def cold(self) -> dict[str, torch.Tensor]:
        return {"a": self.weight_a.detach().t(), "d": self.weight.detach().t()}


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_captured_object_re_pointed_at_another_slot_is_not_tied_to_it(mode: str, detect: str) -> None:
    layer = DD()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    paths = ("a", "d")
    sealed = _sharing(layer, paths)
    left: set[tuple[str, str]] = set()
    try:
        with contract.reload(), torch.no_grad():
            layer.load(_new(7), _new(7))
            layer.pwal()
            left = _sharing(layer, paths)
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    made = _sharing(layer, paths) - sealed - left
    assert not made, f"paths {made} share memory neither the seal nor PWAL shared ({out.status}: {out.summary()})"


@pytest.mark.parametrize(
    ("model", "how"), [(DK, "numpy"), (DK, "dlpack"), (DD, "")], ids=["numpy-import", "dlpack-import", "re-pointed"]
)
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_no_tie_left_by_a_restore_makes_the_reload_after_a_recapture_commit_wrong_values(
    mode: str, detect: str, model, how: str
) -> None:
    """The harm of the ties of 4 and 5: after the recapture the reload asked for (a reseal of the model as it is),
    the next reload loads different values into the two weights and PWAL writes both derived tensors in place."""
    layer = model()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    try:
        with contract.reload(), torch.no_grad():
            layer.load(_new(7), _new(7))
            layer.pwal(how)
    except (ReloadFailedError, GraphSafeError):
        pass
    assert _outcome(contract).status is not Status.COMMITTED
    contract.reseal(recaptured=True)
    try:
        with contract.reload(), torch.no_grad():
            layer.load(_new(21), _new(22))
            layer.pwal_in_place()
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    if out.status is Status.COMMITTED:
        wrong = [p for p, v in layer.cold().items() if not torch.equal(_get(layer, p).as_subclass(torch.Tensor), v)]
        assert not wrong, f"COMMITTED while {wrong} read other values than a cold model ({out.summary()})"


# ---------------------------------------------------------------------------------------------------------------
# 6. A keeper without strided storage of its own that reads the captured memory: a sparse COO tensor whose values
#    are d's captured tensor (torch keeps the values tensor given, no copy): it has no strided memory of its own
#    to compare, and must still not be left reading what a copy writes.
#    ``k`` from ``weight_k``, ``d`` from ``weight``. "equal": both weights get the same new values (a tie no value
#    check sees); "differ": different values, so the copy into d's captured memory also changes what k reads.
# ---------------------------------------------------------------------------------------------------------------


class DS(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        self.weight_k = nn.Parameter(_new(2), requires_grad=False)
        self.k = self.weight_k.detach().t().reshape(-1).clone()  # dense at the seal
        self.d = self.weight.detach().t().contiguous()
        register_derived(self, "k", derived_from="weight_k")
        register_derived(self, "d", derived_from="weight")

    def pwal(self, how: str) -> None:
        old = self.d
        old.copy_(self.weight_k.detach().t())  # k's values, in the buffer k will read
        values = old.reshape(-1)
        if how == "sparse":
            self.k = torch.sparse_coo_tensor(torch.arange(8).unsqueeze(0), values, (8,), is_coalesced=True)
        else:  # a jagged nested tensor (a wrapper subclass): the control
            self.k = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 3, 8]))
        self.d = self.weight.detach().t().contiguous()  # a fresh tensor: d's captured one is restored
        register_derived(self, "k", derived_from="weight_k")
        register_derived(self, "d", derived_from="weight")


def _reads(t: torch.Tensor) -> torch.Tensor:
    if t.layout is torch.sparse_coo:
        return t._values()
    if t.is_nested:
        return t.values()
    return t


@pytest.mark.parametrize("values", ["equal", "differ"])
@pytest.mark.parametrize("how", ["sparse", "jagged"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_sparse_keeper_on_captured_memory_is_not_tied_or_left_stale(
    mode: str, detect: str, how: str, values: str
) -> None:
    layer = DS()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    new, new_k = _new(7), (_new(7) if values == "equal" else _new(8))
    cold_k = new_k.t().reshape(-1).clone()
    left_shared = True
    try:
        with contract.reload(), torch.no_grad():
            layer.weight.copy_(new)
            layer.weight_k.copy_(new_k)
            layer.pwal(how)
            left_shared = _reads(layer.k).data_ptr() == layer.d.data_ptr()
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    assert not left_shared  # PWAL left k and d on different memory
    k_reads = _reads(layer.k)
    tied = k_reads.untyped_storage().data_ptr() == layer.d.untyped_storage().data_ptr()
    wrong = not torch.equal(k_reads, cold_k)
    assert not tied and not wrong, (
        f"k {'shares memory with d' if tied else ''} {'reads other values than a cold model' if wrong else ''} "
        f"({out.status}: {out.summary()})"
    )


# ---------------------------------------------------------------------------------------------------------------
# 7. No tie where no byte is shared (findings, not the status: the keeper is respecified, so the reload asks for a
#    recapture anyway).
#    a) Zero-byte storages (every one at data_ptr 0): a slot ``k`` given an empty tensor (respecified) shares no
#       byte with the empty slot ``e``, whose restore must not be taken back.
#    b) By storage, not bytes: a packed buffer holds ``s`` then ``r``; ``kt`` (own memory at the seal) becomes a view
#       of ``s`` (the model ties them); ``r`` gets a fresh tensor. Restoring r writes bytes kt does not read: by
#       bytes, not by storage, nothing is tied.
# ---------------------------------------------------------------------------------------------------------------


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        self.k = self.weight.detach().t().contiguous()
        self.e = torch.empty(0, 2)  # an empty derived tensor (a feature this weight lacks)
        self.declare()

    def declare(self) -> None:
        register_derived(self, "k", derived_from="weight")
        register_derived(self, "e", derived_from="weight")

    def pwal(self) -> None:
        self.k = torch.empty(0, 4)  # now empty too (respecified)
        self.e = torch.empty(0, 2)  # a fresh empty tensor: its captured one is restored (nothing to copy)
        self.declare()


class PackedView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        w = self.weight.detach()
        packed = torch.empty(16)
        self.r = packed[:8].view(2, 4)
        self.s = packed[8:].view(2, 4)
        self.r.copy_(w.t())
        self.s.copy_(w.t() * 2)
        self.kt = (w * 2).contiguous()  # s transposed, its own memory at the seal
        self.declare()

    def declare(self) -> None:
        for path in ("r", "s", "kt"):
            register_derived(self, path, derived_from="weight")

    def pwal(self) -> None:
        w = self.weight.detach()
        self.s.copy_(w.t() * 2)
        self.kt = self.s.t()  # a view of s now (respecified): the model ties kt to s
        self.r = w.t().contiguous()  # fresh, laid out as r was sealed
        self.declare()


@pytest.mark.parametrize("model", [WithEmpty, PackedView], ids=["empty", "packed"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_no_alias_broken_where_nothing_would_share_bytes(mode: str, detect: str, model) -> None:
    layer = model()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    restored = "e" if model is WithEmpty else "r"
    captured = _get(layer, restored)
    try:
        with contract.reload(), torch.no_grad():
            layer.weight.copy_(_new(7))
            layer.pwal()
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    broken = [f for f in out.findings if f.kind.name == "ALIAS_BROKEN" and str(f.slot).endswith(f":{restored}")]
    assert not broken, f"{restored}: {broken[0].detail}"
    assert _get(layer, restored) is captured


# ---------------------------------------------------------------------------------------------------------------
# 8. A manifest holder (a path the capture recorded, ``record_capture`` around a plain forward; not declared, so
#    with detect="declared-only" a watch-only slot): PWAL hands it d's captured tensor (written with h's values,
#    which equal d's this time: ``h`` from ``weight_h``, ``d`` from ``weight``) and gives d a fresh tensor. A
#    moved watch-only slot lets go of its captured tensor (``captured`` None).
# ---------------------------------------------------------------------------------------------------------------


class WithHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_new(1), requires_grad=False)
        self.weight_h = nn.Parameter(_new(2), requires_grad=False)
        self.d = self.weight.detach().t().contiguous()
        self.h = self.weight_h.detach().t().contiguous().as_subclass(Marked)  # read by the forward, never declared
        register_derived(self, "d", derived_from="weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.d + x @ self.h.as_subclass(torch.Tensor)

    def pwal(self) -> None:
        old = self.d
        old.copy_(self.weight_h.detach().t())  # h's values
        self.h = old  # (Marked -> plain)
        self.d = self.weight.detach().t().contiguous()
        register_derived(self, "d", derived_from="weight")


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_manifest_holder_is_not_tied(mode: str, detect: str) -> None:
    from graphsafe.collectors import record_capture

    layer = WithHolder()
    contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
    with record_capture(contract), torch.no_grad():
        layer(torch.randn(3, 2))
    paths = ("d", "h")
    sealed = _sharing(layer, paths)
    left: set[tuple[str, str]] = set()
    try:
        with contract.reload(), torch.no_grad():
            layer.weight.copy_(_new(7))
            layer.weight_h.copy_(_new(7))
            layer.pwal()
            left = _sharing(layer, paths)
    except (ReloadFailedError, GraphSafeError):
        pass
    out = _outcome(contract)
    made = _sharing(layer, paths) - sealed - left
    assert not made, f"paths {made} share memory neither the seal nor PWAL shared ({out.status}: {out.summary()})"
