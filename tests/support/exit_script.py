"""A two-rank script whose rank 0 ends while a collective it posted is still in gloo's hands
(rank 1 joins it ``DELAY_S`` later), with a callback that writes ``MARKER`` when gloo runs it:
the exit must wait for it (``gradsync.exit_safety``). Run under torchrun by tests/e2e."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync import exit_safety

DELAY_S = 1.5


def main(marker: Path) -> None:
    torch.set_num_threads(1)
    gs.init()
    model = torch.nn.Linear(4, 2)
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        with sync.step():
            model(torch.randn(3, 4)).sum().backward()
    if gs.rank() == 1:
        time.sleep(DELAY_S)
        dist.all_reduce(torch.ones(1))
        return
    work = dist.all_reduce(torch.ones(1), async_op=True)
    assert work is not None

    def record(fut: torch.futures.Future[list[torch.Tensor]]) -> None:
        marker.write_text(f"{fut.value()[0].item()} {time.time()}")

    exit_safety.then(work.get_future(), record)
    # The script ends here, its last collective in flight.


if __name__ == "__main__":
    main(Path(sys.argv[1]))
