"""The ``graphsafe`` command: ``graphsafe demo``, ``graphsafe report [TARGET]`` and ``graphsafe fix TARGET`` (also
``python -m graphsafe``).

Exit status: 0 clean (or every demo result as expected, or nothing to fix), 1 findings (or an unexpected demo
result, or changes proposed or made), 2 usage errors (bad arguments, a TARGET that cannot be loaded or reloaded, an
output file that cannot be written, a source file graphsafe fix must not edit), 3 a bug.

Besides :func:`main`, the names a TARGET or a script may want: :class:`ReloadTarget` (what a TARGET may return),
:func:`load_target`, the zoo targets :func:`legacy_zoo` and :func:`migrated_zoo`, :func:`run_demo`, and
:func:`upstream_harm` (the demo's measured harm of a plain reload, :class:`Harm`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from graphsafe._version import __version__
from graphsafe.cli._demo import Harm, run_demo, upstream_harm
from graphsafe.cli._exit import EXIT_CLEAN, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE, first_line, usage
from graphsafe.cli._fix_command import run_fix
from graphsafe.cli._report_command import run_report
from graphsafe.cli._target import (
    TARGET_HELP,
    ReloadTarget,
    TargetError,
    legacy_zoo,
    load_target,
    migrated_zoo,
    zoo_target,
)
from graphsafe.contract import MODES
from graphsafe.report import FORMATS
from graphsafe.testing.zoo import EXAMPLES

__all__ = [
    "Harm",
    "ReloadTarget",
    "TargetError",
    "legacy_zoo",
    "load_target",
    "main",
    "migrated_zoo",
    "run_demo",
    "upstream_harm",
    "zoo_target",
]


def _run_demo(args: argparse.Namespace) -> int:
    unknown = [name for name in args.examples if name not in EXAMPLES]
    if unknown:
        return usage(f"unknown example(s) {', '.join(unknown)}: choose from {', '.join(EXAMPLES)}")
    return run_demo(sys.stdout, args.examples or None, verbose=args.verbose)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (``graphsafe: error: ...``) and exit 2.

    argparse's own ``error()`` prints the whole usage first; subcommand parsers are made of this class too.
    """

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("graphsafe").strip()
        where = f"{command}: " if command else ""
        hint = f"see 'graphsafe {command} --help'" if command else "see 'graphsafe --help'"
        self.exit(EXIT_USAGE, f"graphsafe: error: {where}{' '.join(message.split())} ({hint})\n")


def _choice(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """An argparse ``type`` that accepts ``choices`` in any case (``-f JSON`` is ``-f json``)."""

    def parse(text: str) -> str:
        folded = text.strip().lower()
        if folded not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}: choose one of {', '.join(choices)}")
        return folded

    parse.__name__ = what
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    demo.add_argument(
        "-v", "--verbose", action="store_true", help="print the full matrix: every example under every mode"
    )
    demo.set_defaults(run=_run_demo)

    report = commands.add_parser(
        "report",
        help="seal, reload once with other weights, print the migration report",
        description="Seal a contract on TARGET's model, reload once with other weights, and print the migration "
        "report: every undeclared graph-visible tensor and the exact line that declares it. Exit 0 clean, "
        "1 findings, 2 usage errors.",
    )
    report.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    report.add_argument(
        "--format",
        "-f",
        type=_choice(FORMATS, "format"),
        default="text",
        metavar="{" + ",".join(FORMATS) + "}",
        help="output format, any case (default: text)",
    )
    report.add_argument(
        "--mode",
        "-m",
        type=_choice(MODES, "mode"),
        default="migrate",
        metavar="{" + ",".join(MODES) + "}",
        help="contract mode, any case (default: migrate)",
    )
    report.add_argument("--seed", type=int, default=1, help="seed passed to reload(model, seed) (default: 1)")
    report.add_argument(
        "--capture",
        action="store_true",
        help="record TARGET's warmup as a capture (CPU stand-in) so storage no layer path holds is reported",
    )
    report.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    report.set_defaults(run=run_report)

    fix = commands.add_parser(
        "fix",
        help="apply the migration report to the source of the classes it names (a diff; --write applies it)",
        description="Make the migration report of TARGET (as graphsafe report does, recording TARGET's warmup as "
        "a capture when it has one) and write its fixes into the source of the classes it names, keeping "
        "formatting and comments (needs LibCST: pip install 'graphsafe[fix]'). Prints a unified diff and writes "
        "nothing unless --write; a fix it cannot place is listed on stderr with the report's text. Exit 0 nothing "
        "to do, 1 changes proposed or made (or left to place by hand), 2 usage errors.",
    )
    fix.add_argument("target", metavar="TARGET", help=TARGET_HELP.split(" Default:")[0])
    fix.add_argument("--write", action="store_true", help="write the changes (every file or none)")
    fix.add_argument(
        "--mode",
        "-m",
        type=_choice(MODES, "mode"),
        default="migrate",
        metavar="{" + ",".join(MODES) + "}",
        help="contract mode of the report's reload, any case (default: migrate)",
    )
    fix.add_argument("--seed", type=int, default=1, help="seed passed to reload(model, seed) (default: 1)")
    fix.set_defaults(run=run_fix, capture=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version (0) and usage errors (2, one line already printed)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        return usage(
            "no command given: run 'graphsafe demo', 'graphsafe report TARGET' or 'graphsafe fix TARGET' "
            "(see 'graphsafe --help')"
        )
    try:
        return run(args)
    except KeyboardInterrupt:
        print("graphsafe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `graphsafe demo | head`: the reader left; not a bug, and nothing more to say
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter flushes stdout at exit
        return EXIT_CLEAN
    except Exception as exc:
        print(f"graphsafe: internal error ({first_line(exc)}); this is a bug, the traceback follows", file=sys.stderr)
        traceback.print_exc()
        return EXIT_INTERNAL
