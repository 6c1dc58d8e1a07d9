"""Parameter-server pieces that need no process group: sharding, the servers' optimizer, the
validation of ``--servers``, and what a server's checkpoint keeps."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.strategies.ps import shard_by_size
from gradsync.strategies.ps_server import (
    CHECKPOINTS_SAVED,
    ServerStats,
    _Server,
    _server_optimizer,
)
from gradsync.strategies.ps_wire import CHECKPOINT, GRADIENT, SAVED, ShardPlan

pytestmark = pytest.mark.unit

# -- shard_by_size --------------------------------------------------------------------------


def test_shard_by_size_places_largest_first_on_the_least_loaded_server() -> None:
    # 100 -> s0; 60 -> s1; 50 -> s1 (60 < 100); 40 -> s0 (100 < 110); 10 -> s1 (110 < 140)
    assert shard_by_size([10, 100, 50, 60, 40], 2) == [[1, 4], [0, 2, 3]]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40),
    servers=st.integers(1, 8),
)
def test_shard_by_size_every_tensor_once_balanced_and_deterministic(
    sizes: list[int], servers: int
) -> None:
    shards = shard_by_size(sizes, servers)
    assert len(shards) == servers
    assert sorted(i for shard in shards for i in shard) == list(range(len(sizes)))  # each once
    assert all(shard == sorted(shard) for shard in shards)
    loads = [sum(sizes[i] for i in shard) for shard in shards]
    # Greedy onto the least loaded: no server exceeds another by more than one tensor's size.
    assert max(loads) - min(loads) <= max(sizes)
    if servers <= len(sizes):
        assert all(shards)  # nobody is left without a tensor
    assert shard_by_size(list(sizes), servers) == shards  # same input, same layout


# -- the servers' optimizer -----------------------------------------------------------------


def _model_and_groups() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    w0, b0, w1, b1 = model.parameters()
    opt = torch.optim.SGD(
        [
            {"params": [w0, w1], "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
            {"params": [b0], "lr": 0.5, "momentum": 0.0, "nesterov": False},
        ],
        lr=1.0,
    )
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to every group
    return model, opt


def test_server_optimizer_keeps_each_parameters_group() -> None:
    model, user = _model_and_groups()
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    group_of = [0, 1, 0, -1]  # w0, b0, w1 in their groups; b1 in none
    server, source = _server_optimizer(user, params, group_of)
    assert server is not None and type(server) is torch.optim.SGD
    assert source == [0, 1]
    first, second = server.param_groups
    assert [id(p) for p in first["params"]] == [id(params[0]), id(params[2])]
    assert [id(p) for p in second["params"]] == [id(params[1])]
    assert (first["lr"], first["momentum"], first["weight_decay"]) == (0.1, 0.9, 0.01)
    assert (second["lr"], second["momentum"], second["weight_decay"]) == (0.5, 0.0, 0.0)
    assert "initial_lr" not in first  # a scheduler's bookkeeping, not a hyper-parameter
    # b1 is in no group of the user's optimizer: the server never updates it either
    assert all(id(p) != id(params[3]) for g in server.param_groups for p in g["params"])


def test_server_optimizer_is_none_for_a_shard_outside_every_group() -> None:
    model, user = _model_and_groups()
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    assert _server_optimizer(user, params[3:], [-1]) == (None, [])


# -- validation of --servers ----------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bsp", "local:4", "diloco:8"])
def test_servers_with_a_strategy_that_has_none_is_refused(strategy: str) -> None:
    with pytest.raises(UsageError, match=rf"--servers 2 is for .*ssp:S, async.*{strategy}"):
        RunConfig(strategy=strategy, servers=2, out="unused")
    with pytest.raises(UsageError, match=rf"servers=2 is for .*strategy {strategy} runs no"):
        gs.parse_strategy(strategy, servers=2)
    RunConfig(strategy=strategy, out="unused")  # the default (1) is fine


def test_more_servers_than_parameter_tensors_is_refused_naming_the_count() -> None:
    # the mlp workload has 6 trainable tensors (3 layers: weight and bias each)
    with pytest.raises(UsageError, match="--servers 7 is more than the 6 trainable parameter"):
        RunConfig(strategy="async", workload="mlp", servers=7, nproc=1, out="unused")
    RunConfig(strategy="async", workload="mlp", servers=6, nproc=1, out="unused")


def test_a_server_checkpoint_keeps_only_the_newest_checkpoint_steps() -> None:
    # With a checkpoint every step, keeping every earlier checkpoint's step made each one of a
    # long run larger than the one before. A server without a process group: only the fields
    # state_dict reads.
    server = object.__new__(_Server)
    server.params, server.optimizer = [torch.ones(3)], None
    server.pushed, server.fresh_through = [5000, 5000], [4999, 4999]
    server.stats = ServerStats(server_rank=2, checkpoints=list(range(1, 5001)))
    state = server.state_dict()
    assert state["checkpoints"] == list(range(5001 - CHECKPOINTS_SAVED, 5001))
    assert len(server.stats.checkpoints) == 5000  # this process's own record stays whole
    assert state["params"][0] is not None and state["pushed"] == [5000, 5000]


# -- control messages -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_control_words_come_back_and_fit_a_tiny_models_receive(dtype: torch.dtype) -> None:
    # A model of one scalar: its push (1 element) is shorter than a checkpoint request's
    # two words, so the server's receive must be sized for the longer of the two.
    model = torch.nn.Linear(1, 1, bias=False).to(dtype)
    ctx = SimpleNamespace(
        group=None,
        compressor=SimpleNamespace(spec="none"),
        layout=SimpleNamespace(workers=2),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    plan = ShardPlan(ctx, 1, timeout_s=5)  # type: ignore[arg-type]
    lrs = torch.tensor([0.1], dtype=torch.float64)
    msg = plan.control(0, CHECKPOINT, lrs, (1, -(2**62)))
    assert msg.dtype == dtype and msg.numel() <= plan.receive_numel(0)
    received = torch.full((plan.receive_numel(0),), 7, dtype=dtype)
    received[: msg.numel()] = msg
    assert float(received[0]) == CHECKPOINT
    assert plan.read_lrs(received) == [0.1]
    assert plan.read_words(0, received, 2) == [1, -(2**62)]
    with pytest.raises(ValueError, match="at most 2 words"):
        plan.control(0, CHECKPOINT, lrs, (1, 2, 3))


def _waiting_server(
    pushed: list[int], requested: list[bool], checkpoints: list[int]
) -> tuple[_Server, list[Any]]:
    """A server without a process group: its workers' clocks and requests, the steps of its
    checkpoints so far; and the states its checkpoint callback was handed."""
    server = object.__new__(_Server)
    server.params, server.optimizer = [torch.ones(3)], None
    server.workers = len(pushed)
    server.pushed, server.fresh_through = list(pushed), [c - 1 for c in pushed]
    server.requested, server.done = list(requested), [False] * len(pushed)
    server.stats = ServerStats(server_rank=len(pushed), checkpoints=list(checkpoints))
    server.where = 5
    taken: list[Any] = []
    server.checkpoint = lambda state, **request: taken.append((state["pushed"], request))
    return server, taken


def test_a_worker_lost_after_its_save_still_gets_that_step_checkpointed() -> None:
    # Worker 1 saved after its 7th push, then died before the message that would have asked
    # (with a checkpoint every step a request rides on the next message): the server's state
    # holds 7 pushes of each, the checkpoint of step 7.
    server, taken = _waiting_server([7, 7, 7], [True, False, False], [6])
    server.checkpoint_on_loss(1)
    assert taken == [([7, 7, 7], {"durable": False, "where": 5})]
    assert server.stats.checkpoints == [6, 7]
    # Nobody has asked yet, but the last checkpoint was of the step before: saving every step.
    server, taken = _waiting_server([7, 7, 7], [False, False, False], [6])
    server.checkpoint_on_loss(1)
    assert len(taken) == 1
    # Not when the lost worker is behind (it never got to save that step)...
    server, taken = _waiting_server([7, 6, 7], [True, False, True], [6])
    server.checkpoint_on_loss(1)
    assert taken == []
    # ...nor when saves are steps apart and nobody asked, nor when the step is already taken.
    server, taken = _waiting_server([7, 7, 7], [False, False, False], [5])
    server.checkpoint_on_loss(1)
    assert taken == []
    server, taken = _waiting_server([7, 7, 7], [True, False, True], [6, 7])
    server.checkpoint_on_loss(1)
    assert taken == []


def test_a_request_queued_behind_the_loss_counts() -> None:
    server, taken = _waiting_server([7, 7, 7], [False, False, False], [5])
    receivers = SimpleNamespace(inbox=queue.Queue())
    receivers.inbox.put((1, RuntimeError("connection closed")))
    receivers.inbox.put((2, torch.tensor([GRADIENT + SAVED, 0.0])))  # asked with its push
    server.checkpoint_on_loss(1, receivers)  # type: ignore[arg-type]
    assert server.requested == [False, False, True] and len(taken) == 1


def _worker_posting() -> tuple[Any, list[tuple[float, tuple[int, ...]]]]:
    """A worker's strategy whose sends are recorded, not made: (kind, words) of each."""
    strategy = gs.strategies.ps.ParameterServer(float("inf"))
    sent: list[tuple[float, tuple[int, ...]]] = []
    strategy._plan = SimpleNamespace(
        groups=1,
        control=lambda s, kind, lrs, words=(): (kind, tuple(words)),
        post=lambda op, msg, peer, what: sent.append(msg),
        server_rank=lambda s: 1,
        wait=lambda work, what: None,
    )
    model = torch.nn.Linear(1, 1)
    strategy._ctx = SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return strategy, sent


def test_a_request_rides_on_the_next_message_only_when_saving_every_step() -> None:
    strategy, sent = _worker_posting()
    strategy.checkpoint_held(3, False, 0)  # the first save: a message of its own
    assert sent == [(CHECKPOINT, (0, 0))]
    strategy.checkpoint_held(4, False, 0)  # the step after: with the next message
    assert len(sent) == 1 and strategy._take_request() == SAVED
    strategy.checkpoint_held(5, False, 0)
    strategy.checkpoint_held(7, False, 0)  # 5's request goes first; 7 is two steps on
    assert sent[1:] == [(CHECKPOINT, (0, 0)), (CHECKPOINT, (0, 0))]
    strategy.checkpoint_held(8, True, 0)  # a save that waits: at once, marked
    assert sent[3:] == [(CHECKPOINT, (1, 0))]
    strategy.checkpoint_held(9, False, 11)  # rank 0 naming a new directory: at once
    strategy.checkpoint_held(10, False, 11)  # the same one: rides
    assert sent[4:] == [(CHECKPOINT, (0, 11))] and strategy._request_pending
