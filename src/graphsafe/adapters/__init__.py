"""Adapters: translate a framework's lifecycle into contract calls, and an outcome into the framework's action.

* :mod:`graphsafe.adapters.torch`: capture ``torch.cuda.graph`` graphs under a contract, reload, recapture.
* :mod:`graphsafe.adapters.distributed`: every rank of a process group ends a reload with one outcome.
* :mod:`graphsafe.adapters.vllm`: a vLLM general plugin on vLLM's own reload path (``pip install graphsafe[vllm]``).
"""
