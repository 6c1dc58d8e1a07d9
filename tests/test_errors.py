"""Each user error gets one clear message naming the bad value and what is valid; the CLI exits
non-zero without a traceback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.testing import run_ranks
from tests.test_cli_run import gradsync


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--strategy", "bogus"], "unknown strategy 'bogus'; valid: bsp, zero:N, local:H"),
        (["--strategy", "local:0"], "H must be an integer >= 1"),
        (["--strategy", "ssp:-1"], "S must be an integer >= 0 or inf"),
        (["--strategy", "ssp:1", "--servers", "0"], "--servers must be at least 1, got 0"),
        (["--batch-size", "6", "--micro-batches", "4"], "does not split into --micro-batches 4"),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--bucket-mb", "0"], "--bucket-mb must be > 0, got 0.0"),
        (["--micro-batches", "0"], "--micro-batches must be at least 1, got 0"),
        (
            ["--data", "/nonexistent/corpus.txt"],
            "--data file '/nonexistent/corpus.txt' does not exist or is not a file; pass an "
            "existing text file of at least 1024 bytes, or omit --data to train on the "
            "standard-library sample",
        ),
        (["--workload", "resnet"], "unknown workload 'resnet'; valid: charlm, mlp"),
        (["--slow", "1x3"], "bad --slow value '1x3'"),
        (["--nproc", "2", "--slow", "5:2"], "names rank 5, but ranks are 0..1"),
    ],
)
@pytest.mark.timeout(60)
def test_cli_usage_errors(args: list[str], expected: str, tmp_path) -> None:
    proc = gradsync("run", "--out", str(tmp_path / "r"), *args, timeout=60)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.unit
def test_strategy_spec_error_names_valid_forms() -> None:
    with pytest.raises(
        ValueError,
        match=r"valid: bsp, zero:N, local:H, diloco:H\[:F\[:TAU\[:ALPHA\]\]\[:SPLIT\]\]"
        r"\[:outer_lr=X\]\[:outer_momentum=M\], ssp:S, "
        "async",
    ):
        gs.parse_strategy("bps")


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_data_file_too_small_names_size_and_what_is_valid(tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("tiny corpus")
    proc = gradsync("run", "--out", str(tmp_path / "r"), "--data", str(small), timeout=60)
    assert proc.returncode == 2
    assert f"--data file '{small}' holds 11 bytes; pass an existing text file of at least " in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.unit
def test_synchronizer_before_init_is_a_clear_error() -> None:
    # The Synchronizer is the first thing that needs the process group: it broadcasts the
    # initial parameters, so without gs.init() there is no sync.step() to call yet.
    model = nn.Linear(2, 1)
    with pytest.raises(UsageError, match=r"gs.Synchronizer needs torch.distributed: call gs.init"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.unit
def test_step_after_the_process_group_is_gone_is_a_clear_error(tmp_path) -> None:
    # A one-rank group in this process (FileStore: no port), destroyed between steps.
    model = nn.Linear(2, 1)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with sync.step():
            model(torch.ones(1, 2)).sum().backward()
        assert sync.step_count == 1
    finally:
        dist.destroy_process_group()
    no_group = r"sync.step\(\) needs torch.distributed: call gs.init"
    with pytest.raises(UsageError, match=no_group), sync.step():
        pytest.fail("the block must not run without a process group")
    assert sync.step_count == 1


def _bad_synchronizers(rank: int, world: int) -> list[str]:
    messages = []
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen = nn.Linear(2, 1).requires_grad_(False)
    cases = [
        lambda: gs.Synchronizer(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1)),
        lambda: gs.Synchronizer(model, opt, bucket_mb=0),
        lambda: gs.Synchronizer(model, opt, bucket_mb=-1.5),
        lambda: gs.Synchronizer(model, opt, strategy="ssp"),
    ]
    for make in cases:
        try:
            make()
            messages.append("no error")
        except UsageError as exc:
            messages.append(str(exc))
    sync = gs.Synchronizer(model, opt)
    for bad in (0, -1, 1.5):
        try:
            with sync.step(micro_batches=bad):  # type: ignore[arg-type]
                pass
            messages.append("no error")
        except UsageError as exc:
            messages.append(str(exc))
    try:  # fewer backward passes than announced
        with sync.step(micro_batches=2):
            model(torch.ones(1, 2)).sum().backward()
        messages.append("no error")
    except UsageError as exc:
        messages.append(str(exc))
    return messages


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_api_usage_errors() -> None:
    messages = run_ranks(_bad_synchronizers, 1)[0]
    assert "has no trainable parameters" in messages[0]
    assert "bucket_mb must be a number > 0, got 0" in messages[1]
    assert "got -1.5" in messages[2]
    assert "unknown strategy 'ssp'" in messages[3]
    for m, bad in zip(messages[4:7], ("0", "-1", "1.5"), strict=True):
        assert f"micro_batches must be an integer >= 1, got {bad}" in m
    assert "micro_batches=2) but the block ran 1 backward pass" in messages[7]
