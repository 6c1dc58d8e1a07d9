"""Standalone entry points for one module's subcommands (``python -m gradsync.sim ...``).

The ``gradsync`` command builds every subcommand's parser (and ``run``'s imports torch); a
module that can stand alone exposes only its own through this, with the CLI's convention for
usage errors: one line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
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
        return int(args.func(args))
    except UsageError as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
