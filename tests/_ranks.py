"""Shared test helpers: the rank-agreement protocol run on threads over one in-memory store, and code run on
spawned ranks joined in a gloo process group."""

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


def _block_worker(rank: int, world: int, port: int, code: str, where: str, outdir: str) -> None:
    import json
    import traceback
    from datetime import timedelta
    from pathlib import Path

    result: dict[str, Any] = {"rank": rank}
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
        exec(compile(code, where, "exec"), {"__name__": f"rank{rank}"})
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(code: str, where: str, outdir: str, *, world: int = 2, limit: float = 90.0) -> None:
    """Run ``code`` on ``world`` spawned processes joined in a gloo process group (as ``torchrun`` would set one
    up before the reader's code runs); fail naming the rank and its traceback if any rank raised or hung."""
    import json
    import multiprocessing as mp
    from datetime import timedelta
    from pathlib import Path

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_block_worker, args=(r, world, server.port, code, where, outdir), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + limit
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert not hung, f"{where}: rank(s) {hung} did not finish within {limit} s"
    errors = []
    for rank, proc in enumerate(procs):
        written = Path(outdir, f"rank{rank}.json")
        if not written.exists():
            errors.append(f"rank {rank}: exited with code {proc.exitcode} before reporting")
        elif "error" in (result := json.loads(written.read_text())):
            errors.append(f"rank {rank}:\n{result['error']}")
    assert not errors, f"{where} raised:\n" + "\n".join(errors)
