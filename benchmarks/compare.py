"""Two source trees of graphsafe, benchmarked side by side: ``run.py`` of each, rounds alternating.

    python3 benchmarks/compare.py OLD_TREE NEW_TREE [--rounds 3] [-- run.py arguments]

Each tree is a checkout (its ``src/`` and ``benchmarks/run.py`` are used), so a refactor can be checked against the
commit before it on the same machine in the same run. Rounds alternate which tree goes first, so drift in the
machine's load hits both alike. Every timing row ``run.py`` reports is matched by section and method (or model)
and the median over rounds is compared; the table's last column is new over old for times (below 1: new is
faster) and for rates (objects/s: above 1: new is faster), as labelled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Row fields compared, and whether a larger value is better.
METRICS: dict[str, bool] = {
    "cycle_ms": False,
    "restore_ms": False,
    "restore_us_per_slot": False,
    "host_us_per_slot": False,
    "walk_ms": False,
    "objects_per_s": True,
    "reload_walk_ms": False,
    "reload_objects_per_s": True,
    "contract_ms": False,
    "recapture_ms": False,
}


def _run(tree: Path, args: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        command = [sys.executable, str(tree / "benchmarks" / "run.py"), "--json", str(out), *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if not out.exists():
            raise SystemExit(f"compare: {tree} produced no result:\n{done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _rows(result: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """``(section, row name, metric) -> value`` for every timing row of one run."""
    values: dict[tuple[str, str, str], float] = {}
    for section, body in result.items():
        if not isinstance(body, dict):
            continue
        for row in body.get("rows", ()):
            name = str(row.get("method") or row.get("model") or "")
            for metric in METRICS:
                value = row.get(metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    values[(section, name, metric)] = float(value)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the tree before the change")
    parser.add_argument("new", type=Path, help="the tree after the change")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write every run's numbers")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    run_args = argv[split + 1 :]  # everything after "--" goes to run.py
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for round_number in range(args.rounds):
        order = ("old", "new") if round_number % 2 == 0 else ("new", "old")
        for which in order:
            runs[which].append(_run(getattr(args, which), run_args))
            print(f"[round {round_number + 1}: {which} done]", file=sys.stderr, flush=True)
        # A table after every round: a run cut short by a time limit still leaves its figures.
        print(_table(runs, args.rounds, round_number + 1, run_args), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=2, default=str))
    return 0


def _table(runs: dict[str, list[dict[str, Any]]], rounds: int, done: int, run_args: list[str]) -> str:
    medians: dict[str, dict[tuple[str, str, str], float]] = {}
    for which, results in runs.items():
        per_key: dict[tuple[str, str, str], list[float]] = {}
        for result in results:
            for key, value in _rows(result).items():
                per_key.setdefault(key, []).append(value)
        medians[which] = {key: statistics.median(values) for key, values in per_key.items()}
    machine = runs["new"][0].get("machine", {})
    lines = [
        f"## old vs new, {done} of {rounds} rounds alternating ({machine.get('date', '?')})",
        "",
        f"- {machine.get('cpu', '?')} ({machine.get('cpu_count', '?')} cores); GPU: {machine.get('gpu', '-')}",
        f"- torch {machine.get('torch', '?')}; run.py {' '.join(run_args) or '(defaults)'}",
        "",
        "| section | row | metric | old | new | new/old |",
        "|---|---|---|---|---|---|",
    ]
    for key in sorted(medians["new"].keys() & medians["old"].keys()):
        old, new = medians["old"][key], medians["new"][key]
        better = "higher is better" if METRICS[key[2]] else "lower is better"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {old:.4g} | {new:.4g} | {new / old:.2f} ({better}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
