"""The vLLM plugin's environment settings: a bad value stops the process that vLLM starts with one line that names
the variable and what to set, not a traceback (vLLM calls the plugin's ``register()`` in every process it starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("GRAPHSAFE_MODE", "bogus", "graphsafe: GRAPHSAFE_MODE='bogus': choose one of strict, recapture, migrate, off"),
        ("GRAPHSAFE_DETECT", "sometimes", "graphsafe: GRAPHSAFE_DETECT='sometimes': choose one of"),
        ("GRAPHSAFE_MANIFEST", "maybe", "graphsafe: GRAPHSAFE_MANIFEST='maybe': expected one of 1/0"),
        (
            "GRAPHSAFE_RECORD_RELOADS",
            "always",
            "graphsafe: GRAPHSAFE_RECORD_RELOADS='always': choose one of every, first, none",
        ),
    ],
)
def test_a_bad_setting_stops_the_process_with_one_line(variable: str, value: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHSAFE_")}
    env.update({variable: value, "PYTHONPATH": SRC})
    result = subprocess.run(
        [sys.executable, "-c", "from graphsafe.adapters.vllm import register; register()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr


def test_a_bad_setting_is_still_a_config_error_for_code_that_reads_it() -> None:
    from graphsafe.adapters.vllm import AdapterConfig, ConfigError

    with pytest.raises(ConfigError, match="GRAPHSAFE_MODE='warn'"):
        AdapterConfig.from_env({"GRAPHSAFE_MODE": "warn"})
