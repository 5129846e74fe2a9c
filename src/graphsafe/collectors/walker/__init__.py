"""The walker: every device tensor reachable from a layer, named by a slot path (see :func:`walk`)."""

from graphsafe.collectors.walker._walk import TensorRef, WalkResult, collect, walk

__all__ = ["TensorRef", "WalkResult", "collect", "walk"]
