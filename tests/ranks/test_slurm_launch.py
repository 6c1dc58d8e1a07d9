"""Two tasks started as ``srun`` starts them, with SLURM's variables and none of torchrun's:
gs.init() makes the group from them (rank 0's store on the node list's first host, the port
from MASTER_PORT) and an all-reduce crosses it. The parsing itself: tests/unit/test_slurm_env.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ranks

WORLD = 2

TASK = textwrap.dedent(
    """
    import json, os
    import torch
    import torch.distributed as dist
    import gradsync as gs

    before = (gs.rank(), gs.world_size(), gs.is_main())
    gs.init(backend="gloo", timeout_s=30)
    total = torch.tensor([float(gs.rank() + 1)])
    dist.all_reduce(total)
    print(json.dumps({
        "before": before,
        "after": (gs.rank(), gs.world_size(), gs.is_main()),
        "sum": total.item(),
        "env": [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")],
    }))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    """A port nothing listens on now: rank 0's store takes it a moment later (no fixed port to
    collide with another test or run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _task_env(rank: int, port: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_")
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    }
    return env | {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(WORLD),
        "SLURM_LOCALID": str(rank),
        "SLURM_JOB_NODELIST": "127.0.0.1",  # one "node", named by its address: loopback only
        "SLURM_JOB_ID": "77",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.timeout(90)
def test_two_srun_tasks_form_a_group_from_slurms_variables() -> None:
    port = _free_port()
    tasks = [
        subprocess.Popen(
            [sys.executable, "-c", TASK],
            env=_task_env(rank, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for task in tasks:
            out, err = task.communicate(timeout=75)
            assert task.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, signal.SIGKILL)
                task.communicate()
    for rank, got in enumerate(outputs):
        assert got["before"] == got["after"] == [rank, WORLD, rank == 0]
        assert got["sum"] == 3.0  # 1 + 2: both ranks' tensors
        assert got["env"] == [str(rank), str(WORLD), str(rank), "127.0.0.1"]
