"""Compression spec strings: valid forms parse to the right compressor, bad ones fail clearly."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gradsync.compression as compression
from gradsync.compression import (
    ALLREDUCE,
    VALID_FORMS,
    ErrorFeedbackState,
    ddp_comm_hook,
    parse_compression,
    topk,
)
from gradsync.compression.fp import CastState
from gradsync.compression.int8 import Int8State
from gradsync.compression.powersgd import PowerSGDState
from gradsync.compression.sparse import RandomKState
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("spec", "canonical", "inner", "feedback"),
    [
        ("fp16", "fp16", CastState, False),
        ("BF16", "bf16", CastState, False),
        ("int8", "int8", Int8State, False),
        (" topk:0.01 ", "topk:0.01", None, True),
        ("randomk:0.5", "randomk:0.5", RandomKState, False),
        ("sign", "sign", None, True),
        ("powersgd:4", "powersgd:4", PowerSGDState, True),
        ("topk:1", "topk:1.0", None, True),
    ],
)
def test_valid_specs(spec: str, canonical: str, inner: type | None, feedback: bool) -> None:
    c = parse_compression(spec)
    assert c.spec == canonical
    state = c.make_state(None)
    assert isinstance(state, ErrorFeedbackState) == feedback
    if inner is not None:
        assert isinstance(state.inner if feedback else state, inner)
    assert state.bytes_sent == 0


def test_none_and_objects_pass_through() -> None:
    assert parse_compression(None) is ALLREDUCE
    assert parse_compression("none") is ALLREDUCE
    custom = topk(0.2)
    assert parse_compression(custom) is custom


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("topk:0", "0"),
        ("topk:1.5", "1.5"),
        ("topk:-0.1", "-0.1"),
        ("topk:nan", "nan"),
        ("topk", "fraction"),
        ("randomk:abc", "abc"),
        ("powersgd:0", "0"),
        ("powersgd:1.5", "1.5"),
        ("powersgd", "rank"),
        ("int3", "int3"),
        ("fp16:2", "no argument"),
        ("", "''"),
    ],
)
def test_bad_specs_name_the_value_and_the_valid_forms(spec: str, names: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_compression(spec)
    message = str(err.value)
    assert repr(spec) in message and names in message
    assert VALID_FORMS in message
    assert isinstance(err.value, ValueError)  # the API promises ValueError for bad specs


def test_a_non_string_spec_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="got int"):
        parse_compression(4)  # type: ignore[arg-type]


def test_ddp_comm_hook_rejects_a_bad_spec_before_touching_ddp() -> None:
    with pytest.raises(UsageError, match="powersgd:0"):
        ddp_comm_hook("powersgd:0")


@given(st.floats(min_value=1e-6, max_value=1.0))
def test_every_fraction_in_range_parses_and_round_trips(fraction: float) -> None:
    for family in ("topk", "randomk"):
        c = parse_compression(f"{family}:{fraction!r}")
        assert parse_compression(c.spec).spec == c.spec
        assert float(c.spec.split(":")[1]) == fraction


def test_public_api_is_frozen() -> None:
    assert sorted(compression.__all__) == sorted(
        [
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
    )
    for name in compression.__all__:
        assert hasattr(compression, name), name


def test_small_randomk_fractions_warn_and_larger_ones_do_not() -> None:
    with pytest.warns(UserWarning, match=r"randomk:0\.01: .*scaled by n/k \(about 100\)"):
        parse_compression("randomk:0.01")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_compression("randomk:0.1")
        parse_compression("topk:0.01")
