"""Hold Python's cyclic garbage collector off while the contract's own per-reload code runs.

A reload allocates a few container objects per slot (snapshot entries, planned copies, rebinds) that all die when
the transaction ends. Left to the collector, their allocations trigger young collections that promote them, and
the promotions trigger full collections over the whole process heap: measured on the small-slot benchmark (200
layers x 20 slots, CPU), 85 ms of a 262 ms reload cycle went to the collector, one full collection every three
reloads. Paused, they die by reference counting before any collection sees them (benchmarks/RESULTS.md).

Only the contract's own code runs paused: never a loader, PWAL, a listener or a recapture callback. Reference
counting still frees everything without cycles; a cycle made meanwhile waits for the next collection.

The pause holds collections off by the allocation threshold, never by the collector's switch. The contract's
own code still runs user code (the restore's rebind calls a layer's ``__setattr__`` or a property setter), and
that code may turn the collector off or on for its own reasons. The switch (``gc.enable()``/``gc.disable()``)
is one process-wide flag with no count of who set it: a pause that flipped it could not tell its own
``disable()`` from one made inside the block, and turning the collector back on at exit would undo the user's.
CPython runs no automatic collection while the first threshold is 0 (``gc.set_threshold``), whatever the switch
says; so the pause sets that threshold and leaves the switch to its owners.
"""

from __future__ import annotations

import gc
from types import TracebackType

__all__ = ["collections_paused"]


class _Pause:
    """One pause: the thresholds it found and set (see :func:`collections_paused`)."""

    __slots__ = ("_found", "_paused")

    def __init__(self) -> None:
        self._found: tuple[int, int, int] | None = None
        self._paused: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        found = gc.get_threshold()
        if found[0]:  # 0: automatic collections are off already (an outer pause, or the caller's own setting)
            paused = (0, found[1], found[2])
            gc.set_threshold(*paused)
            self._found, self._paused = found, paused

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        found, paused = self._found, self._paused
        if found is None:
            return
        self._found = self._paused = None
        if gc.get_threshold() == paused:  # still what the pause set: put back what it found
            gc.set_threshold(*found)
        # else code inside the block (or another thread) set the thresholds: theirs stay


def collections_paused() -> _Pause:
    """A block with no automatic cyclic collection; the collector's settings as the block left them after.

    The rule: the pause puts back exactly what it found, except what code run inside the block changed, which
    stays as that code left it.

    - **The switch is never touched.** ``gc.isenabled()`` inside the block is what it was before; a
      ``gc.disable()`` or ``gc.enable()`` made inside (a slot's setter during the restore) stays after the block.
      A ``gc.enable()`` inside does not end the pause: collections wait for the block's end either way.
    - **The thresholds are put back** when the block ends, normally or by an exception, if they are still the
      ones the pause set (the first 0, the others as found). Thresholds set inside the block stay. One setting
      cannot be told from the pause's own: code inside that sets exactly the paused thresholds (the first to 0
      and the others unchanged, as ``gc.set_threshold(0)`` does) sees the found ones put back.
    - **Nesting.** A pause entered while the first threshold is 0 (inside another pause, or where the caller
      holds collections off by the threshold) changes nothing and puts nothing back; the outer one restores.
    - **Only automatic collections wait.** An explicit ``gc.collect()``, inside or in another thread, still
      collects.
    - **Threads.** The collector's settings are process-wide: while the block runs, no thread's allocations
      start a collection. Another thread's ``gc.enable()``/``gc.disable()`` is never touched; its
      ``gc.set_threshold()`` during the block stays, except one made between the pause's read of the thresholds
      and its write (at entry or at exit), which is overwritten, and one that sets exactly the paused
      thresholds. Two pauses in two threads that overlap without nesting: the later one finds the first
      threshold 0 and does nothing, so once the earlier one ends the rest of the later block runs unpaused; the
      thresholds after both are the ones found before the first.

    Cost: two ``gc.get_threshold()`` and two ``gc.set_threshold()`` calls and one tuple comparison, about 1 us
    per pause (0.9 us measured on CPython 3.11, against 1.3 us for the ``contextlib`` pause that flipped the
    switch). A reload runs at most two (``begin()``, ``finish()``) plus one per ``before_layer()`` and one per
    ``after_layer()`` call: about 2 us for a whole-model reload, 0.4 ms for 200 layers loaded layer by layer.
    """
    return _Pause()
