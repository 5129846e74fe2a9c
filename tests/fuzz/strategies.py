"""Hypothesis strategies for :class:`~fuzz.models.Scenario`.

Every choice is listed simplest first, so hypothesis shrinks a failing scenario toward one layer, attribute
holders, no declarations and plain rebinds: what is left in a shrunk example is what the failure needs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from fuzz.classes import CLASSES, FAULTS, VARIANTS, VOUCHED_FAULTS
from fuzz.models import (
    ATTR_WHENS,
    ATTRS,
    DEPENDENT_MUTATIONS,
    DETECTS,
    FLOAT_SOURCES,
    HOLDERS,
    INFERENCE,
    LAYERWISE,
    LOADERS,
    METAS,
    MODES,
    RECORDS,
    STATIC_SOURCES,
    SWAP_LOADERS,
    LayerSpec,
    Scenario,
    SlotSpec,
)

SOURCE_ORDER = ("t", "scale", "strides", "fp8", "int8", "sum", "complex")
HOLDER_ORDER = HOLDERS
DECLARE_ORDER = ("graph_visible", "register_derived", "none")
KIND_ORDER = ("derived", "alias", "tail", "weight_view", "tie")


def mutations_for(source: str) -> tuple[str, ...]:
    """The reload-time mutations that make sense for a derived slot of ``source``."""
    base = ["rebind", "inplace", "view_old", "skip", "respec_dtype", "respec_shape", "respec_stride"]
    base += ["respec_offset", "set_data", "data_inplace", "stash", "stash_ref", "free"]
    if source in FLOAT_SOURCES:
        base.append("neg")
    if source == "complex":
        base.append("conj")
    if source in STATIC_SOURCES:
        base += ["noop", "noop_write"]
    return tuple(base)


@st.composite
def derived_slots(draw: Any, name: str, source: str | None = None, peers: int = 0) -> SlotSpec:
    """A derived slot; ``peers``: how many slots of the layer come before it (what a ``peer`` attribute may name:
    one of them if derived, else the weight; the name is checked against the kinds when the layer is done)."""
    src = source if source is not None else draw(st.sampled_from(SOURCE_ORDER))
    attr = draw(st.sampled_from(ATTRS))
    attr_of = -1
    if attr == "peer" and peers:
        attr_of = draw(st.integers(-1, peers - 1))
    return SlotSpec(
        name=name,
        kind="derived",
        source=src,
        factor=draw(st.integers(1, 3)),
        holder=draw(st.sampled_from(HOLDER_ORDER)),
        declare=draw(st.sampled_from(DECLARE_ORDER)),
        subclass=draw(st.booleans()),
        mutation=draw(st.sampled_from(mutations_for(src))),
        attr=attr,
        attr_of=attr_of,
        attr_when=draw(st.sampled_from(ATTR_WHENS)) if attr != "none" else "always",
    )


@st.composite
def layers(draw: Any, index: int, layer0: LayerSpec | None) -> LayerSpec:
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 4))
    slots: list[SlotSpec] = []
    # A permutation group first: 2 (swap) or 3 (rotate) derived slots of one source (one geometry).
    group = draw(st.sampled_from((0, 2, 3)))
    if group:
        source = draw(st.sampled_from(SOURCE_ORDER))
        slots.extend(draw(derived_slots(f"d{i}", source, peers=i)) for i in range(group))
    for i in range(len(slots), len(slots) + draw(st.integers(0 if group else 1, 4))):
        derived = [j for j, s in enumerate(slots) if s.kind == "derived"]
        ties = [j for j, s in enumerate(layer0.slots) if s.kind == "derived"] if layer0 is not None else []
        kinds = ["derived", "weight_view"]
        if derived:
            kinds[1:1] = ["alias", "tail"]
        if ties:
            kinds.append("tie")
        kind = draw(st.sampled_from(kinds))
        if kind == "derived":
            slots.append(draw(derived_slots(f"d{i}", peers=i)))
            continue
        of = 0
        if kind in ("alias", "tail"):
            of = draw(st.sampled_from(derived))
        elif kind == "tie":
            of = draw(st.sampled_from(ties))
        slots.append(
            SlotSpec(
                name=f"d{i}",
                kind=kind,
                of=of,
                holder=draw(st.sampled_from(HOLDER_ORDER)),
                declare=draw(st.sampled_from(DECLARE_ORDER)),
                mutation=draw(st.sampled_from(DEPENDENT_MUTATIONS)),
            )
        )
    cycle: tuple[int, ...] = ()
    if group:
        cycle = tuple(draw(st.permutations(range(group))))
        if draw(st.booleans()):
            cycle = cycle[::-1]
    # A peer attribute names a derived slot (an earlier one); one that names anything else names the weight. A slot
    # whose tensor the reload permutes gets its attribute at every load: a first-load-only guard would leave the
    # attribute on the object, which then moves to another path (PWAL's own inconsistency, not graphsafe's).
    slots = [
        replace(s, attr_of=-1) if s.attr == "peer" and s.attr_of >= 0 and slots[s.attr_of].kind != "derived" else s
        for s in slots
    ]
    # A slot whose tensor the reload permutes carries no attribute: a PWAL that swaps tensor objects among paths
    # and hangs attributes on them is a documented gap (docs/fault-matrix.md, "attributes on a tensor").
    slots = [replace(s, attr="none", attr_of=-1, attr_when="always") if i in cycle else s for i, s in enumerate(slots)]
    slots = [replace(s, attr_of=-1) if s.attr == "peer" and s.attr_of in cycle else s for s in slots]
    return LayerSpec(
        rows=rows,
        cols=cols,
        slots=tuple(slots),
        loader=draw(st.sampled_from(LOADERS)),
        buffer=draw(st.booleans()),
        cycle=cycle,
        meta=draw(st.sampled_from(METAS)),
    )


#: How often the base class is drawn against each other class (``scenarios()``): two thirds of the reloads are the
#: base fuzzer's, the rest spread evenly over the classes.
BASE_WEIGHT = 2 * (len(CLASSES) - 1)


@st.composite
def scenarios(draw: Any, classes: tuple[str, ...] = CLASSES) -> Scenario:
    """A random scenario of one of ``classes`` (the base class weighted by :data:`BASE_WEIGHT` where it is one)."""
    pool = tuple(("base",) * (BASE_WEIGHT - 1) if "base" in classes else ()) + classes
    klass = draw(st.sampled_from(pool))
    scenario = draw(base_scenarios())
    return scenario if klass == "base" else draw(with_class(scenario, klass))


@st.composite
def with_class(draw: Any, scenario: Scenario, klass: str) -> Scenario:
    """``scenario`` with the feature of ``klass`` on one of its layers (``fuzz.classes``)."""
    n = len(scenario.layers)
    variant = draw(st.sampled_from(VARIANTS[klass]))
    faults = VOUCHED_FAULTS if (klass, variant) == ("external_cache", "vouched") else FAULTS[klass]
    fault = draw(st.sampled_from(faults))
    at = draw(st.integers(0, n - 1))
    # The classes run without inference mode: a tensor made under it takes in-place writes only there.
    out = replace(scenario, klass=klass, variant=variant, fault=fault, at=at, inference="none")
    if draw(st.booleans()):
        out = tamed(out)
    layers = list(out.layers)
    if klass == "external_cache":
        # Only a capture sees a read no model path feeds: without one the cache is a documented gap
        # (docs/fault-matrix.md, "module-level cache").
        out = replace(out, manifest=True)
    elif klass == "shared":
        out = replace(out, at=n - 1)  # no later layer ties to it, so a layer bound at one path reads consistently
    elif klass == "custom_op" and out.detect == "declared-only" and variant == "hidden":
        # An undeclared tensor only a custom op reads, not passed to it: declared-only watches declarations and what
        # the capture recorded, and the dispatch recorder cannot see that read (docs/manifest.md, blind spots).
        out = replace(out, variant="hidden_declared")
    elif klass == "call_order":
        out = replace(out, layerwise=fault, touch=at)
    elif klass in ("wrapper", "dtensor"):
        # The layer's weight is a wrapper: no attribute names it (the oracle's attribute view reads plain tensors).
        spec = layers[at]
        slots = tuple(replace(s, attr="none", attr_of=-1, attr_when="always") for s in spec.slots)
        loader = spec.loader if spec.loader != "stash" else "copy"
        layers[at] = replace(spec, slots=slots, meta="none", loader=loader)
    elif klass == "swap":
        # torch refuses to swap a tensor a view is taken of: no swap of a weight a weight_view slot views, nor of a
        # derived tensor a tail slot views (the model's own views; one graphsafe took would be graphsafe's crash).
        for index, spec in enumerate(layers):
            viewed = {s.of for s in spec.slots if s.kind == "tail"}
            weight_viewed = any(s.kind == "weight_view" for s in spec.slots)
            loader = draw(st.sampled_from(("lsd", "lsd_assign", "keep") if weight_viewed else (*SWAP_LOADERS, "keep")))
            slots = tuple(
                replace(s, mutation="swap")
                if s.kind == "derived" and i not in spec.cycle and i not in viewed and draw(st.booleans())
                else s
                for i, s in enumerate(spec.slots)
            )
            layers[index] = replace(spec, loader=loader, slots=slots)
    elif klass == "contracts":
        out = replace(out, at=draw(st.integers(0, 3)), layerwise="none", touch=0)
    return replace(out, layers=tuple(layers))


def tamed(scenario: Scenario) -> Scenario:
    """``scenario`` with every base fault taken out (slots written in place, weights copied in place, no
    permutation, attribute, loader metadata or layerwise touch): what the class adds decides the reload, so its
    false alarms show (half of each class's draws)."""
    layers = []
    for layer in scenario.layers:
        slots = tuple(
            replace(
                s,
                # (a static slot is declared static and left alone: one undeclared or rewritten while the weight
                # changed is the base class's known false alarm, see docs/fault-matrix.md)
                mutation=("rebind" if s.kind != "derived" else "noop" if s.source in STATIC_SOURCES else "inplace"),
                declare=(
                    "register_derived"
                    if s.kind == "derived" and s.source in STATIC_SOURCES and s.declare == "none"
                    else s.declare
                ),
                attr="none",
                attr_of=-1,
                attr_when="always",
            )
            for s in layer.slots
        )
        layers.append(replace(layer, slots=slots, loader="copy", cycle=(), meta="none"))
    layerwise = "plain" if scenario.layerwise != "none" else "none"
    return replace(scenario, layers=tuple(layers), layerwise=layerwise, touch=0)


@st.composite
def base_scenarios(draw: Any) -> Scenario:
    n = draw(st.integers(1, 3))
    specs: list[LayerSpec] = []
    for index in range(n):
        specs.append(draw(layers(index, specs[0] if specs else None)))
    detect = draw(st.sampled_from(DETECTS))
    # declared-only trusts the declarations plus the capture-time manifest (docs/design.md): always record one.
    manifest = True if detect == "declared-only" else draw(st.booleans())
    # Half the reloads layerwise (one of the touches), the rest all at once as before.
    layerwise = draw(st.sampled_from(LAYERWISE[1:])) if draw(st.booleans()) else "none"
    touch = draw(st.integers(0, n - 1)) if layerwise not in ("none", "plain") else 0
    inference = draw(st.sampled_from(INFERENCE[1:])) if draw(st.booleans()) else "none"
    return Scenario(
        layers=tuple(specs),
        mode=draw(st.sampled_from(MODES)),
        detect=detect,
        manifest=manifest,
        layerwise=layerwise,
        touch=touch,
        inference=inference,
        record=draw(st.sampled_from(RECORDS)),
    )
