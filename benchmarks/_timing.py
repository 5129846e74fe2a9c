"""Timing and machine description for the benchmark: medians of repeats, device syncs, who ran it where."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` followed by a device sync (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def med(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def flat_copy_time(nbytes: int, device: torch.device, repeats: int) -> float:
    """Seconds of one ``copy_`` of ``nbytes`` contiguous bytes (the bandwidth reference)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), device, repeats, warmup=2)


def copy_threshold(device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """Per-tensor time of a ``copy_`` loop vs one ``_foreach_copy_`` over same-size tensors, by size."""
    rows = []
    for size in (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 24, 1 << 26):
        count = max(4, min(256, (256 << 20) // size if device.type == "cuda" else (32 << 20) // size))
        dsts = [torch.empty(size // 2, dtype=torch.bfloat16, device=device) for _ in range(count)]
        srcs = [torch.empty_like(d) for d in dsts]
        t_loop = median_time(_copy_loop(dsts, srcs), device, repeats)
        t_each = median_time(_foreach(dsts, srcs), device, repeats)
        rows.append(
            {
                "bytes": size,
                "tensors": count,
                "copy_loop_us_per_tensor": t_loop / count * 1e6,
                "foreach_us_per_tensor": t_each / count * 1e6,
                "copy_loop_GBps": size * count / t_loop / 1e9,
                "foreach_GBps": size * count / t_each / 1e9,
            }
        )
    return rows


def _copy_loop(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)

    return run


def _foreach(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Callable[[], None]:
    return lambda: torch._foreach_copy_(dsts, srcs)
