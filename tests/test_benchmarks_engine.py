"""The engine-shaped benchmark model (``benchmarks/_engine.py``), tiny, on the CPU.

A benchmark that measures a broken reload is worthless, so the model the ``engine`` section times is checked here:
its forward reads every derived tensor (corrupting one changes the output), every reload under a contract commits,
keeps every graph-read tensor at its sealed address and gives the values of a cold build on the same weights, and
the section itself runs end to end (1 repeat) with its own checks.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any

import pytest
import torch

from graphsafe import GraphContract, Status

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def bench() -> tuple[Any, Any]:
    sys.path.insert(0, BENCHMARKS)
    try:
        engine = importlib.import_module("_engine")
        spec = importlib.util.spec_from_file_location("graphsafe_benchmarks_run", os.path.join(BENCHMARKS, "run.py"))
        assert spec is not None and spec.loader is not None
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
        return engine, run
    finally:
        while BENCHMARKS in sys.path:  # run.py puts its own folder on the path too
            sys.path.remove(BENCHMARKS)


CPU = torch.device("cpu")


def _x(engine: Any, tokens: int = 8) -> torch.Tensor:
    shape = engine.TINY_SHAPE
    return torch.randn(tokens, shape.hidden, generator=torch.Generator().manual_seed(11)).to(engine.DTYPE)


def test_forward_reads_every_derived_tensor(bench: tuple[Any, Any]) -> None:
    engine, _ = bench
    model = engine.build(engine.TINY_SHAPE, CPU, declare=False)
    x = _x(engine)
    with torch.no_grad():
        want = model(x)
        layer0 = [(name, t) for name, t in engine.derived(model) if name.startswith("layers.0.")]
        assert len(layer0) == 13
        for name, tensor in layer0:
            saved = tensor.clone()
            tensor.zero_()
            assert not torch.equal(model(x), want), f"the forward does not depend on {name}"
            tensor.copy_(saved)
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-model", "layerwise"])
@pytest.mark.parametrize("detect", ["declared-only", "every-reload"])
def test_reloads_commit_keep_addresses_and_equal_a_cold_build(
    bench: tuple[Any, Any], detect: str, layerwise: bool
) -> None:
    engine, _ = bench
    shape = engine.TINY_SHAPE
    model = engine.build(shape, CPU, declare=True)
    contract = GraphContract(model, "strict", detect=detect).seal()  # type: ignore[arg-type]
    # 12 parameters + 13 derived tensors + the scratch, per layer
    assert sum(1 for _ in contract.slots()) == 26 * shape.layers
    sealed = engine.graph_read(model)
    x = _x(engine)
    before = {name: t.clone() for name, t in engine.derived(model)}
    for seed in (1, 2, 3):
        weights = engine.make_weights(model, seed, CPU)
        txn = contract.reload(layerwise=layerwise)
        txn.begin()
        if layerwise:
            for layer, values in zip(model.layers, weights, strict=True):
                txn.before_layer(layer)
                engine.load_layer(layer, values, declare=True)
                txn.after_layer(layer)
        else:
            engine.load_weights(model, weights, declare=True)
        outcome = txn.finish()
        assert outcome.status is Status.COMMITTED, outcome.summary()
        assert engine.moved(model, sealed) == []
        cold = engine.build(shape, CPU, declare=False, weights=weights)
        assert engine.value_mismatches(model, cold) == []
        with torch.no_grad():
            assert torch.equal(model(x), cold(x))
    # The weights really changed: every weight-derived tensor has new values (the strides are shape-derived).
    unchanged = [n for n, t in engine.derived(model) if torch.equal(t, before[n]) and "strides" not in n]
    assert unchanged == []


def test_engine_section_runs_tiny(bench: tuple[Any, Any]) -> None:
    _, run = bench
    args = argparse.Namespace(repeats=1, engine_size="tiny", engine_layers=None)
    result = run.section_engine(args, CPU)
    assert result["all_committed"] and result["values_equal_cold_rebuild"]
    assert result["reloads_checked"] == 4 * 4  # four contract methods, 2 * repeats + 2 rounds each
    assert set(result["tracked"].values()) == {26 * 2}
    contract_rows = [r for r in result["rows"] if "tracked" in r]
    assert len(contract_rows) == 4 and all(r["goal_overhead"] in ("met", "missed") for r in contract_rows)
    assert "Engine-shaped model" in "\n".join(run.render_engine(result))
