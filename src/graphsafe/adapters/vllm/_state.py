"""The adapter's configuration (from the environment) and its per-process state.

This is the one place the vLLM adapter keeps state: which contract guards which model, which reload is open on
which model, which model runner and worker own a model (for recapture), and the last outcome and report. Models,
layers, runners and workers are held weakly, so the adapter never keeps a torn-down engine alive.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from torch import nn

from graphsafe.contract import DETECT_POLICIES, RECORD_POLICIES, Detect, GraphContract, Record, ReloadTransaction
from graphsafe.outcome import ReloadOutcome

__all__ = [
    "ENV_DETECT",
    "ENV_FIX_NONPERSISTENT",
    "ENV_MANIFEST",
    "ENV_MODE",
    "ENV_RECORD_RELOADS",
    "ENV_REPORT",
    "MODES",
    "AdapterConfig",
    "AdapterState",
    "ConfigError",
    "Session",
]

AdapterMode = Literal["strict", "recapture", "migrate", "off"]
MODES: tuple[str, ...] = ("strict", "recapture", "migrate", "off")

ENV_MODE = "GRAPHSAFE_MODE"
ENV_REPORT = "GRAPHSAFE_REPORT"
ENV_DETECT = "GRAPHSAFE_DETECT"
ENV_FIX_NONPERSISTENT = "GRAPHSAFE_FIX_NONPERSISTENT"
ENV_MANIFEST = "GRAPHSAFE_MANIFEST"
ENV_RECORD_RELOADS = "GRAPHSAFE_RECORD_RELOADS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class ConfigError(SystemExit):
    """An environment variable of the adapter holds a value it does not understand.

    A :class:`SystemExit`: vLLM calls the plugin in every process it starts, and a setting it cannot use stops that
    process with one line on stderr that names the variable and what to set, not a traceback through vLLM's start-up.
    Code that reads the configuration itself (:meth:`AdapterConfig.from_env`) catches it by this class.
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"graphsafe: {message}")

    def __str__(self) -> str:
        return str(self.code)


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = environ.get(name, default).strip().lower() or default
    if raw not in choices:
        raise ConfigError(f"{name}={environ[name]!r}: choose one of {', '.join(choices)}")
    return raw


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={environ[name]!r}: expected one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """How the plugin behaves in this process; read from the environment by :meth:`from_env`.

    ``mode`` is the contract mode (``off`` installs nothing), ``explicit`` whether the operator set
    ``GRAPHSAFE_MODE`` (an unsupported vLLM then refuses to start instead of running without graphsafe),
    ``report_path`` where the JSON report of each reload goes (``{rank}`` is replaced by the global rank),
    ``detect`` the collector policy, ``record_manifest`` whether vLLM's graph captures are recorded into the
    contract's manifest, and ``record_reloads`` which reloads record the load and PWAL
    (:attr:`GraphContract.record_reloads <graphsafe.GraphContract.record_reloads>`).
    """

    mode: AdapterMode = "migrate"
    report_path: str | None = None
    detect: Detect = "every-reload"
    record_manifest: bool = False
    record_reloads: Record = "every"
    explicit: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AdapterConfig:
        """The configuration the ``GRAPHSAFE_*`` variables describe; :class:`ConfigError` names a bad one."""
        env = os.environ if environ is None else environ
        explicit = bool(env.get(ENV_MODE, "").strip())
        mode = _choice(env, ENV_MODE, MODES, "migrate")
        detect = _choice(env, ENV_DETECT, DETECT_POLICIES, "every-reload")
        record = _choice(env, ENV_RECORD_RELOADS, RECORD_POLICIES, "every")
        report = env.get(ENV_REPORT, "").strip() or None
        if _flag(env, ENV_FIX_NONPERSISTENT):
            raise ConfigError(
                f"{ENV_FIX_NONPERSISTENT} was removed: it copied into non-persistent buffers memory that vLLM's "
                "post-load step never wrote (garbage reported as committed); unset it. vLLM keeps those buffers "
                "as they were computed at the first load."
            )
        return cls(
            mode=cast(AdapterMode, mode),
            report_path=report,
            detect=cast(Detect, detect),
            record_manifest=_flag(env, ENV_MANIFEST),
            record_reloads=cast(Record, record),
            explicit=explicit,
        )

    @property
    def enabled(self) -> bool:
        """Whether the plugin does anything at all."""
        return self.mode != "off"


@dataclass(slots=True)
class Session:
    """One reload of one model under its contract, from ``initialize_layerwise_reload`` to finalize."""

    model_ref: weakref.ReferenceType[nn.Module]
    contract: GraphContract
    txn: ReloadTransaction
    #: ids of modules already snapshotted (a parent's ``before_layer`` covers its whole subtree).
    seen: set[int] = field(default_factory=set)
    #: layers whose restore waits for finalize, because a module under them was still loading.
    deferred: list[str] = field(default_factory=list)
    layers_processed: int = 0


class AdapterState:
    """Everything the adapter tracks in one process (one per process, made by ``register()``)."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.contracts: weakref.WeakKeyDictionary[nn.Module, GraphContract] = weakref.WeakKeyDictionary()
        self.sessions: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()
        #: layer -> the open session of the model it belongs to (filled as layers are snapshotted).
        self.layer_sessions: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()
        #: model -> weak reference to the vLLM model runner that captured its graphs.
        self.runners: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        #: model -> weak reference to the vLLM worker that owns the runner.
        self.workers: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        #: the session whose ``initialize_layerwise_reload`` is running (layers go to meta one by one in it).
        self.initializing: Session | None = None
        #: set while the adapter itself re-captures, so the capture hook does not reseal twice.
        self.recapturing = False
        self.last_outcome: ReloadOutcome | None = None
        self.last_report: dict[str, Any] | None = None
        #: the hook points found in the installed vLLM (filled by the guard).
        self.hooks: dict[str, str] = {}
        #: integration points that could not be imported on this platform, with why.
        self.unavailable: dict[str, str] = {}
        #: the declarations pack's validation (filled by ``register()``).
        self.pack: Any = None
        #: vLLM schedulers alive in this process (an engine core's), for the in-flight check of a recapture.
        self.schedulers: weakref.WeakSet[Any] = weakref.WeakSet()

    def runner_of(self, model: nn.Module) -> Any:
        """The model runner bound to ``model``, or ``None``."""
        ref = self.runners.get(model)
        return ref() if ref is not None else None

    def worker_of(self, model: nn.Module) -> Any:
        """The worker bound to ``model``, or ``None``."""
        ref = self.workers.get(model)
        return ref() if ref is not None else None
