"""Messages that said something untrue (issue 42, trap 6): what zero:1 takes, that gs.init()
works under plain python, that only an enabled GradScaler is refused by a parameter server, and
gs.init(backend="nccl") alone on a machine without CUDA (a world of one on gloo, not an error)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync import runtime
from gradsync.compression import parse_compression
from gradsync.errors import UsageError
from gradsync.spec import COMPRESSION_FORMS, COMPRESSION_TABLE, GRADIENT_COMPRESSION_FORMS
from gradsync.strategies.base import SyncContext
from gradsync.strategies.factory import check_compression, check_compressor
from gradsync.strategies.ps import ParameterServer
from gradsync.strategies.zero import ZeroStage1

pytestmark = pytest.mark.unit
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
SLURM_ENV = ("SLURM_PROCID", "SLURM_NTASKS")
#: an argument for each form that needs one
EXAMPLE_ARGUMENT = {"topk": "0.1", "randomk": "0.1", "powersgd": "2", "sparseloco": ""}


def _example(kind: str) -> str:
    arg = EXAMPLE_ARGUMENT.get(kind, "")
    return f"{kind}:{arg}" if arg else kind


@pytest.fixture
def no_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No process group and no launcher's environment; any group made is destroyed after."""
    assert not dist.is_initialized()
    for key in TORCHRUN_ENV + SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_forms_said_to_compress_a_gradient_are_the_ones_zero_1_takes() -> None:
    listed = {
        k for k in COMPRESSION_TABLE if re.search(rf"(^|, ){k}\b", GRADIENT_COMPRESSION_FORMS)
    }
    assert {"none", "int8", "topk", "powersgd"} <= listed
    for kind in COMPRESSION_TABLE:
        compressor = parse_compression(_example(kind))
        if kind in listed:
            check_compressor(ZeroStage1(), compressor)  # taken
        else:
            with pytest.raises(UsageError, match="needs local:H or diloco:H"):
                check_compressor(ZeroStage1(), compressor)
    assert "sparseloco" not in listed


def test_the_zero_2_refusal_suggests_only_what_zero_1_takes() -> None:
    with pytest.raises(UsageError) as refused:
        check_compression("zero:2", "int8")
    message = str(refused.value)
    assert "zero:2 cannot compress" in message and "zero:1" in message
    # zero:1 is offered with the forms it takes: sparseloco's is not among them.
    assert COMPRESSION_FORMS not in message and "sparseloco[:" not in message, message


def test_a_step_before_init_says_plain_python_works(no_group: None) -> None:
    with pytest.raises(UsageError) as refused:
        runtime.require_initialized("sync.step()")
    message = str(refused.value)
    assert "python train.py" in message and "world of one" in message, message
    assert "torchrun, gradsync run or srun" in message, message


def _ctx(scaler: torch.amp.GradScaler) -> SyncContext:
    model = nn.Linear(3, 2)
    return SyncContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        group=None,
        compressor=parse_compression(None),
        bucket_mb=25.0,
        scaler=scaler,
    )


def test_a_parameter_server_refuses_an_enabled_scaler_only() -> None:
    with pytest.raises(UsageError) as refused:
        ParameterServer(0.0).setup(_ctx(torch.amp.GradScaler("cpu")))
    message = str(refused.value)
    assert "cannot drive ssp:0 while enabled" in message, message
    assert "GradScaler(enabled=False)) is accepted" in message, message
    # What the message says: a disabled one is taken.
    ParameterServer(0.0).setup(_ctx(torch.amp.GradScaler("cpu", enabled=False)))


def test_nccl_alone_without_cuda_makes_a_world_of_one_on_gloo(
    no_group: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="gradsync.runtime"):
        gs.init(backend="nccl")
    assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert [r.name for r in caplog.records] == ["gradsync.runtime"]
    assert "makes a world of one on 'gloo'" in caplog.text
    assert "pass backend='gloo'" in caplog.text


def test_nccl_on_several_ranks_without_cuda_is_still_refused(
    no_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "0")  # refused before any store is made
    with pytest.raises(UsageError, match="backend 'nccl' .*use 'gloo'"):
        gs.init(backend="nccl")
    assert not dist.is_initialized()
