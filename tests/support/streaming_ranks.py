"""Rank functions for the streaming DiLoCo tests (module level, so spawned ranks import them),
and the single-process float64 reference they are checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import gradsync as gs
from gradsync.strategies import DiLoCo
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

PER_RANK = 4
PARAMS = 3000  # the mlp: Linear 64 -> 27, 27 -> 27, 27 -> 16
#: the model's tensors (w0, b0, w1, b1, w2, b2) of each fragment for F=2 under the layers
#: split: two fragments hold layers {0, 2} and {1}
FRAGMENTS_OF_TWO = ([0, 1, 4, 5], [2, 3])
#: each fragment's (tensor, first row, end row) for F=2 under the rows split, worked out by
#: hand from the rule: every tensor (27 or 16 rows) is cut in two; of 27 rows the fragment with
#: fewer elements so far takes 14 (ties to fragment 0): w0 14 to fragment 0 (896 to 832
#: elements), then b0, w1 and b1 14 to fragment 1 (909 to 846, 1260 to 1224, 1273 to 1238);
#: w2 and b2 split 8 and 8 (1497 to 1462, of 2959)
ROWS_OF_TWO = (
    [(0, 0, 14), (1, 0, 13), (2, 0, 13), (3, 0, 13), (4, 0, 8), (5, 0, 8)],
    [(0, 14, 27), (1, 13, 27), (2, 13, 27), (3, 13, 27), (4, 8, 16), (5, 8, 16)],
)
#: the tensors' rows (first dimensions), for whole tensors as blocks
ROWS = (27, 27, 27, 27, 16, 16)


def whole(fragments: tuple[list[int], ...]) -> list[list[tuple[int, int, int]]]:
    """Fragments of whole tensors (the layers split) as blocks of all their rows."""
    return [[(i, 0, ROWS[i]) for i in tensors] for tensors in fragments]


def _workload(dtype: str = "float64") -> Any:
    return make_workload("mlp", seed=5, params=PARAMS, dtype=dtype)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # momentum: the inner optimizer's own state keeps running through the exchanges
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(
    rank: int,
    world: int,
    strategy: Any,
    steps: int,
    *,
    compression: str | None = None,
    dtype: str = "float64",
    record_spans: bool = False,
    foreach_outer: bool = False,
) -> dict[str, Any]:
    """Train the mlp; return the parameters after every step, the final (post-``report()``)
    ones, the losses, each step's bytes and barrier flag, and (``record_spans``) the
    exchanges' timeline spans as (step, name, seconds)."""
    w = _workload(dtype)
    model = w.build_model()
    sync = gs.Synchronizer(
        model,
        _optimizer(model),
        strategy=strategy,
        compression=compression,
        timeout_s=30,
        record_spans=record_spans,
    )
    if foreach_outer:
        # the outer SGD's foreach path, a GPU's default: it adds the Nesterov momentum into
        # the gradient in place (an eager round's kept share was corrupted so)
        st = sync.strategy
        st._outer_opt = torch.optim.SGD(
            st._globals, lr=0.7, momentum=0.9, nesterov=True, foreach=True
        )
    after, losses = [], []
    for step in range(steps):
        with sync.step(samples=PER_RANK):
            lo = rank * PER_RANK
            x, y = w.batch(step, PER_RANK * world, lo, lo + PER_RANK)
            loss = w.loss(model, x, y)
            loss.backward()
        losses.append(float(loss.detach()))
        after.append(flat_params(model))
    report = sync.report()
    mine = [r for r in report.records if r.rank == rank]
    return {
        "after": after,
        "params": flat_params(model),
        "losses": losses,
        "bytes": [r.bytes for r in mine],
        "barrier": [r.barrier for r in mine],
        "spans": [(s.step, s.name, s.dur) for s in sync.spans if s.name not in ("compute", "sync")],
    }


def scenarios(rank: int, world: int) -> dict[str, Any]:
    """Every multi-rank scenario of test_streaming_diloco, in one launch of the ranks."""
    return {
        "plain": train(rank, world, "diloco:4", 12),
        "one fragment": train(rank, world, DiLoCo(4, fragments=1, delay=0, alpha=0.0), 12),
        "reference": train(rank, world, "diloco:4:2:1:0.25", 12),
        "alpha 0": train(rank, world, "diloco:4:2:1", 12),
        # the local steps taken while an exchange was in flight kept (TAU 1 and 2)
        "keep": train(rank, world, "diloco:4:2:1:keep", 12),
        "keep, one fragment": train(rank, world, DiLoCo(4, delay=2, keep_local=True), 12),
        "no delay": train(rank, world, DiLoCo(4, fragments=2, delay=0), 12),
        "layers": train(rank, world, "diloco:4:2:1:0.25:layers", 12),
        "layers alpha 0": train(rank, world, DiLoCo(4, fragments=2, split="layers"), 12),
        "learns": train(rank, world, "diloco:8:3", 48, dtype="float32"),
        # PowerSGD reads each tensor's shape: under the rows split, the shapes of row blocks
        "powersgd": train(rank, world, "diloco:4:2", 48, compression="powersgd:2", dtype="float32"),
        "int8": train(rank, world, "diloco:4:2", 48, compression="int8", dtype="float32"),
        "topk": train(rank, world, "diloco:4:2", 48, compression="topk:0.3", dtype="float32"),
        "int4": train(rank, world, "diloco:4:2", 48, compression="int4", dtype="float32"),
        # "alpha 0" and "plain" again, their exchanges timed on the timeline (issue 46)
        "alpha 0, spans": train(rank, world, "diloco:4:2:1", 12, record_spans=True),
        "plain, spans": train(rank, world, "diloco:4", 12, record_spans=True),
        # eager outer updates (gradsync.strategies.eager), against reference_eager
        "eager": train(rank, world, "diloco:4:2:eager", 12),
        "eager, one fragment": train(rank, world, DiLoCo(4, eager=True), 12),
        "eager, foreach": train(rank, world, "diloco:4:2:eager", 12, foreach_outer=True),
        "eager int8": train(
            rank, world, "diloco:4:2:eager", 48, compression="int8", dtype="float32"
        ),
    }


def resumed(rank: int, world: int, directory: str, strategy: str) -> dict[str, Any]:
    """Under ``strategy`` with int8 and with topk (error feedback): train 12 steps straight;
    train 6, save (an exchange in flight) and continue to step 12; and resume a fresh run from
    that checkpoint to step 12."""
    return {
        spec: _resumed(rank, world, str(Path(directory) / spec), strategy, spec)
        for spec in ("int8", "topk:0.3")
    }


def resumed_eager(rank: int, world: int, directory: str) -> dict[str, Any]:
    """``resumed``'s three runs under eager outer updates with int8 (error feedback), the
    checkpoint taken after step 5, where fragment 0's second round has just started."""
    return _resumed(rank, world, directory, "diloco:4:2:eager", "int8")


def _resumed(rank: int, world: int, directory: str, strategy: str, compression: str) -> Any:
    straight = train(rank, world, strategy, 12, compression=compression)["params"]
    runs = {}
    for name in ("continued", "resumed"):
        w = _workload()
        model = w.build_model()
        sync = gs.Synchronizer(
            model, _optimizer(model), strategy=strategy, compression=compression, timeout_s=30
        )
        start = 0
        if name == "resumed":
            loaded = sync.load(directory)
            assert loaded is not None
            start = loaded["step"]
        for step in range(start, 12):
            with sync.step(samples=PER_RANK):
                lo = rank * PER_RANK
                x, y = w.batch(step, PER_RANK * world, lo, lo + PER_RANK)
                w.loss(model, x, y).backward()
            if name == "continued" and step == 5:
                saved = sync.state_dict()["strategy"]
                sync.save(directory)
        sync.report()
        # Closed, as a script would: the writer process of "continued" otherwise lives on, and
        # the load of "resumed" waits for it (up to half the timeout, 15 s) before it reads.
        sync.close()
        runs[name] = flat_params(model)
    return {
        "straight": straight,
        **runs,
        "pending": saved["streaming"]["pending"],
        "eager": saved.get("eager"),
        # error feedback keeps one residual per fragment (the bucket index of its exchange)
        "residuals": sorted(saved["compressor"].get("residuals", {})),
    }


# -- the float64 reference ---------------------------------------------------------------------


def _fragment_access(
    tensors: list[list[torch.Tensor]], fragments: list[list[tuple[int, int, int]]]
) -> tuple[Any, Any]:
    """``frag(r, p)``: worker r's fragment p, flat (a copy); ``put(r, p, flat)``: written back
    into worker r's tensors, block by block of rows."""

    def frag(r: int, p: int) -> torch.Tensor:
        return torch.cat([tensors[r][i].detach()[a:b].reshape(-1) for i, a, b in fragments[p]])

    def put(r: int, p: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i, a, b in fragments[p]:
                t = tensors[r][i][a:b]
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    return frag, put


def _local_steps(w: Any, models: list[Any], opts: list[Any], step: int) -> None:
    """Every simulated worker's inner SGD step ``step`` on its own shard of the batch."""
    world = len(models)
    for r in range(world):
        opts[r].zero_grad()
        x, y = w.batch(step, PER_RANK * world, r * PER_RANK, (r + 1) * PER_RANK)
        w.loss(models[r], x, y).backward()
        opts[r].step()


def reference(
    world: int,
    period: int,
    fragments: list[list[tuple[int, int, int]]],
    delay: int,
    alpha: float,
    steps: int,
    *,
    keep: bool = False,
) -> list[torch.Tensor]:
    """``world`` workers simulated in one process, written from the algorithm's description,
    not from the strategy's code: each worker takes its SGD steps on its own shard; fragment p
    starts its exchange after the steps where ``(step + 1) % period == (p + 1) * period //
    F % period``, with the pseudo-gradient (global minus local) of that moment; TAU steps
    later the mean pseudo-gradient goes through Nesterov SGD (lr 0.7, momentum 0.9) and each
    worker's fragment becomes ``alpha * local + (1 - alpha) * global`` (``keep``: ``global +
    local - sent``, ``sent`` being the worker's fragment when the exchange started). At the
    end, pending exchanges are applied, then every fragment once more, replaced by its global copy.
    ``fragments``: each fragment's blocks of rows, ``(tensor, first row, end row)``.
    Returns each worker's final parameters, flat."""
    w = _workload()
    models = [w.build_model() for _ in range(world)]
    opts = [_optimizer(m) for m in models]
    tensors = [list(m.parameters()) for m in models]
    count = len(fragments)

    frag, put = _fragment_access(tensors, fragments)

    global_ = [frag(0, p).clone() for p in range(count)]
    momentum: list[torch.Tensor | None] = [None] * count
    # (fragment, due step, mean, each worker's fragment at the start)
    pending: list[tuple[int, int, torch.Tensor, list[torch.Tensor]]] = []

    def outer(p: int, mean: torch.Tensor, mix: float, sent: list[torch.Tensor] | None) -> None:
        buf = momentum[p]
        buf = mean.clone() if buf is None else buf.mul(0.9).add(mean)
        momentum[p] = buf
        global_[p] = global_[p] - 0.7 * (mean + 0.9 * buf)
        for r in range(world):
            if sent is not None:
                put(r, p, global_[p] + (frag(r, p) - sent[r]))
            else:
                put(r, p, mix * frag(r, p) + (1 - mix) * global_[p])

    for step in range(steps):
        _local_steps(w, models, opts, step)
        for p in range(count):
            if (step + 1) % period == (p + 1) * period // count % period:
                mean = sum(global_[p] - frag(r, p) for r in range(world)) / world
                pending.append((p, step + delay, mean, [frag(r, p).clone() for r in range(world)]))
        for p, _, mean, sent in [e for e in pending if e[1] == step]:
            outer(p, mean, alpha, sent if keep else None)
        pending = [e for e in pending if e[1] != step]
    for p, _, mean, sent in pending:
        outer(p, mean, alpha, sent if keep else None)
    for p in range(count):
        outer(p, sum(global_[p] - frag(r, p) for r in range(world)) / world, 0.0, None)
    return [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in tensors]


def reference_eager(
    world: int, period: int, fragments: list[list[tuple[int, int, int]]], steps: int
) -> torch.Tensor:
    """Eager outer updates simulated in one process, written from the algorithm's description
    (Kale et al., 2025; ``gradsync.strategies.eager``'s docstring), not from the strategy's
    code: fragments start on streaming DiLoCo's schedule; at each start worker r's outer step
    (Nesterov SGD, lr 0.7, momentum 0.9, each worker its own) takes ``own_r / W`` plus, from
    the fragment's previous start on, ``mean_before - own_r_before / W`` (the previous start's
    mean less the share taken of it then). At the end each fragment's last rest is applied
    the same way, then the workers' parameters are averaged. Returns the final parameters,
    flat (the same on every worker)."""
    w = _workload()
    models = [w.build_model() for _ in range(world)]
    opts = [_optimizer(m) for m in models]
    tensors = [list(m.parameters()) for m in models]
    count = len(fragments)

    frag, put = _fragment_access(tensors, fragments)

    global_ = [[frag(r, p).clone() for p in range(count)] for r in range(world)]
    momentum: list[list[torch.Tensor | None]] = [[None] * count for _ in range(world)]
    #: per fragment: each worker's pseudo-gradient at its last start, and their mean
    last: list[tuple[list[torch.Tensor], torch.Tensor] | None] = [None] * count

    def outer(r: int, p: int, gradient: torch.Tensor) -> None:
        buf = momentum[r][p]
        buf = gradient.clone() if buf is None else buf.mul(0.9).add(gradient)
        momentum[r][p] = buf
        global_[r][p] = global_[r][p] - 0.7 * (gradient + 0.9 * buf)
        put(r, p, global_[r][p])

    def rest(p: int, r: int) -> torch.Tensor:
        before = last[p]
        return 0 * global_[r][p] if before is None else before[1] - before[0][r] / world

    for step in range(steps):
        _local_steps(w, models, opts, step)
        for p in range(count):
            if (step + 1) % period == (p + 1) * period // count % period:
                owns = [global_[r][p] - frag(r, p) for r in range(world)]
                for r in range(world):
                    outer(r, p, owns[r] / world + rest(p, r))
                last[p] = (owns, sum(owns) / world)
    for p in range(count):
        if last[p] is not None:
            for r in range(world):
                outer(r, p, rest(p, r))
    flats = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in tensors]
    return sum(flats) / world
