"""The single-rank GPU script the GPU tests launch: ``python tests/support/gpu_nccl.py PHASE DIR``.

Phases (each writes ``DIR/PHASE.json`` for the test to read):

- ``dial`` (under torchrun, one process): ``gs.init()`` must pick NCCL; bsp with every
  compressor, local SGD, DiLoCo (plain and streaming) and the ZeRO stages train on the device.
- ``timing`` (under torchrun): a model large enough that the device, not the host, sets the
  pace; the telemetry's compute and sync against a host clock around the same block with the
  device synchronized, against the bare launch time, and against torch.profiler's kernel time;
  then steps that call ``synchronize()`` in the block, whose compute must not lose the
  backward to the host's wait.
- ``save`` (under torchrun): DiLoCo with Adam on the device, checkpointed after 6 steps.
- ``cpu`` (plain python, gloo, model on the CPU): loads that checkpoint, checks it bitwise,
  trains 2 steps and checkpoints again.
- ``back`` (under torchrun): loads the CPU's checkpoint onto the device, checks it bitwise and
  trains 4 steps, through an outer step that uses the restored outer state.

``GRADSYNC_GPU_TEST_DEVICE=cpu`` runs every phase on the CPU with gloo (a dry run).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import gradsync as gs
from gradsync.workloads import make_workload

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: tests.support.gpu_ranks must import

from tests.support.gpu_ranks import BEYOND_BSP, COMPRESSIONS, device_under_test  # noqa: E402

#: zero:3 (FSDP2) runs here: NCCL carries its collectives, which gloo cannot for device tensors.
DIAL = (*(("bsp", c) for c in COMPRESSIONS), ("zero:3", None), *BEYOND_BSP)
PER_RANK = 16


def _device() -> str:
    device = device_under_test()
    assert device is not None, "no CUDA device: set GRADSYNC_GPU_TEST_DEVICE=cpu for a dry run"
    return device


def _init(device: str) -> None:
    gs.init(backend=None if device == "cuda" else "gloo")
    if device == "cuda":
        assert torch.distributed.get_backend() == "nccl", torch.distributed.get_backend()


def dial(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": torch.distributed.get_backend()}
    for strategy, compression in DIAL:
        w = make_workload("mlp", seed=1, params=20_000)
        model = w.build_model().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        key = f"{strategy}+{compression or 'none'}"
        try:
            sync = gs.Synchronizer(model, opt, strategy=strategy, compression=compression)
            losses = []
            for _ in range(8):
                with sync.step(samples=PER_RANK) as s:
                    x, y = w.batch(0, PER_RANK, 0, PER_RANK)  # one batch: the loss must fall
                    loss = w.loss(model, x.to(device), y.to(device))
                    loss.backward()
                    s.loss = loss
                losses.append(float(loss))
            report = sync.report()
            sync.close()
            on = {p.device.type for p in model.parameters()}
            out[key] = {"losses": losses, "steps": report.steps, "devices": sorted(on)}
        except Exception as exc:  # noqa: BLE001 - every configuration is reported
            out[key] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
    return out


def _big_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    width = 4096 if device == "cuda" else 256
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).to(device)


def _sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timing(device: str) -> dict[str, Any]:
    """Per step seconds, medians over the timed steps: telemetry's compute and sync, the
    host's launch time of the block, the block with the device synchronized around it, and
    torch.profiler's device time of every kernel per step."""
    model = _big_model(device)
    width = model[0].in_features
    batch = 4096 if device == "cuda" else 64
    x = torch.randn(batch, width, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sync = gs.Synchronizer(model, opt, telemetry_every=4)

    def block() -> None:
        model(x).square().mean().backward()

    launch, synced = [], []
    for step in range(16):
        with sync.step(samples=batch):
            t0 = time.perf_counter()
            block()
            launch.append(time.perf_counter() - t0)
        if step >= 4:  # a step of the same block, the device synchronized around it
            _sync_device(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            block()
            _sync_device(device)
            synced.append(time.perf_counter() - t0)
    kernels = _profiled_kernel_seconds(sync, block, 4, device)  # steps 16-19
    for _ in range(8):  # steps 20-27: synchronize() in the block, where users clip
        with sync.step(samples=batch) as s:
            block()
            s.synchronize()
    report = sync.report()
    sync.close()
    mine = [r for r in report.records if 4 <= r.step < 16]
    waited = [r for r in report.records if r.step >= 22]
    return {
        "compute": statistics.median(r.compute for r in mine),
        "sync": statistics.median(r.sync for r in mine),
        "compute_with_synchronize": statistics.median(r.compute for r in waited),
        "launch": statistics.median(launch[4:]),
        "synced": statistics.median(synced),
        "profiler_kernels": kernels,
    }


def _profiled_kernel_seconds(sync: Any, block: Any, steps: int, device: str) -> float | None:
    """torch.profiler's device time of all kernels, per step, over ``steps`` more steps."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync_device(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with sync.step(samples=1):
                block()
        _sync_device(device)
    # Each kernel is listed once as itself (a device event) and again in the self time of
    # the operator that launched it: count the kernels alone.
    cuda = torch.autograd.DeviceType.CUDA
    total_us = sum(
        getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        for e in prof.key_averages()
        if getattr(e, "device_type", None) == cuda
    )
    return total_us / 1e6 / steps if total_us else None


def _adam_diloco(device: str) -> tuple[Any, Any, Any, Any]:
    w = make_workload("mlp", seed=2, params=20_000)
    torch.manual_seed(0)
    model = w.build_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = gs.Synchronizer(model, opt, strategy="diloco:4", compression="int8")
    return w, model, opt, sync


def _state(model: Any, opt: Any, sync: Any) -> dict[str, Any]:
    """Everything a resume restores, on the CPU, for a bitwise comparison."""
    return {
        "params": [p.detach().cpu().clone() for p in model.parameters()],
        "opt": [
            {k: v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)}
            for s in (opt.state[p] for p in model.parameters())
        ],
        "strategy": _tensors(sync.state_dict()),
    }


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value.detach().cpu().clone()]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _train(w: Any, model: Any, sync: Any, steps: range, device: str) -> float:
    loss = torch.zeros(())
    for step in steps:
        with sync.step(samples=PER_RANK) as s:
            x, y = w.batch(step, PER_RANK, 0, PER_RANK)
            loss = w.loss(model, x.to(device), y.to(device))
            loss.backward()
            s.loss = loss
    return float(loss.detach())


def checkpoint(phase: str, device: str, directory: Path) -> dict[str, Any]:
    """``save``: 6 steps, then a checkpoint; ``cpu`` / ``back``: load the previous phase's
    checkpoint, compare it with what that phase had, train (2 steps on the CPU, 4 back on the
    device) and checkpoint again."""
    w, model, opt, sync = _adam_diloco(device)
    out: dict[str, Any] = {"device": str(next(model.parameters()).device)}
    start = 0
    if phase != "save":
        before = "save" if phase == "cpu" else "cpu"
        extra = sync.load(directory / f"ckpt-{before}")
        assert extra is not None
        start = int(extra["step"])
        expected = torch.load(directory / f"state-{before}.pt")
        out["bitwise"] = _same(_state(model, opt, sync), expected)
        # Adam keeps its step count on the CPU wherever the model is: the other state counts.
        state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        out["on_device"] = sorted(
            {p.device.type for p in model.parameters()}
            | {v.device.type for v in state if torch.is_tensor(v)}
        )
    # 6 steps, then 2 on the CPU and 4 back on the device: each part after a load reaches an
    # outer step of diloco:4 (after steps 7 and 11), which uses the restored outer state.
    end = start + {"save": 6, "cpu": 2, "back": 4}[phase]
    out["loss"] = _train(w, model, sync, range(start, end), device)
    sync.save(directory / f"ckpt-{phase}")
    torch.save(_state(model, opt, sync), directory / f"state-{phase}.pt")
    out["step"] = end
    sync.report()
    sync.close()
    return out


def main() -> None:
    phase, directory = sys.argv[1], Path(sys.argv[2])
    device = _device()
    if phase == "cpu":
        gs.init(backend="gloo")
        device = "cpu"
    else:
        _init(device)
    if phase == "dial":
        result = dial(device)
    elif phase == "timing":
        result = timing(device)
    else:
        result = checkpoint(phase, device, directory)
    (directory / f"{phase}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result)[:4000], flush=True)
    # as a DDP script ends: NCCL warns at exit about a group left undestroyed
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
