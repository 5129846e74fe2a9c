"""Compiled models and engines that capture no graphs: what the walker leaves opaque, and what the
contract decides when no captured graph replays the model."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from graphsafe import GraphContract
from graphsafe.collectors import walk
from graphsafe.devices import WalkBudget
from graphsafe.errors import UndeclaredDriftError


class Compiled(nn.Module):
    """Holds its compiled forward the way vLLM's compilation wrapper does (``_compiled_callable``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w_t = self.proj.weight.detach().t().contiguous()  # a derived tensor the forward reads
        self._compiled_callable = torch.compile(self.forward, fullgraph=True, backend="eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self.w_t

    def rebuild(self) -> None:
        """A post-load step: the derived tensor is made again as a new object."""
        self.w_t = self.proj.weight.detach().t().contiguous()


@pytest.fixture(scope="module")
def compiled() -> Compiled:
    torch.manual_seed(0)
    model = Compiled()
    model._compiled_callable(torch.randn(2, 8))  # dynamo's caches, guards and backend now hang off the callable
    return model


def test_compiled_artifacts_are_opaque_and_the_modules_own_tensors_are_walked(compiled: Compiled) -> None:
    result = walk(compiled, budget=WalkBudget(max_depth=4))
    assert result.exhausted is None, result.exhausted  # the depth budget is not spent inside dynamo's objects
    assert [ref.path for ref in result.refs] == ["w_t"]


def test_a_reload_of_an_unchanged_compiled_model_commits_in_strict(compiled: Compiled) -> None:
    contract = GraphContract(compiled, mode="strict", budget=WalkBudget(max_depth=4)).seal()
    with contract.reload(), torch.no_grad():
        compiled.proj.weight.copy_(torch.randn_like(compiled.proj.weight))  # new weights, loaded in place
        compiled.w_t.copy_(compiled.proj.weight.t())  # its post-load step, in place
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert contract.serving_safe


def _drifting() -> tuple[Compiled, GraphContract]:
    model = Compiled()
    return model, GraphContract(model, mode="strict").seal()


def test_with_no_graphs_drift_commits_and_with_graphs_strict_still_raises() -> None:
    model, contract = _drifting()
    contract.graphless = lambda: "no graph captured here"
    with contract.reload():
        model.rebuild()
    assert contract.last_outcome is not None and contract.last_outcome.committed
    assert contract.serving_safe and contract.last_outcome.problems, "the finding is kept, but nothing replays"
    contract.graphless = lambda: None  # graphs were captured: the same drift fails closed
    with pytest.raises(UndeclaredDriftError), contract.reload():
        model.rebuild()
    assert not contract.serving_safe


def test_with_no_graphs_a_reload_that_raised_still_fails() -> None:
    _, contract = _drifting()
    contract.graphless = lambda: "no graph captured here"
    with pytest.raises(OSError), contract.reload():
        raise OSError("shard vanished")
    assert contract.last_outcome is not None and contract.last_outcome.status.value == "failed"


class _Deep:
    def __init__(self, depth: int) -> None:
        self.next = _Deep(depth - 1) if depth else torch.zeros(2)

    def hook(self) -> None: ...


def test_a_hook_handle_is_opaque() -> None:
    """vLLM's compiled model keeps dynamo's bytecode-hook handle, whose weak reference leads into dynamo's hook
    registry: a handle is not walked (the hooks it removes are read where they are registered)."""
    model = nn.Linear(2, 2)
    registry = collections.OrderedDict({0: _Deep(12).hook})  # weakly referenced, as torch does
    model._bytecode_hook_handle = torch.utils.hooks.RemovableHandle(registry)
    result = walk(model, budget=WalkBudget(max_depth=6))
    assert result.exhausted is None, result.exhausted
    assert result.refs == ()
