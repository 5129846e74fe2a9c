"""Adapters: translate a framework's lifecycle into contract calls, and an outcome into the framework's action.

* :mod:`graphsafe.adapters.torch`: capture ``torch.cuda.graph`` graphs under a contract, reload, recapture.
* :mod:`graphsafe.adapters.distributed`: rank agreement among the ranks of a ``torch.distributed`` process group.
* :mod:`graphsafe.adapters.vllm`: a vLLM general plugin on vLLM's own reload path (the ``vllm`` extra).
"""

__all__: list[str] = []  # each adapter is its own public module; nothing is re-exported here
