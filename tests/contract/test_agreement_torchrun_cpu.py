"""CPU twin of the multi-GPU proof: the same torchrun worker on gloo with the eager fallback (control flow only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "graphsafe_multi_gpu_proof", Path(__file__).resolve().parents[1] / "gpu" / "multi" / "test_multi_gpu.py"
)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
run_scenario = _module.run_scenario


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["clean", "drift", "raise"])
def test_two_ranks_agree_on_gloo(scenario: str) -> None:
    results = run_scenario(scenario, device="cpu")
    assert {line.split()[1] for line in results} == {"rank=0", "rank=1"}
