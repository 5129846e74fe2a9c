"""Tools for kernel authors and graphsafe's own tests.

* :func:`assert_reload_stable` builds a layer, seals it, reloads other weights and back, and fails with the
  migration report when a graph-visible tensor moved or kept stale values.
* :func:`grade` (:class:`Grading`, :class:`GradedStorage`): which of the registry, the walker and the
  parameters name each storage a capture manifest recorded.
* :mod:`graphsafe.testing.zoo`: the example zoo, small layers modelling the real sites where reload breaks
  captured graphs, each in a legacy and a migrated variant.
* :mod:`graphsafe.testing.plugin`, a pytest plugin (loaded automatically; ``-p no:graphsafe`` turns it off): the
  ``graphsafe_contract`` fixture, the ``@pytest.mark.graphsafe`` marker and ``--graphsafe-report=PATH``.

Names are imported on first use, so importing the plugin (which pytest does in every session) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphsafe.testing._assertions import (
        ExampleInput,
        LoadWeights,
        MakeLayer,
        ReloadUnstable,
        StabilityResult,
        assert_reload_stable,
    )
    from graphsafe.testing._grading import GradedStorage, Grading, grade

__all__ = [
    "ExampleInput",
    "GradedStorage",
    "Grading",
    "LoadWeights",
    "MakeLayer",
    "ReloadUnstable",
    "StabilityResult",
    "assert_reload_stable",
    "grade",
]

# The private module behind each group of names (each imports torch, so it loads on first use).
_MODULES = {
    "graphsafe.testing._assertions": (
        "ExampleInput",
        "LoadWeights",
        "MakeLayer",
        "ReloadUnstable",
        "StabilityResult",
        "assert_reload_stable",
    ),
    "graphsafe.testing._grading": ("GradedStorage", "Grading", "grade"),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
