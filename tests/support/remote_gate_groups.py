"""The worker of tests/e2e/test_cluster_gate_groups.py, two per emulated host under torchrun
(ranks 0 and 1 on host 0, 2 and 3 on host 1): the step gate in groups of 3, so that rank 2, on
the second host, waits at the group store rank 0 serves on the first, across the link. Rank 2
evaluates past the timeout between steps 1 and 2: its group and rank 3 wait for it. Each rank
writes what it saw to ``$GRADSYNC_TEST_OUT/rank<r>.json``."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from gradsync.checks import liveness
from tests.support.gate_ranks import TIMEOUT_S, _setup, _train_step
from tests.support.ranks import flat_params

OUT_ENV = "GRADSYNC_TEST_OUT"
GROUP_SIZE = 3
STEPS = 5


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    w, model, _, sync = _setup(gate_group_size=GROUP_SIZE)
    for step in range(STEPS):
        with sync.step():
            _train_step(w, model, rank, world, step)
        if step == 1 and rank == 2:
            time.sleep(1.6 * TIMEOUT_S)  # an evaluation between steps, past the timeout
    sync.report()
    gate = sync._gate
    group = gate._group if gate is not None else None
    seen = {
        "steps": sync.step_count,
        "params": flat_params(model).tolist(),
        "group": list(group.ranks) if group is not None else None,
        "serves": gate is not None and gate._server is not None,
        "machine": liveness.machine(),
    }
    sync.close()
    (Path(os.environ[OUT_ENV]) / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
