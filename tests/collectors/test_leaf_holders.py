"""Holders the walker could take for leaves (walker, classify, manifest; detect policies): one violation each.

Every test builds a small CPU model, seals it the way an engine does (first load, seal), reloads with OTHER weights
and compares what a captured graph would read (the tensor objects the forward read at seal, i.e. the captured
storages, after the reload) with what a cold model built from scratch on the new weights reads. A non-COMMITTED
status is fail-closed and passes; only a COMMITTED reload whose captured reads differ from the cold model fails.
No capture manifest: the walker policies (``every-reload``, ``sealed-paths``) are the collector safety net the
README promises for undeclared tensors ("a collector safety net finds the device tensors nobody declared").
"""

from __future__ import annotations

import abc
import contextlib
import enum
import functools
import importlib.machinery
import itertools
import math
import os
import sysconfig
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import ContractViolation, GraphContract, ReloadOutcome, Status
from graphsafe.collectors.walker import walk
from graphsafe.paths import SlotPath

N = 4


def _reload(contract: GraphContract, load: Callable[[], None]) -> ReloadOutcome:
    with contextlib.suppress(ContractViolation), contract.reload():
        load()
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome


def _weights(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


# -- 1. holders the walker's plans take for leaves -----------------------------------------------------------------
# Each holder: (make: (layer, derived tensor) -> the object the layer keeps, read: that object -> the tensor the
# forward reads). A holder that needs a class of its own makes a fresh one per layer, so the cold model never
# shares state with the model under test.


def _class_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # A kernel "singleton" kept as a class with class-level state (vLLM-style kernel classes with class caches):
    # the layer holds the class itself, not an instance.
    kernel = getattr(layer, "_kernel_cls", None)
    if kernel is None:
        kernel = layer._kernel_cls = type("Kernel", (), {})
    kernel.workspace = t
    return kernel


def _enum_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # A backend enum member with state hung on it (``Backend.FP8.workspace``).
    backend = getattr(layer, "_backend_enum", None)
    if backend is None:
        backend = layer._backend_enum = enum.Enum("Backend", "FP8")
    member = backend.FP8
    member.workspace = t
    return member


class Prefetcher(threading.Thread):
    """A background prefetch thread (never started here) that keeps the buffer it fills."""

    def __init__(self, buf: torch.Tensor) -> None:
        super().__init__(daemon=True)
        self.buf = buf


def _thread_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    return Prefetcher(t)


def _staticmethod_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # A kernel bound as a class attribute: ``type(layer).kernel = staticmethod(partial(op, workspace))``.
    return staticmethod(functools.partial(torch.mul, t))


def _storage_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # A raw storage (a storage pool); the forward views it as float32[N].
    return t.untyped_storage()


def _numpy_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # Per-expert tensors in a numpy object array.
    table = np.empty(2, dtype=object)
    table[0] = t
    return table


HOLDERS: dict[str, tuple[Callable[[nn.Module, torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "class": (_class_holder, lambda h: h.workspace),
    "enum-member": (_enum_holder, lambda h: h.workspace),
    "thread-subclass": (_thread_holder, lambda h: h.buf),
    "staticmethod": (_staticmethod_holder, lambda h: h.__func__.args[0]),
    "untyped-storage": (_storage_holder, lambda h: torch.empty(0).set_(h, 0, (N,))),
    "numpy-object-array": (_numpy_holder, lambda h: h[0]),
}

FIXED = tuple(HOLDERS)  # the holders of section 1 (section 2's are added to HOLDERS after this)

# Where the layer keeps the holder: (store: (layer, holder) -> None, fetch: layer -> holder).
PLACES: dict[str, tuple[Callable[[nn.Module, Any], None], Callable[[nn.Module], Any]]] = {
    "attribute": (lambda layer, h: setattr(layer, "h", h), lambda layer: layer.h),
    "list": (lambda layer, h: setattr(layer, "hs", [h]), lambda layer: layer.hs[0]),
    "dict": (lambda layer, h: setattr(layer, "hd", {"k": h}), lambda layer: layer.hd["k"]),
    "object": (
        lambda layer, h: setattr(layer, "cfg", type("Cfg", (), {})()) or setattr(layer.cfg, "h", h),
        lambda layer: layer.cfg.h,
    ),
    # a class attribute of the layer's own class (its class is made per layer)
    "class-attribute": (lambda layer, h: setattr(type(layer), "h", h), lambda layer: type(layer).__dict__["h"]),
}


def _layer_class() -> type[nn.Module]:
    class Held(nn.Module):
        def __init__(self, holder: str, place: str) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(N), requires_grad=False)
            self.holder = holder
            self.place = place

        def pwal(self) -> None:
            make = HOLDERS[self.holder][0]
            PLACES[self.place][0](self, make(self, self.weight.detach() * 2))  # a NEW tensor every load

        def read(self) -> torch.Tensor:
            return HOLDERS[self.holder][1](PLACES[self.place][1](self))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.read()

    return Held


def _load(layer: Any, seed: int) -> None:
    with torch.no_grad():
        layer.weight.copy_(_weights(seed))
        layer.pwal()


def _check_holder(holder: str, place: str, mode: str, detect: str) -> None:
    layer = _layer_class()(holder, place)
    _load(layer, 0)
    contract = GraphContract(layer, mode=mode, detect=detect).seal()  # type: ignore[arg-type]
    captured = layer.read()  # what the captured graph reads (the tensor PWAL made at the first load)

    outcome = _reload(contract, lambda: _load(layer, 1))

    cold = _layer_class()(holder, place)
    _load(cold, 1)
    if outcome.status is Status.COMMITTED:
        assert torch.equal(captured, cold.read()), (
            f"COMMITTED ({outcome.summary()}) while the graph reads the seal's tensor held by a {holder} "
            f"({place}): {captured.tolist()} where a cold model reads {cold.read().tolist()}"
        )


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
@pytest.mark.parametrize("holder", sorted(FIXED))
def test_a_tensor_held_by_an_object_the_walker_takes_for_a_leaf_is_not_committed(holder: str, detect: str) -> None:
    """``_plans._LEAF_BASES`` makes every instance of ``type``, ``enum.Enum``, ``threading.Thread``,
    ``staticmethod``/``classmethod``/``property``, ``torch.UntypedStorage`` (and numpy's ``ndarray``, which the
    GC protocol cannot read) a leaf: the walker never enters it, neither names nor notes what it holds. Each of
    these can hold a tensor a graph reads: a kernel class with class-level state kept on the layer, an enum member
    with a workspace hung on it, a prefetch thread's arguments, a kernel bound with ``staticmethod(partial(op,
    ws))``, a raw storage pool, an object array of per-expert tensors. PWAL rebuilds the tensor: the reload commits
    while the graph reads the first load's tensor (a weak reference, a set member or an itertools object holding
    the same tensor is ``untrackable`` and fails closed)."""
    _check_holder(holder, "attribute", "recapture", detect)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    holder=st.sampled_from(sorted(FIXED)),  # section 2's holders have a property test of their own
    place=st.sampled_from(sorted(PLACES)),
    mode=st.sampled_from(["strict", "recapture", "migrate"]),
    detect=st.sampled_from(["every-reload", "sealed-paths"]),
)
def test_property_no_commit_while_a_leaf_typed_holder_keeps_the_old_tensor(
    holder: str, place: str, mode: str, detect: str
) -> None:
    """The same family as a property: any of those holders, kept directly, in a list, a dict, a plain object or
    as a class attribute of the layer's class, in every mode and walker policy. Oracle: a COMMITTED reload's
    captured tensor holds what a cold model built on the new weights reads."""
    _check_holder(holder, place, mode, detect)


# -- 2. a module, the stdlib's own thread, class code: read by bounded rules (docs/design.md, "What the walker reads")
def _module_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # A Python module used as a kernel namespace (``self.ops = my_kernels``) whose global holds the workspace.
    namespace = getattr(layer, "_namespace", None)
    if namespace is None:
        namespace = layer._namespace = types.ModuleType("my_kernels")
    namespace.workspace = t
    return namespace


def _stdlib_thread_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # The stdlib's own Thread (no subclass) whose arguments hold the buffer.
    return threading.Thread(target=torch.Tensor.clone, args=(t,), daemon=True)


def _class_code_holder(layer: nn.Module, t: torch.Tensor) -> Any:
    # A method of a class made per load, closing over the workspace (class code, not state).
    def scale(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x * t

    return type("Scaler", (), {"scale": scale})


CODE_HOLDERS: dict[str, tuple[Callable[[nn.Module, torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "python-module": (_module_holder, lambda h: h.workspace),
    "stdlib-thread-args": (_stdlib_thread_holder, lambda h: h._args[0]),
    "class-code-closure": (_class_code_holder, lambda h: h.__dict__["scale"].__closure__[0].cell_contents),
}
HOLDERS.update(CODE_HOLDERS)


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
@pytest.mark.parametrize("holder", sorted(CODE_HOLDERS))
def test_a_tensor_held_by_a_module_thread_or_class_code_never_commits_stale(
    holder: str, detect: str, mode: str
) -> None:
    """Once leaves on purpose (a layer holding ``torch.ops`` or ``numpy`` would walk the whole library, the stdlib's
    own ``threading.Thread`` reaches its target's object, functions in a class dictionary are code), each is read by
    a bounded rule: a module's device tensor globals (``h.workspace``), a stdlib thread's arguments
    (``h._args[0]``), a class's method that closes over state (``h.scale.__closure__[0]``). PWAL rebuilds the
    tensor they hold: the reload no longer commits while the graph reads the old one."""
    _check_holder(holder, "attribute", mode, detect)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    holder=st.sampled_from(sorted(CODE_HOLDERS)),
    place=st.sampled_from(sorted(PLACES)),
    mode=st.sampled_from(["strict", "recapture", "migrate"]),
    detect=st.sampled_from(["every-reload", "sealed-paths"]),
)
def test_property_no_commit_while_a_module_thread_or_class_code_keeps_the_old_tensor(
    holder: str, place: str, mode: str, detect: str
) -> None:
    """The same three holders kept directly, in a list, a dict, a plain object or as a class attribute of the
    layer's class, in every mode and walker policy (oracle of section 1)."""
    _check_holder(holder, place, mode, detect)


def _installed_module(name: str) -> types.ModuleType:
    """A module that says it was loaded from an installed package (its file in this environment's site-packages)."""
    module = types.ModuleType(name)
    module.__file__ = os.path.join(sysconfig.get_paths()["purelib"], name, "__init__.py")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=module.__file__)
    return module


@pytest.mark.parametrize("origin", ["made-at-run-time", "installed"])
def test_a_module_is_read_for_its_direct_device_tensors_only(origin: str) -> None:
    """A module, wherever it was loaded from, is read in one pass over its namespace: a device tensor global is a
    slot like any attribute (``ops.workspace``, restorable by attribute); no global is entered (not a dict of
    workspaces, a function's defaults, a class, an imported module), so that ``torch`` or ``numpy`` costs one
    object and a kernel module's caches are not read at every reload. One object per module."""
    imported = types.ModuleType("imported_kernels")
    imported.workspace = torch.ones(N)  # type: ignore[attr-defined]
    default = torch.ones(N)

    def run(x: torch.Tensor, ws: torch.Tensor = default) -> torch.Tensor:
        return x * ws

    kernels = types.ModuleType("my_kernels") if origin == "made-at-run-time" else _installed_module("my_kernels")
    kernels.workspace = torch.ones(N)  # type: ignore[attr-defined]
    kernels.cache = {"ws": torch.ones(N)}  # type: ignore[attr-defined]
    kernels.run = run  # type: ignore[attr-defined]
    kernels.imported, kernels.torch = imported, torch  # type: ignore[attr-defined]
    layer = nn.Linear(N, N)
    layer.ops = kernels
    result = walk(layer)
    assert [(ref.path, ref.restorable) for ref in result.refs] == [("ops.workspace", True)]
    assert result.objects_visited == 2 and result.notes == () and result.exhausted is None
    fresh = torch.zeros(N)
    SlotPath("ops.workspace").assign(layer, fresh)
    assert kernels.workspace is fresh  # type: ignore[attr-defined]


def test_a_stdlib_thread_is_read_for_its_arguments_not_its_target() -> None:
    """``threading.Thread(target, args, kwargs)``: its ``_args`` and ``_kwargs`` (a ``Timer``'s ``args`` and
    ``kwargs``) are read and restorable (the tuple is rebuilt into the thread); its target is not followed (a bound
    method reaches the object that runs the engine)."""

    class Engine:
        def __init__(self) -> None:
            self.state = torch.ones(N)

        def fill(self, buf: torch.Tensor, *, out: torch.Tensor) -> None:
            pass

    layer = nn.Linear(N, N)
    buf, out = torch.ones(N), torch.ones(N)
    layer.prefetch = threading.Thread(target=Engine().fill, args=(buf,), kwargs={"out": out}, daemon=True)
    layer.timer = threading.Timer(1.0, print, args=[buf])
    result = walk(layer)
    assert sorted((ref.path, ref.restorable) for ref in result.refs) == [
        ("prefetch._args[0]", True),
        ("prefetch._kwargs['out']", True),
        ("timer.args[0]", True),
    ]
    fresh = torch.zeros(N)
    SlotPath("prefetch._args[0]").assign(layer, fresh)
    assert layer.prefetch._args == (fresh,)  # type: ignore[attr-defined]


def test_class_code_is_read_where_it_holds_a_tensor_itself() -> None:
    """A method that holds a tensor itself (in a closure cell or a default) is read; read on a class held as a
    value it is the function itself (``kernel.scale.__closure__[0]``, written in place: restorable). Read through an
    instance, the class attribute is a descriptor (``obj.scale`` is a bound method): no slot path names what it
    holds, and the walk says so (untrackable, never unseen). Methods holding no tensor stay code."""
    ws, default = torch.ones(N), torch.ones(N)

    def scale(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x * ws

    def shift(self: Any, x: torch.Tensor, by: torch.Tensor = default) -> torch.Tensor:
        return x + by

    kernel = type("Kernel", (), {"scale": scale, "shift": shift, "plain": lambda self: self})
    layer = nn.Linear(N, N)
    layer.kernel = kernel
    result = walk(layer)
    assert [(ref.path, ref.restorable) for ref in result.refs] == [
        ("kernel.scale.__closure__[0]", True),
        ("kernel.shift.__defaults__[0]", True),  # the tuple is rebuilt into the function
    ]
    assert result.objects_visited == 5  # the layer, the class, its two methods, shift's defaults
    fresh = torch.zeros(N)
    SlotPath("kernel.shift.__defaults__[0]").assign(layer, fresh)
    SlotPath("kernel.scale.__closure__[0]").assign(layer, fresh)
    assert shift.__defaults__ == (fresh,) and scale.__closure__[0].cell_contents is fresh  # type: ignore[index]
    del layer.kernel
    layer.obj = kernel()
    result = walk(layer)
    assert result.refs == ()
    assert [note.split(":")[0] for note in result.notes] == ["obj", "obj"]


def test_modules_threads_and_class_code_without_device_tensors_are_no_false_alarm() -> None:
    """The bound of these rules, on a layer that holds what real layers hold: library modules (``torch``,
    ``numpy``, ``math``, ``torch.ops``, ``torch.nn.functional``), a kernel module that imports them, a stdlib
    thread, a class whose methods call ``super()``, are decorated (``torch.no_grad()``, a decorator closing over its
    configuration) or are static methods and properties. No finding on any reload, and the walk reads each module
    as one object: 5 objects before these rules (every module and the thread a leaf), 13 with them (the four
    library modules, the kernel module, the thread and its two argument containers), never the modules' contents
    nor the methods' closures."""

    def configured(fn: Callable[..., Any]) -> Callable[..., Any]:  # a decorator closing over its configuration
        cfg = {"tile": 64, "backends": [torch.ops, math], "fallback": fn}

        @functools.wraps(fn)
        def inner(*args: Any) -> Any:
            return cfg["fallback"](*args)

        return inner

    class Base:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Method(Base):
        tile = 64

        def forward(self, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            return super().forward(x) + eps

        @torch.no_grad()
        def apply(self, x: torch.Tensor) -> torch.Tensor:
            return x

        @configured
        def tuned(self, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def rule() -> int:
            return 1

        @property
        def name(self) -> str:
            return "m"

    kernels = types.ModuleType("my_kernels")
    kernels.torch, kernels.np, kernels.math = torch, np, math  # type: ignore[attr-defined]
    kernels.Method = Method  # type: ignore[attr-defined]

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(N), requires_grad=False)
            self.libs = [torch, np, math, torch.ops, torch.nn.functional]
            self.kernels = kernels
            self.worker = threading.Thread(target=print, args=("ready",), kwargs={"end": ""}, daemon=True)
            self.method_cls = Method
            self.method = Method()
            self.sqrt = math.sqrt  # a builtin whose __self__ is the math module

    layer = Layer()
    result = walk(layer)
    assert result.refs == () and result.notes == () and result.exhausted is None
    assert result.objects_visited == 13
    for mode in ("strict", "migrate"):
        for detect in ("every-reload", "sealed-paths"):
            contract = GraphContract(layer, mode, detect=detect).seal()  # type: ignore[arg-type]
            outcome = _reload(contract, lambda: layer.weight.copy_(_weights(1)))
            assert outcome.status is Status.COMMITTED and outcome.findings == (), outcome.summary()


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
def test_an_abc_quant_method_checked_against_other_classes_is_no_budget_false_alarm(detect: str) -> None:
    """False alarm on every reload of a real engine, made by this round's own fix (classes held as values are read):
    an ABC's ``_abc_impl`` (C ``_abc_data``) holds weak references to every class an ``isinstance`` was asked about;
    read through, each class leads to its own ``_abc_impl``, and vLLM's quant-method classes (checked against one
    another all over the engine) cut every layer's walk at ``max_depth``: ``budget-exhausted`` on every reload. The
    ABC caches hold classes only by weak reference and no state of an instance: they are the ABC machinery, a leaf."""

    class Method(abc.ABC):  # noqa: B024 (vLLM's QuantizeMethodBase is an ABC)
        pass

    chain = [type(f"Method{i}", (Method,), {}) for i in range(10)]
    for base, other in itertools.pairwise(chain):
        assert not isinstance(other(), base)  # base's negative cache now holds a weak reference to other

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
            self.quant_method = chain[0]()
            self.rebuild()

        def rebuild(self) -> None:
            self.w_t = self.weight.t().contiguous()

    model = nn.Sequential(Layer())
    contract = GraphContract(model, "migrate", detect=detect).seal()  # type: ignore[arg-type]
    captured = model[0].w_t
    with contract.reload(), torch.no_grad():
        model[0].weight.copy_(torch.randn(4, 4))
        model[0].rebuild()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.COMMITTED, outcome.summary()
    assert model[0].w_t is captured and torch.equal(captured, model[0].weight.t())
