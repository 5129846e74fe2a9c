"""Acceptance: the promises the README and the design make, checked end to end.

* the public surface of the collectors and the manifest (``import graphsafe`` is enough);
* the README's quick start runs as written and keeps its promise (addresses kept, new values delivered);
* ``examples/rl_loop.py`` (a plain-PyTorch RL loop) runs and checks its replays;
* the layerwise reload under rank agreement (``reload(layerwise=True, agreement=...)``).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe
from _ranks import on_threads
from graphsafe import (
    ContractViolation,
    GraphContract,
    RankAgreementError,
    ReloadOutcome,
    Status,
    collectors,
    graph_visible,
    report,
)
from graphsafe.adapters import torch as torch_adapter
from graphsafe.contract import AgreementGroup, StoreAgreement
from graphsafe.testing.zoo import EXAMPLES

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# Public surface


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("collect", collectors),
        ("migration_report", report),
        ("MigrationReport", report),
        ("record_capture", collectors),
        ("cuda_graph", collectors),
        ("CapturedGraph", torch_adapter),
        ("GraphRunner", torch_adapter),
        ("capture", torch_adapter),
        ("run_reload", torch_adapter),
    ],
)
def test_names_later_issues_promise_are_exported_at_top_level(name: str, home: types.ModuleType) -> None:
    assert name in graphsafe.__all__
    assert getattr(graphsafe, name) is getattr(home, name)


def test_every_public_name_of_the_adapter_is_exported_and_everything_in_all_resolves() -> None:
    assert set(torch_adapter.__all__) <= set(graphsafe.__all__)
    assert graphsafe.UndeclaredDriftError is graphsafe.errors.UndeclaredDriftError
    assert issubclass(graphsafe.UndeclaredDriftError, graphsafe.ContractViolation)
    missing = [name for name in graphsafe.__all__ if not hasattr(graphsafe, name)]
    assert missing == []


def test_every_public_callable_and_class_has_a_docstring() -> None:
    undocumented = [
        name
        for name in graphsafe.__all__
        if (callable(obj := getattr(graphsafe, name))) and not (getattr(obj, "__doc__", None) or "").strip()
    ]
    assert undocumented == []


# ----------------------------------------------------------------------------------------------------------------
# README quick start, executed as written (only the names it leaves to the reader are stubbed)


class _Kernel:
    workspace: torch.Tensor | None = None


def _make_workspace(layer: nn.Module) -> torch.Tensor:
    # Derived from the weights, so a reload with other weights changes the values.
    return (layer.weight.detach().sum(dim=0) * 3).to(torch.float32)


class _Layer(nn.Module):
    def __init__(self, method: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.g_idx = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.quant_method = method
        method.kernel = _Kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws = self.quant_method.kernel.workspace
        return x @ self.weight + ws + self.g_idx_sort_indices.to(x.dtype)


class _Model(nn.Module):
    def __init__(self, method_cls: type) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(method_cls()), _Layer(method_cls())])

    def load_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(4, 4, generator=generator))
                layer.g_idx.copy_(torch.randn(4, generator=generator))
                layer.quant_method.process_weights_after_loading(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# The README's own blocks run as written in tests/test_doc_blocks.py (they assert the addresses they promise).


def test_the_readme_quick_start_would_fail_if_pwal_moved_an_undeclared_tensor() -> None:
    # Negative twin: the same model with nothing declared drifts, so the README's promise is not vacuous.
    class Undeclared:
        def process_weights_after_loading(self, layer: nn.Module) -> None:
            layer.quant_method.kernel.workspace = _make_workspace(layer)
            layer.g_idx_sort_indices = torch.argsort(layer.g_idx)

    model = _Model(Undeclared)
    model.load_weights(0)
    contract = GraphContract(model, mode="strict").seal()
    with pytest.raises(graphsafe.UndeclaredDriftError) as info, contract.reload():
        model.load_weights(1)
    assert info.value.outcome is not None
    assert {f.path for f in info.value.outcome.problems} == {"quant_method.kernel.workspace", "g_idx_sort_indices"}


# ----------------------------------------------------------------------------------------------------------------
# examples/rl_loop.py


def test_rl_loop_example_runs_and_every_replay_equals_eager() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all replays equal eager" in result.stdout
    rows = [line for line in result.stdout.splitlines() if " steps=2 " in line]
    assert len(rows) == 2 * len(EXAMPLES)
    assert all(row.rstrip().split()[-2] == "OK" for row in rows), result.stdout


# ----------------------------------------------------------------------------------------------------------------
# Layerwise reload under rank agreement


class _Shard(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ShardLayer(), _ShardLayer()])
        self.rank = rank


class _ShardLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    @graph_visible("weight_t")
    def process_weights_after_loading(self, fault: str | None = None) -> None:
        if fault == "raise":
            raise ValueError("layer shard is corrupt")
        self.weight_t = self.weight.detach().t().contiguous()
        if fault == "undeclared" or not hasattr(self, "scratch"):
            self.scratch = torch.zeros(8)  # undeclared: a new tensor is drift


def _layerwise_reload(
    contract: GraphContract, model: _Shard, group: AgreementGroup, seed: int, fault: str | None
) -> BaseException | None:
    generator = torch.Generator().manual_seed(seed)
    try:
        with contract.reload(layerwise=True, agreement=StoreAgreement(group, 10)) as txn:
            for index, layer in enumerate(model.layers):
                txn.before_layer(layer)
                with torch.no_grad():
                    layer.weight.copy_(torch.randn(4, 4, generator=generator))
                layer.process_weights_after_loading(fault=fault if index == 1 else None)
                txn.after_layer(layer)
    except Exception as exc:
        return exc
    return None


def _shard(rank: int, mode: str) -> tuple[_Shard, GraphContract]:
    model = _Shard(rank)
    generator = torch.Generator().manual_seed(rank)
    contract = GraphContract(model, mode)  # type: ignore[arg-type]
    # Recorded: the contract learns that PWAL makes the undeclared scratch from nothing (static, not stale).
    with contract.record_inputs(), torch.no_grad():
        for layer in model.layers:
            layer.weight.copy_(torch.randn(4, 4, generator=generator))
            layer.process_weights_after_loading()
    return model, contract.seal()


@pytest.mark.timeout(60)
def test_layerwise_drift_on_one_rank_recaptures_every_rank() -> None:
    def run(group: AgreementGroup) -> tuple[BaseException | None, Status, list[ReloadOutcome], bool, bool]:
        model, contract = _shard(group.rank, "recapture")
        calls: list[ReloadOutcome] = []
        contract.on_recapture(calls.append)
        captured = [layer.weight_t.data_ptr() for layer in model.layers]
        fault = "undeclared" if group.rank == 2 else None
        error = _layerwise_reload(contract, model, group, seed=10 + group.rank, fault=fault)
        assert contract.last_outcome is not None
        kept = [layer.weight_t.data_ptr() for layer in model.layers] == captured
        return error, contract.last_outcome.status, calls, kept, contract.serving_safe

    results = on_threads(3, run)
    for rank, (error, status, calls, kept, safe) in enumerate(results):
        assert error is None, (rank, error)
        assert status is Status.NEEDS_RECAPTURE, rank
        assert len(calls) == 1, f"rank {rank}: on_recapture ran {len(calls)} time(s)"
        assert kept and safe
        remote = [f for f in calls[0].findings if f.rank == 2] if rank != 2 else []
        if rank != 2:
            assert remote and all(f.path == "scratch" for f in remote), calls[0].findings


@pytest.mark.timeout(60)
def test_layerwise_clean_reload_commits_on_every_rank() -> None:
    def run(group: AgreementGroup) -> tuple[BaseException | None, Status | None]:
        model, contract = _shard(group.rank, "strict")
        error = _layerwise_reload(contract, model, group, seed=10 + group.rank, fault=None)
        return error, contract.last_outcome.status if contract.last_outcome else None

    assert on_threads(2, run) == [(None, Status.COMMITTED), (None, Status.COMMITTED)]


@pytest.mark.timeout(60)
def test_layerwise_error_on_one_rank_fails_every_rank_naming_it() -> None:
    def run(group: AgreementGroup) -> tuple[BaseException | None, bool]:
        model, contract = _shard(group.rank, "migrate")
        fault = "raise" if group.rank == 1 else None
        error = _layerwise_reload(contract, model, group, seed=10 + group.rank, fault=fault)
        assert contract.last_outcome is not None and contract.last_outcome.status is Status.FAILED
        return error, contract.serving_safe

    (error0, safe0), (error1, safe1) = on_threads(2, run)
    assert isinstance(error1, ValueError) and str(error1) == "layer shard is corrupt"  # its own error, untouched
    assert isinstance(error0, RankAgreementError) and isinstance(error0, ContractViolation)
    assert "because of rank(s) 1," in str(error0) and "layer shard is corrupt" in str(error0)
    assert not safe0 and not safe1


# ----------------------------------------------------------------------------------------------------------------
# Walker: streams, events and graphs are leaves (tests/collectors/test_walker.py covers the rest)


def test_the_walker_never_enters_streams_events_or_graphs() -> None:
    class Graph(torch.cuda.CUDAGraph):
        pass

    class CudaStream(torch.cuda.Stream):
        pass

    class Stream(torch.Stream):
        pass

    class Event(torch.Event):
        pass

    class Plain:
        pass

    layer = nn.Linear(2, 2)
    # Subclass instances can carry a tensor in their __dict__: the walker must still not look inside.
    # (object.__new__: the CUDA classes are placeholders that refuse a normal construction on a CPU build.)
    leaves = {
        "graph": object.__new__(Graph),
        "cuda_stream": object.__new__(CudaStream),
        "stream": Stream(device="cpu"),
        "event": Event(device="cpu"),
    }
    for name, leaf in leaves.items():
        leaf.planted = torch.ones(2)
        setattr(layer, name, leaf)
    layer.plain = Plain()
    layer.plain.planted = torch.ones(2)  # the positive control: the same tensor on a plain object is found
    assert [ref.path for ref in graphsafe.collect(layer)] == ["plain.planted"]
