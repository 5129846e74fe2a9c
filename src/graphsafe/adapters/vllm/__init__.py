"""vLLM adapter: a ``vllm.general_plugins`` plugin that runs graphsafe's contract inside vLLM 0.33's reload.

Installing graphsafe (its ``vllm`` extra pulls the vLLM it supports) registers the entry point; vLLM then calls
:func:`register` in every process.
Configuration is by environment (see ``docs/vllm.md``): ``GRAPHSAFE_MODE`` (``strict``, ``recapture``,
``migrate`` (default) or ``off``), ``GRAPHSAFE_REPORT``, ``GRAPHSAFE_DETECT``, ``GRAPHSAFE_MANIFEST``,
``GRAPHSAFE_RECORD_RELOADS``.
Importing this package does not import vLLM.
"""

from graphsafe.adapters.vllm._guard import HOOK_POINTS, HookMismatchError, HookPoint
from graphsafe.adapters.vllm._pack import PACK, PackEntry, PackResult, StaleEntry, validate_pack
from graphsafe.adapters.vllm._plugin import bind, current_state, register, unregister
from graphsafe.adapters.vllm._state import AdapterConfig, ConfigError
from graphsafe.adapters.vllm._worker import GraphsafeWorkerExtension

__all__ = [
    "HOOK_POINTS",
    "PACK",
    "AdapterConfig",
    "ConfigError",
    "GraphsafeWorkerExtension",
    "HookMismatchError",
    "HookPoint",
    "PackEntry",
    "PackResult",
    "StaleEntry",
    "bind",
    "current_state",
    "register",
    "unregister",
    "validate_pack",
]
