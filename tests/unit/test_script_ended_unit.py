"""``gradsync run``'s worker tells its open Synchronizers when the script ends well (it returned,
or ``sys.exit(0)``/``sys.exit()``), and not when it failed: the process lingers after the
script, and a peer must not take it for a rank busy between steps
(tests/ranks/test_script_ended.py checks what the peer then says)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gradsync.runner import worker
from gradsync.runner.config import RunConfig

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ending", "told"),
    [
        (None, ["it returned"]),
        (SystemExit(0), ["sys.exit(0)"]),
        (SystemExit(None), ["sys.exit()"]),
        (SystemExit(3), []),  # a failure: the rank fails, and the peers hear of it so
        (RuntimeError("boom"), []),
    ],
)
def test_the_script_ending_well_is_told_to_the_synchronizers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: BaseException | None, told: list[str]
) -> None:
    heard: list[str] = []
    monkeypatch.setattr(worker, "scripts_ended", heard.append)

    def script(command: list[str], ending_: Any = None) -> None:
        if ending is not None:
            raise ending

    monkeypatch.setattr(worker, "_run_main", script)
    monkeypatch.setenv("GRADSYNC_THREADS", "1")
    train = tmp_path / "train.py"
    train.write_text("")  # never run: _run_main stands in for it
    cfg = dataclasses.asdict(RunConfig(script=[str(train)], out=str(tmp_path / "run")))
    if ending is None or (isinstance(ending, SystemExit) and ending.code in (0, None)):
        worker.run_script(cfg)
    else:
        with pytest.raises(type(ending)):
            worker.run_script(cfg)
    assert heard == told


@pytest.mark.timeout(60)
def test_each_start_of_a_replica_groups_process_drops_the_last_attempts_final_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group that called report() and failed later kept that attempt's record, and the run's
    summary compared it, or said the group finished where it was lost (a reviewer's finding)."""
    from gradsync.telemetry.membership import FINAL_MODEL_PATH, write_final_model

    monkeypatch.setattr(worker, "scripts_ended", lambda how: None)
    monkeypatch.setattr(worker, "_run_main", lambda command, ending=None: None)
    monkeypatch.setenv("GRADSYNC_THREADS", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    group = tmp_path / "run" / "group-1"
    write_final_model(group, step=12, fingerprint="ab" * 8, restart=0)
    train = tmp_path / "train.py"
    train.write_text("")
    config = RunConfig(script=[str(train)], out=str(group), replica_groups=2, nproc=1)
    worker.run_script(dataclasses.asdict(config))
    assert not (group / FINAL_MODEL_PATH).exists()
