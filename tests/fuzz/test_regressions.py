"""Minimal scenarios of the differential fuzzer (``tests/fuzz``) on which a reload could lie, one named test each.

Each scenario is as small as the failure needs; the docstring says what the reload does and why a COMMITTED (or
crashing) outcome would be a lie. Every test runs the scenario through the same harness and independent
oracle as the fuzzer (:func:`fuzz.harness.run`) and asserts the verdict is ``ok``: no silent success (committed
while a replay reads wrong memory, or graphsafe writing values the reload did not produce) and no crash. The
failure message names the verdict, its reason and the scenario. A scenario reads
``d0=t*1@attr [graph_visible]:neg``: slot ``d0`` holds ``weight.t()`` (times 1) at attribute ``d0``, declared with
``@graph_visible``, and the reload's PWAL applies the ``neg`` mutation (see ``tests/fuzz/models.py``).
"""

from __future__ import annotations

import pytest

from fuzz import oracle
from fuzz.harness import run
from fuzz.models import LayerSpec, Scenario, SlotSpec


def _assert_honest(scenario: Scenario) -> None:
    result = run(scenario)
    assert result.verdict in (oracle.OK, oracle.FALSE_ALARM), (
        f"{result.verdict}: {result.reason} {result.detail}\n{scenario.describe()}"
    )


def _one_layer(*slots: SlotSpec, mode: str = "strict", detect: str = "every-reload", **layer: object) -> Scenario:
    return Scenario(
        layers=(LayerSpec(rows=2, cols=3, slots=slots, **layer),),  # type: ignore[arg-type]
        mode=mode,
        detect=detect,
        manifest=detect == "declared-only",
    )


MODES = ("strict", "recapture", "migrate")


# ----------------------------------------------------------------------------------------------------
# Restore order: captured tensors permuted among slots


@pytest.mark.parametrize("mode", MODES)
def test_rotated_captured_tensors_are_not_committed_with_crossed_values(mode: str) -> None:
    """PWAL rotates the captured tensor objects of three declared slots of one geometry (d0 gets d1's tensor, d1
    gets d2's, d2 gets d0's), then writes each slot's new values in place. The model's values are right. Restore
    copies slot by slot: d0's captured storage <- the tensor now at d0 (d1's captured storage), ...; the last copy
    reads d0's captured storage, already overwritten by the first, so d2's captured storage gets d0's values and the
    reload commits. A graph replaying d2 reads d0's values (the ``rotate`` class, in one layer)."""
    slots = (
        SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
        SlotSpec("d1", source="t", factor=2, declare="graph_visible"),
        SlotSpec("d2", source="t", factor=3, declare="graph_visible"),
    )
    _assert_honest(_one_layer(*slots, mode=mode, cycle=(0, 1, 2)))


@pytest.mark.parametrize("mode", MODES)
def test_swapped_captured_tensors_keep_the_values_pwal_wrote(mode: str) -> None:
    """PWAL swaps the captured tensor objects of a declared slot d0 and an undeclared d1 of one geometry, then
    writes each one's new values in place (the model is right). Under ``declared-only`` (with the capture-time
    manifest) restore copies d0's new values into d0's captured storage, which PWAL had handed to d1: d1's values,
    which PWAL got right, are overwritten with d0's. graphsafe wrote into a tensor values the reload did not produce
    for it (found as ``swap``)."""
    slots = (
        SlotSpec("d0", source="t", factor=1, declare="graph_visible"),
        SlotSpec("d1", source="t", factor=2),
    )
    _assert_honest(_one_layer(*slots, mode=mode, detect="declared-only", cycle=(0, 1)))


# ----------------------------------------------------------------------------------------------------
# Fingerprint: conj and neg bits


@pytest.mark.parametrize("mode", MODES)
def test_a_negative_view_of_the_captured_storage_is_not_committed(mode: str) -> None:
    """PWAL writes ``-new`` into the captured storage of d0 and binds ``torch._neg_view`` of it: torch computes
    with the right values, but the memory a captured kernel reads holds their negation. Same storage, pointer,
    shape, stride and dtype as sealed, so the reload commits (found as ``neg``)."""
    _assert_honest(_one_layer(SlotSpec("d0", source="t", declare="graph_visible", mutation="neg"), mode=mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_conjugate_view_of_the_captured_storage_is_not_committed(mode: str) -> None:
    """As the negative view, with a complex slot: ``conj(new)`` written into the captured storage, bound as its
    ``.conj()`` view. The memory holds the conjugate; the reload commits (found as ``conj``)."""
    _assert_honest(_one_layer(SlotSpec("d0", source="complex", declare="graph_visible", mutation="conj"), mode=mode))


# ----------------------------------------------------------------------------------------------------
# Coverage: storage the graph reads beyond the declared view


@pytest.mark.parametrize("mode", MODES)
def test_an_undeclared_base_of_a_declared_view_is_not_committed_stale(mode: str) -> None:
    """d0 (``weight.t()``, undeclared) and d1 (``d0.view(-1)[1:]``, declared) share a storage; PWAL rebuilds both.
    Under ``declared-only`` with the capture-time manifest, restore copies d1's new values into the captured
    storage from offset 1; element 0 (read by the graph through d0) keeps the old value. The manifest sees the
    storage still held by a tracked path and the reload commits (found as ``tail``)."""
    slots = (SlotSpec("d0", source="t"), SlotSpec("d1", kind="tail", of=0, declare="graph_visible"))
    _assert_honest(_one_layer(*slots, mode=mode, detect="declared-only"))


# ----------------------------------------------------------------------------------------------------
# Freshness of undeclared tensors (docs/fault-matrix.md, "stale value": undeclared tensors are watched)


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
def test_an_undeclared_tensor_pwal_skips_is_not_committed_stale(detect: str) -> None:
    """PWAL's "already processed" guard skips rebuilding the undeclared d0 although the weight changed. The slot is
    at its captured storage with the old values: the reload committed and a replay read stale values, because
    freshness was checked for declared slots only; under ``declared-only`` the manifest's paths were not checked
    at all (found as ``skip``)."""
    _assert_honest(_one_layer(SlotSpec("d0", source="t", mutation="skip"), detect=detect))


# ----------------------------------------------------------------------------------------------------
# A slot left in place on memory a moved partner shares


@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
@pytest.mark.parametrize("kind", ["alias", "tail"])
def test_a_skipped_view_of_a_rebuilt_tensor_is_not_recaptured_stale(kind: str, detect: str) -> None:
    """Undeclared d1 views undeclared d0's storage (``alias``: the same view, ``tail``: from offset 1). PWAL
    rebuilds d0 and skips d1. The reload said NEEDS_RECAPTURE, and the recapture read d1's old values where a cold
    model reads a view of the new d0 (found as ``skip`` of an alias/tail slot). Every-reload: the restore wrote d1's
    old bytes back over d0's copy (d1 "kept its values"). Declared-only: d1 was not checked at all."""
    slots = (SlotSpec("d0", source="t"), SlotSpec("d1", kind=kind, of=0, mutation="skip"))
    _assert_honest(_one_layer(*slots, mode="recapture", detect=detect))


@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_view_of_the_weight_follows_the_weight(mode: str) -> None:
    """Under ``declared-only`` d0 (``weight.t()``, undeclared) reads the weight's storage; the loader replaces the
    weight and PWAL leaves d0. The restore copies the new weight into the captured weight, and d0, a view of it,
    must read the new values there: it was taken for a tensor with values of its own and written back (found as
    ``skip`` of a ``weight_view`` slot)."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=2, cols=3, slots=(SlotSpec("d0", kind="weight_view", mutation="skip"),), loader="rebind"),
        ),
        mode=mode,
        detect="declared-only",
        manifest=True,
    )
    _assert_honest(scenario)


@pytest.mark.parametrize("detect", ["sealed-paths", "declared-only"])
@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_skipped_view_whose_base_was_rotated_away_is_stale(mode: str, detect: str) -> None:
    """d0 and d1 swap their tensor objects and each writes its own values in place; d2 (``tail(d1)``, in a child
    module) is skipped. d2's memory is now d0's new tensor, written with d0's values: d2's version counter moved and
    its values changed, so it looked refreshed. d0 and d1 changed class (one is a subclass), so nothing is copied;
    the reload said NEEDS_RECAPTURE and the recapture read d0's values through d2. Under ``declared-only`` d2 was
    not watched at all: the child module has no sealed slot of its own (found as ``swap`` with a ``tail:skip``)."""
    slots = (
        SlotSpec("d0", source="scale", factor=2, holder="closure", mutation="neg"),
        SlotSpec("d1", source="scale", subclass=True, holder="dict", mutation="neg"),
        SlotSpec("d2", kind="tail", of=1, holder="child", mutation="skip"),
    )
    scenario = Scenario(
        layers=(LayerSpec(rows=3, cols=1, slots=slots, loader="keep", cycle=(1, 0)),),
        mode=mode,
        detect=detect,
        manifest=detect == "declared-only",
    )
    _assert_honest(scenario)


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_an_alias_path_of_a_respecified_slot_is_stale(mode: str, detect: str) -> None:
    """d1 (undeclared) is the same view as the declared d0; PWAL rebuilds d0 with another dtype (no copy can
    restore it) and skips d1. An alias path follows its slot, but nothing reaches it here: the reload said
    NEEDS_RECAPTURE and the recapture read d1's old values (found as ``respec_dtype`` with ``alias:skip``)."""
    slots = (
        SlotSpec("d0", declare="graph_visible", mutation="respec_dtype"),
        SlotSpec("d1", kind="alias", of=0, mutation="skip"),
    )
    scenario = Scenario(
        layers=(LayerSpec(rows=1, cols=1, slots=slots),), mode=mode, detect=detect, manifest=detect == "declared-only"
    )
    _assert_honest(scenario)


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_skipped_slot_written_through_a_rotated_partner_is_stale(mode: str) -> None:
    """d3 is declared as the same view as d0 (a subclass); d0, d1 and d2 rotate their tensor objects, each writing
    its own values in place, and d3 is skipped. d1 now holds d3's captured object and wrote d1's values into it:
    d3's version counter moved and its values changed, so it passed for refreshed; d1 changed class, so it is
    respecified and nothing is copied (found as ``rotate`` with ``alias:skip``)."""
    slots = (
        SlotSpec("d0", subclass=True, declare="graph_visible"),
        SlotSpec("d1", factor=2, declare="graph_visible"),
        SlotSpec("d2", declare="graph_visible"),
        SlotSpec("d3", kind="alias", of=0, declare="graph_visible", mutation="skip"),
    )
    _assert_honest(Scenario(layers=(LayerSpec(rows=1, cols=1, slots=slots, cycle=(0, 2, 1)),), mode=mode))


@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
@pytest.mark.parametrize("rotation", [(0, 1), (0, 1, 2)])
def test_an_alias_path_of_a_rotated_away_slot_is_stale(rotation: tuple[int, ...], detect: str) -> None:
    """The undeclared d_alias is the same view as d0; the declared slots rotate their tensor objects (one of them a
    subclass, so nothing can be copied back) and each writes its own values in place. d_alias still reads d0's
    captured memory, which now holds another slot's values: the alias path follows d0, whose new values went
    elsewhere (found as ``swap``/``rotate`` with ``alias:skip``)."""
    declared = (
        SlotSpec("d0", declare="graph_visible"),
        SlotSpec("d1", factor=2, subclass=True, declare="graph_visible"),
        SlotSpec("d2", factor=3, declare="graph_visible"),
    )[: len(rotation)]
    slots = (*declared, SlotSpec(f"d{len(rotation)}", kind="alias", of=0, mutation="skip"))
    scenario = Scenario(
        layers=(LayerSpec(rows=1, cols=1, slots=slots, cycle=rotation),),
        mode="recapture",
        detect=detect,
        manifest=detect == "declared-only",
    )
    _assert_honest(scenario)


# ----------------------------------------------------------------------------------------------------
# declared-only with a manifest: paths the contract does not track


@pytest.mark.parametrize("mode", MODES)
def test_an_untracked_path_in_a_swap_keeps_the_values_pwal_gave_it(mode: str) -> None:
    """Under ``declared-only`` d0 is declared and d1 is not; PWAL swaps their tensors (each then gets its own new
    values in place). d1 now holds d0's captured storage with d1's values, and the restore of d0 copied d0's new
    values over them: graphsafe wrote into d1 values the reload did not produce for it (found as ``swap``: "a
    value PWAL got right was overwritten")."""
    slots = (
        SlotSpec("d0", source="t", declare="graph_visible"),
        SlotSpec("d1", source="t", factor=2),
    )
    _assert_honest(_one_layer(*slots, mode=mode, detect="declared-only", cycle=(0, 1)))


def test_a_conjugate_view_at_an_untracked_path_is_not_committed() -> None:
    """Under ``declared-only`` the undeclared d0 is rewritten in place as the conjugate of its new values and bound
    as a conjugate view of its captured storage: the path reads the right values, the graph reads the raw bytes
    (found as ``conj`` of a manifest-only path)."""
    slot = SlotSpec("d0", source="complex", factor=3, subclass=True, holder="closure", mutation="conj")
    _assert_honest(_one_layer(slot, mode="migrate", detect="declared-only"))


def test_a_new_view_of_its_own_memory_is_not_a_foreign_write() -> None:
    """The undeclared d0 (in a child module) is rewritten in place with the same weights and bound as a new view
    object of its captured memory: nothing is wrong, and nothing may be flagged (a false alarm seen by the fuzzer:
    the path's own new view was taken for another path's tensor)."""
    slot = SlotSpec("d0", factor=2, holder="child", mutation="view_old")
    result = run(_one_layer(slot, detect="declared-only", loader="keep"))
    assert result.verdict == oracle.OK, f"{result.verdict}: {result.reason}"


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths", "declared-only"])
def test_a_skipped_tensor_of_a_child_without_weights_is_stale(detect: str) -> None:
    """d0 lives in a child module that has no weights of its own; PWAL skips it although the parent's weight
    changed. Its layer's fallback inputs were its own module's tensors (itself included), so nothing it was
    computed from seemed to change and the reload committed stale values (found as ``skip`` at ``@child``)."""
    slot = SlotSpec("d0", source="complex", factor=3, holder="child", mutation="skip")
    _assert_honest(_one_layer(slot, detect=detect))


@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
def test_a_declared_view_written_through_a_negative_view_of_its_base_is_stale(detect: str) -> None:
    """The undeclared d0 is rewritten in place negated and bound as a negative view of its captured storage; the
    declared d1 (``tail(d0)``) is skipped. d1's memory changed, so it passed for refreshed, but it holds the raw
    negated bytes a recapture would read (found as ``neg`` with ``tail:skip``)."""
    slots = (
        SlotSpec("d0", source="scale", factor=2, subclass=True, holder="closure", mutation="neg"),
        SlotSpec("d1", kind="tail", of=0, holder="dict", declare="graph_visible", mutation="skip"),
    )
    _assert_honest(_one_layer(*slots, mode="recapture", detect=detect, loader="rebind"))


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_skipped_tie_in_a_layer_whose_own_weights_did_not_change_is_stale(mode: str) -> None:
    """layers.1's d0 is tied to layers.0's d0; layers.0 reloads new weights and rebuilds its side, layers.1 keeps
    its weights and PWAL skips the tie. The tie's own layer's inputs did not change, so it kept its old bytes and
    the partner broke away: NEEDS_RECAPTURE, and the recapture read the old values (found as ``tie:skip``)."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=3, cols=2, slots=(SlotSpec("d0", source="sum", factor=2, declare="graph_visible"),)),
            LayerSpec(
                rows=4,
                cols=1,
                loader="keep",
                slots=(SlotSpec("d0", kind="tie", of=0, holder="nested", declare="graph_visible", mutation="skip"),),
            ),
        ),
        mode=mode,
        detect="sealed-paths",
        manifest=True,
    )
    _assert_honest(scenario)


def test_a_respecified_stride_is_sampled_not_a_crash() -> None:
    """The undeclared d0 is rebuilt with a stride of 2 (``respec_stride``); its value sample for the freshness
    check was a strided view that cannot be viewed as bytes, and the reload escaped as a raw RuntimeError (found as
    ``respec_stride`` once undeclared tensors were watched)."""
    slots = (
        SlotSpec("d0", source="sum", factor=3, holder="closure", mutation="respec_stride"),
        SlotSpec("d1", kind="weight_view", declare="graph_visible", mutation="skip"),
        SlotSpec("d2", source="scale", subclass=True, holder="child", mutation="respec_stride"),
        SlotSpec("d3", kind="weight_view", holder="list", mutation="skip"),
    )
    scenario = Scenario(layers=(LayerSpec(rows=1, cols=2, slots=slots, loader="rebind"),), mode="migrate")
    result = run(scenario)
    assert result.verdict != oracle.CRASH, f"{result.reason} {result.detail}"
    _assert_honest(scenario)


@pytest.mark.parametrize("detect", ["every-reload", "sealed-paths"])
def test_a_skipped_tensor_and_its_alias_in_a_child_without_weights_are_stale(detect: str) -> None:
    """d0 and its alias d1 (one tensor) live in a child module without weights; PWAL skips both although the
    parent's buffer weight changed. Each was the other's fallback input, unchanged, so the reload committed stale
    values (found as ``skip`` with ``alias:skip`` at ``@child``)."""
    slots = (
        SlotSpec("d0", source="int8", factor=3, subclass=True, holder="child", mutation="skip"),
        SlotSpec("d1", kind="alias", of=0, holder="child", mutation="skip"),
    )
    _assert_honest(_one_layer(*slots, detect=detect, loader="rebind", buffer=True))


# ----------------------------------------------------------------------------------------------------
# Minimal scenarios of the fuzzer's long profile


@pytest.mark.parametrize("mutation", ["neg", "conj"])
def test_an_alias_path_of_a_slot_now_read_another_way_is_stale(mutation: str) -> None:
    """d0 is rewritten in place negated (or conjugated) and bound as a negative (conjugate) view of its captured
    memory; its undeclared alias d1 is skipped. The memory was not abandoned by address, so d1 was not doubted,
    and the recapture read the raw bytes through d1."""
    source = "complex" if mutation == "conj" else "t"
    slots = (
        SlotSpec("d0", source=source, declare="graph_visible", mutation=mutation),
        SlotSpec("d1", kind="alias", of=0, mutation="skip"),
    )
    _assert_honest(_one_layer(*slots, mode="migrate", loader="rebind"))


@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
def test_an_undeclared_tie_skipped_while_its_partner_moved_is_stale(detect: str) -> None:
    """layers.1's undeclared d0 is tied to layers.0's undeclared d0; layers.0 rebinds its side, layers.1 (its own
    weights kept) skips. No copy restored layers.0's side (recapture mode), and the tie stayed on the old values."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=2, cols=1, slots=(SlotSpec("d0", source="sum", factor=3),)),
            LayerSpec(rows=1, cols=2, loader="keep", slots=(SlotSpec("d0", kind="tie", of=0, mutation="skip"),)),
        ),
        mode="recapture",
        detect=detect,
        manifest=detect == "declared-only",
    )
    _assert_honest(scenario)


def test_an_untracked_path_sharing_a_freed_declared_tail_is_watched() -> None:
    """Under ``declared-only`` the undeclared d0 shares memory with the declared d1 (``tail(d0)``, empty here);
    PWAL frees d1 and skips d0. d0 counted as an alias path of d1, and alias paths were not watched for
    freshness: the recapture read d0's old values."""
    slots = (
        SlotSpec("d0", source="sum", factor=3, mutation="skip"),
        SlotSpec("d1", kind="tail", of=0, declare="register_derived", mutation="free"),
    )
    scenario = Scenario(
        layers=(LayerSpec(rows=1, cols=2, slots=slots, loader="data_copy"),),
        mode="recapture",
        detect="declared-only",
        manifest=True,
    )
    _assert_honest(scenario)


def test_an_alias_path_written_through_a_rotated_partner_is_stale() -> None:
    """Under ``declared-only`` d0 and d1 (undeclared) swap their tensor objects and each writes its values in
    place; d3 (an undeclared alias of d1) is skipped and now holds d0's values. Foreign writes were checked for
    watched slots only, not alias paths."""
    slots = (
        SlotSpec("d0", source="sum"),
        SlotSpec("d1", source="sum", factor=2),
        SlotSpec("d2", kind="tail", of=1, declare="register_derived"),
        SlotSpec("d3", kind="alias", of=1, mutation="skip"),
    )
    scenario = Scenario(
        layers=(LayerSpec(rows=2, cols=2, slots=slots, loader="keep", cycle=(0, 1)),),
        mode="migrate",
        detect="declared-only",
        manifest=True,
    )
    _assert_honest(scenario)


def test_a_skipped_view_of_a_replaced_weight_follows_it_or_is_stale() -> None:
    """d0 (declared, ``weight.t()``) is skipped while the loader replaces the weight. Its fallback inputs dropped
    every path to its own memory, the weight included, so nothing it reads seemed to change: it kept its old
    bytes over the weight's copy and the recapture read them (found as ``weight_view:skip`` with ``load:rebind``)."""
    slots = (
        SlotSpec("d0", kind="weight_view", declare="graph_visible", mutation="skip"),
        SlotSpec("d1", source="strides", declare="register_derived", mutation="skip"),
        SlotSpec("d2", kind="alias", of=1),
    )
    scenario = Scenario(layers=(LayerSpec(rows=4, cols=4, slots=slots, loader="rebind"),), mode="recapture")
    _assert_honest(scenario)


def test_a_tie_left_on_memory_its_partner_abandoned_is_judged_by_what_pwal_wrote() -> None:
    """Three layers share one undeclared tensor: layers.0 rebinds it (moved, not restored in recapture mode),
    layers.1 (declared) rebinds to layers.0's new tensor, layers.2 skips. The copy of layers.1's new values into
    the shared memory moved its version counter, so layers.2 passed for written by PWAL and kept old values."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=4, cols=2, loader="stash", slots=(SlotSpec("d0", source="complex", factor=3),)),
            LayerSpec(rows=2, cols=1, loader="keep", slots=(SlotSpec("d0", kind="tie", declare="graph_visible"),)),
            LayerSpec(rows=3, cols=4, loader="keep", slots=(SlotSpec("d0", kind="tie", mutation="skip"),)),
        ),
        mode="recapture",
        detect="sealed-paths",
    )
    _assert_honest(scenario)


def test_an_alias_path_of_a_freed_empty_tail_is_stale() -> None:
    """d1 (declared) is an empty tail of the undeclared d0, which the walker therefore seals as d1's alias path;
    PWAL frees d1 and skips d0. The empty tail's memory has no bytes (its data_ptr() is 0), so no alias path
    seemed to read it, and the recapture read d0's old values (found as ``tail:free`` with ``skip``)."""
    slots = (
        SlotSpec("d0", source="sum", mutation="skip"),
        SlotSpec("d1", kind="tail", of=0, declare="register_derived", mutation="free"),
    )
    layer = LayerSpec(rows=1, cols=3, slots=slots, loader="rebind")
    _assert_honest(Scenario(layers=(layer,), mode="migrate", detect="sealed-paths"))


def test_an_alias_path_of_a_slot_whose_object_moved_is_stale() -> None:
    """The declared d0 is given new memory under the same Python object (``d0.data = new``); its undeclared tail d1
    is skipped. The captured object no longer reads the captured memory, but it was compared with itself, so the
    memory did not count as abandoned and the recapture read d1's old values (found as ``set_data``)."""
    slots = (
        SlotSpec("d0", source="complex", factor=2, declare="graph_visible", mutation="set_data"),
        SlotSpec("d1", kind="tail", of=0, mutation="skip"),
    )
    layer = LayerSpec(rows=1, cols=2, slots=slots, loader="data_copy")
    _assert_honest(Scenario(layers=(layer,), mode="recapture"))


def test_two_skipped_tensors_of_a_weightless_child_are_stale() -> None:
    """Two undeclared tensors live in a child module with no weights; PWAL skips both while the parent's weight
    changes. Each was the other's fallback input (a plain tensor of its module), unchanged, so neither looked stale
    and the reload committed (found as ``skip`` at ``@child``, twice)."""
    slots = (
        SlotSpec("d0", source="sum", holder="child", mutation="skip"),
        SlotSpec("d1", source="sum", holder="child", mutation="skip"),
    )
    layer = LayerSpec(rows=4, cols=3, slots=slots)
    _assert_honest(Scenario(layers=(layer,), mode="recapture", detect="sealed-paths"))


def test_a_tie_to_an_untracked_tensor_pwal_freed_is_stale() -> None:
    """Under ``declared-only`` layers.0's undeclared d0 is freed by PWAL (its path holds nothing) and layers.1's
    undeclared tie to it is skipped. A watch-only path that held no tensor any more did not count as having left
    its memory, so the tie was not doubted: the manifest said orphaned (NEEDS_RECAPTURE) and the recapture read the
    tie's old values (found as ``free`` with ``tie:skip``)."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=4, cols=3, loader="stash", slots=(SlotSpec("d0", source="fp8", factor=3, mutation="free"),)),
            LayerSpec(rows=1, cols=1, loader="keep", slots=(SlotSpec("d0", kind="tie", mutation="skip"),)),
        ),
        mode="migrate",
        detect="declared-only",
        manifest=True,
    )
    _assert_honest(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_tensor_whose_only_declared_view_is_empty_is_stale(mode: str) -> None:
    """Undeclared d0 (``scale``: one element for a one-row weight) and declared d1, its empty tail (``d0[1:]``);
    the weight is loaded through ``.data`` and PWAL skips both. The empty view was the only watched witness of
    d0's staleness: a rule that takes empty slots for never stale (to spare a "false alarm") makes the reload
    commit with d0 stale (the ``skip`` class)."""
    slots = (
        SlotSpec("d0", source="scale", holder="list", mutation="skip"),
        SlotSpec("d1", kind="tail", of=0, holder="child", declare="graph_visible", mutation="skip"),
    )
    layer = LayerSpec(rows=1, cols=4, slots=slots, loader="data_copy", buffer=True)
    _assert_honest(Scenario(layers=(layer,), mode=mode, detect="every-reload", manifest=False))


@pytest.mark.parametrize("detect", ["every-reload", "declared-only"])
def test_shared_memory_compared_bit_for_bit_takes_any_stride(detect: str) -> None:
    """A one-element derived slot PWAL rebuilds with another stride (``respec_stride``) next to a stashed buffer
    weight: the bit-for-bit comparison of shared memory must not view a stride-2 one-element tensor as bytes and
    raise out of the restore (a crash)."""
    slot = SlotSpec(
        "d0", source="scale", factor=3, holder="child", declare="register_derived", mutation="respec_stride"
    )
    layer = LayerSpec(rows=1, cols=3, slots=(slot,), loader="stash", buffer=True)
    _assert_honest(Scenario(layers=(layer,), mode="migrate", detect=detect, manifest=detect == "declared-only"))


def test_an_alias_pwal_leaves_on_a_respecified_slots_memory_is_not_taken_for_recapture_fixable() -> None:
    """PWAL gives ``d0`` another shape (a recapture's business), leaves ``d1``, an undeclared alias of ``d0``'s memory,
    where it was, and rebuilds the declared tail ``d2`` of ``d0``. ``d1`` then reads memory no reload wrote while the
    weights changed: a recapture through ``d1`` reads old values, so the reload must fail, not wait for a recapture."""
    scenario = Scenario(
        layers=(
            LayerSpec(
                rows=1,
                cols=2,
                slots=(
                    SlotSpec("d0", source="t", factor=1, mutation="respec_shape"),
                    SlotSpec("d1", kind="alias", of=0, mutation="skip"),
                    SlotSpec("d2", kind="tail", of=0, declare="graph_visible", mutation="rebind"),
                ),
            ),
        ),
        mode="recapture",
        detect="every-reload",
        manifest=False,
    )
    _assert_honest(scenario)


def test_an_alias_path_that_leaves_memory_its_slot_s_copy_rewrote_abandons_nothing() -> None:
    """The other side of the rule above: an alias path PWAL points at its slot's new tensor read another way (a
    respecified view) leaves memory the slot's copy rewrites whole. Another alias path that follows the slot reads
    the new values there: a recapture is all it takes, nothing is stale."""
    import torch
    from torch import nn

    from graphsafe import FindingKind, GraphContract, Status, register_derived

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.arange(6.0).view(2, 3), requires_grad=False)
            self.reloads = 0

        def process_weights_after_loading(self) -> None:
            self.w_t = self.weight.t().contiguous()
            register_derived(self, "w_t")
            self.follows = self.w_t  # an alias path that follows its slot
            self.flat = self.w_t.view(-1) if not self.reloads else self.w_t.view(2, 3)  # read another way later

    layer = Layer()
    layer.process_weights_after_loading()
    contract = GraphContract(layer, "recapture", detect="every-reload").seal()
    contract.on_recapture(lambda outcome: None)
    with torch.no_grad(), contract.reload():
        layer.weight.copy_(torch.arange(6.0).view(2, 3) * 10)
        layer.reloads += 1
        layer.process_weights_after_loading()
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE, outcome.summary()
    assert FindingKind.STALE not in {f.kind for f in outcome.problems}, outcome.summary()
    assert torch.equal(layer.follows, layer.weight.t())


def test_a_layerwise_child_restore_does_not_overwrite_a_respecified_partner_still_pending() -> None:
    """``rotate`` + ``tie``: layer 1's PWAL rotates the captured tensors of d0 (a ``Marked`` subclass), d1 and d2 (d2
    held on the child ``sub``, a seal entry of its own), each then written in place; d3 ties layer 0's d0, so layers.1
    is restored at ``finish()`` while ``layers.1.sub`` is restored at its ``after_layer``. d0 now holds d2's plain
    captured tensor: another class, so no copy can restore it and it stays at its path. The child's step copied d2's
    values into that memory: d0's values, which PWAL got right, were overwritten and the reload asked for a recapture
    that reads them. A pending layer's tensor that stays at its path is a reader of what the step writes, like the
    step's own kept tensors."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=1, cols=1, slots=(SlotSpec("d0", source="sum"),)),
            LayerSpec(
                rows=1,
                cols=1,
                cycle=(0, 2, 1),
                slots=(
                    SlotSpec("d0", source="fp8", factor=3, subclass=True, declare="register_derived"),
                    SlotSpec("d1", source="fp8"),
                    SlotSpec("d2", source="fp8", holder="child"),
                    SlotSpec("d3", kind="tie", of=0),
                ),
            ),
        ),
        mode="migrate",
        layerwise="plain",
    )
    _assert_honest(scenario)


@pytest.mark.parametrize("mode", ["recapture", "migrate"])
def test_a_tie_left_on_memory_an_earlier_after_layer_abandoned_is_not_taken_for_recapture_fixable(mode: str) -> None:
    """``swap`` + ``tie:skip`` + ``layerwise``: layer 0's weights stay (``keep``); its PWAL swaps the captured tensors
    of the declared d0 and d2 and writes each one's values in place, so d2's captured memory now holds d0's values.
    Layer 1's undeclared d3 (seen by the capture manifest) still ties that memory. ``after_layer(0)`` cannot copy d2
    back (d3 holds its memory) and leaves both slots on their new tensors. Layer 1's snapshot, taken after that, sees d3
    unchanged and its inputs unchanged: the reload asked for a recapture, which reads d0's values through d3. A slot
    left on memory an earlier step abandoned fails closed."""
    scenario = Scenario(
        layers=(
            LayerSpec(
                rows=1,
                cols=1,
                loader="keep",
                cycle=(0, 2),
                slots=(
                    SlotSpec("d0", source="int8", declare="graph_visible"),
                    SlotSpec("d1", source="int8", mutation="skip"),
                    SlotSpec("d2", source="int8", factor=3, declare="register_derived"),
                ),
            ),
            LayerSpec(rows=1, cols=1, loader="keep", slots=(SlotSpec("d3", kind="tie", of=2, mutation="skip"),)),
        ),
        mode=mode,
        detect="declared-only",
        manifest=True,
        layerwise="plain",
    )
    _assert_honest(scenario)


def test_a_skipped_tie_to_an_inference_tensor_in_a_layer_whose_weights_did_not_change_is_stale() -> None:
    """``layerwise:repwal`` + ``tie:skip`` + ``inference:both``, reduced to what the failure needs: neither the
    layerwise reload nor the
    second PWAL is needed. The first load's PWAL runs under ``torch.inference_mode()`` (every derived tensor is an
    inference tensor); layers.1's undeclared d0 is tied to layers.0's d0; layers.0 reloads new weights and its PWAL
    rebinds d0, layers.1 keeps its weights and PWAL skips the tie. The reload says NEEDS_RECAPTURE, but the tie
    still holds layers.0's old values, so the recapture reads wrong values. Without inference mode at the first load
    the same reload is FAILED (the tie is ``stale``); under ``migrate`` and ``strict`` it is FAILED too."""
    scenario = Scenario(
        layers=(
            LayerSpec(rows=2, cols=2, slots=(SlotSpec("d0", source="t"),)),
            LayerSpec(rows=2, cols=2, loader="keep", slots=(SlotSpec("d0", kind="tie", of=0, mutation="skip"),)),
        ),
        mode="recapture",
        inference="first",
    )
    _assert_honest(scenario)


def test_a_skipped_tie_to_a_rotated_respecified_slot_in_a_repwal_layer_is_not_recapture_fixable() -> None:
    """``layerwise:repwal`` + ``tie:skip`` + ``inference:reload`` + ``rotate``, not fully reduced. Layerwise; the
    reload's PWAL runs under ``torch.inference_mode()``; layers.0 rotates d0, d2, d1 (then skips d0, respecifies d1 with
    doubled strides, frees d2); layers.1 holds a tie to layers.0's d1 that PWAL skips, and its PWAL runs once more after
    its after_layer() (which does not matter: layers.1 shares memory with layers.0, so its restore waits for finish()).
    The reload said NEEDS_RECAPTURE, but the tie held other values than a cold model, so a recapture read wrong values:
    the tie's captured memory was written by PWAL as another slot's new tensor (the rotation), which an earlier restore
    step copied from and released; a later step's slot left on that memory holds that slot's values
    (``_steps._note_earlier_new``, ``stale``)."""
    scenario = Scenario(
        layers=(
            LayerSpec(
                rows=3,
                cols=2,
                cycle=(0, 2, 1),
                slots=(
                    SlotSpec("d0", source="int8", factor=2, mutation="skip"),
                    SlotSpec("d1", source="int8", factor=1, holder="dict", mutation="respec_stride"),
                    SlotSpec("d2", source="int8", factor=2, holder="child", mutation="free"),
                ),
            ),
            LayerSpec(
                rows=1,
                cols=3,
                buffer=True,
                slots=(SlotSpec("d0", kind="tie", of=1, holder="nested", mutation="skip"),),
            ),
        ),
        mode="migrate",
        manifest=True,
        layerwise="repwal",
        touch=1,
        inference="reload",
    )
    _assert_honest(scenario)


def test_a_skipped_tie_to_a_rotated_slot_held_in_a_child_is_not_overwritten_in_a_layerwise_reload() -> None:
    """Layerwise: layers.0's PWAL rotates the tensors of three declared-or-not ``sum`` slots held in a list, a
    closure and a child module (d0 gets d2's, d2 gets d1's, d1 gets d0's) and writes each one's new values in
    place; layers.1 holds a tie to layers.0's ``d2`` that its PWAL skips. The reload asks for a recapture, but
    ``layers.0:d2`` then held other values than PWAL left there (a value PWAL got right was overwritten). The memory
    of the new tensors an earlier restore step copied from is now foreign to the slots of later steps
    (``_steps._note_earlier_new``), so the step that would have written over it fails closed instead. Whole-model,
    all attribute holders, or a swap instead of the rotation: honest before too."""
    layer0 = LayerSpec(
        rows=4,
        cols=2,
        cycle=(0, 2, 1),
        slots=(
            SlotSpec("d0", source="sum", factor=3, holder="list", declare="graph_visible"),
            SlotSpec("d1", source="sum", factor=1, holder="closure", declare="register_derived"),
            SlotSpec("d2", source="sum", factor=3, holder="child"),
        ),
    )
    layer1 = LayerSpec(
        rows=3, cols=4, slots=(SlotSpec("d0", kind="tie", of=2, declare="register_derived", mutation="skip"),)
    )
    _assert_honest(Scenario(layers=(layer0, layer1), mode="recapture", layerwise="plain"))


def test_a_rotation_writing_a_slot_s_memory_as_another_slot_s_new_tensor_is_not_taken_back() -> None:
    """A value PWAL got right must not be overwritten (that reload was FAILED): PWAL rotates d1 -> d2 -> d0 and writes
    each slot's new values in place, while undeclared aliases of d0 stay on d0's captured memory. That memory was
    written as another slot's new tensor (the rotation), not by an owner of its own: the rule that takes back a copy
    into memory its alias path wrote (``contract._owned``) must not act on it."""
    slots = (
        SlotSpec("d0", source="fp8", factor=1, holder="list", mutation="stash"),
        SlotSpec("d1", source="fp8", factor=2, holder="attr", declare="graph_visible", mutation="respec_stride"),
        SlotSpec("d2", source="fp8", factor=3, holder="closure", declare="graph_visible", mutation="skip"),
        SlotSpec("d3", kind="alias", of=0, holder="attr", mutation="skip"),
        SlotSpec("d4", kind="alias", of=0, holder="closure", declare="register_derived", mutation="rebind"),
        SlotSpec("d5", source="strides", factor=1, holder="dict", mutation="respec_shape"),
    )
    layer = LayerSpec(rows=1, cols=1, slots=slots, loader="stash", cycle=(1, 2, 0))
    _assert_honest(Scenario(layers=(layer,), mode="recapture", detect="sealed-paths"))


def test_a_swap_of_subclass_slots_with_an_alias_and_a_tie_in_a_later_layer_writes_nothing_pwal_did_not_produce() -> (
    None
):
    """The previous case's twin: two layers each swapping two derived subclass tensors, an alias of the swapped d1 in
    layer 0, ties to it in layer 1."""
    layer0 = LayerSpec(
        rows=2,
        cols=1,
        loader="stash",
        meta="tensor",
        cycle=(0, 1),
        slots=(
            SlotSpec("d0", source="complex", subclass=True, declare="graph_visible", mutation="stash"),
            SlotSpec(
                "d1",
                source="complex",
                factor=2,
                subclass=True,
                holder="child",
                declare="graph_visible",
                mutation="stash",
            ),
            SlotSpec("d2", kind="alias", of=1, holder="dict", mutation="rebind"),
        ),
    )
    layer1 = LayerSpec(
        rows=4,
        cols=2,
        loader="stash",
        meta="load",
        buffer=True,
        cycle=(0, 1),
        slots=(
            SlotSpec(
                "d0",
                source="strides",
                factor=2,
                subclass=True,
                holder="child",
                declare="graph_visible",
                mutation="stash",
            ),
            SlotSpec(
                "d1",
                source="strides",
                factor=2,
                subclass=True,
                holder="child",
                declare="graph_visible",
                mutation="stash",
            ),
            SlotSpec("d2", kind="tie", of=1, holder="child", declare="register_derived", mutation="rebind"),
            SlotSpec("d3", kind="tie", of=1, holder="list", mutation="skip"),
            SlotSpec("d4", kind="alias", of=1, holder="child", mutation="free"),
            SlotSpec("d5", kind="alias", of=1, holder="list", declare="graph_visible", mutation="skip"),
        ),
    )
    _assert_honest(Scenario(layers=(layer0, layer1), mode="recapture", detect="sealed-paths"))


def test_a_late_before_layer_does_not_commit_a_stale_tensor_attribute() -> None:
    """The call_order class, as drawn: layerwise, ``before_layer`` after PWAL; d2 is written in place and carries
    ``.fz_attr``, a tensor set on the first PWAL only. The loader writes through ``.data`` (no version counter moves),
    so only a digest of the weights shows the load came first."""
    import fuzz.classes  # noqa: F401  (registers the class's model maker)

    layer = LayerSpec(
        rows=1,
        cols=2,
        loader="data_copy",
        meta="load",
        slots=(
            SlotSpec("d0", kind="weight_view", holder="nested", declare="register_derived", mutation="skip"),
            SlotSpec("d1", kind="weight_view", holder="attr", mutation="rebind"),
            SlotSpec("d2", holder="dict", mutation="inplace", attr="tensor", attr_when="first"),
        ),
    )
    scenario = Scenario(
        layers=(layer,),
        mode="recapture",
        detect="every-reload",
        layerwise="late_before_pwal",
        touch=0,
        klass="call_order",
        variant="layerwise",
        fault="late_before_pwal",
        at=0,
    )
    _assert_honest(scenario)


def test_a_layer_pwal_rotated_without_before_or_after_layer_does_not_ask_for_a_recapture_that_reads_wrong() -> None:
    """The call_order class: layerwise, layer 0 gets neither before_layer() nor after_layer(); its loader leaves the
    weights alone but PWAL rotates three derived tensors, and an undeclared alias of one stays on the old object. The
    snapshot taken at the end saw PWAL's tensors as the captured ones; the verdict was NEEDS_RECAPTURE and the recapture
    read the alias's wrong values."""
    import fuzz.classes  # noqa: F401  (registers the class's model maker)

    layer0 = LayerSpec(
        rows=1,
        cols=3,
        loader="keep",
        buffer=True,
        cycle=(2, 0, 1),
        slots=(
            SlotSpec("d0", source="t", factor=2, subclass=True, holder="nested", mutation="skip"),
            SlotSpec("d1", source="t", factor=2, holder="list", mutation="stash"),
            SlotSpec("d2", source="t", factor=3, holder="child", mutation="rebind"),
            SlotSpec("d3", kind="alias", of=0, holder="dict", mutation="skip"),
        ),
    )
    layer1 = LayerSpec(
        rows=4,
        cols=4,
        loader="copy",
        cycle=(1, 2, 0),
        slots=(
            SlotSpec(
                "d0",
                source="scale",
                factor=2,
                subclass=True,
                holder="closure",
                declare="register_derived",
                mutation="skip",
            ),
            SlotSpec(
                "d1", source="scale", subclass=True, holder="dict", declare="register_derived", mutation="data_inplace"
            ),
            SlotSpec(
                "d2", source="scale", subclass=True, holder="closure", declare="register_derived", mutation="stash_ref"
            ),
        ),
    )
    scenario = Scenario(
        layers=(layer0, layer1),
        mode="recapture",
        detect="every-reload",
        manifest=True,
        layerwise="neither",
        touch=0,
        klass="call_order",
        variant="layerwise",
        fault="neither",
        at=0,
    )
    _assert_honest(scenario)


def test_a_repwal_rotation_with_a_tie_in_a_later_layer_writes_nothing_pwal_did_not_produce() -> None:
    """As drawn (layerwise, PWAL again after layer 0's after_layer()). Layer 0's storage is tied to a later layer, so
    its restore waits for finish(); PWAL run again permuted its tensors meanwhile, and the later layer's tie holds a
    tensor of another role. ``stale``, never a recapture."""
    layer0 = LayerSpec(
        rows=4,
        cols=4,
        loader="rebind",
        buffer=True,
        cycle=(1, 2, 0),
        slots=(
            SlotSpec("d0", source="fp8", factor=3, subclass=True, declare="graph_visible", mutation="rebind"),
            SlotSpec(
                "d1", source="fp8", factor=3, subclass=True, holder="list", declare="graph_visible", mutation="inplace"
            ),
            SlotSpec("d2", source="fp8", factor=2, subclass=True, declare="graph_visible", mutation="respec_stride"),
            SlotSpec(
                "d3",
                source="fp8",
                subclass=True,
                holder="list",
                declare="graph_visible",
                mutation="respec_dtype",
                attr="peer",
                attr_of=-1,
                attr_when="first",
            ),
        ),
    )
    layer1 = LayerSpec(
        rows=1,
        cols=2,
        loader="stash",
        buffer=True,
        slots=(
            SlotSpec("d0", source="fp8", factor=2, subclass=True, mutation="stash_ref", attr="tensor"),
            SlotSpec("d1", kind="weight_view", holder="dict", mutation="rebind"),
        ),
    )
    layer2 = LayerSpec(
        rows=2,
        cols=1,
        loader="data_copy",
        cycle=(1, 0),
        slots=(
            SlotSpec("d0", source="complex", holder="nested", mutation="free"),
            SlotSpec(
                "d1",
                source="complex",
                subclass=True,
                holder="nested",
                declare="register_derived",
                mutation="respec_offset",
            ),
            SlotSpec("d2", kind="alias", of=1, declare="graph_visible", mutation="rebind"),
            SlotSpec("d3", kind="tie", of=2, holder="list", declare="register_derived", mutation="rebind"),
            SlotSpec(
                "d4",
                source="strides",
                factor=3,
                subclass=True,
                declare="graph_visible",
                mutation="respec_shape",
                attr="tensor",
            ),
            SlotSpec("d5", kind="tie", of=3, holder="child", mutation="free"),
        ),
    )
    scenario = Scenario(
        layers=(layer0, layer1, layer2),
        mode="recapture",
        detect="every-reload",
        manifest=True,
        layerwise="repwal",
        touch=0,
    )
    _assert_honest(scenario)


def test_a_tied_layer_pwal_permuted_again_after_its_after_layer_fails_closed() -> None:
    """The case above, shrunk: layer 0 rotates three tensors; layer 1 ties to layer 0's d2; PWAL runs again on layer 0
    after layer 1's tie was taken. Layer 1 then holds a tensor with d0's or d1's values: a recapture reads them."""
    layer0 = LayerSpec(
        rows=1,
        cols=1,
        cycle=(1, 2, 0),
        slots=(
            SlotSpec("d0", source="fp8"),
            SlotSpec("d1", source="fp8"),
            SlotSpec("d2", source="fp8", factor=2),
        ),
    )
    layer1 = LayerSpec(rows=1, cols=1, slots=(SlotSpec("d0", kind="tie", of=2),))
    for fast_tier in (True, False):
        result = run(
            Scenario(layers=(layer0, layer1), mode="recapture", layerwise="repwal", touch=0), fast_tier=fast_tier
        )
        assert result.verdict == oracle.OK and result.status == "FAILED", (result.verdict, result.reason)


def test_a_slot_kept_on_its_new_tensor_at_after_layer_is_stale_when_the_weight_is_written_again() -> None:
    """The input_shares class: the weight Parameter is a view at offset 1 of a storage the static input shares; the
    loader binds a new Parameter and PWAL re-views it (``d0 = weight.t()``, offset 0: respecified, it keeps its new
    tensor). after_layer() binds the captured Parameter back; then the weight is written again with other values. ``d0``
    still views the Parameter no path holds: a recapture read its old values."""
    import fuzz.classes  # noqa: F401  (registers the class's model maker)

    layer = LayerSpec(
        rows=4,
        cols=1,
        loader="rebind",
        meta="load",
        slots=(SlotSpec("d0", kind="weight_view", holder="closure", mutation="rebind"),),
    )
    scenario = Scenario(
        layers=(layer,),
        mode="migrate",
        detect="sealed-paths",
        layerwise="rewrite_new",
        touch=0,
        klass="input_shares",
        variant="weight",
        fault="inplace",
        at=0,
    )
    for fast_tier in (True, False):
        result = run(scenario, fast_tier=fast_tier)
        assert result.verdict == oracle.OK, (result.verdict, result.reason)


def test_a_skipped_tail_of_a_rotated_tensor_is_not_left_to_a_recapture() -> None:
    """The wrapper class (the base class reproduces it, as here): layerwise in order, layer 0 rotates d1, d0, d2 (d0 and
    d1 respecified: they keep their new tensors) and skips ``d3 = tail(d2)``, which then views d0's new tensor, written
    with d0's values. The reader check took those values for d3's own (it looked for the writer among the moves only)
    and broke d2 away: NEEDS_RECAPTURE, and the recapture read d3 wrong. It is ``stale`` now (written through a new
    tensor another path holds)."""
    layer0 = LayerSpec(
        rows=2,
        cols=4,
        loader="rebind",
        buffer=True,
        cycle=(1, 0, 2),
        slots=(
            SlotSpec("d0", factor=3, holder="child", mutation="data_inplace"),
            SlotSpec("d1", subclass=True, holder="child", mutation="set_data"),
            SlotSpec("d2", factor=2, subclass=True, holder="closure", mutation="stash_ref"),
            SlotSpec("d3", kind="tail", of=2, holder="list", mutation="skip"),
        ),
    )
    layer1 = LayerSpec(
        rows=3,
        cols=4,
        loader="copy",
        meta="tensor",
        slots=(
            SlotSpec("d0", kind="tie", of=1, holder="dict", mutation="free"),
            SlotSpec("d1", source="scale", holder="list", declare="graph_visible", mutation="view_old", attr="tensor"),
            SlotSpec("d2", kind="tail", of=1, holder="closure", declare="graph_visible", mutation="skip"),
        ),
    )
    _assert_honest(Scenario(layers=(layer0, layer1), mode="migrate", manifest=True, layerwise="plain"))


def test_a_layer_swapping_a_slot_with_its_child_layer_s_undeclared_slot_twice_is_not_left_to_a_recapture() -> None:
    """``layerwise:repwal`` + a swap across a layer and its child layer + a tie. Layerwise; layers.0's PWAL swaps its
    declared ``d1`` with ``sub.d0`` (undeclared, in the child layer, which a tie from layers.1 makes wait for
    ``finish()``) and runs again after its ``after_layer()``. That step's copy went into ``d1``'s captured memory, which
    the pending child's undeclared slot held as its new tensor: not restored in recapture mode, it kept the values the
    copy wrote, both slots ended on one tensor, and the recapture read them. A pending layer's undeclared slot that its
    restore will not copy is a reader of that memory (``_holders._protect_pending``)."""
    layer0 = LayerSpec(
        rows=1,
        cols=1,
        cycle=(0, 1),
        slots=(
            SlotSpec("d0", source="complex", factor=2, holder="child"),
            SlotSpec("d1", source="complex", factor=1, declare="register_derived"),
        ),
    )
    layer1 = LayerSpec(rows=1, cols=1, slots=(SlotSpec("d0", kind="tie", of=0),))
    for mode in ("recapture", "strict"):
        _assert_honest(Scenario(layers=(layer0, layer1), mode=mode, layerwise="repwal", touch=0))


@pytest.mark.parametrize("mode", ("recapture", "migrate"))
def test_watched_slots_permuted_again_after_after_layer_with_a_tie_in_a_later_layer_fail_closed(mode: str) -> None:
    """Under ``declared-only`` layer 0's undeclared slots are watched only (the capture manifest saw them); layer 1 ties
    to layer 0's ``d1``. PWAL swaps layer 0's tensors, and runs again after every ``after_layer()``, swapping them back:
    layer 1's tie now holds the tensor of ``d0``'s role. The manifest sees that storage left layer 1's path (a
    recapture), but a recapture would read ``d0``'s values there."""
    layer0 = LayerSpec(
        rows=1, cols=1, cycle=(0, 1), slots=(SlotSpec("d0", source="sum", factor=2), SlotSpec("d1", source="sum"))
    )
    layer1 = LayerSpec(rows=1, cols=1, slots=(SlotSpec("d0", kind="tie", of=1),))
    scenario = Scenario(
        layers=(layer0, layer1), mode=mode, detect="declared-only", manifest=True, layerwise="repwal", touch=0
    )
    _assert_honest(scenario)


def test_an_alias_of_a_rotated_inference_slot_in_a_repwal_layer_is_not_left_to_a_recapture() -> None:
    """PWAL, under inference mode (no version counters), rotates three slots' tensors on every pass; the restore at
    ``after_layer()`` leaves them on their new tensors (respecified, class changes). PWAL runs again and rotates them
    once more, writing each in place: the memory a skipped declared alias of ``d1`` reads now holds ``d2``'s values, and
    a recapture would read them there."""
    layer = LayerSpec(
        rows=1,
        cols=1,
        loader="keep",
        cycle=(1, 2, 0),
        slots=(
            SlotSpec("d0", source="int8", factor=2, declare="graph_visible"),
            SlotSpec("d1", source="int8", factor=2, subclass=True),
            SlotSpec("d2", source="int8", declare="register_derived"),
            SlotSpec("d3", kind="alias", of=1, declare="graph_visible", mutation="skip"),
        ),
    )
    scenario = Scenario(
        layers=(layer,), mode="recapture", detect="every-reload", layerwise="repwal", touch=0, inference="both"
    )
    _assert_honest(scenario)


def test_a_conditional_attribute_of_an_inference_slot_after_a_late_rewrite_does_not_commit() -> None:
    layer = LayerSpec(
        rows=4,
        cols=2,
        loader="rebind",
        meta="ctor",
        slots=(
            SlotSpec(
                "d0",
                source="strides",
                subclass=True,
                holder="dict",
                declare="register_derived",
                mutation="inplace",
                attr="peer",
                attr_when="cond",
            ),
        ),
    )
    scenario = Scenario(
        layers=(layer,),
        mode="strict",
        manifest=True,
        layerwise="rewrite_new",
        touch=0,
        inference="first",
    )
    _assert_honest(scenario)


def test_a_contextvar_set_by_pwal_before_a_late_rewrite_is_not_left_to_a_recapture() -> None:
    import fuzz.classes  # noqa: F401  (registers the class's model maker)

    layer = LayerSpec(
        rows=1,
        cols=3,
        slots=(
            SlotSpec("d0", kind="weight_view", holder="closure", mutation="free"),
            SlotSpec("d1", kind="weight_view", holder="closure", mutation="free"),
        ),
    )
    scenario = Scenario(
        layers=(layer,),
        mode="recapture",
        manifest=True,
        layerwise="rewrite_new",
        touch=0,
        klass="contextvar",
        variant="value",
        fault="set",
    )
    _assert_honest(scenario)


def test_a_repeated_pwal_over_a_rotation_with_respecified_slots_asks_no_recapture_that_reads_wrong_values() -> None:
    """With and without a recording of the reload: layerwise (``repwal``: PWAL again after the layer's
    ``after_layer()``), the loader keeps the weight (a buffer, with loader metadata), PWAL rotates d1 -> d0 -> d2 -> d1
    and gives d0 another stride, d1 another dtype, skips d2 and frees d3 (an alias of d0). ``after_layer()`` bound d2's
    captured tensor back although d0 kept it as its new tensor (d0 and d1 respecified), tying the two paths; PWAL's
    second run then wrote d1's values through the tie and d0 read them (a restore never ties two paths the model did
    not: ``_holders.new_ties``)."""
    slots = (
        SlotSpec("d0", source="fp8", holder="closure", declare="register_derived", mutation="respec_stride"),
        SlotSpec("d1", source="fp8", factor=3, subclass=True, holder="child", mutation="respec_dtype"),
        SlotSpec("d2", source="fp8", subclass=True, holder="list", declare="register_derived", mutation="skip"),
        SlotSpec("d3", kind="alias", of=0, holder="attr", declare="register_derived", mutation="free"),
    )
    layer = LayerSpec(rows=4, cols=2, slots=slots, loader="keep", meta="load", buffer=True, cycle=(1, 0, 2))
    _assert_honest(
        Scenario(layers=(layer,), mode="migrate", detect="sealed-paths", manifest=True, layerwise="repwal", touch=0)
    )
