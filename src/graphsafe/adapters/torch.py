"""Plain-PyTorch adapter: graphs you capture with ``torch.cuda.graph``, kept valid across weight reloads.

See :mod:`graphsafe.adapters._torch_graphs` for how it works; this module is the public surface.
"""

from graphsafe.adapters._torch_graphs import CapturedGraph, GraphRunner, capture, reload

__all__ = ["CapturedGraph", "GraphRunner", "capture", "reload"]
