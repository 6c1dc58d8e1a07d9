"""Rank functions for the ZeRO traps of a ported DDP script (issue 42): evaluation on rank 0
under ``zero:3``, torch's ``clip_grad_norm_`` on sharded gradients, rank-0 checkpoints of a
sharded optimizer (module level, so spawned ranks can import them).

``everything`` runs the cases it is given (all of them by default), each on a process group of
its own and catching what it raises, so that one trap that fails does not hide the others; the
forwards on rank 0 alone (the cases that hung before they were detected) come last. The two
that wait out a timeout (``WAITING``) are started in spawns of their own beside the others'
(tests/ranks/test_zero_traps.py), so that their waits overlap. The state dict after an
evaluation runs alone (``state_dict_alone``): where it fails, gloo aborts the process."""

from __future__ import annotations

import copy
import datetime
import functools
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from tests.support import zero3_ranks as z3
from tests.support import zero_ranks as zr

STEPS = 2  # before the evaluation or the checkpoint, and again after it
MAX_NORM = zr.MAX_NORM
#: the gate's bound for a rank in its own code, short so a regression fails in seconds
BETWEEN_S = 2.0
TIMEOUT_S = 15.0
#: each case's group's own collective timeout, which bounds a forward left in FSDP2's
#: all-gather (the user's code keeps it): a regression of the detection fails in seconds
GROUP_TIMEOUT = datetime.timedelta(seconds=20)
#: the front door's own timeout where rank 0 evaluates alone: ranks at different gates are told
#: apart after min(timeout_s, between_steps_timeout_s, max(5 s, 3 heartbeats' silence)), 9 s
#: at TIMEOUT_S and the 5 s floor at this (gradsync.checks.gate, mismatch_s): seconds off the
#: wait, and still far below the between-steps bound (60 s) the test holds it to
FRONT_DOOR_TIMEOUT_S = 5.0


class RootHeld(nn.Module):
    """The ``mlp`` workload's student (Linear, Tanh, Linear, Tanh, Linear: the same numbers)
    with its first and last layers held by the root module, as a GPT's embeddings and head
    are: under ``zero:3`` the root is then an FSDP2 unit of its own, which FSDP2 leaves
    gathered after a forward."""

    def __init__(self, student: nn.Sequential) -> None:
        super().__init__()
        self.first, self.middle, self.last = student[0], nn.ModuleList([student[2]]), student[4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle[0](torch.tanh(self.first(x)))))


def _model(w: Any) -> nn.Module:
    return RootHeld(w.build_model())


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _build(
    spec: str, group: Any, units_only: bool = False, **kw: Any
) -> tuple[Any, nn.Module, torch.optim.Optimizer, gs.Synchronizer]:
    w = zr._workload()
    model = w.build_model() if units_only else _model(w)
    opt = zr.make_optimizer("adamw", model)
    kw.setdefault("timeout_s", TIMEOUT_S)
    return w, model, opt, gs.Synchronizer(model, opt, strategy=spec, group=group, **kw)


def _train(sync: gs.Synchronizer, w: Any, model: nn.Module, steps: range, rank: int) -> None:
    for step in steps:
        with sync.step():
            w.loss(model, *zr._batch(w, step, rank, sync.world_size)).backward()


def _eval_batch(w: Any, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return w.batch(99, zr.PER_RANK * world, 0, zr.PER_RANK * world)


def reference(world: int, steps: int, clip: bool = False) -> dict[str, Any]:
    """One process on the global batch (AdamW, the two param groups): the model's and the
    optimizer's state dicts after ``steps`` steps, and the evaluation loss after STEPS."""
    w = zr._workload()
    model = _model(w)
    opt = zr.make_optimizer("adamw", model)
    gb = zr.PER_RANK * world
    evaluated = None
    for step in range(steps):
        if step == STEPS:
            with torch.no_grad():
                evaluated = float(w.loss(model, *_eval_batch(w, world)))
        opt.zero_grad()
        w.loss(model, *w.batch(step, gb, 0, gb)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "evaluated": evaluated}


def continue_ddp_style(state: dict[str, Any], world: int, steps: range) -> dict[str, Any]:
    """What a DDP script's resume does with a rank-0 checkpoint: a plain model and optimizer
    load it, and training goes on (one process on the global batch here)."""
    w = zr._workload()
    model = _model(w)
    opt = zr.make_optimizer("adamw", model)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    gb = zr.PER_RANK * world
    for step in steps:
        opt.zero_grad()
        w.loss(model, *w.batch(step, gb, 0, gb)).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


# -- trap 1: evaluation between steps under zero:3 ----------------------------------------------


def evaluation_on_rank_0(
    rank: int, world: int, group: Any, units_only: bool = False
) -> dict[str, Any]:
    """Rank 0 evaluates alone inside ``sync.unsharded()`` (entered on every rank), three
    forwards; then training goes on. Its loss must be the whole model's, and training after it
    the trajectory of a run that never evaluated. ``units_only``: the plain student, whose root
    holds no parameter of its own, so each Linear is an FSDP2 unit that reshards after its
    forward, and the evaluation's forwards are in FSDP2's record for its backward prefetch."""
    w, model, _, sync = _build(
        "zero:3", group, units_only=units_only, between_steps_timeout_s=BETWEEN_S
    )
    out: dict[str, Any] = {"error": None, "losses": [], "params": None, "after_state_dict": None}
    try:
        _train(sync, w, model, range(STEPS), rank)
        with sync.unsharded():
            if rank == 0:
                with torch.no_grad():
                    for _ in range(3):
                        out["losses"].append(float(w.loss(model, *_eval_batch(w, world))))
                    model.state_dict()  # FSDP2 puts this rank's parameters back to shards
                    try:  # a forward now would gather alone: refused, not hung
                        w.loss(model, *_eval_batch(w, world))
                    except Exception as exc:  # noqa: BLE001 - the test reads it
                        out["after_state_dict"] = _error(exc)
            else:
                time.sleep(0.5)  # rank 1 reaches the next step's gate first
        _train(sync, w, model, range(STEPS, 2 * STEPS), rank)
        out["params"] = z3.full(model)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    finally:
        sync.close()
    return out


def state_dict_after_evaluation(rank: int, world: int, group: Any) -> dict[str, Any]:
    """Every rank evaluates (a no-grad forward between steps, which FSDP2 leaves with the
    root's parameters gathered), then rank 0 alone calls ``model.state_dict()`` (which puts
    them back to shards on rank 0 only): the next step must still find the ranks in the same
    collectives."""
    w, model, _, sync = _build("zero:3", group)
    out: dict[str, Any] = {"error": None, "params": None, "evaluated": None}
    try:
        _train(sync, w, model, range(STEPS), rank)
        with torch.no_grad():
            out["evaluated"] = float(w.loss(model, *_eval_batch(w, world)))
        if rank == 0:
            model.state_dict()
        _train(sync, w, model, range(STEPS, 2 * STEPS), rank)
        out["params"] = z3.full(model)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    finally:
        sync.close()
    return out


def forward_on_rank_0_alone(rank: int, world: int, group: Any) -> dict[str, Any]:
    """Rank 0 runs a forward of the sharded model between steps without ``sync.unsharded()``;
    rank 1 goes on to the next step. Both must fail, naming ``sync.unsharded()``, rather than
    sit in different collectives."""
    w, model, _, sync = _build("zero:3", group, between_steps_timeout_s=BETWEEN_S)
    out: dict[str, Any] = {"error": None}
    try:
        _train(sync, w, model, range(1), rank)
        if rank == 0:
            with torch.no_grad():
                w.loss(model, *_eval_batch(w, world))
        else:
            _train(sync, w, model, range(1, 2), rank)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    finally:
        sync.close()
    return out


class WithBuffer(RootHeld):
    """``RootHeld`` with a buffer, which the front door broadcasts from rank 0 at the first
    forward of each step, as DDP does (another collective outside the step block)."""

    def __init__(self, student: nn.Sequential) -> None:
        super().__init__(student)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def front_door_forward_on_rank_0_alone(rank: int, world: int, group: Any) -> dict[str, Any]:
    """The front door (``gs.DistributedDataParallel``) with two micro-batches a step and a
    buffer: after a step, rank 0 evaluates the raw module alone, without
    ``sync.unsharded()``, while rank 1 goes on to the next step's first micro-batch (under
    ``no_sync()``: its buffer broadcast and its forward are collectives outside the step
    block). Both must fail within seconds naming ``sync.unsharded()``: before, rank 1's
    no_sync() forward paired its gathers with rank 0's evaluation, or its buffer broadcast left
    rank 0 waiting for a rank in its own code, up to ``between_steps_timeout_s``."""
    w = zr._workload()
    raw = WithBuffer(w.build_model())
    opt = zr.make_optimizer("adamw", raw)
    model = gs.DistributedDataParallel(
        raw,
        optimizer=opt,
        strategy="zero:3",
        process_group=group,
        timeout_s=FRONT_DOOR_TIMEOUT_S,
        between_steps_timeout_s=60.0,  # the mismatch, not this bound, must end the wait
    )
    out: dict[str, Any] = {"error": None, "seconds": None}

    def micro_batches(step: int) -> None:
        x, y = zr._batch(w, step, rank, world)
        with model.no_sync():
            w.loss(model, x[:3], y[:3]).backward()
        w.loss(model, x[3:], y[3:]).backward()
        opt.step()
        opt.zero_grad()

    try:
        micro_batches(0)
        started = time.monotonic()
        try:
            if rank == 0:
                with torch.no_grad():
                    model.module(_eval_batch(w, world)[0])
            else:
                micro_batches(1)
        finally:
            out["seconds"] = time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    finally:
        model.sync.close()
    return out


# -- trap 3: torch's clip_grad_norm_ on sharded gradients ---------------------------------------


def torch_clip(rank: int, world: int, spec: str, over: str, group: Any) -> dict[str, Any]:
    """torch's own ``clip_grad_norm_`` at the gradient-ready point, over ``over``: the model's
    parameters, or the tensors the optimizer steps (this rank's shards under zero:3). Either
    gradsync refuses it, or the step is the one a single process clipping the whole gradient
    makes."""
    w, model, opt, sync = _build(spec, group)
    params = (
        list(model.parameters())
        if over == "model"
        else [p for g in opt.param_groups for p in g["params"]]
    )
    out: dict[str, Any] = {"error": None, "params": None}
    try:
        for step in range(STEPS):
            with sync.step() as s:
                w.loss(model, *zr._batch(w, step, rank, world)).backward()
                s.synchronize()
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        out["params"] = z3.full(model)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    try:  # s.clip_grad_norm_ still works after a refusal
        with sync.step() as s:
            w.loss(model, *zr._batch(w, STEPS, rank, world)).backward()
            s.clip_grad_norm_(MAX_NORM)
        out["handle_after"] = True
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["handle_after"] = _error(exc)
    finally:
        sync.close()
    return out


# -- trap 4: rank-0 checkpoints of a sharded optimizer ------------------------------------------


def _every_rank_has(state: dict[str, Any] | None, group: Any) -> dict[str, Any]:
    """Rank 0's state on every rank, as when every rank ``torch.load``s rank 0's file (a copy:
    torch's ``load_state_dict`` keeps the tensors it is given where it can)."""
    box = [copy.deepcopy(state)]
    dist.broadcast_object_list(box, src=0, group=group)
    assert box[0] is not None
    return box[0]


def checkpoint(rank: int, world: int, spec: str, group: Any) -> dict[str, Any]:
    """STEPS steps; then ``optimizer.state_dict()`` on this rank alone (gradsync must refuse a
    shard passed off as the whole), ``sync.full_state_dict()`` (rank 0's is checked by the
    test and loaded DDP-style there), and a fresh model, optimizer and Synchronizer resumed
    from it with ``sync.load_full_state_dict`` for STEPS more steps."""
    w, model, opt, sync = _build(spec, group)
    out: dict[str, Any] = {"partial": None, "error": None}
    try:
        _train(sync, w, model, range(STEPS), rank)
        try:
            opt.state_dict()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["partial"] = _error(exc)
        state = sync.full_state_dict()
        out["full"] = state
        out["full_on_others"] = state is None if rank else None
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
        return out
    finally:
        sync.close()
    try:
        w, model, opt, sync = _build(spec, group)
        sync.load_full_state_dict(_every_rank_has(out["full"] if rank == 0 else None, group))
        _train(sync, w, model, range(STEPS, 2 * STEPS), rank)
        out["resumed"] = sync.full_state_dict()
        sync.close()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    return out


def state_dict_alone(rank: int, world: int) -> dict[str, Any]:
    """``state_dict_after_evaluation`` in a spawn of its own: where it fails, gloo finds the
    ranks' collectives mismatched and aborts the process."""
    return state_dict_after_evaluation(rank, world, None)


def front_door_unsharded_between_accumulations(rank: int, world: int, group: Any) -> dict[str, Any]:
    """The front door with two micro-batches a step (the first under ``no_sync()``), and after
    each step ``model.sync.unsharded()`` entered on every rank with rank 0 evaluating inside it,
    as docs/porting.md says: three steps end, and the ranks agree. Before, the next step's
    ``no_sync()`` backward on rank 0 prefetched an all-gather rank 1 never posted (FSDP2's
    record of the forwards, which only a backward or the step's start emptied), and both waited
    until a timeout."""
    w = zr._workload()
    raw = w.build_model()
    opt = zr.make_optimizer("adamw", raw)
    model = gs.DistributedDataParallel(
        raw, optimizer=opt, strategy="zero:3", process_group=group, timeout_s=TIMEOUT_S
    )
    out: dict[str, Any] = {"error": None, "steps": 0, "full": None}
    try:
        for step in range(3):
            x, y = zr._batch(w, step, rank, world)
            with model.no_sync():
                w.loss(model, x[:3], y[:3]).backward()
            w.loss(model, x[3:], y[3:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with model.sync.unsharded():
                if rank == 0:
                    with torch.no_grad():
                        model.module(_eval_batch(w, world)[0])
            out["steps"] = step + 1
        full = model.sync.full_state_dict()  # on every rank; rank 0's alone holds it
        out["full"] = None if full is None else full["model"]
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = _error(exc)
    finally:
        model.sync.close()
    return out


#: every case of ``everything``, in its order
CASES = (
    "evaluation",
    "evaluation units only",
    *(f"clip {spec} {over}" for spec in ("zero:2", "zero:3") for over in ("model", "optimizer")),
    *(f"checkpoint {spec}" for spec in ("zero:1", "zero:2", "zero:3")),
    "forward alone",
    "front door forward alone",
    "front door unsharded between accumulations",
)
#: the cases that fail only after a timeout (seconds of waiting, not of work)
WAITING = ("forward alone", "front door forward alone")


def everything(rank: int, world: int, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every other case, or those ``names`` (in this order), each on a group of its own: a
    case that leaves its collectives broken (a trap that hangs until a timeout) leaves the
    others' connections whole."""
    cases: dict[str, Any] = {
        "evaluation": functools.partial(evaluation_on_rank_0, rank, world),
        "evaluation units only": functools.partial(
            evaluation_on_rank_0, rank, world, units_only=True
        ),
    }
    for spec in ("zero:2", "zero:3"):
        for over in ("model", "optimizer"):
            cases[f"clip {spec} {over}"] = functools.partial(torch_clip, rank, world, spec, over)
    for spec in ("zero:1", "zero:2", "zero:3"):
        cases[f"checkpoint {spec}"] = functools.partial(checkpoint, rank, world, spec)
    cases["forward alone"] = functools.partial(forward_on_rank_0_alone, rank, world)
    cases["front door forward alone"] = functools.partial(
        front_door_forward_on_rank_0_alone, rank, world
    )
    cases["front door unsharded between accumulations"] = functools.partial(
        front_door_unsharded_between_accumulations, rank, world
    )
    assert tuple(cases) == CASES, (tuple(cases), CASES)
    if names is not None:
        cases = {name: case for name, case in cases.items() if name in names}
        assert len(cases) == len(names), (sorted(cases), names)
    out = {}
    for name, case in cases.items():
        # A case that failed may have left one rank seconds behind the other: meet on the
        # default group (whose timeout is long) before making the next case's group.
        dist.barrier()
        try:
            out[name] = case(dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - a case that broke its own group (close())
            out[name] = {"error": f"outside the case's own checks: {_error(exc)}"}
    return out
