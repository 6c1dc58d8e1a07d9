"""What ``gradsync run`` starts on every rank: a script, the user's own or the built-in
workloads' (``gradsync.runner.train``), run as ``__main__`` in the elastic agent's worker
process with ``GRADSYNC_RUN_DIR`` naming the run directory its gs.Synchronizer attaches to
(``gradsync.attached_run``). One way in for both (also runnable under torchrun:
``python -m gradsync.runner.worker --config RUN_DIR/config.json``)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import multiprocessing
import multiprocessing.util
import os
import sys
import time
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradsync import compat, runtime
from gradsync.attached_run import (
    ATTEMPTS_FILE,
    CONFIG_FILE,
    RUN_DIR_ENV,
    append_fault,
    restart_count,
)
from gradsync.logs import one_line_warnings
from gradsync.runner.config import RunConfig, is_source_file, said_by_the_command
from gradsync.runner.rundir import CHECKPOINT_DIR, FINAL_MODEL
from gradsync.runner.stopped import records_kept_when_stopped
from gradsync.synchronizer import scripts_ended
from gradsync.telemetry.membership import FINAL_MODEL_PATH

__all__ = ["CHECKPOINT_DIR", "FINAL_MODEL", "run_rank", "run_script", "run_worker"]

#: replaced by the run directory in a script's arguments
RUN_DIR_PLACEHOLDER = "{run_dir}"
#: the built-in workloads' script (``--config RUN_DIR/config.json`` follows)
BUILTIN = ["-m", "gradsync.runner.train"]


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
    (``runner.stopped``). The script sees multiprocessing's start method unset, and a forked
    rank ends as the script's interpreter would (``_start_method_as_python``, ``_ScriptExit``)."""
    one_line_warnings()
    said_by_the_command()  # its checks' warnings: the command printed them before this rank
    cfg = RunConfig.from_dict(config_dict)
    run_dir = Path(cfg.out).resolve()
    os.environ[RUN_DIR_ENV] = str(run_dir)
    if cfg.replica_groups and os.environ.get("LOCAL_RANK", "0") == "0":
        # Each start of a replica group's process, for the run's summary of its restarts
        # (the group's elastic agent restarts it on its own; nothing else sees that).
        entry = {"restart": restart_count(), "pid": os.getpid(), "time": time.time()}
        append_fault(run_dir, ATTEMPTS_FILE, entry)
        # An earlier attempt's final model is not this one's: a group that called report()
        # and failed later would be compared by it, its loss said to be its finish.
        (run_dir / FINAL_MODEL_PATH).unlink(missing_ok=True)
    torch.set_num_threads(int(os.environ.get("GRADSYNC_THREADS", cfg.threads)))
    # ``{run_dir}`` in the script's arguments: this run's directory (each of compare's runs has
    # its own: a checkpoint path there is not shared between strategies)
    command = [arg.replace(RUN_DIR_PLACEHOLDER, str(run_dir)) for arg in cfg.script]
    command = command or [*BUILTIN, "--config", str(run_dir / CONFIG_FILE)]
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    ending = _ScriptExit()
    if _ends_without_exit():
        # After every other finalizer of the process (gradsync's own, at priorities 0 and 1,
        # and multiprocessing's joining of the children): where a spawned rank's interpreter
        # exit would run the same handlers, after the same steps.
        multiprocessing.util.Finalize(None, ending, exitpriority=_LAST_PRIORITY)
    try:
        with (
            records_kept_when_stopped(heals_forward=bool(cfg.replica_groups)),
            _start_method_as_python(),
        ):
            _run_main(command, ending)
        # the process goes on (the elastic agent's worker waits for its peers): its open
        # Synchronizers tell their peers, which would take it for a rank busy between steps
        scripts_ended("it returned")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        scripts_ended(f"sys.exit({exc.code if exc.code is not None else ''})")
    except BaseException as exc:
        ending.failed(exc)
        _said_before_restart(exc)
        raise
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return {"run_dir": cfg.out} if runtime.rank() == 0 else None


def _said_before_restart(exc: BaseException) -> None:
    """One line on stderr naming this rank's exception where the agent restarts the group: an
    elastic restart shows none of a failed attempt's errors (only "worker process N exited
    with code 1"), where a run that ends with one names it (``cli._describe_child_failure``)."""
    if isinstance(exc, Exception) and runtime.restarts_left():
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        print(
            f"gradsync: rank {runtime.rank()} failed, and the run restarts: {why}",
            file=sys.stderr,
            flush=True,
        )


#: lower than any finalizer's exit priority in gradsync (0 and 1) or a script's likely choice
_LAST_PRIORITY = -(2**31)


def _ends_without_exit() -> bool:
    """Whether this process is a child that multiprocessing started by forking (``gradsync
    run``'s workers from its forkserver, ``gradsync.processes.forkserver``): it ends with
    ``os._exit`` once its function returns, so the interpreter's exit never runs there. A
    spawned child ends with ``sys.exit``, a worker under torchrun is no child of
    multiprocessing: their interpreters' exits do it. Read before ``_start_method_as_python``:
    multiprocessing sets a child's start method to the one that started it."""
    if multiprocessing.parent_process() is None:
        return False
    method = multiprocessing.get_start_method(allow_none=True)
    return (method or multiprocessing.get_all_start_methods()[0]) != "spawn"


@contextlib.contextmanager
def _start_method_as_python() -> Iterator[None]:
    """While the script runs, multiprocessing's start method unset, as in ``python
    train.py``: the platform's default for a process started without one, and a script's own
    ``set_start_method`` is not refused. A rank is a multiprocessing child whose start method
    multiprocessing set to the one that started it (forkserver, or spawn): a DataLoader with
    workers then started them that way, and each imported the script again, whose unguarded
    ``gs.init()`` failed the run (a script without ``if __name__ == "__main__":``, fine under
    torchrun, where the default on Linux forks them from the script)."""
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(None, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


class _ScriptExit:
    """What ``python train.py``'s exit does for the script, done at the exit of a rank that
    ends with ``os._exit`` (``_ends_without_exit``), which would skip it: its ``atexit``
    handlers (``weakref.finalize`` callbacks among them) run, then its globals are dropped (a
    script run from its file: runpy keeps a ``-m MODULE``'s to itself) and the garbage
    collected, so a file it left open is flushed and closed as it is freed (a log written every
    step and never closed was left empty). After an uncaught exception, the
    exception is in ``sys.last_value`` while the handlers run, as Python sets it when it prints
    one (gradsync's own handler then bounds its wait as for a failed script), and the locals of
    the frames it passed through are dropped too. Multiprocessing flushes stdout and stderr
    after this. What differs from the interpreter's exit: it comes before the process's
    non-daemon threads are joined, and the globals of other modules are not dropped (a file
    only another module holds is not closed)."""

    def __init__(self) -> None:
        #: the script's globals, where it ran from a source file (``_run_source``)
        self.namespace: dict[str, Any] = {}
        self.error: BaseException | None = None

    def failed(self, exc: BaseException) -> None:
        self.error = exc
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__

    def __call__(self) -> None:
        compat.run_exit_handlers()
        if self.error is not None:
            traceback.clear_frames(self.error.__traceback__)
            for name in ("last_type", "last_value", "last_traceback"):
                if hasattr(sys, name):
                    delattr(sys, name)
            self.error = None
        # In the interpreter's order: names with one leading underscore first, then the rest
        # (set to None, not deleted: a function of the script still running finds the name).
        names = list(self.namespace)
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                self.namespace[name] = None
        for name in names:
            if name != "__builtins__":
                self.namespace[name] = None
        gc.collect()


def _run_main(command: list[str], ending: _ScriptExit | None = None) -> None:
    """``command`` (a script and its arguments, or ``-m MODULE ...``) as ``__main__``; a
    source file's globals kept in ``ending``, for the exit."""
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
        if is_source_file(command[0]):
            _run_source(command[0], ending or _ScriptExit())
        else:  # a directory or zip archive with a __main__.py, or a compiled file
            runpy.run_path(command[0], run_name="__main__")


def _run_source(path: str, ending: _ScriptExit) -> None:
    """``runpy.run_path(path, run_name="__main__")`` for a source file, with the same
    globals, but kept in ``ending``: runpy's module is its own, and a script that raises
    leaves no way to reach it."""
    with io.open_code(os.path.abspath(path)) as f:  # bytes: the file's coding line decides
        source = f.read()
    # dont_inherit: not this module's ``from __future__`` imports
    code = compile(source, path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path, __cached__=None, __loader__=None, __package__="", __spec__=None
    )
    ending.namespace = module.__dict__
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module  # as runpy does: pickle and ``import __main__`` find it
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
        else:
            del sys.modules["__main__"]


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
