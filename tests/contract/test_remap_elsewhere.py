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

from contract.test_rebind_attributes import _KernelRef, _rebind_weight, _TiedLayer  # (section 2's tie)
from graphsafe import ContractViolation, GraphContract, Status

pytestmark = pytest.mark.both_tiers  # the rules hold on both restore tiers

N = 4
DETECTS = ("declared-only", "sealed-paths", "every-reload")


def _sealed(mode: str = "strict", detect: str = "declared-only") -> tuple[_KernelRef, GraphContract]:
    model = _KernelRef()
    with torch.no_grad():
        model.pwal()
    return model, GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]


# -- 1. a layerwise reload that raises after an after_layer(): its rebinds are remapped ------------------------------
def test_a_reload_that_raises_after_an_after_layer_still_remaps_the_attribute() -> None:
    """``after_layer(model)`` restores ``weight`` (the captured Parameter bound back, the new values copied in);
    the loader then raises. The rebind stands, so ``sub.kernel.weight_ref`` (no slot path under ``declared-only``)
    names the tensor at ``weight`` after the reload too, not the orphaned new Parameter a later in-place load would
    never reach."""
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
class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = _KernelRef()
        self.t = _TiedLayer()


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_problem_in_another_layer_does_not_stop_a_rebound_layers_remap(mode: str, detect: str) -> None:
    """One whole-model step: layer ``t`` gets an ``alias-broken`` finding, layer ``k`` none, and ``k`` is
    rebound (``k.weight`` is the captured Parameter, holding the new values). Another layer's problem does not stop
    ``k``'s remap: after the reload ``k.sub.kernel.weight_ref`` is the tensor at ``k.weight``, under every detect
    policy, whatever the status."""
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
    """A user's ``mock.Mock(spec=torch.Tensor)`` (a plain object that ``isinstance`` takes for a tensor) keeps the
    new Parameter in ``mk.src``: only the model's tensors' attributes are remapped, so it keeps it."""
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
    """A user's lazy proxy (``__class__`` a property whose factory fails) holds the new Parameter in a plain dict
    and hangs on a model tensor: the remap asks no object of the caller's for its class, and nothing raises."""
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
    """A tensor of a subclass whose ``__getattribute__`` refuses ``__dict__`` holds the new Parameter as an
    attribute: its refusal is no error of the reload's."""
    model, contract = _sealed()
    holder = torch.zeros(2).as_subclass(_NoDict)
    with contract.reload():
        _rebind_weight(model, 3.0)
        object.__setattr__(holder, "src", model.weight)
    assert contract.last_outcome is not None


# -- 6. a tensor whose __dict__ is a dict subclass is remapped -------------------------------------------------------
def test_a_tensor_dict_of_a_dict_subclass_is_remapped() -> None:
    """``kernel.__dict__ = Attrs(kernel.__dict__)`` (a dict subclass, a legal assignment on a tensor): its
    attribute naming the new Parameter is remapped like any other."""

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
    """As section 6, but the weights are positive at the seal, so ``sub.kernel.weight_ref`` exists then and
    ``sealed-paths``/``every-reload`` seal it as an undeclared (watch-only) slot aliasing ``weight``. The loader
    rebinds ``weight``; whatever the watch-only slot's verdict, after the reload ``sub.kernel.weight_ref`` is the
    tensor at ``weight``."""
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


# -- 8. tensors gc.freeze() moved out of the collector's reach are remapped ------------------------------------------
def test_an_attribute_of_a_tensor_frozen_by_gc_freeze_follows_the_rebound_weight() -> None:
    """A server calls ``gc.freeze()`` once start-up is done (fewer collector pauses): the kernel tensor is out of
    the collector's reach, and the remap, a walk of the model, finds it all the same."""
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
