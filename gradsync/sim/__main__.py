"""``python -m gradsync.sim simulate ...``: the simulator's commands without torch.

The ``gradsync`` command also builds the parsers of ``run`` and ``compare``, which import
torch; this entry point builds only ``simulate`` (``bench allreduce`` needs torch when run),
so planning works on a laptop with nothing but numpy (and matplotlib for the sweep plots).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradsync.errors import UsageError
from gradsync.sim.cli import add_parsers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradsync.sim")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
