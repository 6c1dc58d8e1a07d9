"""Gossip averaging (``gossip:H``): pairs average every H steps with no group-wide collective,
partners end each round bitwise alike, and ``report()`` leaves one model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradsync.pairing import partner
from gradsync.testing import run_ranks
from tests.support import gossip_ranks as gr
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_four_ranks_average_in_hypercube_pairs_and_end_as_one_model() -> None:
    period, steps = 2, 6
    out = run_ranks(gr.train, 4, period, steps, 4096, timeout_s=100)  # pieces of 4 KB
    for r in out:  # no all-reduce, broadcast, gather or barrier while training
        assert r["collectives"] == [], r["collectives"]
    for step in range(steps):
        params = [r["after"][step] for r in out]
        if (step + 1) % period:
            continue
        round_ = (step + 1) // period - 1
        for rank in range(4):
            peer = partner(rank, 4, round_)
            assert peer is not None
            assert torch.equal(params[rank], params[peer]), (step, rank, peer)
        # ... and the pairs differ from each other: replicas are not one model yet
        assert not torch.equal(params[0], params[partner(0, 4, round_) ^ 3])
    finals = [r["final"] for r in out]
    assert all(torch.equal(f, finals[0]) for f in finals)  # one model after report()
    summary = out[0]["summary"]
    assert summary["rounds"] == steps // period and summary["spread_before_final"] > 0
    nbytes = finals[0].numel() * finals[0].element_size()
    assert out[0]["bytes"] == [0, nbytes] * (steps // period)  # a model's bytes per round


@pytest.mark.timeout(120)
def test_an_odd_number_of_ranks_sits_one_out_each_round_and_ends_as_one_model() -> None:
    out = run_ranks(gr.train, 3, 1, 3, timeout_s=100)
    for step in range(3):
        alone = [r for r in range(3) if partner(r, 3, step) is None]
        assert len(alone) == 1
        paired = [r for r in range(3) if r not in alone]
        assert torch.equal(out[paired[0]]["after"][step], out[paired[1]]["after"][step])
    finals = [r["final"] for r in out]
    assert all(torch.equal(f, finals[0]) for f in finals)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_resumed_run_continues_the_rounds_bitwise(tmp_path: Path, compression: str) -> None:
    """Saved after step 4 of 8 (mid-period of gossip:3, the round counter at 1), resumed from
    there: every rank ends where the uninterrupted run ended, bit for bit (int8: its stochastic
    rounding is drawn from the round, so the resumed rounds encode alike)."""
    args = (str(tmp_path), "gossip:3", compression)
    whole = run_ranks(gr.checkpointed, 4, args[0], False, *args[1:], timeout_s=100)
    resumed = run_ranks(gr.checkpointed, 4, args[0], True, *args[1:], timeout_s=100)
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(whole[0], whole[3])  # replicas differ: the rounds did matter


@pytest.mark.timeout(150)
def test_noloco_pairs_as_gossip_and_its_outer_step_lands_on_the_mean_at_lr_1() -> None:
    """noloco:H exchanges as gossip does (no group-wide collective, a model each way a
    round) and ends as one model; with outer_lr=1 and no momentum its outer step lands on the
    pair's mean, gossip's result, to rounding (phi + (mean - phi))."""
    period, steps = 2, 6
    # one launch for the three runs, each rank running them in turn
    specs = ["gossip:2", "noloco:2:outer_lr=1:outer_momentum=0", "noloco:2"]
    by_rank = run_ranks(gr.train_each, 2, period, steps, specs, timeout_s=100)
    gossip, as_gossip, noloco = ([out[i] for out in by_rank] for i in range(len(specs)))
    for g, a in zip(gossip, as_gossip, strict=True):
        for step in range(steps):
            torch.testing.assert_close(a["after"][step], g["after"][step], rtol=0, atol=1e-12)
    for r in noloco:
        assert r["collectives"] == [], r["collectives"]
        assert r["bytes"] == gossip[0]["bytes"]
        assert r["summary"]["outer_lr"] == 0.7 and r["summary"]["outer_momentum"] == 0.9
    finals = [r["final"] for r in noloco]
    assert all(torch.equal(f, finals[0]) for f in finals)
    # the outer momentum moves the replicas off gossip's path
    assert not torch.allclose(noloco[0]["after"][-1], gossip[0]["after"][-1])


@pytest.mark.timeout(150)
def test_a_resumed_noloco_run_continues_bitwise(tmp_path: Path) -> None:
    """The slow weights and the outer momentum are in the checkpoint: resumed after step 4 of
    8, every rank ends where the uninterrupted run ended, bit for bit."""
    spec = "noloco:3:outer_lr=0.5:outer_momentum=0.8"
    whole = run_ranks(gr.checkpointed, 2, str(tmp_path), False, spec, timeout_s=100)
    resumed = run_ranks(gr.checkpointed, 2, str(tmp_path), True, spec, timeout_s=100)
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b)


ASLEEP_SPECS = ["gossip:1", "zero:2"]


@pytest.fixture(scope="module")
def asleep() -> Iterator[Overlapped]:
    """Each spec's partner-asleep launch, started at once (tests/support/overlap.py): each
    mostly waits out its partner's 6 s of sleep, and the waits overlap."""
    launches = {s: ranks(gr.partner_asleep, 2, s, 6.0, timeout_s=100) for s in ASLEEP_SPECS}
    with overlapped(launches) as out:
        yield out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ASLEEP_SPECS)
def test_a_partner_asleep_in_its_block_fails_the_exchange_after_timeout_s(
    spec: str, asleep: Overlapped
) -> None:
    """docs/gossip.md: a pair's wait is bounded by ``timeout_s``. gloo's point-to-point waits
    kept the group's own timeout, so rank 0 waited the whole 6 s its partner slept (noloco:H
    pairs through the same exchange; zero:2's ring of sends and receives on gloo too)."""
    out = asleep.result(spec)
    assert out[0]["raised"] is not None, out[0]
    if spec.startswith("gossip"):
        assert "averaging with rank 1" in out[0]["raised"], out[0]
    assert out[0]["seconds"] < 5, out[0]["seconds"]


@pytest.mark.timeout(120)
def test_a_slow_ranks_partner_counts_its_wait_as_idle_not_communication() -> None:
    """Rank 1 sleeps 0.15 s in each step: at each round (steps 1 and 3) rank 0 waits about
    0.3 s for it, which is idle that rank 1 caused, as at a barrier; rank 1 waits for no one.
    Before, the wait was communication, and the straggler finding said 0% idle caused."""
    out = run_ranks(gr.slow_partner, 2, 0.15, timeout_s=100)
    fast, slow = ({step: (idle, comm) for step, idle, comm in rows} for rows in out)
    for step in (1, 3):
        idle, comm = fast[step]
        assert 0.2 < idle < 0.6, fast
        assert comm < idle, fast
        assert slow[step][0] < 0.05, slow
    assert fast[0][0] == fast[2][0] == 0.0  # no exchange there


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("compression", "dtype"), [("fp16", "float64"), ("int8", "float32")])
def test_a_compressed_round_keeps_the_pairs_sum_and_each_sides_own_error(
    compression: str, dtype: str
) -> None:
    """x_i <- x_i + (Q(x_j) - Q(x_i)) / 2 on both sides: the pair's sum is what it was before
    the round (the codec's error never moves the average), each side keeps its own error, and
    the bytes are the codec's; report() still leaves one model."""
    from gradsync.compression.spec import parse_compression
    from gradsync.strategies.gossip import pair_codec

    out = run_ranks(gr.compressed_round, 2, compression, dtype, timeout_s=120)
    before = [r["before"] for r in out]
    after = [r["after"] for r in out]
    assert not torch.equal(before[0], before[1])  # the ranks drifted apart in step 0
    compressor = parse_compression(compression)

    def decoded(rank: int) -> torch.Tensor:  # what rank's bytes of round 0 decode to
        codec = pair_codec(compressor, before[rank], rank)
        return codec.decode(codec.encode(before[rank], 0), 0)

    for me, peer in ((0, 1), (1, 0)):
        expected = before[me] + (decoded(peer) - decoded(me)) / 2
        torch.testing.assert_close(after[me], expected, rtol=0, atol=1e-6)
    tol = 1e-12 if dtype == "float64" else 1e-5
    torch.testing.assert_close(after[0] + after[1], before[0] + before[1], rtol=0, atol=tol)
    # the sides differ by their codecs' errors only: far closer than before the round
    gap_before = (before[0] - before[1]).abs().max()
    gap_after = (after[0] - after[1]).abs().max()
    assert 0 < gap_after < gap_before
    n = before[0].numel()
    # fp16: 2 bytes a value; int8: 1 byte a value and a float32 scale per 1,024 values
    wire = 2 * n if compression == "fp16" else n + 4 * -(-n // 1024)
    assert out[0]["bytes"] == [0, wire]
    # the end's average is exact, not the codec's: the model the run ends with is not rounded
    assert torch.equal(out[0]["final"], out[1]["final"])
    torch.testing.assert_close(out[0]["final"], (after[0] + after[1]) / 2, rtol=0, atol=1e-15)


@pytest.mark.timeout(150)
def test_noloco_with_int4_on_an_odd_world_sends_int4_bytes_and_ends_as_one_model() -> None:
    """3 ranks: each round one sits out (no bytes), the pair sends int4's payload (half a byte
    a value and a float32 scale per 128), and report() leaves every rank the same model."""
    out = run_ranks(gr.compressed_noloco, 3, 4, timeout_s=120)
    n = out[0]["numel"]
    wire = -(-n // 2) + 4 * -(-n // 128)
    for round_, step in enumerate((1, 3)):
        for rank in range(3):
            paired = partner(rank, 3, round_) is not None
            assert out[rank]["bytes"][step] == (wire if paired else 0), (rank, step)
    finals = [r["final"] for r in out]
    assert all(torch.equal(f, finals[0]) for f in finals)
    assert torch.isfinite(finals[0]).all()
