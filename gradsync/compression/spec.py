"""Compression spec strings, shared by the API and the CLI: ``"powersgd:4"`` -> a Compressor."""

from __future__ import annotations

import math

from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import Compressor
from gradsync.compression.errorfeedback import error_feedback
from gradsync.compression.fp import BF16, FP16
from gradsync.compression.int8 import int8
from gradsync.compression.powersgd import powersgd
from gradsync.compression.sign import sign
from gradsync.compression.sparse import randomk, topk
from gradsync.errors import UsageError

VALID_FORMS = (
    "none, fp16, bf16, int8, sign, topk:FRACTION, randomk:FRACTION (0 < FRACTION <= 1), "
    "powersgd:RANK (integer >= 1)"
)

_NO_ARGUMENT = ("none", "fp16", "bf16", "int8", "sign")


def _bad(spec: str, reason: str) -> UsageError:
    return UsageError(f"invalid compression spec {spec!r}: {reason}; valid forms: {VALID_FORMS}")


def _fraction(spec: str, name: str, arg: str) -> float:
    if not arg:
        raise _bad(spec, f"{name} needs a fraction, as in {name}:0.01")
    try:
        fraction = float(arg)
    except ValueError:
        raise _bad(spec, f"fraction {arg!r} is not a number") from None
    if math.isnan(fraction) or not 0.0 < fraction <= 1.0:
        raise _bad(spec, f"fraction {arg} is outside (0, 1]")
    return fraction


def _rank(spec: str, arg: str) -> int:
    if not arg:
        raise _bad(spec, "powersgd needs a rank, as in powersgd:4")
    try:
        rank = int(arg)
    except ValueError:
        raise _bad(spec, f"rank {arg!r} is not an integer") from None
    if rank < 1:
        raise _bad(spec, f"rank {arg} must be at least 1")
    return rank


def parse_compression(spec: str | Compressor | None) -> Compressor:
    """A Compressor from a spec string; None and ``"none"`` give the plain all-reduce.

    The biased compressors (``topk``, ``sign``, ``powersgd``) come wrapped in error feedback;
    ``int8`` and ``randomk`` are unbiased and ``fp16``/``bf16`` only round, so they do not.
    A Compressor object passes through unchanged. Raises ``UsageError`` naming the bad value
    and ``VALID_FORMS``.
    """
    if spec is None:
        return ALLREDUCE
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise UsageError(
            f"compression must be a spec string, a Compressor or None, got {type(spec).__name__}"
            f" {spec!r}; valid forms: {VALID_FORMS}"
        )
    name, colon, arg = spec.strip().lower().partition(":")
    arg = arg.strip()
    if name in _NO_ARGUMENT:
        if colon:
            raise _bad(spec, f"{name} takes no argument")
        if name == "none":
            return ALLREDUCE
        if name == "fp16":
            return FP16
        if name == "bf16":
            return BF16
        if name == "int8":
            return int8()
        return error_feedback(sign())
    if name == "topk":
        return error_feedback(topk(_fraction(spec, name, arg)))
    if name == "randomk":
        return randomk(_fraction(spec, name, arg))
    if name == "powersgd":
        return error_feedback(powersgd(_rank(spec, arg)))
    raise _bad(spec, f"unknown compressor {name!r}")
