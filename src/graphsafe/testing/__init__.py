"""Tools for kernel authors: assert in a CPU unit test that a layer's PWAL is reload-safe.

* :func:`assert_reload_stable` builds a layer, seals it, reloads other weights and back, and fails with the
  migration report when a graph-visible tensor moved or kept stale values.
* :mod:`graphsafe.testing.plugin`, a pytest plugin (loaded automatically; ``-p no:graphsafe`` turns it off): the
  ``graphsafe_contract`` fixture, the ``@pytest.mark.graphsafe`` marker and ``--graphsafe-report=PATH``.

Names are imported on first use, so importing the plugin (which pytest does in every session) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphsafe.testing._assertions import (
        ExampleInput,
        LoadWeights,
        MakeLayer,
        StabilityResult,
        assert_reload_stable,
    )

__all__ = ["ExampleInput", "LoadWeights", "MakeLayer", "StabilityResult", "assert_reload_stable"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from graphsafe.testing import _assertions

        return getattr(_assertions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
