"""gs.init() under SLURM: the node list's first host, torchrun's variables made from SLURM's, the
errors that name a malformed variable, and gs.rank() / gs.world_size() / gs.is_main() before and
with a process group. The environment is monkeypatched; nothing is launched (two real tasks:
tests/ranks/test_slurm_launch.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch.distributed as dist

import gradsync as gs
from gradsync import runtime
from gradsync.errors import UsageError
from gradsync.runtime import expand_nodelist, slurm_environment

pytestmark = pytest.mark.unit

TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

# What srun gives task 2 of 4, two per node, on nodes gpu07 and gpu08.
SRUN = {
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "4242",
}


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher's variables (and no process group) but those a test sets."""
    for name in [*TORCHRUN_ENV, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    return monkeypatch


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b2", ["a1", "b2"]),
        ("gpu-a1", ["gpu-a1"]),
        ("n[8-10],login", ["n8", "n9", "n10", "login"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("node[001-002],node[010]", ["node001", "node002", "node010"]),
    ],
)
def test_a_node_list_expands_in_order(text: str, hosts: list[str]) -> None:
    assert list(expand_nodelist(text)) == hosts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("node[01-04", "unbalanced brackets"),
        ("node01]", "unbalanced brackets"),
        ("n[[1]]", "unbalanced brackets"),
        ("a1,,b2", "an empty host"),
        ("", "an empty host"),
        ("node[04-01]", "runs backwards"),
        ("node[a-b]", "not N or N-M"),
        ("node[1-]", "not N or N-M"),
    ],
)
def test_a_malformed_node_list_is_refused_naming_the_variable(text: str, why: str) -> None:
    with pytest.raises(UsageError, match=rf"SLURM_NODELIST='{re.escape(text)}'.*{why}") as refused:
        expand_nodelist(text, "SLURM_NODELIST")
    assert "e.g. node[01-04,07]" in str(refused.value)


def test_srun_variables_become_torchruns() -> None:
    assert slurm_environment(SRUN) == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(runtime.SLURM_PORT_BASE + 4242),
    }


def test_master_from_the_step_then_the_job_then_the_node_list_and_the_environments_own() -> None:
    job = {k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"}
    assert slurm_environment({**job, "SLURM_NODELIST": "c[3-4]"})["MASTER_ADDR"] == "c3"
    step = {**SRUN, "SLURM_STEP_NODELIST": "gpu08"}
    assert slurm_environment(step)["MASTER_ADDR"] == "gpu08"
    given = {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert slurm_environment(given) | {} == slurm_environment(SRUN) | {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }


def test_the_default_port_is_the_same_for_every_task_and_differs_between_jobs() -> None:
    ports = {runtime.slurm_default_port({"SLURM_JOB_ID": str(job)}) for job in range(100, 110)}
    assert len(ports) == 10
    assert all(runtime.SLURM_PORT_BASE <= p < 32768 for p in ports)  # below ephemeral ports


def test_slurm_is_not_taken_without_a_task_or_under_torchrun() -> None:
    assert slurm_environment({}) is None
    assert slurm_environment({k: v for k, v in SRUN.items() if k != "SLURM_PROCID"}) is None
    assert slurm_environment({**SRUN, "RANK": "0"}) is None  # torchrun inside srun
    # "tasks per node" that differ between nodes ("2(x3),1"): no LOCAL_WORLD_SIZE is made up
    assert "LOCAL_WORLD_SIZE" not in slurm_environment({**SRUN, "SLURM_NTASKS_PER_NODE": "2(x2)"})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"SLURM_PROCID": "two"}, "SLURM_PROCID='two' is not an integer >= 0"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not an integer >= 0"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not an integer >= 1"),
        ({"SLURM_LOCALID": ""}, "SLURM_LOCALID='' is not an integer >= 0"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
        ({"SLURM_NTASKS": None}, "needs SLURM_NTASKS, which is not set"),
        ({"SLURM_JOB_NODELIST": None}, "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST"),
        ({"SLURM_JOB_NODELIST": "gpu[07"}, "SLURM_JOB_NODELIST='gpu\\[07'"),
        ({"SLURM_JOB_ID": "42_1"}, "SLURM_JOB_ID='42_1' is not a job number.*set MASTER_PORT"),
    ],
)
def test_a_malformed_slurm_variable_is_named(change: dict[str, str | None], named: str) -> None:
    env = {k: v for k, v in {**SRUN, **change}.items() if v is not None}
    with pytest.raises(UsageError, match=named):
        slurm_environment(env)


def test_init_refuses_a_malformed_slurm_variable_before_any_group(
    clean_env: pytest.MonkeyPatch,
) -> None:
    for name, value in {**SRUN, "SLURM_NTASKS": "four"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(UsageError, match="SLURM_NTASKS='four'"):
        gs.init()
    assert "RANK" not in os.environ


@pytest.mark.parametrize(
    ("env", "rank", "world"),
    [
        ({}, 0, 1),
        ({"RANK": "3", "WORLD_SIZE": "8"}, 3, 8),
        (SRUN, 2, 4),
        ({**SRUN, "SLURM_PROCID": "0"}, 0, 4),
        # the task's rank is known before its hosts are: only gs.init() needs rank 0's
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}, 1, 2),
    ],
)
def test_rank_and_world_size_before_init_come_from_the_launcher(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], rank: int, world: int
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert (gs.rank(), gs.world_size(), gs.is_main()) == (rank, world, rank == 0)
    assert "RANK" not in os.environ or "RANK" in env  # asking sets nothing


def test_a_malformed_rank_is_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "first")
    with pytest.raises(UsageError, match="RANK='first' is not an integer"):
        gs.rank()


def test_with_a_group_torch_distributed_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank group in this process: its rank and size, whatever the environment says."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert (gs.rank(), gs.world_size(), gs.is_main()) == (0, 1, True)
    finally:
        if made:
            dist.destroy_process_group()
