"""The differential fuzzer: random models and random PWAL mutations, judged by an oracle that does not use graphsafe.

* :mod:`fuzz.models`: the scenario values (:class:`~fuzz.models.Scenario`), the model they build, the loader, the
  PWAL (with its mutations) and the forward a graph would capture.
* :mod:`fuzz.classes`: the classes of scenario beside the base one (ContextVar-held tensors, module-level caches,
  lazy modules, shared submodules, layerwise call-order faults, storage-sharing inputs, custom ops, wrapper
  subclasses and DTensor, swap_tensors loading, two contracts in one agreement group).
* :mod:`fuzz.strategies`: hypothesis strategies drawing scenarios.
* :mod:`fuzz.oracle`: the independent oracle (a ``TorchDispatchMode`` read recorder and the verdicts); torch only.
* :mod:`fuzz.harness`: runs one scenario under a ``GraphContract`` (public API only) and asks the oracle.
* ``test_fuzz.py``: the fixed-seed CI slice, the long run (``make fuzz``) and the oracle's own sanity tests.
"""
