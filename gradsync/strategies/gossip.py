"""Gossip averaging (``gossip:H``): every H steps each rank averages its parameters with one
peer, and no collective spans the group until the end.

Local SGD (``local:H``) averages every H steps over all ranks: one all-reduce, a barrier that
waits for the slowest rank, and 2(W-1) latency terms on a ring. Gossip replaces it by a pair
exchange: each rank sends its parameters to one partner and receives the partner's, and both
take the mean. A rank then waits for its partner only, so a slow rank holds back one peer per
round rather than the whole group, and a round costs one latency and one model's bytes each
way, whatever the number of ranks. The price is consensus: replicas differ during training (by
design, the divergence check does not run then) and agree only in the limit; ``report()`` ends
with one all-reduce of the parameters, so the final model is one. Before it, the spread of the
replicas (the largest difference of any rank's parameter from their mean) is measured and kept
in the strategy's summary (``report.json``, ``strategy_summary``).

Who pairs with whom, every rank computes alike from the round number (``gradsync.pairing``:
the hypercube on a power-of-two number of ranks, else a seeded perfect matching, one rank
sitting out a round when W is odd). Each pair's mean is computed as ``(a + b) / 2`` on both
sides, so partners hold bitwise the same parameters after a round (IEEE addition commutes).

NoLoCo (``noloco:H``, :class:`NoLoCo`; Kolehmainen et al., 2025, "NoLoCo: No-all-reduce Low
Communication Training"): the same pair exchange, followed by an outer momentum step on slow
weights each rank keeps, which bounds how far the replicas drift apart. Per round, with the
rank's slow weights ``phi`` (its parameters after its last outer step), momentum ``m``, outer
learning rate ``a`` and momentum ``b``, and ``mean`` the pair's mean of their parameters:
``m <- b * m + a * (mean - phi)``, ``phi <- phi + m``, and the parameters become ``phi``. That
is the update of the authors' reference code (its ``a * (mean progress) + a * (pair's mean slow
weights - phi)``, whose two terms add up to ``a * (mean - phi)``), so the pair exchanges its
parameters only, as gossip does. With ``a = 1, b = 0`` it lands on the pair's mean, as gossip
(to rounding). Replicas do not agree after a round (each keeps its own ``phi`` and ``m``).

Compression (``PAIR_CODECS``: fp16, bf16, int8, int4): each side sends its parameters encoded
by the family's codec (the one parameter-server pushes use, ``compression.push``) and updates
``x <- x + (Q(partner) - Q(x)) / 2``, ``Q`` being what the codec's bytes decode to. The pair's
sum is kept (each side adds what the other subtracts), so the codec's error never shifts the
average the ranks train towards; it stays in each replica, as the difference
``x_i - x_j <- e_i - e_j`` of the two sides' errors ``e = x - Q(x)``, and is not carried over to
the next round. The partners no longer hold bitwise one mean. Only codecs that approximate every
element qualify: a sparsifier, a low-rank or a sign code of the parameters themselves would drop
most of them (refused, naming the valid ones). The codec's random stream is the sender's rank
and its step the round; no such codec's decode needs the sender's stream, so one codec a rank
encodes its own bytes and decodes its partners'.

Why our own: torch has no gossip averaging; the pair exchange is ``batch_isend_irecv`` of the
flat parameters (or their encoding), over the user's process group. What is not here: the
hierarchy (refused).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync.checks.diagnose import END
from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import Compressor, FlatBucket
from gradsync.compression.push import PushCodec
from gradsync.errors import UsageError
from gradsync.flat import copy_into, flatten
from gradsync.pairing import partner
from gradsync.spec import OUTER_DEFAULTS, StrategySpec
from gradsync.strategies.base import StepOutcome, SyncContext, wait_each
from gradsync.strategies.local_sgd import OuterConfig, Periodic

__all__ = ["PAIR_CODECS", "PIECE_BYTES", "Gossip", "NoLoCo", "pair_compression_refusal"]

#: the compression families a pair exchange takes: those whose codec approximates every element
#: of the parameters (casts and block quantizers)
PAIR_CODECS = ("fp16", "bf16", "int8", "int4")

#: the pair exchange sends the parameters in pieces of at most this many bytes each way.
#: Why: measured on the emulated cluster (2 hosts, 1 Gbit/s, gloo), 12 MB sent as one message
#: each way took 168-199 ms, in 1 to 3 MB pieces 102-104 ms, as gloo's all-reduce of the same
#: 12 MB (100 ms): one large message in each direction did not keep both directions busy.
PIECE_BYTES = 1 << 20


class Gossip(Periodic):
    """``gossip:H``: every H steps, average the parameters with one partner (see the module
    docstring)."""

    name = "gossip"
    #: nothing spans the group before the end: telemetry is gathered then, not every few steps
    barrier_free = True
    takes_hierarchy = False
    #: no gate: a pair waits for each other only (the final average passes one at ``END``)
    gate_ahead = False

    def __init__(self, period: int) -> None:
        super().__init__(period)
        self._round = 0
        #: the replicas' spread measured before the final average (None: not yet)
        self._spread: float | None = None
        self._world = 1
        self._rank = 0
        #: when this rank's local steps since its last round began (``_pair_mean``'s idle)
        self._local_since = time.perf_counter()
        #: the pair exchange's codec (None: uncompressed), built at the first round
        self._codec: PushCodec | None = None
        self._compressed = False

    def settings_spec(self) -> str | None:
        return f"gossip:{self.period}" if self.name == "gossip" else None  # None: a subclass

    def setup(self, ctx: SyncContext) -> None:
        compressed = ctx.compressor is not ALLREDUCE
        if compressed and not takes_pair_compression(ctx.compressor.spec):
            raise UsageError(
                pair_compression_refusal(f"{self.name}:{self.period}", ctx.compressor.spec)
            )
        if compressed and ctx.compressor.codec is None:
            raise UsageError(
                f"{self.name}:{self.period} encodes its pair exchange with the compressor's codec"
                f", and compression {ctx.compressor.spec!r} was built without one (codec=...); "
                f"use one of the built-in {', '.join(PAIR_CODECS)}"
            )
        if ctx.hierarchy is not None:
            raise UsageError(
                f"{self.name}:{self.period} pairs ranks itself and takes no "
                "allreduce='hierarchical'"
            )
        super().setup(ctx)
        self._world = dist.get_world_size(ctx.group) if dist.is_initialized() else 1
        self._rank = dist.get_rank(ctx.group) if dist.is_initialized() else 0
        self._local_since = time.perf_counter()  # after the initial broadcast: every rank's
        self._compressed = compressed

    def _exchange(self, step: int, outcome: StepOutcome) -> StepOutcome:
        """The pair exchange due after local step ``step``, if any: no gate, no barrier beyond
        the partner (a rank's own code between steps delays its partner only)."""
        if (step + 1) % self.period:
            return outcome
        round_ = self._round
        peer = partner(self._rank, self._world, round_)
        self._round += 1
        local = time.perf_counter() - self._local_since
        if peer is None:
            self._sat_out()
        else:
            mean, nbytes, idle = self._pair_mean(peer, step, local, round_)
            self._apply_round(mean)
            outcome.bytes_sent += nbytes
            outcome.idle += idle
        self._local_since = time.perf_counter()
        return outcome

    def _apply_round(self, mean: torch.Tensor) -> None:
        """The round's result: the pair's mean becomes the parameters."""
        copy_into(mean, self._params)

    def _sat_out(self) -> None:
        """A round without a partner (W odd): the parameters stay as they are."""

    def _pair_mean(
        self, peer: int, step: int, local: float, round_: int
    ) -> tuple[torch.Tensor, int, float]:
        """The mean of this rank's parameters and ``peer``'s (under compression, the
        sum-keeping update of the module docstring), the bytes sent, and how long this
        rank waited for ``peer`` (its idle): the partner's ``local`` seconds since its last
        round (its steps' compute and its own code) beyond this rank's, as a barrier's idle is
        the slowest rank's compute beyond a rank's own (``telemetry.records.fill_idle``), at
        most the exchange's time. Each side sends its ``local`` with the parameters, in the
        same batch of messages: no extra round trip. On a GPU (NCCL sends device tensors only)
        the idle is not measured, 0: reading the partner's value would stop the host."""
        ctx = self._ctx
        assert ctx is not None
        params = flatten(self._params)
        codec = self._pair_codec(params)
        mine = params if codec is None else codec.encode(params, round_)
        theirs = torch.empty_like(mine)
        timed = mine.device.type == "cpu"
        mine_s = torch.tensor([local], dtype=torch.float64)
        theirs_s = torch.zeros(1, dtype=torch.float64)
        group = ctx.group
        to = peer if group is None else dist.get_global_rank(group, peer)
        # bsp and diloco fail after timeout_s: so does a pair whose partner is asleep
        bound = None if ctx.watch is None else ctx.watch.timeout_s

        def run() -> None:
            # In pieces: one message each way of a whole model ran at half the link's rate both
            # ways (see PIECE_BYTES); pieces to one peer are matched in the order posted.
            pieces = max(1, -(-mine.numel() * mine.element_size() // PIECE_BYTES))
            ops = []
            if timed:  # first on both sides, so the pieces' order matches as before
                ops.append(dist.P2POp(dist.isend, mine_s, to, group))
                ops.append(dist.P2POp(dist.irecv, theirs_s, to, group))
            for out, into in zip(mine.chunk(pieces), theirs.chunk(pieces), strict=True):
                ops.append(dist.P2POp(dist.isend, out, to, group))
                ops.append(dist.P2POp(dist.irecv, into, to, group))
            wait_each(dist.batch_isend_irecv(ops), bound)

        started = time.perf_counter()
        if ctx.watch is None:
            run()
        else:
            ctx.watch.run(step, f"{self.name}:{self.period} averaging with rank {peer}", run)
        waited = time.perf_counter() - started
        idle = min(waited, max(0.0, float(theirs_s) - local)) if timed else 0.0
        nbytes = mine.numel() * mine.element_size()
        if codec is None:
            # (a + b) / 2 on both sides: addition commutes, so the pair holds bitwise one mean.
            return (mine + theirs) / 2, nbytes, idle
        # This rank's codec decodes the partner's bytes too: no PAIR_CODECS family's decode
        # uses the sender's random stream (int8's noise is the encode's alone; int4 has none).
        moved = (codec.decode(theirs, round_) - codec.decode(mine, round_)) / 2
        return params + moved, nbytes, idle

    def _pair_codec(self, params: torch.Tensor) -> PushCodec | None:
        """This rank's pair codec under compression (built once), else None."""
        if self._compressed and self._codec is None:
            assert self._ctx is not None
            self._codec = pair_codec(self._ctx.compressor, params, self._rank)
        return self._codec

    def finalize(self) -> None:
        """One average over every rank, so the final model is one; the spread before it is
        measured first (the largest distance of a replica's parameter from the mean)."""
        if self._world < 2 or self._ctx is None:
            return
        if self._ctx.gate is not None:
            self._ctx.gate.ensure(END, f"final averaging of {self.name}:{self.period}")
        mine = flatten(self._params)
        mean = self._exact_mean(mine) if self._compressed else self._mean(mine.clone())
        spread = (mine - mean).abs().max() if mine.numel() else torch.zeros(())
        spread = spread.reshape(1).to(torch.float64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self._ctx.group)
        self._spread = float(spread.item())
        copy_into(mean, self._params)
        self._in_sync = True

    def _exact_mean(self, mine: torch.Tensor) -> torch.Tensor:
        """The final average where the pair exchanges are compressed: uncompressed all the
        same, since it is the model the run ends with (a codec's mean would leave it rounded to
        the codec's precision)."""
        ctx = self._ctx
        assert ctx is not None
        state = ALLREDUCE.make_state(ctx.group)
        bucket = FlatBucket(mine.clone(), params=self._params)

        def run() -> torch.Tensor:
            return ALLREDUCE.hook(state, bucket).wait()

        what = f"final averaging of {self.name}:{self.period}"
        return run() if ctx.watch is None else ctx.watch.run(self._step, what, run)

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Only at the end: during training the replicas differ by design."""
        return final

    def summary(self) -> dict[str, Any]:
        return {"period": self.period, "rounds": self._round, "spread_before_final": self._spread}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "round": self._round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._round = int(state.get("round", 0))

    def _synchronize(self) -> None:  # the final average only (``finalize``)
        raise AssertionError("gossip synchronizes in pairs (_exchange) and at the end (finalize)")


class NoLoCo(Gossip):
    """``noloco:H``: gossip's pair exchange every H steps, then an outer momentum step on this
    rank's slow weights (see the module docstring); the defaults are DiLoCo's outer settings,
    as NoLoCo's."""

    name = "noloco"

    def __init__(
        self,
        period: int,
        outer_lr: float = OUTER_DEFAULTS["outer_lr"],
        outer_momentum: float = OUTER_DEFAULTS["outer_momentum"],
    ) -> None:
        super().__init__(period)
        self.outer = OuterConfig(outer_lr=outer_lr, outer_momentum=outer_momentum)
        self._slow: torch.Tensor | None = None
        self._momentum: torch.Tensor | None = None

    def settings_spec(self) -> str | None:
        if self.name != "noloco":  # a user's subclass
            return None
        outer = self.outer
        spec = StrategySpec(
            kind="noloco",
            period=self.period,
            outer_lr=outer.outer_lr,
            outer_momentum=outer.outer_momentum,
        )
        return str(spec)

    def setup(self, ctx: SyncContext) -> None:
        super().setup(ctx)
        # After the Synchronizer's initial broadcast: the same slow weights on every rank.
        self._slow = flatten(self._params).clone()
        self._momentum = torch.zeros_like(self._slow)

    def _apply_round(self, mean: torch.Tensor) -> None:
        slow, momentum = self._slow, self._momentum
        assert slow is not None and momentum is not None
        momentum.mul_(self.outer.outer_momentum).add_(mean.sub_(slow), alpha=self.outer.outer_lr)
        slow.add_(momentum)
        copy_into(slow, self._params)

    def _sat_out(self) -> None:
        # A pair of one: its own parameters stand for the pair's mean, so its slow weights
        # take its progress in the same outer step as the others'.
        self._apply_round(flatten(self._params))

    def summary(self) -> dict[str, Any]:
        lr, momentum = self.outer.outer_lr, self.outer.outer_momentum
        return {**super().summary(), "outer_lr": lr, "outer_momentum": momentum}

    def state_dict(self) -> dict[str, Any]:
        assert self._slow is not None and self._momentum is not None
        return {
            **super().state_dict(),
            "slow": self._slow.clone(),
            "momentum": self._momentum.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self._slow is not None and "slow" in state:
            self._slow.copy_(state["slow"])
        if self._momentum is not None and "momentum" in state:
            self._momentum.copy_(state["momentum"])


def takes_pair_compression(compression: str) -> bool:
    """Whether a compression spec's family is one a pair exchange takes (``PAIR_CODECS``)."""
    return compression.split(":", 1)[0].strip().lower() in PAIR_CODECS


def pair_codec(compressor: Compressor, params: torch.Tensor, sender: int) -> PushCodec:
    """The codec of ``sender``'s pair exchanges of ``params`` (flat): the family's own encoding,
    its random stream the sender's rank. Without error feedback: the update keeps each side's
    error in its own replica instead (module docstring)."""
    assert compressor.codec is not None  # every PAIR_CODECS family has one
    numel = params.numel()
    codec = compressor.codec(numel, params.dtype, [[numel]], sender)
    return PushCodec(compressor.spec, numel, params.dtype, codec, error_feedback=False)


def pair_compression_refusal(strategy: str, compression: str) -> str:
    """Why gossip and NoLoCo refuse a compression (the same words before launch, in
    ``factory.check_compression``, and in ``setup``)."""
    return (
        f"{strategy} exchanges the parameters themselves between pairs of ranks and compresses "
        f"them with {', '.join(PAIR_CODECS)} only (got {compression}): a sparse, low-rank or "
        "sign code of the parameters would drop most of them; use one of those, or "
        f"{compression} with local:H or diloco:H"
    )
