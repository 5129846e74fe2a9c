"""A worker extension for vLLM's ``worker_extension_cls``: the reload outcome and report over ``collective_rpc``.

``LLM(..., worker_extension_cls="graphsafe.adapters.vllm.GraphsafeWorkerExtension")`` mixes these methods into
every worker; ``llm.collective_rpc("graphsafe_last_outcome")`` then returns one value per rank. Every method
name starts with ``graphsafe_`` because vLLM refuses an extension whose names collide with the worker's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from graphsafe.contract import GraphContract

__all__ = ["GraphsafeWorkerExtension"]


class GraphsafeWorkerExtension:
    """Methods vLLM adds to its worker class; ``self`` is the worker (``self.model_runner`` is vLLM's runner)."""

    model_runner: Any

    @staticmethod
    def init_worker_extension(worker: Any) -> None:
        """vLLM's hook after the worker's device is set: make sure the plugin is on even if ``VLLM_PLUGINS``
        filtered the entry point out (registering twice is a no-op)."""
        from graphsafe.adapters.vllm._plugin import register

        register()

    def _graphsafe_contract(self) -> GraphContract | None:
        from graphsafe.adapters.vllm._plugin import current_state

        state = current_state()
        runner = getattr(self, "model_runner", None)
        model = runner.get_model() if runner is not None else None
        if state is None or not isinstance(model, nn.Module):
            return None
        return state.contracts.get(model)

    def graphsafe_status(self) -> dict[str, Any]:
        """Mode, whether the captured graphs are safe to replay, the hooks in place and stale pack entries."""
        from graphsafe.adapters.vllm._plugin import current_state

        state = current_state()
        if state is None:
            return {"registered": False}
        contract = self._graphsafe_contract()
        return {
            "registered": True,
            "mode": state.config.mode,
            "detect": contract.detect if contract is not None else state.config.detect,
            "sealed": contract.sealed if contract is not None else False,
            "serving_safe": contract.serving_safe if contract is not None else None,
            "unsafe_reason": contract.unsafe_reason if contract is not None else None,
            "reloads": contract.reloads if contract is not None else 0,
            "slots": sum(1 for _ in contract.slots()) if contract is not None else 0,
            "hooks": sorted(state.hooks),
            "unavailable": dict(state.unavailable),
            "pack": state.pack.to_dict() if state.pack is not None else None,
        }

    def graphsafe_last_outcome(self) -> dict[str, Any] | None:
        """The last reload's :class:`~graphsafe.ReloadOutcome` as a dict (``None`` before the first reload)."""
        contract = self._graphsafe_contract()
        outcome = contract.last_outcome if contract is not None else None
        return outcome.to_dict() if outcome is not None else None

    def graphsafe_last_report(self) -> dict[str, Any] | None:
        """The last reload's full report (outcome, migration report, what the adapter did)."""
        from graphsafe.adapters.vllm._plugin import current_state

        state = current_state()
        return state.last_report if state is not None else None

    def graphsafe_recapture(self) -> dict[str, Any]:
        """Capture the graphs again and reseal: the way back to serving-safe after a failed reload."""
        from graphsafe.adapters.vllm._plugin import current_state
        from graphsafe.adapters.vllm._recapture import recapture_runner

        state = current_state()
        contract = self._graphsafe_contract()
        if state is None or contract is None:
            return {"recaptured": False, "why": "graphsafe is not guarding this worker's model"}
        done = recapture_runner(self.model_runner, worker=self, state=state)
        # recapture_runner captured every graph again (its capture hook reported it) or found none to capture
        # (eager mode, no KV cache yet): either way no graph reads the storage of before the failed reload.
        contract.reseal(recaptured=True)
        return {"recaptured": True, "what": done, "serving_safe": contract.serving_safe}
