"""``graphsafe report [TARGET]``: seal TARGET's model, reload it once with other weights, print the report."""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from torch import nn

from graphsafe.cli._exit import EXIT_CLEAN, EXIT_FINDINGS, first_line, usage
from graphsafe.cli._target import DEFAULT_TARGET, TargetError, legacy_zoo, load_target
from graphsafe.collectors import record_capture
from graphsafe.contract import GraphContract, version_of
from graphsafe.errors import ContractViolation, NotServingSafeError
from graphsafe.report import MigrationReport, migration_report

__all__ = ["prepare_and_reload", "run_report"]


#: Elements of each parameter and buffer compared before and after the reload (enough to see new weights).
_SAMPLED = 64


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLED)].clone()
    try:
        return sample.view(torch.uint8)  # bytes: NaN equals NaN, any changed bit is a write
    except RuntimeError:  # a dtype with no byte view: its values
        return sample


def _state(model: nn.Module) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """Each parameter and buffer with its version counter and a strided sample of its bytes."""
    tensors = [*model.parameters(), *model.buffers()]
    return [(t, version_of(t), _sample(t)) for t in tensors if t.device.type != "meta" and t.numel() > 0]


def _loaded_nothing(before: list[tuple[torch.Tensor, int, torch.Tensor]]) -> bool:
    """Whether no parameter or buffer was written since ``before``: after a reload that loaded nothing the report
    cannot tell what follows the weights (it would call a weight-derived tensor static)."""
    return bool(before) and all(
        version_of(tensor) == version and torch.equal(_sample(tensor), sample) for tensor, version, sample in before
    )


def run_report(args: argparse.Namespace) -> int:
    """Run ``graphsafe report`` with parsed ``args``; the exit status."""
    # Only the report goes to stdout (``-f json | jq``): what TARGET prints (progress, logs) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        prepared = prepare_and_reload(args)
    if isinstance(prepared, int):
        return prepared
    contract, model = prepared  # the contract holds its model weakly: keep it alive until the report is made
    status = _print_report(args, contract, migration_report(contract))
    del model
    return status


def prepare_and_reload(args: argparse.Namespace) -> tuple[GraphContract, nn.Module] | int:
    """Load TARGET, seal, warm up, reload once: the contract and its model, or the exit status of a usage error."""
    spec = args.target or DEFAULT_TARGET
    try:
        target = load_target(args.target) if args.target else legacy_zoo()
    except TargetError as exc:
        return usage(str(exc))
    model = target.model
    contract = GraphContract(model, args.mode)
    # ``None`` (graphsafe fix): record the warmup as a capture whenever TARGET has one (the fixes are then the
    # ones made for what the graph really reads and writes).
    capture = target.warmup is not None if args.capture is None else args.capture
    if capture and target.warmup is None:
        return usage(f"--capture needs a warmup(model) from TARGET {spec!r} to record")
    # Seal right after the load (the contract's documented point), then warm up: tensors the first forward
    # allocates are then known not to come from PWAL, and the report suggests register_derived for them.
    try:
        contract.seal()
        if target.warmup is not None:
            target.warmup(model)
            if capture:
                with record_capture(contract):
                    target.warmup(model)
    except Exception as exc:
        return usage(f"preparing TARGET {spec!r} (seal, warm-up, capture) raised {first_line(exc)}")
    before = _state(model)
    try:
        with contract.reload():
            target.reload(model, args.seed)
    except NotServingSafeError as exc:  # refused at begin(): the reload never ran, so there is nothing to report
        return usage(f"the contract refused to reload TARGET {spec!r} ({first_line(exc)})")
    except ContractViolation:
        pass  # strict mode: the outcome and the report are on the contract
    except Exception as exc:
        return usage(f"the reload of TARGET {spec!r} raised {first_line(exc)}")
    if _loaded_nothing(before):
        return usage(
            f"the reload of TARGET {spec!r} changed no parameter or buffer: reload(model, seed) must load weights "
            "made from seed into the model it is given (then run PWAL); without new weights the report cannot "
            "tell what follows them"
        )
    return contract, model


def _print_report(args: argparse.Namespace, contract: GraphContract, report: MigrationReport) -> int:
    rendered = report.render(args.format)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as handle:
                handle.write(rendered)
        except OSError as exc:
            return usage(f"cannot write the report to {args.output!r} ({first_line(exc)})")
    else:
        sys.stdout.write(rendered)
    outcome = contract.last_outcome
    problems = len(outcome.problems) if outcome is not None else 0
    # The enum's value is its documented spelling (``needs_recapture``); used for the message only.
    status = outcome.status.value if outcome is not None else "none"
    where = f"; written to {args.output}" if args.output else ""
    print(
        f"graphsafe report: reload {status} (mode={args.mode}), {len(report.entries)} undeclared tensor(s), "
        f"{len(report.unowned)} unowned storage(s), {problems} problem(s){where}",
        file=sys.stderr,
    )
    return EXIT_CLEAN if report.clean and problems == 0 else EXIT_FINDINGS
