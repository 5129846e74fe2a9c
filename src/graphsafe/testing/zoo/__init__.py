"""An example zoo of the real sites where reload breaks captured CUDA graphs.

Each :class:`Example` is a small CPU-friendly layer kind whose ``process_weights_after_loading`` (PWAL)
recomputes derived tensors from the weights as *new* tensors outside ``_parameters``/``_buffers`` -- so a graph
captured before a reload would replay stale or freed memory -- in two variants:

``legacy``
    as the site is written today: nothing declared.
``migrated``
    the same PWAL (still creating new tensors) with graphsafe declarations added
    (:func:`~graphsafe.graph_visible`, :func:`~graphsafe.register_derived`, :func:`~graphsafe.stable_empty`), so a
    :class:`~graphsafe.GraphContract` can restore the new values into the captured storage.

Usage::

    from graphsafe.testing.zoo import EXAMPLES

    ex = EXAMPLES["act_order"]
    model = ex.build("legacy", seed=0)           # two layers, first load done
    x = ex.example_input(model)
    y0 = model(x)
    ex.load_weights(model, ex.make_weights(model, seed=1))   # an RL step's reload
    y1 = model(x)

Forwards use only aten ops with static shapes (no ``.item()``, no host syncs), so they can be captured in a CUDA
graph; the one exception is ``lazy_permute_scratch``, whose first forward after a load allocates its scratch
(warm-up, before capture).
"""

from __future__ import annotations

from graphsafe.testing.zoo import (
    act_order,
    cutlass_moe,
    flashinfer,
    lazy_scratch,
    machete_closure,
    machete_partial,
    marlin,
    mla,
    module_cache,
    slots_kernel,
    underscore,
)
from graphsafe.testing.zoo.base import HIDDEN, TOKENS, VARIANTS, Example, Variant, ZooModel, run_pwal

__all__ = ["EXAMPLES", "HIDDEN", "TOKENS", "VARIANTS", "Example", "Variant", "ZooModel", "run_pwal"]

#: Every example by name, in the order of the sites they model.
EXAMPLES: dict[str, Example] = {
    example.name: example
    for example in (
        marlin.EXAMPLE,
        act_order.EXAMPLE,
        cutlass_moe.EXAMPLE,
        mla.EXAMPLE,
        flashinfer.EXAMPLE,
        underscore.EXAMPLE,
        machete_partial.EXAMPLE,
        machete_closure.EXAMPLE,
        slots_kernel.EXAMPLE,
        lazy_scratch.EXAMPLE,
        module_cache.EXAMPLE,
    )
}
