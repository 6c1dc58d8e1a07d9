"""What the GPU tests run (importable by spawned ranks and by torchrun): the dial and every
compressor with the model on a CUDA device, and the same on the CPU for comparison.

``GRADSYNC_GPU_TEST_DEVICE`` names the device under test: ``cuda`` (the default where one is
visible) or ``cpu``, which dry-runs these tests' plumbing on a machine without a GPU.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

import gradsync as gs
from gradsync.workloads import make_workload

#: Every compressor, each run under bsp.
COMPRESSIONS: tuple[str | None, ...] = (None, "fp16", "bf16", "int8", "int4", "sign")
COMPRESSIONS += ("topk:0.1", "randomk:0.25", "powersgd:2")
#: The rest of the dial that a model on the GPU takes, on one rank (NCCL) and on two (gloo).
BEYOND_BSP: tuple[tuple[str, str | None], ...] = (
    ("zero:1", None),
    ("zero:2", None),
    ("local:2", None),
    ("local:4", "sparseloco"),
    ("diloco:4", None),
    ("diloco:4:2:1", "int4"),
)
#: (strategy, compression) pairs run as 2 gloo ranks sharing one device. Each replicates the
#: parameters on both ranks by the end of STEPS (local/diloco periods divide it). The
#: parameter servers need a second rank (the server).
#: They run in one launch per family: a rank that aborts (a gloo call given device memory it
#: cannot take, as the ZeRO ring once did) takes its family down, not every configuration,
#: and a GPU check costs 3 launches, not 19 (each about 15 s on an H200 machine).
FAMILIES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "bsp": tuple(("bsp", c) for c in COMPRESSIONS),
    "dial": (*BEYOND_BSP, ("local:2", "int8")),
    "servers": (("ssp:1", None), ("async", "int8")),
}
TWO_RANK_CONFIGS = tuple(
    (family, strategy, compression)
    for family, configs in FAMILIES.items()
    for strategy, compression in configs
)
#: Exact up to the order of floating-point sums: the device's run must match the CPU's closely.
EXACT = {"none", "fp16", "bf16"}
STEPS = 8
PER_RANK = 8
LR = 0.05


def device_under_test() -> str | None:
    """``cuda`` where a CUDA device is visible, the variable's value where it is set, else None."""
    chosen = os.environ.get("GRADSYNC_GPU_TEST_DEVICE")
    if chosen:
        return chosen
    return "cuda" if torch.cuda.is_available() else None


def _train(
    strategy: str, compression: str | None, device: str, rank: int, world: int
) -> dict[str, Any]:
    w = make_workload("mlp", seed=3, params=4000)
    torch.manual_seed(0)
    model = w.build_model().to(device)
    init = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sync = gs.Synchronizer(
        model, opt, strategy=strategy, compression=compression, timeout_s=60, telemetry_every=4
    )
    if sync.is_server:
        sync.serve()
        sync.close()
        return {"server": True}
    n, me = sync.layout.workers, rank  # workers are the first ranks
    losses = []
    for step in range(STEPS):
        with sync.step(samples=PER_RANK) as s:
            x, y = w.batch(step % 2, PER_RANK * n, me * PER_RANK, (me + 1) * PER_RANK)
            loss = w.loss(model, x.to(device), y.to(device))
            loss.backward()
            s.loss = loss
        losses.append(float(loss.detach()))
    report = sync.report()
    sync.close()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert params.device.type == torch.device(device).type, params.device
    return {
        "params": params.cpu(),
        "init": init,
        "losses": losses,
        "compute": [r.compute for r in report.records if r.rank == rank],
    }


def configs_on_both_devices(
    rank: int, world: int, device: str, configs: list[tuple[str, str | None]]
) -> dict[tuple[str, str | None], dict[str, Any]]:
    """Each two-rank configuration on ``device`` and on the CPU; a failure is kept as its
    traceback (the test reports it), so one configuration's error hides no other's."""
    torch.set_num_threads(1)
    out: dict[tuple[str, str | None], dict[str, Any]] = {}
    for strategy, compression in configs:
        runs = out[strategy, compression] = {}
        for where in dict.fromkeys([device, "cpu"]):
            try:
                runs[where] = _train(strategy, compression, where, rank, world)
            except Exception:  # noqa: BLE001 - reported by the test that reads it
                runs[where] = traceback.format_exc()
    return out


def refusal(rank: int, world: int, device: str, strategy: str) -> str:
    """``strategy`` with the model on ``device`` over gloo: the message it refuses with."""
    model = make_workload("mlp", seed=3, params=4000).build_model().to(device)
    try:
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=LR), strategy=strategy)
    except gs.UsageError as exc:
        return str(exc)
    return "accepted"
