"""The ``vllm.general_plugins`` entry point: ``register()`` turns graphsafe on inside every vLLM process.

vLLM calls general plugins in every process it starts (API server, engine core, workers), possibly more than
once, so ``register()`` is idempotent: the first call checks the installed vLLM, installs the hooks and applies
the declarations pack; later calls only pick up a changed environment (``GRAPHSAFE_MODE=off`` removes the hooks).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from torch import nn

from graphsafe.adapters.vllm import _session
from graphsafe.adapters.vllm._hooks import HookSet
from graphsafe.adapters.vllm._state import AdapterConfig, AdapterState

__all__ = ["bind", "current_state", "register", "unregister"]

log = logging.getLogger("graphsafe.vllm")

_LOCK = threading.Lock()
_STATE: AdapterState | None = None
_HOOKS: HookSet | None = None
_SAID_OFF = False


def _say_off_once(line: str) -> None:
    """Log why the plugin stays off, once per process (vLLM calls ``register()`` several times)."""
    global _SAID_OFF
    if not _SAID_OFF:
        _SAID_OFF = True
        log.warning("%s", line)


def current_state() -> AdapterState | None:
    """The adapter's state in this process (``None`` until ``register()`` installed the hooks)."""
    return _STATE if _HOOKS is not None else None


def register() -> AdapterState | None:
    """Install graphsafe into the running vLLM according to ``GRAPHSAFE_*``; returns the state (``None`` if off).

    An installed vLLM that is not 0.32.x or 0.33.x, or lacks a hook point: with ``GRAPHSAFE_MODE`` unset the
    plugin stays off (one log line says why) and vLLM serves as it would without graphsafe; with a mode set,
    :class:`~graphsafe.adapters.vllm.HookMismatchError` (the operator asked for graphsafe). Raises
    :class:`~graphsafe.adapters.vllm.ConfigError` for a bad variable.
    """
    global _STATE, _HOOKS
    config = AdapterConfig.from_env()
    with _LOCK:
        if not config.enabled:
            if _HOOKS is not None:
                _HOOKS.uninstall()
                _HOOKS = None
            return None
        if _STATE is not None and _HOOKS is not None:
            _STATE.config = config  # the hooks read the configuration at call time
            for contract in _STATE.contracts.values():
                assert config.mode != "off"
                contract.mode = config.mode
                if contract.detect != config.detect:  # its slots were classified under its own policy
                    log.warning(
                        "graphsafe: GRAPHSAFE_DETECT=%s applies to models sealed from now on; the %s contract keeps "
                        "detect=%s (a contract's policy is fixed when it is made)",
                        config.detect,
                        type(contract.model).__name__,
                        contract.detect,
                    )
            return _STATE
        from graphsafe.adapters.vllm import _guard, _pack
        from graphsafe.adapters.vllm._hooks import install

        version = str(_guard.vllm_module("vllm").__version__)
        try:
            _guard.check_version(version)
            resolved, unavailable = _guard.resolve_all()
        except _guard.HookMismatchError as exc:
            if config.explicit:
                raise  # the operator asked for graphsafe: refuse to serve without it
            _say_off_once(f"graphsafe: off, GRAPHSAFE_MODE is unset and this vLLM is not supported: {exc}")
            return None
        state = _STATE if _STATE is not None else AdapterState(config)
        state.config = config
        hooks = install(state, resolved)
        state.pack = _pack.apply_pack(_pack.PACK, hooks.patch)
        state.hooks = {name: hook.point.module for name, hook in resolved.items()}
        state.unavailable = unavailable
        _STATE, _HOOKS = state, hooks
    for stale in state.pack.stale:
        log.warning("graphsafe: stale declarations-pack entry %s: %s", stale.entry.name, stale.reason)
    log.info(
        "graphsafe: vLLM %s guarded (mode=%s, %d hooks, %d pack entries, %d stale)",
        version,
        config.mode,
        hooks.count,
        len(state.pack.applied),
        len(state.pack.stale),
    )
    return state


def unregister() -> None:
    """Remove every hook and pack wrapper and forget the state (for tests and embedding)."""
    global _STATE, _HOOKS
    with _LOCK:
        if _HOOKS is not None:
            _HOOKS.uninstall()
        _STATE, _HOOKS = None, None


def bind(model: nn.Module, runner: Any = None, worker: Any = None) -> None:
    """Bind a model loaded outside vLLM's runner to the runner (and worker) that captures its graphs, so a
    ``NEEDS_RECAPTURE`` reload can recapture them. vLLM's own runners are bound automatically."""
    state = current_state()
    if state is None:
        raise RuntimeError("graphsafe's vLLM plugin is not registered in this process (GRAPHSAFE_MODE=off?)")
    _session.bind(state, model, runner=runner, worker=worker)
