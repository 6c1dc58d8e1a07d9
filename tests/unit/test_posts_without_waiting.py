"""Which compressors let streaming DiLoCo post an exchange once the step gate has opened: those
whose hook waits for none of its collectives (``Compressor.posts_without_waiting``). One that
waits would hold the rank that posted first until the last has posted."""

from __future__ import annotations

import pytest

from gradsync.compression.spec import parse_compression

pytestmark = pytest.mark.unit

RETURNS_AT_ONCE = ("none", "fp16", "bf16", "int8", "int4", "sign", "topk:0.1", "randomk:0.1")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", RETURNS_AT_ONCE + ("sparseloco",))
def test_compressors_whose_hook_waits_for_nothing_say_so(spec: str) -> None:
    # (int8, int4, sign and topk come wrapped in error feedback: the wrapper says the same)
    assert parse_compression(spec).posts_without_waiting


@pytest.mark.timeout(30)
def test_powersgd_waits_for_its_first_round_in_the_hook() -> None:
    assert not parse_compression("powersgd:2").posts_without_waiting
