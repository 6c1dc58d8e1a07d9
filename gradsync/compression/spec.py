"""Compression spec strings, shared by the API and the CLI: ``"powersgd:4"`` -> a Compressor.

``gradsync.spec`` parses the string (and words every message about a bad one); this module only
maps the parsed kind to the compressor it names.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import Compressor
from gradsync.compression.errorfeedback import error_feedback
from gradsync.compression.fp import BF16, FP16
from gradsync.compression.int4 import int4
from gradsync.compression.int8 import int8
from gradsync.compression.powersgd import powersgd
from gradsync.compression.sign import sign
from gradsync.compression.sparse import randomk, topk
from gradsync.compression.sparseloco import sparseloco
from gradsync.spec import COMPRESSION_FORMS, CompressionSpec, parse_compression_spec

#: The valid compression spec forms (``gradsync.spec.COMPRESSION_FORMS``).
VALID_FORMS = COMPRESSION_FORMS


def _fraction(spec: CompressionSpec) -> float:
    assert isinstance(spec.argument, float), spec
    return spec.argument


def _rank(spec: CompressionSpec) -> int:
    assert isinstance(spec.argument, int), spec
    return spec.argument


def _options(spec: CompressionSpec) -> tuple[float, int, float]:
    assert isinstance(spec.argument, tuple), spec
    return spec.argument


#: kind -> the Compressor it names, for every kind in ``gradsync.spec.COMPRESSION_TABLE``.
BUILDERS: dict[str, Callable[[CompressionSpec], Compressor]] = {
    "none": lambda _: ALLREDUCE,
    "fp16": lambda _: FP16,
    "bf16": lambda _: BF16,
    "int8": lambda _: int8(),
    "int4": lambda _: error_feedback(int4()),
    "sign": lambda _: error_feedback(sign()),
    "topk": lambda s: error_feedback(topk(_fraction(s))),
    "randomk": lambda s: randomk(_fraction(s)),
    "powersgd": lambda s: error_feedback(powersgd(_rank(s))),
    "sparseloco": lambda s: sparseloco(*_options(s)),
}


def parse_compression(spec: str | Compressor | None) -> Compressor:
    """A Compressor from a spec string; None and ``"none"`` give the plain all-reduce.

    The biased compressors (``int4``, ``topk``, ``sign``, ``powersgd``) come wrapped in error
    feedback; ``int8`` and ``randomk`` are unbiased and ``fp16``/``bf16`` only round, so they
    do not; ``sparseloco`` keeps its own decaying accumulator (``local:H``/``diloco:H`` only).
    A Compressor object passes through unchanged. Raises ``UsageError`` naming the bad value
    and ``VALID_FORMS``.
    """
    if isinstance(spec, Compressor):
        return spec
    parsed = parse_compression_spec(spec)
    return BUILDERS[parsed.kind](parsed)
