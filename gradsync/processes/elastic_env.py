"""What torch's elastic agent tells each worker it starts about restarts, read in one place.

``TORCHELASTIC_RESTART_COUNT`` (which attempt of the run this worker belongs to) was parsed in
four places that disagreed on a bad value: one took it for 0, one for "no restarts left" and
two raised Python's own ``ValueError``. The agent itself always writes a count; a bad one was
set by hand, and every reader now refuses it with the same message.
"""

from __future__ import annotations

import os

from gradsync.errors import UsageError

#: the restart count the elastic agent gives each worker it starts (0: the first attempt)
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
#: how many restarts the agent was allowed (torchrun's and ``gradsync run``'s --max-restarts)
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


def _count(variable: str) -> int:
    text = os.environ.get(variable) or "0"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(
            f"{variable}={text!r} is not a count of restarts: torch's elastic agent sets it to "
            "an integer >= 0 for each worker it starts; unset it, or set it to one"
        )
    return value


def restart_count() -> int:
    """Which attempt of the run this process belongs to (0: the first, or outside an agent);
    ``UsageError`` for a value that is not an integer >= 0."""
    return _count(RESTART_COUNT_ENV)


def max_restarts() -> int:
    """How many restarts the agent may make (0 outside an agent); ``UsageError`` as above."""
    return _count(MAX_RESTARTS_ENV)


__all__ = ["MAX_RESTARTS_ENV", "RESTART_COUNT_ENV", "max_restarts", "restart_count"]
