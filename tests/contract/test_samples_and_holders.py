"""The contract's value samples and input digests, the memory-lost checks, the holder look by address, the
cross-storage take-back, a repeated ``before_layer``: what they must hold. Each test reloads DIFFERENT weights and
judges with an independent oracle.

Pinned here: a DLPack tie made after the seal, a slot carved out of a parameter the loader replaces, an unsampled
weight change through a ``Parameter`` subclass (no digest), a skipped refresh disguised as a re-import. The
subprocess scripts below keep long lines."""

# ruff: noqa: E501

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, Status, register_derived
from graphsafe.errors import ContractViolation, GraphSafeError

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

MODES = ("strict", "recapture", "migrate")


def w(seed: int, n: int = 4) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100.0 * seed + 0.5


def outcome_of(contract: GraphContract) -> Any:
    out = contract.last_outcome
    assert out is not None
    return out


def _run(contract, net, loads, layerwise=False):
    """loads: list of (layer, callable doing load+pwal for that layer)."""
    with (
        contextlib.suppress(ContractViolation, GraphSafeError),
        contract.reload(layerwise=layerwise) as txn,
        torch.no_grad(),
    ):
        for layer, fn in loads:
            if layerwise:
                txn.before_layer(layer)
            fn()
            if layerwise:
                txn.after_layer(layer)
    return outcome_of(contract)


# ---------------------------------------------------------------------------------------------------------------
# A. A tie that appears AFTER seal through DLPack (another storage object on the same bytes). _cross is computed at
#    seal only; the adopted slot's captured storage is a different object, so the agreement check cannot see it.
# ---------------------------------------------------------------------------------------------------------------


class TLayer(nn.Module):
    def __init__(self, seed: int, k: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.k = k

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * self.k + 1.0
        if "cache" in self.__dict__:
            self.cache = self.weight * 3.0


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize(
    "mode,detect,how",
    [
        ("migrate", "every-reload", "walker"),
        ("strict", "declared-only", "declared"),
        ("recapture", "declared-only", "declared"),
        ("migrate", "every-reload", "declared"),
    ],
)
def test_dlpack_tie_after_seal(mode: str, detect: str, how: str, layerwise: bool) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([TLayer(1, 2.0), TLayer(2, 5.0)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l0, l1 = net.layers
    l1.cache = torch.from_dlpack(l0.w_t)  # after seal: a second storage object on layer 0's captured bytes
    if how == "declared":
        register_derived(l1, "cache")
    captured = l0.w_t
    old = captured.clone()
    new0, new1 = w(11), w(12)
    exp_w_t0 = new0 * 2.0 + 1.0
    exp_cache1 = new1 * 3.0

    def load(layer, new):
        def fn():
            layer.weight.copy_(new)
            layer.process_weights_after_loading()

        return fn

    out = _run(contract, net, [(l0, load(l0, new0)), (l1, load(l1, new1))], layerwise)
    errors = []
    if not any(torch.equal(captured, v) for v in (old, exp_w_t0, exp_cache1)):
        errors.append(f"captured holds {captured.tolist()}, values nobody produced")
    if not torch.equal(l0.w_t, exp_w_t0):
        errors.append(f"layers.0.w_t reads {l0.w_t.tolist()}, PWAL made {exp_w_t0.tolist()}")
    if not torch.equal(l1.cache, exp_cache1):
        errors.append(f"layers.1.cache reads {l1.cache.tolist()}, PWAL made {exp_cache1.tolist()}")
    if out.status is Status.COMMITTED:
        errors.append("COMMITTED although one memory cannot hold both")
    assert not errors, f"{errors}; {out.status}: {out.summary()}"


# ---------------------------------------------------------------------------------------------------------------
# B. A tensor carved out of an arena that is NOT a parameter/buffer, under another storage object (from_numpy,
#    DLPack). PWAL gives the carved slot a new tensor and reuses the arena for other values. Copying the slot's
#    new values into its captured memory writes into the arena (a plain view of the arena would be a suspect:
#    same storage; a carve under another storage object is not).
# ---------------------------------------------------------------------------------------------------------------


def _carve(arena: torch.Tensor, how: str) -> torch.Tensor:
    if how == "numpy":
        return torch.from_numpy(arena.numpy()[:4])
    if how == "dlpack":
        return torch.from_dlpack(arena[:4])
    if how == "view":  # control: the same storage object
        return arena[:4]
    if how == "frombuffer":
        return torch.frombuffer(arena.numpy(), dtype=torch.float32, count=4)
    raise AssertionError(how)


class ArenaLayer(nn.Module):
    def __init__(self, seed: int, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.arena = torch.zeros(8)
        self.how = how
        self.first = True

    def process_weights_after_loading(self) -> None:
        if self.first:  # the first load: the derived tensor lives in the arena
            self.first = False
            self.a = _carve(self.arena, self.how)
            self.a.copy_(self.weight * 2.0)
            return
        # later loads: a new tensor; the arena is reused for other values
        self.a = self.weight * 2.0
        self.arena.copy_(torch.cat([self.weight, self.weight]) * 7.0)


@pytest.mark.parametrize("how", ["view", "numpy", "dlpack", "frombuffer"])
@pytest.mark.parametrize("detect", ["declared-only", "sealed-paths", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_carve_from_a_plain_arena_is_not_overwritten(mode: str, detect: str, how: str) -> None:
    """The arena is never written: a holder the walk finds (declared-only, a view), a carve whose storage is an
    import (declared-only: the arena's memory is its owner, ``contract._owned``), a tie of two storage objects
    (sealed-paths/every-reload), or an arena sealed as the slot's alias and written by PWAL (``contract._owned``).
    The slot keeps PWAL's tensor, ``alias-broken``."""
    net = nn.Module()
    net.layers = nn.ModuleList([ArenaLayer(1, how), ArenaLayer(2, how)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "a")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    # (no reference to the captured tensor is kept here: one would make the holder look search)
    new = w(13)
    exp_a = new * 2.0
    exp_arena = torch.cat([new, new]) * 7.0

    def fn():
        l1.weight.copy_(new)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    errors = []
    if not torch.equal(l1.arena, exp_arena):
        errors.append(f"arena holds {l1.arena.tolist()}, PWAL made {exp_arena.tolist()} (graphsafe wrote into it)")
    if not torch.equal(l1.a, exp_a):
        errors.append(f"a = {l1.a.tolist()}, PWAL made {exp_a.tolist()}")
    if not any(f.kind.value == "alias-broken" and (f.layer, f.path) == ("layers.1", "a") for f in out.problems):
        errors.append("no alias-broken finding at layers.1:a")
    assert not errors, f"{errors}; {out.status}: {out.summary()}"


# ---------------------------------------------------------------------------------------------------------------
# C. PWAL mutates the captured tensor OBJECT in place (as_strided_, .data = a shorter tensor on the same address,
#    set_ onto a storage slice at the same address, resize_ of the storage larger) and then binds a new tensor.
#    Run in a subprocess: crash-prone.
# ---------------------------------------------------------------------------------------------------------------

_MUTATE_SCRIPT = r"""
import sys, contextlib, torch
from torch import nn
from graphsafe import GraphContract, Status, register_derived
from graphsafe.errors import ContractViolation, GraphSafeError
how, mode, layerwise = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

def w(seed): return torch.arange(4, dtype=torch.float32) + 100.0 * seed + 0.5

class L(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.first = True
    def process_weights_after_loading(self):
        if self.first:
            self.first = False
            self.w_t = (self.weight * 2.0 + 1.0).reshape(2, 2).contiguous()
            return
        old = self.w_t
        if how == "as_strided_T":
            old.as_strided_((2, 2), (1, 2))
        elif how == "as_strided_short":
            old.as_strided_((2,), (1,))
        elif how == "as_strided_off":
            old.as_strided_((2, 2), (2, 1), 0)
        elif how == "data_short":
            old.data = torch.from_dlpack(old.reshape(-1)[:2])
        elif how == "data_same_ptr_other_storage":
            old.data = torch.from_dlpack(old)
        elif how == "set_short":
            st = old.untyped_storage()
            old.set_(st, 0, (1, 2), (2, 1))
        elif how == "resize_larger":
            old.untyped_storage().resize_(1 << 20)
        elif how == "resize_same":
            old.untyped_storage().resize_(old.untyped_storage().nbytes())
        elif how == "tensor_resize_":
            old.resize_(4, 4)
        elif how == "tensor_resize_smaller":
            old.resize_(1, 2)
        self.w_t = (self.weight * 2.0 + 1.0).reshape(2, 2).contiguous()

net = nn.Module()
net.layers = nn.ModuleList([L(1), L(2)])
for l in net.layers:
    l.process_weights_after_loading()
    register_derived(l, "w_t")
c = GraphContract(net, mode, detect="declared-only").seal()
ptr = net.layers[1].w_t.data_ptr()
new = w(17)
exp = (new * 2.0 + 1.0).reshape(2, 2)
l1 = net.layers[1]
escaped = None
try:
    with contextlib.suppress(ContractViolation, GraphSafeError), c.reload(layerwise=layerwise) as txn, torch.no_grad():
        if layerwise: txn.before_layer(l1)
        l1.weight.copy_(new)
        l1.process_weights_after_loading()
        if layerwise: txn.after_layer(l1)
except Exception as exc:
    escaped = repr(exc)
out = c.last_outcome
status = None if out is None else out.status.name
errors = []
if escaped is not None:
    errors.append(f"exception escaped: {escaped}; outcome {status}")
if status == "COMMITTED":
    t = l1.w_t
    if t.data_ptr() != ptr or t.shape != exp.shape or not torch.equal(t, exp):
        errors.append(f"COMMITTED but w_t at {t.data_ptr()==ptr} shape {tuple(t.shape)} reads {t.tolist()} want {exp.tolist()}")
elif status is None or status == "COMMITTED":
    pass
else:
    if not torch.equal(l1.w_t.reshape(2, 2) if l1.w_t.numel() == 4 else l1.w_t, exp) and status == "NEEDS_RECAPTURE":
        errors.append(f"NEEDS_RECAPTURE but w_t reads {l1.w_t.tolist()} (a recapture reads it) want {exp.tolist()}")
print("STATUS", status, [ (f.kind.name, f.detail[:120]) for f in (out.findings if out else [])])
print("ERRORS", errors)
sys.exit(1 if errors else 0)
"""


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("mode", ["strict", "migrate"])
@pytest.mark.parametrize(
    "how",
    [
        "as_strided_T",
        "as_strided_short",
        "as_strided_off",
        "data_short",
        "data_same_ptr_other_storage",
        "set_short",
        "resize_larger",
        "resize_same",
        "tensor_resize_",
        "tensor_resize_smaller",
    ],
)
def test_pwal_mutates_the_captured_object(how: str, mode: str, layerwise: bool) -> None:
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", _MUTATE_SCRIPT, how, mode, "1" if layerwise else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])


# ---------------------------------------------------------------------------------------------------------------
# E. before_layer twice: a loader that calls before_layer once per weight and runs PWAL after each weight. The
#    second before_layer keeps the first snapshot; the second weight's load is followed by no
#    PWAL, so the slot holds f(first load) while the weights are the second load's. PWAL skipped the recompute for
#    the weight change made after its last run: stale.
# ---------------------------------------------------------------------------------------------------------------


class TwoWeights(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.bias = nn.Parameter(w(seed) * 0.25, requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.w_t = self.weight * 2.0 + self.bias  # a new tensor every time


@pytest.mark.parametrize("pwal_between", ["rebuild", "skip_second"])
@pytest.mark.parametrize("mode", MODES)
def test_second_before_layer_after_a_pwal_then_more_loading(mode: str, pwal_between: str) -> None:
    """A weight loaded after a repeated ``before_layer()`` with no PWAL after it: the slot PWAL rebuilt before that
    load is ``stale`` (``contract._repeat``); PWAL run again after it commits."""
    net = nn.Module()
    net.layers = nn.ModuleList([TwoWeights(1), TwoWeights(2)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    nw, nb = w(31), w(32)
    with (
        contextlib.suppress(ContractViolation, GraphSafeError),
        contract.reload(layerwise=True) as txn,
        torch.no_grad(),
    ):
        txn.before_layer(l1)
        l1.weight.copy_(nw)
        l1.process_weights_after_loading()  # PWAL after the first weight
        txn.before_layer(l1)  # once per weight
        l1.bias.copy_(nb)
        if pwal_between == "rebuild":
            l1.process_weights_after_loading()
        txn.after_layer(l1)
    out = outcome_of(contract)
    exp = nw * 2.0 + nb
    if pwal_between == "rebuild":
        assert out.status is Status.COMMITTED, out.summary()
        assert torch.equal(l1.w_t, exp), f"COMMITTED with w_t {l1.w_t.tolist()}, weights say {exp.tolist()}"
    else:
        assert out.status is Status.FAILED, out.summary()
        assert any(
            f.kind.value == "stale" and f.path == "w_t" and "second before_layer" in f.detail for f in out.problems
        )


# ---------------------------------------------------------------------------------------------------------------
# F. A layer restored (after_layer) and then reloaded again in the same transaction with other weights.
# ---------------------------------------------------------------------------------------------------------------


class SkipLayer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.skip = False

    def process_weights_after_loading(self) -> None:
        if self.skip:
            return
        self.w_t = self.weight * 2.0 + 1.0


@pytest.mark.parametrize("second", ["rebuild", "skip", "inplace_stale", "data_copy"])
@pytest.mark.parametrize("mode", MODES)
def test_layer_reloaded_twice_in_one_transaction(mode: str, second: str) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([SkipLayer(1), SkipLayer(2)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    ptr = l1.w_t.data_ptr()
    a, b = w(41), w(42)
    with (
        contextlib.suppress(ContractViolation, GraphSafeError),
        contract.reload(layerwise=True) as txn,
        torch.no_grad(),
    ):
        txn.before_layer(l1)
        l1.weight.copy_(a)
        l1.process_weights_after_loading()
        txn.after_layer(l1)
        txn.before_layer(l1)
        if second == "data_copy":
            l1.weight.data.copy_(b)
        else:
            l1.weight.copy_(b)
        if second == "rebuild":
            l1.process_weights_after_loading()
        elif second == "inplace_stale":
            l1.w_t.clamp_(-float("inf"), float("inf"))  # a no-op write
        txn.after_layer(l1)
    out = outcome_of(contract)
    exp = b * 2.0 + 1.0
    if out.status is Status.COMMITTED:
        assert l1.w_t.data_ptr() == ptr and torch.equal(l1.w_t, exp), (
            f"COMMITTED with w_t {l1.w_t.tolist()}, weights say {exp.tolist()}"
        )


# ---------------------------------------------------------------------------------------------------------------
# G. A derived slot carved (under another storage object) out of a PARAMETER arena, and the loader binds a new
#    Parameter (the parameter slot is restored by a copy into the captured one). Two copies write the same bytes
#    under two storage objects; the cross-storage check skips pairs with a parameter.
# ---------------------------------------------------------------------------------------------------------------


class ParamArena(nn.Module):
    def __init__(self, seed: int, how: str) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.cat([w(seed), torch.zeros(4)]), requires_grad=False)
        self.how = how
        self.first = True

    def process_weights_after_loading(self) -> None:
        d = self.packed[:4] * 2.0
        if self.first:
            self.first = False
            carved = self.packed.data[4:]
            self.d = torch.from_dlpack(carved) if self.how == "dlpack" else torch.from_numpy(carved.numpy())
            self.d.copy_(d)
            return
        self.d = d  # a new tensor


@pytest.mark.parametrize("how", ["dlpack", "numpy"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_carve_from_a_parameter_the_loader_replaces(mode: str, detect: str, how: str) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([ParamArena(1, how), ParamArena(2, how)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "d")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    ptr = l1.packed.data_ptr()
    ckpt = torch.cat([w(51), torch.full((4,), -1.0)])  # the checkpoint's bytes for the arena's tail

    def fn():
        l1.packed = nn.Parameter(ckpt.clone(), requires_grad=False)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    exp_d = ckpt[:4] * 2.0
    if out.status is Status.COMMITTED:
        assert l1.packed.data_ptr() == ptr
        assert torch.equal(l1.d, exp_d), f"COMMITTED with d {l1.d.tolist()}, PWAL made {exp_d.tolist()}"
        assert torch.equal(l1.packed[:4], ckpt[:4])


# ---------------------------------------------------------------------------------------------------------------
# H. The digest of every byte is taken only for type(t) in (Tensor, Parameter). vLLM's weights are Parameter
#    SUBCLASSES (ModelWeightParameter & co.: plain storage, no wrapper); for them the sample alone decides, so a
#    weight change confined to unsampled elements, loaded through .data, with a skipped PWAL commits stale.
# ---------------------------------------------------------------------------------------------------------------


class ModelWeightParameter(nn.Parameter):  # the shape of vLLM's BasevLLMParameter subclasses
    pass


class GuardLayer(nn.Module):
    def __init__(self, seed: int, cls: type) -> None:
        super().__init__()
        base = torch.arange(1024, dtype=torch.float32) * 0.001 + seed
        self.weight = cls(base, requires_grad=False)
        self.done_for: int | None = None

    def process_weights_after_loading(self) -> None:
        # A buggy "already processed" guard: keyed on the version counter, which .data.copy_ does not move.
        if self.done_for == self.weight._version:
            return
        self.done_for = self.weight._version
        self.w_t = self.weight * 2.0 + 1.0


@pytest.mark.parametrize("cls", [nn.Parameter, ModelWeightParameter], ids=["Parameter", "subclass"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_unsampled_weight_change_through_a_parameter_subclass(mode: str, detect: str, cls: type) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([GuardLayer(1, cls), GuardLayer(2, cls)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t", derived_from=["weight"])
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    new = l1.weight.detach().clone()
    new[1] += 5.0  # element 1: the sample picks every 4th element of 1024
    new[6] -= 3.0
    exp = new * 2.0 + 1.0

    def fn():
        l1.weight.data.copy_(new)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    assert torch.equal(l1.weight, new)
    if out.status is Status.COMMITTED:
        assert torch.equal(l1.w_t, exp), f"COMMITTED stale: w_t[1] {l1.w_t[1].item()} PWAL should make {exp[1].item()}"


class DtypeLayer(nn.Module):
    def __init__(self, seed: int, dtype: torch.dtype, n: int) -> None:
        super().__init__()
        base = (torch.arange(n) % 7 + seed).to(torch.float32)
        if dtype is torch.bool:
            t = torch.zeros(n, dtype=torch.bool)
        elif dtype.is_complex:
            t = torch.complex(base, -base).to(dtype)
        else:
            t = base.to(dtype)
        self.weight = nn.Parameter(t, requires_grad=False)
        self.done_for: int | None = None

    def process_weights_after_loading(self) -> None:
        if self.done_for == self.weight._version:
            return
        self.done_for = self.weight._version
        self.w_t = self.weight.to(torch.complex64 if self.weight.dtype.is_complex else torch.float32) * 2.0


@pytest.mark.parametrize(
    "dtype,n",
    [
        (torch.bool, 1024),
        (torch.bool, 1023),
        (torch.int8, 1023),
        (torch.float16, 1023),
        (torch.complex64, 1024),
        (torch.float8_e4m3fn, 1025),
        (torch.uint8, 5000),
        (torch.float32, 300),
    ],
)
def test_unsampled_change_for_odd_dtypes_and_sizes(dtype: torch.dtype, n: int) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([DtypeLayer(1, dtype, n), DtypeLayer(2, dtype, n)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t", derived_from=["weight"])
    contract = GraphContract(net, "migrate", detect="declared-only").seal()
    l1 = net.layers[1]
    new = l1.weight.detach().clone()
    if dtype is torch.bool:
        new[n - 2] = True  # last rows / unsampled
        new[1] = True
    else:
        new[1] = (new[1].to(torch.float32) + 3).to(dtype) if not dtype.is_complex else new[1] + 3
    assert not torch.equal(
        new.view(torch.uint8) if new.dtype != torch.bool else new,
        l1.weight.detach().view(torch.uint8) if new.dtype != torch.bool else l1.weight.detach(),
    )

    def fn():
        l1.weight.data.copy_(new)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    exp = new.to(torch.complex64 if dtype.is_complex else torch.float32) * 2.0
    if out.status is Status.COMMITTED:
        assert torch.equal(l1.w_t, exp), "COMMITTED stale"


# ---------------------------------------------------------------------------------------------------------------
# I. PWAL keeps the old captured memory as a storage pool made through another storage object (a DLPack import's
#    or from_numpy's UntypedStorage), reuses it, and gives the slot a new tensor. The pool must not be written.
# ---------------------------------------------------------------------------------------------------------------


class PoolLayer(nn.Module):
    def __init__(self, seed: int, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.how = how
        self.first = True

    def process_weights_after_loading(self) -> None:
        if self.first:
            self.first = False
            self.w_t = self.weight * 2.0 + 1.0
            return
        old = self.w_t
        if self.how == "dlpack_storage":
            self.pool = torch.from_dlpack(old).untyped_storage()
        elif self.how == "numpy_storage":
            self.pool = torch.from_numpy(old.numpy()).untyped_storage()
        elif self.how == "same_storage":  # control: the captured storage object itself
            self.pool = old.untyped_storage()
        elif self.how == "dlpack_tensor_list":
            self.pool = [torch.from_dlpack(old)]
        elif self.how == "numpy_tensor":
            self.pool = torch.from_numpy(old.numpy())
        view = torch.empty(0).set_(
            self.pool
            if isinstance(self.pool, torch.UntypedStorage)
            else (self.pool[0] if isinstance(self.pool, list) else self.pool).untyped_storage()
        )
        view.fill_(9.0)  # the pool's new contents
        del old, view
        self.w_t = self.weight * 2.0 + 1.0


@pytest.mark.parametrize(
    "how", ["same_storage", "dlpack_storage", "numpy_storage", "dlpack_tensor_list", "numpy_tensor"]
)
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_pool_through_another_storage_object_is_never_written(mode: str, detect: str, how: str) -> None:
    """The holder search matches a raw storage the walk reaches by its memory too (``WalkResult.storages``): a pool
    made over the captured bytes through DLPack or ``from_numpy`` blocks the copy like the captured storage object
    itself; the slot keeps PWAL's tensor, ``alias-broken``."""
    net = nn.Module()
    net.layers = nn.ModuleList([PoolLayer(1, how), PoolLayer(2, how)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    new = w(61)

    def fn():
        l1.weight.copy_(new)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    pool = l1.pool
    if isinstance(pool, list):
        pool = pool[0]
    if isinstance(pool, torch.UntypedStorage):
        pool = torch.empty(0).set_(pool)
    assert torch.equal(pool, torch.full((4,), 9.0)), f"graphsafe wrote {pool.tolist()} into the pool ({out.status})"
    broken = [f for f in out.problems if f.kind.value == "alias-broken" and (f.layer, f.path) == ("layers.1", "w_t")]
    assert broken and "'layers.1.pool" in broken[0].detail, out.summary()
    assert torch.equal(l1.w_t, new * 2.0 + 1.0)


# ---------------------------------------------------------------------------------------------------------------
# J. A derived slot carved out of a parameter arena; the loader copies the checkpoint into the whole parameter (the
#    carved bytes included) and PWAL skips the recompute. The slot's sample changed (the loader wrote it), which
#    counts as PWAL's write: committed with the checkpoint's bytes instead of PWAL's values.
# ---------------------------------------------------------------------------------------------------------------


class SkipArena(nn.Module):
    def __init__(self, seed: int, how: str) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.cat([w(seed), torch.zeros(4)]), requires_grad=False)
        self.how = how
        self.first = True

    def process_weights_after_loading(self) -> None:
        if not self.first:
            return  # buggy guard: "already processed"
        self.first = False
        carved = self.packed.data[4:]
        if self.how == "dlpack":
            self.d = torch.from_dlpack(carved)
        elif self.how == "numpy":
            self.d = torch.from_numpy(carved.numpy())
        elif self.how == "view":
            self.d = self.packed[4:]
        elif self.how == "data_view":
            self.d = carved
        self.d.copy_(self.packed[:4] * 2.0)


@pytest.mark.parametrize("how", ["view", "data_view", "dlpack", "numpy"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_skipped_carve_the_loader_overwrote(mode: str, detect: str, how: str) -> None:
    """The slot's bytes changed (the loader wrote the arena) with no write through its own tensor, which cannot pass
    for PWAL's refresh: ``stale``, naming the parameter whose memory it lies in (``contract._carved``). An autograd
    view of the parameter shares its version counter, so the loader's write moves the slot's too: judged by its
    inputs all the same."""
    net = nn.Module()
    net.layers = nn.ModuleList([SkipArena(1, how), SkipArena(2, how)])
    with torch.no_grad():
        for layer in net.layers:
            layer.process_weights_after_loading()
            register_derived(layer, "d")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    ckpt = torch.cat([w(71), torch.full((4,), -1.0)])

    def fn():
        l1.packed.copy_(ckpt)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    assert out.status is Status.FAILED, out.summary()
    stale = [f for f in out.problems if f.kind.value == "stale" and (f.layer, f.path) == ("layers.1", "d")]
    assert stale and "inside the memory of layers.1:packed" in stale[0].detail, out.summary()


@pytest.mark.parametrize("how", ["view", "data_view", "dlpack", "numpy"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
def test_a_carve_pwal_refreshes_after_the_loader_commits(detect: str, how: str) -> None:
    """The legitimate twin: PWAL rewrites the carve after the loader wrote the arena; and a reload that leaves the
    arena as it was commits. An autograd view of the parameter (``view``) fails closed instead: its write cannot be
    told from the loader's, and the finding says to carve it with ``.data``."""
    net = nn.Module()
    net.layers = nn.ModuleList([SkipArena(1, how), SkipArena(2, how)])
    with torch.no_grad():
        for layer in net.layers:
            layer.process_weights_after_loading()
            register_derived(layer, "d")
    contract = GraphContract(net, "strict", detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    ckpt = torch.cat([w(71), torch.full((4,), -1.0)])

    def fn():
        l1.packed.copy_(ckpt)
        l1.d.copy_(l1.packed[:4] * 2.0)  # the refresh (in place, where the graph reads it)

    if how == "view":
        out = _run(contract, net, [(l1, fn)])
        assert out.status is Status.FAILED, out.summary()
        assert any("Carve it with .data" in f.detail for f in out.problems), out.summary()
        return
    assert _run(contract, net, [(l1, fn)]).status is Status.COMMITTED
    assert torch.equal(l1.d, ckpt[:4] * 2.0)
    assert _run(contract, net, [(l1, lambda: None)]).status is Status.COMMITTED


# ---------------------------------------------------------------------------------------------------------------
# K. Freeing (or regrowing) a captured storage two slots share; one slot left in place. Subprocess: crash-prone.
# ---------------------------------------------------------------------------------------------------------------

_SHARED_FREE_SCRIPT = r"""
import sys, contextlib, torch
from torch import nn
from graphsafe import GraphContract, Status, register_derived
from graphsafe.errors import ContractViolation, GraphSafeError
how, mode = sys.argv[1], sys.argv[2]
def w(seed): return torch.arange(4, dtype=torch.float32) + 100.0 * seed + 0.5
class L(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.first = True
    def process_weights_after_loading(self):
        if self.first:
            self.first = False
            s = torch.empty(8)
            self.a, self.b = s[:4], s[4:]
            self.a.copy_(self.weight * 2); self.b.copy_(self.weight * 3)
            return
        st = self.a.untyped_storage()
        if how == "free_both_rebuilt":
            self.a = self.weight * 2; self.b = self.weight * 3
            st.resize_(0)
        elif how == "free_b_left":
            self.a = self.weight * 2
            self.b.copy_(self.weight * 3)
            st.resize_(0)
        elif how == "regrow_b_left":
            self.a = self.weight * 2
            st.resize_(0); st.resize_(32)
            self.b.copy_(self.weight * 3)
        elif how == "shrink_half":
            self.a = self.weight * 2; self.b = self.weight * 3
            st.resize_(16)
        elif how == "grow":
            self.a = self.weight * 2; self.b = self.weight * 3
            st.resize_(64)
net = nn.Module(); net.layers = nn.ModuleList([L(1), L(2)])
for l in net.layers:
    l.process_weights_after_loading(); register_derived(l, "a"); register_derived(l, "b")
c = GraphContract(net, mode, detect="declared-only").seal()
l1 = net.layers[1]
pa, pb = l1.a.data_ptr(), l1.b.data_ptr()
new = w(19)
escaped = None
try:
    with contextlib.suppress(ContractViolation, GraphSafeError), c.reload() as txn, torch.no_grad():
        l1.weight.copy_(new); l1.process_weights_after_loading()
except Exception as exc:
    escaped = repr(exc)
out = c.last_outcome
errors = []
if escaped: errors.append("escaped " + escaped)
if out is not None and out.status is Status.COMMITTED:
    if not (l1.a.data_ptr() == pa and l1.b.data_ptr() == pb and torch.equal(l1.a, new * 2) and torch.equal(l1.b, new * 3)):
        errors.append(f"COMMITTED but a={l1.a.tolist()} b={l1.b.tolist()} ptrs {l1.a.data_ptr()==pa} {l1.b.data_ptr()==pb}")
print("STATUS", None if out is None else out.status, [(f.kind.name, f.path) for f in (out.findings if out else [])])
print("ERRORS", errors)
sys.exit(1 if errors else 0)
"""


@pytest.mark.parametrize("mode", ["strict", "migrate"])
@pytest.mark.parametrize("how", ["free_both_rebuilt", "free_b_left", "regrow_b_left", "shrink_half", "grow"])
def test_shared_captured_storage_freed(how: str, mode: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SHARED_FREE_SCRIPT, how, mode], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])


# ---------------------------------------------------------------------------------------------------------------
# L. A skipped recompute disguised as a rebuild: PWAL re-imports the slot's own memory as a new tensor under
#    another storage object (DLPack, from_numpy) — say the buffer an extension owns and should have refreshed.
#    "another storage at the path" counts as rebuilt; the restore's copy is a no-op onto the same bytes.
# ---------------------------------------------------------------------------------------------------------------


class ReimportLayer(nn.Module):
    def __init__(self, seed: int, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(w(seed), requires_grad=False)
        self.how = how
        self.first = True

    def process_weights_after_loading(self) -> None:
        if self.first:
            self.first = False
            self.w_t = self.weight * 2.0 + 1.0
            return
        # the refresh is skipped (a bug); the path gets a new tensor object on the same memory
        if self.how == "dlpack":
            self.w_t = torch.from_dlpack(self.w_t)
        elif self.how == "numpy":
            self.w_t = torch.from_numpy(self.w_t.numpy())
        elif self.how == "view":  # control: the same storage object
            self.w_t = self.w_t.view_as(self.w_t)


@pytest.mark.parametrize("how", ["view", "dlpack", "numpy"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_skip_disguised_as_a_reimport_is_stale(mode: str, detect: str, how: str) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([ReimportLayer(1, how), ReimportLayer(2, how)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect=detect).seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    new = w(81)

    def fn():
        l1.weight.copy_(new)
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    exp = new * 2.0 + 1.0
    if out.status is Status.COMMITTED:
        assert torch.equal(l1.w_t, exp), f"COMMITTED stale: w_t {l1.w_t.tolist()}, PWAL should make {exp.tolist()}"


# ---------------------------------------------------------------------------------------------------------------
# M. The wrapper twin of I: PWAL keeps the old captured wrapper's inner qdata memory as a pool through a DLPack
#    storage object, reuses it, and gives the slot a new wrapper.
# ---------------------------------------------------------------------------------------------------------------


def _wrapper_case(hand: str) -> Any:
    from contract.test_restore_sharing import quant_of  # the torchao-style wrapper of the restore-plan tests

    class WPool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(w(1), requires_grad=False)

        def process_weights_after_loading(self) -> None:
            if "cur" not in self.__dict__:
                self.cur = quant_of(self.weight, 1)
                return
            old, self.cur = self.cur, quant_of(self.weight, 1)
            if hand == "dlpack_storage":
                self.pool = torch.from_dlpack(old.qdata).untyped_storage()
            else:  # control
                self.pool = old.qdata.untyped_storage()
            torch.empty(0, dtype=torch.int8).set_(self.pool).fill_(7)

    return WPool(), quant_of


@pytest.mark.parametrize("hand", ["same_storage", "dlpack_storage"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
@pytest.mark.parametrize("mode", MODES)
def test_wrapper_inner_pool_through_dlpack_is_never_written(mode: str, detect: str, hand: str) -> None:
    model, _quant_of = _wrapper_case(hand)
    model.process_weights_after_loading()
    register_derived(model, "cur")
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    new = w(33)
    with contextlib.suppress(ContractViolation, GraphSafeError), contract.reload(), torch.no_grad():
        model.weight.copy_(new)
        model.process_weights_after_loading()
    out = outcome_of(contract)
    pool = torch.empty(0, dtype=torch.int8).set_(model.pool)
    assert torch.equal(pool, torch.full((4,), 7, dtype=torch.int8)), f"graphsafe wrote {pool.tolist()} ({out.status})"
    assert any(f.kind.value == "alias-broken" and f.path == "cur" and "'pool'" in f.detail for f in out.problems), (
        out.summary()
    )


# ---------------------------------------------------------------------------------------------------------------
# N. The loader replaces the weight by a new Parameter of another dtype or shape (or a Parameter subclass) and
#    PWAL's version guard skips the recompute: never COMMITTED, and a NEEDS_RECAPTURE must not recapture stale.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["float64", "shape", "subclass_same_values_but_one", "bf16_same_bytes"])
@pytest.mark.parametrize("mode", MODES)
def test_weight_replaced_by_another_parameter_with_a_skipped_pwal(mode: str, kind: str) -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([GuardLayer(1, nn.Parameter), GuardLayer(2, nn.Parameter)])
    for layer in net.layers:
        layer.process_weights_after_loading()
        register_derived(layer, "w_t")
    contract = GraphContract(net, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    l1 = net.layers[1]
    old = l1.weight.detach().clone()
    if kind == "float64":
        new = nn.Parameter(old.double() + 1, requires_grad=False)
    elif kind == "shape":
        new = nn.Parameter(torch.cat([old, old])[:1000] + 1, requires_grad=False)
    elif kind == "subclass_same_values_but_one":
        v = old.clone()
        v[1] += 5.0
        new = ModelWeightParameter(v, requires_grad=False)
    else:  # int32 bits reinterpreted: same bytes, other dtype of the same width
        new = nn.Parameter(old.view(torch.int32).clone(), requires_grad=False)

    def fn():
        l1.weight = new
        l1.process_weights_after_loading()

    out = _run(contract, net, [(l1, fn)])
    exp = l1.weight * 2.0 + 1.0
    if out.status is Status.COMMITTED:
        assert l1.w_t.shape == exp.shape and torch.equal(l1.w_t, exp.to(l1.w_t.dtype)), "COMMITTED stale"
    elif out.status is Status.NEEDS_RECAPTURE:
        assert l1.w_t.shape == exp.shape and torch.equal(l1.w_t, exp), "a recapture would read a stale w_t"


class WholeView(nn.Module):
    """A derived slot that is the whole of a parameter's bytes (the parameter itself, or a view of all of it), as
    vLLM's StaticSinkAttention is handed its sink value: what the loader writes is its value."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.param = nn.Parameter(torch.randn(4, 2, 8), requires_grad=False)
        self.process_weights_after_loading()
        register_derived(self, "held")

    def process_weights_after_loading(self) -> None:
        self.held = self.param if self.how == "same" else self.param.view(8, 8)


@pytest.mark.parametrize("how", ["same", "view"])
def test_a_derived_slot_on_the_whole_of_a_parameter_the_loader_wrote_commits(how: str) -> None:
    """Not a carve of a part the loader's write could pass for PWAL's refresh in: the loader's values are its own,
    whatever the shared version counter says (``contract._carved``)."""
    layer = WholeView(how)
    contract = GraphContract(layer, "strict").seal()
    new = torch.randn(4, 2, 8)
    with torch.no_grad(), contract.reload():
        layer.param.copy_(new)
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(layer.held.reshape(4, 2, 8), new)
