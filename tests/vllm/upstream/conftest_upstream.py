"""The conftest vLLM's own reload tests run under (copied as ``conftest.py`` next to them by ``run.py``).

Minimal stand-ins for the fixtures of vLLM's ``tests/conftest.py`` that the three files use, on CPU with gloo;
and graphsafe's plugin registered in the mode ``GRAPHSAFE_MODE`` names (``off``: not at all), before any test
module imports vLLM's reload functions, as vLLM's plugin loader would in an engine.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("GRAPHSAFE_MODE", "off")
    if mode != "off":
        from graphsafe.adapters import vllm as gs_vllm

        state = gs_vllm.register()
        assert state is not None and state.config.mode == mode, "graphsafe's plugin did not register"


#: Tests that build vLLM's default ``ModelConfig()``, which reads Qwen/Qwen3-0.6B's config from the hub.
NEEDS_HUB = ("test_attention_reload_defers_post_load", "test_attention_first_load_processes_weights")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests that need what this machine has not: a real engine on hub models (``vllm_runner``: a
    GPU and the network) and the hub's default model config (:data:`NEEDS_HUB`)."""
    keep, drop = [], []
    for item in items:
        needs = "vllm_runner" in getattr(item, "fixturenames", ()) or item.name.split("[")[0] in NEEDS_HUB
        (drop if needs else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def default_vllm_config() -> Iterator[Any]:
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def dist_init() -> Iterator[None]:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    fd, path = tempfile.mkstemp()
    os.close(fd)
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{path}", backend="gloo"
        )
        parallel_state.initialize_model_parallel(1, 1, backend="gloo")
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        with contextlib.suppress(FileNotFoundError):  # the file store may have removed it
            os.remove(path)


@pytest.fixture
def workspace_init() -> Iterator[None]:
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

    init_workspace_manager(torch.device("cpu"))
    try:
        yield
    finally:
        reset_workspace_manager()
