"""``python -m gradsync.sim simulate ...``: the simulator's commands without torch.

The ``gradsync`` command also builds the parsers of ``run`` and ``compare``, which import
torch; this entry point builds only ``simulate`` (``bench allreduce`` needs torch when run),
so planning works on a laptop with nothing but numpy (and matplotlib for the sweep plots).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradsync.module_cli import run_commands
from gradsync.sim.cli import add_parsers


def main(argv: Sequence[str] | None = None) -> int:
    return run_commands("python -m gradsync.sim", add_parsers, argv)


if __name__ == "__main__":
    sys.exit(main())
