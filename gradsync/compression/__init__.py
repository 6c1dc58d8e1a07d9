"""Gradient compression: how many bytes each exchange puts on the wire.

``parse_compression("powersgd:4")`` gives a :class:`Compressor`: ``make_state(group)`` builds the
per-run state (``bytes_sent``, ``state_dict()``), and ``hook(state, bucket)`` returns a future of
the mean over ranks of ``bucket.buffer()``, bitwise identical on every rank. The same pair plugs
into DDP through :func:`ddp_comm_hook`. See docs/compression.md.

Each family's module (fp, int8, int4, sign, sparse, sparseloco, powersgd, allreduce) holds
its hook and its codec (``Compressor.codec``: the encode/decode of a flat tensor, see
``base.Codec``); the hook uses the codec, and parameter-server pushes
(``push.make_push_codec``) frame the same codec, so adding a compressor means writing one
module. ``errorfeedback`` wraps any of them (sparseloco keeps its own decaying accumulator).
"""

from gradsync.compression.allreduce import ALLREDUCE, AllReduceState, allreduce_hook
from gradsync.compression.base import BucketLike, Compressor, CompressorState, FlatBucket, Hook
from gradsync.compression.ddp_hook import ddp_comm_hook
from gradsync.compression.errorfeedback import ErrorFeedbackState, error_feedback
from gradsync.compression.fp import BF16, FP16
from gradsync.compression.int8 import int8
from gradsync.compression.powersgd import powersgd
from gradsync.compression.sign import sign
from gradsync.compression.sparse import randomk, topk
from gradsync.compression.spec import VALID_FORMS, parse_compression

__all__ = [
    "ALLREDUCE",
    "BF16",
    "FP16",
    "VALID_FORMS",
    "AllReduceState",
    "BucketLike",
    "Compressor",
    "CompressorState",
    "ErrorFeedbackState",
    "FlatBucket",
    "Hook",
    "allreduce_hook",
    "ddp_comm_hook",
    "error_feedback",
    "int8",
    "parse_compression",
    "powersgd",
    "randomk",
    "sign",
    "topk",
]
