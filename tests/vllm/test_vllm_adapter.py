"""The vLLM adapter against the real vLLM 0.33: its layers, its layerwise reload, its plugin loader, on CPU.

The model is built from vLLM's own parallel linear layers (QKV, column, row) with a quant method whose PWAL makes
the zoo's kinds of derived tensors: a transposed copy and a permutation on plain layer attributes, a lock
workspace and a stride table on a kernel object, and a derived non-persistent buffer. Reloads go through vLLM's
``reload_weights``, the model runner's and worker's ``reload_weights``, the raw initialize -> load_weights ->
finalize trio, and the weight-transfer ``start_weight_update`` / ``finish_weight_update``. Every reload loads
DIFFERENT weights, so a stale tensor cannot hide behind equal values.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

# "vllm.config", not "vllm": without vLLM installed, "import vllm" would find this tests/vllm folder instead.
pytest.importorskip("vllm.config", reason="vLLM is not installed (these tests run in .venv-vllm)")

import torch
from torch import nn
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.model_loader import reload as vllm_reload
from vllm.model_executor.model_loader.reload import inplace, layerwise
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.utils import set_weight_attrs

import vllm
from graphsafe import graph_visible
from graphsafe.adapters import vllm as gs_vllm
from graphsafe.adapters.vllm import _guard, _pack, _recapture
from graphsafe.adapters.vllm._hooks import ORIGINAL_ATTR, HookSet
from graphsafe.errors import (
    NotServingSafeError,
    RecaptureError,
    UndeclaredDriftError,
)

HIDDEN = 16
HEAD = 4
HEADS = 4
KV_HEADS = 2
INTER = 32
GRAPHSAFE_ENV = (
    "GRAPHSAFE_MODE",
    "GRAPHSAFE_REPORT",
    "GRAPHSAFE_DETECT",
    "GRAPHSAFE_FIX_NONPERSISTENT",
    "GRAPHSAFE_MANIFEST",
)


# -- a quant method whose PWAL makes the zoo's kinds of derived tensors ------------------------------------------
class _Kernel:
    """A kernel object held by the quant method (where Marlin keeps its workspace, CUTLASS its strides)."""

    workspace: torch.Tensor
    strides: torch.Tensor


class DerivedLinearMethod(LinearMethodBase):
    """Legacy PWAL: every load makes new derived tensors outside ``_parameters``/``_buffers``."""

    def __init__(self) -> None:
        self.kernel = _Kernel()

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        out = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(out, input_size_per_partition), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        scale = nn.Parameter(torch.empty(out), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0})
        layer.register_parameter("weight_scale", scale)
        set_weight_attrs(scale, extra_weight_attrs)

    def _derive(self, layer: nn.Module) -> None:
        dense = layer.weight * layer.weight_scale[:, None]
        layer.w_t = dense.t().contiguous()  # a transposed copy (MLA's W_UV / W_UK_T kind)
        layer.perm = torch.argsort(layer.weight_scale, stable=True)  # act order's g_idx_sort_indices kind
        self.kernel.workspace = torch.zeros(8, dtype=torch.int32)  # Marlin's lock workspace kind
        self.kernel.strides = torch.full((2,), dense.shape[1], dtype=torch.int64)  # CUTLASS stride tables
        layer.register_buffer("row_norm", dense.norm(dim=1), persistent=False)  # derived non-persistent

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._derive(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # Reads every derived tensor, as the real kernels do (the workspace is zeros, the strides constant).
        y = (x @ layer.w_t) * layer.row_norm
        y = y.index_select(-1, layer.perm) + self.kernel.workspace.sum()
        return y * (self.kernel.strides[0] / x.shape[-1])


DECLARED = ("w_t", "perm", "quant_method.kernel.workspace", "quant_method.kernel.strides")


class DeclaredLinearMethod(DerivedLinearMethod):
    """The same PWAL, its graph-visible tensors declared by the author."""

    @graph_visible(*DECLARED)
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._derive(layer)


class DerivedQuantConfig(QuantizationConfig):
    def __init__(self, method: type[DerivedLinearMethod]) -> None:
        super().__init__()
        self.method = method

    def get_name(self) -> Any:
        return "graphsafe_test"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DerivedQuantConfig:
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        return self.method() if isinstance(layer, LinearBase) else None


class TinyModel(nn.Module):
    """Attention-block projections of a Llama, from vLLM's own parallel linear layers."""

    # checkpoint name -> (parameter, shard id) for the fused QKV projection, as vLLM's Llama maps it
    STACKED = (("qkv", "q_proj", "q"), ("qkv", "k_proj", "k"), ("qkv", "v_proj", "v"))

    def __init__(self, method: type[DerivedLinearMethod]) -> None:
        super().__init__()
        config = DerivedQuantConfig(method)
        self.qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, quant_config=config, prefix="qkv")
        self.up = ColumnParallelLinear(HIDDEN, INTER, bias=False, quant_config=config, prefix="up")
        self.down = RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=config, prefix="down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(x)
        h, _ = self.up(qkv[:, :HIDDEN])
        out, _ = self.down(h)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for fused, part, shard in self.STACKED:
                if name.startswith(part + "."):
                    target = name.replace(part, fused, 1)
                    params[target].weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                params[name].weight_loader(params[name], tensor)
                loaded.add(name)
        return loaded


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-format weights; different seeds give different values."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (HEADS * HEAD, HIDDEN),
        "k_proj": (KV_HEADS * HEAD, HIDDEN),
        "v_proj": (KV_HEADS * HEAD, HIDDEN),
        "up": (INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }
    weights = {}
    for name, shape in shapes.items():
        weights[f"{name}.weight"] = torch.randn(shape, generator=g) * 0.25
        weights[f"{name}.weight_scale"] = torch.rand(shape[0], generator=g) + 0.5
    return weights


# -- vLLM on CPU ---------------------------------------------------------------------------------------------------
def make_config(folder: str) -> VllmConfig:
    """A VllmConfig on CPU whose model config is a tiny Llama described by a local config.json (no hub)."""
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "intermediate_size": INTER,
                "num_attention_heads": HEADS,
                "num_key_value_heads": KV_HEADS,
                "num_hidden_layers": 1,
                "vocab_size": 64,
                "max_position_embeddings": 64,
                "torch_dtype": "float32",
            },
            handle,
        )
    model_config = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))


@pytest.fixture(scope="module")
def vllm_config() -> Iterator[VllmConfig]:
    folder = tempfile.mkdtemp(prefix="graphsafe-vllm-")
    config = make_config(folder)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{folder}/dist", backend="gloo"
        )
        parallel_state.initialize_model_parallel(1, 1, backend="gloo")
        try:
            yield config
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``plugin(mode=..., **env)`` registers graphsafe with that environment; unregistered after the test.

    These tests stand for an engine that captures graphs (vLLM on a GPU), though they run on CPU: the adapter's
    "no graphs here" rule answers "graphs may replay" unless the test passes ``graphs=False``, which leaves the
    rule as it is (this CPU platform captures none).
    """
    for name in GRAPHSAFE_ENV:
        monkeypatch.delenv(name, raising=False)
    gs_vllm.unregister()

    def start(mode: str = "migrate", graphs: bool = True, **env: str) -> Any:
        if graphs:
            monkeypatch.setattr(_recapture, "no_graphs", lambda runner: None)
        monkeypatch.setenv("GRAPHSAFE_MODE", mode)
        for name, value in env.items():
            monkeypatch.setenv(f"GRAPHSAFE_{name.upper()}", value)
        return gs_vllm.register()

    yield start
    gs_vllm.unregister()


def build(config: VllmConfig, seed: int, method: type[DerivedLinearMethod] = DerivedLinearMethod) -> TinyModel:
    """vLLM's first load: construct, record reload metadata, load, PWAL (as ``initialize_model`` + loader do)."""
    with set_current_vllm_config(config):
        model = TinyModel(method)
        layerwise.record_metadata_for_reloading(model)
        model.load_weights(checkpoint(seed).items())
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model


def derived(model: TinyModel) -> dict[str, torch.Tensor]:
    """Every graph-visible tensor of the model: parameters, derived attributes, kernel state, buffers."""
    found: dict[str, torch.Tensor] = {}
    for name in ("qkv", "up", "down"):
        layer = getattr(model, name)
        found[f"{name}.weight"] = layer.weight
        found[f"{name}.weight_scale"] = layer.weight_scale
        found[f"{name}.w_t"] = layer.w_t
        found[f"{name}.perm"] = layer.perm
        found[f"{name}.workspace"] = layer.quant_method.kernel.workspace
        found[f"{name}.strides"] = layer.quant_method.kernel.strides
        found[f"{name}.row_norm"] = layer.row_norm
    return found


def addresses(model: TinyModel) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in derived(model).items()}


def x_input() -> torch.Tensor:
    return torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(123))


# -- the reload routes ---------------------------------------------------------------------------------------------
def reload_inplace(config: VllmConfig, model: nn.Module, seed: int) -> None:
    """vLLM's ``reload_weights`` (what the runners' and the worker's ``reload_weights`` call)."""
    inplace.reload_weights(config, model, iter(checkpoint(seed).items()), None, True)


def reload_trio(config: VllmConfig, model: nn.Module, seed: int) -> None:
    """The raw trio, through the names the reload package exports."""
    vllm_reload.initialize_layerwise_reload(model)
    model.load_weights(checkpoint(seed).items())
    vllm_reload.finalize_layerwise_reload(model, config.model_config)


class StubRunner:
    """Just enough model runner for vLLM's own ``GPUModelRunner.reload_weights`` (V2) to run unbound on it."""

    def __init__(self, config: VllmConfig, model: nn.Module) -> None:
        self.vllm_config = config
        self.model = model

    def get_model(self) -> nn.Module:
        return self.model

    def get_draft_model(self) -> None:
        return None

    def reset_lora_state(self) -> None: ...

    def reset_encoder_cache(self) -> None: ...

    def reset_mm_cache(self) -> None: ...


def reload_runner_v2(config: VllmConfig, model: nn.Module, seed: int) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    GPUModelRunner.reload_weights(StubRunner(config, model), weights_iterator=iter(checkpoint(seed).items()))


def stub_worker(config: VllmConfig, model: nn.Module) -> Any:
    """vLLM's ``Worker`` object without its device set-up, with a real weight-transfer engine (IPC)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.vllm_config = config
    worker.model_runner = StubRunner(config, model)
    worker.weight_transfer_engine = IPCWeightTransferEngine(
        WeightTransferConfig(backend="ipc"), config, torch.device("cpu"), model
    )
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    return worker


def reload_worker_rpc(config: VllmConfig, model: nn.Module, seed: int) -> None:
    """What ``collective_rpc("reload_weights", kwargs=...)`` runs on each worker."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = stub_worker(config, model)
    worker.model_runner.reload_weights = lambda **kw: reload_runner_v2(config, model, seed)
    Worker.reload_weights(worker, weights_iterator=None)


def reload_weight_transfer(config: VllmConfig, model: nn.Module, seed: int) -> None:
    """The weight-transfer route: ``start_weight_update``, chunks load, ``finish_weight_update`` (the IPC
    engine's receive needs CUDA, so the chunks are loaded the way its receiver does: ``model.load_weights``)."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = stub_worker(config, model)
    Worker.start_weight_update(worker)
    model.load_weights(checkpoint(seed).items())
    Worker.finish_weight_update(worker)


ROUTES = {
    "reload_weights": reload_inplace,
    "runner_v2.reload_weights": reload_runner_v2,
    "worker.reload_weights": reload_worker_rpc,
    "trio": reload_trio,
    "weight_transfer": reload_weight_transfer,
}


# -- without the plugin: what vLLM 0.33 does on its own -------------------------------------------------------------
def test_without_plugin_plain_attributes_drift_and_nonpersistent_buffers_go_stale(vllm_config: VllmConfig) -> None:
    gs_vllm.unregister()
    model = build(vllm_config, seed=0)
    before = addresses(model)
    old_norm = model.up.row_norm.clone()
    reload_inplace(vllm_config, model, seed=1)
    after = addresses(model)
    for name in ("up.weight", "up.weight_scale", "up.row_norm"):
        assert after[name] == before[name], f"vLLM itself keeps {name} in place"
    moved = {name for name in before if after[name] != before[name]}
    assert {"qkv.w_t", "up.perm", "down.workspace", "down.strides"} <= moved
    fresh = build(vllm_config, seed=1)
    assert not torch.equal(fresh.up.row_norm, old_norm), "the seeds must differ"
    assert torch.equal(model.up.row_norm, old_norm), "vLLM 0.33 puts the old non-persistent buffer back, stale"


# -- with the plugin -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_migrate_keeps_every_address_and_matches_a_fresh_load(
    vllm_config: VllmConfig, plugin: Callable[..., Any], route: str
) -> None:
    plugin("migrate")
    model = build(vllm_config, seed=0)
    before = addresses(model)
    captured_w_t = model.qkv.w_t
    old_norms = {name: t.clone() for name, t in derived(model).items() if name.endswith("row_norm")}
    ROUTES[route](vllm_config, model, 2)
    assert addresses(model) == before
    assert model.qkv.w_t is captured_w_t
    fresh = build(vllm_config, seed=2)
    for name, tensor in derived(fresh).items():
        if name in old_norms:  # a derived non-persistent buffer: vLLM keeps the first load's, with or without us
            assert torch.equal(derived(model)[name], old_norms[name]), name
        else:
            assert torch.equal(derived(model)[name], tensor), name
    state = gs_vllm.current_state()
    outcome = state.last_outcome
    assert outcome is not None and outcome.committed
    assert {f.path for f in outcome.auto_restored} >= {"w_t", "perm", "quant_method.kernel.workspace"}
    assert state.contracts[model].serving_safe


def test_migrate_restores_layer_by_layer_before_finalize(vllm_config: VllmConfig, plugin: Callable[..., Any]) -> None:
    """Each layer is restored right after its own PWAL, not at the end (its new tensors can be freed at once)."""
    plugin("migrate")
    model = build(vllm_config, seed=0)
    captured = model.up.w_t
    seen_during: list[bool] = []
    original = layerwise.finalize_layerwise_processing

    def spy(m: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen_during.append(m.up.w_t is captured)
        return original(m, *args, **kwargs)

    layerwise.finalize_layerwise_processing = spy
    try:
        reload_inplace(vllm_config, model, seed=3)
    finally:
        layerwise.finalize_layerwise_processing = original
    assert seen_during == [True]
    report = gs_vllm.current_state().last_report
    assert report["layers_processed"] == 3 and report["deferred_to_finalize"] == []


def test_the_nonpersistent_fix_is_removed_and_buffers_keep_what_vllm_keeps(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """The old opt-in copied memory no PWAL wrote (FoPE's inv_freq became 1.9e12, its cache NaN) and reported
    it committed: it cannot tell which buffers PWAL rebuilt, so it is gone, and asking for it is an error."""
    with pytest.raises(gs_vllm.ConfigError, match="GRAPHSAFE_FIX_NONPERSISTENT was removed"):
        plugin("migrate", fix_nonpersistent="1")
    plugin("migrate", fix_nonpersistent="0")
    model = build(vllm_config, seed=0)
    old = model.down.row_norm.clone()
    address = model.down.row_norm.data_ptr()
    reload_inplace(vllm_config, model, seed=4)
    assert model.down.row_norm.data_ptr() == address
    assert torch.equal(model.down.row_norm, old), "vLLM's own behaviour stands: nothing is written into it"
    report = gs_vllm.current_state().last_report
    assert report["outcome"]["status"] == "committed"
    assert "nonpersistent_fixed" not in report


def test_report_is_written_after_each_reload(
    vllm_config: VllmConfig, plugin: Callable[..., Any], tmp_path: Any
) -> None:
    plugin("migrate", report=str(tmp_path / "reload-{rank}.json"))
    model = build(vllm_config, seed=0)
    reload_inplace(vllm_config, model, seed=6)
    report = json.loads((tmp_path / "reload-0.json").read_text())
    assert report["outcome"]["status"] == "committed"
    assert report["mode"] == "migrate"
    restored = {(f["layer"], f["path"]) for f in report["outcome"]["findings"] if f["kind"] == "auto-restored"}
    assert ("qkv", "w_t") in restored and ("down", "quant_method.kernel.strides") in restored
    assert report["migration"]["entries"], "the migration report names what to declare"


# -- strict ---------------------------------------------------------------------------------------------------------
def test_strict_raises_through_reload_weights_and_then_refuses(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    plugin("strict")
    model = build(vllm_config, seed=0)
    with pytest.raises(UndeclaredDriftError) as info:
        reload_runner_v2(vllm_config, model, seed=7)
    assert "w_t" in str(info.value) and "qkv" in str(info.value)
    assert info.value.outcome is not None and info.value.outcome.status.value == "failed"
    contract = gs_vllm.current_state().contracts[model]
    assert not contract.serving_safe
    with pytest.raises(NotServingSafeError):
        reload_inplace(vllm_config, model, seed=8)


def test_strict_commits_when_the_author_declared_the_tensors(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    plugin("strict")
    model = build(vllm_config, seed=0, method=DeclaredLinearMethod)
    before = addresses(model)
    reload_inplace(vllm_config, model, seed=9)
    outcome = gs_vllm.current_state().last_outcome
    assert outcome is not None and outcome.committed and not outcome.auto_restored
    moved = {n for n, a in addresses(model).items() if a != before[n]}
    assert moved == set(), moved
    assert torch.equal(model.qkv.w_t, build(vllm_config, seed=9).qkv.w_t)


def test_strict_commits_when_a_pack_entry_declares_an_unedited_class(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    plugin("strict")
    hooks = HookSet()
    entry = _pack.PackEntry(f"{__name__}:DerivedLinearMethod", DECLARED, "test: the zoo's kinds of tensors")
    try:
        result = _pack.apply_pack([entry], hooks.patch)
        assert result.applied == [entry] and not result.stale
        model = build(vllm_config, seed=0)
        reload_trio(vllm_config, model, seed=10)
        assert gs_vllm.current_state().last_outcome.committed
        assert result.usage[entry.name]["w_t"][0] >= 6  # 3 layers x (first load + reload)
    finally:
        hooks.uninstall()
    assert not hasattr(DerivedLinearMethod.process_weights_after_loading, _pack.PACK_ATTR), "uninstalled"


def test_a_reload_that_raises_midway_fails_closed(vllm_config: VllmConfig, plugin: Callable[..., Any]) -> None:
    plugin("migrate")
    model = build(vllm_config, seed=0)

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        items = list(checkpoint(11).items())
        yield from items[:4]
        raise OSError("checkpoint shard vanished")

    with pytest.raises(OSError, match="vanished"):
        inplace.reload_weights(vllm_config, model, broken(), None, True)
    state = gs_vllm.current_state()
    assert state.last_outcome is not None and state.last_outcome.status.value == "failed"
    assert any(f.kind.value == "reload-error" for f in state.last_outcome.findings)
    assert not state.contracts[model].serving_safe
    assert model not in state.sessions


# -- recapture ---------------------------------------------------------------------------------------------------------
class SpyManager:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def release_graphs(self) -> None:
        self.calls.append("release")


class SpyRunner(StubRunner):
    """A model runner V2 whose capture is a spy; the rest of the sequence is vLLM's own code."""

    def __init__(self, config: VllmConfig, model: nn.Module, calls: list[str]) -> None:
        super().__init__(config, model)
        self.calls = calls
        self.cudagraph_manager = SpyManager(calls)
        self.req_states = SimpleNamespace(req_id_to_index={})
        self.block_tables = SimpleNamespace(redirect_writes_to_null_block=False)
        self.kv_block_zeroer = None

    def _remove_request(self, req_id: str) -> None:  # what vLLM's preserve_serving_state calls
        self.req_states.req_id_to_index.pop(req_id, None)

    def capture_model(self) -> int:
        redirect = self.block_tables.redirect_writes_to_null_block
        self.calls.append(f"capture(redirect_writes_to_null_block={redirect})")
        return 0


@pytest.fixture
def workspace(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """vLLM's real workspace manager on CPU, its lock/unlock recorded."""
    from vllm.v1.worker import workspace as ws

    calls: list[str] = []
    ws.init_workspace_manager(torch.device("cpu"))
    lock, unlock = ws.lock_workspace, ws.unlock_workspace
    monkeypatch.setattr(ws, "lock_workspace", lambda: (calls.append("lock"), lock())[-1])
    monkeypatch.setattr(ws, "unlock_workspace", lambda: (calls.append("unlock"), unlock())[-1])
    yield calls
    ws.reset_workspace_manager()


def test_recapture_runs_vllms_sequence_then_reseals(
    vllm_config: VllmConfig, plugin: Callable[..., Any], workspace: list[str]
) -> None:
    plugin("recapture")
    model = build(vllm_config, seed=0)
    runner = SpyRunner(vllm_config, model, workspace)
    gs_vllm.bind(model, runner)
    reload_inplace(vllm_config, model, seed=12)
    assert workspace == ["release", "unlock", "capture(redirect_writes_to_null_block=True)", "lock"]
    state = gs_vllm.current_state()
    assert state.last_outcome.needs_recapture
    contract = state.contracts[model]
    assert contract.serving_safe
    # resealed on the new tensors: the next reload tracks them, not the pre-recapture ones
    sealed = {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots()}
    assert sealed[("qkv", "w_t")] == model.qkv.w_t.data_ptr()
    assert not runner.block_tables.redirect_writes_to_null_block, "serving state restored after capture"


def test_recapture_refuses_with_requests_in_flight(
    vllm_config: VllmConfig, plugin: Callable[..., Any], workspace: list[str]
) -> None:
    plugin("recapture")
    model = build(vllm_config, seed=0)
    runner = SpyRunner(vllm_config, model, workspace)
    runner.req_states.req_id_to_index["req-0"] = 0
    gs_vllm.bind(model, runner)
    with pytest.raises(RecaptureError, match="in flight"):
        reload_inplace(vllm_config, model, seed=13)
    assert "capture(redirect_writes_to_null_block=True)" not in workspace
    assert not gs_vllm.current_state().contracts[model].serving_safe


def test_recapture_without_a_runner_raises_naming_the_fix(vllm_config: VllmConfig, plugin: Callable[..., Any]) -> None:
    plugin("recapture")
    model = build(vllm_config, seed=0)
    with pytest.raises(RecaptureError, match="no vLLM model runner"):
        reload_trio(vllm_config, model, seed=14)


def test_recapture_is_not_called_when_nothing_drifted(
    vllm_config: VllmConfig, plugin: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin("recapture")
    calls: list[Any] = []
    monkeypatch.setattr(_recapture, "recapture_runner", lambda *a, **k: calls.append(a))
    model = build(vllm_config, seed=0, method=DeclaredLinearMethod)
    gs_vllm.bind(model, SpyRunner(vllm_config, model, []))
    reload_inplace(vllm_config, model, seed=15)
    assert gs_vllm.current_state().last_outcome.committed
    assert calls == []


def test_runner_hooks_bind_seal_and_record_what_the_capture_read(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """The wrappers vLLM's runners get: load binds and seals; capture records the manifest and reseals.

    vLLM's own capture needs CUDA, so the wrappers are applied here to stand-ins with the same signatures; the
    capture stand-in runs the model's forward, which ``record_capture`` records as it would a graph capture.
    """
    from graphsafe.adapters.vllm import _hooks

    state = plugin("migrate", manifest="1")
    model = build(vllm_config, seed=0)
    runner = StubRunner(vllm_config, model)
    _hooks._wrap_runner_load(state)(lambda self: None)(runner)
    assert state.runner_of(model) is runner
    contract = state.contracts[model]
    assert contract.sealed and contract.manifest is None

    def capture(self: Any) -> int:
        with torch.no_grad():
            self.get_model()(x_input())
        return 0

    _hooks._wrap_capture(state)(capture)(runner)
    manifest = contract.manifest
    assert manifest is not None and len(manifest) > 0
    captured = {entry.data_ptr for entry in manifest.storages()}
    assert model.qkv.w_t.untyped_storage().data_ptr() in captured, "the forward read w_t; the manifest saw it"
    reload_inplace(vllm_config, model, seed=21)
    assert state.last_outcome.committed
    assert not [f for f in state.last_outcome.problems if f.kind.value == "orphaned"]


def test_the_recorded_manifest_catches_drift_the_slots_do_not_track(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """With the walker off (declared-only) nothing tracks w_t, but the capture read it: the manifest fails it."""
    from graphsafe.adapters.vllm import _hooks
    from graphsafe.errors import ContractViolation

    state = plugin("strict", manifest="1", detect="declared-only")
    model = build(vllm_config, seed=0)
    runner = StubRunner(vllm_config, model)
    _hooks._wrap_runner_load(state)(lambda self: None)(runner)

    def capture(self: Any) -> int:
        with torch.no_grad():
            self.get_model()(x_input())
        return 0

    _hooks._wrap_capture(state)(capture)(runner)
    with pytest.raises(ContractViolation) as info:
        reload_inplace(vllm_config, model, seed=22)
    # nothing else held the old w_t, so its storage was freed: the graph would read freed memory
    lost = [f for f in info.value.outcome.problems if f.kind.value in ("dead", "orphaned")]
    assert any(f.path == "w_t" and f.layer == "qkv" for f in lost), [f.describe() for f in lost]


# -- the worker extension ------------------------------------------------------------------------------------------
def test_worker_extension_reports_outcome_and_mixes_into_vllms_worker(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    plugin("migrate")
    for attr in dir(gs_vllm.GraphsafeWorkerExtension):
        if not attr.startswith("__"):
            assert not hasattr(Worker, attr), f"vLLM refuses extensions whose {attr!r} collides with Worker"
    model = build(vllm_config, seed=0)

    class Extended(gs_vllm.GraphsafeWorkerExtension):
        model_runner = StubRunner(vllm_config, model)

    worker = Extended()
    assert worker.graphsafe_last_outcome() is None
    reload_weight_transfer(vllm_config, model, seed=16)
    outcome = worker.graphsafe_last_outcome()
    assert outcome["status"] == "committed" and outcome["slots_restored"] > 0
    status = worker.graphsafe_status()
    assert status["mode"] == "migrate" and status["serving_safe"] and status["reloads"] == 1
    assert worker.graphsafe_last_report()["outcome"] == outcome


def test_worker_extension_recapture_brings_a_failed_contract_back(
    vllm_config: VllmConfig, plugin: Callable[..., Any], workspace: list[str]
) -> None:
    plugin("strict")
    model = build(vllm_config, seed=0)

    class Extended(gs_vllm.GraphsafeWorkerExtension):
        model_runner = SpyRunner(vllm_config, model, workspace)

    worker = Extended()
    with pytest.raises(UndeclaredDriftError):
        reload_inplace(vllm_config, model, seed=17)
    assert worker.graphsafe_status()["serving_safe"] is False
    with pytest.raises(NotServingSafeError):
        reload_inplace(vllm_config, model, seed=18)
    result = worker.graphsafe_recapture()
    assert result["recaptured"] and result["serving_safe"]
    assert "capture(redirect_writes_to_null_block=True)" in workspace
    # resealed on the tensors the new graphs read...
    contract = gs_vllm.current_state().contracts[model]
    sealed = {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots()}
    assert sealed[("qkv", "w_t")] == model.qkv.w_t.data_ptr()
    # ...and strict still fails closed on the same undeclared drift (nothing was silently relaxed)
    with pytest.raises(UndeclaredDriftError):
        reload_inplace(vllm_config, model, seed=19)


def test_a_failed_weight_transfer_chunk_fails_the_open_reload(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    plugin("migrate")
    model = build(vllm_config, seed=0)
    worker = stub_worker(vllm_config, model)
    Worker.start_weight_update(worker)
    state = gs_vllm.current_state()
    assert model in state.sessions
    with pytest.raises(ValueError, match="Invalid update_info"):
        Worker.update_weights(worker, {"not_a_field": 1})
    assert model not in state.sessions
    assert state.last_outcome is not None and state.last_outcome.status.value == "failed"
    assert not state.contracts[model].serving_safe
    with pytest.raises(NotServingSafeError):
        Worker.start_weight_update(worker)


def _tp_rank(rank: int, folder: str) -> None:
    """One rank of a TP=2 group (spawned): rank 1's quant method is undeclared, rank 0's declared."""
    os.environ["GRAPHSAFE_MODE"] = "strict"
    config = make_config(folder)
    result: dict[str, Any] = {"rank": rank}
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=2, rank=rank, local_rank=rank, distributed_init_method=f"file://{folder}/dist", backend="gloo"
        )
        parallel_state.initialize_model_parallel(2, 1, backend="gloo")
        try:
            gs_vllm.register()
            _recapture.no_graphs = lambda runner: None  # an engine that captures graphs (see plugin())
            model = build(config, seed=0, method=DerivedLinearMethod if rank == 1 else DeclaredLinearMethod)
            result["shard_rows"] = model.qkv.weight.shape[0]
            try:
                reload_inplace(config, model, seed=20)
                result["error"] = None
            except Exception as exc:
                result["error"] = type(exc).__name__
                outcome = getattr(exc, "outcome", None)
                if outcome is not None:
                    result["status"] = outcome.status.value
                    result["rank_statuses"] = [[r, st.value] for r, st in outcome.rank_statuses]
                    result["remote_findings"] = sorted({f.path for f in outcome.findings if f.rank not in (None, rank)})
        finally:
            gs_vllm.unregister()
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)


def test_tensor_parallel_ranks_agree_on_one_outcome() -> None:
    """TP=2 through vLLM's TP group: rank 0 alone would commit, but rank 1 drifted, so both fail."""
    import multiprocessing

    folder = tempfile.mkdtemp(prefix="graphsafe-vllm-tp-")
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_tp_rank, args=(rank, folder)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
        assert process.exitcode == 0, f"rank process exited with {process.exitcode}"
    results = {}
    for rank in range(2):
        with open(os.path.join(folder, f"rank{rank}.json")) as handle:
            results[rank] = json.load(handle)
    assert results[0]["shard_rows"] == (HEADS + 2 * KV_HEADS) * HEAD // 2, "each rank holds its own shard"
    assert results[1]["error"] == "UndeclaredDriftError"
    assert results[0]["error"] == "RankAgreementError", results[0]  # failed because a peer failed
    for rank in range(2):
        assert results[rank]["status"] == "failed"
        assert sorted(map(tuple, results[rank]["rank_statuses"])) == [(0, "committed"), (1, "failed")]
    assert "w_t" in results[0]["remote_findings"], "rank 0 is told what drifted on rank 1"


# -- plugin loading, the guard, the pack ---------------------------------------------------------------------------
def test_vllm_loads_the_plugin_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.plugins

    gs_vllm.unregister()
    monkeypatch.setenv("VLLM_PLUGINS", "graphsafe")
    monkeypatch.setenv("GRAPHSAFE_MODE", "strict")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        vllm.plugins.load_general_plugins()
        state = gs_vllm.current_state()
        assert state is not None and state.config.mode == "strict"
        for fn in (
            layerwise._layerwise_process,
            vllm_reload.initialize_layerwise_reload,
            inplace.initialize_layerwise_reload,
            layerwise.finalize_layerwise_processing,
        ):
            assert hasattr(fn, ORIGINAL_ATTR)
        wrapped = layerwise._layerwise_process
        assert gs_vllm.register() is state  # idempotent: no second wrapper around the first
        assert layerwise._layerwise_process is wrapped
        assert not hasattr(getattr(wrapped, ORIGINAL_ATTR), ORIGINAL_ATTR)
    finally:
        gs_vllm.unregister()
    assert not hasattr(layerwise._layerwise_process, ORIGINAL_ATTR)


def test_mode_off_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    gs_vllm.unregister()
    monkeypatch.setenv("GRAPHSAFE_MODE", "off")
    assert gs_vllm.register() is None
    assert not hasattr(layerwise._layerwise_process, ORIGINAL_ATTR)


def test_bad_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    gs_vllm.unregister()
    monkeypatch.setenv("GRAPHSAFE_MODE", "warn")
    with pytest.raises(gs_vllm.ConfigError, match="GRAPHSAFE_MODE='warn'"):
        gs_vllm.register()


def test_every_hook_point_exists_in_the_installed_vllm() -> None:
    found, unavailable = _guard.resolve_all()
    assert unavailable == {}
    assert set(found) == {p.name for p in _guard.HOOK_POINTS}


def test_a_missing_hook_makes_the_plugin_refuse_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    gs_vllm.unregister()
    monkeypatch.setenv("GRAPHSAFE_MODE", "migrate")
    monkeypatch.delattr(layerwise, "_layerwise_process")
    with pytest.raises(gs_vllm.HookMismatchError, match=r"reload\.layerwise:_layerwise_process is missing"):
        gs_vllm.register()
    assert gs_vllm.current_state() is None
    monkeypatch.setenv("GRAPHSAFE_MODE", "off")
    assert gs_vllm.register() is None  # the documented way to run such a vLLM


def test_a_resigned_hook_makes_the_plugin_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    gs_vllm.unregister()
    monkeypatch.setenv("GRAPHSAFE_MODE", "migrate")
    monkeypatch.setattr(GPUModelRunner, "reload_weights", lambda self, weights: None)
    with pytest.raises(gs_vllm.HookMismatchError, match=r"GPUModelRunner\.reload_weights has parameters"):
        gs_vllm.register()


def test_another_vllm_version_is_refused_when_the_operator_asked_for_graphsafe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gs_vllm.unregister()
    monkeypatch.setenv("GRAPHSAFE_MODE", "migrate")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(gs_vllm.HookMismatchError, match=r"supports vLLM 0\.32\.x or 0\.33\.x, but vLLM 0\.34\.0"):
        gs_vllm.register()
    assert gs_vllm.current_state() is None


def test_an_unsupported_vllm_runs_without_graphsafe_when_no_mode_is_set(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Installing graphsafe must not stop a vLLM upgrade from serving: no GRAPHSAFE_MODE, no refusal."""
    from graphsafe.adapters.vllm import _plugin

    gs_vllm.unregister()
    for name in GRAPHSAFE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_plugin, "_SAID_OFF", False)
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with caplog.at_level("INFO", logger="graphsafe.vllm"):
        assert gs_vllm.register() is None
        assert gs_vllm.register() is None  # vLLM registers plugins in every process, more than once
    lines = [r.getMessage() for r in caplog.records if r.name == "graphsafe.vllm"]
    assert len(lines) == 1 and "GRAPHSAFE_MODE is unset" in lines[0] and "0.31.0" in lines[0], lines
    assert gs_vllm.current_state() is None
    assert not hasattr(layerwise._layerwise_process, ORIGINAL_ATTR)
    monkeypatch.setattr(layerwise, "_layerwise_process", None)  # a hook gone in a newer vLLM: still off, no raise
    monkeypatch.setattr(vllm, "__version__", "0.33.9")
    assert gs_vllm.register() is None


def test_the_hook_guard_knows_vllm_0_32_and_0_33() -> None:
    for version in ("0.32.0", "0.32.1", "0.33.0", "0.33.2"):
        _guard.check_version(version)
    for version in ("0.31.9", "0.34.0", "1.0.0"):
        with pytest.raises(gs_vllm.HookMismatchError):
            _guard.check_version(version)


def test_the_pack_matches_the_installed_vllm_and_reports_a_stale_entry() -> None:
    assert vllm.__version__.startswith("0.33.")
    result = gs_vllm.validate_pack()
    assert result.stale == [], [s.reason for s in result.stale]
    assert len(result.applied) == len(gs_vllm.PACK)
    fake = gs_vllm.PackEntry(
        "vllm.model_executor.layers.quantization.fp8:Fp8NoSuchMoEMethod", ("quant_method.workspace",), "fake"
    )
    wrong_method = gs_vllm.PackEntry(
        "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod", ("x",), "fake", method="no_such_pwal"
    )
    result = gs_vllm.validate_pack([*gs_vllm.PACK, fake, wrong_method])
    assert [s.entry for s in result.stale] == [fake, wrong_method]
    assert "has no class 'Fp8NoSuchMoEMethod'" in result.stale[0].reason
    assert "has no method 'no_such_pwal'" in result.stale[1].reason


def test_the_pack_is_applied_at_plugin_load_and_declares_vllm_classes(plugin: Callable[..., Any]) -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    from graphsafe import graph_visible_spec

    state = plugin("strict")
    assert state.pack.stale == []
    spec = graph_visible_spec(Fp8MoEMethod.process_weights_after_loading)
    assert spec is not None and "quant_method.moe_kernel.impl.fused_experts.ab_strides1" in spec.paths
    assert "W_UV" in graph_visible_spec(MLAAttention.process_weights_after_loading).paths
    gs_vllm.unregister()
    assert graph_visible_spec(Fp8MoEMethod.process_weights_after_loading) is None


def test_import_graphsafe_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, graphsafe, graphsafe.adapters.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- vLLM's real lifecycle ------------------------------------------------------------------------------------------
MODES = ("strict", "recapture", "migrate")


@pytest.mark.parametrize("mode", MODES)
def test_a_second_initialize_settles_the_open_reload_by_what_is_true(
    vllm_config: VllmConfig, plugin: Callable[..., Any], mode: str
) -> None:
    """vLLM processed and put back every layer, and nobody finalized: the next reload settles the open one by
    verifying it, commits it, and goes on (the plugin used to fail it and refuse every later reload)."""
    plugin(mode)
    model = build(vllm_config, seed=0, method=DeclaredLinearMethod)
    before = addresses(model)
    vllm_reload.initialize_layerwise_reload(model)
    model.load_weights(checkpoint(1).items())  # every layer complete: each processed and copied back at once
    state = gs_vllm.current_state()
    assert model in state.sessions, "the first reload is still open (no finalize)"
    reload_inplace(vllm_config, model, seed=2)
    contract = state.contracts[model]
    assert contract.reloads == 2 and contract.serving_safe
    assert state.last_outcome is not None and state.last_outcome.committed
    assert addresses(model) == before
    for name, tensor in derived(build(vllm_config, seed=2, method=DeclaredLinearMethod)).items():
        if not name.endswith("row_norm"):
            assert torch.equal(derived(model)[name], tensor), name


@pytest.mark.parametrize("mode", MODES)
def test_the_sharded_rdt_bake_sequence_then_a_weight_update_commits(
    vllm_config: VllmConfig, plugin: Callable[..., Any], mode: str
) -> None:
    """vLLM 0.33's sharded RDT engine bakes its plan at init_transfer_engine: initialize, a load on meta, then its
    own restore of the kernel tensors, never a finalize. The first real weight update must go through."""
    from vllm.distributed.weight_transfer.sharded_rdt_engine import ShardedRDTWeightTransferEngine
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    from vllm.v1.worker.gpu_worker import Worker

    plugin(mode)
    model = build(vllm_config, seed=0, method=DeclaredLinearMethod)
    before = addresses(model)
    weights = {name: t.clone() for name, t in derived(model).items()}
    layerwise.initialize_layerwise_reload(model)  # _bake: params to meta, kernel tensors saved
    for module in model.modules():  # _bake stamps the original loaders, bypassing online_process_loader...
        for tensor in get_layer_tensors(module).values():
            tensor.weight_loader = layerwise._get_original_loader(tensor)
    model.load_weights((name, t.to("meta")) for name, t in checkpoint(3).items())  # ...and loads on meta
    ShardedRDTWeightTransferEngine._restore_after_dry_run(None, model)  # vLLM's own restore (no self state read)
    assert addresses(model) == before
    for name, tensor in derived(model).items():
        assert torch.equal(tensor, weights[name]), name
    worker = stub_worker(vllm_config, model)
    Worker.start_weight_update(worker)
    model.load_weights(checkpoint(3).items())
    Worker.finish_weight_update(worker)
    state = gs_vllm.current_state()
    assert state.last_outcome is not None and state.last_outcome.committed
    assert state.contracts[model].serving_safe and addresses(model) == before
    assert torch.equal(model.qkv.w_t, build(vllm_config, seed=3, method=DeclaredLinearMethod).qkv.w_t)


class _Scheduler:
    """What the in-flight check reads of vLLM's scheduler: the ids it finished since its last schedule()."""

    def __init__(self, finished: set[str]) -> None:
        self.finished_req_ids = finished


@pytest.mark.parametrize("runner_version", ["v1", "v2"])
def test_requests_the_scheduler_finished_are_not_in_flight(
    vllm_config: VllmConfig, plugin: Callable[..., Any], workspace: list[str], runner_version: str
) -> None:
    """An engine in the caller's process stops stepping when nothing is unfinished, so its runner still lists
    the finished requests: the recapture must not count them (and still refuses a request really in flight)."""
    state = plugin("recapture")
    model = build(vllm_config, seed=0)
    runner = SpyRunner(vllm_config, model, workspace)
    requests: dict[str, int] = {"done-0": 0, "done-1": 1}
    if runner_version == "v1":
        del runner.req_states
        runner.requests = requests
    else:
        runner.req_states.req_id_to_index = requests
    scheduler = _Scheduler({"done-0", "done-1"})
    state.schedulers.add(scheduler)
    gs_vllm.bind(model, runner)
    reload_inplace(vllm_config, model, seed=24)
    assert state.last_outcome.needs_recapture and state.contracts[model].serving_safe
    assert any(call.startswith("capture") for call in workspace)
    requests["live"] = 2
    with pytest.raises(RecaptureError, match="1 request"):
        reload_inplace(vllm_config, model, seed=25)


def test_the_scheduler_hook_remembers_vllms_schedulers(plugin: Callable[..., Any]) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from graphsafe.adapters.vllm import _hooks

    state = plugin("migrate")
    assert hasattr(Scheduler.__init__, ORIGINAL_ATTR), "installed on vLLM's scheduler"
    seen: list[tuple[Any, ...]] = []
    init = _hooks._wrap_scheduler_init(state)(lambda self, *args: seen.append(args))
    scheduler = object.__new__(Scheduler)
    init(scheduler, "config")
    assert seen == [("config",)] and scheduler in state.schedulers


@pytest.mark.parametrize("mode", MODES)
def test_with_no_graphs_a_drifting_reload_restores_and_commits(
    vllm_config: VllmConfig,
    plugin: Callable[..., Any],
    workspace: list[str],
    mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On this CPU platform no graph is captured: findings a recapture would fix read no wrong memory, so the
    reload commits in every mode, runs no recapture, and strict says once that it has nothing to protect."""
    plugin(mode, graphs=False)
    model = build(vllm_config, seed=0)
    runner = SpyRunner(vllm_config, model, workspace)
    gs_vllm.bind(model, runner)
    before = addresses(model)
    with caplog.at_level("INFO", logger="graphsafe.vllm"):
        reload_inplace(vllm_config, model, seed=26)
        reload_runner_v2(vllm_config, model, seed=27)
    state = gs_vllm.current_state()
    assert state.last_outcome.committed and state.contracts[model].serving_safe
    assert workspace == [], "nothing to recapture"
    after = addresses(model)
    assert {n: a for n, a in after.items() if n.endswith(("weight", "weight_scale"))} == {
        n: a for n, a in before.items() if n.endswith(("weight", "weight_scale"))
    }
    if mode == "migrate":
        assert after == before, "migrate restores undeclared tensors all the same"
    assert torch.equal(model.qkv.w_t, build(vllm_config, seed=27).qkv.w_t)
    said = [r.getMessage() for r in caplog.records if "nothing to protect" in r.getMessage()]
    assert len(said) == (1 if mode == "strict" else 0), said


def test_no_graphs_rule(vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False), vllm_config=vllm_config)
    assert "captures no CUDA graphs" in (_recapture.no_graphs(runner) or "")  # this machine's CPU platform
    monkeypatch.setattr(_recapture, "platform_has_graphs", lambda: True)
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setattr(vllm_config.compilation_config, "cudagraph_mode", CUDAGraphMode.FULL_AND_PIECEWISE)
    assert _recapture.no_graphs(runner) is None
    assert _recapture.no_graphs(None) is None
    runner.model_config.enforce_eager = True
    assert _recapture.no_graphs(runner) == "enforce_eager"
    runner.model_config.enforce_eager = False
    monkeypatch.setattr(vllm_config.compilation_config, "cudagraph_mode", CUDAGraphMode.NONE)
    assert _recapture.no_graphs(runner) == "cudagraph_mode is NONE"
    assert "no graphs" in (_recapture.no_graphs(SimpleNamespace(cudagraph_manager=None)) or "")


class RejectingModel(TinyModel):
    """Does what vLLM's expert substitution does on a layerwise reload: put the old weights back, then raise."""

    def __init__(self, method: type[DerivedLinearMethod], config: VllmConfig) -> None:
        super().__init__(method)
        self.model_config = config.model_config

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.qkv.weight.is_meta:
            vllm_reload.finalize_layerwise_reload(self, self.model_config)
            raise NotImplementedError("this model does not support layerwise weight reload")
        return super().load_weights(weights)


@pytest.mark.parametrize("mode", MODES)
def test_a_reload_vllm_rejects_is_failed_and_carries_vllms_error(
    vllm_config: VllmConfig, plugin: Callable[..., Any], mode: str
) -> None:
    plugin(mode)
    with set_current_vllm_config(vllm_config):
        model = RejectingModel(DeclaredLinearMethod, vllm_config)
        layerwise.record_metadata_for_reloading(model)
        model.load_weights(checkpoint(0).items())
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    weights = {name: t.clone() for name, t in derived(model).items()}
    with pytest.raises(NotImplementedError, match="layerwise weight reload") as info:
        reload_inplace(vllm_config, model, seed=28)
    state = gs_vllm.current_state()
    outcome = state.contracts[model].last_outcome
    assert outcome is state.last_outcome and outcome.status.value == "failed"
    assert outcome.error is info.value
    assert any(f.kind.value == "reload-error" and "NotImplementedError" in f.detail for f in outcome.findings)
    assert state.last_report["outcome"]["status"] == "failed"
    for name, tensor in derived(model).items():  # vLLM put the old weights back, and graphsafe verified them
        assert torch.equal(tensor, weights[name]), name
    assert state.contracts[model].serving_safe


def _dispatcher(config: VllmConfig, monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    compilation = config.compilation_config
    monkeypatch.setattr(compilation, "cudagraph_mode", CUDAGraphMode.PIECEWISE)
    monkeypatch.setattr(compilation, "cudagraph_capture_sizes", [1, 2, 4, 8])
    monkeypatch.setattr(compilation, "max_cudagraph_capture_size", 8)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE, 1)
    return dispatcher


def test_the_serving_gate_runs_eager_after_a_failed_reload_until_the_recapture(
    vllm_config: VllmConfig, plugin: Callable[..., Any], workspace: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed reload, or while a NEEDS_RECAPTURE waits, vLLM's runner dispatches every batch eager: no
    captured graph replays until the recapture succeeded."""
    plugin("strict")
    dispatcher = _dispatcher(vllm_config, monkeypatch)
    assert dispatcher.dispatch(4)[0].name == "PIECEWISE"
    model = build(vllm_config, seed=0)

    class Extended(gs_vllm.GraphsafeWorkerExtension):
        model_runner = SpyRunner(vllm_config, model, workspace)

    assert dispatcher.dispatch(4)[0].name == "PIECEWISE", "serving-safe: graphs replay"
    with pytest.raises(UndeclaredDriftError):
        reload_inplace(vllm_config, model, seed=29)
    mode, descriptor = dispatcher.dispatch(4)
    assert mode.name == "NONE" and descriptor.num_tokens == 4
    assert Extended().graphsafe_recapture()["serving_safe"]
    assert dispatcher.dispatch(4)[0].name == "PIECEWISE"


def test_the_serving_gate_on_model_runner_v2(
    vllm_config: VllmConfig, plugin: Callable[..., Any], workspace: list[str]
) -> None:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager

    state = plugin("recapture")
    full = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4, num_active_loras=0)
    manager = object.__new__(CudaGraphManager)
    original = CudaGraphManager.dispatch.__graphsafe_original__
    from graphsafe.adapters.vllm import _hooks

    gated = _hooks._wrap_dispatch_v2(state)(lambda self, *a, **k: full)
    assert gated(manager, 4, 4, None, 0) is full
    assert CudaGraphManager.dispatch is not original, "installed on vLLM's manager"
    model = build(vllm_config, seed=0)
    gs_vllm.bind(model, StubRunner(vllm_config, model))  # no recapture possible: NEEDS_RECAPTURE stays open
    with pytest.raises(RecaptureError):
        reload_inplace(vllm_config, model, seed=30)
    eager = gated(manager, 4, 4, None, 0)
    assert eager.cg_mode is CUDAGraphMode.NONE and eager.num_tokens == 4 and eager.num_reqs == 4


def test_a_model_loaded_before_the_plugin_gets_the_packs_declarations_at_seal(
    vllm_config: VllmConfig, plugin: Callable[..., Any]
) -> None:
    """GRAPHSAFE_MODE set after the engine loaded: PWAL ran unwrapped, so the pack declares when the contract
    seals (here vLLM's Attention KV cache, serving state the pack marks static)."""
    from vllm.model_executor.layers.attention.attention import Attention

    from graphsafe.adapters.vllm import _hooks
    from graphsafe.registry import declarations_of

    gs_vllm.unregister()
    model = build(vllm_config, seed=0)
    attn = object.__new__(Attention)  # vLLM's class (no attention backend on this platform to build one with)
    nn.Module.__init__(attn)
    attn.kv_cache = torch.zeros(2, 4, KV_HEADS, HEAD)  # what vLLM binds after the load
    model.attn = attn
    assert not declarations_of(attn)
    state = plugin("migrate")
    _hooks._wrap_runner_load(state)(lambda self: None)(StubRunner(vllm_config, model))  # binds and seals
    assert state.contracts[model].sealed
    declared = {name: d.static for name, d in declarations_of(attn).items()}
    assert declared == {"kv_cache": True}, declared


def test_a_re_registered_detect_policy_is_reported_as_the_contract_uses_it(
    vllm_config: VllmConfig, plugin: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM calls ``register()`` again in each process; a changed GRAPHSAFE_DETECT cannot reach a sealed contract
    (its slots were classified under the old policy), so the status and the report must name the policy in use."""
    plugin("migrate", detect="every-reload")
    model = build(vllm_config, seed=0)

    class Extended(gs_vllm.GraphsafeWorkerExtension):
        model_runner = StubRunner(vllm_config, model)

    worker = Extended()
    reload_weight_transfer(vllm_config, model, seed=16)
    assert worker.graphsafe_status()["detect"] == "every-reload"
    with caplog.at_level("WARNING", logger="graphsafe"):
        plugin("migrate", detect="declared-only")
    assert worker.graphsafe_status()["detect"] == "every-reload"
    assert worker.graphsafe_last_report()["detect"] == "every-reload"
    assert any("GRAPHSAFE_DETECT" in r.getMessage() and "every-reload" in r.getMessage() for r in caplog.records)
