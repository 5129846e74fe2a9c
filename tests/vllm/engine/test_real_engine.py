"""A real vLLM engine on CPU (``vllm-cpu`` 0.32, in ``.venv-vllm-cpu``) reloaded under graphsafe.

A tiny random Llama is made on the fly (no hub): three checkpoints A, B and C of the same architecture. One engine
per compile setting (eager, and vLLM's default torch.compile) starts on A in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as colocated RL runs it) and is reloaded through the three routes, each
in another plugin mode: ``reload_weights`` with a path (plugin off), with a weights iterator (``migrate``), and
the weight-transfer route start / load / finish (``strict``). After each reload the greedy output must equal
that of a fresh engine started on the new weights. Engines are shared: a start takes 10-110 s here.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its worker is ours
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

vllm = pytest.importorskip("vllm.config", reason="vLLM is not installed (this suite runs in .venv-vllm-cpu)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import vllm as vllm_package  # noqa: E402
from graphsafe.adapters import vllm as gs_vllm  # noqa: E402
from graphsafe.adapters.vllm import _guard, _recapture  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("a real engine on CPU needs the vllm-cpu build (make vllm-cpu-venv)", allow_module_level=True)

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 20, 33]}, {"prompt_token_ids": [3, 3, 7]}, {"prompt_token_ids": [90]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False)


def _checkpoint(folder: str, seed: int) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,  # CPU attention needs heads at least 32 wide
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=128,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)  # larger than the init: greedy tokens differ between seeds
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, str]:
    root = tempfile.mkdtemp(prefix="graphsafe-engine-")
    return {name: _checkpoint(os.path.join(root, name), seed) for seed, name in enumerate("ABC")}


def _engine(path: str, compiled: bool) -> Any:
    return LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        enforce_eager=not compiled,
        weight_transfer_config={"backend": "ipc"},
        worker_extension_cls="graphsafe.adapters.vllm.GraphsafeWorkerExtension",
        seed=0,
    )


def _tokens(llm: Any) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def fresh(checkpoints: dict[str, str]) -> Any:
    """``fresh(name, compiled)``: the greedy tokens of a fresh engine on checkpoint ``name`` (computed once)."""
    cache: dict[tuple[str, bool], list[list[int]]] = {}

    def tokens(name: str, compiled: bool) -> list[list[int]]:
        if (name, compiled) not in cache:
            llm = _engine(checkpoints[name], compiled)
            cache[name, compiled] = _tokens(llm)
            _close(llm)
        return cache[name, compiled]

    return tokens


def _set_mode(mode: str) -> Any:
    os.environ["GRAPHSAFE_MODE"] = mode
    return gs_vllm.register()


def _iterate(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield from load_file(os.path.join(path, "model.safetensors")).items()


def test_the_hook_guard_accepts_this_vllm() -> None:
    _guard.check_version(vllm_package.__version__)
    found, unavailable = _guard.resolve_all()
    assert set(found) == {point.name for point in _guard.HOOK_POINTS} and unavailable == {}


@pytest.mark.timeout(1200)  # four engine starts (10-110 s each on this CPU) and their compiles
@pytest.mark.parametrize(("compiled", "start_mode"), [(False, "off"), (True, "migrate")], ids=["eager", "compiled"])
def test_reloads_through_every_route_give_a_fresh_engines_output(
    compiled: bool, start_mode: str, checkpoints: dict[str, str], fresh: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The eager engine starts without graphsafe (turned on later: the pack declares at seal); the compiled one
    with it (the plugin is in from the first load, and sees the engine's scheduler made)."""
    # One engine at a time in this process (they share vLLM's process-wide parallel state): references first.
    want = {name: fresh(name, compiled) for name in "ABC"}
    assert want["B"] != want["A"] != want["C"], "the checkpoints must differ"
    _set_mode(start_mode)
    llm = _engine(checkpoints["A"], compiled)
    try:
        _reload_every_route(llm, checkpoints, want, caplog)
        _nothing_in_flight(llm, plugin_saw_the_start=start_mode != "off")
    finally:
        _close(llm)
        gs_vllm.unregister()


def _reload_every_route(
    llm: Any, checkpoints: dict[str, str], want: dict[str, list[list[int]]], caplog: pytest.LogCaptureFixture
) -> None:
    assert _tokens(llm) == want["A"]

    # plugin off: vLLM's own reload, by path
    assert _set_mode("off") is None
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoints["B"]})
    assert _tokens(llm) == want["B"]

    # migrate: a weights iterator (the callable runs in the engine's worker, here this process)
    state = _set_mode("migrate")
    path_c = checkpoints["C"]
    llm.collective_rpc(lambda worker: worker.reload_weights(weights_iterator=_iterate(path_c)))
    outcome = state.last_outcome
    assert outcome is not None and outcome.committed, outcome and outcome.summary()
    assert _tokens(llm) == want["C"]

    # strict: the weight-transfer route (the IPC receiver needs CUDA: the chunk loads as its receiver loads it)
    state = _set_mode("strict")
    path_b = checkpoints["B"]
    with caplog.at_level(logging.INFO, logger="graphsafe.vllm"):
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc(lambda worker: worker.model_runner.get_model().load_weights(_iterate(path_b)))
        llm.collective_rpc("finish_weight_update")
    outcome = state.last_outcome
    assert outcome is not None and outcome.committed, outcome.summary()
    exhausted = [f"{f.layer}: {f.detail}" for f in outcome.findings if f.kind.value == "budget-exhausted"]
    assert not exhausted, exhausted  # compiled callables are opaque: the walk never spends its budget in them
    said = [r.getMessage() for r in caplog.records if "nothing to protect" in r.getMessage()]
    assert len(said) == 1, said
    assert _tokens(llm) == want["B"]
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["serving_safe"] and status["mode"] == "strict" and status["reloads"] == 2


def _nothing_in_flight(llm: Any, *, plugin_saw_the_start: bool) -> None:
    """The generate above finished every request; the in-process engine never ran the step that tells the
    runner, so only the scheduler knows they are done."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.get_num_unfinished_requests() == 0
    assert _recapture.in_flight(runner, [scheduler]) == 0
    state = gs_vllm.current_state()
    if plugin_saw_the_start:
        assert scheduler in state.schedulers, "the plugin saw vLLM's scheduler made"
        assert _recapture.in_flight(runner, list(state.schedulers)) == 0


def _in_flight_here(worker: Any) -> int:
    """Run in the engine core's process: the in-flight count graphsafe's recapture would see there."""
    from graphsafe.adapters.vllm import _recapture, current_state

    state = current_state()
    assert state is not None, "graphsafe's plugin is registered in the engine core's process"
    return _recapture.in_flight(worker.model_runner, list(state.schedulers))


@pytest.mark.timeout(600)
def test_a_multiprocess_engine_loads_the_plugin_and_counts_nothing_in_flight_after_generate(
    checkpoints: dict[str, str], fresh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine core in its own process (vLLM's default): the plugin comes in through vLLM's entry point, a
    strict reload through the weights iterator commits there, and the recapture's in-flight check sees no
    request after a generate finished."""
    want = fresh("C", False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the test's callables cross to the engine core
    monkeypatch.setenv("GRAPHSAFE_MODE", "strict")
    gs_vllm.unregister()  # nothing of this process's plugin can help: the engine core is another process
    llm = _engine(checkpoints["A"], compiled=False)
    try:
        _tokens(llm)
        assert llm.collective_rpc(_in_flight_here) == [0]
        path_c = checkpoints["C"]
        llm.collective_rpc(lambda worker: worker.reload_weights(weights_iterator=_iterate(path_c)))
        (outcome,) = llm.collective_rpc("graphsafe_last_outcome")
        assert outcome is not None and outcome["status"] == "committed", outcome
        assert _tokens(llm) == want
        assert llm.collective_rpc(_in_flight_here) == [0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
