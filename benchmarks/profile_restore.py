"""Where a contract reload's own time goes: host time per phase, device kernels and host-device synchronisations.

Runs one of run.py's synthetic models (``large``: 8 layers x 2 bf16 transposed copies, 512 MiB on CUDA; ``small``:
200 layers x 20 small derived tensors) under a ``declared-only`` strict contract, warms up, then:

1. times each phase of the transaction on the host (wrapping the contract's methods; no synchronisation added);
2. on CUDA, records one reload with ``torch.profiler`` and lists the device kernels and the synchronising calls
   (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, device-to-host copies) made inside ``begin()`` and
   ``finish()``: each one makes the host wait for every copy launched before it.

    PYTHONPATH=src python3 benchmarks/profile_restore.py --device cuda --model large
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import Shape, make_weights
from run import Contract, sync

import graphsafe.contract._plan as plan_module
import graphsafe.contract._snapshot as snapshot_module
import graphsafe.contract._steps as steps_module
import graphsafe.contract._transaction as transaction_module

PHASES: dict[Any, list[str]] = {
    snapshot_module.LayerSnapshot: ["take", "restore", "rebind", "verify", "doubt_foreign_writes"],
    steps_module: ["judge_noted", "check_freshness"],  # module functions, as the restore steps' module holds them
    plan_module.RestorePlan: ["protect", "watch", "launch", "check"],
    transaction_module.ReloadTransaction: ["begin", "_finish", "_restore_group", "_doubt_abandoned"],
}


def _instrument(totals: dict[str, float]) -> Callable[[], None]:
    """Wrap every phase to add its host seconds to ``totals``; returns the undo."""
    undo: list[tuple[Any, str, Any]] = []
    for owner, names in PHASES.items():
        for name in names:
            original = owner.__dict__[name]
            func = original.__func__ if isinstance(original, classmethod) else original

            label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

            def timed(*args: Any, _f: Any = func, _label: str = label, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - start

            wrapped = functools.wraps(func)(timed)
            setattr(owner, name, classmethod(wrapped) if isinstance(original, classmethod) else wrapped)
            undo.append((owner, name, original))

    def restore() -> None:
        for owner, name, original in undo:
            setattr(owner, name, original)

    return restore


def _count_ops(method: Contract, weights: Any) -> dict[str, collections.Counter[str]]:
    """The aten ops ``begin()`` and the restore (``finish()`` up to the decision) dispatch in one reload."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
            return func(*args, **(kwargs or {}))

    found: dict[str, collections.Counter[str]] = {}
    owner = transaction_module.ReloadTransaction
    originals = {"begin": owner.begin, "restore": owner._settle}

    def counted(name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with Count() as mode:
                result = originals[name](*args, **kwargs)
            found[name] = mode.counts
            return result

        return run

    owner.begin = counted("begin")  # type: ignore[method-assign]
    owner._settle = counted("restore")  # type: ignore[method-assign]
    try:
        method.cycle(weights, split=True)
    finally:
        owner.begin = originals["begin"]  # type: ignore[method-assign]
        owner._settle = originals["restore"]  # type: ignore[method-assign]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("large", "small"), default="large")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--inplace", action="store_true", help="small model: PWAL writes into last time's tensors (stable storage)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.model == "large":
        side = 4096 if device.type == "cuda" else 1024
        shape = Shape("large", 8, 2, side, side, kinds=("transposed",))
    elif args.inplace:
        shape = Shape("small-inplace", 200, 20, 32, 32, inplace=True)
    else:
        shape = Shape("small", 200, 20, 64, 32)
    method = Contract(shape, device, "declared-only")
    weights = [make_weights(method.model, seed, device) for seed in (1, 2)]
    for i in range(3):
        method.cycle(weights[i % 2], split=True)

    ops = _count_ops(method, weights[0])
    totals: dict[str, float] = {}
    undo = _instrument(totals)
    split: list[dict[str, float]] = []
    try:
        for i in range(args.repeats):
            split.append(method.cycle(weights[i % 2], split=True))
    finally:
        undo()
    n, slots = args.repeats, method.slots
    print(f"## {shape.name} model on {device}: {shape.layers} layers, {slots} slots, {args.repeats} reloads")
    for key in ("begin", "finish", "restore"):
        values = sorted(s[key] for s in split)
        print(f"- {key}: median {values[len(values) // 2] * 1e3:.3f} ms")
    print("\n| phase | tensor ops (each computing one is a kernel launch on CUDA) |\n|---|---|")
    for phase, counts in ops.items():
        shown = ", ".join(f"{n} {name}" for name, n in counts.most_common(6))
        print(f"| {phase} | {sum(counts.values())}: {shown} |")
    print("\n| phase (host, wrapped) | ms per reload | us per slot |\n|---|---|---|")
    for label, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"| {label} | {seconds / n * 1e3:.3f} | {seconds / n / slots * 1e6:.2f} |")

    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("graphsafe.reload"):
                method.cycle(weights[0], split=True)
            sync(device)
        calls: collections.Counter[str] = collections.Counter()
        kernels: collections.Counter[str] = collections.Counter()
        kernel_us: collections.Counter[str] = collections.Counter()
        for event in prof.events():
            name = event.name
            if "Synchronize" in name or "MemcpyDtoH" in name or name == "aten::item" or name == "aten::equal":
                calls[name] += 1
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[name[:80]] += 1
                kernel_us[name[:80]] += event.device_time_total if hasattr(event, "device_time_total") else 0
        print("\n| synchronising call in one reload (load included) | count |\n|---|---|")
        for name, count in calls.most_common():
            print(f"| {name} | {count} |")
        print("\n| device kernel | count | device us |\n|---|---|---|")
        for name, count in kernels.most_common(25):
            print(f"| {name} | {count} | {kernel_us[name]:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
