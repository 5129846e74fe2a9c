"""A recorded reload (every reload, by default) whose PWAL rewrites a derived slot in place only in part
(``collectors/_dataflow.py``, ``Dataflow.unwritten_bytes``; ``contract/_freshness.py``): through indices, a mask,
``scatter_``, a strided view with gaps, and followed by a new view of the same memory, the slot is ``stale`` where its
inputs changed; so is one whose partial write is followed by a whole write of the slot's own old values (a no-op
scale, a copy of itself), which refreshes nothing. A write the dispatcher never sees (a NumPy view) is judged by
the slot's inputs (``tests/contract/test_unseen_writes.py``). Every reload loads different weights; the oracle is
computed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadFailedError, ReloadOutcome, Status, register_derived
from graphsafe.errors import GraphSafeError

N = 8192


class _Slot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(N), requires_grad=False)
        self.s = self.w.detach() * 2
        register_derived(self, "s", self.s, derived_from="w")


def recorded_reload(
    layer: nn.Module, write: Callable[[Any, torch.Tensor], Any], mode: str = "recapture"
) -> tuple[ReloadOutcome, torch.Tensor, torch.Tensor, Exception | None]:
    """The first (recorded) reload of ``layer`` (a weight ``w`` and a slot ``s = w * 2``) with new weights, PWAL being
    ``write(layer, new * 2)``: the outcome, the captured slot, the values it must hold, and any exception other than
    graphsafe's own refusal (graphsafe breaking the user's PWAL)."""
    contract = GraphContract(layer, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    captured = layer.s
    new = torch.randn(tuple(layer.w.shape), generator=torch.Generator().manual_seed(7))
    error = None
    try:
        with contract.reload(), torch.no_grad():
            layer.w.data.copy_(new)
            write(layer, new * 2)
    except (ReloadFailedError, GraphSafeError):
        pass
    except Exception as exc:
        error = exc
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome, captured, new * 2, error


def _partial(write: Callable[[_Slot, torch.Tensor], None], mode: str = "recapture") -> None:
    layer = _Slot()
    outcome, captured, _, error = recorded_reload(layer, write, mode)
    assert error is None, repr(error)
    new = layer.w.detach()
    if outcome.status is Status.COMMITTED:
        assert layer.s.data_ptr() == captured.data_ptr()
        left = int((captured != new * 2).sum())
        assert left == 0, f"COMMITTED, but {left} of {N} captured elements hold old values"


_HALF = torch.arange(N // 2)


def _mask() -> torch.Tensor:
    m = torch.zeros(N, dtype=torch.bool)
    m[: N // 2] = True
    return m


@pytest.mark.parametrize(
    "write",
    [
        lambda layer, v: layer.s.index_copy_(0, _HALF, v[: N // 2]),
        lambda layer, v: layer.s.__setitem__(_mask(), v[_mask()]),  # index_put_ with a mask
        lambda layer, v: layer.s.scatter_(0, _HALF, v[: N // 2]),
    ],
    ids=["index_copy_", "boolean-mask-assign", "scatter_"],
)
def test_a_half_refresh_through_indices_is_not_committed(write) -> None:
    """An indexed write marks the rows it reached."""
    _partial(write)


@pytest.mark.parametrize(
    "write",
    [
        lambda layer, v: layer.s[::2].copy_(v[::2]),
        lambda layer, v: layer.s.view(64, 128)[:, :64].copy_(
            v.view(64, 128)[:, :64]
        ),  # a column block (one of two heads)
    ],
    ids=["every-second", "column-block"],
)
def test_a_half_refresh_through_a_strided_view_with_gaps_is_not_committed(write) -> None:
    """A strided write marks the elements it reached."""
    _partial(write)


@pytest.mark.parametrize(
    "rebind",
    [
        lambda layer: setattr(layer, "s", layer.s.view(N)),
        lambda layer: setattr(layer, "s", layer.s.detach()),
        lambda layer: layer.s.set_(layer.s.untyped_storage(), 0, (N,), (1,)),
    ],
    ids=["view", "detach", "set_"],
)
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_half_refresh_followed_by_a_new_view_of_the_same_memory_is_not_committed(rebind, mode: str) -> None:
    """The path's new view reads the same memory: judged by the bytes of the tensor it held before the load (``set_``
    changes only the view: it marks nothing)."""

    def write(layer: _Slot, value: torch.Tensor) -> None:
        layer.s[: N // 2].copy_(value[: N // 2])
        rebind(layer)

    _partial(write, mode)


@pytest.mark.parametrize(
    "after",
    [
        lambda s: s.mul_(1.0),
        lambda s: s.add_(0.0),
        lambda s: s.copy_(s * 1.0),
        lambda s: s.copy_(s.clone()),
        lambda s: torch.mul(s, 1.0, out=s),
        lambda s: s.clamp_(-float("inf"), float("inf")),
        lambda s: s.index_add_(0, torch.arange(N), torch.zeros(N)),
    ],
    ids=["mul_", "add_", "copy-of-a-product", "copy-of-a-clone", "out=", "clamp_", "index_add_"],
)
def test_a_half_refresh_followed_by_a_whole_write_of_its_own_values_is_not_committed(after) -> None:
    """A whole write after the partial one that reads the slot's old values (a scale of 1, a copy of itself) leaves
    half of it old: it refreshes nothing."""
    _half_refresh_then(after)


def _half_refresh_then(after: Callable[[torch.Tensor], Any]) -> None:
    """PWAL refreshes the first half of the slot, then runs ``after`` on it: never committed with old values, and
    the slot is ``stale``, refreshed only in part."""

    def write(layer: _Slot, value: torch.Tensor) -> None:
        layer.s[: N // 2].copy_(value[: N // 2])
        after(layer.s)

    _partial(write)
    layer = _Slot()
    outcome, _, _, error = recorded_reload(layer, write)
    assert error is None, repr(error)
    assert any(f.kind is FindingKind.STALE and "only in part" in f.detail for f in outcome.findings), outcome


@pytest.mark.parametrize(
    "write",
    [
        lambda s, v: (s.copy_(v), s.mul_(1.0)),
        lambda s, v: (s.copy_(v), s.copy_(s * 1.0)),
        lambda s, v: (s[: N // 2].copy_(v[: N // 2]), s[N // 2 :].copy_(s[: N // 2] * 0 + v[N // 2 :])),
        lambda s, v: (s.zero_(), s.add_(v)),
        lambda s, v: s.copy_(torch.empty_like(s).copy_(v)),  # a buffer shaped like the slot, filled anew
        lambda s, v: s.copy_(s.clone().copy_(v)),  # a copy of the old slot, overwritten whole, copied back
    ],
    ids=[
        "scale-after-whole",
        "copy-of-itself-after-whole",
        "half-from-the-fresh-half",
        "zero-then-add",
        "empty-like",
        "clone-overwritten",
    ],
)
def test_a_whole_refresh_followed_by_writes_of_its_fresh_values_commits(write) -> None:
    """Reads of the slot's values after all of it (or the part read) was refreshed are reads of new values; a buffer
    made like the slot (its shape read, not its values) or overwritten whole holds none of its old values."""
    layer = _Slot()
    outcome, captured, _, error = recorded_reload(layer, lambda layer, v: write(layer.s, v))
    assert error is None, repr(error)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert layer.s.data_ptr() == captured.data_ptr()


def test_a_half_refresh_written_through_a_numpy_view_is_not_committed() -> None:
    """A write the dispatcher never sees: the recording saw no write to the slot, so its changed value sample says
    nothing about how much of it is new."""

    def write(layer: _Slot, value: torch.Tensor) -> None:
        layer.s.numpy()[: N // 2] = value[: N // 2].numpy()

    _partial(write)


@torch.library.custom_op("graphsafe_tests::scale_in_place", mutates_args=("x",))
def _scale_in_place(x: torch.Tensor, factor: float) -> None:
    """A custom op that reads and writes its mutable argument (as ``fused_add_rms_norm`` does its own)."""
    x.mul_(factor)


@pytest.mark.parametrize(
    "after",
    [
        lambda s: torch._foreach_mul_([s], 1.0),
        lambda s: torch._foreach_add_([s], 0.0),
        lambda s: torch.ops.graphsafe_tests.scale_in_place(s, 1.0),
        lambda s: torch.embedding_renorm_(s.view(64, 128), torch.arange(64), 1e30, 2.0),
        lambda s: s.copy_(torch.from_dlpack(s) * 1.0),
        lambda s: s.copy_(torch.from_numpy(s.numpy()).clone()),
    ],
    ids=["foreach-mul_", "foreach-add_", "custom-op", "unmarked-indexed-op", "dlpack-alias", "numpy-alias"],
)
def test_a_half_refresh_followed_by_a_write_that_may_read_its_old_values_is_not_committed(after) -> None:
    """An op on a list (``_foreach_*``), a custom op's mutable argument (nothing says it is not read), an indexed op
    whose reach the recorder cannot mark, and a read through another storage object over the slot's memory: none
    proves the half left out refreshed."""
    _half_refresh_then(after)


_ROUND_TRIPS = [
    lambda s: s.copy_(s.to_sparse().to_dense()),
    lambda s: s.copy_(s.view(64, 128).to_sparse_csr().to_dense().view(-1)),
    lambda s: s.copy_((torch.nested.as_nested_tensor([s[:100], s[100:]], layout=torch.jagged) * 1).values()),
    lambda s: torch.ops.aten.empty_like.out(s[N // 2 :], out=s[N // 2 :]),
]
_ROUND_TRIP_IDS = ["sparse", "sparse-csr", "jagged-nested", "empty-like-out"]
if torch.backends.mkldnn.is_available():
    _ROUND_TRIPS.append(lambda s: s.copy_(s.to_mkldnn().to_dense()))
    _ROUND_TRIP_IDS.append("mkldnn")


@pytest.mark.parametrize("after", _ROUND_TRIPS, ids=_ROUND_TRIP_IDS)
def test_a_half_refresh_followed_by_a_copy_through_another_layout_is_not_committed(after) -> None:
    """Values that pass through a sparse, mkldnn or nested tensor keep what they were computed from; an ``out=``
    that allocates (``empty_like.out``) writes nothing."""
    _half_refresh_then(after)


@pytest.mark.parametrize("alias", [torch.from_dlpack, lambda s: torch.from_numpy(s.numpy())], ids=["dlpack", "numpy"])
def test_old_values_written_back_through_another_storage_object_are_not_committed(alias) -> None:
    """PWAL refreshes the slot whole, then writes a saved copy of its old first half back through a DLPack or NumPy
    import of its memory: that half is old again."""

    def write(layer: _Slot, value: torch.Tensor) -> None:
        saved = layer.s.clone()
        layer.s.copy_(value)
        alias(layer.s)[: N // 2].copy_(saved[: N // 2])

    _partial(write)
    layer = _Slot()
    outcome, _, _, error = recorded_reload(layer, write)
    assert error is None, repr(error)
    assert any(f.kind is FindingKind.STALE and "only in part" in f.detail for f in outcome.findings), outcome


def _cond(value: torch.Tensor) -> torch.Tensor:
    return torch.cond(torch.tensor(True), lambda a: a.clone(), lambda a: a * 0, (value,))


def _after_a_subclass_op(layer: _Slot, value: torch.Tensor) -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    _ = TwoTensor(value.clone(), value.clone()) * 1  # a wrapper subclass's op (its storage has no data pointer)
    layer.s.copy_(value)


@pytest.mark.parametrize(
    "write",
    [
        lambda layer, v: layer.s.copy_(_cond(v)),
        _after_a_subclass_op,
        lambda layer, v: torch.from_dlpack(layer.s).copy_(v),
    ],
    ids=["higher-order-op", "wrapper-subclass-op", "written-through-an-import"],
)
def test_a_whole_refresh_around_ops_the_recorder_follows_loosely_commits(write) -> None:
    """A higher-order op (``torch.cond``) runs inside the recording instead of raising into the PWAL; a wrapper
    subclass's op beside the refresh, and a whole refresh through an import of the slot's memory, leave it
    refreshed."""
    layer = _Slot()
    outcome, captured, expected, error = recorded_reload(layer, write)
    assert error is None, repr(error)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(captured, expected)


def _complex_rotation(layer: _Slot, value: torch.Tensor) -> None:
    layer.s[::2].copy_(value[::2])  # even elements new, odd ones old
    torch.view_as_complex(layer.s.view(N // 2, 2)).mul_(1j)  # each even element gets minus its old odd neighbour
    layer.s[1::2].copy_(value[1::2])


def _float64_round_trip(layer: _Slot, value: torch.Tensor) -> None:
    layer.s[::2].copy_(value[::2])
    layer.s.view(torch.float64).add_(1.0)  # each float64 rounds its new half by its old one
    layer.s.view(torch.float64).sub_(1.0)
    layer.s[1::2].copy_(value[1::2])


def _bytes_then_scale(layer: _Slot, value: torch.Tensor) -> None:
    layer.s.view(torch.uint8).view(N, 4)[:, :2].copy_(value.view(torch.uint8).view(N, 4)[:, :2])
    layer.s.mul_(3.0)  # each float32 mixes its two new bytes with its two old ones
    layer.s.div_(3.0)
    layer.s.view(torch.uint8).view(N, 4)[:, 2:].copy_(value.view(torch.uint8).view(N, 4)[:, 2:])


@pytest.mark.parametrize(
    "write", [_complex_rotation, _float64_round_trip, _bytes_then_scale], ids=["complex", "float64", "bytes"]
)
def test_an_elementwise_op_over_elements_part_refreshed_leaves_them_old(write) -> None:
    """An elementwise in-place op through a view whose elements span fresh and old bytes (a complex or float64 view
    of a float32 slot, a float32 op after a byte-wise write) computes each element from both: none of its bytes is
    refreshed, whatever later writes fill the rest."""
    _partial(write)
    layer = _Slot()
    outcome, _, _, error = recorded_reload(layer, write)
    assert error is None, repr(error)
    assert any(f.kind is FindingKind.STALE and "only in part" in f.detail for f in outcome.findings), outcome


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(N), requires_grad=False)
        self.s = self.w.detach() * 2
        self.t = self.w.detach() * 3
        register_derived(self, "s", self.s, derived_from="w")
        register_derived(self, "t", self.t, derived_from="w")


@pytest.mark.parametrize("order", ["t-reads-old-s", "t-reads-new-s"])
def test_a_slot_written_from_another_slots_old_values_is_not_committed(order: str) -> None:
    """``t`` computed in part from ``s`` before PWAL refreshes ``s`` holds values of the old weights; computed from
    ``s`` after, it holds new ones and commits."""
    layer = _Pair()
    captured = layer.t
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    new = torch.randn(N, generator=torch.Generator().manual_seed(7))
    try:
        with contract.reload(), torch.no_grad():
            layer.w.data.copy_(new)
            if order == "t-reads-new-s":
                layer.s.copy_(new * 2)
            layer.t[: N // 2].copy_(new[: N // 2] * 3)
            layer.t[N // 2 :].copy_(layer.s[N // 2 :] * 1.5)
            if order == "t-reads-old-s":
                layer.s.copy_(new * 2)
    except ReloadFailedError:
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    if order == "t-reads-new-s":
        assert outcome.status is Status.COMMITTED, outcome.summary()
        assert torch.equal(captured, new * 3)
    else:
        assert outcome.status is not Status.COMMITTED
        assert any(f.kind is FindingKind.STALE and str(f.path) == "t" for f in outcome.findings), outcome


def test_a_slot_whose_storage_grows_during_pwal_does_not_break_the_pwal() -> None:
    """``resize_`` after a strided write: the recorder's count of the slot's bytes grows with it; the user's later
    read of the new bytes runs as it does without graphsafe."""

    def write(layer: _Slot, value: torch.Tensor) -> None:
        layer.s[::2].copy_(value[::2])
        layer.s[1::2].copy_(value[1::2])
        grown = layer.s.detach()
        grown.resize_(2 * N)
        _ = grown[N:] * 1

    layer = _Slot()
    outcome, captured, expected, error = recorded_reload(layer, write)
    assert error is None, repr(error)
    assert outcome.status is not Status.COMMITTED or torch.equal(captured[:N], expected)
