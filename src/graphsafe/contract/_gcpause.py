"""Hold Python's cyclic garbage collector off while the contract's own per-reload code runs.

A reload allocates a few container objects per slot (snapshot entries, planned copies, rebinds) that all die when
the transaction ends. Left to the collector, their allocations trigger young collections that promote them, and
the promotions trigger full collections over the whole process heap: measured on the small-slot benchmark (200
layers x 20 slots, CPU), 85 ms of a 262 ms reload cycle went to the collector, one full collection every three
reloads. Paused, they die by reference counting before any collection sees them (benchmarks/RESULTS.md).

Only the contract's own code runs paused: never a loader, PWAL, a listener or a recapture callback. Reference
counting still frees everything without cycles; a cycle made meanwhile waits for the next collection.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collections_paused"]


@contextmanager
def collections_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block, if it is enabled; enable it again after (also on error).

    A collector the caller disabled stays disabled. Process-wide, as the collector is: another thread's cycles
    wait too, for the few milliseconds the block takes.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
