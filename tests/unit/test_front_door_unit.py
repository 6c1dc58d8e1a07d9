"""The DDP-shaped front door (``gs.DistributedDataParallel``) in one process: the example ports
change a handful of lines and re-indent none; unsupported strategies and options are refused
before any collective, naming what to use; a world of one runs a DDP loop, with its LR
schedulers, and refuses the steps DDP would let diverge. Against DDP on 2 ranks:
tests/ranks/test_front_door.py."""

from __future__ import annotations

import datetime
import difflib
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync import compat
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HEADER = 2  # each file's first two lines name the file itself: its command and docstring
PORTS = ("ddp_lm", "ddp_vision")


def port_diff(name: str) -> tuple[list[str], list[str]]:
    """(lines of the DDP script the port removes or rewrites, lines it adds), headers aside."""
    a = (EXAMPLES / f"{name}.py").read_text().splitlines()[HEADER:]
    b = (EXAMPLES / f"{name}_frontdoor.py").read_text().splitlines()[HEADER:]
    diff = list(difflib.unified_diff(a, b, lineterm="", n=0))[2:]
    removed = [line[1:] for line in diff if line.startswith("-")]
    added = [line[1:] for line in diff if line.startswith("+")]
    return removed, added


@pytest.mark.parametrize("name", PORTS)
def test_the_front_door_port_changes_at_most_6_lines_and_re_indents_none(name: str) -> None:
    removed, added = port_diff(name)
    assert len(removed) + len(added) <= 6, (removed, added)
    # a re-indented line: the same text, removed at one depth and added at another
    assert {line.strip() for line in removed if line.strip()}.isdisjoint(
        line.strip() for line in added
    )
    header = (EXAMPLES / f"{name}_frontdoor.py").read_text().splitlines()[0]
    assert header.startswith(f"# torchrun --standalone --nproc_per_node=2 examples/{name}_front")


def test_the_diff_count_sees_a_re_indented_loop(tmp_path: Path) -> None:
    # the explicit form's port re-indents the micro-step loop: this count would refuse it
    a = (EXAMPLES / "ddp_lm.py").read_text().splitlines()[HEADER:]
    b = (EXAMPLES / "ddp_lm_gradsync.py").read_text().splitlines()[HEADER:]
    diff = list(difflib.unified_diff(a, b, lineterm="", n=0))[2:]
    removed = {line[1:].strip() for line in diff if line.startswith("-")}
    added = {line[1:].strip() for line in diff if line.startswith("+")}
    assert removed & added  # e.g. "for micro in range(args.accumulation):"


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("strategy", "why"),
    [
        ("ssp:2", "sync.serve()"),
        ("async", "sync.serve()"),
        ("hogwild", "shared parameters"),
    ],
)
def test_an_unsupported_strategy_is_refused_before_any_collective(strategy: str, why: str) -> None:
    assert not dist.is_initialized()  # refused before the Synchronizer would need a group
    model, optimizer = _model_and_optimizer()
    with pytest.raises(UsageError) as refused:
        gs.DistributedDataParallel(model, optimizer=optimizer, strategy=strategy)
    message = str(refused.value)
    assert f"cannot run strategy {strategy!r}" in message and why in message
    assert "gs.Synchronizer(model, optimizer" in message
    assert "step" not in optimizer.__dict__  # the optimizer was left as it was


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"optimizer": None}, "pass the optimizer the loop steps"),
        # another model's optimizer: gradients averaged that this one never applies (the
        # front-door tester's run ended elsewhere than DDP's, silently)
        (
            {"optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)},
            "the optimizer holds none of the model's parameters",
        ),
        ({"scaler": torch.amp.GradScaler("cpu")}, "keep calling scaler.scale"),
        ({"accumulation": "mean"}, "model.no_sync()"),
        ({"device_ids": [3]}, "move the module there first"),
    ],
)
def test_options_the_front_door_decides_itself_are_refused_naming_the_fix(
    options: dict, says: str
) -> None:
    model, optimizer = _model_and_optimizer()
    with pytest.raises(UsageError) as refused:
        gs.DistributedDataParallel(model, **{"optimizer": optimizer, **options})
    assert says in str(refused.value)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo group in this process (FileStore: no port, no other process)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _micro_steps(model: gs.DistributedDataParallel, k: int, sync_last: bool = True) -> None:
    for micro in range(k):
        last = micro == k - 1 and sync_last
        with nullcontext() if last else model.no_sync():
            model(torch.randn(3, 4)).pow(2).mean().div(k).backward()


@pytest.mark.parametrize("built", ["before the wrap", "after the wrap"])
def test_a_ddp_loop_with_an_lr_scheduler_runs_without_a_warning(
    one_rank_group: None, built: str
) -> None:
    model, optimizer = _model_and_optimizer()
    make = lambda: torch.optim.lr_scheduler.StepLR(optimizer, 2)  # noqa: E731
    scheduler = make() if built == "before the wrap" else None
    wrapped = gs.DistributedDataParallel(model, optimizer=optimizer, telemetry=False)
    scheduler = scheduler or make()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with warnings.catch_warnings():
        # "optimizer.step() has been overridden after learning rate scheduler
        # initialization", or "lr_scheduler.step() before optimizer.step()"
        warnings.simplefilter("error")
        for _ in range(3):
            _micro_steps(wrapped, 2)
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            scaler.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    assert wrapped.sync.step_count == 3
    assert scheduler.get_last_lr() == [0.1 * 0.1]  # StepLR(2) after 3 steps: one decay
    assert list(wrapped.state_dict())[0] == "module.0.weight"  # as DDP's keys
    wrapped.close()


def test_steps_ddp_would_let_diverge_are_refused(one_rank_group: None) -> None:
    model, optimizer = _model_and_optimizer()
    wrapped = gs.DistributedDataParallel(model, optimizer=optimizer, telemetry=False)
    _micro_steps(wrapped, 2, sync_last=False)  # every micro-batch under no_sync()
    with pytest.raises(UsageError, match="outside model.no_sync()"):
        optimizer.step()
    _micro_steps(wrapped, 1)
    optimizer.step()
    with pytest.raises(UsageError, match="optimizer.step\\(\\) ran twice with no forward"):
        optimizer.step()  # twice (it said no_sync() was the cause until 2026-11-30)
    _micro_steps(wrapped, 1)
    with pytest.raises(UsageError, match="closure"):
        optimizer.step(lambda: 0.0)
    wrapped.close()
    assert "step" not in optimizer.__dict__  # close() gave the optimizer its own step back


def test_without_end_of_backward_callbacks_the_front_door_is_refused(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # outside a backward pass the engine refuses a callback: the plain answer is False
    assert compat.end_of_backward_callbacks()
    assert compat.queue_end_of_backward(lambda: None) is False
    monkeypatch.setattr(torch.autograd, "Variable", None)  # a torch that hides the engine
    assert not compat.end_of_backward_callbacks()
    model, optimizer = _model_and_optimizer()
    with pytest.raises(UsageError, match="no end-of-backward callbacks.*explicit"):
        gs.DistributedDataParallel(model, optimizer=optimizer)


def test_a_strategy_the_run_contradicts_is_refused_naming_the_front_door(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `gradsync run --strategy local:4 -- script.py` where the script wraps with
    # strategy="zero:1": it built no gs.Synchronizer, so the refusal names what it did call
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"strategy": "local:4", "given": ["strategy"]}')
    monkeypatch.setenv("GRADSYNC_RUN_DIR", str(run_dir))
    model, optimizer = _model_and_optimizer()
    with pytest.raises(UsageError) as refused:
        gs.DistributedDataParallel(model, optimizer=optimizer, strategy="zero:1", telemetry=False)
    said = str(refused.value)
    assert "gradsync run --strategy local:4, but the script's gs.DistributedDataParallel(" in said
    assert "passes strategy='zero:1'" in said and "gs.Synchronizer" not in said
    assert "step" not in optimizer.__dict__  # refused before the optimizer's step was routed
