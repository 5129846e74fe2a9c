"""Outcome values: status order, finding kinds, and what a real reload's outcome carries and renders (CPU)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import torch

from graphsafe import DeclaredDriftError, Finding, FindingKind, GraphContract, ReloadOutcome, Status

if TYPE_CHECKING:
    from conftest import Tiny


def test_status_worst_orders_failed_over_recapture_over_committed() -> None:
    assert Status.worst() is Status.COMMITTED
    assert Status.worst(Status.COMMITTED, Status.NEEDS_RECAPTURE) is Status.NEEDS_RECAPTURE
    assert Status.worst(Status.NEEDS_RECAPTURE, Status.FAILED, Status.COMMITTED) is Status.FAILED


def test_only_value_and_error_findings_are_beyond_a_recapture() -> None:
    beyond = {kind for kind in FindingKind if not kind.recapture_fixes}
    assert beyond == {FindingKind.STALE, FindingKind.RELOAD_ERROR}
    assert {kind for kind in FindingKind if not kind.is_problem} == {
        FindingKind.AUTO_RESTORED,
        FindingKind.UNREAD_DRIFT,
    }


def test_where_names_the_root_model_explicitly() -> None:
    root = Finding(FindingKind.VANISHED, layer="", layer_class="Net", path="scale", declared=True)
    nested = Finding(FindingKind.VANISHED, layer="layers.1", layer_class="QuantLinear", path="scale", declared=False)
    assert root.where == "<model>:scale"
    assert nested.where == "layers.1:scale"
    assert "undeclared" in nested.describe() and "undeclared" not in root.describe()


def _faulty_outcome(tiny: Tiny) -> ReloadOutcome:
    model = tiny.build(0)
    contract = GraphContract(model, detect="declared-only").seal()
    with pytest.raises(DeclaredDriftError) as info, contract.reload():
        tiny.reload(model, 1)
        model.layers[1].weight_t = model.layers[1].weight_t.to(torch.float64)
    assert info.value.outcome is not None
    return info.value.outcome


def test_a_findings_fingerprints_describe_before_and_after(tiny: Tiny) -> None:
    outcome = _faulty_outcome(tiny)
    (finding,) = outcome.problems
    assert finding.before is not None and finding.after is not None
    assert finding.before.dtype == torch.float32 and finding.after.dtype == torch.float64
    assert finding.before.data_ptr != finding.after.data_ptr
    text = finding.describe()
    assert "layers.1" in text and "'weight_t'" in text and "respecified" in text
    assert "float32" in text and "float64" in text
    summary = outcome.summary()
    assert outcome.status.value in summary and "weight_t" in summary


def test_outcome_to_dict_is_json_and_keeps_the_facts(tiny: Tiny) -> None:
    outcome = _faulty_outcome(tiny)
    data = json.loads(json.dumps(outcome.to_dict()))
    assert data["status"] == "failed" and data["mode"] == "strict"
    assert data["slots_restored"] == outcome.slots_restored > 0
    assert data["bytes_copied"] == outcome.bytes_copied > 0
    (finding,) = data["findings"]
    assert (finding["kind"], finding["layer"], finding["path"]) == ("respecified", "layers.1", "weight_t")
    assert finding["before"]["dtype"] == "float32" and finding["after"]["dtype"] == "float64"
    assert finding["before"]["data_ptr"] == outcome.problems[0].before.data_ptr  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4),
        lambda: torch.nn.Parameter(torch.ones(2, 3), requires_grad=False),
        lambda: torch.arange(24, dtype=torch.int32).reshape(4, 6)[1:, ::2],  # offset, strides
        lambda: torch.ones(3, dtype=torch.complex64).conj(),  # the lazy conjugate bit
        lambda: torch._neg_view(torch.ones(3)),  # the lazy negative bit
        lambda: torch.ones(4)[4:],  # no elements: data_ptr 0, the storage's pointer not
        lambda: torch.ones(2, 1, dtype=torch.bfloat16).t(),
    ],
    ids=["plain", "parameter", "strided-view", "conj", "neg", "empty", "size-1-dim"],
)
def test_fingerprint_of_a_plain_tensor_has_every_field(make: Any) -> None:
    from graphsafe.outcome import fingerprint

    tensor = make()
    storage = tensor.untyped_storage()
    fp = fingerprint(tensor)
    assert (fp.storage_ptr, fp.storage_nbytes, fp.data_ptr, fp.storage_offset) == (
        storage.data_ptr(),
        storage.nbytes(),
        tensor.data_ptr(),
        tensor.storage_offset(),
    )
    assert (fp.shape, fp.stride, fp.dtype, fp.device) == (
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )
    assert type(fp.shape) is tuple and type(fp.stride) is tuple and type(fp.storage_offset) is int
    assert (fp.conj, fp.neg, fp.layout, fp.kind) == (tensor.is_conj(), tensor.is_neg(), torch.strided, torch.Tensor)
    assert fp.storage_ref() is storage and fp.inner == () and fp.meta is None


_FIRST_RELOADS = """
import json, sys, time
import torch
from graphsafe.testing.zoo import EXAMPLES

assert "torch._dynamo" not in sys.modules, "the one-time set-up was paid before the first reload"
ex = EXAMPLES["act_order"]
model = ex.build("legacy")
ex.load_weights(model, ex.make_weights(model, 0))
from graphsafe import GraphContract
contract = GraphContract(model, mode="migrate").seal()
rows = []
for seed in (1, 2):
    weights = ex.make_weights(model, seed)
    start = time.perf_counter()
    with contract.reload() as txn:
        ex.load_weights(model, weights)
    wall = time.perf_counter() - start
    o = txn.outcome
    rows.append({"wall": wall, "seconds": o.seconds, "setup": o.setup_seconds, "summary": o.summary()})
print(json.dumps(rows))
"""


def test_the_first_reload_of_a_process_reports_its_one_time_set_up_apart() -> None:
    """The first reload of a process pays torch's one-time dispatch set-up (it records what PWAL computes): seconds
    on a CPU. The outcome accounts for that time as set-up, apart from the reload's own milliseconds, and later
    reloads carry none."""
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_RELOADS],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": src, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    first, second = json.loads(result.stdout)
    assert first["seconds"] + first["setup"] >= 0.5 * first["wall"], first  # the time is accounted for
    assert first["setup"] > 0 and "one-time set-up" in first["summary"], first
    assert second["setup"] == 0 and "one-time" not in second["summary"], second
