"""What ``gradsync run`` starts on every rank: a script, the user's own or the built-in
workloads' (``gradsync.runner.train``), run as ``__main__`` in the elastic agent's worker
process with ``GRADSYNC_RUN_DIR`` naming the run directory its gs.Synchronizer attaches to
(``gradsync.attached_run``). One way in for both (also runnable under torchrun:
``python -m gradsync.runner.worker --config RUN_DIR/config.json``)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch

from gradsync import runtime
from gradsync.attached_run import (
    ATTEMPTS_FILE,
    CONFIG_FILE,
    RUN_DIR_ENV,
    append_fault,
    restart_count,
)
from gradsync.logs import get_logger
from gradsync.runner.config import RunConfig
from gradsync.runner.rundir import CHECKPOINT_DIR, FINAL_MODEL
from gradsync.runner.stopped import records_kept_when_stopped

__all__ = ["CHECKPOINT_DIR", "FINAL_MODEL", "run_rank", "run_script", "run_worker"]

#: replaced by the run directory in a script's arguments
RUN_DIR_PLACEHOLDER = "{run_dir}"
#: the built-in workloads' script (``--config RUN_DIR/config.json`` follows)
BUILTIN = ["-m", "gradsync.runner.train"]
warnings_logger = get_logger("warnings")


_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep  # gradsync/


def _one_line_warnings() -> None:
    """Show gradsync's own warnings in this worker (of its categories, or raised from its
    files) through the ``gradsync.warnings`` logger: one ``gradsync: ...`` line each, like the
    command's other messages, at the level the user set for gradsync's logs
    (``GRADSYNC_LOG_LEVEL=error`` hides them). Python's format adds the file, line and source
    text of the ``warnings.warn`` call, which tell a user of the command nothing; other
    warnings keep it. Filters still apply first: a warning the script ignores is not shown."""
    shown = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if category.__module__.split(".")[0] == "gradsync" or filename.startswith(_PACKAGE):
            warnings_logger.warning("%s", str(message).removeprefix("gradsync: "))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def run_rank(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of ``gradsync run``: the user's script if the run names one, else the
    built-in workloads' script, both through ``run_script``."""
    return run_script(config_dict)


def run_worker(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of a built-in workload's run (the run's config.json must be written)."""
    return run_script({**config_dict, "script": []})


def run_script(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """Run the run's script (the user's, or ``-m MODULE``; none: the built-in workloads') as
    ``__main__`` in this rank's process, as ``python train.py ARGS`` under torchrun would,
    with ``GRADSYNC_RUN_DIR`` naming the run directory its gs.Synchronizer attaches to. Why
    in-process rather than a new interpreter: the elastic agent's worker is this process (its
    restarts, its error file naming the failed rank and the exception), and a second
    interpreter would import torch again. Returns, on rank 0, where the run directory is; a
    script's ``sys.exit(0)`` is a success, any other exit status fails the rank. A SIGTERM
    from the agent (a peer failed for good) writes the rank's step records first
    (``runner.stopped``)."""
    cfg = RunConfig.from_dict(config_dict)
    _one_line_warnings()
    run_dir = Path(cfg.out).resolve()
    os.environ[RUN_DIR_ENV] = str(run_dir)
    if cfg.replica_groups and os.environ.get("LOCAL_RANK", "0") == "0":
        # Each start of a replica group's process, for the run's summary of its restarts
        # (the group's elastic agent restarts it on its own; nothing else sees that).
        entry = {"restart": restart_count(), "pid": os.getpid(), "time": time.time()}
        append_fault(run_dir, ATTEMPTS_FILE, entry)
    torch.set_num_threads(int(os.environ.get("GRADSYNC_THREADS", cfg.threads)))
    # ``{run_dir}`` in the script's arguments: this run's directory (each of compare's runs has
    # its own: a checkpoint path there is not shared between strategies)
    command = [arg.replace(RUN_DIR_PLACEHOLDER, str(run_dir)) for arg in cfg.script]
    command = command or [*BUILTIN, "--config", str(run_dir / CONFIG_FILE)]
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    try:
        with records_kept_when_stopped(heals_forward=bool(cfg.replica_groups)):
            _run_main(command)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return {"run_dir": cfg.out} if runtime.rank() == 0 else None


def _run_main(command: list[str]) -> None:
    """``command`` (a script and its arguments, or ``-m MODULE ...``) as ``__main__``."""
    import runpy

    if command[0] == "-m":
        # As ``python -m``: the current directory first on the import path (a package there)
        sys.argv = [command[1], *command[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        # As ``python train.py``: the script's own directory first on the import path
        sys.argv = command
        sys.path.insert(0, str(Path(command[0]).resolve().parent))
        runpy.run_path(command[0], run_name="__main__")


def main() -> None:
    """``python -m gradsync.runner.worker --config RUN_DIR/config.json``: one worker under
    torchrun."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, help="a run's config.json")
    args = parser.parse_args()
    run_rank(json.loads(Path(args.config).read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
