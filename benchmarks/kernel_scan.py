"""Kernel scan cost on a GPU: scan time per kernel node and for a 48-layer model's graph set, host memory per graph.

    PYTHONPATH=src python benchmarks/kernel_scan.py --layers 48 --batches 1,2,4,8,16,32 --json out.json

Each graph of the set is captured by the torch adapter (which scans it). The scan is then repeated on the captured
graphs to time its two parts: the node walk with parameter reads (``scan_graph``) and the attribution of every
candidate address (``attribute``, against the allocator's snapshot). Host memory is what ``tracemalloc`` sees kept
after a capture's scan (its manifest entries and facts), per graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from typing import Any

import torch
from torch import nn

from graphsafe import GraphContract
from graphsafe.adapters.torch import GraphRunner, run_reload
from graphsafe.collectors import Manifest, StorageView, scan_graph
from graphsafe.collectors import _kernelscan as kscan


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q * k, dim=-1) * v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model = nn.Sequential(*[Block(args.width) for _ in range(args.layers)]).to(device).eval()
    contract = GraphContract(model, "recapture")
    runner = GraphRunner(model, contract)
    batches = [int(b) for b in args.batches.split(",")]
    memory: list[int] = []
    capture_s: list[float] = []
    tracemalloc.start()
    for batch in batches:
        x = torch.randn(batch, args.width, device=device)
        before = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        runner.capture(x, name=f"b{batch}")
        capture_s.append(time.perf_counter() - start)
        memory.append(tracemalloc.get_traced_memory()[0] - before)
    tracemalloc.stop()
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    drv = kscan.driver()
    rows: list[dict[str, Any]] = []
    for graph, kept in zip(runner.graphs, memory, strict=True):
        raw = kscan.raw_graph(graph.graph)
        walks, attributions, nodes = [], [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            scan = scan_graph(raw, drv)
            t1 = time.perf_counter()
            model_ranges = [
                (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes(), p) for p in model.parameters()
            ]
            view = StorageView.from_allocator(model_ranges, graph.static_inputs)
            kscan.attribute(scan, view)
            t2 = time.perf_counter()
            walks.append(t1 - t0)
            attributions.append(t2 - t1)
            nodes = len(scan.nodes)
        rows.append(
            {
                "graph": graph.name,
                "nodes": nodes,
                "walk_ms": statistics.median(walks) * 1e3,
                "attribute_ms": statistics.median(attributions) * 1e3,
                "us_per_node": statistics.median(w + a for w, a in zip(walks, attributions, strict=True)) / nodes * 1e6,
                "host_kib_kept": kept / 1024,
            }
        )
    checks = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        manifest.check(contract)
        checks.append(time.perf_counter() - t0)
    outcome = run_reload(contract, lambda: None)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "graphs": rows,
        "total_nodes": sum(r["nodes"] for r in rows),
        "total_scan_ms": sum(r["walk_ms"] + r["attribute_ms"] for r in rows),
        "capture_with_scan_s": capture_s,
        "captured_storages": len(manifest.storages()),
        "check_ms": statistics.median(checks) * 1e3,
        "reload": outcome.status.value,
        "slots_unread": outcome.slots_unread,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
