"""Live membership: replica groups that leave and join a run while the others train on.

Without it (``membership=None``) a lost worker stops every rank: torch's elastic agent restarts
the group and all resume from the last checkpoint. With ``membership="torchft"`` each replica
group is a participant of a torchft quorum (``gradsync.membership.ft_manager``): the others go
on at the next step with the mean over the live participants, and a replacement heals from a
live peer's state before it rejoins (docs/membership.md).

Why a package of its own: what it holds (torchft's Manager, its lighthouse, the state a
replacement heals from) is neither a strategy nor checkpointing, and it is the one place that
imports torchft, an optional dependency (``pip install gradsync[ft]``). Strategies see only the
``strategies.base.Membership`` protocol, through ``SyncContext.membership``.

This module is torch-free and torchft-free: the Synchronizer validates its arguments here
before anything listens or is exchanged.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from gradsync.errors import UsageError
from gradsync.spec import StrategySpec, parse_strategy_spec

#: the values ``Synchronizer(membership=...)`` takes besides None (the classic restart)
MEMBERSHIPS = ("torchft",)
#: the strategies whose exchanges go through the quorum (``check_exchange``)
LIVE_KINDS = ("bsp", "local", "diloco")
#: the strategies whose exchange goes through the quorum, as the messages name them
LIVE_STRATEGIES = "bsp, zero:1, zero:2, local:H or diloco:H"
#: where the lighthouse's address is read when ``lighthouse=`` is not given (torchft's own name)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: this replica group's id (torchft's examples' name): it names the group in the quorum and in
#: torchft's logs; a uuid is added by torchft, so a replacement never collides with the dead
REPLICA_ID_ENV = "REPLICA_GROUP_ID"


@dataclass(frozen=True, slots=True)
class StepQuorum:
    """What one step's quorum was, as this replica group saw it (``TorchftMembership`` hands
    one to ``on_step`` once the step's commit is decided; a run directory records it in
    ``membership.jsonl``, ``gradsync.telemetry.membership``)."""

    step: int
    #: when the group asked for the quorum (epoch seconds), and how long it took to have it
    #: (a replacement's healing included)
    time: float
    quorum_s: float
    #: the lighthouse's id of the quorum (it changes whenever its members do)
    quorum_id: int | None
    participants: int
    #: torchft's ids of the quorum's replicas, ``GROUP:UUID`` (None: not known)
    members: list[str] | None
    committed: bool
    #: the bytes of tensors taken from a peer, when this group healed at the step
    healed_bytes: int | None = None
    #: this group's own replica id among ``members`` (None: not known)
    replica_id: str | None = None
    #: the step the quorum was joined before, where it is not ``step``: a periodic strategy's
    #: quorum is joined at a period's first step (where a loss is seen and a replacement
    #: heals) and decides the average at the period's last (``step``)
    joined_at: int | None = None
    #: the run's final synchronization (an incomplete last period's average, in
    #: ``report()``), after the last step: ``step`` is then the number of steps run
    final: bool = False


@dataclass(frozen=True, slots=True)
class LiveSettings:
    """What ``membership="torchft"`` was given, validated."""

    lighthouse: str
    min_replicas: int
    replica_id: str | None


def torchft_missing() -> str | None:
    """Why torchft cannot be used here (None: it can)."""
    if importlib.util.find_spec("torchft") is None:
        return (
            "membership='torchft' needs torchft, which is not installed: "
            "pip install 'gradsync[ft]' (torchft 0.2, torch >= 2.7)"
        )
    return None


def check_membership(
    membership: str | None,
    *,
    lighthouse: str | None,
    min_replicas: int | None,
    strategy: Any,
    compression_spec: str,
    allreduce: str,
    bucket_mb: Any,
    balance: Any,
) -> LiveSettings | None:
    """The validated settings of ``membership=`` (None: no live membership), or a
    ``UsageError`` naming the bad value and what is valid. Called before anything listens."""
    if membership is None:
        if lighthouse is not None or min_replicas not in (None, 1):
            raise UsageError(
                "lighthouse= and min_replicas= set how replica groups join a torchft quorum: "
                "they need membership='torchft'"
            )
        return None
    if membership not in MEMBERSHIPS:
        valid = ", ".join(repr(m) for m in (None, *MEMBERSHIPS))
        raise UsageError(f"membership={membership!r} is not known; valid: {valid}")
    min_replicas = 1 if min_replicas is None else min_replicas
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise UsageError(f"min_replicas must be an integer >= 1, got {min_replicas!r}")
    # Whatever check_exchange lets through runs in a replica group of any number of ranks:
    # each rank exchanges with the same rank of the other groups, after the group's own sum
    # (bsp's buckets, the periodic averages: docs/membership.md).
    check_exchange(strategy, compression_spec, allreduce, bucket_mb, balance)
    address = lighthouse if lighthouse is not None else os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise UsageError(
            "membership='torchft' needs the lighthouse's address: lighthouse='http://HOST:PORT' "
            f"or ${LIGHTHOUSE_ENV} (docs/membership.md starts one on 127.0.0.1)"
        )
    check_lighthouse(address)
    missing = torchft_missing()
    if missing is not None:
        raise UsageError(missing)
    replica_id = os.environ.get(REPLICA_ID_ENV) or None
    return LiveSettings(lighthouse=address, min_replicas=min_replicas, replica_id=replica_id)


#: the compressions streaming DiLoCo's fragments take through the quorum: each replica casts
#: its share to the 16-bit type, the Manager sums the casts, and the sum is cast back
#: (``ft_manager.TorchftMembership.allreduce``; ``compression.fp.CAST_WIRE``). BSP's buckets
#: and the averages of ``local:H`` and ``diloco:H`` take these and every other compressor,
#: whose collectives then run on the quorum's participants (``TorchftMembership.exchange``)
QUORUM_COMPRESSIONS = ("fp16", "bf16")


def runs_live(spec: StrategySpec) -> bool:
    """Whether the strategy ``spec`` runs under live membership: those of ``LIVE_KINDS``, and
    ``zero:1`` and ``zero:2`` inside each replica group (HSDP's shape: the optimizer state,
    and under ``zero:2`` the gradient, sharded over the group's ranks; the gradient's mean
    over every group through the quorum: the whole gradient under ``zero:1``, as ``bsp``, each
    rank's shard under ``zero:2``)."""
    return spec.kind in LIVE_KINDS or (spec.kind == "zero" and spec.stage in (1, 2))


def check_exchange(
    strategy: Any, compression_spec: str, allreduce: str, bucket_mb: Any, balance: Any
) -> None:
    """What the torchft Manager's collectives can carry in this version: BSP's plain
    all-reduce, bucket by bucket, the same buckets on every replica; the periodic exchanges
    of ``local:H`` (the parameters' mean) and ``diloco:H`` (the mean pseudo-gradient), one
    quorum a period; and streaming DiLoCo's fragments, one quorum an exchange, which the
    Manager (one quorum at a time) can hold only where each exchange is applied before the
    next one starts: TAU below H // F, the fewest steps between two fragments' starts."""
    spec = parse_strategy_spec(strategy) if isinstance(strategy, str) else None
    if spec is None or not runs_live(spec):
        raise UsageError(
            f"membership='torchft' runs strategies {LIVE_STRATEGIES} only for now, got "
            f"{strategy!r}: their exchanges (BSP's gradient, the periodic average) are the "
            "ones that go through the torchft Manager's quorum and commit decision (the other "
            "strategies' collectives would stay inside one replica group, or reach a lost one "
            f"and hang); give strategy as a string, one of {LIVE_STRATEGIES}"
        )
    if spec.eager:
        from gradsync.strategies.eager import NOT_UNDER_MEMBERSHIP  # torch: only when refused

        raise UsageError(f"membership='torchft' with {strategy!r}: {NOT_UNDER_MEMBERSHIP}")
    # the fewest steps between two fragments' starts (``streaming.offsets``)
    gap = (spec.period or 1) // (spec.fragments or 1)
    if spec.fragments is not None and (spec.delay or 0) >= gap:
        raise UsageError(
            f"membership='torchft' with streaming DiLoCo {strategy!r}: with TAU={spec.delay} "
            "a fragment's exchange would start at the step the previous one is applied, and "
            "the torchft Manager holds one quorum at a time (each exchange has its own, from "
            "the step after the previous one was applied until its own is); use TAU below "
            f"H // F = {gap}"
        )
    streaming = (spec.fragments or 1) > 1
    if streaming and compression_spec != "none" and compression_spec not in QUORUM_COMPRESSIONS:
        raise UsageError(
            f"membership='torchft' with streaming DiLoCo {strategy!r} and compression "
            f"{compression_spec!r}: the fragments' exchanges cross the quorum as they are or "
            "cast to fp16 or bf16 (the last one sends every fragment at once, which a "
            "compressor's state kept per fragment does not fit); use compression=None, "
            "'fp16' or 'bf16', or one fragment (diloco:H)"
        )
    if allreduce != "ring":
        raise UsageError(
            f"membership='torchft' with allreduce={allreduce!r}: the Manager's all-reduce is "
            "the exchange; use allreduce='ring' (the default)"
        )
    if bucket_mb == "auto":
        raise UsageError(
            "membership='torchft' with bucket_mb='auto': each replica would time its own plans "
            "and could choose other buckets than its peers, whose all-reduces would then not "
            "match; give bucket_mb a number (or None for the default plan)"
        )
    if balance:
        raise UsageError(
            "membership='torchft' with balance: shard balancing weighs ranks of one group, "
            "and the quorum changes under it; use balance=False"
        )


def check_lighthouse(address: str) -> None:
    """A lighthouse address torchft's client can dial: ``http://HOST:PORT`` (or https)."""
    scheme, sep, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or scheme not in ("http", "https") or not host or not port.isdigit():
        raise UsageError(
            f"the lighthouse's address must be http://HOST:PORT, got {address!r} (torchft's "
            "lighthouse prints its own, e.g. http://127.0.0.1:29510)"
        )
