"""A captured storage whose slot PWAL moved, still held by something else, is never written.

The promise: a reload never reports COMMITTED while a graph reads wrong memory, and graphsafe never writes into a
tensor values other than the ones the reload produced for it. A ping-pong buffer (PWAL swaps a declared slot with
an undeclared spare) makes the captured storage another path's tensor; copying the slot's new values there would
write into that path. Covered: nested layers, whole-model and layerwise, holders deep in objects or in a module kept
in a plain list, a raw ``UntypedStorage`` spare, a holder of the captured view's base.

A tracked pool tied to the captured view is an alias PWAL wrote (contract._owned). A holder the model walk cannot
reach (a dict key, a table outside the model) is told from a caller's own reference to the slot by a write to the
captured memory during the reload (its version counter, or its value sample where it has no counter).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, graph_visible, record_capture
from graphsafe.errors import ContractViolation

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

DETECTS = ["declared-only", "sealed-paths", "every-reload"]


class _PingPong(nn.Module):
    """PWAL swaps the declared ``cur`` with an undeclared ``other`` (a ping-pong buffer), then (``write``) writes both
    in place: ``other`` (the old captured tensor) gets ``weight * 3``, ``cur`` gets ``weight * 2``."""

    def __init__(self, write: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.other = torch.zeros(4)  # undeclared; no captured graph reads it
        self.write = write

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "cur"):
            self.cur = self.weight * 2
            return
        self.cur, self.other = self.other, self.cur
        if self.write:
            self.other.copy_(self.weight * 3)
            self.cur.copy_(self.weight * 2)


@pytest.mark.parametrize("write", [True, False], ids=["swap-then-write", "swap-only"])
@pytest.mark.parametrize("detect", DETECTS)
def test_a_captured_tensor_pwal_handed_to_an_untracked_path_is_never_written(write: bool, detect: str) -> None:
    """The case the unread-skip fuzzer found (at the model root; it held under ``unread="restore"`` too)."""
    model = _PingPong(write)
    contract = _seal_and_capture(model, model, detect)
    captured_cur = model.cur
    with contract.reload(), torch.no_grad():
        model.weight.copy_(torch.full((4,), 5.0))
        model.process_weights_after_loading()
    expected_other = model.weight * 3 if write else torch.full((4,), 2.0)  # what the reload left there
    assert model.other is captured_cur
    # graphsafe wrote nothing into 'other' (values the reload never produced for it) ...
    assert torch.equal(model.other, expected_other)
    # ... and did not commit: the graph reads 'other''s values where it expects cur's.
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _seal_and_capture(model: nn.Module, pp: _PingPong, detect: str, mode: str = "recapture") -> GraphContract:
    pp.process_weights_after_loading()
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    with torch.no_grad(), record_capture(contract):
        pp.cur.sum()  # the graph reads cur only
    return contract


def _assert_promise(contract: GraphContract, pp: _PingPong, captured_cur: torch.Tensor) -> None:
    assert pp.other is captured_cur
    # graphsafe must not have written cur's new values (10) into 'other' (the reload produced 15 for it) ...
    assert torch.equal(pp.other, torch.full((4,), 15.0)), f"graphsafe wrote {pp.other.tolist()} into 'other'"
    # ... and must not commit: the graph reads 'other''s values where it expects cur's.
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


# -- 1. the foreign-holder walk walks only the root module's own attributes ----------------------------------------
# walk(model) treats every submodule as a reload unit of its own and does not enter it, so an untracked holder in
# any layer that is not the root itself is never found: the block never fires for a real (nested) model.


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
@pytest.mark.parametrize("depth", [1, 3])
def test_pingpong_in_a_nested_layer_is_never_written(depth: int, mode: str) -> None:
    pp = _PingPong()
    model: nn.Module = pp
    for _ in range(depth):
        model = _Wrap(model)
    contract = _seal_and_capture(model, pp, "declared-only", mode)
    captured_cur = pp.cur
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        pp.weight.copy_(torch.full((4,), 5.0))
        pp.process_weights_after_loading()
    _assert_promise(contract, pp, captured_cur)


def test_pingpong_in_a_nested_layer_layerwise_is_never_written() -> None:
    pp = _PingPong()
    model = nn.Sequential(_Wrap(nn.Identity()), pp)
    contract = _seal_and_capture(model, pp, "declared-only")
    captured_cur = pp.cur
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=True) as txn, torch.no_grad():
        txn.before_layer(pp)
        pp.weight.copy_(torch.full((4,), 5.0))
        pp.process_weights_after_loading()
        txn.after_layer(pp)
    _assert_promise(contract, pp, captured_cur)


# -- 2. holders the walk misses even when the layer is the model root ------------------------------------------------
# Same ping-pong, with the layer as the model root (as in test_contract.py), the old captured tensor handed to a
# holder the walk does not reach: deeper than WalkBudget.max_depth (the walk's `exhausted` is ignored), an
# nn.Module kept in a plain list (units=None: every module is a unit, never entered), a dict key / set member, or a
# holder outside the model (an engine-level ping-pong table). The look (refcount) says "held"; the walk finds no
# one; the copy goes ahead into the holder's tensor and the reload commits.


class _Node:
    pass


_ENGINE_TABLE: dict[str, torch.Tensor] = {}  # an engine-level table, outside the model


class _RootPingPong(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.where = where
        self._hold(torch.zeros(4))

    def _hold(self, t: torch.Tensor) -> None:
        if self.where == "deep-object":  # self.box.n.n.n.n.n.n.n.n.n.t: 11 steps
            box = node = _Node()
            for _ in range(9):
                node.n = _Node()  # type: ignore[attr-defined]
                node = node.n  # type: ignore[attr-defined]
            node.t = t  # type: ignore[attr-defined]
            self.box = box
        elif self.where == "module-in-plain-list":
            helper = nn.Module()
            helper.t = t  # type: ignore[assignment]
            self.helpers = [helper]
        elif self.where == "dict-key":
            self.by_tensor = {t: "buf"}
        elif self.where == "outside-the-model":
            _ENGINE_TABLE["other"] = t
        else:
            raise AssertionError(self.where)

    @property
    def other(self) -> torch.Tensor:
        if self.where == "deep-object":
            node = self.box
            for _ in range(9):
                node = node.n  # type: ignore[attr-defined]
            return node.t  # type: ignore[attr-defined,no-any-return]
        if self.where == "module-in-plain-list":
            return self.helpers[0].t  # type: ignore[return-value]
        if self.where == "dict-key":
            return next(iter(self.by_tensor))
        return _ENGINE_TABLE["other"]

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "cur"):
            self.cur = self.weight * 2
            return
        old, self.cur = self.cur, self.other
        self._hold(old)
        self.other.copy_(self.weight * 3)
        self.cur.copy_(self.weight * 2)


@pytest.mark.parametrize(
    "where",
    [
        "deep-object",
        "module-in-plain-list",
        "dict-key",
        "outside-the-model",
    ],
)
def test_pingpong_holder_the_walk_misses_is_never_written(where: str) -> None:
    pp = _RootPingPong(where)
    contract = _seal_and_capture(pp, pp, "declared-only")  # type: ignore[arg-type]
    captured_cur = pp.cur
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        pp.weight.copy_(torch.full((4,), 5.0))
        pp.process_weights_after_loading()
    _assert_promise(contract, pp, captured_cur)  # type: ignore[arg-type]


class _SilentPingPong(nn.Module):
    """The ping-pong with the holder outside the model, written without moving the old tensor's version counter:
    through ``.data`` (``data``), or as an inference tensor that counts no writes (``inference``); ``-sparse``: a
    weight of 8,192 elements, the holder writing every second one (between a value sample's elements)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8192 if how.endswith("-sparse") else 4), requires_grad=False)
        self.how = how
        self.table: dict[torch.Tensor, str] = {}  # a dict key: no walk reaches it

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        with torch.inference_mode(self.how.startswith("inference")):
            if not hasattr(self, "cur"):
                self.cur = self.weight * 2
                self.table = {self.weight * 0: "spare"}
                return
            (other,) = self.table
            old, self.cur = self.cur, other
            self.table = {old: "spare"}
            target = old.data if self.how.startswith("data") else old
            if self.how.endswith("-sparse"):
                target[1::2] = (self.weight * 3)[1::2]
            else:
                target.copy_(self.weight * 3)
            self.cur.copy_(self.weight * 2)


@pytest.mark.parametrize("how", ["data", "inference", "data-sparse", "inference-sparse"])
@pytest.mark.parametrize("detect", DETECTS)
def test_a_holder_outside_the_model_written_without_a_version_is_never_written(how: str, detect: str) -> None:
    layer = _SilentPingPong(how)
    contract = _seal_and_capture(layer, layer, detect)  # type: ignore[arg-type]
    captured_cur = layer.cur
    size = layer.weight.numel()
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        layer.weight.copy_(torch.full((size,), 5.0))
        layer.process_weights_after_loading()
    (held,) = layer.table
    assert held is captured_cur
    written = held[1::2] if how.endswith("-sparse") else held
    assert torch.equal(written, torch.full_like(written, 15.0)), f"graphsafe wrote {written.unique().tolist()} there"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


_SPARES: dict[str, torch.Tensor] = {}  # an engine-level table of spare parameters, outside the model


class _StatePingPong(nn.Module):
    """PWAL swaps the parameter (or buffer) ``weight`` with a spare an engine-level table holds (``none_first``:
    setting it to None first, ``del_first``: deleting it first; ``view``: each a view of a flat buffer), then writes
    both: the old, captured one gets 7 (in place, under inference mode, or through an alias that moves no version
    counter: ``.data``, ``set_``, a NumPy view, a DLPack import). A loader's write to a
    parameter before PWAL replaces it leaves the same evidence on the old one, except that it comes before the module
    takes the spare."""

    def __init__(self, how: str = "copy", kind: str = "parameter") -> None:
        super().__init__()
        self.how = how
        with torch.inference_mode() if how == "inference" else contextlib.nullcontext():
            weight, spare = torch.ones(4), torch.zeros(4)
        if how.startswith("view"):  # each a view of a flat buffer of its own (one version counter per buffer)
            weight, spare = torch.ones(8)[:4], torch.zeros(8)[:4]
        if kind == "parameter":
            self.weight = nn.Parameter(weight, requires_grad=False)
            _SPARES["spare"] = nn.Parameter(spare, requires_grad=False)
        else:
            self.register_buffer("weight", weight)
            _SPARES["spare"] = spare

    def process_weights_after_loading(self) -> None:
        old = self.weight
        if self.how == "none_first":
            self.weight = None  # torch calls no registration hook for None
        elif self.how.endswith("del_first"):
            del self.weight  # nor for a name deleted first
        self.weight = _SPARES["spare"]
        _SPARES["spare"] = old
        with torch.no_grad(), torch.inference_mode() if self.how == "inference" else contextlib.nullcontext():
            self.weight.copy_(old * 2)
            _alias(old, self.how).copy_(torch.full((4,), 7.0))


def _alias(tensor: torch.Tensor, how: str) -> torch.Tensor:
    """Where the holder writes ``tensor``: itself, or a route that moves no version counter of it."""
    if how == "data":
        return tensor.data
    if how == "set_":
        return torch.empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    if how == "numpy":
        return torch.from_numpy(tensor.numpy())
    if how == "dlpack":
        return torch.from_dlpack(tensor)
    return tensor


def _load(layer: nn.Module, value: float) -> None:
    """The loader: the new weight written in place (under inference mode where the model's tensors are made so)."""
    inference = getattr(layer, "how", "") == "inference"
    with torch.no_grad(), torch.inference_mode() if inference else contextlib.nullcontext():
        layer.weight.copy_(torch.full((4,), value))


@pytest.mark.parametrize(
    ("how", "kind"),
    [
        ("copy", "parameter"),
        ("copy", "buffer"),
        ("inference", "parameter"),
        ("inference", "buffer"),
        ("none_first", "buffer"),  # torch calls the buffer hooks for None too
        ("none_first", "parameter"),  # left unseen: not written whatever happened after
        ("del_first", "parameter"),
        ("view", "parameter"),
        ("view", "buffer"),
        ("view_del_first", "parameter"),
        ("data", "parameter"),  # the routes that move no version counter: each departure's bytes witness it
        ("data", "buffer"),
        ("set_", "parameter"),
        ("numpy", "buffer"),
        ("dlpack", "parameter"),
    ],
)
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
def test_a_parameter_pingpong_with_a_holder_outside_the_model_is_never_written(
    detect: str, how: str, kind: str
) -> None:
    """The captured parameter ends in a table outside the model, written there after the module took the spare:
    the restore must not copy the spare's values (10) over the 7 the reload produced for the table's tensor."""
    layer = _StatePingPong(how, kind)
    contract = GraphContract(layer, "recapture", detect=detect).seal()  # type: ignore[arg-type]
    with torch.no_grad(), record_capture(contract):
        layer.weight.sum()
    captured = layer.weight
    with contextlib.suppress(ContractViolation), contract.reload():
        _load(layer, 5.0)
        layer.process_weights_after_loading()
    assert _SPARES["spare"] is captured
    assert torch.equal(captured, torch.full((4,), 7.0)), f"graphsafe wrote {captured.tolist()} into the spare"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


class _LargeInferencePingPong(nn.Module):
    """The ping-pong of an inference-mode parameter of 8,192 elements whose holder writes every second element: a
    value sample of 4,096 elements would read the even ones only."""

    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.weight = nn.Parameter(torch.ones(8192), requires_grad=False)
            _SPARES["spare"] = nn.Parameter(torch.zeros(8192), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        old = self.weight
        self.weight = _SPARES["spare"]
        _SPARES["spare"] = old
        with torch.inference_mode():
            self.weight.copy_(old * 2)
            old[1::2] = 7.0  # the holder's own values, between a sample's elements


def test_an_inference_parameter_written_after_it_left_between_sampled_elements_is_never_written() -> None:
    layer = _LargeInferencePingPong()
    contract = GraphContract(layer, "recapture").seal()
    with torch.no_grad(), record_capture(contract):
        layer.weight.sum()
    captured = layer.weight
    with contextlib.suppress(ContractViolation), contract.reload():
        with torch.inference_mode():
            layer.weight.copy_(torch.full((8192,), 5.0))
        layer.process_weights_after_loading()
    assert _SPARES["spare"] is captured
    assert captured[1].item() == 7.0, f"graphsafe wrote {captured[1].item()} over the holder's 7.0"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


class _FlatViews(nn.Module):
    """Two parameters that are views of one flat buffer (one version counter): PWAL repacks ``w1``, scales ``w2`` in
    place, then repacks it; a caller's table holds the old ones."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.ones(8)
        self.w1 = nn.Parameter(flat[0:4], requires_grad=False)
        self.w2 = nn.Parameter(flat[4:8], requires_grad=False)

    def process_weights_after_loading(self) -> None:
        with torch.no_grad():
            self.w1 = nn.Parameter(self.w1 * 2, requires_grad=False)
            self.w2.mul_(3)
            self.w2 = nn.Parameter(self.w2 + 0, requires_grad=False)


@pytest.mark.parametrize("held", [False, True], ids=["unheld", "held"])
def test_views_of_one_buffer_repacked_after_an_in_place_write_to_one_commit(held: bool) -> None:
    """The write to ``w2`` moves the counter ``w1`` shares with it, after ``w1`` left: no write to ``w1``'s bytes."""
    layer = _FlatViews()
    contract = GraphContract(layer, "recapture").seal()
    with torch.no_grad(), record_capture(contract):
        layer.w1.sum()
        layer.w2.sum()
    for step in (5.0, 6.0):
        kept = {"w1": layer.w1, "w2": layer.w2} if held else {}
        with contract.reload(), torch.no_grad():
            layer.w1.copy_(torch.full((4,), step))
            layer.w2.copy_(torch.full((4,), step + 1))
            layer.process_weights_after_loading()
        outcome = contract.last_outcome
        assert outcome is not None and outcome.committed, outcome
        assert torch.equal(layer.w1, torch.full((4,), step * 2))
        assert torch.equal(layer.w2, torch.full((4,), step * 3 + 3))
        del kept


class _Repacked(nn.Module):
    """PWAL replaces the loaded parameter with a new one computed from it (a repack: the common vLLM pattern), and
    leaves the old one alone."""

    def __init__(self, how: str = "copy") -> None:
        super().__init__()
        self.how = how
        with torch.inference_mode() if how == "inference" else contextlib.nullcontext():
            self.weight = nn.Parameter(torch.ones(4), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        with torch.no_grad(), torch.inference_mode() if self.how == "inference" else contextlib.nullcontext():
            self.weight = nn.Parameter(self.weight * 2, requires_grad=False)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("how", ["copy", "inference"])
def test_a_loaded_parameter_replaced_by_pwal_while_a_caller_holds_it_commits(how: str, layerwise: bool) -> None:
    """The legitimate twin of the ping-pong: the loader writes the parameter, then PWAL replaces it; a caller (an
    optimizer, a weight-sync table) keeps the old one. Written before it left, so the restore copies PWAL's values
    into it and commits; the caller's reference reads them."""
    layer = _Repacked(how)
    contract = GraphContract(layer, "recapture").seal()
    with torch.no_grad(), record_capture(contract):
        layer.weight.sum()
    kept = {"weight": layer.weight}  # the caller's table, outside the model
    for step, value in enumerate((5.0, 6.0)):  # again: the restore's own rebinds leave nothing behind
        with contract.reload(layerwise=layerwise) as txn:
            if layerwise:
                txn.before_layer(layer)
            _load(layer, value)
            layer.process_weights_after_loading()
            if layerwise:
                txn.after_layer(layer)
        outcome = contract.last_outcome
        assert outcome is not None and outcome.committed, (step, outcome)
        assert layer.weight is kept["weight"] and torch.equal(kept["weight"], torch.full((4,), value * 2))


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        self.cur = self.weight * 2  # a new tensor every time


def test_a_callers_reference_to_the_captured_slot_does_not_block_the_copy() -> None:
    """The legitimate twin of the unreachable holder (why that one stays a gap): the caller keeps the captured
    tensor, PWAL gives the slot a new tensor; the restore copies, the caller's reference reads the new values, and
    it commits."""
    layer = _Plain()
    contract = _seal_and_capture(layer, layer, "declared-only")  # type: ignore[arg-type]
    kept = {"ref": layer.cur}  # a caller's own table, outside the model
    with contract.reload(), torch.no_grad():
        layer.weight.copy_(torch.full((4,), 5.0))
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.committed, outcome
    assert layer.cur is kept["ref"] and torch.equal(kept["ref"], torch.full((4,), 10.0))


# -- 3. a tracked holder tied at seal is written (not committed, but a write the reload did not produce) -------------
# The captured ``cur`` is a row of a pool tensor an undeclared list holds (two pools, ping-pong between them). Under
# declared-only the foreign-holder block catches it (alias-broken, nothing written). Under sealed-paths / every-reload
# the pool is a *tracked* walker slot ('pools[0]'), so _block_foreign_holders skips it as "tracked", and the restore
# copies cur's new values (10) into pools[0], whose values the reload set to 15. The outcome is not COMMITTED, but
# graphsafe wrote values the reload never produced into a tensor. The restore path itself must hold this: the
# foreign-holder block excludes tracked paths, so it does not close it.


class _PoolPingPong(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.pools = [torch.zeros(1, 4), torch.zeros(1, 4)]  # undeclared
        self.turn = 0

    @property
    def other(self) -> torch.Tensor:
        return self.pools[1 - self.turn][0]

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if hasattr(self, "cur"):
            self.turn = 1 - self.turn
        self.cur = self.pools[self.turn][0]  # a view; its base stays in self.pools
        self.other.copy_(self.weight * 3)
        self.cur.copy_(self.weight * 2)


@pytest.mark.parametrize("detect", ["sealed-paths", "every-reload"])
def test_captured_view_whose_base_a_tracked_pool_holds_is_never_written(detect: str) -> None:
    """The pool is the captured view's alias and PWAL wrote it in place: the copy is taken back
    (``contract._owned``), ``cur`` keeps PWAL's tensor, ``alias-broken``."""
    pp = _PoolPingPong()
    contract = _seal_and_capture(pp, pp, detect)  # type: ignore[arg-type]
    captured_cur = pp.cur
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        pp.weight.copy_(torch.full((4,), 5.0))
        pp.process_weights_after_loading()
    other = pp.other
    assert other.data_ptr() == captured_cur.data_ptr()
    assert torch.equal(other, torch.full((4,), 15.0)), f"graphsafe wrote {other.tolist()} into pools[{1 - pp.turn}]"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed
    assert any(f.kind.value == "alias-broken" and f.path == "cur" for f in outcome.problems), outcome.summary()
    assert torch.equal(pp.cur, torch.full((4,), 10.0))


# -- 4. a ping-pong that keeps the spare as a raw UntypedStorage -------------------------------------------------
# PWAL keeps the old captured memory as an UntypedStorage (a storage pool, as engines that free/re-map memory do) and
# views it as a tensor when it needs it. The storage's use count is 2 (the captured tensor, the storage object) so
# held_outside says "not held"; the walker does not report storages anyway. The copy writes cur's new values into
# the spare the reload filled with other values, and the reload commits.


class _StoragePingPong(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.spare = torch.zeros(4).untyped_storage()

    def other(self) -> torch.Tensor:
        return torch.empty(0).set_(self.spare, 0, (4,))

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "cur"):
            self.cur = self.weight * 2
            return
        old, self.cur = self.cur, self.other()
        self.spare = old.untyped_storage()
        self.other().copy_(self.weight * 3)
        self.cur.copy_(self.weight * 2)


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
@pytest.mark.parametrize("detect", DETECTS)
def test_spare_kept_as_untyped_storage_is_never_written(detect: str, mode: str) -> None:
    pp = _StoragePingPong()
    pp.process_weights_after_loading()
    contract = GraphContract(pp, mode, detect=detect).seal()  # type: ignore[arg-type]
    with torch.no_grad(), record_capture(contract):
        pp.cur.sum()
    captured_ptr = pp.cur.data_ptr()
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        pp.weight.copy_(torch.full((4,), 5.0))
        pp.process_weights_after_loading()
    other = pp.other()
    assert other.data_ptr() == captured_ptr
    assert torch.equal(other, torch.full((4,), 15.0)), f"graphsafe wrote {other.tolist()} into the spare storage"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


# -- 5. the look is blind to a holder of the captured view's base ----------------------------------------------------
# The captured ``cur`` is a view (a row of a (1, 4) buffer). PWAL rebuilds cur and keeps the old buffer (the captured
# view's ``_base``) at an undeclared path, writing the reload's values for it there. The base's TensorImpl was
# already one storage use (through the view), so the use count stays at 3 == held_outside's threshold for a view,
# and the captured view's own refcount does not move: no walk, the copy writes cur's new values into 'spare', and
# the reload commits. (The layer is the model root, so finding 1 is not involved.)


class _BaseKeeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "cur"):
            buffer = torch.zeros(1, 4)
            self.cur = buffer[0]
            self.cur.copy_(self.weight * 2)
            return
        old = self.cur
        self.cur = self.weight * 2
        self.spare = old._base  # the ping-pong keeps the old buffer
        self.spare.copy_(self.weight.reshape(1, 4) * 3)


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
@pytest.mark.parametrize("detect", DETECTS)
def test_holder_of_the_captured_views_base_is_never_written(detect: str, mode: str) -> None:
    model = _BaseKeeper()
    model.process_weights_after_loading()
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    with torch.no_grad(), record_capture(contract):
        model.cur.sum()
    captured_ptr = model.cur.data_ptr()
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        model.weight.copy_(torch.full((4,), 5.0))
        model.process_weights_after_loading()
    assert model.spare.data_ptr() == captured_ptr
    assert torch.equal(model.spare, torch.full((1, 4), 15.0)), f"graphsafe wrote {model.spare.tolist()} into 'spare'"
    outcome = contract.last_outcome
    assert outcome is not None and not outcome.committed


# -- 6. (low severity, not the reload promise) the collector pause keeps what user code it runs did to the collector --
# The restore's rebind runs the layer's own __setattr__ inside the contract's collector pause; a hook there that
# turns the collector off (an engine that serves with gc disabled) or on must find it so after the reload. The
# pause holds collections off by the threshold and never flips the switch, so it cannot undo the user's.


class _TogglesCollector(nn.Module):
    def __init__(self, toggle: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.toggle = toggle
        self.armed = False
        self.setter_saw_paused = False

    def __setattr__(self, name: str, value: object) -> None:
        if name == "cur" and self.__dict__.get("armed"):
            # automatic collections held off, by the threshold or by the switch
            self.__dict__["setter_saw_paused"] = gc.get_threshold()[0] == 0 or not gc.isenabled()
            if self.__dict__["toggle"] == "disable":
                gc.disable()  # user code: serve with the collector off from now on
            else:
                gc.enable()  # user code: the collector back on from now on
        super().__setattr__(name, value)

    @graph_visible("cur")
    def process_weights_after_loading(self) -> None:
        self.cur = self.weight * 2


def _reload_with_the_setter_armed(toggle: str, enabled_before: bool) -> bool:
    """Reload with the rebind's setter toggling the collector; what ``gc.isenabled()`` says after."""
    model = _TogglesCollector(toggle)
    model.process_weights_after_loading()
    contract = GraphContract(model, "strict", detect="declared-only").seal()
    with torch.no_grad(), record_capture(contract):
        model.cur.sum()
    was, threshold = gc.isenabled(), gc.get_threshold()
    (gc.enable if enabled_before else gc.disable)()
    try:
        with contract.reload(), torch.no_grad():
            model.weight.copy_(torch.full((4,), 5.0))
            model.process_weights_after_loading()
            model.__dict__["armed"] = True  # the rebind at finish() runs the setter
        assert model.setter_saw_paused, "the rebind did not run inside the pause (probe invalid)"
        assert gc.get_threshold() == threshold, "the pause left its thresholds behind"
        outcome = contract.last_outcome
        assert outcome is not None and outcome.committed
        return gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_a_collector_disable_made_by_a_slot_setter_during_restore_stays() -> None:
    assert not _reload_with_the_setter_armed("disable", enabled_before=True), (
        "graphsafe re-enabled the collector that user code disabled"
    )


def test_a_collector_enable_made_by_a_slot_setter_during_restore_stays() -> None:
    assert _reload_with_the_setter_armed("enable", enabled_before=False), (
        "graphsafe disabled again the collector that user code enabled"
    )
