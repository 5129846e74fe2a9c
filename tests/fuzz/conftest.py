"""Hypothesis profiles of the differential fuzzer (registered here, used only by ``tests/fuzz``).

* ``graphsafe-fuzz-ci`` (default): the fixed slice ``make test`` runs. Derandomized, so the same scenarios every
  run (2,400, two thirds of the base class and the rest spread over the other classes of ``fuzz.classes``: about
  a minute and a half on one core); ``GRAPHSAFE_FUZZ_EXAMPLES`` overrides the count.
* ``graphsafe-fuzz-long``: ``make fuzz``. Random (a new seed each run, or ``GRAPHSAFE_FUZZ_SEED``), as many
  examples as ``GRAPHSAFE_FUZZ_EXAMPLES`` says (default 50 000, about an hour); prints the counts at the end.

Pick one with ``GRAPHSAFE_FUZZ_PROFILE``. Neither profile shrinks (the slice counts every verdict instead of
stopping at the first); ``GRAPHSAFE_FUZZ_SHRINK=1`` makes the first silent success or crash fail the example,
so hypothesis shrinks it to a minimal scenario.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

CI_EXAMPLES = 2400
LONG_EXAMPLES = 50_000

_common = {
    "deadline": None,
    "database": None,
    "suppress_health_check": list(HealthCheck),
    "print_blob": True,
}
_phases = (Phase.explicit, Phase.generate) if not os.environ.get("GRAPHSAFE_FUZZ_SHRINK") else tuple(Phase)

settings.register_profile(
    "graphsafe-fuzz-ci",
    max_examples=int(os.environ.get("GRAPHSAFE_FUZZ_EXAMPLES", CI_EXAMPLES)),
    derandomize=True,
    phases=_phases,
    **_common,
)
settings.register_profile(
    "graphsafe-fuzz-long",
    max_examples=int(os.environ.get("GRAPHSAFE_FUZZ_EXAMPLES", LONG_EXAMPLES)),
    derandomize=False,
    phases=_phases,
    **_common,
)
