"""Exceptions users see.

A ``UsageError`` is a mistake in input: the CLI prints it without a traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user: names the bad value and the valid choices."""


class SyncTimeoutError(RuntimeError):
    """A synchronizing wait ran past its timeout; the message says which step, which collective,
    and which ranks never arrived."""


class DivergenceError(RuntimeError):
    """Replicas that must be identical are not."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded; the message says which and why."""
