"""``sparseloco`` on two gloo ranks training the mlp: replicas bitwise identical after every
synchronization, loss falling, bytes per exchange, and a resume that restores the accumulator
bit for bit. The codec, the accumulator and the spec: tests/unit/test_sparseloco.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.compression.sparseloco import (
    index_bits,
    kept,
)
from gradsync.testing import run_ranks
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

pytestmark = pytest.mark.ranks


# -- two ranks ---------------------------------------------------------------------------------

PARAMS = 6000  # the mlp's three Linear layers: 6 chunks of 1024, the last one short
PER_RANK = 8
SPEC = "sparseloco:0.1:1024:0.9"


def _train(
    rank: int,
    world: int,
    strategy: str,
    compression: str,
    steps: int,
    *,
    directory: str | None = None,
    save_at: int | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=PARAMS)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(model, opt, strategy=strategy, compression=compression, timeout_s=30)
    start, saved = 0, None
    if resume:
        loaded = sync.load(str(directory))
        assert loaded is not None
        start = loaded["step"]
    after, losses = [], []
    for step in range(start, steps):
        with sync.step(samples=PER_RANK):
            lo = rank * PER_RANK
            x, y = w.batch(step, PER_RANK * world, lo, lo + PER_RANK)
            loss = w.loss(model, x, y)
            loss.backward()
        losses.append(float(loss.detach()))
        after.append(flat_params(model))
        if step == save_at:
            saved = sync.state_dict()["strategy"]["compressor"]
            sync.save(str(directory))
    report = sync.report()
    # Closed, as a script would: a run that saved otherwise keeps its writer process, and the
    # next run's load waits for it (up to half the timeout) before it reads the directory.
    sync.close()
    return {
        "after": after,
        "params": flat_params(model),
        "losses": losses,
        "bytes": [r.bytes for r in report.records if r.rank == rank],
        "saved": saved,
    }


def scenarios(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every two-rank scenario, in one launch of the ranks."""
    out = {
        name: _train(rank, world, strategy, compression, steps)
        for name, strategy, compression, steps in (
            ("local", "local:4", SPEC, 48),
            ("diloco", "diloco:4", SPEC, 48),
            ("diloco plain", "diloco:4", "none", 48),
            ("streaming", "diloco:4:2", SPEC, 48),
        )
    }
    out["straight"] = _train(rank, world, "diloco:4", SPEC, 16)
    out["continued"] = _train(rank, world, "diloco:4", SPEC, 16, directory=directory, save_at=9)
    out["resumed"] = _train(rank, world, "diloco:4", SPEC, 16, directory=directory, resume=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("sparseloco")
    return run_ranks(scenarios, 2, str(directory), timeout_s=240)


def _trained(run: dict[str, Any]) -> float:
    return sum(run["losses"][-4:]) / 4


def _untrained(run: dict[str, Any]) -> float:
    return sum(run["losses"][:4]) / 4


def _payload() -> int:
    n = sum(
        p.numel() for p in make_workload("mlp", seed=2, params=PARAMS).build_model().parameters()
    )
    full, tail = divmod(n, 1024)
    records = full * kept(0.1, 1024) + kept(0.1, tail)
    return 8 * math.ceil(n / 1024) + math.ceil(records * (index_bits(1024) + 2) / 8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["local", "diloco"])
def test_replicas_are_bitwise_identical_after_every_synchronization(
    runs: list[dict[str, Any]], name: str
) -> None:
    r0, r1 = runs[0][name], runs[1][name]
    synced = [s for s in range(48) if s % 4 == 3]
    for s in synced:
        assert torch.equal(r0["after"][s], r1["after"][s]), (name, s)
    # ...and only there: between synchronizations each rank trains on its own shard
    assert not torch.equal(r0["after"][4], r1["after"][4])
    assert torch.equal(r0["params"], r1["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["local", "diloco", "streaming"])
def test_loss_falls(runs: list[dict[str, Any]], name: str) -> None:
    # 48 steps (12 exchanges, 10% of each chunk each): local 0.77 -> 0.47, diloco (outer lr
    # 0.7, no momentum) -> 0.55, streaming -> 0.61; uncompressed diloco:4 reaches 0.41
    run = runs[0][name]
    assert _trained(run) < 0.85 * _untrained(run), name
    # it moved the model differently from the uncompressed run
    assert not torch.equal(run["params"], runs[0]["diloco plain"]["params"])
    assert torch.equal(run["params"], runs[1][name]["params"])  # the final models agree


@pytest.mark.timeout(300)
def test_bytes_per_exchange_are_the_sparse_payload(runs: list[dict[str, Any]]) -> None:
    payload = _payload()
    n = runs[0]["diloco plain"]["bytes"][3] // 4  # fp32 pseudo-gradient, once every H steps
    # about DENSITY * (10 index + 2 value bits) / 32 of the dense bytes
    assert payload / (4 * n) == pytest.approx(0.1 * 12 / 32, rel=0.1)
    for name in ("local", "diloco"):
        got = runs[0][name]["bytes"]
        assert got == [payload if s % 4 == 3 else 0 for s in range(48)], name
    # streaming: each fragment is its own bucket, its exchange every H steps at its offset
    streaming = runs[0]["streaming"]["bytes"]
    assert all(b > 0 for s, b in enumerate(streaming) if s % 2 == 1)
    assert sum(streaming) < sum(runs[0]["diloco plain"]["bytes"]) / 10


@pytest.mark.timeout(300)
def test_a_resumed_run_restores_the_accumulator_and_continues_bitwise(
    runs: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        r = runs[rank]
        assert torch.equal(r["continued"]["params"], r["straight"]["params"])
        assert torch.equal(r["resumed"]["params"], r["straight"]["params"])
        saved = r["continued"]["saved"]
        assert list(saved["accumulators"]) == [0] and saved["beta"] == 0.9
        assert saved["accumulators"][0].abs().sum() > 0  # something was left unsent
