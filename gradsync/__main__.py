"""``python -m gradsync``: the ``gradsync`` command, where its script is not on PATH (a venv not
activated). It imports the CLI only, which imports torch only for a command that needs it."""

from __future__ import annotations

import sys

from gradsync.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
