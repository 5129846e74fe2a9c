"""Exit statuses of the ``graphsafe`` command, and the one-sentence form of its errors."""

from __future__ import annotations

import sys

__all__ = ["EXIT_CLEAN", "EXIT_FINDINGS", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_USAGE", "first_line", "usage"]

#: Clean (``demo``: every result as expected).
EXIT_CLEAN = 0
#: Findings (``demo``: an unexpected result).
EXIT_FINDINGS = 1
#: Bad arguments, a TARGET that cannot be used, an output file that cannot be written.
EXIT_USAGE = 2
#: A bug in graphsafe.
EXIT_INTERNAL = 3
#: Ctrl-C, as a shell reports SIGINT.
EXIT_INTERRUPTED = 130


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: an exception in one line, for a one-sentence error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def usage(message: str) -> int:
    """Print ``graphsafe: error: message`` (one line on stderr) and return :data:`EXIT_USAGE`."""
    print(f"graphsafe: error: {message}", file=sys.stderr)
    return EXIT_USAGE
