"""Opaque holders, strided and sparse slots, the capture manifest: each test reproduces one violation.

Every test builds a small CPU model, seals it the way an engine does (first load, seal, capture), reloads with
OTHER weights and compares what a captured graph would read (the captured tensor objects, i.e. the captured
storages at their captured offsets, after the reload) with what a cold model built on the new weights holds. A
non-COMMITTED status is fail-closed and passes; only a COMMITTED reload whose captured reads differ from the cold
model fails (or, for the input-validation test, a raw exception from inside graphsafe).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import (
    ContractViolation,
    GraphContract,
    GraphSafeError,
    ReloadOutcome,
    Status,
    record_capture,
    register_derived,
)

N = 4


def _reload(contract: GraphContract, load: Callable[[], None]) -> ReloadOutcome:
    with contextlib.suppress(ContractViolation), contract.reload():
        load()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def _weights(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- 1. a strided slot view: the restore writes only its elements; the manifest's byte check covers its whole span --
class _Interleaved(nn.Module):
    """PWAL packs three derived columns into one NEW (N, 3) buffer and keeps a view of columns 0 and 2 (stride
    (3, 2)); the kernel is handed the view's pointer and reads the whole buffer, column 1 included. The view's
    address span is the whole buffer, but its elements are not."""

    def __init__(self, declared: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.declared = declared

    def pwal(self) -> None:
        w = self.weight.detach()
        packed = torch.stack([w * 2, w * 3, w * 5], 1)  # a NEW buffer every load
        self.s = packed[:, ::2]
        if self.declared:
            register_derived(self, "s")

    @staticmethod
    def read(s: torch.Tensor) -> torch.Tensor:
        return s.as_strided((3 * N,), (1,), s.storage_offset())  # what the kernel reads through s's pointer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.read(self.s)


def _load_interleaved(layer: _Interleaved, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(_weights(seed, N))
        layer.pwal()


@pytest.mark.parametrize(
    ("declared", "mode", "detect"),
    [
        (True, "strict", "declared-only"),
        (True, "recapture", "every-reload"),
        (False, "migrate", "sealed-paths"),
        (False, "migrate", "every-reload"),
    ],
)
def test_a_strided_view_slot_does_not_commit_the_stale_bytes_between_its_elements(
    declared: bool, mode: str, detect: str
) -> None:
    """The dispatch recorder records that the graph reads bytes [0, 48) of the captured buffer. The restore copies
    the slot's 8 elements (columns 0 and 2) into the captured view; column 1 keeps the seal's values. The byte
    check (`_reads_no_copy_reached`) takes each copy's and each held path's *address span* as covered, and the
    span of a stride-(3, 2) view is the whole buffer, so the gap inside it is never seen. The packed-prefix
    variant of this (tests/collectors/test_undeclared_tensors.py) is caught; this one commits."""
    layer = _Interleaved(declared)
    _load_interleaved(layer, 0)
    contract = GraphContract(layer, mode=mode, detect=detect).seal()  # type: ignore[arg-type]
    x = torch.randn(3 * N)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        layer(x)
    captured = layer.s

    outcome = _reload(contract, lambda: _load_interleaved(layer, 1))

    cold = _Interleaved(declared)
    _load_interleaved(cold, 1)
    if outcome.status is Status.COMMITTED:
        got, want = _Interleaved.read(captured), _Interleaved.read(cold.s)
        assert torch.equal(got, want), (
            f"COMMITTED ({outcome.summary()}) while the graph reads {got.tolist()} from the captured buffer; a cold "
            f"model holds {want.tolist()} (column 1 kept the seal's values)"
        )


# -- 2. a sparse buffer: parameters/buffers that are not strided are silently not sealed ----------------------------
class _SparseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.register_buffer("adj", torch.zeros(N, N).to_sparse())  # a sparse (COO) buffer the forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adj, x) + self.weight[:, None]


def _load_sparse(layer: _SparseLayer, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(_weights(seed, N))
        # the loader binds a new buffer (as for a replaced parameter, graphsafe must copy back or flag it)
        layer.adj = (_weights(seed + 100, N, N) * (_weights(seed + 200, N, N) > 0)).to_sparse()


@pytest.mark.parametrize("manifest", [False, True])
@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
@pytest.mark.parametrize("mode", ["strict", "recapture"])
def test_a_sparse_buffer_the_loader_replaces_is_not_committed(mode: str, detect: str, manifest: bool) -> None:
    """`_state_entries` skips every parameter and buffer whose layout is not strided ("no storage to fingerprint
    (sparse, ...)"), silently: no slot, no untrackable note (a sparse *plain attribute* is untrackable and fails
    closed), and the dispatch recorder drops non-strided arguments too. The loader binds a new sparse buffer; the
    captured graph keeps reading the old one's indices and values (freed, in a real engine); the reload commits in
    every mode and policy, with or without the capture manifest."""
    layer = _SparseLayer()
    _load_sparse(layer, 0)
    contract = GraphContract(layer, mode=mode, detect=detect).seal()  # type: ignore[arg-type]
    x = torch.randn(N, 1)
    if manifest:
        with torch.no_grad(), record_capture(contract, ignore=[x]):
            layer(x)
    captured = layer.adj

    outcome = _reload(contract, lambda: _load_sparse(layer, 1))

    cold = _SparseLayer()
    _load_sparse(cold, 1)
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured.to_dense(), cold.adj.to_dense()), (
            f"COMMITTED ({outcome.summary()}) while the graph reads the seal's sparse buffer, not the loaded one"
        )


# -- 3. a declared sparse slot: a raw NotImplementedError from inside the seal ------------------------------------
def test_a_declared_sparse_csr_slot_is_refused_with_a_graphsafe_error() -> None:
    """A kernel author declares a sparse CSR derived tensor. `seal()` calls `fingerprint` on it, whose
    `untyped_storage()` raises torch's `NotImplementedError: Cannot access storage of SparseCsrTensorImpl`: a raw
    error from deep inside, naming neither the layer, nor the path, nor what to do."""

    class Csr(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(N, N), requires_grad=False)
            with torch.no_grad():
                self.w_csr = (self.weight * 2).to_sparse_csr()
            register_derived(self, "w_csr")

    layer = Csr()
    contract = GraphContract(layer, mode="strict")
    try:
        contract.seal()
    except GraphSafeError as exc:
        assert "w_csr" in str(exc)
    except Exception as exc:
        pytest.fail(f"seal() raised a raw {type(exc).__name__}: {exc}")


# -- 4. tensors held by C objects the walker takes for leaves ----------------------------------------------------
# (make the holder from the derived tensor, read the tensor back through it, call it as the forward does)
_OPAQUE: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    # a ping-pong/recycled handle: itertools objects
    "itertools.repeat": (itertools.repeat, lambda h: next(h)),
    "itertools.cycle": (lambda t: itertools.cycle([t]), lambda h: next(h)),
    # a bound call: operator.methodcaller("mul", t)(x) == x.mul(t)
    "operator.methodcaller": (
        lambda t: operator.methodcaller("mul", t),
        lambda h: h.__reduce__()[1][1],  # (name, *args): its argument
    ),
    # a view of a dict no one else holds
    "dict.values": (lambda t: {"w": t}.values(), lambda h: next(iter(h))),
    # a generator's frame
    "generator": (lambda t: (t for _ in itertools.count()), lambda h: next(h)),
}


class _Opaque(nn.Module):
    def __init__(self, holder: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.holder = holder

    def pwal(self) -> None:
        self.h = _OPAQUE[self.holder][0](self.weight.detach() * 2)  # a NEW tensor every load

    def read(self) -> torch.Tensor:
        return _OPAQUE[self.holder][1](self.h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.read()


def _load_opaque(layer: _Opaque, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(_weights(seed, N))
        layer.pwal()


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
@pytest.mark.parametrize("holder", sorted(_OPAQUE))
def test_a_tensor_held_by_an_opaque_c_object_is_not_committed(holder: str, detect: str) -> None:
    """`Plan.__init__` turns a C type without ``__dict__`` or slots into a LEAF ("a C type without instance state
    we could read"), so the walker neither names nor notes what it holds (``gc.get_referents`` would list it). A
    set member, a weak reference's referent or an lru_cache entry is *untrackable* and fails closed; a tensor inside
    an ``itertools.cycle``, a ``methodcaller``, a ``dict_values`` view or a generator frame is not seen at all. PWAL
    rebuilds it into a new holder: the reload commits while the graph reads the old (freed) tensor. No capture
    manifest here: the walker policies are the collector safety net the README promises for undeclared tensors."""
    layer = _Opaque(holder)
    _load_opaque(layer, 0)
    contract = GraphContract(layer, mode="recapture", detect=detect).seal()  # type: ignore[arg-type]
    captured = layer.read()  # what the captured graph reads

    outcome = _reload(contract, lambda: _load_opaque(layer, 1))

    cold = _Opaque(holder)
    _load_opaque(cold, 1)
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, cold.read()), (
            f"COMMITTED ({outcome.summary()}) while the graph reads the seal's tensor inside a {holder}"
        )


# -- 5. weakref.proxy is a leaf, weakref.ref is followed ------------------------------------------------------------
_STRONG: dict[int, torch.Tensor] = {}


class _Proxied(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.kind = kind

    def pwal(self) -> None:
        _STRONG[id(self)] = self.weight.detach() * 2  # a NEW tensor every load, owned by a registry
        t = _STRONG[id(self)]
        self.h = weakref.proxy(t) if self.kind == "proxy" else weakref.ref(t)

    def read(self) -> torch.Tensor:
        return _STRONG[id(self)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.h if self.kind == "proxy" else self.h())


def _load_proxied(layer: _Proxied, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(_weights(seed, N))
        layer.pwal()


def test_a_tensor_behind_a_weak_proxy_is_not_committed() -> None:
    """The walker follows a ``weakref.ref`` to its referent and makes the layer *untrackable* (fail closed: the
    same test with ``_Proxied("ref")`` passes), but ``weakref.ProxyType`` is in ``_LEAF_BASES``: the same tensor
    read through ``weakref.proxy`` is invisible and the reload commits while the graph reads the old tensor. (The
    strong owner is a module-level registry, as in the documented module-level-cache row; the point here is that
    the layer's own reference to it is a weak reference the docs say the walker reads.)"""
    kind = "proxy"
    layer = _Proxied(kind)
    _load_proxied(layer, 0)
    contract = GraphContract(layer, mode="recapture", detect="every-reload").seal()
    captured = layer.read()

    outcome = _reload(contract, lambda: _load_proxied(layer, 1))

    cold = _Proxied(kind)
    _load_proxied(cold, 1)
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, cold.read()), (
            f"COMMITTED ({outcome.summary()}) while the graph reads the seal's tensor behind a weakref.{kind}"
        )


# -- 6. declared-only + manifest: a recorded path now on another view of the same storage ------------------------
class _DoubleBuffer(nn.Module):
    """Double buffering inside one allocation: PWAL writes the new derived values into the half the graph does not
    read and points ``w`` at it (the other half keeps the old values for in-flight work)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
        self.w: torch.Tensor | None = None

    def pwal(self) -> None:
        arena = torch.zeros(2 * N) if self.w is None else self.w._base
        assert arena is not None
        half = 0 if self.w is None or self.w.storage_offset() else N
        with torch.no_grad():
            arena[half : half + N].copy_(self.weight * 2)
        self.w = arena[half : half + N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.w is not None
        return x * self.w


def _load_double(layer: _DoubleBuffer, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(_weights(seed, N))
    layer.pwal()


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_declared_only_manifest_path_moved_within_its_storage_is_not_committed(mode: str) -> None:
    """``detect="declared-only"`` trusts the declarations plus the capture manifest. The manifest recorded that the
    graph reads bytes [0, 16) of the arena and that ``w`` held it. After PWAL ``w`` is ``arena[4:8]``: same
    storage object, so ``Manifest.check`` (``_holds``: storage identity only) is satisfied, and the watch-only slot
    for ``w`` takes the other data pointer for "moved or gone" and leaves it to the manifest. Nothing compares the
    bytes the graph reads with what the path now covers: COMMITTED, the graph reads the old half. (Under
    ``sealed-paths``/``every-reload`` the walker slot is ``respecified``: fail closed.)"""
    layer = _DoubleBuffer()
    _load_double(layer, 0)
    contract = GraphContract(layer, mode=mode, detect="declared-only").seal()  # type: ignore[arg-type]
    x = torch.randn(N)
    with torch.no_grad(), record_capture(contract, ignore=[x]):
        layer(x)
    captured = layer.w
    assert captured is not None

    outcome = _reload(contract, lambda: _load_double(layer, 1))

    cold = _DoubleBuffer()
    _load_double(cold, 1)
    assert cold.w is not None
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, cold.w), (
            f"COMMITTED ({outcome.summary()}) while the graph reads {captured.tolist()} (the arena's old half); "
            f"a cold model holds {cold.w.tolist()}"
        )
