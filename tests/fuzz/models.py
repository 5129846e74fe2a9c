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

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fuzz import oracle
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
    "swap",  # ``torch.utils.swap_tensors(old, new)``: the old object now holds the new memory (the swap class only)
)
#: Mutations a dependent slot (alias, tail, weight view, tie) can have: it follows its referent or not.
DEPENDENT_MUTATIONS = ("rebind", "skip", "free")
#: A Python attribute PWAL hangs on a derived slot's tensor (``t.fz_attr``): a plain value computed from the weight,
#: a tensor computed from the weight (the forward reads it), or another slot's tensor (``attr_of``: a derived slot
#: of the layer, -1 the weight) that the forward reads through the attribute.
ATTRS = ("none", "plain", "tensor", "peer")
#: When PWAL sets it: every load; only at the first load (a guard: a tensor PWAL reuses keeps the old attribute, a new
#: one has none); or only where a condition on the weight holds (elsewhere PWAL deletes it).
ATTR_WHENS = ("always", "first", "cond")
ATTR = "fz_attr"
#: Loader metadata on a layer's weight parameter: set at construction (``weight_loader`` and a shard tuple, never
#: again: a new Parameter lacks it), a plain value the loader sets at every load, or a tensor the loader sets at
#: every load (``weight.fz_scale``, which the forward reads).
METAS = ("none", "ctor", "load", "tensor")
META_NAMES = ("weight_loader", "fz_shard", "fz_loaded", "fz_scale")
#: How the reload is driven: all at once, or ``reload(layerwise=True)`` with before_layer/after_layer around each
#: layer's load and PWAL, then maybe a touch of layer ``touch`` after its after_layer, before finish(): PWAL run
#: again, its weight written again with the same values, with other (final) values, with other values and PWAL run
#: again; or after_layer() without before_layer() for that layer.
LAYERWISE = ("none", "plain", "repwal", "rewrite_same", "rewrite_new", "rewrite_new_repwal", "no_before")
#: Where PWAL runs under ``torch.inference_mode()``: at the first load (so every derived tensor is an inference
#: tensor), at the reload, at both.
INFERENCE = ("none", "first", "reload", "both")

#: Whether the reload is recorded (``GraphContract.record_reloads``): ``first`` (the reload after a seal records
#: the load and PWAL, as every reload does under the default ``every``); ``none``, judged as a contract that records
#: no reload judges it (value samples, version counters and digests, no dispatch mode), against the whole layer's
#: tensors as inputs.
RECORDS = ("first", "none")

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
    attr: str = "none"  # derived: see ATTRS
    attr_of: int = -1  # attr "peer": a derived slot of this layer, -1 the weight
    attr_when: str = "always"  # see ATTR_WHENS

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
        attr = ""
        if self.attr != "none":
            target = ("weight" if self.attr_of < 0 else f"d{self.attr_of}") if self.attr == "peer" else self.attr
            attr = f" .{ATTR}={target}" + ("" if self.attr_when == "always" else f"({self.attr_when})")
        return f"{self.name}={what}@{self.holder}{declared}:{self.mutation}{attr}"


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
    meta: str = "none"  # loader metadata on the weight: see METAS

    def describe(self) -> str:
        parts = [f"w[{self.rows},{self.cols}]", f"load:{self.loader}"]
        if self.meta != "none":
            parts.append(f"meta:{self.meta}")
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
    layerwise: str = "none"  # see LAYERWISE
    touch: int = 0  # the layer a layerwise touch acts on
    inference: str = "none"  # see INFERENCE
    record: str = "first"  # see RECORDS
    #: The class of scenario (``fuzz.classes.CLASSES``): ``base``, or one extra feature on layer ``at`` of the
    #: model (a ContextVar-held tensor, a module-level cache, a lazy module, ...), built as ``variant`` says and
    #: changed by the reload as ``fault`` says.
    klass: str = "base"
    variant: str = ""
    fault: str = ""
    at: int = 0

    def describe(self) -> str:
        head = f"mode={self.mode} detect={self.detect}" + (" manifest" if self.manifest else "")
        if self.klass != "base":
            head = f"class={self.klass}:{self.variant}:{self.fault}@{self.at} " + head
        if self.layerwise != "none":
            head += f" layerwise:{self.layerwise}" + (f"@{self.touch}" if self.layerwise != "plain" else "")
        if self.inference != "none":
            head += f" inference:{self.inference}"
        if self.record != "first":
            head += f" record:{self.record}"
        return head + "".join(f"\n  layers.{i}: {layer.describe()}" for i, layer in enumerate(self.layers))

    def mutations(self) -> set[str]:
        """Every mutation kind the reload applies (loader kinds prefixed ``load:``, permutations as swap/rotate)."""
        found: set[str] = set()
        if self.layerwise != "none":
            found.add(f"layerwise:{self.layerwise}")
        if self.inference != "none":
            found.add(f"inference:{self.inference}")
        for layer in self.layers:
            found.add(f"load:{layer.loader}")
            if layer.meta != "none":
                found.add(f"meta:{layer.meta}")
            for slot in layer.slots:
                if slot.kind == "derived" and slot.attr != "none":
                    found.add(f"attr:{slot.attr}")
                    found.add(f"attr-when:{slot.attr_when}")
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


class SwapRefused(RuntimeError):
    """``torch.utils.swap_tensors`` refused a slot's tensor the fuzzer holds no view of (a foreign exception)."""


class Feature:
    """A class of scenario's extra state (``fuzz.classes``): made with the model, loaded, processed by PWAL and
    read by the forward with it. Kept off the model (:data:`FEATURES`), so no walk reaches it through the model."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.at = scenario.at
        self.cold = False  # the feature of a model built cold (the oracle's truth), not of the model under test

    def construct(self, model: FuzzModel) -> None:
        """After the model's layers are made, before the first load."""

    def finish(self, model: FuzzModel) -> None:
        """At the end of the build (a cold model's feature makes the state a reload leaves)."""

    def warm(self, model: FuzzModel) -> None:
        """The warm-up forward after the seal, before the capture (a lazy module materialises)."""

    def vouch(self, manifest: Any) -> None:
        """At capture: vouch for the fixed tables the class keeps outside the model."""

    def late(self, model: FuzzModel) -> bool:
        """The reload's last step, after every layer's PWAL (inside the transaction); whether it did anything."""
        return False

    def param(self, values: torch.Tensor) -> torch.Tensor:
        """The tensor a loader binds or copies for a layer-``at`` weight of ``values`` (a wrapper, a DTensor)."""
        return values

    def load(self, layer: FuzzLayer, reload: bool) -> None:
        """The class's own loading of layer ``at`` (after its weight is in place)."""

    def pwal(self, model: FuzzModel, layer: FuzzLayer, reload: bool) -> None:
        """The class's own PWAL of layer ``at`` (after the layer's slots)."""

    def read(self, model: FuzzModel, reader: Reader, layer: FuzzLayer, label: str) -> None:
        """Read what the class holds for layer ``at`` (``label``: the layer's label prefix)."""

    def release(self, model: FuzzModel) -> None:
        """Drop what the class keeps outside the model (a module-level cache's entries)."""


#: The feature of each model and of each of its layers (weak: a model's feature goes with it).
FEATURES: weakref.WeakKeyDictionary[nn.Module, Feature] = weakref.WeakKeyDictionary()
#: ``klass`` -> the feature a scenario of that class builds (filled by ``fuzz.classes``).
MAKERS: dict[str, Callable[[Scenario], Feature]] = {}


def feature_of(module: nn.Module) -> Feature | None:
    return FEATURES.get(module)


def plain_weight(layer: FuzzLayer) -> torch.Tensor:
    """The layer's weight as a plain tensor (a wrapper's or a DTensor's inner tensor), detached."""
    weight = layer.weight.detach()
    return next(oracle.kernel_tensors(weight)) if is_traceable_wrapper_subclass(weight) else weight


MISSING: Any = object()


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader metadata (``weight.weight_loader``) a layer hangs on its parameter at construction."""
    param.data.copy_(loaded)


class FuzzLayer(nn.Module):
    def __init__(self, spec: LayerSpec, index: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(spec.rows, spec.cols), requires_grad=False)
        if spec.meta == "ctor":
            setattr(self.weight, "weight_loader", default_weight_loader)  # noqa: B010 (attributes torch does not type)
            setattr(self.weight, "fz_shard", (index, spec.rows))  # noqa: B010
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
        self.fuzz_inference = scenario.inference  # plain data: where PWAL runs under inference mode


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


def load_layer(layer: FuzzLayer, values: dict[str, torch.Tensor], how: str, *, reload: bool = True) -> None:
    """Put one layer's ``values`` in place the way ``how`` (a loader kind) says, with its loader metadata."""
    if how == "keep":
        return
    feature = feature_of(layer)
    param = feature.param if feature is not None and feature.at == layer.fuzz_index else (lambda t: t)
    if how == "stash":
        layer.old_weight = layer.weight.detach().clone()
    with torch.no_grad():
        if how == "rebind":
            layer.weight = nn.Parameter(param(values["weight"].clone()), requires_grad=False)
        elif how == "data_copy":
            layer.weight.data.copy_(param(values["weight"]))
        elif how in SWAP_LOADERS:
            _swap_load(layer, param(values["weight"].clone()), how)
        else:
            layer.weight.copy_(param(values["weight"]))
        if "bias" in values:
            layer.bias.copy_(values["bias"])
    if feature is not None and feature.at == layer.fuzz_index:
        feature.load(layer, reload)
    meta = layer.fuzz_spec.meta
    if meta == "load":
        setattr(layer.weight, "fz_loaded", round(float(values["weight"].sum()), 4))  # noqa: B010
    elif meta == "tensor":
        setattr(layer.weight, "fz_scale", values["weight"].abs().amax(dim=1) * 0.5)  # noqa: B010


#: Loaders of the ``swap`` class: ``torch.utils.swap_tensors`` of the weight with a new Parameter; ``load_state_dict``
#: with ``torch.__future__.set_swap_module_params_on_conversion(True)`` (it swaps instead of copying); plain
#: ``load_state_dict`` (a copy); ``load_state_dict(assign=True)`` (binds the loaded tensors).
SWAP_LOADERS = ("swap", "lsd_swap", "lsd", "lsd_assign")


def _swap_load(layer: FuzzLayer, value: torch.Tensor, how: str) -> None:
    if how == "swap":
        torch.utils.swap_tensors(layer.weight, nn.Parameter(value, requires_grad=False))
        return
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(how == "lsd_swap")
    try:
        layer.load_state_dict({"weight": value}, strict=False, assign=how == "lsd_assign")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    if how == "lsd_assign":
        layer.weight.requires_grad_(False)


def load(model: FuzzModel, new: list[dict[str, torch.Tensor]], *, loaders: bool) -> None:
    """Put ``new`` into the model: in place (upstream) or, with ``loaders``, the way each layer's spec says."""
    for layer, values in zip(model.layers, new, strict=True):
        assert isinstance(layer, FuzzLayer)
        load_layer(layer, values, layer.fuzz_spec.loader if loaders else "copy", reload=loaders)


# --------------------------------------------------------------------------------------------------------------
# PWAL


def _value(layer: FuzzLayer, slot: SlotSpec, model: FuzzModel) -> torch.Tensor | None:
    """What the slot must hold after PWAL, computed from the current state (dependents from their referent;
    ``None`` when the referent was freed)."""
    spec = layer.fuzz_spec
    if slot.kind == "derived":
        value = SOURCES[slot.source](plain_weight(layer) * slot.factor)
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


#: Mutations that write into the old tensor, or (``set_data``) repoint it: on an inference tensor, torch allows the
#: write only under inference mode, and ``.data =`` a normal tensor leaves an object no view can be taken of.
_IN_PLACE = frozenset({"inplace", "noop_write", "view_old", "neg", "conj", "data_inplace", "set_data"})


def _mutate(layer: FuzzLayer, slot: SlotSpec, index: int, value: torch.Tensor | None, mutation: str) -> None:
    old = get_slot(layer, slot, index)
    if (
        mutation in _IN_PLACE
        and isinstance(old, torch.Tensor)
        and old.is_inference()
        and not torch.is_inference_mode_enabled()
    ):
        # A tensor the first load's PWAL made under inference mode takes in-place writes only there: a PWAL that
        # writes into its own tensors does so under inference mode too (else torch refuses; not graphsafe's case);
        # ``.data =`` there gets an inference tensor (a clone made there).
        with torch.inference_mode():
            _mutate_plain(layer, slot, index, old, value, mutation)
        return
    _mutate_plain(layer, slot, index, old, value, mutation)


def _mutate_plain(
    layer: FuzzLayer, slot: SlotSpec, index: int, old: Any, value: torch.Tensor | None, mutation: str
) -> None:
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
    elif mutation == "swap":  # the slot's tensor object takes the new tensor's memory (``torch.utils.swap_tensors``)
        try:
            torch.utils.swap_tensors(old, value)
        except Exception as exc:  # the fuzzer swaps no tensor a view of the model holds: a refusal is graphsafe's
            raise SwapRefused(f"torch.utils.swap_tensors on {slot.name} raised {exc!r}") from exc
    elif mutation in ("stash", "stash_ref"):
        setattr(layer, f"stash_{slot.name}", old.detach().clone() if mutation == "stash" else old)
        set_slot(layer, slot, index, value)
    else:
        raise AssertionError(f"unknown mutation {mutation!r}")


def _attr_value(layer: FuzzLayer, slot: SlotSpec, reload: bool) -> Any:
    """What PWAL hangs at ``slot``'s ``fz_attr`` now: a value, ``None`` to delete it, MISSING to leave it."""
    w = plain_weight(layer)
    if slot.attr_when == "first" and reload:
        return MISSING
    if slot.attr_when == "cond" and not bool((w * slot.factor).sum() > 0.5):
        return None
    if slot.attr == "plain":
        return round(float((w * slot.factor).sum()), 4)
    if slot.attr == "tensor":
        return (w * (slot.factor + 1)).abs().amax(dim=0)
    if slot.attr_of < 0:
        return layer.weight
    peer = get_slot(layer, layer.fuzz_spec.slots[slot.attr_of], slot.attr_of)
    return MISSING if peer is MISSING else peer


def _pwal_attributes(layer: FuzzLayer, reload: bool) -> None:
    """Hang each derived slot's Python attribute on the tensor now at its path (after every slot is rebuilt: a peer
    is the tensor its slot holds now). A PWAL that skips a slot (its "already processed" guard) skips it too."""
    spec = layer.fuzz_spec
    for index, slot in enumerate(spec.slots):
        if slot.kind != "derived" or slot.attr == "none":
            continue
        mutation = slot.mutation if reload and index not in spec.cycle else "rebind"
        if mutation in ("skip", "noop", "free"):
            continue
        tensor = get_slot(layer, slot, index)
        if not isinstance(tensor, torch.Tensor):
            continue
        value = _attr_value(layer, slot, reload)
        if value is None:
            tensor.__dict__.pop(ATTR, None)
        elif value is not MISSING:
            setattr(tensor, ATTR, value)


def _pwal_layer(layer: FuzzLayer, model: FuzzModel, reload: bool) -> None:
    where = model.fuzz_inference
    if where in (("reload", "both") if reload else ("first", "both")) and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            _pwal_layer_plain(layer, model, reload)
    else:
        _pwal_layer_plain(layer, model, reload)


def _pwal_layer_plain(layer: FuzzLayer, model: FuzzModel, reload: bool) -> None:
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
    _pwal_attributes(layer, reload)
    feature = feature_of(layer)
    if feature is not None and feature.at == layer.fuzz_index:
        feature.pwal(model, layer, reload)


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
        except (GraphSafeError, SwapRefused):
            raise
        except Exception as exc:
            raise FuzzerBug(f"the fuzzer's PWAL raised {exc!r}") from exc

    fn: Callable[[FuzzLayer, FuzzModel, bool], None] = pwal
    for static in (False, True):
        paths = _declared(spec, static)
        if paths:
            fn = graph_visible(*paths, static=static)(fn)
    return fn


def pwal_layer(model: FuzzModel, layer: FuzzLayer, *, reload: bool) -> None:
    """Run one layer's PWAL."""
    _pwal_function(layer.fuzz_spec)(layer, model, reload)


def pwal(model: FuzzModel, *, reload: bool) -> None:
    """Run every layer's PWAL, in order (a tie in a later layer reads layer 0's new tensor)."""
    for layer in model.layers:
        assert isinstance(layer, FuzzLayer)
        pwal_layer(model, layer, reload=reload)


def build(scenario: Scenario, new: list[dict[str, torch.Tensor]], *, cold: bool = False) -> FuzzModel:
    """A model built cold: construction, load, the build-time PWAL (no mutation)."""
    model = FuzzModel(scenario)
    if scenario.klass != "base":
        feature = MAKERS[scenario.klass](scenario)
        FEATURES[model] = feature
        for layer in model.layers:
            FEATURES[layer] = feature
        feature.cold = cold
        feature.construct(model)
    load(model, new, loaders=False)
    pwal(model, reload=False)
    feature = feature_of(model)
    if feature is not None:
        feature.finish(model)
    return model


def build_cold(scenario: Scenario, new: list[dict[str, torch.Tensor]]) -> FuzzModel:
    """The oracle's truth: a model built cold on the weights a reload leaves, in the state the reload leaves."""
    return build(scenario, new, cold=True)


def warm(model: FuzzModel) -> None:
    """The warm-up forward a capture runs first (its class's)."""
    feature = feature_of(model)
    if feature is not None:
        feature.warm(model)


def after_reload(model: FuzzModel) -> bool:
    """The class's last step of a reload (inside the transaction); whether it did anything."""
    feature = feature_of(model)
    return feature is not None and feature.late(model)


def static_input(model: FuzzModel) -> torch.Tensor | None:
    """The static input the class carves out of the model's memory, if any."""
    feature = feature_of(model)
    x = getattr(feature, "x", None)
    return x if isinstance(x, torch.Tensor) else None


def vouch(model: FuzzModel, manifest: Any) -> None:
    feature = feature_of(model)
    if feature is not None:
        feature.vouch(manifest)


def release(model: FuzzModel) -> None:
    """Drop what the model's class keeps outside it."""
    feature = feature_of(model)
    if feature is not None:
        feature.release(model)


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

    def saw(self, label: str, tensor: torch.Tensor) -> None:
        """A read no dispatched op shows (a custom op reading a table it is not passed), told to the oracle."""
        oracle.saw(label, tensor)


def forward(
    model: FuzzModel, x: torch.Tensor, note: Callable[[str], None] = lambda label: None, only: int | None = None
) -> torch.Tensor:
    """Read every tensor the model holds for the graph, layer by layer; a missing slot is not read. Tensor
    attributes are read too: the weight's ``fz_scale``, a derived slot's ``fz_attr`` (through its tensor).
    ``only``: read that layer alone (the harness's look at one layer in a layerwise reload)."""
    reader = Reader(note)
    try:
        out = x.clone()
        feature = feature_of(model)
        for li, layer in enumerate(model.layers):
            assert isinstance(layer, FuzzLayer)
            if only is not None and li != only:
                continue
            read_layer(reader, f"layers.{li}", layer)
            if feature is not None and feature.at == li:
                feature.read(model, reader, layer, f"layers.{li}")
        return out
    except Exception as exc:
        raise FuzzerBug(f"the fuzzer's forward raised {exc!r}") from exc


def read_layer(reader: Reader, label: str, layer: FuzzLayer) -> None:
    """Read one layer's weight, buffer, slots and tensor attributes (``label``: its label prefix)."""
    reader.read(f"{label}:weight", layer.weight)
    scale = layer.weight.__dict__.get("fz_scale")
    if isinstance(scale, torch.Tensor):
        reader.read(f"{label}:weight.fz_scale", scale)
    if layer.fuzz_spec.buffer:
        reader.read(f"{label}:bias", layer.bias)
    for index, slot in enumerate(layer.fuzz_spec.slots):
        tensor = get_slot(layer, slot, index)
        if isinstance(tensor, torch.Tensor):
            reader.read(f"{label}:{slot.name}", tensor)
            if slot.kind == "derived":
                attr = tensor.__dict__.get(ATTR)
                if isinstance(attr, torch.Tensor):
                    reader.read(f"{label}:{slot.name}.{ATTR}", attr)


# --------------------------------------------------------------------------------------------------------------
# Python attributes on the model's tensors, as the oracle compares them


def attributes(model: FuzzModel, only: int | None = None) -> dict[tuple[str, str], tuple[Any, ...]]:
    """Each Python attribute the fuzzer hangs on a tensor, by ``(slot label, name)``: ``("absent",)``,
    ``("plain", value)``, ``("ref", labels, logical values)`` where it is the very tensor some slot path holds (the
    labels of every such path: ``layers.0:d1``, ``layers.0:weight``), else ``("tensor", logical values)``. Only
    labels of derived slots and weights (dependents share their referent's object)."""
    held: list[tuple[str, torch.Tensor]] = []
    for li, layer in enumerate(model.layers):
        assert isinstance(layer, FuzzLayer)
        held.append((f"layers.{li}:weight", layer.weight))
        for index, slot in enumerate(layer.fuzz_spec.slots):
            tensor = get_slot(layer, slot, index)
            if isinstance(tensor, torch.Tensor) and slot.kind == "derived":
                held.append((f"layers.{li}:{slot.name}", tensor))

    def describe(value: Any) -> tuple[Any, ...]:
        if value is MISSING:
            return ("absent",)
        if isinstance(value, torch.Tensor):
            refs = frozenset(label for label, tensor in held if tensor is value)
            values = value.as_subclass(torch.Tensor).resolve_conj().resolve_neg().detach().clone()
            return ("ref", refs, values) if refs else ("tensor", values)
        return ("plain", value)

    out: dict[tuple[str, str], tuple[Any, ...]] = {}
    for li, layer in enumerate(model.layers):
        assert isinstance(layer, FuzzLayer)
        if only is not None and li != only:
            continue
        if layer.fuzz_spec.meta != "none":
            for name in META_NAMES:
                out[(f"layers.{li}:weight", name)] = describe(layer.weight.__dict__.get(name, MISSING))
        if all(slot.attr == "none" for slot in layer.fuzz_spec.slots):
            continue
        for index, slot in enumerate(layer.fuzz_spec.slots):
            if slot.kind != "derived":  # every derived slot: a permutation moves attributes between them
                continue
            tensor = get_slot(layer, slot, index)
            value = tensor.__dict__.get(ATTR, MISSING) if isinstance(tensor, torch.Tensor) else MISSING
            out[(f"layers.{li}:{slot.name}", ATTR)] = describe(value)
    return out
