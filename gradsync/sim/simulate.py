"""Discrete-event simulation of every strategy, vectorised over workers (and steps where the
recurrence allows), so that 1024 workers x 1000 steps takes well under a second.

Every result obeys one accounting identity per worker: compute + idle + unhidden comm = wall.
``idle`` is time a worker is blocked: at a barrier, at the staleness bound, or after its last
step while the slowest worker finishes (so that strategies with and without barriers compare).
Each worker runs the same number of steps; a faster worker under ``async`` does not take more,
so ``throughput`` (over the whole run) cannot show what async gains with a persistent
straggler; ``throughput_while_all_train`` (up to the moment the first worker runs out of
steps) does, as a run of fixed duration would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from gradsync.errors import UsageError
from gradsync.pairing import partner
from gradsync.sim.config import (
    HIERARCHICAL,
    CommModel,
    SimStrategy,
    parse_sim_strategy,
    takes_hierarchy,
)
from gradsync.sim.streaming import Layer, Plan, fragment_shares, timeline


@dataclass(frozen=True, kw_only=True, slots=True)
class Overlap:
    """BSP with bucketed overlap: the backward pass (the last ``backward_frac`` of compute)
    produces gradients evenly; ``buckets`` equal buckets are all-reduced one after another,
    each as soon as every worker has produced it. ``zero:1`` exchanges its gradient the same
    way (then all-gathers, not overlapped); ``zero:2`` has nothing to overlap."""

    backward_frac: float = 2.0 / 3.0
    buckets: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.backward_frac <= 1:
            raise UsageError(f"--backward-frac must be in (0, 1], got {self.backward_frac}")
        if self.buckets < 1:
            raise UsageError(f"--buckets must be at least 1, got {self.buckets}")


@dataclass(kw_only=True, slots=True)
class SimResult:
    """What a simulated run cost. Matrices are ``(steps, workers)``; times in ms."""

    strategy: str
    compute_ms: np.ndarray
    idle_ms: np.ndarray
    # (steps,): exchange time no worker could hide, charged at that step; where each worker
    # paid its own (``comm_steps`` per worker, ssp and async), their mean over the workers
    comm_ms: np.ndarray
    wall_ms: float
    staleness: np.ndarray  # updates each worker's read missed, in clocks (0 under BSP)
    step_ms: np.ndarray | None = None  # (steps,): superstep time, for the barrier strategies
    # (steps,): when every worker had finished clock t, for the free-running strategies
    done_ms: np.ndarray | None = None
    period: int = 1  # clocks per synchronisation period: H for local/diloco, else 1
    # worker-steps per second until the first worker finished its last step (None: barrier
    # strategies, where every worker finishes at the same moment)
    steady_throughput: float | None = None
    # (workers,): the free-running strategies' wait after a worker's last step until the
    # slowest one finishes, part of ``idle_ms``'s last row (None: the others). A run's step
    # records hold no such wait (it is spent in ``report()``), so the calibrated prediction
    # leaves it out of the barrier tax it compares with the run's
    final_wait_ms: np.ndarray | None = None

    @property
    def steps(self) -> int:
        return int(self.compute_ms.shape[0])

    @property
    def workers(self) -> int:
        return int(self.compute_ms.shape[1])

    @property
    def idle_per_worker(self) -> np.ndarray:
        return self.idle_ms.sum(axis=0)

    @property
    def throughput(self) -> float:
        """Worker-steps per second of wall-clock."""
        return self.steps * self.workers / (self.wall_ms / 1000.0) if self.wall_ms > 0 else 0.0

    @property
    def throughput_while_all_train(self) -> float:
        """Worker-steps per second while every worker is still training.

        Counts the steps finished by the moment the first worker finished its last one. Under
        a barrier it equals ``throughput``; under async with a persistent straggler it is the
        rate a run of fixed duration would see, the fast workers not waiting for the slow one.
        """
        return self.throughput if self.steady_throughput is None else self.steady_throughput

    def period_step_ms(self) -> np.ndarray:
        """Time per step of each synchronisation period (one clock; H clocks for local/diloco).

        A period's time runs from the moment every worker had finished the previous period to
        the moment every worker has finished this one: the superstep under bsp (and ssp:0),
        the pace of the slowest worker under ssp and async, a whole round over H under
        local/diloco. Its median is the "median step" the calibrated prediction reports for
        every strategy; its mean over the run is ``wall_ms / steps``.
        """
        h = self.period
        ends = np.minimum(np.arange(h - 1, self.steps + h - 1, h), self.steps - 1)
        lengths = np.diff(ends, prepend=-1)
        if self.step_ms is not None:
            return self.step_ms[ends] / lengths
        assert self.done_ms is not None
        return np.diff(self.done_ms[ends], prepend=0.0) / lengths

    @property
    def efficiency(self) -> float:
        """Share of all worker-time spent computing: 1.0 is perfect linear scaling."""
        total = self.workers * self.wall_ms
        return float(self.compute_ms.sum() / total) if total > 0 else 1.0

    def staleness_hist(self) -> dict[int, int]:
        values, counts = np.unique(self.staleness, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts, strict=True)}


def simulate(
    strategy: SimStrategy | str,
    compute_ms: np.ndarray,
    comm: CommModel,
    *,
    overlap: Overlap | None = None,
    comm_steps: np.ndarray | None = None,
    layers: Sequence[Layer] | None = None,
) -> SimResult:
    """Simulate ``strategy`` on a ``(steps, workers)`` compute matrix.

    ``comm_steps`` (``(steps,)``, ms), when given, replaces ``comm``'s constant exchange with
    one exchange time per step, e.g. resampled from a real run's telemetry; for ``ssp:S`` and
    ``async`` it may be ``(steps, workers)``, each worker's own exchange (a push and a pull
    that waits for no other worker's). ``layers``: the
    sizes of the model's layers in module order, from which streaming DiLoCo's fragments take
    their shares of the bytes under the spec's split (``streaming.fragment_shares``): each
    layer's bytes (``streaming.layer_bytes``), or its tensors' rows and bytes
    (``streaming.layer_tensors``), which the rows split needs to match the runtime exactly;
    without them each fragment carries 1/F.
    """
    strat = parse_sim_strategy(strategy) if isinstance(strategy, str) else strategy
    c = np.asarray(compute_ms, dtype=float)
    if c.ndim != 2 or c.size == 0:
        raise UsageError("compute matrix must be (steps, workers) with at least one of each")
    _check_hosts(strat, comm)
    if strat.streaming:
        if comm_steps is not None:
            raise UsageError(
                f"per-step comm times are not modelled for {strat.spec}: a step's measured "
                "exchange is a whole model's, not a fragment's; price it with a comm model"
            )
        return _streaming(c, comm, strat, layers)
    if overlap is not None and strat.spec not in OVERLAPPED:
        raise UsageError(
            f"--overlap applies to {' and '.join(OVERLAPPED)} only, not {strat.spec}"
            + (" (its reduce-scatter runs after the backward pass)" if strat.kind == "zero" else "")
        )
    if strat.kind in ("gossip", "noloco"):  # noloco's outer step costs no communication
        if comm_steps is not None:
            raise UsageError(
                f"{strat.spec} exchanges whole parameters between pairs: it is priced from the "
                "comm model (no per-step comm times)"
            )
        pair = comm.pair_ms(c.shape[1])  # a model each way between two ranks, compressed
        final = replace(comm, ratio=1.0).exchange_ms(c.shape[1])  # the end's average is exact
        return _gossip(c, pair, final, int(strat.param), strat.spec)
    if strat.kind == "zero":
        if comm.ratio != 1:
            raise UsageError(
                f"a compression ratio prices compressed exchanges of bsp, ssp:S, async, local:H "
                "and diloco:H[:F[:TAU[:ALPHA]|:eager][:SPLIT]]; "
                f"{strat.spec}'s collectives are not compressed"
            )
        if comm_steps is not None:
            raise UsageError(
                f"per-step comm times are not modelled for {strat.spec}: its gradient exchange "
                "and all-gather are priced from the comm model"
            )
        return _zero(c, comm, int(strat.param), overlap)
    exchange = _exchange_ms(strat, c, comm, overlap, comm_steps)
    if strat.kind == "bsp":
        if overlap is not None:
            return _bsp_overlap(c, comm, overlap)
        return _bsp(c, exchange, _gate_open_ms(comm, c.shape[1]))
    if strat.kind == "async":
        return _async(c, exchange)
    if strat.kind == "hogwild":
        return _hogwild(c)
    if strat.kind == "ssp":
        return _ssp(c, exchange, strat.param, strat.spec)
    return _periodic(c, exchange, int(strat.param), strat.spec)


#: Strategies whose gradient exchange overlaps the backward pass under ``--overlap``.
OVERLAPPED = ("bsp", "zero:1")


def _exchange_ms(
    strat: SimStrategy,
    c: np.ndarray,
    comm: CommModel,
    overlap: Overlap | None,
    comm_steps: np.ndarray | None,
) -> np.ndarray:
    """The exchange each step pays (ms): ``comm``'s constant one, or ``comm_steps`` checked,
    ``(steps,)`` or, for ``ssp:S`` and ``async``, ``(steps, workers)``."""
    if comm_steps is None:
        return np.full(c.shape[0], comm.exchange_ms(c.shape[1]))
    if overlap is not None:
        raise UsageError("per-step comm times cannot be combined with --overlap")
    exchange = np.asarray(comm_steps, dtype=float)
    own = strat.kind in ("ssp", "async") and exchange.shape == c.shape
    if (exchange.shape != (c.shape[0],) and not own) or not np.all(exchange >= 0):
        raise UsageError(
            "per-step comm must be one time >= 0 ms per step (ssp:S and async: or one per "
            "worker and step)"
        )
    return exchange


def _check_hosts(strat: SimStrategy, comm: CommModel) -> None:
    """Refuse what ``gradsync run`` refuses on hosts: the hierarchical all-reduce for a strategy
    that does not exchange through it, and hogwild (one shared copy: one host) on several."""
    if comm.hosts is None:
        return
    if comm.hosts.allreduce == "hierarchical" and not takes_hierarchy(strat):
        raise UsageError(
            f"--allreduce hierarchical carries the exchanges of {', '.join(HIERARCHICAL)}; "
            f"{strat.spec} does not exchange through it. Use --allreduce ring with {strat.spec}"
        )
    if strat.kind == "hogwild" and comm.hosts.hosts > 1:
        raise UsageError(
            f"hogwild shares one copy of the parameters within one host, not across "
            f"--hosts {comm.hosts.hosts}; simulate it with --hosts 1 or without --hosts"
        )


def _streaming(
    c: np.ndarray, comm: CommModel, strat: SimStrategy, layers: Sequence[Layer] | None
) -> SimResult:
    # Fragment by fragment (gradsync.sim.streaming): an exchange hides behind the TAU steps
    # after it, and a worker waits at the merge only for what has not finished. The unhidden
    # comm of a step is what even its slowest worker waited; the rest of a wait is idle.
    shares = fragment_shares(layers, strat.fragments, strat.split)
    # Eager outer updates (diloco:H:F:eager) wait for a fragment's exchange where its next one
    # starts, H steps later; their end (each fragment's rest, then one average of the model)
    # is priced as the others' end, one exchange of every fragment.
    plan = Plan(
        period=int(strat.param),
        delay=int(strat.param) if strat.eager else strat.delay,
        costs=tuple(comm.exchange_ms(c.shape[1], s) for s in shares),
        merge_replaces=strat.fragments == 1
        and strat.alpha == 0
        and not strat.eager
        and not strat.keep,
    )
    tl = timeline(c, plan)
    slowest = tl.end.max(axis=1)
    unhidden = np.maximum(tl.release - slowest, 0.0)
    idle = tl.resume - tl.end - unhidden[:, None]
    wall = float(tl.resume[-1].max())
    idle[-1] += wall - tl.resume[-1]  # the fast workers' wait for the last one to finish
    # Staleness: local steps since the last merge of any fragment (t % H for plain DiLoCo).
    last = np.maximum.accumulate(np.where(tl.merged, np.arange(c.shape[0]), -1))
    since = np.arange(c.shape[0]) - np.concatenate(([-1], last[:-1])) - 1
    return SimResult(
        strategy=strat.spec,
        compute_ms=c,
        idle_ms=idle,
        comm_ms=unhidden,
        wall_ms=wall,
        staleness=np.broadcast_to(since[:, None], c.shape).astype(np.int64),
        done_ms=np.maximum.accumulate(tl.resume.max(axis=1)),
        period=plan.period,
    )


def zero_comm_ms(stage: int, comm: CommModel, workers: int) -> tuple[str, float, float]:
    """``(gradient op, its ms, all-gather ms)`` of one ``zero:<stage>`` step.

    ``zero:1`` all-reduces the gradient (as ``bsp``) and ``zero:2`` reduce-scatters it; both
    then all-gather the updated parameters (``comm.nbytes``, a gradient's size). ``zero:3``
    reduce-scatters the gradient and all-gathers the parameters twice, before the forward and
    again before the backward pass (FSDP2 frees them after each); priced unhidden, as gloo on
    CPU runs them (FSDP2's prefetch overlaps them with compute on GPUs).
    """
    op = "allreduce" if stage == 1 else "reducescatter"
    gathers = 2 if stage == 3 else 1
    return op, comm.collective_ms(op, workers), gathers * comm.collective_ms("allgather", workers)


def _zero(c: np.ndarray, comm: CommModel, stage: int, ov: Overlap | None) -> SimResult:
    # The gradient exchange (overlapped with backward under zero:1 --overlap, as bsp's), then
    # the optimizer step on the shard (inside compute: not modelled apart), then the
    # all-gather, which needs the step's result and so is never hidden; then the barrier.
    # The step gate: waited ahead under zero:1/2 (as bsp's), before the forward under zero:3.
    _, grad_ms, gather_ms = zero_comm_ms(stage, comm, c.shape[1])
    spec = f"zero:{stage}"
    gate_ms = _gate_open_ms(comm, c.shape[1])
    if ov is not None:
        bucketed = _bsp_overlap(c, comm, ov)
        assert bucketed.step_ms is not None
        step = bucketed.step_ms + gather_ms
        return _barrier_result(f"{spec}+overlap", c, step, bucketed.comm_ms + gather_ms)
    slowest = c.max(axis=1)
    ready = slowest + gate_ms if stage == 3 else np.maximum(slowest, gate_ms)
    step = ready + grad_ms + gather_ms
    return _barrier_result(spec, c, step, step - slowest)


def _barrier_result(spec: str, c: np.ndarray, step: np.ndarray, unhidden: np.ndarray) -> SimResult:
    slowest = c.max(axis=1)
    return SimResult(
        strategy=spec,
        compute_ms=c,
        idle_ms=slowest[:, None] - c,
        comm_ms=unhidden,
        wall_ms=float(step.sum()),
        staleness=np.zeros(c.shape, dtype=np.int64),
        step_ms=step,
    )


def _gate_open_ms(comm: CommModel, workers: int) -> float:
    """When the step gate opens after the ranks arrive (0 where it is not priced)."""
    return 0.0 if comm.gate is None or workers == 1 else comm.gate.open_ms(workers)


def _bsp(c: np.ndarray, exchange: np.ndarray, gate_ms: float = 0.0) -> SimResult:
    # The gate is waited ahead (gradsync.checks.gate_ahead): the exchange starts once the
    # slowest worker's gradient is ready and the gate has opened.
    slowest = c.max(axis=1)
    step = np.maximum(slowest, gate_ms) + exchange
    return _barrier_result("bsp", c, step, step - slowest)


def _bsp_overlap(c: np.ndarray, comm: CommModel, ov: Overlap) -> SimResult:
    # Bucket i is ready on a worker at (1 - f) c + f c (i + 1) / k; its all-reduce starts when
    # the slowest worker has it and the previous bucket's all-reduce is done (the first one,
    # once the step gate has opened).
    slowest = c.max(axis=1)
    per_bucket = comm.exchange_ms(c.shape[1], 1.0 / ov.buckets)
    finish = np.full_like(slowest, _gate_open_ms(comm, c.shape[1]))
    for i in range(ov.buckets):
        ready = slowest * ((1.0 - ov.backward_frac) + ov.backward_frac * (i + 1) / ov.buckets)
        finish = np.maximum(ready, finish) + per_bucket
    return _barrier_result("bsp+overlap", c, finish, finish - slowest)


def _async(c: np.ndarray, exchange: np.ndarray) -> SimResult:
    # No bound: each worker runs back to back; staleness follows from the finish times.
    end = np.cumsum(c + _by_worker(exchange), axis=0)
    start = np.zeros_like(end)
    start[1:] = end[:-1]
    return _free_running("async", c, exchange, start, end)


def _by_worker(exchange: np.ndarray) -> np.ndarray:
    """``exchange`` as (steps, workers): one time per step for every worker, or each its own."""
    return exchange if exchange.ndim == 2 else exchange[:, None]


def _hogwild(c: np.ndarray) -> SimResult:
    # One host, one shared copy: an update is a write into memory, part of the step's compute,
    # and nothing crosses a link, so the comm model does not apply. Free-running as async, with
    # no exchange at all.
    none = np.zeros(c.shape[0])
    end = np.cumsum(c, axis=0)
    start = np.zeros_like(end)
    start[1:] = end[:-1]
    return _free_running("hogwild", c, none, start, end)


def _ssp(c: np.ndarray, exchange: np.ndarray, bound: float, spec: str) -> SimResult:
    if math.isinf(bound) or bound >= c.shape[0]:
        bound = c.shape[0]  # a bound no worker can reach; the recurrence below still runs
    s = int(bound)
    steps = c.shape[0]
    start = np.empty_like(c)
    end = np.empty_like(c)
    everyone_done = np.empty(steps)  # time by which every worker finished clock t
    prev_end = np.zeros(c.shape[1])
    for t in range(steps):
        # Clock t may read only once every worker has finished clock t - s - 1.
        gate = everyone_done[t - s - 1] if t - s - 1 >= 0 else 0.0
        start[t] = np.maximum(prev_end, gate)
        end[t] = start[t] + (c[t] + exchange[t])  # cumsum's association: ssp:inf == async exactly
        everyone_done[t] = end[t].max()
        prev_end = end[t]
    return _free_running(spec, c, exchange, start, end)


def _free_running(
    spec: str, c: np.ndarray, exchange: np.ndarray, start: np.ndarray, end: np.ndarray
) -> SimResult:
    wall = float(end[-1].max())
    idle = np.empty_like(c)
    idle[0] = start[0]
    idle[1:] = start[1:] - end[:-1]
    idle[-1] += wall - end[-1]
    # min over workers of clocks finished by time x = clocks t whose slowest finish <= x, and
    # the slowest finish is non-decreasing in t, so one searchsorted covers every worker.
    everyone_done = np.maximum.accumulate(end.max(axis=1))
    finished = np.searchsorted(everyone_done, start.ravel(), side="right").reshape(c.shape)
    clock = np.arange(c.shape[0])[:, None]
    # A zero-length step ends when it starts; it still has not finished before it began.
    staleness = clock - np.minimum(finished, clock)
    first_out = float(end[-1].min())
    # tested on the seconds, not the ms: a subnormal ms (5e-324) is 0 once divided by 1000
    seconds = first_out / 1000.0
    steady = float((end <= first_out).sum()) / seconds if seconds > 0 else 0.0
    return SimResult(
        strategy=spec,
        compute_ms=c,
        idle_ms=idle,
        comm_ms=exchange.mean(axis=1) if exchange.ndim == 2 else exchange.copy(),
        wall_ms=wall,
        staleness=staleness.astype(np.int64),
        done_ms=everyone_done,
        steady_throughput=steady,
        final_wait_ms=wall - end[-1],
    )


def _periodic(c: np.ndarray, exchange: np.ndarray, h: int, spec: str) -> SimResult:
    # local:H and diloco:H cost the same: H local steps, then one all-reduce of the parameters
    # (local SGD) or pseudo-gradient (DiLoCo) behind a barrier; a short last round syncs too.
    steps = c.shape[0]
    last_of_round = np.minimum(np.arange(h - 1, steps + h - 1, h), steps - 1)
    rounds = np.add.reduceat(c, np.arange(0, steps, h), axis=0)
    idle = np.zeros_like(c)
    idle[last_of_round] = rounds.max(axis=1)[:, None] - rounds
    comm = np.zeros(steps)
    comm[last_of_round] = exchange[last_of_round]
    step = np.zeros(steps)
    step[last_of_round] = rounds.max(axis=1) + exchange[last_of_round]
    return SimResult(
        strategy=spec,
        compute_ms=c,
        idle_ms=idle,
        comm_ms=comm,
        wall_ms=float(step.sum()),
        staleness=np.broadcast_to((np.arange(steps) % h)[:, None], c.shape).astype(np.int64),
        step_ms=step,
        period=h,
    )


def _gossip(c: np.ndarray, pair_ms: float, final_ms: float, h: int, spec: str) -> SimResult:
    # gossip:H: H local steps, then each worker waits for its partner of the round alone
    # (``gradsync.pairing.partner``) and both pay one pair exchange; no barrier spans
    # the group until the end, where one all-reduce makes the replicas one model.
    steps, workers = c.shape
    clock = np.zeros(workers)  # when each worker is done with everything so far
    idle = np.zeros_like(c)
    comm = np.zeros(steps)
    end = np.empty_like(c)
    for t in range(steps):
        clock = clock + c[t]
        if (t + 1) % h == 0:
            peers = [partner(w, workers, (t + 1) // h - 1) for w in range(workers)]
            ready = np.array([clock[w] if p is None else max(clock[w], clock[p]) for w, p in
                              enumerate(peers)])  # fmt: skip
            paired = np.array([p is not None for p in peers])
            idle[t] += ready - clock
            clock = ready + np.where(paired, pair_ms, 0.0)
            comm[t] = pair_ms if paired.any() else 0.0
        end[t] = clock
    slowest = float(clock.max())
    idle[-1] += slowest - clock  # the final average waits for the slowest worker
    comm[-1] += final_ms
    wall = slowest + final_ms
    everyone_done = np.maximum.accumulate(end.max(axis=1))
    return SimResult(
        strategy=spec,
        compute_ms=c,
        idle_ms=idle,
        comm_ms=comm,
        wall_ms=wall,
        staleness=np.broadcast_to((np.arange(steps) % h)[:, None], c.shape).astype(np.int64),
        done_ms=everyone_done,
        steady_throughput=float(steps * workers) / (float(end[-1].min()) / 1000.0)
        if end[-1].min() > 0
        else 0.0,
    )


def overlap_summary(
    compute_ms: float, comm: CommModel, workers: int, ov: Overlap
) -> dict[str, float]:
    """One step of BSP with and without overlap, for ``simulate --overlap`` on one value."""
    naive_comm = comm.exchange_ms(workers)
    backward = compute_ms * ov.backward_frac
    # Infinitely fine buckets at no per-message latency: communication only needs to keep
    # pace with the backward pass; what exceeds it cannot be hidden.
    best = compute_ms + max(0.0, naive_comm - backward)
    bucketed = _bsp_overlap(np.full((1, workers), float(compute_ms)), comm, ov)
    step_k = float(bucketed.wall_ms)
    return {
        "compute_ms": compute_ms,
        "comm_ms": naive_comm,
        "naive_step_ms": compute_ms + naive_comm,
        "comm_share": naive_comm / (compute_ms + naive_comm) if compute_ms + naive_comm else 0.0,
        "best_overlapped_step_ms": best,
        "best_residual_ms": best - compute_ms,
        "buckets": ov.buckets,
        "backward_frac": ov.backward_frac,
        "bucketed_step_ms": step_k,
        "bucketed_residual_ms": step_k - compute_ms,
    }
