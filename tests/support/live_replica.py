"""One replica group of a live-membership test (tests/ranks/test_live_membership.py), run as
``python -m tests.support.live_replica``: a process of its own, so that the test can SIGKILL
it mid-run as a lost machine would be lost, and start its replacement as a new process.

It trains a tiny model with ``bsp`` under ``membership="torchft"`` until ``DIR/stop`` appears,
and after every step appends to ``DIR/replica<R>-<pid>.jsonl`` the step just run, a
fingerprint of its parameters and optimizer state (bitwise: a sha256 of their bytes), whether
the step was skipped, and a counter registered with ``sync.register_state`` (it travels with
the healing state, as any registered state does)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

import gradsync as gs


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
        state = optimizer.state.get(p, {})
        if "momentum_buffer" in state:
            digest.update(state["momentum_buffer"].contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--poison", action="store_true", help="NaN once DIR/poison appears")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--pause-s", type=float, default=0.03)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gs.init()  # a world of one: this replica group alone; the quorum is torchft's
    # Another seed per process: replicas start apart, and the first quorum syncs them.
    torch.manual_seed(1000 * args.replica + os.getpid())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(
        model, optimizer, strategy="bsp", membership="torchft", timeout_s=20, telemetry=False
    )
    counter = {"steps_applied": 0}
    sync.register_state("counter", lambda: dict(counter), counter.update)
    data = torch.Generator().manual_seed(os.getpid())  # each replica its own batches
    log = (args.out / f"replica{args.replica}-{os.getpid()}.jsonl").open("a", buffering=1)
    stop = args.out / "stop"
    run, poisoned = 0, False
    while not stop.exists() and run < args.max_steps:
        x = torch.randn(16, 8, generator=data)
        y = x.sum(dim=1, keepdim=True).sin()
        poison = args.poison and not poisoned and (args.out / "poison").exists()
        poisoned |= poison
        with sync.step() as s:
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss * float("nan") if poison else loss).backward()
        if not s.skipped:
            counter["steps_applied"] += 1
        entry = {
            "step": sync.step_count - 1,
            "fp": fingerprint(model, optimizer),
            "skipped": s.skipped,
            "nan": poison,
            "counter": counter["steps_applied"],
        }
        log.write(json.dumps(entry) + "\n")
        run += 1
        time.sleep(args.pause_s)
    sync.close()


if __name__ == "__main__":
    main()
