"""Soak: 1,000 reloads per mode of a zoo-sized model, alternating two weight sets, watching for leaks.

A leak or an accumulating structure shows as growth between the first window after warm-up and the last one: in
process memory (RSS), in the number of objects the garbage collector tracks, in graphsafe's own structures
(declaration store, sealed slots, quarantine, callbacks, the walker's class plans), or in per-reload time. Time is
compared with a generous factor: this detects something that grows with the number of reloads, it is not a
benchmark. Every reload's outcome and the model's output are checked too, and at the end every derived tensor must
equal a model built cold on the last weights.

Each mode soaks the path it is for: ``strict`` a fully declared model (commits, addresses never move);
``recapture`` the same plus one legacy layer (every reload needs a recapture: callback, then a full reseal);
``migrate`` declared and legacy layers mixed (commits, restoring the undeclared tensors on the way).
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from graphsafe import FindingKind, GraphContract, ReloadOutcome, Status
from graphsafe.collectors.walker import _plans
from graphsafe.paths import SlotPath
from graphsafe.registry._store import iter_declared_layers
from graphsafe.testing.zoo import EXAMPLES, ZooModel

pytestmark = pytest.mark.slow

RELOADS = 1_000
WINDOW = 100  # reloads per measurement window; the first window is warm-up
SEED_A, SEED_B = 1, 2
#: Allowed growth from the first window after warm-up to the last: a leak of one object per reload is +800, the
#: measurement itself adds 2 per window.
MAX_OBJECT_GROWTH = 100
#: RSS growth allowed (about 10 KiB was seen). Leaked Python objects show in the object count first; RSS is the
#: witness for memory no tracked object owns (C++-side buffers), from about 4.5 KB per reload.
MAX_RSS_GROWTH = 4 * 1024 * 1024
#: Median per-reload time of the last window vs the first after warm-up.
MAX_SLOWDOWN = 3.0

# Every example whose layer declares its slots, in its migrated variant (module_cache declares nothing).
DECLARED = [name for name, example in EXAMPLES.items() if example.slot_paths]
LEGACY_RESTORABLE = ["act_order", "underscore_scales", "slots_kernel", "mla_transposed", "machete_partial"]

MIXES: dict[str, list[tuple[str, str]]] = {
    "strict": [(name, "migrated") for name in DECLARED],
    "recapture": [*((name, "migrated") for name in DECLARED), ("underscore_scales", "legacy")],
    "migrate": [
        *((name, "migrated") for name in DECLARED if name not in LEGACY_RESTORABLE),
        *((name, "legacy") for name in LEGACY_RESTORABLE),
    ],
}
EXPECTED = {
    "strict": (Status.COMMITTED, frozenset()),
    "recapture": (Status.NEEDS_RECAPTURE, frozenset({FindingKind.MOVED})),
    "migrate": (Status.COMMITTED, frozenset({FindingKind.AUTO_RESTORED})),
}

_ANY = EXAMPLES[DECLARED[0]]  # make_weights / load_weights / example_input work on any ZooModel


def build(mix: list[tuple[str, str]], weights: dict[str, torch.Tensor] | None = None) -> ZooModel:
    model = ZooModel([EXAMPLES[name].make_layer(variant, torch.device("cpu")) for name, variant in mix])  # type: ignore[arg-type]
    _ANY.load_weights(model, weights if weights is not None else _ANY.make_weights(model, 0))
    _ANY.forward(model, _ANY.example_input(model))  # warm-up: allocates lazy scratch, as before a capture
    return model


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best we have
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def graphsafe_sizes(contract: GraphContract) -> dict[str, int]:
    """Sizes of every structure graphsafe keeps between reloads (all must stay constant)."""
    stores = [store for _, store in iter_declared_layers()]
    return {
        "declared layers": len(stores),
        "declared slots": sum(len(store.slots) for store in stores),
        "stable storages": sum(len(store.stable) for store in stores),
        "sealed layers": len(contract._layers),
        "sealed slots": sum(1 for _ in contract.slots()),
        "quarantine": len(contract._quarantine),
        "callbacks": len(contract._callbacks),
        "walker class plans": len(_plans.PLANS),
        "open transaction": int(contract._active is not None),
    }


@dataclass
class Window:
    rss: int
    objects: int
    sizes: dict[str, int]
    seconds: list[float] = field(default_factory=list)


def measure(contract: GraphContract, seconds: list[float]) -> Window:
    gc.collect()
    return Window(rss_bytes(), len(gc.get_objects()), graphsafe_sizes(contract), seconds)


def soak(
    mode: str,
    model: ZooModel,
    contract: GraphContract,
    weights: list[dict[str, torch.Tensor]],
    check: Callable[[int], None],
) -> tuple[list[Window], Counter[tuple[Status, frozenset[FindingKind]]]]:
    outcomes: Counter[tuple[Status, frozenset[FindingKind]]] = Counter()
    windows: list[Window] = []
    seconds: list[float] = []
    for i in range(RELOADS):
        start = time.process_time()  # CPU time: other processes on a busy machine do not inflate it
        with contract.reload():
            _ANY.load_weights(model, weights[i % 2])
        seconds.append(time.process_time() - start)
        outcome = contract.last_outcome
        assert outcome is not None
        outcomes[(outcome.status, frozenset(f.kind for f in outcome.findings))] += 1
        check(i)
        if (i + 1) % WINDOW == 0:
            windows.append(measure(contract, seconds))
            seconds = []
    return windows, outcomes


@pytest.mark.parametrize("mode", ["strict", "recapture", "migrate"])
def test_a_thousand_reloads_leak_nothing_and_stay_correct(mode: str) -> None:
    mix = MIXES[mode]
    model = build(mix)
    weights = [_ANY.make_weights(model, SEED_A), _ANY.make_weights(model, SEED_B)]
    x = _ANY.example_input(model)
    colds = [build(mix, w) for w in weights]
    with torch.no_grad():
        expected = [cold(x) for cold in colds]
    assert not torch.equal(expected[0], expected[1]), "A and B give one output: the soak would prove nothing"

    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    recaptures = Counter[Status]()  # counts only: keeping the outcomes would itself grow

    def recapture(outcome: ReloadOutcome) -> None:  # stands in for the engine's capture; the contract then reseals
        recaptures[outcome.status] += 1

    contract.on_recapture(recapture)
    sealed = {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots()}

    def check(i: int) -> None:
        with torch.no_grad():
            out = model(x)
        assert torch.equal(out, expected[i % 2]), f"reload {i} ({mode}) serves wrong values"
        if mode != "recapture" and i % WINDOW == 0:
            now = {(s.layer, s.path): s.fingerprint.data_ptr for s in contract.slots()}
            assert now == sealed  # the seal never had to move
            for (layer, path), ptr in sealed.items():
                assert SlotPath(path).resolve(model.get_submodule(layer)).data_ptr() == ptr, f"{layer}:{path} moved"

    windows, outcomes = soak(mode, model, contract, weights, check)

    assert outcomes == Counter({EXPECTED[mode]: RELOADS}), outcomes
    assert recaptures == (Counter({Status.NEEDS_RECAPTURE: RELOADS}) if mode == "recapture" else Counter())
    assert contract.serving_safe

    first, last = windows[1], windows[-1]
    assert all(w.sizes == first.sizes for w in windows[1:]), [w.sizes for w in windows]
    assert first.sizes["quarantine"] == 0 and first.sizes["open transaction"] == 0
    growth = [w.objects - first.objects for w in windows[1:]]
    assert max(growth) <= MAX_OBJECT_GROWTH, f"tracked objects grew by {growth} over the windows"
    assert last.rss - first.rss <= MAX_RSS_GROWTH, f"RSS grew by {(last.rss - first.rss) / 2**20:.1f} MiB"
    early, late = statistics.median(first.seconds), statistics.median(last.seconds)
    assert late <= MAX_SLOWDOWN * early, f"median reload time went from {early * 1e3:.2f} to {late * 1e3:.2f} ms"

    # The last reload loaded weights[(RELOADS - 1) % 2]: every derived tensor equals a cold build's.
    cold = colds[(RELOADS - 1) % 2]
    for (name, _), layer, cold_layer in zip(mix, model.layers, cold.layers, strict=True):
        derived, reference = EXAMPLES[name].derived(layer), EXAMPLES[name].derived(cold_layer)
        assert derived.keys() == reference.keys()
        for path, tensor in derived.items():
            if path not in EXAMPLES[name].lazy_paths:  # scratch contents are whatever the last forward left
                assert torch.equal(tensor, reference[path]), f"{name}:{path} differs from a cold build"
