"""The attribute move on rebind (``_move_attributes``, ``LayerSnapshot.swapped``),
the reads-past-a-slot check against PWAL's new storages (``_same_as_new``), and what a recording teaches about a
graph-read path no slot tracked (``_recorded_extras``, ``SealedSlot.unrecorded``): what each must hold.

Every reload loads DIFFERENT weights (or, where said, leaves a layer's weights alone). The oracle never asks
graphsafe: a cold model loaded with the same weights and processed (load + PWAL, + warm-up where the model computes
something lazily), the captured data pointers, and the values the model resolves at its paths.
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch import nn

from _graph_tables import FakeGraph, kernel_row
from graphsafe import ContractViolation, GraphContract, Status, register_derived
from graphsafe.collectors import record_capture

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

MODES = ("strict", "recapture", "migrate")
DETECTS = ("declared-only", "sealed-paths", "every-reload")
N = 4


# -- 1. an attribute holding a slot whose copy was taken back is mapped to that slot's captured tensor anyway -------
class _PoolLayer(nn.Module):
    """PWAL keeps the old ``cur`` buffer in a pool (``spare``: a foreign holder, so graphsafe must not copy into it),
    gives ``cur`` a new tensor, and hangs that new ``cur`` on the new ``w_t`` as ``w_t.cur_ref`` (a kernel reads the
    scale it was built with through the tensor it was built for)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(N), requires_grad=False)

    def pwal(self, first: bool = False) -> None:
        if not first:
            self.spare = self.cur  # a storage pool keeps the old captured buffer
        self.cur = self.weight * 2
        w_t = self.weight * 4
        w_t.cur_ref = self.cur
        self.w_t = w_t
        register_derived(self, "cur")
        register_derived(self, "w_t")


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_attribute_of_a_taken_back_slot_is_not_mapped_to_its_unwritten_captured_tensor(mode: str, detect: str) -> None:
    """``cur``'s copy is taken back (its captured buffer is held by ``spare``: alias-broken, nothing written,
    ``cur`` keeps PWAL's new tensor). ``w_t`` is restored and rebound, and ``_move_attributes`` maps the attribute
    ``w_t.cur_ref`` (PWAL's new ``cur``) through ``swapped`` to ``cur``'s CAPTURED tensor, which was never written: it
    is now the pool's spare and holds the old values.

    Promise: where the reload does not commit, the model keeps the tensors PWAL produced, so the recapture reads the
    right values; graphsafe never leaves the model reading values the reload did not produce. After the reload
    ``model.w_t.cur_ref`` must hold what the cold model's does (PWAL made it ``model.cur``).
    """
    model = _PoolLayer()
    model.pwal(first=True)
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        model.weight.copy_(torch.full((N,), 5.0))
        model.pwal()
    outcome = contract.last_outcome
    assert outcome is not None
    cold = _PoolLayer()
    with torch.no_grad():
        cold.weight.copy_(torch.full((N,), 5.0))
    cold.pwal(first=True)
    assert torch.equal(model.cur, cold.cur)  # graphsafe left cur on PWAL's new tensor, as documented
    assert torch.equal(model.w_t.cur_ref, cold.w_t.cur_ref), (
        f"{outcome.status.name} ({outcome.summary()}): model.w_t.cur_ref = {model.w_t.cur_ref.tolist()} (the captured "
        f"cur, never written, now the pool's spare); PWAL made {cold.w_t.cur_ref.tolist()} (model.cur)"
    )


# -- 2. two slots captured as one tensor object: the captured object can carry only one of their attributes -------
class _TiedLayer(nn.Module):
    """At the seal ``a`` and ``b`` are one tensor (a tie). Later loads give each its own new tensor with the same
    values but its own metadata (``role``, a per-projection ``meta`` tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(N), requires_grad=False)

    def pwal(self, first: bool = False) -> None:
        if first:
            self.a = self.b = self.weight * 2
        else:
            a = self.weight * 2
            a.role, a.meta = "gate", torch.tensor([1.0])
            b = self.weight * 2
            b.role, b.meta = "up", torch.tensor([2.0])
            self.a, self.b = a, b
        register_derived(self, "a")
        register_derived(self, "b")


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_two_slots_on_one_captured_object_do_not_commit_with_one_slots_attributes_lost(mode: str, detect: str) -> None:
    """``a`` and ``b`` were captured as one tensor object. The reload gives them two new tensors with equal
    values (the tie agrees bitwise) and different attributes. Both are rebound to the one captured object, and
    ``_move_attributes`` clears and refills its ``__dict__`` once per slot: the last slot rebound wins, so one path
    now reads the other's attributes.

    Promise: COMMITTED means the model holds what a cold model loaded with the same weights holds; here the reload
    commits while ``model.a.meta`` (and ``.role``) are ``b``'s.
    """
    model = _TiedLayer()
    model.pwal(first=True)
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    with contextlib.suppress(ContractViolation), contract.reload(), torch.no_grad():
        model.weight.copy_(torch.full((N,), 5.0))
        model.pwal()
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert (model.a.role, model.a.meta.tolist(), model.b.role, model.b.meta.tolist()) == (
            "gate",
            [1.0],
            "up",
            [2.0],
        ), (
            f"COMMITTED while a.role={model.a.role!r} a.meta={model.a.meta.tolist()} b.role={model.b.role!r} "
            f"b.meta={model.b.meta.tolist()}: PWAL made a=('gate', [1.0]), b=('up', [2.0])"
        )


# -- 3. _same_as_new: the gap compared with ANY move's new storage, not the one the graph read past ----------------
class _TwoViewLayer(nn.Module):
    """First load: ``packed = [w*2 | w*3 | w*5]``, ``A = packed[:N]``, ``C = packed[2N:]``; the kernel handed ``A``
    reads ``A`` and the packed half after it (``[0, 2N)``), another reads ``C``. Later loads build ``A``'s pair in a
    new buffer and update ``C`` copy-on-write (a clone of ``C``'s buffer with ``C``'s part rewritten). Eager, the
    model is right: ``A``'s buffer holds the new pair, ``C`` the new values."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)

    def pwal(self) -> None:
        w = self.weight.detach()
        if not hasattr(self, "C"):
            packed = torch.cat([w * 2, w * 3, w * 5])
            self.A, self.C = packed[:N], packed[2 * N :]
        else:
            fresh = torch.cat([w * 2, w * 3])  # A and the half its kernel reads after it: a new buffer
            self.A = fresh[:N]
            arena = self.C._base.clone()  # copy-on-write update of C's buffer
            arena[2 * N :] = w * 5
            self.C = arena[2 * N :]
        register_derived(self, "A")
        register_derived(self, "C")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.A.as_strided((2 * N,), (1,), self.A.storage_offset())  # the kernel reads 2N elements
        return x * full[:N] + full[N:] + self.C


def _load_two_view(model: _TwoViewLayer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.weight.copy_(torch.randn(N, generator=generator))
        model.pwal()


@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_gap_bytes_equal_to_another_slots_new_storage_are_not_fresh(mode: str, detect: str) -> None:
    """The manifest records that the graph reads ``[0, 2N)`` of the captured packed storage through ``A``
    and ``[2N, 3N)`` through ``C``; the gap ``[N, 2N)`` is no slot's. The restore copies ``A`` and ``C`` and leaves
    the gap with the old ``w*3``. ``_same_as_new`` accepts the gap when ANY move into the storage has a new storage
    holding the same bytes at the same offsets: ``C``'s new storage is a clone of the captured buffer, so at
    ``[N, 2N)`` it holds exactly the old ``w*3`` and the gap passes as "what PWAL left there". ``A``'s new buffer,
    the one the graph really read past, holds the new ``w*3``.

    Promise: COMMITTED only if a replay (here: the same forward on the reloaded model, which reads the captured
    storage) gives what the cold model gives.
    """
    model = _TwoViewLayer()
    _load_two_view(model, 0)
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    x = torch.randn(N)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        model(x)
    ptr = model.A.data_ptr()
    with contextlib.suppress(ContractViolation), contract.reload():
        _load_two_view(model, 1)
    outcome = contract.last_outcome
    assert outcome is not None
    cold = _TwoViewLayer()
    _load_two_view(cold, 1)
    if outcome.status is Status.COMMITTED:
        assert model.A.data_ptr() == ptr
        with torch.no_grad():
            got, want = model(x), cold(x)
        assert torch.equal(got, want), (
            f"COMMITTED while the graph reads the captured packed buffer's old second half: replay gives "
            f"{got.tolist()}, the cold model {want.tolist()}"
        )


# -- 4. a recording in which a layer's weights did not change teaches that PWAL never computes its graph-read table -
class _GuardLayer(nn.Module):
    """``_x = weight * 3`` read by the graph, undeclared; ``kind="guard"``: PWAL computes it once (an "already
    processed" guard, a PWAL bug the contract exists to catch); ``kind="lazy"``: the first forward computes it (a
    warm-up cache). ``has_x=False``: a layer without one."""

    def __init__(self, has_x: bool, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.has_x, self.kind = has_x, kind

    def pwal(self) -> None:
        self.w2 = self.weight.detach() * 2
        register_derived(self, "w2")
        if self.has_x and self.kind == "guard" and not hasattr(self, "_x"):
            self._x = self.weight.detach() * 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_x and self.kind == "lazy" and getattr(self, "_x", None) is None:
            self._x = self.weight.detach() * 3
        return x * self.w2 + (self._x if self.has_x else 0)


class _GuardModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_GuardLayer(False, kind), _GuardLayer(True, kind)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _load_guard(model: _GuardModel, seed: int, only: set[int] | None = None) -> None:
    """Load layer weights for ``seed`` (only the layers in ``only``: a partial reload), then PWAL every layer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for index, layer in enumerate(model.layers):
            values = torch.randn(N, generator=generator)
            if only is None or index in only:
                layer.weight.copy_(values)
        for layer in model.layers:
            layer.pwal()


@pytest.mark.parametrize(
    ("detect", "kind", "record_initial"),
    [
        (detect, kind, record)
        for detect in ("declared-only", "sealed-paths")
        for kind in ("guard", "lazy")
        for record in (True, False)
        # (sealed-paths + guard + record_inputs holds: the walker seals _x and the recording keeps its inputs)
        if not (detect == "sealed-paths" and kind == "guard" and record)
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_a_partial_reload_does_not_teach_that_a_stale_graph_read_table_is_static(
    mode: str, detect: str, kind: str, record_initial: bool
) -> None:
    """The manifest ties the graph-read ``layers.1._x`` to a path no slot tracks, so it is watched (stale
    when the weights change and PWAL leaves it) until a recording shows PWAL never computes it. Reload 1 is partial
    (layer 0's weights only; PWAL runs over every layer, as vLLM's does): it records (a watched path no recording
    saw), commits rightly (``_x``'s inputs did not change), and ``learn_inputs`` marks every slot of the layer as
    recorded with no inputs: ``_x`` is now a trusted fixed table (kept in ``_recorded_extras`` across reseals).
    Reload 2 changes layer 1's weights and commits while the graph reads ``_x``'s old values. No reload failed
    before the lie.

    Promise: COMMITTED only if every captured tensor holds what a cold model (same weights, PWAL, warm-up) holds.
    """
    model = _GuardModel(kind)
    contract = GraphContract(model, mode, detect=detect)  # type: ignore[arg-type]
    if record_initial:
        with contract.record_inputs():
            _load_guard(model, 0)
    else:
        _load_guard(model, 0)
    contract.seal()
    x = torch.randn(N)
    with torch.no_grad():
        model(x)  # warm-up
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        model(x)
    captured = model.layers[1]._x

    with contextlib.suppress(ContractViolation), contract.reload():
        _load_guard(model, 1, only={0})
    first = contract.last_outcome
    assert first is not None and first.status is Status.COMMITTED, first.summary() if first else None

    with contextlib.suppress(ContractViolation), contract.reload():
        _load_guard(model, 2)
    outcome = contract.last_outcome
    assert outcome is not None
    cold = _GuardModel(kind)
    with torch.no_grad():
        for mine, theirs in zip(model.layers, cold.layers, strict=True):
            theirs.weight.copy_(mine.weight)
            theirs.pwal()
        cold(x)
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, cold.layers[1]._x), (
            f"COMMITTED while the graph reads layers.1._x = {captured.tolist()} (computed from the seal's "
            f"weights); the cold model holds {cold.layers[1]._x.tolist()}"
        )


# -- 5. the kernel scan and a large float (or Parameter) workspace that holds a pointer table ----------------------
class _Grouped(nn.Module):
    """A grouped-GEMM style layer: the kernel gets a device-side workspace holding the address of ``expert_t``."""

    def __init__(self, workspace: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        if isinstance(workspace, nn.Parameter):
            self.workspace = workspace
        else:
            self.register_buffer("workspace", workspace)

    def process_weights_after_loading(self) -> None:
        self.read_t = (self.weight * 2).contiguous()
        self.expert_t = (self.weight + 1).contiguous()
        register_derived(self, "read_t")
        register_derived(self, "expert_t")


def _load_grouped(layer: _Grouped, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
        layer.process_weights_after_loading()


@pytest.mark.parametrize("workspace", ["float32_over_1MiB", "int64_parameter_over_1MiB"])
def test_skip_does_not_free_a_slot_a_large_workspace_points_at(fake_cuda: dict[str, object], workspace: str) -> None:
    """The captured kernel reads ``expert_t`` through a pointer table laid out in a workspace just over
    1 MiB: a float32 buffer (the scan's own docstring: "a fused-MoE workspace lays its pointer tables out in a
    ``uint8`` or float buffer"), or an int64 table registered as an ``nn.Parameter`` (``requires_grad=False``). The
    scan read storages of at most 1 MiB whatever their dtype; above that only integer non-Parameter storages made
    it incomplete, so these two were neither read nor reported: truth() said "fully known", and ``unread="skip"``
    judged ``expert_t`` unread, freed its captured storage and committed. Every larger storage a node points into
    is now searched on its own device for words pointing into memory not yet known to be read
    (``_kernelscan.search_words``).

    Promise: COMMITTED never while a graph reads freed or stale memory.
    """
    words = (1 << 20) // 8 + 1
    if workspace == "float32_over_1MiB":
        buf: torch.Tensor = torch.zeros(2 * words, dtype=torch.float32)
    else:
        buf = nn.Parameter(torch.zeros(words, dtype=torch.int64), requires_grad=False)
    layer = _Grouped(buf)
    _load_grouped(layer, 0)
    with torch.no_grad():
        layer.workspace.view(torch.int64)[0] = layer.expert_t.data_ptr()  # the table the kernel dereferences
    contract = GraphContract(layer, "strict", unread="skip").seal()
    fake_cuda["table"] = {"root": 1, "graphs": {"1": [kernel_row(layer.read_t, layer.workspace)]}}
    with record_capture(contract, name="g", graph=FakeGraph()):
        pass
    assert contract.manifest is not None
    read_by_graph = layer.expert_t.untyped_storage()
    alive = weakref.ref(read_by_graph)
    del read_by_graph
    with contextlib.suppress(ContractViolation), contract.reload():
        _load_grouped(layer, 1)
    outcome = contract.last_outcome
    assert outcome is not None
    if outcome.status is Status.COMMITTED:
        assert alive() is not None, (
            f"COMMITTED (slots_skipped={outcome.slots_skipped}, truth={contract.manifest.truth()!r}), but the "
            "storage of expert_t that the captured kernel reads through its workspace's pointer table was freed"
        )


@pytest.mark.parametrize("workspace", ["float32_over_1MiB", "int64_parameter_over_1MiB", "int64_buffer_over_1MiB"])
def test_a_large_workspace_pointing_only_at_what_the_graph_reads_leaves_the_skip_on(
    fake_cuda: dict[str, object], workspace: str
) -> None:
    """Legitimate: a workspace over 1 MiB whose one pointer is to ``read_t`` (which the kernel also reads directly)
    and whose other words are weight-like values (random floats, small integers); no graph reads ``expert_t``. The
    search must neither take those values for pointers nor take a large storage, its dtype or its being an
    ``nn.Parameter`` for a reason to give up: truth() is "fully known" and ``expert_t`` is skipped. (An integer
    buffer this large used to make the scan incomplete, which switched ``unread="skip"`` off for the whole model.)
    """
    words = (1 << 20) // 8 + 1
    generator = torch.Generator().manual_seed(0)
    if workspace == "float32_over_1MiB":
        buf: torch.Tensor = torch.randn(2 * words, generator=generator)
    else:
        buf = torch.randint(0, 1 << 31, (words,), dtype=torch.int64, generator=generator)
        if workspace == "int64_parameter_over_1MiB":
            buf = nn.Parameter(buf, requires_grad=False)
    layer = _Grouped(buf)
    _load_grouped(layer, 0)
    with torch.no_grad():
        layer.workspace.view(torch.int64)[0] = layer.read_t.data_ptr()
    contract = GraphContract(layer, "strict", unread="skip").seal()
    fake_cuda["table"] = {"root": 1, "graphs": {"1": [kernel_row(layer.read_t, layer.workspace)]}}
    with record_capture(contract, name="g", graph=FakeGraph()):
        pass
    assert contract.manifest is not None
    assert contract.manifest.truth() is None, contract.manifest.truth()
    with contract.reload() as txn:
        _load_grouped(layer, 1)
    outcome = txn.outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome
    assert outcome.skip_refused is None, outcome.skip_refused
    assert outcome.slots_skipped == 1, (outcome.slots_skipped, outcome.skip_notes)


# -- 6. an attribute naming a rebound tensor on a tensor no slot path names --------------------------------------
class _KernelRef(nn.Module):
    """A kernel tensor at a child module keeps a reference to the weight it was built from
    (``sub.kernel.weight_ref = weight``), set by PWAL where a condition on the weights holds (not at the first
    load). Nothing declares ``sub.kernel``: under ``declared-only`` no slot path names it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((N,), -1.0), requires_grad=False)
        self.sub = nn.Module()

    def pwal(self) -> None:
        kernel = getattr(self.sub, "kernel", None)
        if kernel is None:
            self.sub.kernel = kernel = self.weight * 2
        else:
            kernel.copy_(self.weight * 2)  # in place: the graph keeps reading it
        if bool(self.weight.sum() > 0):
            kernel.weight_ref = self.weight
        else:
            kernel.__dict__.pop("weight_ref", None)


def _rebind_weight(model: _KernelRef, value: float) -> nn.Parameter:
    """A loader that binds a new Parameter (``layer.weight = nn.Parameter(new)``), then PWAL."""
    new = nn.Parameter(torch.full((N,), value), requires_grad=False)
    model.weight = new
    with torch.no_grad():
        model.pwal()
    return new


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("detect", DETECTS)
@pytest.mark.parametrize("mode", MODES)
def test_an_attribute_off_every_slot_path_follows_the_rebound_weight(mode: str, detect: str, layerwise: bool) -> None:
    """The loader rebinds ``weight``; graphsafe copies the new values into the captured Parameter and binds
    that back, while ``sub.kernel.weight_ref`` (a tensor no slot path names) still names the new Parameter, which
    nothing else holds: the next in-place load writes ``model.weight`` and the kernel's reference keeps the old
    values. Promise: after the reload ``sub.kernel.weight_ref`` is the tensor at ``weight``, whatever the status."""
    model = _KernelRef()
    with torch.no_grad():
        model.pwal()
    contract = GraphContract(model, mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = model.weight
    with contextlib.suppress(ContractViolation), contract.reload(layerwise=layerwise) as txn:
        if layerwise:
            txn.before_layer(model)
        _rebind_weight(model, 3.0)
        if layerwise:
            txn.after_layer(model)
    outcome = contract.last_outcome
    assert outcome is not None
    assert model.weight is captured, outcome.summary()  # the premise: the captured Parameter was bound back
    assert model.sub.kernel.weight_ref is model.weight, (
        f"{outcome.status.name}: sub.kernel.weight_ref is the orphaned new Parameter, not the one at weight"
    )
    with torch.no_grad():
        model.weight.fill_(7.0)  # the next load, in place
    assert torch.equal(model.sub.kernel.weight_ref, torch.full((N,), 7.0))


def test_a_rebound_tensor_held_elsewhere_than_a_tensor_attribute_is_left_as_it_is() -> None:
    """What the remap must not touch: a list and a plain object of the user's that hold the new Parameter keep it
    (graphsafe rewrites only tensors' attributes), and a new Parameter nothing else holds is let go."""
    model = _KernelRef()
    with torch.no_grad():
        model.pwal()
    contract = GraphContract(model, "strict", detect="declared-only").seal()

    class Holder:
        pass

    with contract.reload():
        new = _rebind_weight(model, 3.0)
        kept, holder = [new], Holder()
        holder.param = new
    assert model.sub.kernel.weight_ref is model.weight and model.weight is not new
    assert kept[0] is new and holder.param is new
    del new, kept, holder
    with contract.reload():
        gone = weakref.ref(_rebind_weight(model, 4.0))
    assert gone() is None and model.sub.kernel.weight_ref is model.weight
