"""Exporting a checkpoint written by two gloo ranks (``gradsync.checkpoint.export``): the whole
model and optimizer, and BatchNorm's buffers, bitwise equal to what the ranks held. In one
process and the command's refusals: tests/unit/test_export.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint.export import export_checkpoint, single_process_state
from gradsync.testing import run_ranks
from tests.support import export_ranks as er
from tests.support.export import (
    assert_same,
    check_dcp,
    check_export,
)

pytestmark = pytest.mark.ranks


# -- real ranks: every rank's share and shard ------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every strategy of ``export_ranks.STRATEGIES`` trained on two gloo ranks (one spawn)."""
    root = tmp_path_factory.mktemp("two-ranks")
    return root, run_ranks(er.trained, 2, str(root), timeout_s=240)


def _expected_optimizer(spec: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the export must hold of the optimizer: the replicas' (bsp: the same on every
    rank), every rank's owned part (zero:N), or rank 0's (local SGD, DiLoCo)."""
    if not spec.startswith("zero"):
        return ranks[0][spec]["optimizer"]
    if spec in ("zero:1", "zero:2"):
        # By rows (the default for AdamW) each rank held its rows of every tensor's state;
        # joined, they are bsp's, whose trajectory both follow bitwise on 2 ranks.
        return {**ranks[0][spec]["optimizer"], "state": ranks[0]["bsp"]["optimizer"]["state"]}
    state: dict[int, Any] = {}
    for r in ranks:
        owned = r[spec]["optimizer"]["state"]
        assert not set(owned) & set(state), "a parameter's state on two ranks"
        state.update(owned)
    return {**ranks[0][spec]["optimizer"], "state": state}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", er.STRATEGIES)
def test_two_ranks_export_whole_model_and_optimizer(
    spec: str, two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """bsp's shares, zero:N's shards of the optimizer state (each rank holds some, none all),
    local SGD's and DiLoCo's rank 0: the export loads strictly into a fresh model and
    optimizer, and both then hold bitwise what the ranks held after the last checkpoint."""
    root, ranks = two_ranks
    directory = root / spec.replace(":", "-")
    done = export_checkpoint(directory, tmp_path / "model.pt")
    assert done.world_size == 2
    exported = torch.load(done.path, weights_only=True)
    check_export(exported, ranks[0][spec]["model"], _expected_optimizer(spec, ranks), er.STEPS)
    if spec in ("bsp", "zero:1", "zero:2"):
        assert_same(exported["model"], ranks[1][spec]["model"], "rank 1's replica")
    if spec == "bsp":
        assert_same(
            exported["optimizer"], ranks[1][spec]["optimizer"], "rank 1's optimizer replica"
        )
    if spec.startswith("zero"):  # each rank held its rows of every tensor's state, none all
        for index, entry in exported["optimizer"]["state"].items():
            rows = [r[spec]["optimizer"]["state"][index]["exp_avg"].shape[0] for r in ranks]
            assert sum(rows) == entry["exp_avg"].shape[0] and min(rows) > 0, (index, rows)
    dcp_done = export_checkpoint(directory, tmp_path / "model.dcp", to="dcp")
    check_dcp(dcp_done.path, exported, tmp_path)


def _parameter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}


@pytest.mark.timeout(300)
def test_bsp_with_batch_norm_exports_the_parameters_and_each_buffer_from_one_rank(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    """BatchNorm's running statistics are each rank's own between steps under ``bsp`` (rank
    0's are broadcast at the start of the next step, as DDP's ``broadcast_buffers``): the
    parameters are every replica's, and each buffer is the one the rank that wrote its share
    held (docs/checkpoints.md, "Opening a checkpoint with torch alone")."""
    root, ranks = two_ranks
    exported = single_process_state(root / er.BATCH_NORM)
    model, _ = er.build(batch_norm=True)
    model.load_state_dict(exported["model"], strict=True)
    held = [r[er.BATCH_NORM]["model"] for r in ranks]
    for name, value in exported["model"].items():
        if name in _parameter_names(model):
            assert_same(value, held[0][name], name)
            assert_same(value, held[1][name], name)
        else:
            assert any(torch.equal(value, h[name]) for h in held), name
    differ = [n for n in held[0] if not torch.equal(held[0][n], held[1][n])]
    assert differ == ["1.running_mean", "1.running_var"]  # what the test is about


@pytest.mark.timeout(300)
def test_bsp_with_batch_norm_exports_rank_0s_buffers(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    # BatchNorm's running statistics differ between ranks after a step (rank 0's are
    # broadcast at the next step's start): the checkpoint holds rank 0's, which the run goes on
    # with, so the export and ``sync.load`` do too.
    root, ranks = two_ranks
    exported = single_process_state(root / er.BATCH_NORM)
    assert_same(exported["model"], ranks[0][er.BATCH_NORM]["model"], "rank 0's model")
