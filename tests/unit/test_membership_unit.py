"""``membership=`` is validated before anything listens: each refusal names the bad value and
what is valid (``gradsync.membership.check_membership``; no process, no torchft needed)."""

from __future__ import annotations

from typing import Any

import pytest

from gradsync.errors import UsageError
from gradsync.membership import LIGHTHOUSE_ENV, check_membership, torchft_missing

pytestmark = pytest.mark.unit

GOOD: dict[str, Any] = dict(
    lighthouse="http://127.0.0.1:1",
    min_replicas=1,
    strategy="bsp",
    compression_spec="none",
    allreduce="ring",
    bucket_mb=None,
    balance=False,
)


def test_no_membership_is_the_classic_restart_and_refuses_its_settings() -> None:
    assert check_membership(None, **{**GOOD, "lighthouse": None}) is None
    with pytest.raises(UsageError, match="need membership='torchft'"):
        check_membership(None, **GOOD)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"strategy": "diloco:7:2:3"}, r"streaming DiLoCo .diloco:7:2:3.: with TAU=3 a fragment"),
        ({"strategy": "zero:3"}, r"diloco:H only for now, got 'zero:3'"),
        ({"compression_spec": "topk:0.01", "strategy": "diloco:4:2:1"}, r"compression .topk:0.01."),
        ({"allreduce": "hierarchical"}, r"allreduce='hierarchical'"),
        ({"bucket_mb": "auto"}, r"bucket_mb='auto'"),
        ({"balance": True}, r"with balance"),
        ({"min_replicas": 0}, r"min_replicas must be an integer >= 1, got 0"),
    ],
)
def test_what_the_manager_cannot_carry_is_refused_naming_it(
    change: dict[str, Any], match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        check_membership("torchft", **{**GOOD, **change})


@pytest.mark.parametrize("strategy", ["diloco:4:2:1", "diloco:8:4:1", "diloco:7:2:2", "diloco:6:3"])
def test_streaming_diloco_with_each_exchange_applied_before_the_next_starts_runs(
    strategy: str,
) -> None:
    """TAU below H // F: one quorum an exchange, the next joined after it was applied."""
    settings = check_membership("torchft", **{**GOOD, "strategy": strategy})
    assert settings is not None


def test_an_unknown_membership_names_the_valid_ones() -> None:
    with pytest.raises(UsageError, match=r"membership='etcd' is not known; valid: None, 'torchft'"):
        check_membership("etcd", **GOOD)


def test_the_lighthouse_comes_from_the_argument_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torchft_missing():
        pytest.skip("torchft is not installed: pip install 'gradsync[ft]'")
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(UsageError, match="needs the lighthouse's address"):
        check_membership("torchft", **{**GOOD, "lighthouse": None})
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://127.0.0.1:2")
    settings = check_membership("torchft", **{**GOOD, "lighthouse": None})
    assert settings is not None and settings.lighthouse == "http://127.0.0.1:2"


@pytest.mark.parametrize("strategy", ["bsp", "local:4", "diloco:4", "diloco:4:2:1"])
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_a_cast_to_16_bits_crosses_the_quorum_under_every_live_strategy(
    strategy: str, compression: str
) -> None:
    """BSP's buckets and the periodic averages both go through the Manager's all-reduce,
    which carries each replica's share cast to fp16/bf16 (docs/membership.md)."""
    change = {"strategy": strategy, "compression_spec": compression}
    assert check_membership("torchft", **{**GOOD, **change}) is not None


@pytest.mark.parametrize("compression", ["int8", "int4", "topk:0.1", "powersgd:2", "sparseloco"])
def test_every_compressor_crosses_the_quorum_but_streaming_fragments_take_16_bits(
    compression: str,
) -> None:
    """BSP's buckets and the periodic averages run the compressor's own collectives on the
    quorum's participants; streaming DiLoCo's fragments go through the Manager's all-reduce."""
    change = {"compression_spec": compression}
    for strategy in ("bsp", "local:4", "diloco:4"):
        assert check_membership("torchft", **{**GOOD, **change, "strategy": strategy})
    with pytest.raises(UsageError, match=r"use compression=None, 'fp16' or 'bf16', or one"):
        check_membership("torchft", **{**GOOD, **change, "strategy": "diloco:4:2:1"})


class _SmallQuorumManager:
    """torchft's Manager after a quorum of one replica group: the step is not committed."""

    def should_commit(self) -> bool:
        return False

    def num_participants(self) -> int:
        return 1


def test_a_step_skipped_for_a_quorum_below_min_replicas_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lighthouse started with min_replicas=1 forms quorums of one group, which a
    Synchronizer with min_replicas=2 never commits: every step skipped, nothing trained, and
    (before) not a word. Said once, naming both settings."""
    pytest.importorskip("torchft")
    from gradsync.membership.ft_manager import TorchftMembership

    live = TorchftMembership.__new__(TorchftMembership)  # no Manager, lighthouse or store
    live.manager = _SmallQuorumManager()
    live._quorum, live._on_step, live._name = None, None, "replica group 0"
    live._min_replicas, live._warned_small = 2, False
    live._committed_steps, live._met_a_peer = 0, False
    with caplog.at_level("WARNING", logger="gradsync.membership"):
        assert live.commit(0) is False
        assert live.commit(1) is False
    said = [r.getMessage() for r in caplog.records if r.name == "gradsync.membership"]
    assert len(said) == 1, said
    assert "skips step 0: its quorum had 1 participant(s), fewer than min_replicas=2" in said[0]
    assert "start it with min_replicas=2" in said[0]


class _QuorumOf:
    """torchft's Manager whose every quorum has ``participants`` replica groups, committed."""

    def __init__(self, participants: list[int]) -> None:
        self.participants = participants

    def should_commit(self) -> bool:
        return True

    def num_participants(self) -> int:
        return self.participants.pop(0)


@pytest.mark.parametrize(
    ("participants", "warned"),
    [([1, 1, 1], True), ([1, 2, 1], False), ([2, 2, 2], False), ([], False)],
)
def test_a_group_that_never_met_another_says_it_trained_alone(
    caplog: pytest.LogCaptureFixture, participants: list[int], warned: bool
) -> None:
    """Two groups started by hand a few seconds apart under a lighthouse of min_replicas=1:
    the first finished its 30 steps before the second's first quorum, each trained alone,
    and they ended with different models without a word. Said at close by a group none of
    whose committed steps had another group in its quorum."""
    pytest.importorskip("torchft")
    from gradsync.membership.ft_manager import TorchftMembership

    live = TorchftMembership.__new__(TorchftMembership)  # no Manager, lighthouse or store
    live.manager = _QuorumOf(list(participants))
    live._quorum, live._on_step, live._name = None, None, "replica group 1"
    live._min_replicas, live._warned_small = 1, False
    live._committed_steps, live._met_a_peer = 0, False
    live._group = None  # a world of one: its rank 0 says it
    for step in range(len(participants)):
        assert live.commit(step) is True
    with caplog.at_level("WARNING", logger="gradsync.membership"):
        live._say_if_alone()
    said = [r.getMessage() for r in caplog.records if r.name == "gradsync.membership"]
    assert len(said) == int(warned), said
    if warned:
        assert said[0].startswith("replica group 1 trained alone: no other replica group")
        assert "of its 3 committed step(s)" in said[0]
        assert "min_replicas=G" in said[0]


def test_a_replacement_that_found_no_peer_is_told_why_it_trained_alone(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement whose peers had finished (--min-replicas 1) trained its steps alone: the
    advice for groups started apart (give min_replicas=G to the lighthouse and the
    Synchronizer) did not fit it (a tester's); it is told the others were gone."""
    pytest.importorskip("torchft")
    from gradsync.membership.ft_manager import TorchftMembership

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    live = TorchftMembership.__new__(TorchftMembership)
    live.manager = _QuorumOf([1, 1])
    live._quorum, live._on_step, live._name = None, None, "replica group 1"
    live._min_replicas, live._warned_small = 1, False
    live._committed_steps, live._met_a_peer = 0, False
    live._group = None
    for step in range(2):
        live.commit(step)
    with caplog.at_level("WARNING", logger="gradsync.membership"):
        live._say_if_alone()
    said = [r.getMessage() for r in caplog.records if r.name == "gradsync.membership"]
    assert len(said) == 1 and said[0].startswith(
        "replica group 1's replacement (restart 1) trained its 2 committed step(s) alone"
    ), said
    assert "the others had finished" in said[0] and "started apart" not in said[0]
