"""One replica group of ``gradsync run --replica-groups G`` (``gradsync.runner.replica_groups``
starts G of these, each a process of its own): the group's ranks launched through torch's
elastic agent, as ``gradsync run`` launches a run's, with the group's own ``--max-restarts``.
A failure is said in one line naming the group; a stop by signal is said once, by the run.
A module of its own: it reports a failure as ``gradsync run`` does (``runner.cli``), which
itself starts the groups through ``runner.replica_groups``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from gradsync.runner.config import RunConfig

#: how long a group that ended waits for its ranks' checkpoint writers, within the
#: ``replica_groups.STOP_GRACE_S`` the run gives it after SIGTERM before killing its session
WRITERS_GRACE_S = 15.0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradsync.runner.group --config RUN/group-K/config.json``."""
    from gradsync.processes.launch import launch
    from gradsync.runner.worker import run_rank

    parser = argparse.ArgumentParser(prog="python -m gradsync.runner.group")
    parser.add_argument("--config", required=True, help="a replica group's config.json")
    args = parser.parse_args(argv)
    cfg = RunConfig.from_dict(json.loads(Path(args.config).read_text(encoding="utf-8")))
    _stop_with_parent(os.getppid())
    if not os.environ.get("GRADSYNC_DEBUG"):  # as gradsync run's own launch (runner.cli)
        from gradsync.processes.worker_deaths import quiet_elastic_logs

        quiet_elastic_logs()
    try:
        launch(
            run_rank,
            (cfg.to_dict(),),
            nproc=cfg.processes,
            threads=cfg.threads,
            max_restarts=cfg.max_restarts,
        )
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - named in one line, as gradsync run does
        return _group_failure(cfg.replica_group, exc)
    finally:
        _wait_for_checkpoint_writers(cfg.replica_group)
    return 0


def _wait_for_checkpoint_writers(group: int | None) -> None:
    """Before this process ends: the checkpoint writers its ranks left (``writer_child``),
    still writing the snapshots their stopped ranks held and, on rank 0, committing the
    newest step every rank wrote. The run kills this group's whole session once this process
    has ended (``replica_groups._stop``), and a writer killed then lost every checkpoint
    held since the last one written to a file: a SIGTERM after three checkpoints logged left
    the first, and --resume went back to it (docs/checkpoints.md, "Held snapshots")."""
    from gradsync.checkpoint.writer_locks import wait_for_session_writers

    left = wait_for_session_writers(WRITERS_GRACE_S)
    if left:
        print(
            f"gradsync: replica group {group}: {len(left)} checkpoint writer(s) still writing "
            f"{WRITERS_GRACE_S:.0f} s after the group ended (pids "
            f"{', '.join(map(str, left))}): their checkpoints may be lost",
            file=sys.stderr,
        )


def _stop_with_parent(parent: int) -> None:
    """Stop this group as the run's SIGTERM would once the ``gradsync run`` that started it is
    gone: a run killed with SIGKILL runs no handler, and each group has a session of its own
    (so that a terminal's Ctrl-C reaches the run alone), so nothing else would stop it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # the agent stops its workers, as on the run's

    threading.Thread(target=watch, name="gradsync-group-parent", daemon=True).start()


def _group_failure(group: int | None, exc: Exception) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from gradsync import compat
    from gradsync.runner.cli import _describe_child_failure

    signum = compat.elastic_signal(exc)
    if signum is not None:
        return 128 + signum  # stopped: the run says so once, for every group
    if isinstance(exc, ChildFailedError):
        why = _describe_child_failure(exc)
        print(f"gradsync: error: replica group {group}: {why}", file=sys.stderr)
        return 1
    raise exc


if __name__ == "__main__":
    sys.exit(main())
