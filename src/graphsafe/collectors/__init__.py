"""Collectors: what exists and what the graph read.

* :func:`classify`: the one classification of a layer's tensors (declared, parameter, buffer, alias, walker).
* :func:`walk` / :func:`collect`: the walker (undeclared tensors reachable from a layer).
* :func:`record_capture` / :class:`Manifest`: the capture-time manifest (what a graph really read).
* :func:`cuda_graph`: a drop-in for ``torch.cuda.graph`` that captures, kernel-scans and records in one step.
* :func:`scan_graph` / :class:`StorageView`: the kernel scan (what a captured CUDA graph's nodes point into).
* :class:`Dataflow`: which storages PWAL computed each tensor from (what a reload really read).
* :func:`module_names`: every qualified name of every module (a submodule held at two paths has two).

Collectors observe; they never restore anything.
"""

from graphsafe.collectors._capture import kernel_scan_unavailable, record_capture, record_scan
from graphsafe.collectors._classify import (
    UNTRACKABLE_ADVICE,
    Classified,
    LayerTensors,
    TrackedStorage,
    Unresolved,
    classify,
    classify_walk,
)
from graphsafe.collectors._cuda_graph import cuda_graph
from graphsafe.collectors._dataflow import Dataflow
from graphsafe.collectors._kernelscan import (
    GraphNode,
    GraphScan,
    RecordedDriver,
    ScanUnavailable,
    StorageView,
    pointer_words,
    record_table,
    scan_graph,
)
from graphsafe.collectors._manifest import CapturedStorage, Holder, Manifest, SealedModel
from graphsafe.collectors._names import module_names
from graphsafe.collectors.walker import TensorRef, WalkResult, collect, walk

__all__ = [
    "UNTRACKABLE_ADVICE",
    "CapturedStorage",
    "Classified",
    "Dataflow",
    "GraphNode",
    "GraphScan",
    "Holder",
    "LayerTensors",
    "Manifest",
    "RecordedDriver",
    "ScanUnavailable",
    "SealedModel",
    "StorageView",
    "TensorRef",
    "TrackedStorage",
    "Unresolved",
    "WalkResult",
    "classify",
    "classify_walk",
    "collect",
    "cuda_graph",
    "kernel_scan_unavailable",
    "module_names",
    "pointer_words",
    "record_capture",
    "record_scan",
    "record_table",
    "scan_graph",
    "walk",
]
