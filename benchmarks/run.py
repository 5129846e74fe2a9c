"""Reload cost of graphsafe against the alternatives, side by side in one run.

    PYTHONPATH=src python3 benchmarks/run.py                      # CPU
    PYTHONPATH=src python3 benchmarks/run.py --device cuda --json out.json

Synthetic models of N layers x k derived tensors (int32 workspaces, int64 strides, fp32 scales, bf16 transposed
weights; see ``_models.py``) are reloaded with DIFFERENT weights each time, by:

* ``baseline``: the upstream reload, no contract (in-place parameter copy, then PWAL makes new derived tensors);
* ``per-slot loop``: the baseline, then for every slot ``old.copy_(new)`` and a setattr back (what an upstream
  collector does);
* ``graphsafe <detect>``: the baseline inside ``with contract.reload():`` (PWAL also re-declares its slots), for
  ``declared-only``, ``sealed-paths`` and ``every-reload``;
* on CUDA: re-capturing a graph set (8 batch sizes) instead.

The ``engine`` section reloads an engine-shaped model (``_engine.py``: 32 layers of MLA attention with an fp8
``o_proj``, a MoE kernel-args object, a partial with bound tensors and a ``stable_empty`` scratch) from pinned
host memory and from the device, whole-model and layer by layer, checks every reload (COMMITTED, every
graph-read address kept, values equal to a no-contract model's, graph replays equal to eager on CUDA) and compares
with re-capturing a graph set of 6 batch sizes.

Timings are medians over repeats, methods interleaved round-robin so that machine noise hits them alike. Prints
markdown; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _engine
from _models import (
    KINDS,
    DenseMoEModel,
    MoEModel,
    Shape,
    SynthModel,
    assign_derived,
    build,
    load_weights,
    make_weights,
    read_derived,
)
from _timing import copy_threshold, flat_copy_time, machine, med, sync

from graphsafe import GraphContract, Status
from graphsafe.collectors import walk

POLICIES = ("declared-only", "sealed-paths", "every-reload")


# -- one method = one model reloaded one way ---------------------------------------------------------------------


class Method:
    """A model and a way to reload it; ``cycle`` returns times (seconds) of one reload.

    With ``split`` the device is synchronised between the load and the restore, so that the restore can be timed
    alone (``restore``: wall, ``restore_host``: before the final sync); without, the whole ``cycle`` is timed as an
    engine would run it (one sync at the end).
    """

    name: str
    model: SynthModel

    def cycle(self, weights: list[torch.Tensor], split: bool = False) -> dict[str, float]:
        raise NotImplementedError


class Baseline(Method):
    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.name = "baseline (no contract)"
        self.model = build(shape, device, declare=False)
        self.device = device

    def cycle(self, weights: list[torch.Tensor], split: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        load_weights(self.model, weights, declare=False)
        sync(self.device)
        if split:
            return {"restore": 0.0, "restore_host": 0.0}
        return {"cycle": time.perf_counter() - t0}


class Loop(Method):
    """The upstream collector: remember the captured tensors, then copy each new one in and setattr it back."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.name = "per-slot loop"
        self.model = build(shape, device, declare=False)
        self.device = device
        self.targets = [(layer, i, read_derived(layer, i)) for layer in self.model.layers for i in range(shape.k)]
        self.bytes = sum(t.numel() * t.element_size() for _, _, t in self.targets)

    def cycle(self, weights: list[torch.Tensor], split: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        load_weights(self.model, weights, declare=False)
        if split:
            sync(self.device)
        t1 = time.perf_counter()
        with torch.no_grad():
            for layer, i, old in self.targets:
                old.copy_(read_derived(layer, i))
                assign_derived(layer, i, old)
        t2 = time.perf_counter()
        sync(self.device)
        t3 = time.perf_counter()
        if split:
            return {"restore": t3 - t1, "restore_host": t2 - t1, "begin": 0.0, "finish": t3 - t1}
        return {"cycle": t3 - t0}


class Contract(Method):
    """The baseline reload inside a graphsafe transaction (whole model, or layer by layer)."""

    def __init__(
        self,
        shape: Shape,
        device: torch.device,
        detect: str,
        layerwise: bool = False,
        label: str = "",
        fast_tier: bool = True,
    ) -> None:
        label += "" if fast_tier else ", rule engine only"
        self.name = f"graphsafe {detect}" + (" layerwise" if layerwise else "") + label
        self.model = build(shape, device, declare=True)
        self.device = device
        self.layerwise = layerwise
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.contract = GraphContract(self.model, "strict", detect=detect)  # type: ignore[arg-type]
        self.contract.fast_tier = fast_tier  # off: every restore step through the rule engine (the A/B)
        self.contract.seal()
        self.seal_bytes = (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) - before
        self.slots = sum(1 for _ in self.contract.slots())
        self.last_bytes = 0

    def cycle(self, weights: list[torch.Tensor], split: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        txn = self.contract.reload(layerwise=self.layerwise)
        txn.begin()
        t1 = time.perf_counter()
        if self.layerwise:
            with torch.no_grad():
                for layer, w in zip(self.model.layers, weights, strict=True):
                    txn.before_layer(layer)
                    layer.weight.copy_(w, non_blocking=True)
                    layer.process_weights_after_loading(True)
                    txn.after_layer(layer)
        else:
            load_weights(self.model, weights, declare=True)
        if split:
            sync(self.device)
        t2 = time.perf_counter()
        outcome = txn.finish()
        t3 = time.perf_counter()
        sync(self.device)
        t4 = time.perf_counter()
        if outcome.status is not Status.COMMITTED:
            raise SystemExit(f"{self.name}: reload not committed:\n{outcome.summary()}")
        self.last_bytes = outcome.bytes_copied
        if not split:
            return {"cycle": t4 - t0}
        if self.layerwise:  # restores ran inside the loop: the transaction's own time is the best split
            return {"restore": outcome.seconds, "restore_host": outcome.seconds}
        return {
            "restore": (t1 - t0) + (t4 - t2),
            "restore_host": (t1 - t0) + (t3 - t2),
            "begin": t1 - t0,  # snapshot, before the load
            "finish": t4 - t2,  # restore, copies and verification, to the end of the copies
        }


def run_methods(
    methods: list[Method], weights: list[list[torch.Tensor]], repeats: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Interleave the methods' reloads (alternating weight sets) and return median phase times per method."""
    samples: dict[str, dict[str, list[float]]] = {m.name: {} for m in methods}
    for round_ in range(2 * repeats + 2):  # even rounds time whole cycles, odd rounds the restore alone
        for method in methods:
            times = method.cycle(weights[round_ % len(weights)], split=bool(round_ % 2))
            if round_ < 2:
                continue  # warm-up
            for key, value in times.items():
                samples[method.name].setdefault(key, []).append(value)
    out = {name: {key: med(vals) for key, vals in phases.items()} for name, phases in samples.items()}
    if device.type == "cuda":
        for method in methods:  # memory of one more reload: peak above the start, and what stays allocated
            gc.collect()
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            method.cycle(weights[0])
            sync(device)
            out[method.name]["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - start
            out[method.name]["kept_bytes"] = torch.cuda.memory_allocated(device) - start
    return out


def check_same_values(a: SynthModel, b: SynthModel) -> bool:
    """Whether two models loaded with the same weights hold the same derived values (the contract copies right)."""
    return all(
        torch.equal(read_derived(la, i), read_derived(lb, i))
        for la, lb in zip(a.layers, b.layers, strict=True)
        for i in range(a.shape.k)
    )


# -- sections ------------------------------------------------------------------------------------------------------


def section_small(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """10,000 small declared slots: restore speed against the per-slot loop."""
    shape = Shape("small", args.small_layers, args.small_k, 32, 32)
    methods: list[Method] = [Baseline(shape, device), Loop(shape, device)]
    methods += [Contract(shape, device, detect) for detect in POLICIES]
    methods.append(Contract(shape, device, "declared-only", fast_tier=False))
    inplace = Shape("small-inplace", shape.layers, shape.k, 32, 32, inplace=True)
    methods.append(Contract(inplace, device, "declared-only", label=", PWAL writes in place"))
    weights = [make_weights(methods[0].model, seed, device) for seed in (1, 2)]
    times = run_methods(methods, weights, args.repeats, device)
    load_weights(methods[0].model, weights[0], declare=False)
    contracts = [m for m in methods if isinstance(m, Contract)]
    for m in contracts:
        m.cycle(weights[0])
    same = all(check_same_values(methods[0].model, m.model) for m in contracts)
    loop_bytes = methods[1].bytes  # type: ignore[attr-defined]
    flat = flat_copy_time(loop_bytes, device, args.repeats)
    rows = []
    base = times[methods[0].name]["cycle"]
    loop_restore = times[methods[1].name]["restore"]
    for m in methods:
        t = times[m.name]
        row = {
            "method": m.name,
            "slots": shape.slots,
            "cycle_ms": t["cycle"] * 1e3,
            "overhead_pct": (t["cycle"] - base) / base * 100,
            "restore_ms": t["restore"] * 1e3,
            "restore_us_per_slot": t["restore"] / shape.slots * 1e6,
            "host_us_per_slot": t["restore_host"] / shape.slots * 1e6,
            "vs_loop": loop_restore / t["restore"] if t["restore"] else None,
            "GBps": loop_bytes / t["restore"] / 1e9 if t["restore"] else None,
            "vs_flat_copy": flat / t["restore"] if t["restore"] else None,
            "begin_us_per_slot": t["begin"] / shape.slots * 1e6 if "begin" in t else None,
            "finish_us_per_slot": t["finish"] / shape.slots * 1e6 if "finish" in t else None,
        }
        for key in ("peak_extra_bytes", "kept_bytes"):
            if key in t:
                row[key] = t[key]
        if isinstance(m, Contract):
            row["seal_bytes"] = m.seal_bytes
        rows.append(row)
    decl = section_declare_cost(shape, device, args.repeats)
    return {
        "shape": shape.__dict__,
        "bytes": loop_bytes,
        "flat_copy_ms": flat * 1e3,
        "values_equal": same,
        "rows": rows,
        "redeclare_us_per_slot": decl,
    }


def section_declare_cost(shape: Shape, device: torch.device, repeats: int) -> float:
    """What re-declaring (register_derived in PWAL) adds per slot, outside any transaction."""
    model = build(shape, device, declare=True)
    samples = {True: [], False: []}  # type: dict[bool, list[float]]
    for round_ in range(repeats + 1):
        for declare in (False, True):
            t0 = time.perf_counter()
            for layer in model.layers:
                layer.process_weights_after_loading(declare)
            sync(device)
            if round_:
                samples[declare].append(time.perf_counter() - t0)
    return (med(samples[True]) - med(samples[False])) / shape.slots * 1e6


def section_large(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A few large derived tensors: restore bandwidth against one flat copy_ of the same bytes."""
    side = 4096 if device.type == "cuda" else 1024
    shape = Shape("large", 8, 2, side, side, kinds=("transposed",))
    methods: list[Method] = [
        Baseline(shape, device),
        Loop(shape, device),
        Contract(shape, device, "declared-only"),
        Contract(shape, device, "declared-only", fast_tier=False),
    ]
    weights = [make_weights(methods[0].model, seed, device) for seed in (1, 2)]
    times = run_methods(methods, weights, args.repeats, device)
    nbytes = methods[1].bytes  # type: ignore[attr-defined]
    flat = flat_copy_time(nbytes, device, args.repeats)
    rows = []
    for m in methods[1:]:
        t, finish = times[m.name]["restore"], times[m.name]["finish"]
        rows.append(
            {
                "method": m.name,
                "restore_ms": t * 1e3,
                "GBps": nbytes / t / 1e9,
                "vs_flat_copy": flat / t,
                "finish_ms": finish * 1e3,
                "finish_vs_flat_copy": flat / finish,
            }
        )
    return {
        "shape": shape.__dict__,
        "bytes": nbytes,
        "flat_copy_ms": flat * 1e3,
        "flat_GBps": nbytes / flat / 1e9,
        "rows": rows,
    }


def section_cycle(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Whole reload cycles of a ~1 GB (bf16 weights) model: overhead over the baseline, and device memory."""
    if device.type == "cuda":
        layers, side = 32, 4096  # 32 x 32 MiB = 1 GiB of weights
    else:
        layers, side = 8, 1024  # CPU: 16 MiB of weights (the GPU run has the 1 GB figure)
    results = []
    sources = ("device", "host") if device.type == "cuda" else ("host",)
    for label, kinds, k in (("heavy", KINDS, 4), ("light", ("workspace", "strides", "scales"), 3)):
        shape = Shape(f"cycle-{label}", layers, k, side, side, kinds=kinds)
        methods: list[Method] = [
            Baseline(shape, device),
            Contract(shape, device, "declared-only"),
            Contract(shape, device, "declared-only", layerwise=True),
        ]
        for source in sources:
            where = device if source == "device" else torch.device("cpu")
            weights = [make_weights(methods[0].model, seed, where) for seed in (1, 2)]
            times = run_methods(methods, weights, args.repeats, device)
            base = times[methods[0].name]["cycle"]
            for m in methods:
                t = times[m.name]
                results.append(
                    {
                        "derived": label,
                        "source": source,
                        "method": m.name,
                        "weights_MiB": layers * side * side * 2 / 2**20,
                        "derived_MiB": (m.last_bytes if isinstance(m, Contract) else 0) / 2**20,
                        "cycle_ms": t["cycle"] * 1e3,
                        "overhead_pct": (t["cycle"] - base) / base * 100,
                        "restore_ms": t["restore"] * 1e3,
                        **{key: t[key] for key in ("peak_extra_bytes", "kept_bytes") if key in t},
                        **({"seal_bytes": m.seal_bytes} if isinstance(m, Contract) else {}),
                    }
                )
            del weights
        del methods
        gc.collect()
    return {"rows": results}


def section_recapture(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Re-capturing a graph set (8 batch sizes) vs a contract reload, and replay == eager after the reload."""
    out = []
    for name, shape in (
        ("small", Shape("small", args.small_layers, args.small_k, 32, 32)),
        ("1GB", Shape("cycle-heavy", 32, 4, 4096, 4096)),
    ):
        method = Contract(shape, device, "declared-only")
        model = method.model
        width = shape.cols
        sizes = (1, 2, 4, 8, 16, 32, 64, 128)
        inputs = {b: torch.randn(b, width, device=device, dtype=torch.bfloat16) for b in sizes}
        graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        capture = _capture_all(model, inputs, graphs, device)
        samples = []
        for _ in range(max(2, args.repeats // 4) + 1):
            t0 = time.perf_counter()
            capture()
            samples.append(time.perf_counter() - t0)
        recapture = med(samples[1:])
        weights = [make_weights(model, seed, device) for seed in (1, 2)]
        restores = []
        for round_ in range(max(3, args.repeats // 2)):
            restores.append(method.cycle(weights[round_ % 2], split=True)["restore"])
        restore = med(restores)
        graph, y = graphs[8]
        graph.replay()
        with torch.no_grad():
            eager = model(inputs[8])
        out.append(
            {
                "model": name,
                "graphs": len(sizes),
                "recapture_ms": recapture * 1e3,
                "contract_restore_ms": restore * 1e3,
                "ratio": recapture / restore,
                "replay_equals_eager": bool(torch.equal(y, eager)),
                "replay_max_abs_diff": float((y.float() - eager.float()).abs().max()),
            }
        )
        graphs.clear()
        gc.collect()
        torch.cuda.empty_cache()
    return {"rows": out}


def _capture_all(
    model: SynthModel,
    inputs: dict[int, torch.Tensor],
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]],
    device: torch.device,
) -> Callable[[], None]:
    """A function that (re)captures one graph per batch size, as an engine does after a reload it cannot keep.

    Each recapture gets a fresh memory pool shared by its graphs: re-using the handle of graphs already freed
    trips an allocator assertion in torch 2.11 (``use_count > 0``, CUDACachingAllocator.cpp).
    """

    def capture() -> None:
        graphs.clear()
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for b, x in inputs.items():
                model(x)  # warm-up, as engines do before each capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    y = model(x)
                graphs[b] = (graph, y)
        sync(device)

    return capture


def section_walker(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The walker over every module of a model (what a seal does; every-reload does it per reload)."""
    rows = []
    for name, model in (
        ("MoE-like 64 layers x 64 experts", MoEModel(64, 64, device)),
        ("tensor-dense MoE 64 layers x 64 experts x 3 tensors", DenseMoEModel(64, 64, device)),
        (
            f"synthetic {args.small_layers} x {args.small_k}",
            build(Shape("s", args.small_layers, args.small_k, 32, 32), device, declare=False),
        ),
    ):
        modules = [m for _, m in model.named_modules()]
        samples = []
        results: list[Any] = []
        for round_ in range(args.repeats + 1):
            t0 = time.perf_counter()
            results = [walk(m) for m in modules]
            if round_:
                samples.append(time.perf_counter() - t0)
        t = med(samples)
        objects = sum(r.objects_visited for r in results)
        refs = sum(len(r.refs) for r in results)
        # What detect="every-reload" walks per reload: every sealed path skipped (no ref, no fingerprint).
        known = [frozenset(ref.path for ref in r.refs) for r in results]
        reload_samples = []
        for round_ in range(args.repeats + 1):
            t0 = time.perf_counter()
            for m, skip in zip(modules, known, strict=True):
                walk(m, skip_paths=skip)
            if round_:
                reload_samples.append(time.perf_counter() - t0)
        t_reload = med(reload_samples)
        rows.append(
            {
                "model": name,
                "modules": len(modules),
                "objects": objects,
                "tensor_refs": refs,
                "walk_ms": t * 1e3,
                "objects_per_s": objects / t,
                "refs_per_s": refs / t,
                "reload_walk_ms": t_reload * 1e3,
                "reload_objects_per_s": objects / t_reload,
            }
        )
    return {"rows": rows}


# -- the engine-shaped model ----------------------------------------------------------------------------------------

ENGINE_BATCHES = (1, 2, 4, 8, 16, 32)


class EngineCheckFailed(RuntimeError):
    """A graphsafe reload of the engine model did not commit, or committed and is wrong: the section stops."""


class EngineMethod:
    """One engine-shaped model reloaded one way; ``cycle`` as :class:`Method`, ``verify`` checks the reload."""

    name: str
    model: _engine.EngineModel
    slots: int | None = None
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]

    def __init__(
        self, shape: _engine.EngineShape, device: torch.device, initial: list[list[torch.Tensor]], declare: bool
    ) -> None:
        self.device = device
        self.model = _engine.build(shape, device, declare=declare, weights=initial)
        self.graphs = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.capture: Callable[[], None] | None = None
        self.outcome_seconds: list[float] = []
        self.inexact = 0  # replays close to eager but not bitwise equal

    def cycle(self, weights: list[list[torch.Tensor]], split: bool = False) -> dict[str, float]:
        raise NotImplementedError

    def capture_graphs(self, batches: tuple[int, ...]) -> None:
        """On CUDA: one graph per batch size, captured as an engine does (warm-up, then capture; one pool)."""
        if self.device.type != "cuda":
            return
        width = self.model.shape.hidden
        self.inputs = {b: torch.randn(b, width, device=self.device, dtype=_engine.DTYPE) for b in batches}
        self.capture = _capture_all(self.model, self.inputs, self.graphs, self.device)  # type: ignore[arg-type]
        self.capture()

    def check_replay(self, seed: int) -> float:
        """Replay every graph on new inputs and compare with the eager forward; returns the largest |difference|
        (0.0: bitwise equal). Raises when a replay is not even close: a benchmark of a broken reload is worthless."""
        worst = 0.0
        if not self.graphs:
            return worst
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for b, (graph, y) in self.graphs.items():
                x = self.inputs[b]
                x.copy_(torch.randn(tuple(x.shape), generator=gen).to(x.dtype))
                graph.replay()
                eager = self.model(x)
                if not torch.equal(y, eager):
                    diff = float((y.float() - eager.float()).abs().max())
                    scale = float(eager.float().abs().max())
                    if not diff <= 1e-2 * max(scale, 1.0):
                        raise EngineCheckFailed(
                            f"{self.name}: replay of the batch-{b} graph differs from eager after a "
                            f"reload (max |diff| {diff:.3g}, max |y| {scale:.3g})"
                        )
                    worst = max(worst, diff)
                    self.inexact += 1
        return worst


class EngineBaseline(EngineMethod):
    """The upstream reload, no contract: load into the parameters, then PWAL (no declarations)."""

    def __init__(
        self, shape: _engine.EngineShape, device: torch.device, initial: list[list[torch.Tensor]], declare: bool = False
    ) -> None:
        super().__init__(shape, device, initial, declare=declare)
        self.declare = declare
        self.name = "baseline, PWAL declares (no contract)" if declare else "baseline (no contract)"

    def cycle(self, weights: list[list[torch.Tensor]], split: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        _engine.load_weights(self.model, weights, declare=self.declare)
        sync(self.device)
        if split:
            return {"restore": 0.0}
        return {"cycle": time.perf_counter() - t0}


class EngineRecapture(EngineMethod):
    """No contract: load + PWAL, then re-capture the whole graph set (what an engine does without graphsafe)."""

    def __init__(
        self,
        shape: _engine.EngineShape,
        device: torch.device,
        initial: list[list[torch.Tensor]],
        batches: tuple[int, ...],
    ) -> None:
        super().__init__(shape, device, initial, declare=False)
        self.name = f"recapture {len(batches)} graphs (no contract)"
        self.capture_graphs(batches)

    def cycle(self, weights: list[list[torch.Tensor]], split: bool = False) -> dict[str, float]:
        assert self.capture is not None
        t0 = time.perf_counter()
        _engine.load_weights(self.model, weights, declare=False)
        sync(self.device)
        t1 = time.perf_counter()
        self.capture()
        t2 = time.perf_counter()
        return {"restore": t2 - t1} if split else {"cycle": t2 - t0}

    def verify(self, reference: _engine.EngineModel, seed: int) -> float:
        return self.check_replay(seed)


class EngineContract(EngineMethod):
    """The baseline reload inside a graphsafe transaction, whole model or layer by layer; PWAL declares."""

    def __init__(
        self,
        shape: _engine.EngineShape,
        device: torch.device,
        initial: list[list[torch.Tensor]],
        detect: str,
        layerwise: bool,
        batches: tuple[int, ...],
        fast_tier: bool = True,
    ) -> None:
        super().__init__(shape, device, initial, declare=True)
        self.name = f"graphsafe {detect}" + (" layerwise" if layerwise else " whole-model")
        self.name += "" if fast_tier else ", rule engine only"
        self.layerwise = layerwise
        # Seal after the first load, before capture (as an engine does); then capture the graph set.
        self.contract = GraphContract(self.model, "strict", detect=detect)  # type: ignore[arg-type]
        self.contract.fast_tier = fast_tier  # off: every restore step through the rule engine (the A/B)
        self.contract.seal()
        self.slots = sum(1 for _ in self.contract.slots())
        self.capture_graphs(batches)
        if self.graphs:
            self.contract.note_capture()
        self.sealed = _engine.graph_read(self.model)
        self.last_bytes = 0

    def cycle(self, weights: list[list[torch.Tensor]], split: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        txn = self.contract.reload(layerwise=self.layerwise)
        txn.begin()
        t1 = time.perf_counter()
        if self.layerwise:
            for layer, values in zip(self.model.layers, weights, strict=True):
                txn.before_layer(layer)
                _engine.load_layer(layer, values, declare=True)  # type: ignore[arg-type]
                txn.after_layer(layer)
        else:
            _engine.load_weights(self.model, weights, declare=True)
        if split:
            sync(self.device)
        t2 = time.perf_counter()
        outcome = txn.finish()
        sync(self.device)
        t3 = time.perf_counter()
        if outcome.status is not Status.COMMITTED:
            raise EngineCheckFailed(f"{self.name}: reload not committed:\n{outcome.summary()}")
        self.last_bytes = outcome.bytes_copied
        self.outcome_seconds.append(outcome.seconds)
        if not split:
            return {"cycle": t3 - t0}
        if self.layerwise:  # restores ran inside the loop: the transaction's own time is the best split
            return {"restore": outcome.seconds}
        # begin (snapshot) + finish (restore, verify, to the end of the copies)
        return {"restore": (t1 - t0) + (t3 - t2), "begin": t1 - t0, "finish": t3 - t2}

    def verify(self, reference: _engine.EngineModel, seed: int) -> float:
        """Address identity (every graph-read tensor where it was sealed), values equal to a model without a
        contract loaded with the same weights, and on CUDA every graph replay equal to the eager forward."""
        moved = _engine.moved(self.model, self.sealed)
        if moved:
            raise EngineCheckFailed(f"{self.name}: COMMITTED, but {len(moved)} graph-read tensor(s) moved: {moved[:5]}")
        wrong = _engine.value_mismatches(self.model, reference)
        if wrong:
            raise EngineCheckFailed(
                f"{self.name}: COMMITTED, but {len(wrong)} derived tensor(s) differ from the "
                f"no-contract model's: {wrong[:5]}"
            )
        return self.check_replay(seed)


def engine_shape(args: argparse.Namespace, device: torch.device) -> _engine.EngineShape:
    size = args.engine_size or ("full" if device.type == "cuda" else "cpu")
    shape = {"full": _engine.CUDA_SHAPE, "cpu": _engine.CPU_SHAPE, "tiny": _engine.TINY_SHAPE}[size]
    if args.engine_layers:
        shape = dataclasses.replace(shape, layers=args.engine_layers)
    return shape


def section_engine(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """An engine-shaped model (MLA, fp8 linear, MoE kernel args, partial, stable scratch): load overhead of the
    contract, per tracked tensor and as a % of the load, and recapturing the graph set instead (CUDA)."""
    shape = engine_shape(args, device)
    batches = tuple(b for b in ENGINE_BATCHES if b <= shape.max_tokens) if device.type == "cuda" else ()
    sources = ("host", "device") if device.type == "cuda" else ("host",)
    template = _engine.EngineModel(shape, torch.device("meta"))
    initial = _engine.make_weights(template, 0, device)
    methods: list[EngineMethod] = [EngineBaseline(shape, device, initial)]
    methods += [
        EngineBaseline(shape, device, initial, declare=True),  # what re-declaring in PWAL costs alone
        EngineContract(shape, device, initial, "declared-only", False, batches),
        EngineContract(shape, device, initial, "declared-only", False, batches, fast_tier=False),
        EngineContract(shape, device, initial, "declared-only", True, batches),
        EngineContract(shape, device, initial, "every-reload", False, batches),
    ]
    if device.type == "cuda":
        methods.append(EngineRecapture(shape, device, initial, batches))
    del initial
    baseline = methods[0].model
    rows: list[dict[str, Any]] = []
    checks = {"reloads_checked": 0, "replays_checked": 0, "replay_max_abs_diff": 0.0}
    for source in sources:
        where = device if source == "device" else torch.device("cpu")
        weights = [_engine.make_weights(template, seed, where) for seed in (1, 2)]
        samples: dict[str, dict[str, list[float]]] = {m.name: {} for m in methods}
        for m in methods:
            m.outcome_seconds.clear()
        for round_ in range(2 * args.repeats + 2):  # even rounds time whole cycles, odd rounds the contract alone
            for m in methods:
                times = m.cycle(weights[round_ % 2], split=bool(round_ % 2))
                verify = getattr(m, "verify", None)
                if verify is not None:  # untimed: every reload checked, the warm-up ones too
                    diff = verify(baseline, seed=1000 + round_)
                    checks["reloads_checked"] += 1
                    checks["replays_checked"] += len(m.graphs)
                    checks["replay_max_abs_diff"] = max(checks["replay_max_abs_diff"], diff)
                if round_ >= 2:
                    for key, value in times.items():
                        samples[m.name].setdefault(key, []).append(value)
        times_by = {name: {key: med(vals) for key, vals in phases.items()} for name, phases in samples.items()}
        own_ms = {m.name: med(m.outcome_seconds[2:]) * 1e3 for m in methods}  # outcome.seconds, timed rounds
        memory = _engine_memory(methods, weights[0], device) if device.type == "cuda" else {}
        base = times_by[methods[0].name]["cycle"]
        recapture = next((times_by[m.name]["restore"] for m in methods if isinstance(m, EngineRecapture)), None)
        for m in methods:
            t = times_by[m.name]
            row: dict[str, Any] = {"source": source, "method": m.name, "cycle_ms": t["cycle"] * 1e3}
            if isinstance(m, EngineContract):
                overhead = t["cycle"] - base
                own = t["restore"]
                row.update(
                    tracked=m.slots,
                    load_ms=base * 1e3,
                    overhead_ms=overhead * 1e3,
                    overhead_pct=overhead / base * 100,
                    overhead_us_per_tensor=overhead / m.slots * 1e6,
                    contract_ms=own * 1e3,
                    outcome_ms=own_ms[m.name],
                    contract_pct=own / base * 100,
                    contract_us_per_tensor=own / m.slots * 1e6,
                    restored_MiB=m.last_bytes / 2**20,
                    begin_ms=t["begin"] * 1e3 if "begin" in t else None,
                    finish_ms=t["finish"] * 1e3 if "finish" in t else None,
                    goal_overhead="met" if overhead / base <= 0.05 else "missed",
                )
                if recapture is not None:
                    row.update(
                        recapture_ms=recapture * 1e3,
                        ratio=recapture / own,
                        ratio_vs_overhead=recapture / overhead if overhead > 0 else None,
                        goal_ratio="met" if recapture / own >= 100 else "missed",
                    )
            elif isinstance(m, EngineRecapture):
                row.update(recapture_ms=t["restore"] * 1e3, load_ms=base * 1e3)
            else:
                row.update(load_ms=base * 1e3, overhead_ms=(t["cycle"] - base) * 1e3)
            row.update(memory.get(m.name, {}))
            rows.append(row)
        del weights
        gc.collect()
    # The cold-rebuild oracle: one more committed reload of every contract model, compared with a model built
    # from scratch on the same weights (derived values and the forward).
    final = _engine.make_weights(template, 7, device)
    cold = _engine.build(shape, device, declare=False, weights=final)
    x = torch.randn(min(8, shape.max_tokens), shape.hidden, generator=torch.Generator().manual_seed(7)).to(
        device=device, dtype=_engine.DTYPE
    )
    with torch.no_grad():
        want = cold(x)
    cold_equal = True
    for m in methods:
        if isinstance(m, EngineContract):
            m.cycle(final)
            with torch.no_grad():
                got = m.model(x)
            cold_equal &= not _engine.value_mismatches(m.model, cold) and bool(torch.equal(got, want))
            cold_equal &= not _engine.moved(m.model, m.sealed)
    contracts = [m for m in methods if isinstance(m, EngineContract)]
    out = {
        "shape": shape.describe(),
        "batches": list(batches),
        "weights_MiB": _engine.weight_bytes(baseline) / 2**20,
        "derived_MiB": _engine.derived_bytes(baseline) / 2**20,
        "derived_per_layer": sum(1 for _ in _engine.derived(baseline)) // shape.layers,
        "tracked": {m.name: m.slots for m in contracts},
        "rows": rows,
        "replays_inexact": sum(m.inexact for m in methods),
        "all_committed": True,  # a reload that did not commit stops the section (EngineCheckFailed)
        "values_equal_cold_rebuild": cold_equal,
        **checks,
    }
    if not cold_equal:
        raise EngineCheckFailed(f"engine: a graphsafe model differs from a cold rebuild on the same weights: {out}")
    for m in methods:
        m.graphs.clear()
    return out


def _engine_memory(
    methods: list[EngineMethod], weights: list[list[torch.Tensor]], device: torch.device
) -> dict[str, dict[str, int]]:
    """Device memory of one more reload per method: peak above the start, and what stays allocated."""
    out = {}
    for m in methods:
        gc.collect()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        m.cycle(weights)
        sync(device)
        out[m.name] = {
            "peak_extra_bytes": torch.cuda.max_memory_allocated(device) - start,
            "kept_bytes": torch.cuda.memory_allocated(device) - start,
        }
    return out


# -- output --------------------------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def mib(value: Any) -> Any:
    return None if value is None else value / 2**20


def render_engine(s: dict[str, Any]) -> list[str]:
    """The engine section: every figure next to the goal it is measured against."""
    shape = s["shape"]
    tracked = ", ".join(f"{name}: {n:,}" for name, n in s["tracked"].items())
    rows = [dict(r, peak=mib(r.get("peak_extra_bytes")), kept=mib(r.get("kept_bytes"))) for r in s["rows"]]
    contract_rows = [r for r in rows if "tracked" in r]
    lines = [
        f"### Engine-shaped model: {shape['layers']} layers, {s['weights_MiB']:,.1f} MiB of weights, "
        f"{s['derived_MiB']:,.1f} MiB derived",
        "",
        f"Per layer: MLA attention (`w_kc`/`w_vc` transposed copies), an fp8 `o_proj` (float8_e4m3fn `qweight` + "
        f"fp32 per-channel scale, requantized from the bf16 master), a MoE kernel-args object ({shape['experts']} "
        f"experts: 4 int64 stride tables, two of them one tensor, and transposed `w13_t`/`w2_t`), a "
        f"`functools.partial` with 3 bound tensors (act-order shared expert) and a `stable_empty` permute scratch: "
        f"{s['derived_per_layer']} derived tensors + 1 scratch per layer; hidden {shape['hidden']}, "
        f"{shape['heads']} heads, latent {shape['latent']}, inter {shape['inter']}. Graphs: "
        f"{(', '.join(map(str, s['batches'])) + ' tokens') if s['batches'] else 'none (no CUDA)'}. Tracked tensors "
        f"(`contract.slots()`): {tracked}. Every reload loaded different weights and committed; after each, "
        f"every graph-read tensor was at its sealed address and equal to a no-contract model's "
        f"({s['reloads_checked']} reloads checked; {s['replays_checked']} graph replays compared with eager, "
        f"{s['replays_inexact']} of them not bitwise equal, largest |replay - eager| "
        f"{s['replay_max_abs_diff']:.3g}); equal to a cold rebuild at the end: "
        f"{fmt(s['values_equal_cold_rebuild'])}.",
        "",
        table(
            contract_rows,
            [
                ("source", "weights from"),
                ("method", "method"),
                ("tracked", "tracked tensors"),
                ("load_ms", "load ms (baseline)"),
                ("cycle_ms", "cycle ms"),
                ("overhead_ms", "overhead ms"),
                ("overhead_us_per_tensor", "overhead us/tensor"),
                ("overhead_pct", "overhead % of load"),
                ("goal_overhead", "goal <= 5%"),
                ("contract_ms", "contract ms"),
                ("contract_us_per_tensor", "contract us/tensor"),
                ("contract_pct", "contract % of load"),
                ("recapture_ms", "recapture ms"),
                ("ratio", "recapture / contract"),
                ("goal_ratio", "goal >= 100x"),
            ],
        ),
        "",
        "overhead = graphsafe cycle - baseline cycle (medians, methods interleaved); contract = the transaction's "
        "own time (whole model: begin + finish with the device synced after the load; layerwise: "
        "`outcome.seconds`); recapture = re-capturing the graph set after load + PWAL. The baseline whose PWAL "
        "declares (no contract) shows what re-declaring costs alone; it is part of every graphsafe cycle.",
        "",
        table(
            rows,
            [
                ("source", "weights from"),
                ("method", "method"),
                ("cycle_ms", "cycle ms"),
                ("overhead_ms", "cycle - baseline ms"),
                ("outcome_ms", "outcome.seconds ms"),
                ("begin_ms", "begin ms"),
                ("finish_ms", "finish ms"),
                ("recapture_ms", "recapture ms"),
                ("ratio_vs_overhead", "recapture / overhead"),
                ("restored_MiB", "restored MiB"),
                ("peak", "peak MiB"),
                ("kept", "kept MiB"),
            ],
        ),
        "",
    ]
    return lines


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "## graphsafe reload benchmark",
        "",
        f"- date: {m['date']}",
        f"- CPU: {m['cpu']} ({m['cpu_count']} cores); GPU: {m.get('gpu', '-')}",
        f"- torch {m['torch']} (CUDA {m.get('cuda', '-')}), Python {m['python']}, device `{m['device']}`",
        f"- repeats: {report['repeats']} (medians; methods interleaved)",
        "",
    ]
    s = report.get("small")
    if s:
        lines += [
            f"### Small slots: {s['shape']['layers']} layers x {s['shape']['k']} derived = "
            f"{s['shape']['layers'] * s['shape']['k']:,} slots ({s['bytes'] / 2**20:.1f} MiB)",
            "",
            table(
                s["rows"],
                [
                    ("method", "method"),
                    ("cycle_ms", "cycle ms"),
                    ("overhead_pct", "cycle +% vs baseline"),
                    ("restore_ms", "restore ms"),
                    ("restore_us_per_slot", "restore us/slot"),
                    ("host_us_per_slot", "host us/slot"),
                    ("vs_loop", "x faster than loop"),
                    ("GBps", "GB/s"),
                    ("vs_flat_copy", "vs flat copy_"),
                ],
            ),
            "",
            table(
                [r for r in s["rows"] if r.get("begin_us_per_slot") is not None],
                [
                    ("method", "method"),
                    ("begin_us_per_slot", "begin (snapshot) us/slot"),
                    ("finish_us_per_slot", "finish (restore + verify) us/slot"),
                ],
            ),
            "",
            f"Values after a graphsafe reload equal the baseline's: {fmt(s['values_equal'])}. One flat `copy_` of "
            f"the same bytes: {s['flat_copy_ms']:.3f} ms. Re-declaring in PWAL (`register_derived`, part of the "
            f"graphsafe cycles above): {s['redeclare_us_per_slot']:.2f} us/slot.",
            "",
        ]
        if any("peak_extra_bytes" in r for r in s["rows"]):
            lines += [
                table(
                    [
                        dict(
                            r,
                            peak=mib(r.get("peak_extra_bytes")),
                            kept=mib(r.get("kept_bytes")),
                            seal=mib(r.get("seal_bytes")),
                        )
                        for r in s["rows"]
                    ],
                    [
                        ("method", "method"),
                        ("peak", "reload peak MiB over start"),
                        ("kept", "kept MiB"),
                        ("seal", "seal MiB"),
                    ],
                ),
                "",
            ]
    s = report.get("large")
    if s:
        lines += [
            f"### Large slots: {s['shape']['layers'] * s['shape']['k']} bf16 tensors, {s['bytes'] / 2**20:.0f} MiB "
            f"(one flat copy_: {s['flat_copy_ms']:.3f} ms, {s['flat_GBps']:.0f} GB/s)",
            "",
            table(
                s["rows"],
                [
                    ("method", "method"),
                    ("restore_ms", "restore ms"),
                    ("GBps", "GB/s"),
                    ("vs_flat_copy", "fraction of flat copy_"),
                    ("finish_ms", "finish ms"),
                    ("finish_vs_flat_copy", "finish: fraction of flat copy_"),
                ],
            ),
            "",
        ]
    s = report.get("cycle")
    if s:
        lines += [
            "### Whole reload cycle (heavy: + a bf16 transposed copy of every weight; light: scales, workspace, "
            "strides)",
            "",
            table(
                [
                    dict(
                        r,
                        peak=mib(r.get("peak_extra_bytes")),
                        kept=mib(r.get("kept_bytes")),
                        seal=mib(r.get("seal_bytes")),
                    )
                    for r in s["rows"]
                ],
                [
                    ("derived", "derived"),
                    ("source", "weights from"),
                    ("method", "method"),
                    ("weights_MiB", "weights MiB"),
                    ("derived_MiB", "restored MiB"),
                    ("cycle_ms", "cycle ms"),
                    ("overhead_pct", "+% vs baseline"),
                    ("restore_ms", "contract ms"),
                    ("peak", "peak MiB"),
                    ("kept", "kept MiB"),
                    ("seal", "seal MiB"),
                ],
            ),
            "",
        ]
    s = report.get("recapture")
    if s:
        lines += [
            "### Contract reload vs re-capturing the graph set",
            "",
            table(
                s["rows"],
                [
                    ("model", "model"),
                    ("graphs", "graphs"),
                    ("recapture_ms", "recapture ms"),
                    ("contract_restore_ms", "contract restore ms"),
                    ("ratio", "recapture / contract"),
                    ("replay_equals_eager", "replay == eager after reload"),
                ],
            ),
            "",
        ]
    s = report.get("engine")
    if s:
        lines += render_engine(s)
    s = report.get("walker")
    if s:
        lines += [
            "### Walker",
            "",
            table(
                s["rows"],
                [
                    ("model", "model"),
                    ("modules", "modules"),
                    ("objects", "objects"),
                    ("tensor_refs", "tensor refs"),
                    ("walk_ms", "walk ms"),
                    ("objects_per_s", "objects/s"),
                    ("refs_per_s", "refs/s"),
                    ("reload_walk_ms", "every-reload walk ms"),
                    ("reload_objects_per_s", "every-reload objects/s"),
                ],
            ),
            "",
        ]
    s = report.get("threshold")
    if s:
        lines += [
            "### Copy threshold: per-tensor cost of a copy_ loop vs one _foreach_copy_",
            "",
            table(
                [dict(r, KiB=r["bytes"] / 1024) for r in s],
                [
                    ("KiB", "KiB"),
                    ("tensors", "tensors"),
                    ("copy_loop_us_per_tensor", "copy_ us/tensor"),
                    ("foreach_us_per_tensor", "foreach us/tensor"),
                    ("copy_loop_GBps", "copy_ GB/s"),
                    ("foreach_GBps", "foreach GB/s"),
                ],
            ),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 7 cpu, 15 cuda)")
    parser.add_argument("--small-layers", type=int, default=500)
    parser.add_argument("--small-k", type=int, default=20)
    parser.add_argument(
        "--engine-size",
        choices=["full", "cpu", "tiny"],
        default=None,
        help="engine section: full (~1 GiB of weights; default on cuda), cpu (default on cpu), tiny",
    )
    parser.add_argument("--engine-layers", type=int, default=None, help="engine section: layers (default 32)")
    parser.add_argument(
        "--sections",
        default="small,large,cycle,recapture,engine,walker,threshold",
        help="comma-separated subset of small,large,cycle,recapture,engine,walker,threshold",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.repeats is None:
        args.repeats = 15 if device.type == "cuda" else 7
    torch.manual_seed(0)
    report: dict[str, Any] = {"machine": machine(device), "repeats": args.repeats}
    sections: dict[str, Callable[[argparse.Namespace, torch.device], Any]] = {
        "small": section_small,
        "large": section_large,
        "cycle": section_cycle,
        "recapture": section_recapture,
        "engine": section_engine,
        "walker": section_walker,
        "threshold": lambda a, d: copy_threshold(d, a.repeats),
    }
    failed = 0
    for name in args.sections.split(","):
        name = name.strip()
        if name == "recapture" and device.type != "cuda":
            continue
        started = time.perf_counter()
        try:
            report[name] = sections[name](args, device)
        except Exception as exc:  # one broken section must not lose the others' numbers
            failed += 1
            report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            import traceback

            traceback.print_exc()
        print(f"[{name}: {time.perf_counter() - started:.1f} s]", file=sys.stderr, flush=True)
        if args.json:  # written after every section: a run cut short still leaves what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2, default=str)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(render(report))
    for name, error in report.get("errors", {}).items():
        print(f"\n**section {name} failed**: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
