"""The contract's collector pause: it puts back exactly what it found, except what code run inside changed.

The pause runs user code (the restore's rebind calls a layer's ``__setattr__`` or a property setter). Whatever
that code does to the collector (``gc.disable()``, ``gc.enable()``, ``gc.set_threshold()``) must be what the
process sees after the pause; nothing else may change. The property test judges random programs of user toggles
inside nested pauses (some raising) against a small model of that rule that does not know how the pause works.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphsafe._gcpause import collections_paused

Thresholds = tuple[int, int, int]


@pytest.fixture(autouse=True)
def _collector_as_found() -> Iterator[None]:
    """Every test leaves the process's collector as it found it, whatever it asserted."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()


def _set(enabled: bool, thresholds: Thresholds = (700, 10, 10)) -> None:
    (gc.enable if enabled else gc.disable)()
    gc.set_threshold(*thresholds)


def _state() -> tuple[bool, Thresholds]:
    return gc.isenabled(), gc.get_threshold()


class _Boom(Exception):
    pass


# -- the common case: nothing toggled inside -----------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("thresholds", [(700, 10, 10), (123, 4, 5), (1, 1, 1)])
def test_nothing_toggled_leaves_the_collector_exactly_as_it_was(enabled: bool, thresholds: Thresholds) -> None:
    _set(enabled, thresholds)
    with collections_paused():
        assert gc.isenabled() is enabled  # the switch is not the pause's
        assert gc.get_threshold() == (0, thresholds[1], thresholds[2])  # automatic collections held off
    assert _state() == (enabled, thresholds)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_caller_holding_collections_off_by_the_threshold_is_left_alone(enabled: bool) -> None:
    _set(enabled, (0, 7, 8))
    with collections_paused():
        assert _state() == (enabled, (0, 7, 8))
    assert _state() == (enabled, (0, 7, 8))


# -- user code inside: its toggles stay ---------------------------------------------------------------------------


def test_a_user_disable_inside_stays_disabled() -> None:
    _set(True)
    with collections_paused():
        gc.disable()
    assert _state() == (False, (700, 10, 10))


def test_a_user_enable_inside_stays_enabled_when_the_collector_was_off_before() -> None:
    _set(False)
    with collections_paused():
        gc.enable()
    assert _state() == (True, (700, 10, 10))


def test_a_user_enable_inside_does_not_end_the_pause() -> None:
    """No collection starts inside the block after a ``gc.enable()`` there; the collector runs again after it."""
    runs: list[str] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(where)

    _set(False, (1, 10, 10))  # off before the block; once on, a collection at every allocation
    gc.callbacks.append(on_collection)
    try:
        where = "inside"
        with collections_paused():
            gc.enable()
            for _ in range(1000):
                cycle: list[object] = []
                cycle.append(cycle)
        where = "after"
        for _ in range(10):
            cycle = []
            cycle.append(cycle)
    finally:
        gc.callbacks.remove(on_collection)
    assert "inside" not in runs
    assert "after" in runs  # the probe can see a collection: the block's silence is the pause's doing


def test_a_user_threshold_inside_stays() -> None:
    _set(True)
    with collections_paused():
        gc.set_threshold(5000, 20, 30)
    assert _state() == (True, (5000, 20, 30))


# -- nesting and errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_nested_pauses_restore_at_the_outer_exit(enabled: bool) -> None:
    _set(enabled, (700, 10, 10))
    with collections_paused():
        with collections_paused():
            assert _state() == (enabled, (0, 10, 10))
        assert _state() == (enabled, (0, 10, 10))  # the inner one found the pause and put back nothing
        with collections_paused(), collections_paused():
            pass
        assert _state() == (enabled, (0, 10, 10))
    assert _state() == (enabled, (700, 10, 10))


def test_a_pause_nested_after_a_user_threshold_restores_the_users() -> None:
    _set(True, (700, 10, 10))
    with collections_paused():
        gc.set_threshold(300, 3, 3)
        with collections_paused():
            assert gc.get_threshold() == (0, 3, 3)
        assert gc.get_threshold() == (300, 3, 3)
    assert _state() == (True, (300, 3, 3))


@pytest.mark.parametrize("enabled", [True, False])
def test_an_exception_inside_restores_the_prior_state(enabled: bool) -> None:
    _set(enabled, (700, 10, 10))
    with pytest.raises(_Boom), collections_paused():
        raise _Boom
    assert _state() == (enabled, (700, 10, 10))
    with pytest.raises(_Boom), collections_paused(), collections_paused():
        raise _Boom
    assert _state() == (enabled, (700, 10, 10))


def test_an_exception_inside_keeps_a_user_toggle_made_before_it() -> None:
    _set(True)
    with pytest.raises(_Boom), collections_paused():
        gc.disable()
        raise _Boom
    assert _state() == (False, (700, 10, 10))


# -- threads: the collector's settings are process-wide -----------------------------------------------------------


def test_another_threads_toggles_during_the_pause_stay() -> None:
    _set(True, (700, 10, 10))

    def other() -> None:
        gc.disable()
        gc.set_threshold(900, 9, 9)

    with collections_paused():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert _state() == (False, (900, 9, 9))


def test_two_threads_pauses_overlapping_without_nesting_end_with_the_thresholds_found() -> None:
    """A enters, B enters, A exits, B exits: B found the pause and does nothing; A puts back what it found."""
    _set(True, (700, 10, 10))
    b_entered, a_exited, b_saw = threading.Event(), threading.Event(), []

    def b() -> None:
        with collections_paused():
            b_entered.set()
            a_exited.wait(10)
            b_saw.append(gc.get_threshold())
        b_saw.append(gc.get_threshold())

    thread = threading.Thread(target=b)
    with collections_paused():
        thread.start()
        assert b_entered.wait(10)
    a_exited.set()
    thread.join()
    assert b_saw == [(700, 10, 10), (700, 10, 10)]  # the rest of B's block ran unpaused (documented)
    assert _state() == (True, (700, 10, 10))


# -- the property: random user toggles inside nested pauses, judged by a model of the rule ------------------------


@dataclass(frozen=True)
class _Toggle:
    enable: bool


@dataclass(frozen=True)
class _SetThresholds:
    value: Thresholds


@dataclass(frozen=True)
class _PauseBlock:
    body: tuple[_Toggle | _SetThresholds | _PauseBlock, ...]
    raises: bool


_Item = _Toggle | _SetThresholds | _PauseBlock

# A user's thresholds with the first 0 take the second from 1000 up, where the pause's own (the second as a
# non-zero-first state had it: from the initial state or a user's, below 100) never are: the one setting the
# pause cannot tell from its own (exactly its paused thresholds) is documented, not drawn.
_user_thresholds = st.one_of(
    st.tuples(st.integers(1, 5000), st.integers(1, 99), st.integers(1, 99)),
    st.tuples(st.just(0), st.integers(1000, 1100), st.integers(1, 99)),
)
_items: st.SearchStrategy[_Item] = st.recursive(
    st.one_of(st.builds(_Toggle, st.booleans()), st.builds(_SetThresholds, _user_thresholds)),
    lambda inner: st.builds(_PauseBlock, st.lists(inner, max_size=5).map(tuple), st.booleans()),
    max_leaves=12,
)


@dataclass
class _Model:
    """What the rule says the collector's settings are outside every pause: the user's last word, else what the
    caller had. Inside a pause that has seen no user threshold since it began, the first threshold reads 0."""

    enabled: bool
    thresholds: Thresholds
    # per open pause, outermost first: whether user code set the thresholds since it was entered
    user_set_since_entry: list[bool] = field(default_factory=list)

    def check_inside(self) -> None:
        assert gc.isenabled() is self.enabled, "the pause touched the collector's switch"
        if any(not user_set for user_set in self.user_set_since_entry):
            # some open pause has seen no user threshold since it began: it holds collections off
            assert gc.get_threshold() == (0, *self.thresholds[1:]), "a pause left automatic collections on"
        else:
            assert gc.get_threshold() == self.thresholds, "the user's thresholds were not kept"


def _run(items: tuple[_Item, ...], model: _Model) -> None:
    for item in items:
        model.check_inside()
        if isinstance(item, _Toggle):
            (gc.enable if item.enable else gc.disable)()
            model.enabled = item.enable
        elif isinstance(item, _SetThresholds):
            gc.set_threshold(*item.value)
            model.thresholds = item.value
            model.user_set_since_entry = [True] * len(model.user_set_since_entry)
        else:
            at_entry = model.thresholds
            model.user_set_since_entry.append(False)
            try:
                with collections_paused():
                    _run(item.body, model)
                    model.check_inside()
                    if item.raises:
                        raise _Boom
            except _Boom:
                assert item.raises
            user_set = model.user_set_since_entry.pop()
            if not user_set:  # nothing set inside: back to what it found (else the user's last word stays)
                model.thresholds = at_entry
            # a user setting inside this pause is also one since an enclosing pause's entry (marked above)
            if model.user_set_since_entry:
                model.check_inside()  # still inside an enclosing pause
            else:
                assert _state() == (model.enabled, model.thresholds), "a pause did not put back what the rule says"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    enabled=st.booleans(),
    thresholds=st.one_of(
        st.tuples(st.integers(1, 5000), st.integers(1, 99), st.integers(1, 99)),
        st.tuples(st.just(0), st.integers(1, 99), st.integers(1, 99)),
    ),
    program=st.lists(_items, max_size=6).map(tuple),
)
def test_any_program_of_user_toggles_in_nested_pauses_ends_as_the_user_left_it(
    enabled: bool, thresholds: Thresholds, program: tuple[_Item, ...]
) -> None:
    found = _state()
    try:
        _set(enabled, thresholds)
        model = _Model(enabled, thresholds)
        _run(program, model)
        assert _state() == (model.enabled, model.thresholds)
    finally:
        gc.set_threshold(*found[1])
        (gc.enable if found[0] else gc.disable)()
