"""Every compressor on two real gloo ranks: replicas stay bitwise identical, estimates are close
to the true mean where the compressor promises it, error feedback conserves mass across ranks,
and the compressors work as DistributedDataParallel communication hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync.compression import (
    Compressor,
    FlatBucket,
    ddp_comm_hook,
    error_feedback,
    fused,
    parse_compression,
    powersgd,
)
from gradsync.testing import run_ranks

pytestmark = pytest.mark.ranks

WORLD = 2
STEPS = 4
SHAPES = [(24, 16), (16,), (3, 4, 5), (40,)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
SPECS = ["none", "fp16", "bf16", "int8", "topk:0.1", "randomk:0.2", "sign", "powersgd:2"]


def gradient(rank: int, step: int, bucket: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + bucket)
    return torch.randn(NUMEL, generator=gen) * (1.0 + rank)


def compressor(spec: str) -> Compressor:
    if spec == "powersgd:2":
        return error_feedback(powersgd(2, start_iter=1))  # compress from the second step on
    return parse_compression(spec)


#: the compressors with GPU kernels (gradsync.compression.fused)
FUSED_SPECS = ["int8", "int4", "randomk:0.2", "sign"]


def _take_the_device_path() -> list[str]:
    """In this rank process: CPU tensors take the codecs' GPU path, each kernel's function run
    uncompiled (no GPU here); the names of the kernels called, as they are called."""
    called: list[str] = []

    def run(kernel: fused.Kernel, *args: Any) -> Any:
        called.append(kernel.fn.__name__)
        return kernel.fn(*args)

    fused.on_device = lambda t: True  # type: ignore[assignment]
    fused.Kernel.run = run  # type: ignore[method-assign]
    return called


def _exchange_everything(
    rank: int, world: int, specs: list[str] = SPECS, device_path: bool = False
) -> dict[str, Any]:
    called = _take_the_device_path() if device_path else []
    params = [torch.empty(s) for s in SHAPES]
    out: dict[str, Any] = {"kernels": called}
    for spec in specs:
        c = compressor(spec)
        state = c.make_state(None)
        results = []
        for step in range(STEPS):
            # two buckets in flight at once, as DDP fires them
            futs = [
                c.hook(state, FlatBucket(gradient(rank, step, i), index=i, params=params))
                for i in range(2)
            ]
            results.append([f.wait().clone() for f in futs])
        residuals = state.state_dict().get("residuals", {})
        out[spec] = {
            "results": results,
            "residuals": {k: v.clone() for k, v in residuals.items()},
            "bytes": state.bytes_sent,
        }
    return out


@pytest.mark.timeout(120)
def test_every_compressor_keeps_ranks_bitwise_identical_and_conserves_mass() -> None:
    by_rank = run_ranks(_exchange_everything, WORLD, timeout_s=60)
    _assert_exchanged(by_rank, SPECS)
    assert sorted(s for s in SPECS if by_rank[0][s]["residuals"]) == [
        "powersgd:2",
        "sign",
        "topk:0.1",
    ]


@pytest.mark.timeout(120)
def test_the_gpu_path_of_every_fused_codec_keeps_ranks_identical_and_conserves_mass() -> None:
    """The same exchanges through the codecs' GPU path (its kernels run as plain torch ops):
    what no CPU run took before, and what a GPU runs with the kernels compiled."""
    by_rank = run_ranks(_exchange_everything, WORLD, FUSED_SPECS, True, timeout_s=60)
    _assert_exchanged(by_rank, FUSED_SPECS)
    called = set(by_rank[0]["kernels"])
    for kernel in ("int8_encode", "int8_decode", "int4_encode", "int4_decode"):
        assert kernel in called, sorted(called)
    for kernel in ("sign_encode", "sign_decode", "randomk_gather", "randomk_scatter"):
        assert kernel in called, sorted(called)


def _assert_exchanged(by_rank: list[dict[str, Any]], specs: list[str]) -> None:
    """Ranks bitwise identical; int8 within a step of the mean; bytes counted; error feedback
    conserving mass."""
    for spec in specs:
        r0, r1 = by_rank[0][spec], by_rank[1][spec]
        for step in range(STEPS):
            for i in range(2):
                a, b = r0["results"][step][i], r1["results"][step][i]
                assert torch.equal(a, b), f"{spec}: ranks differ at step {step} bucket {i}"
                true_mean = sum(gradient(r, step, i) for r in range(WORLD)) / WORLD
                if spec in ("none", "fp16", "bf16"):
                    tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 1e-2}[spec]
                    torch.testing.assert_close(a, true_mean, rtol=tol, atol=tol)
                elif spec == "int8":  # each rank errs by less than one step of its scale
                    steps = [gradient(r, step, i).abs().max() / 127 for r in range(WORLD)]
                    assert (a - true_mean).abs().max() < sum(steps) / WORLD
        assert r0["bytes"] > 0 and r0["bytes"] == r1["bytes"]
        if r0["residuals"]:  # error feedback: sum of means * W + residuals == sum of inputs
            for i in range(2):
                sent = sum(r0["results"][s][i].double() for s in range(STEPS)) * WORLD
                held = sum(by_rank[r][spec]["residuals"][i].double() for r in range(WORLD))
                given = sum(gradient(r, s, i).double() for r in range(WORLD) for s in range(STEPS))
                torch.testing.assert_close(sent + held, given, rtol=0, atol=1e-4)


def _train_ddp(rank: int, world: int, specs: list[str]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for spec in specs:
        torch.manual_seed(0)  # same initial weights on every rank
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
            torch.nn.Linear(32, 1),
        )  # fmt: skip
        ddp = DDP(model, bucket_cap_mb=0.004)  # ~1000 floats: several buckets
        state, hook = ddp_comm_hook(spec)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        target = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
        losses = []
        for _ in range(40):
            x = torch.randn(32, 16, generator=gen)
            loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[spec] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "losses": losses,
            "bytes": state.bytes_sent,
            "dense_bytes": 40 * 4 * sum(p.numel() for p in model.parameters()),
            "state": state.state_dict(),
        }
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_ddp_trains_with_gradsync_comm_hooks() -> None:
    specs = ["powersgd:2", "topk:0.1"]
    by_rank = run_ranks(_train_ddp, WORLD, specs, timeout_s=60)
    for spec in specs:
        r0, r1 = by_rank[0][spec], by_rank[1][spec]
        for a, b in zip(r0["params"], r1["params"], strict=True):
            assert torch.equal(a, b), f"{spec}: DDP replicas diverged"
        first, last = sum(r0["losses"][:5]) / 5, sum(r0["losses"][-5:]) / 5
        assert last < 0.5 * first, f"{spec}: loss {first:.3f} -> {last:.3f}"
        assert 0 < r0["bytes"] < r0["dense_bytes"]
        # DDP starts with one bucket and rebuilds into several after step 1: both layouts ran
        assert len(r0["state"]["residuals"]) >= 2, f"{spec}: expected several buckets"
    assert by_rank[0]["powersgd:2"]["state"]["inner"]["q"]  # warm-start factors were kept
