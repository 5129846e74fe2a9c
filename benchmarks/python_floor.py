"""The least per-slot restore work pure Python can do with the contract's core checks, beside the per-slot loop.

    PYTHONPATH=src python3 benchmarks/python_floor.py [--device cpu|cuda] [--slots 4200] [--repeats 9] [--native]

The target is a restore of at most 3 us per declared slot on a CPU and 10x faster than a per-slot ``copy_`` loop
on an H200. This measures what any pure-Python design would pay, with none of the contract's fail-closed checks
(value samples, inputs, foreign holders, shared memory, abandoned memory, findings) and only the core ones kept:
per slot a compiled path lookup, an identity check, a storage comparison, the layout tuple of the new and of the
captured tensor, a reference-count look; then one grouped ``_foreach_copy_`` for all slots, a rebind through the
compiled setter and a verification (lookup, identity, pointer, layout). The "per-slot loop" is the baseline of
``run.py`` (resolve, ``copy_``, setattr). Both run over the same module tree of small tensors, PWAL replacing each
tensor by a new one before every timing, interleaved, medians printed.

If the floor is above the goal, no amount of tuning of the pure-Python contract reaches it: the remaining route
is native code (the issue's "native executor"), which must ship as a wheel with a pure-Python fallback.

``--native`` adds the same core restore written in C++ against libtorch (``_native_floor.cpp``, built here with
setuptools into a temporary directory: it needs a C++ compiler and torch's headers, no ninja): what a native
executor would pay per slot for the same checks, measured beside the other two.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphsafe.paths import SlotPath, compile_getter, compile_setter


def _view(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.is_conj(), tensor.is_neg(), type(tensor))


def _build(slots: int, device: torch.device) -> list[tuple[nn.Module, str, torch.Tensor]]:
    per_module = 20
    entries: list[tuple[nn.Module, str, torch.Tensor]] = []
    for _ in range(slots // per_module):
        module = nn.Module()
        for j in range(per_module):
            tensor = torch.zeros(16, 8, device=device)
            setattr(module, f"d{j}", tensor)
            entries.append((module, f"d{j}", tensor))
    return entries


def _build_native(where: str) -> Any:
    """Compile ``_native_floor.cpp`` into ``where`` and import it."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    source = Path(__file__).resolve().parent / "_native_floor.cpp"
    setup(
        name="graphsafe_native_floor",
        ext_modules=[CppExtension("graphsafe_native_floor", [str(source)], extra_compile_args=["-O2"])],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
        script_args=["-q", "build_ext", "--build-lib", where, "--build-temp", where],
    )
    (built,) = Path(where).glob("graphsafe_native_floor*.so")
    spec = importlib.util.spec_from_file_location("graphsafe_native_floor", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", type=int, default=4200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--native", action="store_true", help="also the same restore in C++ (builds it first)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    entries = _build(args.slots, device)
    names = {name for _, name, _ in entries}
    getters = {name: compile_getter(SlotPath(name)) for name in names}
    setters = {name: compile_setter(SlotPath(name)) for name in names}
    layouts = [_view(t) for _, _, t in entries]
    pointers = [t.data_ptr() for _, _, t in entries]

    fresh: list[torch.Tensor] = []  # the tensors the last PWAL made, in slot order

    def pwal() -> None:
        fresh.clear()
        for module, name, _ in entries:
            tensor = torch.ones(16, 8, device=device)
            setattr(module, name, tensor)
            fresh.append(tensor)

    def floor() -> None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for (module, name, captured), layout in zip(entries, layouts, strict=True):
            current = getters[name](module)
            if current is captured:
                continue
            if current.untyped_storage() is captured.untyped_storage():
                raise SystemExit("floor: unexpected in-place slot")
            if _view(current) != layout or _view(captured) != layout or current.storage_offset() != 0:
                raise SystemExit("floor: unexpected layout")
            if sys.getrefcount(captured) > 8:
                raise SystemExit("floor: unexpected holder")
            dsts.append(captured)
            srcs.append(current)
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        for module, name, captured in entries:
            setters[name](module, captured)
        for (module, name, captured), layout, pointer in zip(entries, layouts, pointers, strict=True):
            current = getters[name](module)
            if not (current is captured and current.data_ptr() == pointer and _view(current) == layout):
                raise SystemExit("floor: verification failed")

    def loop() -> None:
        with torch.no_grad():
            for module, name, captured in entries:
                current = getattr(module, name)
                captured.copy_(current)
                setattr(module, name, captured)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    all_captured = [captured for _, _, captured in entries]

    def copy_alone() -> None:  # the copies of every slot and nothing else: what no restore can go below
        with torch.no_grad():
            torch._foreach_copy_(all_captured, fresh)

    methods: dict[str, Callable[[], None]] = {
        "per-slot loop": loop,
        "pure-Python floor": floor,
        "copies alone (one _foreach_copy_, no lookup, check or rebind)": copy_alone,
    }
    if args.native:
        native = _build_native(tempfile.mkdtemp(prefix="graphsafe-native-floor-"))
        native.seal(all_captured)
        owners = [module.__dict__ for module, _, _ in entries]
        keys = [name for _, name, _ in entries]

        def native_floor() -> None:
            if native.restore(owners, keys, all_captured) != len(entries):
                raise SystemExit("native floor: a slot was not copied")

        methods["native floor (C++)"] = native_floor
    times: dict[str, list[float]] = {name: [] for name in methods}
    gc.disable()  # the contract pauses the cyclic collector in its own code too
    try:
        for round_ in range(args.repeats + 1):
            for name, method in methods.items():
                pwal()
                sync()
                start = time.perf_counter()
                method()
                sync()
                if round_:
                    times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    print(f"## pure-Python restore floor: {len(entries)} slots on {device}, {args.repeats} repeats (medians)\n")
    print("| method | us/slot |\n|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) / len(entries) * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
