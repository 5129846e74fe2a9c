"""``GraphContract(unread="skip")`` on a real captured CUDA graph: a derived tensor no graph reads is not copied back,
the replay still equals eager after reloads with other weights, and the slots the graph reads stay at their captured
addresses. Run: ``PYTHONPATH=src python -m pytest tests/gpu -q`` (needs cuda-bindings for the kernel scan)."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch import nn

from graphsafe import GraphContract, capture, graph_visible, run_reload
from graphsafe.adapters.torch import CapturedGraph
from graphsafe.collectors import Manifest, kernel_scan_unavailable


class Derived(nn.Module):
    """Forward reads ``up_t`` (derived) and ``down``; PWAL also derives ``unused``, which forward never reads."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    @graph_visible("up_t", "unused")
    def process_weights_after_loading(self) -> None:
        self.up_t = self.up.weight.t().contiguous()  # a NEW tensor on every load, read by forward
        self.unused = (self.down.weight * 2).contiguous()  # a NEW tensor on every load, read by nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(x @ self.up_t + self.up.bias))


def _load(model: Derived, seed: int) -> None:
    generator = torch.Generator(device=model.up.weight.device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * 0.1)
        model.process_weights_after_loading()


def _setup(device: torch.device, unread: str) -> tuple[Derived, GraphContract, torch.Tensor, CapturedGraph]:
    torch.manual_seed(0)
    model = Derived().to(device).eval()
    _load(model, 0)
    x = torch.randn(8, 64, device=device)
    contract = GraphContract(model, "strict", unread=unread)  # type: ignore[arg-type]
    graph = capture(contract, model, x)
    return model, contract, x, graph


@pytest.fixture(autouse=True)
def _needs_the_scan() -> None:
    why = kernel_scan_unavailable()
    if why is not None:
        pytest.skip(why)


def test_storage_weakrefs_follow_the_memory_on_this_torch(device: torch.device, gpu_notes: list[str]) -> None:
    # The skip frees a captured storage only when its weak reference dies once the contract lets go: that needs
    # the storage's Python object to live exactly as long as its memory (torch's PyObject preservation).
    base = torch.randn(16, device=device)
    ref = weakref.ref(base.untyped_storage())
    view = base[4:]
    # The look before letting go counts one use per tensor and one for the Python storage object (a mismatch only
    # costs skips: the weak reference decides).
    uses = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    gpu_notes.append(f"storage use count of a tensor and one view (expected 3 = 2 tensors + the Python object): {uses}")
    del base
    assert ref() is not None, "a view keeps the storage, so its weak reference must stay alive"
    del view
    assert ref() is None


def test_an_unread_derived_tensor_is_not_copied_and_replay_still_equals_eager(
    device: torch.device, gpu_notes: list[str]
) -> None:
    model, contract, x, graph = _setup(device, "skip")
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert manifest.truth() is None, manifest.truth()
    unread = manifest.unread(contract)
    assert unread is not None and ("", "unused") in {(i.layer, i.path) for i in unread}
    assert ("", "up_t") not in {(i.layer, i.path) for i in unread}
    captured = {
        "up_t": model.up_t.data_ptr(),
        "up.weight": model.up.weight.data_ptr(),
        "down.weight": model.down.weight.data_ptr(),
    }
    old_unused = weakref.ref(model.unused.untyped_storage())

    control, control_contract, control_x, _ = _setup(device, "restore")
    for seed in (1, 2):
        outcome = run_reload(contract, functools.partial(_load, model, seed))
        expected = run_reload(control_contract, functools.partial(_load, control, seed))
        assert outcome.committed and expected.committed, outcome.summary()
        assert outcome.slots_skipped == 1, outcome.summary()
        assert expected.bytes_copied - outcome.bytes_copied == model.unused.nbytes, (
            outcome.summary(),
            expected.summary(),
        )
        got = graph.replay().clone()
        torch.cuda.synchronize()
        with torch.no_grad():
            eager = model(x)
        torch.testing.assert_close(got, eager)
        assert torch.equal(model.unused, model.down.weight * 2)  # the reload's values, at the adopted tensor
        now = {"up_t": model.up_t.data_ptr(), "up.weight": model.up.weight.data_ptr()}
        now["down.weight"] = model.down.weight.data_ptr()
        assert now == captured, "a slot the graph reads left its captured address"
        gpu_notes.append(
            f"unread skip, reload {seed}: {outcome.slots_skipped} slot skipped, {outcome.bytes_copied} bytes copied "
            f"(restore: {expected.bytes_copied}); replay == eager"
        )
    assert old_unused() is None, "the captured storage of the skipped slot was not let go"
    del control_x
