"""Shared test helper: the rank-agreement protocol run on threads, one per rank, over one in-memory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from graphsafe.contract import AgreementGroup


def on_threads(world: int, fn: Callable[[AgreementGroup], Any], *, limit: float = 20.0) -> list[Any]:
    """Run ``fn(group)`` for every rank on its own thread; an exception is returned as the rank's result."""
    store = dist.HashStore()
    results: list[Any] = [None] * world

    def target(rank: int) -> None:
        try:
            results[rank] = fn(AgreementGroup(store, rank, world, "threads"))
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"rank(s) {hung} still inside the agreement after {limit} s"
    return results
