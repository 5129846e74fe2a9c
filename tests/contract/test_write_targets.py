"""What graphsafe writes, and where: sources on another slot's captured bytes, broadcast tensors, take-backs.

Every test is a minimal reproduction of one way the promise could break, and pins the rule that holds it. The
oracle is independent of graphsafe: an eager twin of the model that runs the same reload with no contract (what
each path holds after the load), compared with the bytes of the captured tensors (the pre-reload objects, by
address) after the reload.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from graphsafe import ContractViolation, GraphContract, ReloadOutcome, Status, register_derived

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

MODES = ("strict", "recapture", "migrate")


def _outcome(contract: GraphContract) -> ReloadOutcome:
    out = contract.last_outcome
    assert out is not None
    return out


# ---------------------------------------------------------------------------------------------------------------
# 1. PWAL hands a slot the PREVIOUS values of another slot (a ping-pong / history buffer) through another storage
#    object on the same bytes: torch.from_dlpack(old) or torch.from_numpy(old.numpy()), as kernel libraries and
#    other frameworks hand tensors over. The restore copies the other slot's new values into its captured storage
#    first, then copies "the previous values" out of the same bytes: the source was never cloned, because
#    RestorePlan.protect() asks whether a source overlaps a destination by storage IDENTITY only.
# ---------------------------------------------------------------------------------------------------------------


class Hist(nn.Module):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.cur = torch.tensor(values)
        register_derived(self, "cur", static=True)


def _import(tensor: torch.Tensor, how: str) -> torch.Tensor:
    return torch.from_dlpack(tensor) if how == "dlpack" else torch.from_numpy(tensor.numpy())


def _pingpong_step(model: nn.Module, how: str) -> None:
    l0, l1 = model.layers  # type: ignore[misc]
    l1.cur = _import(l0.cur, how)  # layer 1 keeps layer 0's previous values (read through another storage object)
    l0.cur = torch.tensor([5.0, 6.0, 7.0, 8.0])  # layer 0 gets new ones


def _two_layers() -> nn.Module:
    net = nn.Module()
    net.layers = nn.ModuleList([Hist([1.0, 2.0, 3.0, 4.0]), Hist([10.0, 20.0, 30.0, 40.0])])
    return net


@pytest.mark.parametrize("how", ["dlpack", "numpy"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("mode", MODES)
def test_a_source_on_another_slots_captured_bytes_under_another_storage_object_is_not_overwritten_first(
    mode: str, layerwise: bool, how: str
) -> None:
    eager = _two_layers()
    _pingpong_step(eager, how)
    expected = [layer.cur.clone() for layer in eager.layers]  # [5,6,7,8] and [1,2,3,4]

    model = _two_layers()
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    captured = [layer.cur for layer in model.layers]
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=layerwise) as txn:
        if layerwise:
            for layer in model.layers:
                txn.before_layer(layer)
        _pingpong_step(model, how)
        if layerwise:
            for layer in model.layers:
                txn.after_layer(layer)
    out = _outcome(contract)
    errors = []
    for index, (layer, cap, exp) in enumerate(zip(model.layers, captured, expected, strict=True)):
        if not torch.equal(layer.cur, exp):
            errors.append(f"layers.{index}.cur reads {layer.cur.tolist()}, the reload gave it {exp.tolist()}")
        if out.status is Status.COMMITTED and not torch.equal(cap, exp):
            errors.append(f"COMMITTED, but the captured layers.{index}.cur holds {cap.tolist()}, not {exp.tolist()}")
    assert not errors, f"{errors}; {out.status}: {out.summary()}"


# ---------------------------------------------------------------------------------------------------------------
# 2. The same bytes-under-another-storage-object gap on the READER side: a new tensor the contract leaves at its
#    path (a respecified slot: NEEDS_RECAPTURE, "the model keeps the tensors PWAL produced, so the recapture reads
#    the right values") reads another slot's captured bytes through DLPack. The copy into that captured storage
#    overwrites what the kept tensor reads (RestorePlan.watch -> hold(kept) -> overlaps_destination goes by
#    storage identity), so the model, and the recapture, read values the reload never produced for that path.
# ---------------------------------------------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.tensor([1.0, 2.0, 3.0, 4.0])
        self.b = torch.tensor([10.0, 20.0, 30.0, 40.0])
        register_derived(self, "a", static=True)
        register_derived(self, "b", static=True)


def _pair_step(model: Pair, how: str) -> None:
    model.b = _import(model.a, how)[:2]  # b: the head of a's previous values (another shape: respecified)
    model.a = torch.tensor([5.0, 6.0, 7.0, 8.0])


@pytest.mark.parametrize("how", ["dlpack", "numpy"])
@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_kept_new_tensor_on_another_slots_captured_bytes_keeps_what_pwal_gave_it(mode: str, how: str) -> None:
    eager = Pair()
    _pair_step(eager, how)
    exp_a, exp_b = eager.a.clone(), eager.b.clone()  # [5, 6, 7, 8], [1, 2]

    model = Pair()
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    with contextlib.suppress(ContractViolation), contract.reload():
        _pair_step(model, how)
    out = _outcome(contract)
    assert torch.equal(model.b, exp_b), (
        f"after {out.status} the model's path b reads {model.b.tolist()} (graphsafe copied a's new values into the "
        f"bytes it reads); PWAL gave it {exp_b.tolist()}, and a recapture would read the wrong values. "
        f"{out.summary()}"
    )
    # (Added by the fixer.) Keeping b's bytes must not cost a its values: the write-back of b into a's captured
    # memory breaks a's copy, so a keeps what PWAL gave it too (found by address: b reads it under another storage).
    assert torch.equal(model.a, exp_a), f"after {out.status} a reads {model.a.tolist()}, PWAL gave it {exp_a.tolist()}"


# ---------------------------------------------------------------------------------------------------------------
# 3. A broadcast (stride-0) tensor that reads memory a restore copy writes: a per-tensor scale expanded per channel
#    (`scale[:1].expand(n)`) that PWAL leaves where it was while it rebuilds `scale` (or a new broadcast tensor the
#    contract leaves at its path). RestorePlan.check() writes a changed reader's bytes back with a plain
#    `reader.view.copy_(reader.before)`, which torch refuses for a destination whose elements share memory: a raw
#    RuntimeError from deep inside finish(), no outcome (last_outcome is None), and the captured memory left with
#    the copy's values under the broadcast slot, which the reload never gave it.
# ---------------------------------------------------------------------------------------------------------------


class Bcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
        self.bcast = self.scale[:1].expand(4)  # the per-tensor scale, broadcast per channel
        register_derived(self, "scale", static=True)
        register_derived(self, "bcast", static=True)


def _bcast_step(model: Bcast, how: str) -> None:
    old = model.scale
    model.scale = torch.tensor([5.0, 6.0, 7.0, 8.0])  # rebuilt
    if how == "kept":  # bcast becomes another broadcast of the OLD scale (another shape: respecified, kept)
        model.bcast = old[:1].expand(2)
    # "left": bcast is left as it was (on the old scale's memory)


@pytest.mark.parametrize("how", ["left", "kept"])
@pytest.mark.parametrize("mode", MODES)
def test_a_broadcast_tensor_on_memory_a_copy_writes_gets_an_outcome_and_keeps_its_values(mode: str, how: str) -> None:
    eager = Bcast()
    _bcast_step(eager, how)
    exp_scale, exp_bcast = eager.scale.clone(), eager.bcast.clone()

    model = Bcast()
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    cap_scale, cap_bcast = model.scale, model.bcast
    raised: BaseException | None = None
    try:
        with contract.reload():
            _bcast_step(model, how)
    except ContractViolation:
        pass
    except Exception as exc:  # what escapes is the finding
        raised = exc
    out = contract.last_outcome
    errors = []
    if raised is not None:
        errors.append(f"the reload raised {type(raised).__name__}: {raised} (last_outcome: {out})")
    if not torch.equal(model.scale, exp_scale) or not torch.equal(model.bcast, exp_bcast):
        errors.append(
            f"the model reads scale={model.scale.tolist()} bcast={model.bcast.tolist()}, the reload left "
            f"scale={exp_scale.tolist()} bcast={exp_bcast.tolist()}"
        )
    if out is not None and out.status is Status.COMMITTED:
        errors.append(f"COMMITTED; captured scale={cap_scale.tolist()} bcast={cap_bcast.tolist()}")
    assert not errors, errors


# ---------------------------------------------------------------------------------------------------------------
# 4. A broadcast slot whose new tensor is a broadcast view of another slot's captured memory (double-buffered
#    per-tensor scales: b takes a's previous value, broadcast the captured way; a gets a new one). The geometry
#    matches, so b is planned as a copy; RestorePlan.protect() clones its source because it reads bytes a's copy
#    writes, but `src.detach().clone()` materializes the broadcast (stride 0 -> 1), and CopyBatch.add /
#    distinct_views then refuses the pair with a raw ValueError. The `finally: batch.flush()` still launches a's
#    pending copy: the memory b's new tensor reads is overwritten with a's new values, and no outcome is recorded.
# ---------------------------------------------------------------------------------------------------------------


class TwoScales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.tensor([1.0, 2.0, 3.0, 4.0])
        self.b = torch.tensor([9.0]).expand(4)  # a broadcast scale with memory of its own
        register_derived(self, "a", static=True)
        register_derived(self, "b", static=True)


def _two_scales_step(model: TwoScales) -> None:
    model.b = model.a[:1].expand(4)  # b: a's previous first value, broadcast exactly as b was captured
    model.a = torch.tensor([5.0, 6.0, 7.0, 8.0])


@pytest.mark.parametrize("mode", MODES)
def test_a_broadcast_source_cloned_by_protect_is_copied_not_crashed(mode: str) -> None:
    eager = TwoScales()
    _two_scales_step(eager)
    exp_a, exp_b = eager.a.clone(), eager.b.clone()  # [5, 6, 7, 8], [1, 1, 1, 1]

    model = TwoScales()
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    cap_a, cap_b = model.a, model.b
    raised: BaseException | None = None
    try:
        with contract.reload():
            _two_scales_step(model)
    except ContractViolation:
        pass
    except Exception as exc:  # what escapes is the finding
        raised = exc
    out = contract.last_outcome
    errors = []
    if raised is not None:
        errors.append(f"the reload raised {type(raised).__name__}: {raised} (last_outcome: {out})")
    if not torch.equal(model.a, exp_a) or not torch.equal(model.b, exp_b):
        errors.append(
            f"the model reads a={model.a.tolist()} b={model.b.tolist()}, the reload left a={exp_a.tolist()} "
            f"b={exp_b.tolist()}"
        )
    if (
        out is not None
        and out.status is Status.COMMITTED
        and not (torch.equal(cap_a, exp_a) and torch.equal(cap_b, exp_b))
    ):
        errors.append(f"COMMITTED; captured a={cap_a.tolist()} b={cap_b.tolist()}")
    assert not errors, errors


# ---------------------------------------------------------------------------------------------------------------
# 5. A slot whose copy is taken back (alias-broken) after its source was protected by a clone: RestorePlan._break
#    binds `nn.Parameter(clone)` / the bare clone at the path in place of the object PWAL made. The values are
#    right, but the object is not: its class (a Parameter subclass, as vLLM's weight parameters are) and every
#    Python attribute PWAL or the loader hung on it (`output_dim`, `weight_loader`, ...) are gone, although the
#    reload ends NEEDS_RECAPTURE, "the model keeps the tensors PWAL produced". Double-buffered derived parameter:
#    PWAL moves `cur` to `prev` and builds a new `cur`, but forgets to re-derive `prev_head`, a view into `prev`.
# ---------------------------------------------------------------------------------------------------------------


class TaggedParameter(nn.Parameter):
    """A Parameter subclass with loader metadata, as inference engines use."""


def _tagged(values: list[float]) -> TaggedParameter:
    param = TaggedParameter(torch.tensor(values), requires_grad=False)
    param.output_dim = 0  # type: ignore[attr-defined]
    return param


class DoubleBuffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cur = _tagged([1.0, 2.0, 3.0, 4.0])
        self.prev = _tagged([10.0, 20.0, 30.0, 40.0])
        self.prev_head = self.prev.detach()[:2]  # a view into prev's memory
        for name in ("cur", "prev", "prev_head"):
            register_derived(self, name, static=True)


def _double_buffer_step(model: DoubleBuffered) -> None:
    model.prev = model.cur  # the previous cur, with its class and attributes
    model.cur = _tagged([5.0, 6.0, 7.0, 8.0])
    # prev_head is not re-derived: it keeps reading the old prev memory


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_taken_back_copy_leaves_the_object_pwal_made_at_its_path(mode: str) -> None:
    eager = DoubleBuffered()
    _double_buffer_step(eager)
    exp_prev = eager.prev

    model = DoubleBuffered()
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    with contextlib.suppress(ContractViolation), contract.reload():
        _double_buffer_step(model)
    out = _outcome(contract)
    prev = model.prev
    errors = []
    if not torch.equal(prev, exp_prev):
        errors.append(f"prev reads {prev.tolist()}, the reload gave it {exp_prev.tolist()}")
    if type(prev) is not type(exp_prev):
        errors.append(f"prev is now a {type(prev).__name__}, PWAL made a {type(exp_prev).__name__}")
    if getattr(prev, "output_dim", None) != 0:
        errors.append(f"prev lost the attributes on the object PWAL put there: {prev.__dict__}")
    assert not errors, f"{errors}; {out.status}: {out.summary()}"


# ---------------------------------------------------------------------------------------------------------------
# 6. False alarm (triage, added by the fixer): an empty tensor PWAL rebuilds on every reload (GPTQ-Marlin's
#    `g_idx = torch.empty(0)` when act-order is off) was `stale`: LayerSnapshot._note_fresh took the new object for
#    a re-import of the old memory because both data_ptr() are 0. A data pointer of 0 is no memory at all.
# ---------------------------------------------------------------------------------------------------------------


class EmptyGIdx(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.g_idx = torch.empty(0, dtype=torch.int32)
        self.scale = self.weight.detach() * 2
        register_derived(self, "g_idx")
        register_derived(self, "scale")

    def process_weights_after_loading(self) -> None:
        self.g_idx = torch.empty(0, dtype=torch.int32)  # rebuilt: a new (empty) tensor every time
        self.scale = self.weight.detach() * 2


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_tensor_rebuilt_by_pwal_is_not_stale(mode: str, layerwise: bool) -> None:
    model = EmptyGIdx()
    contract = GraphContract(model, mode, detect="declared-only").seal()  # type: ignore[arg-type]
    cap_scale = model.scale
    for step in range(2):
        with contract.reload(layerwise=layerwise) as txn:
            if layerwise:
                txn.before_layer(model)
            model.weight.data.copy_(torch.full((4,), 3.0 + step))
            model.process_weights_after_loading()
            if layerwise:
                txn.after_layer(model)
        out = _outcome(contract)
        assert out.status is Status.COMMITTED, out.summary()
        assert torch.equal(cap_scale, torch.full((4,), 2 * (3.0 + step)))
