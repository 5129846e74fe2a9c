"""The classes of scenario the fuzzer draws beside its base one: each adds one kind of state or call a class of hole
lives in to a random base scenario (``Scenario.klass``; its ``variant``, ``fault`` and ``at`` say how it is built,
what the reload does to it and on which layer).

========================  ========================================================================================
``contextvar``            a derived tensor held only by a ``contextvars.ContextVar`` (its default, or a value set in
                          the context); the reload makes a new variable, sets a new value, writes in place or skips
``external_cache``        a derived tensor in a module-level cache no model path reaches; the reload replaces the
                          entry (the old one kept alive by a rollback list, or dropped), writes in place or skips; or
                          a fixed table vouched for at capture (``Manifest.vouch_fixed``)
``lazy``                  an ``nn.LazyLinear`` sealed before its first forward (or after a warm-up); the loader copies,
                          binds new Parameters or ``load_state_dict`` s it (its weights derive from the layer's)
``shared``                the last layer also held at ``model.twin``; the reload leaves it shared, or binds a new
                          layer (other weights) at the second or at the first path
``call_order``            a layerwise reload whose touched layer gets ``before_layer`` late (after its load, or after
                          its PWAL) or never, ``after_layer`` never, or neither
``input_shares``          the static input carved out of a storage that also holds a model tensor (a plain table, or
                          the weight), ignored at capture (``record_capture(ignore=[x])``)
``custom_op``             a derived tensor read through a ``torch.library`` custom op, passed to it or read from a
                          registry the op is not passed (the oracle is told of that read; the dispatcher is not)
``wrapper``               a minimal ``__torch_dispatch__`` wrapper subclass (``__tensor_flatten__``): the weight
                          Parameter, or a derived tensor
``dtensor``               the weight as a DTensor (``Replicate`` on a one-rank CPU mesh)
``swap``                  weights loaded by ``torch.utils.swap_tensors`` or ``load_state_dict`` (swapping, copying or
                          ``assign=True``); derived tensors may be swapped in place by PWAL too
``contracts``             two contracts (this model and a one-layer one) in one agreement group of two ranks (threads
                          over one store), reloaded in the same or in different orders, named or by class name
========================  ========================================================================================

The oracle is the same as for the base class (:mod:`fuzz.oracle`): what the forward reads, by address, recorded by
its own dispatch mode (a custom op's hidden read told to it by the forward).
"""

from __future__ import annotations

import contextvars
import itertools
import warnings
import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fuzz import models
from fuzz.models import MAKERS, Feature, FuzzLayer, FuzzModel, Reader, Scenario, plain_weight, read_layer
from graphsafe import register_derived

CLASSES = (
    "base",
    "contextvar",
    "external_cache",
    "lazy",
    "shared",
    "call_order",
    "input_shares",
    "custom_op",
    "wrapper",
    "dtensor",
    "swap",
    "contracts",
)

#: Per class: its variants and the faults the reload applies to what it adds.
VARIANTS: dict[str, tuple[str, ...]] = {
    "contextvar": ("default", "value"),
    "external_cache": ("plain", "vouched"),
    "lazy": ("before", "after"),
    "shared": ("twin",),
    "call_order": ("layerwise",),
    "input_shares": ("table", "weight"),
    "custom_op": ("passed", "hidden", "passed_declared", "hidden_declared"),
    "wrapper": ("param", "slot"),
    "dtensor": ("param",),
    "swap": ("loader",),
    "contracts": ("same_order", "swapped_order"),
}
FAULTS: dict[str, tuple[str, ...]] = {
    "contextvar": ("new_var", "set", "inplace", "skip"),
    "external_cache": ("replace_keep", "replace", "inplace", "skip"),
    "lazy": ("copy", "rebind", "lsd"),
    "shared": ("inplace", "replace_twin", "replace_first"),
    "call_order": ("late_before", "late_before_pwal", "no_before", "no_after", "neither"),
    "input_shares": ("rebuild", "inplace", "skip"),
    "custom_op": ("rebuild", "inplace", "skip"),
    "wrapper": ("rebuild", "inplace", "skip", "rewrap"),
    "dtensor": ("loader",),
    "swap": ("loader",),
    "contracts": ("named", "unnamed"),
}
#: What the reload does to a vouched fixed table (its values never depend on the weights).
VOUCHED_FAULTS = ("noop", "inplace_same", "replace_keep")


def _value(layer: FuzzLayer) -> torch.Tensor:
    """What a class's derived tensor holds: a new tensor, a pure function of the layer's weight."""
    return (plain_weight(layer) * 3 + 1).contiguous()


class Plain(Feature):
    """A class that needs no state of its own (the harness or the strategy does the work)."""


# --------------------------------------------------------------------------------------------------------------
# contextvar


class ContextHeld(Feature):
    """``layer.cv``: a ContextVar whose default (or value set in this context) is the derived tensor."""

    def _new_var(self, layer: FuzzLayer, value: torch.Tensor) -> None:
        if self.scenario.variant == "default":
            layer.cv = contextvars.ContextVar("fz_cv", default=value)  # the case under test
        else:
            var: contextvars.ContextVar[torch.Tensor] = contextvars.ContextVar("fz_cv")
            var.set(value)
            layer.cv = var

    def pwal(self, model: FuzzModel, layer: FuzzLayer, reload: bool) -> None:
        value = _value(layer)
        fault = self.scenario.fault if reload else "new_var"
        if fault == "new_var":
            self._new_var(layer, value)
        elif fault == "set":
            layer.cv.set(value)
        elif fault == "inplace":
            layer.cv.get().copy_(value)

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        reader.read(f"{label}:cv", layer.cv.get())


# --------------------------------------------------------------------------------------------------------------
# external_cache

#: The module-level cache (one entry per model) and the rollback lists that keep replaced entries alive.
CACHE: dict[int, torch.Tensor] = {}
ROLLBACK: dict[int, list[torch.Tensor]] = {}
_keys = itertools.count()


class ExternalCache(Feature):
    """``CACHE[key]``: a derived tensor (or, vouched, a fixed table) that no model path holds."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.key = next(_keys)

    def _entry(self, layer: FuzzLayer) -> torch.Tensor:
        if self.scenario.variant == "vouched":
            return torch.arange(6, dtype=torch.float32)  # fixed: no reload changes it
        return _value(layer)

    def pwal(self, model: FuzzModel, layer: FuzzLayer, reload: bool) -> None:
        value = self._entry(layer)
        fault = self.scenario.fault if reload else "replace"
        if fault in ("replace", "replace_keep"):
            old = CACHE.get(self.key)
            if fault == "replace_keep" and old is not None:
                ROLLBACK.setdefault(self.key, []).append(old)
            CACHE[self.key] = value
        elif fault in ("inplace", "inplace_same"):
            CACHE[self.key].copy_(value)

    def vouch(self, manifest: Any) -> None:
        if self.scenario.variant == "vouched":
            manifest.vouch_fixed(CACHE[self.key])

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        reader.read(f"{label}:ext", CACHE[self.key])

    def release(self, model: FuzzModel) -> None:
        CACHE.pop(self.key, None)
        ROLLBACK.pop(self.key, None)


# --------------------------------------------------------------------------------------------------------------
# lazy


class Lazy(Feature):
    """``layer.lazy``: an ``nn.LazyLinear`` whose weights the loader derives from the layer's weight. Variant
    ``before``: the first load leaves it unmaterialised, so it is sealed lazy and materialised by the first forward
    after the seal (the warm-up); ``after``: loaded (materialised) before the seal."""

    def construct(self, model: FuzzModel) -> None:
        layer = model.layers[self.at]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Lazy modules are a new feature under heavy development"
            layer.lazy = nn.LazyLinear(layer.fuzz_spec.rows)

    def _values(self, layer: FuzzLayer) -> dict[str, torch.Tensor]:
        w = plain_weight(layer)
        return {"weight": (w * 2 + 1).contiguous(), "bias": w.sum(dim=1)}

    def load(self, layer: FuzzLayer, reload: bool) -> None:
        lazy = layer.lazy
        values = self._values(layer)
        how = self.scenario.fault if reload else "lsd"
        if not reload and self.scenario.variant == "before" and not self.cold:
            return  # sealed unmaterialised
        uninitialised = isinstance(lazy.weight, nn.parameter.UninitializedParameter)
        if how == "lsd" or uninitialised:
            lazy.load_state_dict(values)
        elif how == "copy":
            with torch.no_grad():
                lazy.weight.copy_(values["weight"])
                lazy.bias.copy_(values["bias"])
        elif how == "rebind":
            lazy.weight = nn.Parameter(values["weight"], requires_grad=False)
            lazy.bias = nn.Parameter(values["bias"], requires_grad=False)

    def warm(self, model: FuzzModel) -> None:
        layer = model.layers[self.at]
        with torch.no_grad():
            layer.lazy(torch.ones(1, layer.fuzz_spec.cols))

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        reader.note(f"{label}:lazy")
        with torch.no_grad():
            layer.lazy(torch.ones(1, layer.fuzz_spec.cols))


# --------------------------------------------------------------------------------------------------------------
# shared

TWIN_SEED = 4  # the weights of a layer a reload binds at one path of the shared layer


class Shared(Feature):
    """The last layer held at ``model.twin`` too (one module, two qualified names)."""

    def construct(self, model: FuzzModel) -> None:
        model.twin = model.layers[self.at]

    def _replace(self, model: FuzzModel) -> bool:
        fault = self.scenario.fault
        if fault == "inplace":
            return False
        base = replace(self.scenario, klass="base", variant="", fault="", at=0)
        fresh = models.build(base, models.weights(base, (TWIN_SEED,) * len(base.layers))).layers[self.at]
        if fault == "replace_twin":
            model.twin = fresh
        else:
            model.layers[self.at] = fresh
        return True

    def late(self, model: FuzzModel) -> bool:
        return self._replace(model)

    def finish(self, model: FuzzModel) -> None:
        if self.cold:
            self._replace(model)

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        twin = model.twin
        assert isinstance(twin, FuzzLayer)
        read_layer(reader, "twin", twin)


# --------------------------------------------------------------------------------------------------------------
# input_shares


class InputShares(Feature):
    """One storage holds the static input (its first element) and a model tensor: ``layer.table`` (a plain derived
    tensor PWAL writes there at the first load) or the layer's weight Parameter."""

    def construct(self, model: FuzzModel) -> None:
        layer = model.layers[self.at]
        rows, cols = layer.fuzz_spec.rows, layer.fuzz_spec.cols
        self.arena = torch.zeros(1 + rows * cols)
        self.arena[0] = 1.0
        self.x = self.arena[:1]
        self.view = self.arena[1:].view(rows, cols)
        if self.scenario.variant == "weight":
            layer.weight = nn.Parameter(self.view, requires_grad=False)

    def pwal(self, model: FuzzModel, layer: FuzzLayer, reload: bool) -> None:
        if self.scenario.variant != "table":
            return
        value = _value(layer)
        fault = self.scenario.fault if reload else "first"
        if fault == "first":
            self.view.copy_(value)
            layer.table = self.view
        elif fault == "rebuild":
            layer.table = value
        elif fault == "inplace":
            layer.table.copy_(value)

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        if self.scenario.variant == "table":
            reader.read(f"{label}:table", layer.table)


# --------------------------------------------------------------------------------------------------------------
# custom_op

#: key -> the layer whose ``op_t`` the hidden op reads (weak).
HIDDEN: dict[int, weakref.ReferenceType[FuzzLayer]] = {}


@torch.library.custom_op("graphsafe_fuzz::read", mutates_args=())  # type: ignore[misc]
def _read_op(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


@torch.library.custom_op("graphsafe_fuzz::read_hidden", mutates_args=())  # type: ignore[misc]
def _read_hidden_op(x: torch.Tensor, key: int) -> torch.Tensor:
    layer = HIDDEN[key]()
    assert layer is not None
    layer.op_t.clone()  # the read no argument shows
    return x.clone()


class CustomOp(Feature):
    """``layer.op_t``: a derived tensor the forward reads through a custom op, passed to it or not."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.key = next(_keys)

    def pwal(self, model: FuzzModel, layer: FuzzLayer, reload: bool) -> None:
        HIDDEN[self.key] = weakref.ref(layer)
        value = _value(layer)
        fault = self.scenario.fault if reload else "rebuild"
        if fault == "rebuild":
            layer.op_t = value
        elif fault == "inplace":
            layer.op_t.copy_(value)
        if self.scenario.variant.endswith("_declared"):
            register_derived(layer, "op_t")

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        if self.scenario.variant.startswith("passed"):
            reader.note(f"{label}:op")
            torch.ops.graphsafe_fuzz.read(layer.op_t)
        else:
            reader.saw(f"{label}:op", layer.op_t)
            torch.ops.graphsafe_fuzz.read_hidden(torch.zeros(1), self.key)

    def release(self, model: FuzzModel) -> None:
        HIDDEN.pop(self.key, None)


# --------------------------------------------------------------------------------------------------------------
# wrapper


class Wrapper(torch.Tensor):
    """A minimal torchao-style wrapper subclass: no storage of its own, one inner tensor, ``__tensor_flatten__``;
    every op runs on the inner tensor (an in-place op returns the wrapper, any other wraps its tensor results)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=False,
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Wrapper({self.inner!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> Wrapper:
        return Wrapper(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.inner if isinstance(x, Wrapper) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and returns[0].alias_info.is_write:
            return args[0]
        return tree_map(lambda x: Wrapper(x) if type(x) is torch.Tensor else x, out)


class Wrapped(Feature):
    """Variant ``param``: the layer's weight is ``nn.Parameter(Wrapper(...))``; ``slot``: ``layer.wrap_t`` is a
    Wrapper of a derived tensor."""

    def construct(self, model: FuzzModel) -> None:
        if self.scenario.variant == "param":
            layer = model.layers[self.at]
            layer.weight = nn.Parameter(Wrapper(layer.weight.detach().clone()), requires_grad=False)

    def param(self, values: torch.Tensor) -> torch.Tensor:
        return Wrapper(values) if self.scenario.variant == "param" else values

    def pwal(self, model: FuzzModel, layer: FuzzLayer, reload: bool) -> None:
        if self.scenario.variant != "slot":
            return
        value = _value(layer)
        fault = self.scenario.fault if reload else "rebuild"
        if fault == "rebuild":
            layer.wrap_t = Wrapper(value)
        elif fault == "inplace":
            layer.wrap_t.copy_(value)
        elif fault == "rewrap":
            inner = layer.wrap_t.inner
            inner.copy_(value)
            layer.wrap_t = Wrapper(inner)

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        if self.scenario.variant == "slot":
            reader.read(f"{label}:wrap", layer.wrap_t)


# --------------------------------------------------------------------------------------------------------------
# dtensor

_mesh: Any = None


def mesh() -> Any:
    """A one-rank CPU device mesh (a gloo process group over an in-memory store, made on first use)."""
    global _mesh
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _mesh = None
    if _mesh is None:
        _mesh = init_device_mesh("cpu", (1,))
    return _mesh


def close_mesh() -> None:
    """Destroy the process group :func:`mesh` made (if any)."""
    global _mesh
    import torch.distributed as dist

    if _mesh is not None and dist.is_initialized():
        dist.destroy_process_group()
    _mesh = None


class Distributed(Feature):
    """The layer's weight as a DTensor (``Replicate()`` on a one-rank CPU mesh)."""

    def construct(self, model: FuzzModel) -> None:
        layer = model.layers[self.at]
        layer.weight = nn.Parameter(self.param(layer.weight.detach().clone()), requires_grad=False)

    def param(self, values: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Replicate, distribute_tensor

        return distribute_tensor(values, mesh(), [Replicate()])


# --------------------------------------------------------------------------------------------------------------
# contracts

#: The second contract's one-layer model, by ``Scenario.at``: what its PWAL does to its one derived slot.
SECOND = (("register_derived", "rebind"), ("none", "respec_dtype"), ("register_derived", "skip"), ("none", "inplace"))


def second(scenario: Scenario) -> Scenario:
    """The second contract's scenario: one layer, one derived slot, the first's mode and policy."""
    declare, mutation = SECOND[scenario.at]
    slot = models.SlotSpec("d0", source="t", declare=declare, mutation=mutation)
    return Scenario(
        layers=(models.LayerSpec(rows=2, cols=2, slots=(slot,)),),
        mode=scenario.mode,
        detect="every-reload",
        manifest=scenario.manifest,
    )


def run_contracts(scenario: Scenario) -> list[Any]:
    """Two ranks (threads over one store), each with the scenario's model and the second one under two contracts,
    reloaded under a store agreement: both ranks in the same order, or rank 1 in the other. Returns the four
    results (rank 0's first)."""
    from _ranks import on_threads
    from fuzz import harness
    from graphsafe.contract import StoreAgreement

    first = replace(scenario, klass="base", variant="", fault="", at=0)
    other = second(scenario)
    named = scenario.fault == "named"

    def rank(group: Any) -> list[Any]:
        prepared = [harness.prepare(s, name=(n if named else None)) for s, n in ((first, "first"), (other, "second"))]
        order = prepared if group.rank == 0 or scenario.variant == "same_order" else prepared[::-1]
        results = []
        try:
            for one in order:
                if isinstance(one, harness.Result):
                    results.append(one)
                else:
                    results.append(harness.finish(one, agreement=StoreAgreement(group, timeout=20)))
        finally:
            for one in prepared:
                if not isinstance(one, harness.Result):
                    models.release(one.model)
        return results

    out: list[Any] = []
    for at, results in enumerate(on_threads(2, rank, limit=60.0)):
        if isinstance(results, BaseException):
            raise results
        for result in results:
            which = "first" if result.scenario is first else "second"
            out.append(replace(result, scenario=scenario, reason=f"rank {at}, {which} contract: {result.reason}"))
    return out


MAKERS.update(
    {
        "contextvar": ContextHeld,
        "external_cache": ExternalCache,
        "lazy": Lazy,
        "shared": Shared,
        "call_order": Plain,
        "input_shares": InputShares,
        "custom_op": CustomOp,
        "wrapper": Wrapped,
        "dtensor": Distributed,
        "swap": Plain,
        "contracts": Plain,
    }
)
