"""Comparisons of a checkpoint export with what the ranks held, for tests/*/test_export*.py: a
fresh model and optimizer loaded from it (``torch.save`` state dict or DCP), bitwise equal."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.support import export_ranks as er

# -- comparisons -----------------------------------------------------------------------------------


def assert_same(actual: Any, expected: Any, where: str) -> None:
    """The same tree, every tensor bitwise equal (dtype and shape included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def fresh_from(exported: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer, built as the training script built them, loaded from an
    export as a user's script would load it."""
    model, optimizer = er.build()
    model.load_state_dict(exported["model"], strict=True)
    optimizer.load_state_dict(exported["optimizer"])
    return model, optimizer


def optimizer_state_sorted(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with its per-parameter state in parameter order (the order in
    which a single process creates it; a zero:N export takes it rank by rank)."""
    return {**state, "state": dict(sorted(state["state"].items()))}


def check_export(
    exported: dict[str, Any],
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    step: int,
) -> None:
    """The export loads into a fresh model (strict) and optimizer, and both then hold what
    the ranks held, bit for bit."""
    assert exported["step"] == step and exported["extra"] == {"data_position": step}
    fresh_model, fresh_optimizer = fresh_from(exported)
    assert_same(fresh_model.state_dict(), model, "model")
    assert_same(
        optimizer_state_sorted(fresh_optimizer.state_dict()),
        optimizer_state_sorted(optimizer),
        "optimizer",
    )
    # AdamW's state for every parameter: no rank's part left out
    assert len(fresh_optimizer.state_dict()["state"]) == len(list(fresh_model.parameters()))


def dcp_template(model: torch.nn.Module, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A fresh state dict to ``dcp.load`` into: a fresh model's ``state_dict()`` (its own
    tensors are loaded in place) and zeros shaped as the optimizer state."""
    return {
        "model": model.state_dict(),
        "optimizer": {
            "state": {
                i: {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                    for k, v in s.items()
                }
                for i, s in optimizer_state["state"].items()
            },
            "param_groups": [{k: None for k in group} for group in optimizer_state["param_groups"]],
        },
        "step": -1,
        "extra": {"data_position": -1},
    }


def dcp_load(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=path, no_dist=True)
    return template


def check_dcp(path: Path, expected: dict[str, Any], tmp: Path) -> None:
    """DCP: ``dcp.load`` into a fresh state dict gives the export's tensors and values; and
    the whole tree read back without a template (``dcp_to_torch_save``, whose optimizer
    state keys come back as strings) loads into a fresh model and optimizer."""
    fresh, _ = er.build()
    loaded = dcp_load(path, dcp_template(fresh, expected["optimizer"]))
    assert_same(fresh.state_dict(), expected["model"], "dcp model, loaded in place")
    assert_same(loaded, expected, "dcp")
    dcp_to_torch_save(path, tmp / "from-dcp.pt")
    whole = torch.load(tmp / "from-dcp.pt", weights_only=True)
    optimizer = whole["optimizer"]
    optimizer["state"] = {int(k): v for k, v in optimizer["state"].items()}
    model, fresh_optimizer = fresh_from(whole)
    assert_same(model.state_dict(), expected["model"], "dcp_to_torch_save model")
    assert_same(fresh_optimizer.state_dict(), expected["optimizer"], "dcp_to_torch_save optimizer")
