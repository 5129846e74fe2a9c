"""A parameter or buffer the restore copies into is judged by the captured layout, not the loaded tensor's.

The loader's tensor carries values; how the checkpoint laid them out (views at offsets into one flat buffer, a
base and its views re-created as separate tensors, a contiguous checkpoint for a ``channels_last`` conv) is the
loader's business. A copy into the captured storage writes the values in the captured layout, which is what the
graph reads, so the reload commits. What a copy cannot keep stays ``respecified``: another shape, dtype or class,
new values for a captured broadcast dimension, and a derived slot that PWAL laid out anew (a kernel may read its
raw bytes in the new layout, which the graph does not).
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadOutcome, Status, register_derived

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers


def reload(contract: GraphContract, body: Any) -> ReloadOutcome:
    with contract.reload():
        body()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


Captured = tuple["weakref.ReferenceType[torch.UntypedStorage]", torch.Size, tuple[int, ...], int, torch.dtype]


def captured_view(tensor: torch.Tensor) -> Captured:
    """What a replaying graph reads, to look at later: the captured storage (held weakly, as a graph holds it)
    and the captured layout."""
    return (weakref.ref(tensor.untyped_storage()), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)


def at_address(captured: Captured) -> torch.Tensor:
    ref, shape, stride, offset, dtype = captured
    storage = ref()
    assert storage is not None, "the captured storage was freed"
    view = torch.empty(0, dtype=dtype)
    view.set_(storage, offset, shape, stride)
    return view


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_assign_from_views_into_one_flat_buffer_commits_by_copy(mode: str) -> None:
    layer = nn.Linear(4, 4)
    graph = {name: captured_view(t) for name, t in layer.named_parameters()}
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    flat = torch.randn(64)  # safetensors style: every tensor a view at an offset of one buffer
    state = {"weight": flat[8:24].view(4, 4), "bias": flat[40:44]}
    outcome = reload(contract, lambda: layer.load_state_dict(state, assign=True))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    for name, value in state.items():
        assert torch.equal(at_address(graph[name]), value)
        assert getattr(layer, name).untyped_storage() is graph[name][0]()


class BaseAndView(nn.Module):
    """A buffer that is a view into a parameter's memory (a fused weight and one of its parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(32), requires_grad=False)
        self.register_buffer("part", self.base.detach()[4:12].view(2, 4))


def test_a_base_and_its_view_recreated_as_separate_consistent_tensors_commit() -> None:
    model = BaseAndView()
    graph = {"base": captured_view(model.base), "part": captured_view(model.part)}
    contract = GraphContract(model, "strict").seal()
    base = torch.randn(32)
    state = {"base": base, "part": base[4:12].view(2, 4).clone()}  # separate storages, the same values
    outcome = reload(contract, lambda: model.load_state_dict(state, assign=True))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(at_address(graph["base"]), base)
    assert torch.equal(at_address(graph["part"]), state["part"])


def test_a_base_and_its_view_recreated_with_values_that_disagree_are_not_committed() -> None:
    model = BaseAndView()
    contract = GraphContract(model, "recapture").seal()
    state = {"base": torch.randn(32), "part": torch.randn(2, 4)}  # one memory cannot hold both
    outcome = reload(contract, lambda: model.load_state_dict(state, assign=True))
    assert outcome.status is not Status.COMMITTED, outcome.summary()


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_channels_last_conv_loaded_from_a_contiguous_checkpoint_commits_in_its_captured_layout(mode: str) -> None:
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    graph = captured_view(conv.weight)
    contract = GraphContract(conv, mode).seal()  # type: ignore[arg-type]
    state = {"weight": torch.randn(8, 3, 3, 3), "bias": torch.randn(8)}
    outcome = reload(contract, lambda: conv.load_state_dict(state, assign=True))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(at_address(graph), state["weight"])
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_a_loaded_parameter_of_another_shape_or_dtype_is_still_respecified() -> None:
    layer = nn.Linear(4, 4)
    contract = GraphContract(layer, "recapture").seal()
    state = {"weight": torch.randn(4, 4, dtype=torch.float64), "bias": torch.randn(4)}
    outcome = reload(contract, lambda: layer.load_state_dict(state, assign=True))
    assert {(f.path, f.kind) for f in outcome.problems} == {("weight", FindingKind.RESPECIFIED)}


def test_new_values_for_a_captured_broadcast_buffer_are_respecified() -> None:
    layer = nn.Module()
    layer.register_buffer("scale", torch.ones(1, 4).expand(3, 4))
    contract = GraphContract(layer, "recapture").seal()
    outcome = reload(contract, lambda: setattr(layer, "scale", torch.randn(3, 4)))  # no copy keeps 12 values in 4
    assert {(f.path, f.kind) for f in outcome.problems} == {("scale", FindingKind.RESPECIFIED)}


def test_a_derived_slot_pwal_lays_out_anew_is_still_respecified() -> None:
    layer = nn.Linear(4, 4)
    layer.w_t = layer.weight.detach().t().contiguous()
    register_derived(layer, "w_t")
    contract = GraphContract(layer, "recapture").seal()

    def pwal() -> None:
        with torch.no_grad():
            layer.weight.add_(1)
        layer.w_t = layer.weight.detach().t()  # the same values, the bytes in another order

    outcome = reload(contract, pwal)
    assert {(f.path, f.kind) for f in outcome.problems} == {("w_t", FindingKind.RESPECIFIED)}


def test_a_parameter_bound_in_another_stride_order_commits_by_copy() -> None:
    layer = nn.Linear(6, 4)
    graph = captured_view(layer.weight)
    contract = GraphContract(layer, "strict").seal()
    new = torch.randn(6, 4).t()  # the values of a [4, 6] weight, laid out column-major
    outcome = reload(contract, lambda: setattr(layer, "weight", nn.Parameter(new, requires_grad=False)))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(at_address(graph), new) and layer.weight.stride() == (6, 1)
