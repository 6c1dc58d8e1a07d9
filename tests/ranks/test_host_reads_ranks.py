"""Two gloo ranks with a fused optimizer: the steady-state step reads nothing on the host (but
the periodic telemetry gather), and a non-finite step is still skipped on every rank that must
agree and reported (issue 44). The unit tier checks the same in a world of one, and on a GPU
with CUDA's sync debug mode (tests/unit/test_host_reads.py)."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import host_read_ranks as h

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_no_host_reads_between_gathers_and_non_finite_steps_still_skipped() -> None:
    by_rank = run_ranks(h.steady_and_skipped, 2, timeout_s=110)
    gathers = {s for s in range(h.STEPS) if (s + 1) % h.EVERY == 0}
    for strategy in h.STRATEGIES:
        r0, r1 = (out[strategy] for out in by_rank)
        for r in (r0, r1):
            assert {step for step, _, _ in r["reads"]} <= gathers, (strategy, r["reads"])
            assert len(r["reads"]) <= 6 * len(gathers), (strategy, r["reads"])
        if strategy == "zero:3":
            # Each rank steps its own rows: rank 1's NaN skips every rank's update (the
            # all-reduced flag), and no rank's rows move.
            for r in (r0, r1):
                assert r["skipped"] == r["report_skipped"] == [h.NAN_AT], strategy
                assert not r["moved"][h.NAN_AT] and r["moved"][h.NAN_AT + 1], strategy
        elif strategy in ("bsp", "zero:1", "zero:2"):
            # One mean gradient: rank 1's NaN, and its raising block's NaN buckets, make every
            # rank skip those steps, and rank 0 is told why the second was skipped. (zero:2:
            # each rank holds its shard; the all-reduced flag gates every rank's update.)
            for r in (r0, r1):
                assert r["report_skipped"] == [h.NAN_AT, h.RAISE_AT], strategy
                assert not r["moved"][h.NAN_AT] and not r["moved"][h.RAISE_AT], strategy
            assert r0["skipped"] == [h.NAN_AT, h.RAISE_AT], strategy
            assert r0["reasons"] == [
                None,
                f"rank 1's step {h.RAISE_AT} block raised Boom: bad batch",
            ]
            assert torch.equal(r0["params"], r1["params"]), strategy
        else:
            # A local step is each rank's own: rank 1 alone skips its non-finite one, and a
            # raising block skips only its own rank's step.
            assert r0["skipped"] == [] and r0["moved"][h.NAN_AT], strategy
            assert r1["skipped"] == [h.NAN_AT, h.RAISE_AT], strategy
            assert not r1["moved"][h.NAN_AT], strategy
            assert r0["report_skipped"] == [h.NAN_AT, h.RAISE_AT], strategy  # rank 1's records
        assert bool(torch.isfinite(r0["params"]).all()), strategy


@pytest.mark.timeout(120)
def test_a_grad_scaler_and_a_compressed_exchange_read_nothing_and_skip_together() -> None:
    """bsp with int4 (error feedback: its residuals zeroed on the device after the NaN step,
    else every later step would be skipped), and GradScalers under bsp and zero:2 (the
    scaler's found_inf is the verdict; zero:2's counts agreed by an all-reduce): no read
    between gathers, rank 1's NaN and its raising block skipped on both ranks, in step."""
    by_rank = run_ranks(h.scaled_and_compressed, 2, timeout_s=110)
    gathers = {s for s in range(h.STEPS) if (s + 1) % h.EVERY == 0}
    for key in by_rank[0]:
        r0, r1 = (out[key] for out in by_rank)
        for r in (r0, r1):
            assert {step for step, _, _ in r["reads"]} <= gathers, (key, r["reads"])
            assert r["report_skipped"] == [h.NAN_AT, h.RAISE_AT], key
            assert not r["moved"][h.NAN_AT] and not r["moved"][h.RAISE_AT], key
            assert all(r["moved"][h.RAISE_AT + 1 :]), key  # nothing left poisoned
        assert r0["skipped"] == [h.NAN_AT, h.RAISE_AT], key
        assert torch.equal(r0["params"], r1["params"]), key
        assert bool(torch.isfinite(r0["params"]).all()), key
        if key.endswith("True"):  # backed off once per skipped step, on both ranks alike
            assert r0["scale"] == r1["scale"] == 2.0**8, key
