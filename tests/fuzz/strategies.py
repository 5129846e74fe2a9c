"""Hypothesis strategies for :class:`~fuzz.models.Scenario`.

Every choice is listed simplest first, so hypothesis shrinks a failing scenario toward one layer, attribute
holders, no declarations and plain rebinds: what is left in a shrunk example is what the failure needs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

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
    STATIC_SOURCES,
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


@st.composite
def scenarios(draw: Any) -> Scenario:
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
    )
