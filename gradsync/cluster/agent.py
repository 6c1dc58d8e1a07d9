"""``python -m gradsync.cluster.agent ARGS``: torch's launcher (``torch.distributed.run``, the
program behind ``torchrun``) with ARGS unchanged, plus two things only a process of our own can
add, as ``gradsync run`` has them locally (``gradsync.processes.launch``):

- gradsync's rendezvous backend (``--rdzv-backend gradsync-c10d``, ``gradsync.processes.stores``):
torch's
  c10d rendezvous, whose stores listen on the host's address instead of every interface of the
  host's namespace;
- the reaper of stopped workers (``gradsync.processes.reaper``), so a stopped worker does not hold
the
  agent's exit for 30 seconds.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    from gradsync.processes.reaper import StoppedWorkerReaper
    from gradsync.processes.stores import register_rendezvous

    register_rendezvous()
    with StoppedWorkerReaper():
        torchrun(list(argv) if argv is not None else None)


if __name__ == "__main__":
    main()
