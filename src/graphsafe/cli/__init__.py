"""The ``graphsafe`` command: ``graphsafe demo`` and ``graphsafe report [TARGET]`` (also ``python -m graphsafe``).

Exit status: 0 clean (or every demo result as expected), 1 findings (or an unexpected demo result), 2 usage
errors (bad arguments, a TARGET that cannot be loaded or reloaded, an output file that cannot be written).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["TargetError", "load_target", "main"]

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

_TARGET_HELP = (
    "'module:callable' (e.g. mypkg.serving:reload_target). Calling it with no arguments returns either an object "
    "with `model` (an nn.Module, already loaded) and `reload(model, seed)` (loads weights made from seed, in "
    "place, then PWAL), optionally `warmup(model)` (one forward), or a tuple (model, reload) or (model, reload, "
    "warmup). Default: the example zoo, legacy variants (graphsafe.cli._demo:legacy_zoo)."
)


class TargetError(Exception):
    """A TARGET that cannot be imported, called or used; the message is one sentence for the user."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _as_target(value: Any, spec: str) -> Any:
    from graphsafe.cli._demo import ReloadTarget

    expected = "expected an object with `model` (nn.Module) and `reload(model, seed)`, or a tuple (model, reload_fn)"
    if isinstance(value, ReloadTarget):
        return value
    warmup: Any = None
    if isinstance(value, tuple):
        if len(value) not in (2, 3):
            raise TargetError(f"{spec}() returned a tuple of {len(value)} item(s); {expected}")
        model, reload = value[0], value[1]
        warmup = value[2] if len(value) == 3 else None
    elif hasattr(value, "model") and hasattr(value, "reload"):
        model, reload, warmup = value.model, value.reload, getattr(value, "warmup", None)
    else:
        raise TargetError(f"{spec}() returned {type(value).__name__}; {expected}")
    if not isinstance(model, nn.Module):
        raise TargetError(f"{spec}() returned a model of type {type(model).__name__}, not an nn.Module; {expected}")
    if not callable(reload):
        raise TargetError(f"{spec}() returned a reload of type {type(reload).__name__}, which is not callable")
    if warmup is not None and not callable(warmup):
        raise TargetError(f"{spec}() returned a warmup of type {type(warmup).__name__}, which is not callable")
    return ReloadTarget(model, reload, warmup)


def load_target(spec: str) -> Any:
    """Import ``module:callable``, call it, and check what it returns (raises :class:`TargetError`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"TARGET {spec!r} is not of the form 'module:callable' (e.g. mypkg.serving:make_target)")
    # A console script's sys.path starts at its bin directory; make the current directory importable as with -m.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"cannot import module {module_name!r} of TARGET {spec!r} ({_first_line(exc)})") from exc
    except Exception as exc:
        raise TargetError(f"importing module {module_name!r} of TARGET {spec!r} raised {_first_line(exc)}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise TargetError(f"module {module_name!r} has no attribute {attr!r} (TARGET {spec!r})") from exc
    if not callable(obj):
        raise TargetError(f"TARGET {spec!r} names an object of type {type(obj).__name__}, which is not callable")
    try:
        value = obj()
    except Exception as exc:
        raise TargetError(f"calling TARGET {spec}() raised {_first_line(exc)}") from exc
    return _as_target(value, spec)


def _run_report(args: argparse.Namespace) -> int:
    from graphsafe.cli._demo import legacy_zoo
    from graphsafe.collectors._manifest import record_capture
    from graphsafe.contract import GraphContract
    from graphsafe.errors import ContractViolation
    from graphsafe.report import migration_report

    spec = args.target or "graphsafe.cli._demo:legacy_zoo"
    try:
        target = load_target(args.target) if args.target else legacy_zoo()
    except TargetError as exc:
        return _usage(str(exc))
    model = target.model
    contract = GraphContract(model, args.mode)
    if args.capture and target.warmup is None:
        return _usage(f"--capture needs a warmup(model) from TARGET {spec!r} to record")
    # Seal right after the load (the contract's documented point), then warm up: tensors the first forward
    # allocates are then known not to come from PWAL, and the report suggests register_derived for them.
    try:
        contract.seal()
        if target.warmup is not None:
            target.warmup(model)
            if args.capture:
                with record_capture(contract):
                    target.warmup(model)
    except Exception as exc:
        return _usage(f"preparing TARGET {spec!r} (seal, warm-up, capture) raised {_first_line(exc)}")
    try:
        with contract.reload():
            target.reload(model, args.seed)
    except ContractViolation:
        pass  # strict mode: the outcome and the report are on the contract
    except Exception as exc:
        return _usage(f"the reload of TARGET {spec!r} raised {_first_line(exc)}")
    report = migration_report(contract)
    rendered = report.render(args.format)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as handle:
                handle.write(rendered)
        except OSError as exc:
            return _usage(f"cannot write the report to {args.output!r} ({_first_line(exc)})")
    else:
        sys.stdout.write(rendered)
    outcome = contract.last_outcome
    problems = len(outcome.problems) if outcome is not None else 0
    status = outcome.status.value if outcome is not None else "none"
    where = f"; written to {args.output}" if args.output else ""
    print(
        f"graphsafe report: reload {status} (mode={args.mode}), {len(report.entries)} undeclared tensor(s), "
        f"{len(report.unowned)} unowned storage(s), {problems} problem(s){where}",
        file=sys.stderr,
    )
    return EXIT_CLEAN if report.clean and problems == 0 else EXIT_FINDINGS


def _run_demo(args: argparse.Namespace) -> int:
    from graphsafe.cli._demo import run_demo
    from graphsafe.testing.zoo import EXAMPLES

    unknown = [name for name in args.examples if name not in EXAMPLES]
    if unknown:
        return _usage(f"unknown example(s) {', '.join(unknown)}: choose from {', '.join(EXAMPLES)}")
    return run_demo(sys.stdout, args.examples or None)


def _usage(message: str) -> int:
    print(f"graphsafe: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    from graphsafe import __version__
    from graphsafe.contract._contract import MODES
    from graphsafe.report import FORMATS

    parser = argparse.ArgumentParser(
        prog="graphsafe",
        description="Hot weight reload that keeps captured CUDA graphs correct.",
        epilog="Exit status: 0 clean, 1 findings, 2 usage errors.",
    )
    parser.add_argument("--version", action="version", version=f"graphsafe {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="reload the example zoo under each mode and show what graphsafe does",
        description="Load the example zoo, seal, reload with new weights under each mode, and print what an "
        "upstream reload would do, what graphsafe did, and the migration report. Exit 0 when every result is "
        "the expected one, 1 otherwise.",
    )
    demo.add_argument("examples", nargs="*", metavar="EXAMPLE", help="only these examples (default: all)")
    demo.set_defaults(run=_run_demo)

    report = commands.add_parser(
        "report",
        help="seal, reload once with other weights, print the migration report",
        description="Seal a contract on TARGET's model, reload once with other weights, and print the migration "
        "report: every undeclared graph-visible tensor and the exact line that declares it. Exit 0 clean, "
        "1 findings, 2 usage errors.",
    )
    report.add_argument("target", nargs="?", metavar="TARGET", help=_TARGET_HELP)
    report.add_argument("--format", "-f", choices=FORMATS, default="text", help="output format (default: text)")
    report.add_argument("--mode", "-m", choices=MODES, default="migrate", help="contract mode (default: migrate)")
    report.add_argument("--seed", type=int, default=1, help="seed passed to reload(model, seed) (default: 1)")
    report.add_argument(
        "--capture",
        action="store_true",
        help="record TARGET's warmup as a capture (CPU stand-in) so storage no layer path holds is reported",
    )
    report.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    report.set_defaults(run=_run_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return run(args)
    except KeyboardInterrupt:
        print("graphsafe: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"graphsafe: internal error ({_first_line(exc)}); this is a bug, the traceback follows", file=sys.stderr)
        traceback.print_exc()
        return EXIT_INTERNAL
