"""graphsafe never turns a legal model into a raw torch exception, nor a legal torch operation into a failure.

* A parameter that is a wrapper subclass without the flatten protocol (no storage of its own, no inner tensors to
  reach) seals: its memory cannot be tracked, so every reload reports it ``untrackable`` (fail closed).
* A DTensor parameter (its flatten names the device mesh beside the local shard) seals and reloads through its
  local shard; its placements and mesh are how the shard is read (another placement is ``respecified``).
* ``torch.utils.swap_tensors`` on a sealed tensor, and ``load_state_dict`` under
  ``torch.__future__.set_swap_module_params_on_conversion(True)``, work on a sealed model (graphsafe holds no weak
  reference to a model's tensors, which swap_tensors refuses), and the reload does not commit while the graph's
  captured memory no longer holds the new values.
* A reload adds or removes no torch global hook (torch iterates them on every registration, in every thread).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from graphsafe import FindingKind, GraphContract, ReloadOutcome, Status, register_derived
from graphsafe.collectors import record_capture
from graphsafe.errors import GraphSafeError

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers


def reload(contract: GraphContract, body: Any) -> ReloadOutcome:
    with contract.reload():
        body()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def at_address(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A fresh plain view of ``like``'s geometry on ``storage``: what a replaying graph reads there."""
    view = torch.empty(0, dtype=like.dtype, device=like.device)
    view.set_(storage, like.storage_offset(), like.shape, like.stride())
    return view


# ----------------------------------------------------------------------------------------------------
# A wrapper subclass without the flatten protocol
# ----------------------------------------------------------------------------------------------------


class Opaque(torch.Tensor):
    """A wrapper subclass (``_make_wrapper_subclass``) that keeps its values in a plain attribute and does not
    implement ``__tensor_flatten__``: its memory is out of any tracker's reach."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device, requires_grad=False
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return Opaque(args[0].inner)

        def plain(x: Any) -> Any:
            return x.inner if isinstance(x, Opaque) else x

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_parameter_wrapping_an_unflattenable_wrapper_seals_and_is_untrackable(requires_grad: bool) -> None:
    layer = nn.Linear(4, 4)
    layer.packed = nn.Parameter(Opaque(torch.randn(4, 4)), requires_grad=requires_grad)
    contract = GraphContract(layer, "recapture").seal()  # raised a RuntimeError (invalid python storage)
    outcome = reload(contract, lambda: None)
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert [f.kind for f in outcome.problems] == [FindingKind.UNTRACKABLE]
    assert "packed: cannot fingerprint a Opaque parameter" in outcome.problems[0].detail


# ----------------------------------------------------------------------------------------------------
# DTensor parameters (a process group of one rank)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


def _dtensor(mesh: Any, values: torch.Tensor, placement: str = "shard") -> torch.Tensor:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(values, mesh, [Shard(0) if placement == "shard" else Replicate()])


def _dlayer(mesh: Any) -> nn.Linear:
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(_dtensor(mesh, torch.randn(4, 4)), requires_grad=False)
    return layer


@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_dtensor_parameter_seals_and_commits_a_copy_in_place(mesh: Any, mode: str) -> None:
    layer = _dlayer(mesh)
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]  # raised TypeError (flatten)
    new = torch.randn(4, 4)

    def load() -> None:
        with torch.no_grad():
            layer.weight.copy_(_dtensor(mesh, new))

    outcome = reload(contract, load)
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert torch.equal(layer.weight.to_local(), new)


def test_a_new_dtensor_parameter_is_copied_into_the_captured_local_shard(mesh: Any) -> None:
    layer = _dlayer(mesh)
    captured = layer.weight
    local = captured.to_local()
    storage = local.untyped_storage()
    contract = GraphContract(layer, "strict").seal()
    new = torch.randn(4, 4)
    outcome = reload(contract, lambda: setattr(layer, "weight", nn.Parameter(_dtensor(mesh, new), False)))
    assert outcome.status is Status.COMMITTED, outcome.summary()
    assert layer.weight is captured
    assert torch.equal(at_address(storage, local), new)  # what the graph reads holds the new weight


def test_a_dtensor_bound_with_another_placement_is_respecified(mesh: Any) -> None:
    layer = _dlayer(mesh)
    contract = GraphContract(layer, "recapture").seal()
    new = nn.Parameter(_dtensor(mesh, torch.randn(4, 4), placement="replicate"), requires_grad=False)
    outcome = reload(contract, lambda: setattr(layer, "weight", new))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert {(f.path, f.kind) for f in outcome.problems} == {("weight", FindingKind.RESPECIFIED)}


@pytest.mark.parametrize("pwal", ["delete", "rebuild"])
def test_an_undeclared_view_of_a_dtensor_parameter_pwal_lets_go_of_is_a_finding_not_a_crash(
    mesh: Any, pwal: str
) -> None:
    """Under ``declared-only`` an undeclared tensor is only watched: one PWAL lets go of leaves its captured memory
    abandoned. A view of a DTensor parameter owns no storage (its local shard does): letting go of it raised
    ``RuntimeError: Attempted to access the data pointer on an invalid python storage`` (the fuzzer's ``dtensor``
    class)."""
    layer = _dlayer(mesh)
    layer.w_t = layer.weight.data.t()  # undeclared: a DTensor view of the weight's local shard
    contract = GraphContract(layer, "recapture", detect="declared-only").seal()
    x = torch.ones(1)
    with record_capture(contract, ignore=[x]):
        layer.weight.clone()
        layer.w_t.clone()

    def load() -> None:
        with torch.no_grad():
            layer.weight.copy_(_dtensor(mesh, torch.randn(4, 4)))
        if pwal == "delete":
            del layer.w_t
        else:
            layer.w_t = _dtensor(mesh, torch.randn(4, 4)).t()  # another DTensor, other memory

    outcome = reload(contract, load)
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()


# ----------------------------------------------------------------------------------------------------
# torch.utils.swap_tensors on sealed tensors
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def swapping() -> Iterator[None]:
    """``load_state_dict`` swaps every parameter and buffer (``torch.utils.swap_tensors``) instead of copying."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _state(layer: nn.Linear) -> dict[str, torch.Tensor]:
    return {"weight": torch.randn(4, 4), "bias": torch.randn(4)}


def test_swap_tensors_works_on_a_sealed_parameter_and_the_next_reload_fails_closed() -> None:
    layer = nn.Linear(4, 4)
    contract = GraphContract(layer, "recapture").seal()
    new = nn.Parameter(torch.randn(4, 4))
    torch.utils.swap_tensors(layer.weight, new)  # raised: "Cannot swap t1 because it has weakref associated with it"
    del new  # the captured memory went with the swapped-out implementation
    outcome = reload(contract, lambda: None)
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert ("weight", FindingKind.DEAD) in {(f.path, f.kind) for f in outcome.problems}


@pytest.mark.usefixtures("swapping")
def test_load_state_dict_with_swapping_copies_into_the_captured_memory_and_commits() -> None:
    layer = nn.Linear(4, 4)
    weight, bias = layer.weight, layer.bias
    captured = [(t.untyped_storage(), t.detach()) for t in (weight, bias)]
    contract = GraphContract(layer, "strict").seal()
    state = _state(layer)
    outcome = reload(contract, lambda: layer.load_state_dict(state))  # raised through load_state_dict's errors
    assert outcome.status is Status.COMMITTED, outcome.summary()
    for (storage, like), name in zip(captured, ("weight", "bias"), strict=True):
        assert torch.equal(at_address(storage, like), state[name])  # what the graph reads holds the new values


@pytest.mark.usefixtures("swapping")
def test_load_state_dict_assign_with_swapping_moves_the_parameters_and_fails_closed() -> None:
    layer = nn.Linear(4, 4)
    contract = GraphContract(layer, "recapture").seal()
    state = _state(layer)
    outcome = reload(contract, lambda: layer.load_state_dict(state, assign=True))
    assert outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert {f.path for f in outcome.problems} == {"weight", "bias"}


@pytest.mark.usefixtures("swapping")
def test_a_recorded_initial_load_with_swapping_works() -> None:
    layer = nn.Linear(4, 4)
    contract = GraphContract(layer, "strict")
    with contract.record_inputs():
        layer.load_state_dict(_state(layer))
    contract.seal()
    outcome = reload(contract, lambda: layer.load_state_dict(_state(layer)))
    assert outcome.status is Status.COMMITTED, outcome.summary()


@pytest.mark.usefixtures("swapping")
def test_the_toolkit_runs_a_loader_that_swaps() -> None:
    from graphsafe.testing import assert_reload_stable

    def load(layer: nn.Module, generator: torch.Generator) -> None:
        layer.load_state_dict(
            {name: torch.randn(t.shape, generator=generator) for name, t in layer.state_dict().items()}
        )

    assert_reload_stable(lambda: nn.Linear(4, 4), load, example_input=torch.randn(2, 4))  # raised (weakref)


def test_a_captured_tensor_pwal_replaces_after_its_after_layer_is_restored_as_the_same_object() -> None:
    """Without a weak reference to it, the captured object is still the one rebound: the transaction keeps the
    objects its snapshots held, so a later snapshot of the layer finds it although its path no longer holds it."""
    layer = nn.Linear(4, 4)
    layer.w_t = layer.weight.detach().t().contiguous()
    from graphsafe import register_derived

    register_derived(layer, "w_t")
    contract = GraphContract(layer, "strict").seal()
    captured = layer.w_t

    def pwal() -> None:
        layer.w_t = layer.weight.detach().t().contiguous()

    with contract.reload(layerwise=True) as txn, torch.no_grad():
        txn.before_layer(layer)
        layer.weight.copy_(torch.randn(4, 4))
        pwal()
        txn.after_layer(layer)
        pwal()  # again: the path holds a new tensor, and the captured one only the transaction
        txn.before_layer(layer)  # reopened: its new snapshot is taken while the path holds PWAL's tensor
        pwal()
        txn.after_layer(layer)
    assert txn.outcome is not None and txn.outcome.committed, txn.outcome
    assert layer.w_t is captured and torch.equal(captured, layer.weight.t())


def _global_hook_tables() -> list[dict[Any, Any]]:
    from torch.nn.modules import module as torch_module

    return [
        dict(torch_module._global_parameter_registration_hooks),
        dict(torch_module._global_buffer_registration_hooks),
        dict(torch_module._global_module_registration_hooks),
    ]


def test_a_reload_adds_or_removes_no_torch_global_hook() -> None:
    """torch iterates its global registration hooks on every ``register_parameter``: a hook added or removed while
    another thread registers one raises ``OrderedDict mutated during iteration`` there (the fuzzer's
    two-ranks-as-threads class). graphsafe's hooks are installed once, at import."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    contract = GraphContract(model, "recapture").seal()
    before = _global_hook_tables()
    with contract.reload():
        during = _global_hook_tables()
        model[0].weight = nn.Parameter(torch.ones(2, 2))
    assert during == before and _global_hook_tables() == before


def test_two_threads_reloading_with_rebinding_loaders_never_break_a_registration() -> None:
    """Two ranks as threads, each reloading its own contract with a loader that binds new parameters: no
    registration in either thread fails because of the other's reload."""
    import sys
    import threading

    errors: list[BaseException] = []

    def rank() -> None:
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
        contract = GraphContract(model, "recapture").seal()
        try:
            for step in range(300):
                with contract.reload():
                    for layer in model:
                        layer.weight = nn.Parameter(torch.full((2, 2), float(step)))
                if errors:
                    return
        except BaseException as exc:  # the test asks which
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race needs a switch mid-loop
    try:
        threads = [threading.Thread(target=rank) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, repr(errors[0])


# ----------------------------------------------------------------------------------------------------
# A derived slot PWAL gives a tensor whose memory cannot be read: a subclass whose ``__torch_function__`` refuses
# ``untyped_storage()``, a wrapper subclass without the flatten protocol. The contract reads memory as it lies
# (past a subclass's ``__torch_function__``); a tensor with no memory to read is respecified, never a raw error.
# ----------------------------------------------------------------------------------------------------


class _RefusesStorage(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.untyped_storage:
            raise TypeError("this class hands out no storage")
        return super().__torch_function__(func, types, args, kwargs or {})


class _Opaque(torch.Tensor):
    """A wrapper subclass with no ``__tensor_flatten__``: nothing outside it can reach its memory."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Opaque:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        made.inner = inner
        return made

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(value: Any) -> Any:
            return value.inner if isinstance(value, _Opaque) else value

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class _Unreadable(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(4, 2), requires_grad=False)
        self.d = self.weight.detach() * 2
        register_derived(self, "d", derived_from="weight")

    def pwal(self) -> None:
        values = self.weight.detach() * 2
        self.d = values.as_subclass(_RefusesStorage) if self.kind == "refuses" else _Opaque(values)
        register_derived(self, "d", derived_from="weight")


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "unrecorded"])
@pytest.mark.parametrize("kind", ["refuses", "opaque"])
@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_new_tensor_whose_memory_cannot_be_read_is_respecified_not_a_raw_error(
    mode: str, kind: str, record: bool, layerwise: bool
) -> None:
    layer = _Unreadable(kind)
    contract = GraphContract(layer, mode).seal()  # type: ignore[arg-type]
    contract.record_reloads = "every" if record else "none"
    new = torch.randn(4, 2, generator=torch.Generator().manual_seed(3))
    raised: BaseException | None = None
    try:
        if layerwise:
            with contract.reload(layerwise=True) as txn:
                txn.before_layer(layer)
                layer.weight.data.copy_(new)
                layer.pwal()
                txn.after_layer(layer)
        else:
            with contract.reload():
                layer.weight.data.copy_(new)
                layer.pwal()
    except BaseException as exc:  # the test asks which
        raised = exc
    assert raised is None or isinstance(raised, GraphSafeError), f"a raw {type(raised).__name__} escaped: {raised}"
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is not Status.COMMITTED
    assert any(f.kind is FindingKind.RESPECIFIED and f.path == "d" for f in outcome.findings), outcome.summary()
