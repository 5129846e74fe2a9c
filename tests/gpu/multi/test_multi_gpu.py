"""Multi-GPU proof (issue: coordinated recapture with NCCL collectives inside captured graphs).

Each scenario runs ``torchrun --nproc-per-node 2 tp_proof.py SCENARIO`` under a hard timeout and checks that both
ranks report success. Needs two CUDA devices; NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``). The same worker
runs on CPU with gloo in ``tests/contract/test_agreement_torchrun_cpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_proof.py")
HARD_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def run_scenario(scenario: str, device: str = "cuda", nproc: int = 2) -> list[str]:
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    src = str(Path(__file__).resolve().parents[3] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(WORKER),
        scenario,
        "--device",
        device,
        "--timeout",
        "60",
    ]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # a deadlock must fail the test, never hang it
        pytest.fail(f"scenario {scenario} did not finish in {HARD_TIMEOUT_S} s: {exc.stdout!r} {exc.stderr!r}")
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == nproc, done.stdout + done.stderr
    assert all(" ok=True " in line for line in results), "\n".join(results) + "\n" + done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    return results


@pytest.mark.parametrize("scenario", ["clean", "drift", "raise"])
def test_two_ranks_agree(scenario: str) -> None:
    results = run_scenario(scenario)
    print("\n".join(results))
