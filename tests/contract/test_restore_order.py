"""Restore as one whole-model transaction: permutations of captured storages, overlaps, aliasing across layers.

PWAL's new tensors can be the captured storages themselves, permuted (a ping-pong swap, tensors exchanged between
layers, a rotation), or views into another slot's captured storage; one captured storage can be bound to several
paths in several layers (tied embedding/head, a shared workspace). Copies that run one after another would then
overwrite sources still needed, and an alias check confined to one layer would miss two layers disagreeing.

The oracle is independent of graphsafe: the same reload run on a fresh twin of the model with no contract (eager
semantics: what each path holds after the load). Every test asserts

* the model's paths hold exactly the eager values, whatever the status (graphsafe never writes into a tensor values
  other than the ones the reload produced for it), and
* if the status is COMMITTED, every captured tensor (the pre-reload objects, by address) holds exactly the value
  its path holds eagerly and is bound back at its path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import FindingKind, GraphContract, ReloadOutcome, SlotPath, Status, register_derived

pytestmark = pytest.mark.both_tiers  # these tests hold on both restore tiers

N = 4  # elements of every slot


class Slots(nn.Module):
    """A layer whose declared slots are plain tensor attributes (PWAL's derived tensors)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            setattr(self, name, tensor)
        for name in tensors:
            register_derived(self, name, static=True)


class Net(nn.Module):
    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


def values(seed: int, n: int = N) -> torch.Tensor:
    """Distinct values per seed (so a wrong source can never pass by accident)."""
    return torch.arange(n, dtype=torch.float32) + 100.0 * seed + 0.5


# A step of a reload: the layers it loads (indices into model.layers), and what it does to the model.
@dataclass(frozen=True)
class Step:
    layers: tuple[int, ...]
    run: Callable[[Net], None]


@dataclass(frozen=True)
class Scenario:
    build: Callable[[], Net]
    steps: tuple[Step, ...]
    describe: str = ""  # what a generated scenario does (hypothesis prints it)


def slot_paths(model: Net) -> list[tuple[str, str]]:
    found = []
    for index, layer in enumerate(model.layers):
        names = [*layer.__dict__.keys(), *layer._parameters.keys(), *layer._buffers.keys()]
        for name in names:
            if isinstance(getattr(layer, name, None), torch.Tensor):
                found.append((f"layers.{index}", name))
    return sorted(set(found))


def read(model: Net, key: tuple[str, str]) -> torch.Tensor:
    value = SlotPath(key[1]).resolve(model.get_submodule(key[0]))
    assert isinstance(value, torch.Tensor)
    return value


def eager(scenario: Scenario) -> dict[tuple[str, str], torch.Tensor]:
    """The oracle: the same reload on a fresh twin, no contract; the values each path then holds."""
    model = scenario.build()
    for step in scenario.steps:
        step.run(model)
    return {key: read(model, key).detach().clone() for key in slot_paths(model)}


def reload(scenario: Scenario, *, layerwise: bool, mode: str = "recapture") -> ReloadOutcome:
    model = scenario.build()
    contract = GraphContract(model, mode).seal()  # type: ignore[arg-type]
    captured = {key: read(model, key) for key in slot_paths(model)}  # the pre-reload objects: strong refs
    ptrs = {key: t.data_ptr() for key, t in captured.items()}
    expected = eager(scenario)
    with contract.reload(layerwise=layerwise) as txn:
        begun: set[int] = set()
        for step in scenario.steps:
            if layerwise:
                for index in step.layers:
                    if index not in begun:
                        begun.add(index)
                        txn.before_layer(model.layers[index])
            step.run(model)
            if layerwise:
                for index in step.layers:
                    txn.after_layer(model.layers[index])
    outcome = contract.last_outcome
    assert outcome is not None
    check(model, outcome, captured, ptrs, expected)
    return outcome


def check(
    model: Net,
    outcome: ReloadOutcome,
    captured: dict[tuple[str, str], torch.Tensor],
    ptrs: dict[tuple[str, str], int],
    expected: dict[tuple[str, str], torch.Tensor],
) -> None:
    for key, want in expected.items():
        got = read(model, key)
        assert torch.equal(got, want), f"{key}: the model reads {got.tolist()}, eagerly {want.tolist()} ({outcome})"
    if outcome.status is Status.COMMITTED:
        for key, tensor in captured.items():
            assert tensor.data_ptr() == ptrs[key]
            assert read(model, key).data_ptr() == ptrs[key], f"{key} not bound back to its captured storage"
            assert torch.equal(tensor, expected[key]), (
                f"COMMITTED, but the captured storage of {key} holds {tensor.tolist()}, "
                f"not {expected[key].tolist()}: the graph reads wrong memory"
            )


def kinds(outcome: ReloadOutcome | None) -> set[FindingKind]:
    assert outcome is not None
    return {f.kind for f in outcome.problems}


# -- scenarios ---------------------------------------------------------------------------------------------------
def ring(layers: int, per_layer: int = 1) -> Callable[[], Net]:
    """``layers`` layers of ``per_layer`` slots each, every slot its own storage."""

    def build() -> Net:
        return Net([Slots({f"s{j}": values(10 + i * per_layer + j) for j in range(per_layer)}) for i in range(layers)])

    return build


def rebind(moves: dict[tuple[int, str], tuple[int, str]]) -> Callable[[Net], None]:
    """Write new values into every slot in place (the load), then bind each target path to the tensor that was at
    the source path (all read before any is bound: a simultaneous permutation)."""

    def run(model: Net) -> None:
        layers = model.layers
        for index, layer in enumerate(layers):
            for j, name in enumerate(sorted(n for n in vars(layer) if n.startswith("s"))):
                getattr(layer, name).copy_(values(50 + 7 * index + j))
        taken = {dst: getattr(layers[src[0]], src[1]) for dst, src in moves.items()}
        for (index, name), tensor in taken.items():
            setattr(layers[index], name, tensor)

    return run


SWAP_IN_LAYER = Scenario(ring(1, 2), (Step((0,), rebind({(0, "s0"): (0, "s1"), (0, "s1"): (0, "s0")})),))
SWAP_ACROSS = Scenario(ring(2), (Step((0, 1), rebind({(0, "s0"): (1, "s0"), (1, "s0"): (0, "s0")})),))
ROTATE_3 = Scenario(
    ring(3), (Step((0, 1, 2), rebind({(0, "s0"): (1, "s0"), (1, "s0"): (2, "s0"), (2, "s0"): (0, "s0")})),)
)
ROTATE_IN_LAYER = Scenario(
    ring(1, 3), (Step((0,), rebind({(0, "s0"): (0, "s1"), (0, "s1"): (0, "s2"), (0, "s2"): (0, "s0")})),)
)


class Embedding(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def tied() -> Net:
    weight = nn.Parameter(values(1, 2 * N), requires_grad=False)
    return Net([Embedding(weight), Embedding(weight)])  # embed and head: one Parameter, two modules


def bind_param(index: int, seed: int) -> Step:
    def run(model: Net) -> None:
        model.layers[index].weight = nn.Parameter(values(seed, 2 * N), requires_grad=False)

    return Step((index,), run)


def bind_same_param(model: Net) -> None:
    weight = nn.Parameter(values(3, 2 * N), requires_grad=False)
    model.layers[0].weight = weight
    model.layers[1].weight = weight


TIED_DIFFERENT = Scenario(tied, (bind_param(0, 2), bind_param(1, 3)))
TIED_ONE_SIDE = Scenario(tied, (bind_param(0, 2),))
TIED_SAME = Scenario(tied, (Step((0, 1), bind_same_param),))


def shared_workspace() -> Net:
    ws = torch.zeros(N)
    return Net([Slots({"ws": ws}), Slots({"ws": ws})])


def new_workspace(index: int, seed: int) -> Step:
    def run(model: Net) -> None:
        model.layers[index].ws = values(seed)

    return Step((index,), run)


def one_new_workspace(model: Net) -> None:
    ws = values(4)
    model.layers[0].ws = ws
    model.layers[1].ws = ws


WORKSPACE_DIFFERENT = Scenario(shared_workspace, (new_workspace(0, 2), new_workspace(1, 3)))
WORKSPACE_SAME = Scenario(shared_workspace, (Step((0, 1), one_new_workspace),))


def offset_views() -> Net:
    """Each layer: ``big`` (2N elements) and ``s``, a view at offset 2 of a base no other path holds."""
    return Net([Slots({"big": values(30 + i, 2 * N), "s": values(20 + i, 2 * N)[2 : 2 + N]}) for i in range(2)])


def view_into_other(model: Net) -> None:
    # layers.1.s becomes a view into layers.0's captured ``big`` (same offset, shape, stride: a copy is possible),
    # and layers.0.big gets a new tensor, so restoring layers.0 first writes into layers.1's source.
    layers = model.layers
    layers[0].big.copy_(values(60, 2 * N))
    layers[1].s = layers[0].big[2 : 2 + N]
    layers[0].big = values(61, 2 * N)


VIEW_INTO_OTHER = Scenario(offset_views, (Step((0, 1), view_into_other),))


def overlapping_in_layer() -> Net:
    buf = values(5, 2 * N)
    return Net([Slots({"a": buf[0:N], "b": buf[2 : 2 + N]})])  # two slots, overlapping bytes of one storage


def shift_views(model: Net) -> None:
    layer = model.layers[0]
    fresh = values(62, 2 * N)
    layer.a = fresh[0:N]
    layer.b = values(63, 2 * N)[2 : 2 + N]  # another base: ``b`` no longer overlaps ``a`` the same way


OVERLAP_BROKEN = Scenario(overlapping_in_layer, (Step((0,), shift_views),))


# Scenarios whose eager result fits the captured storages: these must commit (not only fail closed).
MUST_COMMIT = {
    "swap-in-layer": SWAP_IN_LAYER,
    "swap-across-layers": SWAP_ACROSS,
    "rotate-3-across-layers": ROTATE_3,
    "rotate-3-in-layer": ROTATE_IN_LAYER,
    "tied-same-values": TIED_SAME,
    "workspace-same-values": WORKSPACE_SAME,
    "view-into-other-layer": VIEW_INTO_OTHER,
}
# Scenarios no captured storage can serve (two paths sharing memory now disagree): must not commit.
MUST_NOT_COMMIT = {
    "tied-different-values": TIED_DIFFERENT,
    "tied-one-side-rebound": TIED_ONE_SIDE,
    "workspace-different-values": WORKSPACE_DIFFERENT,
    "overlapping-views-split": OVERLAP_BROKEN,
}


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-model", "layerwise"])
@pytest.mark.parametrize("name", sorted(MUST_COMMIT))
def test_permutations_and_views_commit_with_the_eager_values(name: str, layerwise: bool) -> None:
    outcome = reload(MUST_COMMIT[name], layerwise=layerwise)
    assert outcome.status is Status.COMMITTED, outcome  # nothing about these reloads needs a recapture


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-model", "layerwise"])
@pytest.mark.parametrize("name", sorted(MUST_NOT_COMMIT))
def test_aliases_that_disagree_across_layers_never_commit(name: str, layerwise: bool) -> None:
    outcome = reload(MUST_NOT_COMMIT[name], layerwise=layerwise)
    assert kinds(outcome) == {FindingKind.ALIAS_BROKEN}, outcome
    assert outcome.status is Status.NEEDS_RECAPTURE


def test_strict_mode_raises_on_tied_weights_bound_apart() -> None:
    from graphsafe import DeclaredDriftError

    model = tied()
    contract = GraphContract(model, "strict").seal()
    with pytest.raises(DeclaredDriftError, match="alias"), contract.reload():
        for step in TIED_DIFFERENT.steps:
            step.run(model)


# -- random permutations with repeats and ties -------------------------------------------------------------------
def permuted(
    keys: list[tuple[int, str]],
    tie_of: dict[tuple[int, str], tuple[int, str]],
    plan: dict[tuple[int, str], Any],
    write: dict[tuple[int, str], bool],
) -> Scenario:
    """Slots ``keys`` tied at seal as ``tie_of`` says; the reload first writes new values in place where ``write``
    says, then gives each slot its own tensor (``"keep"``), another slot's (a key) or a fresh one (``"fresh"``)."""
    layers = 1 + max(index for index, _ in keys)

    def build() -> Net:
        tensors = {key: values(10 + k) for k, key in enumerate(keys)}
        per: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]
        for key in keys:
            per[key[0]][key[1]] = tensors[tie_of[key]]
        return Net([Slots(d) for d in per])

    def run(model: Net) -> None:
        for k, key in enumerate(keys):
            if write[key]:
                getattr(model.layers[key[0]], key[1]).copy_(values(40 + k))
        taken = {key: getattr(model.layers[src[0]], src[1]) for key, src in plan.items() if isinstance(src, tuple)}
        for k, (key, src) in enumerate(plan.items()):
            if src == "fresh":
                setattr(model.layers[key[0]], key[1], values(70 + k))
            elif isinstance(src, tuple):
                setattr(model.layers[key[0]], key[1], taken[key])

    describe = f"ties={tie_of} plan={plan} write={write}"
    return Scenario(build, (Step(tuple(range(layers)), run),), describe)


@st.composite
def permutations(draw: st.DrawFn) -> tuple[Scenario, bool]:
    layers = draw(st.integers(1, 3))
    per_layer = draw(st.integers(1, 3))
    keys = [(i, f"s{j}") for i in range(layers) for j in range(per_layer)]
    # Ties: at seal, several slots (in any layers) may hold one tensor.
    ties = [draw(st.integers(0, k)) for k in range(len(keys))]
    tie_of = {}
    for k, key in enumerate(keys):
        tie_of[key] = tie_of[keys[ties[k]]] if ties[k] < k else key
    # The reload: each slot keeps its tensor, takes another slot's (repeats allowed), or gets a fresh one.
    choice = st.one_of(st.just("keep"), st.just("fresh"), st.sampled_from(keys))
    plan = {key: draw(choice) for key in keys}
    write = {key: draw(st.booleans()) for key in keys}  # the load writes new values in place first
    layerwise = draw(st.booleans())
    return permuted(keys, tie_of, plan, write), layerwise


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(permutations())
def test_random_permutations_never_commit_wrong_memory(case: tuple[Scenario, bool]) -> None:
    scenario, layerwise = case
    reload(scenario, layerwise=layerwise)


def test_a_slot_written_in_place_then_given_a_tensor_an_earlier_layer_restores_over_keeps_its_values() -> None:
    """Layerwise: layer 1's ``s0`` is written in place (a caller holds it), then takes layer 0's old ``s1`` tensor,
    which layer 0's restore fills with ``s1``'s fresh values. Its copy reads the values saved before that; refusing the
    copy for the in-place write would leave it on ``s1``'s values."""
    keys = [(layer, f"s{j}") for layer in range(3) for j in range(2)]
    tie_of = {key: key for key in keys} | {(2, "s0"): (1, "s1"), (2, "s1"): (1, "s1")}
    plan: dict[tuple[int, str], Any] = {key: "keep" for key in keys} | {(0, "s1"): "fresh", (1, "s0"): (0, "s1")}
    write = {key: key == (1, "s0") for key in keys}
    reload(permuted(keys, tie_of, plan, write), layerwise=True)


def test_a_tie_written_in_place_whose_partner_takes_a_later_layers_tensor_keeps_its_values() -> None:
    """Layerwise: layers 0 and 1 share one tensor, written in place through layer 1 (a caller holds it); layer 0 gets a
    fresh tensor, layer 1 takes layer 2's, which layer 2's restore then fills with its fresh values. Refusing the copy
    into the shared memory would leave layer 1 on layer 2's values."""
    keys = [(layer, "s0") for layer in range(3)]
    tie_of = {(0, "s0"): (0, "s0"), (1, "s0"): (0, "s0"), (2, "s0"): (2, "s0")}
    plan: dict[tuple[int, str], Any] = {(0, "s0"): "fresh", (1, "s0"): (2, "s0"), (2, "s0"): "fresh"}
    write = {key: key == (1, "s0") for key in keys}
    reload(permuted(keys, tie_of, plan, write), layerwise=True)
