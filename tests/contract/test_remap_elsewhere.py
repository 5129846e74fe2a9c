"""The remap of attributes naming a replaced tensor beyond the slot paths (``remap_held_elsewhere``, run when a
reload ends) and the write-after-close rule for the tensors ``after_layer()`` replaced: an attribute of a model tensor
that names a new tensor the restore replaced names what replaced it, whatever the status; nothing but tensors'
attributes is touched; the contract's own step raises nothing foreign; a loader's write into a replaced tensor after
its layer's ``after_layer()`` never commits.
"""

from __future__ import annotations

import contextlib
import gc
from unittest import mock

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, GraphContract, Status, register_derived

pytestmark = pytest.mark.both_tiers  # the rules hold on both restore tiers

N = 4
DETECTS = ("declared-only", "sealed-paths", "every-reload")


class _KernelRef(nn.Module):
    """As in test_rebind_attributes section 6: PWAL hangs ``sub.kernel.weight_ref = self.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((N,), -1.0), requires_grad=False)
        self.sub = nn.Module()

    def pwal(self) -> None:
        kernel = getattr(self.sub, "kernel", None)
        if kernel is None:
            self.sub.kernel = kernel = self.weight * 2
        else:
            kernel.copy_(self.weight * 2)
        if bool(self.weight.sum() > 0):
            kernel.weight_ref = self.weight


def _rebind_weight(model: _KernelRef, value: float) -> None:
    model.weight = nn.Parameter(torch.full((N,), value), requires_grad=False)
    with torch.no_grad():
        model.pwal()


def _sealed(mode: str = "strict", detect: str = "declared-only") -> tuple[_KernelRef, GraphContract]:
    model = _KernelRef()
    with torch.no_grad():
        model.pwal()
    return model, GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]


# -- 1. a layerwise reload that raises after an after_layer(): its rebinds are remapped ------------------------------
def test_a_reload_that_raises_after_an_after_layer_still_remaps_the_attribute() -> None:
    """Attack: ``after_layer(model)`` restores ``weight`` (the captured Parameter is bound back, new values copied in)
    and records the rebind in ``_rebound``; the loader then raises. ``_settle(error)`` skips
    ``remap_held_elsewhere``, so ``sub.kernel.weight_ref`` (no slot path under declared-only) keeps the orphaned new
    Parameter while ``model.weight`` is the captured one: the next in-place load writes ``model.weight`` and the
    kernel's reference keeps the old values. Promise (section 6): after the reload ``sub.kernel.weight_ref`` is the
    tensor at ``weight``, whatever the status."""
    model, contract = _sealed()
    captured = model.weight
    with pytest.raises(RuntimeError, match="loader failed"), contract.reload(layerwise=True) as txn:
        txn.before_layer(model)
        _rebind_weight(model, 3.0)
        txn.after_layer(model)
        raise RuntimeError("loader failed")
    outcome = contract.last_outcome
    assert outcome is not None
    assert model.weight is captured  # the premise: after_layer's rebind stays
    assert model.sub.kernel.weight_ref is model.weight, (
        f"{outcome.status.name}: sub.kernel.weight_ref is the orphaned new Parameter, not the one at weight"
    )


# -- 2. a problem in another layer of the step: a layer rebound is remapped ------------------------------------------
class _TiedLayer(nn.Module):
    """Two derived slots captured as one object; the reload gives them two tensors with other attributes
    (``alias-broken``, a problem finding, see test_rebind_attributes section 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(N), requires_grad=False)

    def pwal(self, first: bool = False) -> None:
        if first:
            self.a = self.b = self.weight * 2
        else:
            a = self.weight * 2
            a.role = "gate"
            b = self.weight * 2
            b.role = "up"
            self.a, self.b = a, b
        register_derived(self, "a")
        register_derived(self, "b")


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = _KernelRef()
        self.t = _TiedLayer()


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_problem_in_another_layer_does_not_stop_a_rebound_layers_remap(mode: str, detect: str) -> None:
    """Attack: one whole-model step; layer ``t`` gets an ``alias-broken`` finding, layer ``k`` has none and IS rebound
    (``k.weight`` is the captured Parameter, holding the new values). Because the step had a problem anywhere,
    ``_restore_group`` skips both ``remap_attributes`` and ``self._rebound.extend``: ``k.sub.kernel.weight_ref``
    keeps the orphaned new Parameter (under every detect mode, even where the kernel is a sealed slot). Promise:
    after the reload the attribute is the tensor at ``k.weight``, whatever the status."""
    model = _Two()
    with torch.no_grad():
        model.k.pwal()
    model.t.pwal(first=True)
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = model.k.weight
    with contextlib.suppress(ContractViolation), contract.reload():
        _rebind_weight(model.k, 3.0)
        with torch.no_grad():
            model.t.weight.copy_(torch.full((N,), 5.0))
            model.t.pwal()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED
    assert model.k.weight is captured and torch.equal(model.k.weight, torch.full((N,), 3.0))  # rebound, new values
    assert model.k.sub.kernel.weight_ref is model.k.weight, (
        f"{outcome.status.name}: k.sub.kernel.weight_ref is the orphaned new Parameter, not the one at k.weight"
    )


# -- 3. a non-tensor that answers isinstance(x, torch.Tensor) is not a tensor ----------------------------------------
def test_a_mock_of_a_tensor_is_left_as_it_is() -> None:
    """Attack: a user's ``mock.Mock(spec=torch.Tensor)`` (a plain object; ``isinstance`` says Tensor through its
    ``__class__``) keeps the new Parameter in ``mk.src``. ``remap_held_elsewhere`` checks ``isinstance(owner,
    torch.Tensor)`` and rewrites ``mk.src`` to the captured Parameter. Promise: things that are not tensor attributes
    (plain objects) are left alone."""
    model, contract = _sealed()
    with contract.reload():
        _rebind_weight(model, 3.0)
        new = model.weight
        mk = mock.Mock(spec=torch.Tensor)
        mk.src = new
    assert contract.last_outcome is not None and contract.last_outcome.status is Status.COMMITTED
    assert model.sub.kernel.weight_ref is model.weight
    assert mk.src is new, "graphsafe rewrote an attribute of a Mock (not a tensor)"


# -- 4. objects whose class lookup raises are not asked --------------------------------------------------------------
def test_an_object_whose_class_lookup_raises_does_not_break_the_reload() -> None:
    """Attack: a user's lazy proxy (``__class__`` is a property that evaluates a factory; here the factory fails)
    holds a plain dict ``{"w": new}``. ``remap_held_elsewhere`` calls ``isinstance(owner, torch.Tensor)`` on every
    referrer of every dict holding a surviving new tensor, which runs the proxy's ``__class__``: its RuntimeError
    escapes the reload's exit. Promise: graphsafe never raises a foreign exception from its own step (and the
    dict, not a tensor attribute, is left alone)."""
    model, contract = _sealed()

    class Lazy:
        @property
        def __class__(self):  # type: ignore[override]
            raise RuntimeError("lazy factory failed")

    lazy = Lazy()
    with contract.reload():
        _rebind_weight(model, 3.0)
        lazy.cache = {"w": model.weight}
    assert contract.last_outcome is not None
    assert model.sub.kernel.weight_ref is model.weight


# -- 5. a tensor subclass that refuses __dict__ breaks nothing -------------------------------------------------------
class _NoDict(torch.Tensor):
    """A legal subclass that hides ``__dict__`` from attribute access (its attributes live in it all the same)."""

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "__dict__":
            raise AttributeError("__dict__ is private here")
        return super().__getattribute__(name)


def test_a_tensor_subclass_that_hides_its_dict_does_not_break_the_reload() -> None:
    """Attack: a tensor of a subclass whose ``__getattribute__`` refuses ``__dict__`` holds the new Parameter as an
    attribute. ``remap_held_elsewhere`` reads ``owner.__dict__`` and the subclass's AttributeError escapes the
    reload. Promise: graphsafe never raises a foreign exception from its own step."""
    model, contract = _sealed()
    holder = torch.zeros(2).as_subclass(_NoDict)
    with contract.reload():
        _rebind_weight(model, 3.0)
        object.__setattr__(holder, "src", model.weight)
    assert contract.last_outcome is not None


# -- 6. a tensor whose __dict__ is a dict subclass is remapped -------------------------------------------------------
def test_a_tensor_dict_of_a_dict_subclass_is_remapped() -> None:
    """Attack: ``kernel.__dict__ = Attrs(kernel.__dict__)`` (a dict subclass; legal assignment on a tensor). The
    holder filter ``type(d) is dict`` drops it, so ``sub.kernel.weight_ref`` keeps the orphan while the reload
    COMMITS. Promise: after a commit, attributes that named a replaced new tensor name what replaced it."""

    class Attrs(dict):  # type: ignore[type-arg]
        pass

    model, contract = _sealed()
    with contract.reload():
        _rebind_weight(model, 3.0)
        model.sub.kernel.__dict__ = Attrs(model.sub.kernel.__dict__)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED
    assert model.sub.kernel.weight_ref is model.weight, "COMMITTED with sub.kernel.weight_ref on the orphan"


# -- 7. an attribute sealed as a (watch-only) slot path follows too --------------------------------------------------
@pytest.mark.parametrize("detect", ["sealed-paths", "every-reload"])
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_an_attribute_sealed_as_a_slot_path_follows_the_rebound_weight(mode: str, detect: str) -> None:
    """Attack: as section 6, but the weights are positive at the seal, so ``sub.kernel.weight_ref`` exists then and
    ``sealed-paths``/``every-reload`` seal it as an undeclared (watch-only) slot aliasing ``weight``. The loader
    rebinds ``weight``; the watch-only slot is judged ``moved`` (it names the new Parameter) before any remap, the
    step has a problem so neither remap runs, and the reload fails with the attribute left on the orphan while
    ``weight`` is the captured Parameter (nothing the graph reads is wrong: a false failure). Promise (section 6):
    after the reload ``sub.kernel.weight_ref`` is the tensor at ``weight``, whatever the status."""
    model = _KernelRef()
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.pwal()
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = model.weight
    with contextlib.suppress(ContractViolation), contract.reload():
        _rebind_weight(model, 3.0)
    outcome = contract.last_outcome
    assert outcome is not None
    assert model.weight is captured
    assert model.sub.kernel.weight_ref is model.weight, (
        f"{outcome.status.name} ({[(f.kind.name, f.path) for f in outcome.findings]}): sub.kernel.weight_ref is the "
        "orphaned new Parameter, not the one at weight"
    )


# -- 8. a loader's write into a tensor after_layer() replaced is stale -----------------------------------------------
class _Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(N), requires_grad=False)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Leaf()
        self.b = _Leaf()


@pytest.mark.parametrize("detect", DETECTS)
def test_a_write_into_a_replaced_tensor_after_its_after_layer_does_not_commit(detect: str) -> None:
    """Attack: a layerwise loader binds new Parameters and keeps them in its own ``params`` dict (the usual
    ``params[name].copy_(shard)`` loop); ``a.weight`` is a fused weight whose second half comes in the next shard,
    after ``after_layer(a)``. ``after_layer(a)`` copied the first half into the captured Parameter and bound it back;
    the second shard's write lands in the replaced new Parameter (alive: ``params`` holds it, which the ``_rebound``
    weakref sees at settle), never in what the graph reads. ``check_closed`` looks only at the paths, so the reload
    COMMITS with the graph reading [5, 5, 0, 0]; without graphsafe the model would read [5, 5, 5, 5]. Promise: a
    reload never reports COMMITTED while a graph reads memory other than what the reload produced."""
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


# -- 9. tensors gc.freeze() moved out of the collector's reach are remapped ------------------------------------------
def test_an_attribute_of_a_tensor_frozen_by_gc_freeze_follows_the_rebound_weight() -> None:
    """Attack: a server calls ``gc.freeze()`` once startup is done (after the capture: fewer collector pauses and
    copy-on-write pages). The kernel tensor (no slot path under declared-only) is now in the permanent generation,
    which ``gc.get_referrers`` does not walk: ``remap_held_elsewhere`` finds no owner of the dict, and the reload
    COMMITS with ``sub.kernel.weight_ref`` on the orphaned new Parameter. Promise: after a commit, attributes that
    named a replaced new tensor name what replaced it."""
    model, contract = _sealed()
    gc.freeze()
    try:
        with contract.reload():
            _rebind_weight(model, 3.0)
    finally:
        gc.unfreeze()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED
    assert model.sub.kernel.weight_ref is model.weight, "COMMITTED with sub.kernel.weight_ref on the orphan"
