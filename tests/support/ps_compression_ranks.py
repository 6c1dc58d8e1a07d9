"""Rank functions for compressed parameter-server pushes (importable by spawned ranks), and the
single-process reference they are compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import gradsync as gs
from gradsync.compression._wire import derive_seed
from gradsync.compression.push import make_push_codec
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

PER_RANK = 4
WORKERS = 2
STEPS = 6
SAVE_AT = 3
LR = 0.05
SPECS = ("fp16", "bf16", "int8", "topk:0.1", "randomk:0.25", "sign", "powersgd:2")
EF_SPECS = ("topk:0.1", "sign", "powersgd:2")  # error feedback: their residual must resume


def _workload() -> Any:
    return make_workload("mlp", seed=5, params=3000, dtype="float64")


def _train(spec: str, directory: Path | None, mode: str) -> dict[str, Any]:
    """ssp:0 with plain SGD: each step's parameters are the start of the next on every worker,
    so the trajectory is a function of the gradients alone (see ``reference``)."""
    w = _workload()
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = gs.Synchronizer(model, opt, strategy="ssp:0", compression=spec, timeout_s=30)
    start = 0
    if mode == "resume":
        assert directory is not None
        extra = sync.load(directory)
        assert extra is not None
        start = int(extra["step"])
    if sync.is_server:
        out: dict[str, Any] = {"server": sync.serve()}
        sync.close()
        return out
    for step in range(start, STEPS):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(
                step, PER_RANK * WORKERS, sync.rank * PER_RANK, (sync.rank + 1) * PER_RANK
            )
            w.loss(model, x, y).backward()
        if mode == "save" and step + 1 == SAVE_AT:
            assert directory is not None
            sync.save(directory)
    report = sync.report()
    sync.close()
    mine = [r for r in report.records if r.rank == sync.rank]
    return {"params": flat_params(model), "bytes": [r.bytes for r in mine]}


def every_spec(rank: int, world: int) -> dict[str, Any]:
    return {spec: _train(spec, None, "plain") for spec in ("none", *SPECS)}


def save_then_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for spec in EF_SPECS:
        directory = Path(root) / spec.replace(":", "_")
        _train(spec, directory, "save")  # saves after SAVE_AT, trains on to STEPS
        out[spec] = _train(spec, directory, "resume")  # a fresh group from the save
    return out


def codec(spec: str, worker: int = 0) -> Any:
    """The push codec a worker of these runs uses (1 server: one shard holds every parameter)."""
    params = list(_workload().build_model().parameters())
    return make_push_codec(
        spec,
        sum(p.numel() for p in params),
        params[0].dtype,
        shapes=[tuple(p.shape) for p in params],
        seed=derive_seed(worker, 0),
    )


def reference(spec: str) -> torch.Tensor:
    """The same training in one process: every worker's gradient goes through its own encoder
    and a separate decoder (as on the server), and the mean of the decoded gradients is applied
    with SGD. Compressed PS pushes must follow this trajectory up to float rounding."""
    w = _workload()
    model = w.build_model()
    params = list(model.parameters())
    encoders = [codec(spec, v) for v in range(WORKERS)]
    decoders = [codec(spec, v) for v in range(WORKERS)]
    for step in range(STEPS):
        decoded = []
        for v in range(WORKERS):
            model.zero_grad(set_to_none=True)
            x, y = w.batch(step, PER_RANK * WORKERS, v * PER_RANK, (v + 1) * PER_RANK)
            w.loss(model, x, y).backward()
            g = torch.cat([p.grad.reshape(-1) for p in params])
            decoded.append(decoders[v].decode(encoders[v].encode(g, step), step))
        with torch.no_grad():
            update = torch.stack(decoded).mean(0)
            offset = 0
            for p in params:
                p -= LR * update[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    return flat_params(model)
