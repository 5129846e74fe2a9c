"""Scenario values and the models they build: holders, declarations, loaders, PWAL mutations and the forward.

A :class:`Scenario` is a plain frozen value (hypothesis draws it, a regression test can write one by hand). It
builds a :class:`FuzzModel` of :class:`FuzzLayer` s; each layer has a raw ``weight`` parameter (and maybe a
buffer) and derived tensors held in one of several places (:data:`HOLDERS`), declared or not (:data:`DECLARES`).
The build-time PWAL always allocates new tensors; the reload-time PWAL applies each slot's mutation
(:data:`MUTATIONS`). Every derived value is a pure function of the weight, so a model built cold on the new weights
(``build(scenario, weights)``) holds exactly the values a correct reload must leave behind.

The forward reads every tensor the model holds for a graph (weights, buffers, derived slots, aliases, views, ties)
and calls ``note(label)`` before each read, so the oracle can tell reads apart by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphsafe import GraphSafeError, graph_visible, register_derived

# --------------------------------------------------------------------------------------------------------------
# The vocabulary

MODES = ("strict", "recapture", "migrate")
DETECTS = ("every-reload", "sealed-paths", "declared-only")

#: Where a slot's tensor lives on its layer.
HOLDERS = ("attr", "dict", "list", "nested", "closure", "child")
#: How a slot is declared.
DECLARES = ("none", "graph_visible", "register_derived")
#: What a slot is: a value derived from the weight, or a second path onto another slot's (or the weight's) memory.
KINDS = ("derived", "alias", "tail", "weight_view", "tie")


def _int8(w: torch.Tensor) -> torch.Tensor:
    return (w * 16).round().clamp(-127, 127).to(torch.int8)


#: Derived values: pure functions of the weight (``strides`` does not depend on the values at all).
SOURCES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "t": lambda w: w.t().contiguous(),
    "scale": lambda w: w.abs().amax(dim=1),
    "sum": lambda w: w.sum(),
    "fp8": lambda w: w.to(torch.float8_e4m3fn),
    "int8": _int8,
    "complex": lambda w: torch.complex(w, -2 * w),
    "strides": lambda w: torch.tensor([w.shape[1], 1], dtype=torch.int64),
}
STATIC_SOURCES = frozenset({"strides"})
FLOAT_SOURCES = frozenset({"t", "scale", "sum"})

#: What the reload-time PWAL does to a slot (the build-time PWAL always does ``rebind``).
MUTATIONS = (
    "rebind",  # a new tensor with the new values (the pattern graphsafe exists for)
    "inplace",  # the new values copied into the existing tensor
    "view_old",  # new values written into the old storage, bound as another view object of it
    "respec_dtype",  # a new tensor of another dtype (same values)
    "respec_shape",  # a new tensor with a leading size-1 dimension (same values)
    "respec_stride",  # a new tensor with doubled strides inside a larger buffer (same values)
    "respec_offset",  # a new tensor at storage offset 2 of a larger buffer (same values)
    "neg",  # new values negated into the old storage, bound as a negative view (logical values right)
    "conj",  # conjugated new values into the old storage, bound as a conjugate view (complex only)
    "set_data",  # the existing tensor object repointed at new memory (``t.data = new``)
    "data_inplace",  # the new values written through ``t.data`` (the version counter does not move)
    "stash",  # a copy of the old tensor kept at a new attribute, then rebind
    "stash_ref",  # the old tensor itself kept at a new attribute, then rebind
    "free",  # the slot deleted (the path no longer resolves)
    "skip",  # PWAL's "already processed" guard: the slot is left as it was
    "noop",  # static contents: left alone (correct: they do not depend on the weights)
    "noop_write",  # static contents: the same values written in place
)
#: Mutations a dependent slot (alias, tail, weight view, tie) can have: it follows its referent or not.
DEPENDENT_MUTATIONS = ("rebind", "skip", "free")
#: How the loader puts a layer's new weight in place.
LOADERS = (
    "copy",  # ``weight.copy_(new)`` under no_grad (upstream)
    "data_copy",  # ``weight.data.copy_(new)`` (no version bump)
    "rebind",  # ``layer.weight = nn.Parameter(new)``
    "keep",  # a partial reload: this layer's weights do not change
    "stash",  # copy, after keeping a clone of the old weight at ``layer.old_weight``
)


@dataclass(frozen=True)
class SlotSpec:
    """One graph-visible tensor of a layer."""

    name: str
    kind: str = "derived"
    source: str = "t"  # derived: a key of SOURCES
    factor: int = 1  # derived: the value is SOURCES[source](weight * factor)
    of: int = 0  # alias/tail: index of a derived slot of this layer; tie: index of a derived slot of layer 0
    holder: str = "attr"
    declare: str = "none"
    subclass: bool = False  # derived: held as a tensor subclass (``as_subclass``)
    mutation: str = "rebind"

    def path(self, index: int) -> str:
        """The slot path graphsafe declarations use for it on its layer."""
        return {
            "attr": self.name,
            "dict": f"cache[{self.name!r}]",
            "list": f"items[{index}]",
            "nested": f"qm.kernel.{self.name}",
            "closure": f"{self.name}_fn.__closure__[0]",
            "child": f"sub.{self.name}",
        }[self.holder]

    def describe(self) -> str:
        what = {
            "derived": f"{self.source}*{self.factor}" + ("(subclass)" if self.subclass else ""),
            "alias": f"alias(d{self.of})",
            "tail": f"tail(d{self.of})",
            "weight_view": "weight.t()",
            "tie": f"tie(layers.0.d{self.of})",
        }[self.kind]
        declared = "" if self.declare == "none" else f" [{self.declare}]"
        return f"{self.name}={what}@{self.holder}{declared}:{self.mutation}"


@dataclass(frozen=True)
class LayerSpec:
    """One layer: the weight's shape, its slots, the loader, and the slots whose tensors PWAL permutes."""

    rows: int = 2
    cols: int = 3
    slots: tuple[SlotSpec, ...] = ()
    loader: str = "copy"
    buffer: bool = False
    #: Derived slots (same source, so the same geometry) whose tensor objects the reload's PWAL permutes before
    #: writing each one's new values in place: two is a swap, three a rotation.
    cycle: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = [f"w[{self.rows},{self.cols}]", f"load:{self.loader}"]
        if self.buffer:
            parts.append("buffer")
        if self.cycle:
            parts.append("cycle(" + ",".join(f"d{i}" for i in self.cycle) + ")")
        parts.extend(slot.describe() for slot in self.slots)
        return " ".join(parts)


@dataclass(frozen=True)
class Scenario:
    """A model, how the contract watches it, and what the reload does."""

    layers: tuple[LayerSpec, ...]
    mode: str = "strict"
    detect: str = "every-reload"
    manifest: bool = False  # the capture ran under graphsafe.record_capture

    def describe(self) -> str:
        head = f"mode={self.mode} detect={self.detect}" + (" manifest" if self.manifest else "")
        return head + "".join(f"\n  layers.{i}: {layer.describe()}" for i, layer in enumerate(self.layers))

    def mutations(self) -> set[str]:
        """Every mutation kind the reload applies (loader kinds prefixed ``load:``, permutations as swap/rotate)."""
        found: set[str] = set()
        for layer in self.layers:
            found.add(f"load:{layer.loader}")
            if layer.cycle:
                found.add("swap" if len(layer.cycle) == 2 else "rotate")
            for index, slot in enumerate(layer.slots):
                if index not in layer.cycle:
                    found.add(slot.mutation if slot.kind == "derived" else f"{slot.kind}:{slot.mutation}")
        return found


# --------------------------------------------------------------------------------------------------------------
# The model


class Marked(torch.Tensor):
    """A tensor subclass (no behaviour of its own): derived tensors some kernels wrap."""


class Kernel:
    """A plain object under a plain object, as quant methods hold their kernels."""


class QuantMethod:
    def __init__(self) -> None:
        self.kernel = Kernel()


def _closure() -> Callable[[], Any]:
    held: Any = None

    def read() -> Any:
        return held

    return read


class FuzzerBug(Exception):
    """The fuzzer's own PWAL or forward failed: a bug in the generator, never counted against graphsafe."""


MISSING: Any = object()


class FuzzLayer(nn.Module):
    def __init__(self, spec: LayerSpec, index: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(spec.rows, spec.cols), requires_grad=False)
        if spec.buffer:
            self.register_buffer("bias", torch.zeros(spec.rows))
        self.cache: dict[str, torch.Tensor] = {}
        self.items: list[torch.Tensor | None] = [None] * len(spec.slots)
        self.qm = QuantMethod()
        if any(slot.holder == "child" for slot in spec.slots):
            self.sub = nn.Module()
        for slot in spec.slots:
            if slot.holder == "closure":
                setattr(self, f"{slot.name}_fn", _closure())
        # Not walked as a module: the spec is plain data, the index says which layer this is.
        self.fuzz_spec = spec
        self.fuzz_index = index


class FuzzModel(nn.Module):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FuzzLayer(spec, i) for i, spec in enumerate(scenario.layers))


def get_slot(layer: FuzzLayer, slot: SlotSpec, index: int) -> Any:
    """The slot's tensor, read the way user code reads it (not through graphsafe's paths); MISSING if absent."""
    holder = slot.holder
    if holder == "attr":
        return getattr(layer, slot.name, MISSING)
    if holder == "dict":
        return layer.cache.get(slot.name, MISSING)
    if holder == "list":
        value = layer.items[index]
        return MISSING if value is None else value
    if holder == "nested":
        return getattr(layer.qm.kernel, slot.name, MISSING)
    if holder == "closure":
        value = getattr(layer, f"{slot.name}_fn")()
        return MISSING if value is None else value
    return getattr(layer.sub, slot.name, MISSING)


def set_slot(layer: FuzzLayer, slot: SlotSpec, index: int, value: torch.Tensor | None) -> None:
    """Bind ``value`` at the slot (``None``: delete it)."""
    holder = slot.holder
    if holder == "attr" or holder == "nested" or holder == "child":
        owner = layer if holder == "attr" else layer.qm.kernel if holder == "nested" else layer.sub
        if value is None:
            if hasattr(owner, slot.name):
                delattr(owner, slot.name)
        else:
            setattr(owner, slot.name, value)
    elif holder == "dict":
        if value is None:
            layer.cache.pop(slot.name, None)
        else:
            layer.cache[slot.name] = value
    elif holder == "list":
        layer.items[index] = value
    else:
        fn = getattr(layer, f"{slot.name}_fn")
        fn.__closure__[0].cell_contents = value


# --------------------------------------------------------------------------------------------------------------
# Weights and loading


def weights(scenario: Scenario, seeds: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """The weights of each layer for per-layer seeds (a reload that keeps a layer passes its old seed)."""
    out = []
    for index, (spec, seed) in enumerate(zip(scenario.layers, seeds, strict=True)):
        generator = torch.Generator().manual_seed(seed * 1009 + index)
        entry = {"weight": torch.randn(spec.rows, spec.cols, generator=generator)}
        if spec.buffer:
            entry["bias"] = torch.randn(spec.rows, generator=generator)
        out.append(entry)
    return out


def load(model: FuzzModel, new: list[dict[str, torch.Tensor]], *, loaders: bool) -> None:
    """Put ``new`` into the model: in place (upstream) or, with ``loaders``, the way each layer's spec says."""
    for layer, values in zip(model.layers, new, strict=True):
        assert isinstance(layer, FuzzLayer)
        how = layer.fuzz_spec.loader if loaders else "copy"
        if how == "keep":
            continue
        if how == "stash":
            layer.old_weight = layer.weight.detach().clone()
        with torch.no_grad():
            if how == "rebind":
                layer.weight = nn.Parameter(values["weight"].clone(), requires_grad=False)
            elif how == "data_copy":
                layer.weight.data.copy_(values["weight"])
            else:
                layer.weight.copy_(values["weight"])
            if "bias" in values:
                layer.bias.copy_(values["bias"])


# --------------------------------------------------------------------------------------------------------------
# PWAL


def _value(layer: FuzzLayer, slot: SlotSpec, model: FuzzModel) -> torch.Tensor | None:
    """What the slot must hold after PWAL, computed from the current state (dependents from their referent;
    ``None`` when the referent was freed)."""
    spec = layer.fuzz_spec
    if slot.kind == "derived":
        value = SOURCES[slot.source](layer.weight.detach() * slot.factor)
        return value.as_subclass(Marked) if slot.subclass else value
    if slot.kind == "weight_view":
        return layer.weight.data.t()
    if slot.kind == "tie":
        peer = model.layers[0]
        assert isinstance(peer, FuzzLayer)
        tied = get_slot(peer, peer.fuzz_spec.slots[slot.of], slot.of)
        return None if tied is MISSING else tied  # type: ignore[no-any-return]
    referent = get_slot(layer, spec.slots[slot.of], slot.of)
    if referent is MISSING:
        return None
    if slot.kind == "alias":
        return referent  # type: ignore[no-any-return]
    return referent.view(-1)[1:]  # tail: a view at offset 1


_OTHER_DTYPE = {
    torch.float32: torch.float64,
    torch.float8_e4m3fn: torch.float16,
    torch.int8: torch.int16,
    torch.int64: torch.int32,
    torch.complex64: torch.complex128,
}


def _respecified(value: torch.Tensor, how: str) -> torch.Tensor:
    if how == "respec_dtype":
        return value.to(_OTHER_DTYPE[value.dtype])
    if how == "respec_shape":
        return value.unsqueeze(0)
    n = value.numel()
    if how == "respec_offset":
        buf = torch.zeros(n + 2, dtype=value.dtype)
        out = buf[2:].view(value.shape)
    else:  # respec_stride: every stride doubled
        buf = torch.zeros(2 * n + 1, dtype=value.dtype)
        contiguous = torch.empty(value.shape).stride()
        out = buf.as_strided(value.shape, [2 * s for s in contiguous])
    out.copy_(value)
    return out.as_subclass(type(value)) if type(value) is not torch.Tensor else out


def _mutate(layer: FuzzLayer, slot: SlotSpec, index: int, value: torch.Tensor | None, mutation: str) -> None:
    old = get_slot(layer, slot, index)
    if value is None:  # a dependent whose referent was freed goes with it
        if mutation != "skip":
            set_slot(layer, slot, index, None)
    elif mutation in ("rebind",) or (old is MISSING and mutation != "free"):
        set_slot(layer, slot, index, value)
    elif mutation in ("skip", "noop"):
        pass
    elif mutation == "free":
        set_slot(layer, slot, index, None)
    elif mutation == "inplace":
        old.copy_(value)
    elif mutation == "noop_write":
        old.copy_(old.clone())
    elif mutation == "view_old":
        old.copy_(value)
        set_slot(layer, slot, index, old.view(old.shape))
    elif mutation.startswith("respec_"):
        set_slot(layer, slot, index, _respecified(value, mutation))
    elif mutation == "neg":
        old.copy_(-value)
        set_slot(layer, slot, index, torch._neg_view(old))
    elif mutation == "conj":
        old.copy_(value.conj())
        set_slot(layer, slot, index, old.conj())
    elif mutation == "set_data":
        old.data = value.as_subclass(torch.Tensor).clone()
    elif mutation == "data_inplace":
        old.data.copy_(value)
    elif mutation in ("stash", "stash_ref"):
        setattr(layer, f"stash_{slot.name}", old.detach().clone() if mutation == "stash" else old)
        set_slot(layer, slot, index, value)
    else:
        raise AssertionError(f"unknown mutation {mutation!r}")


def _pwal_layer(layer: FuzzLayer, model: FuzzModel, reload: bool) -> None:
    spec = layer.fuzz_spec
    cycle = spec.cycle if reload else ()
    if len(cycle) > 1:
        # Permute the existing tensor objects among the cycle's slots; each then gets its own values in place.
        olds = [get_slot(layer, spec.slots[i], i) for i in cycle]
        for position, i in enumerate(cycle):
            set_slot(layer, spec.slots[i], i, olds[(position + 1) % len(cycle)])
    for index, slot in enumerate(spec.slots):
        mutation = slot.mutation if reload else "rebind"
        if index in cycle:
            mutation = "inplace"
        _mutate(layer, slot, index, _value(layer, slot, model), mutation)
        if slot.declare == "register_derived" and get_slot(layer, slot, index) is not MISSING:
            register_derived(layer, slot.path(index), static=slot.source in STATIC_SOURCES and slot.kind == "derived")


def _declared(spec: LayerSpec, static: bool) -> tuple[str, ...]:
    return tuple(
        slot.path(i)
        for i, slot in enumerate(spec.slots)
        if slot.declare == "graph_visible" and (slot.kind == "derived" and slot.source in STATIC_SOURCES) == static
    )


def _pwal_function(spec: LayerSpec) -> Callable[[FuzzLayer, FuzzModel, bool], None]:
    def pwal(layer: FuzzLayer, model: FuzzModel, reload: bool) -> None:
        try:
            _pwal_layer(layer, model, reload)
        except GraphSafeError:
            raise
        except Exception as exc:
            raise FuzzerBug(f"the fuzzer's PWAL raised {exc!r}") from exc

    fn: Callable[[FuzzLayer, FuzzModel, bool], None] = pwal
    for static in (False, True):
        paths = _declared(spec, static)
        if paths:
            fn = graph_visible(*paths, static=static)(fn)
    return fn


def pwal(model: FuzzModel, *, reload: bool) -> None:
    """Run every layer's PWAL, in order (a tie in a later layer reads layer 0's new tensor)."""
    for layer in model.layers:
        assert isinstance(layer, FuzzLayer)
        _pwal_function(layer.fuzz_spec)(layer, model, reload)


def build(scenario: Scenario, new: list[dict[str, torch.Tensor]]) -> FuzzModel:
    """A model built cold: construction, load, the build-time PWAL (no mutation)."""
    model = FuzzModel(scenario)
    load(model, new, loaders=False)
    pwal(model, reload=False)
    return model


def reload(model: FuzzModel, new: list[dict[str, torch.Tensor]]) -> None:
    """The reload under test: each layer's loader, then the reload-time PWAL with every slot's mutation."""
    load(model, new, loaders=True)
    pwal(model, reload=True)


# --------------------------------------------------------------------------------------------------------------
# The forward a graph captures


@dataclass
class Reader:
    """Calls ``note(label)`` before each read; the read itself is one op on the tensor (what a kernel reads)."""

    note: Callable[[str], None] = field(default=lambda label: None)

    def read(self, label: str, tensor: torch.Tensor) -> torch.Tensor:
        self.note(label)
        return tensor.clone()


def forward(model: FuzzModel, x: torch.Tensor, note: Callable[[str], None] = lambda label: None) -> torch.Tensor:
    """Read every tensor the model holds for the graph, layer by layer; a missing slot is not read."""
    reader = Reader(note)
    try:
        out = x.clone()
        for li, layer in enumerate(model.layers):
            assert isinstance(layer, FuzzLayer)
            out = out + reader.read(f"layers.{li}:weight", layer.weight).sum()
            if layer.fuzz_spec.buffer:
                out = out + reader.read(f"layers.{li}:bias", layer.bias).sum()
            for index, slot in enumerate(layer.fuzz_spec.slots):
                tensor = get_slot(layer, slot, index)
                if isinstance(tensor, torch.Tensor):
                    reader.read(f"layers.{li}:{slot.name}", tensor)
        return out
    except Exception as exc:
        raise FuzzerBug(f"the fuzzer's forward raised {exc!r}") from exc
