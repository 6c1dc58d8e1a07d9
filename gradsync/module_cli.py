"""Standalone entry points for one module's subcommands (``python -m gradsync.sim ...``).

The ``gradsync`` command builds every subcommand's parser (and ``run``'s imports torch); a
module that can stand alone exposes only its own through this, with the CLI's convention for
usage errors: one line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.errors import UsageError


def run_commands(
    prog: str, add_parsers: Callable[[Any], None], argv: Sequence[str] | None = None
) -> int:
    parser = argparse.ArgumentParser(prog=prog)
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, where a reader gone away is caught, not at exit
        return status
    except UsageError as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return closed_pipe()


def closed_pipe() -> int:
    """The reader of stdout went away (``gradsync report --json | head``): as for any Unix
    filter, not an error worth a traceback. stdout is pointed at /dev/null so that Python's
    flush at exit does not raise the same error again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE, what a shell reports for a filter killed by it
