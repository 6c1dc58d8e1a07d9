"""``gradsync.processes.worker_deaths`` in a fresh interpreter, where torch's agent modules give
their
loggers a level at import: the agent's own warnings are silenced, a death is not. The record
read and the line written: tests/unit/test_worker_deaths.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.worker_deaths import TORCH_FORMAT

pytestmark = pytest.mark.e2e


def test_the_agents_own_warnings_are_silenced_but_deaths_are_not() -> None:
    # In a fresh interpreter: torch's agent modules give their loggers a level at import.
    code = (
        "import logging\n"
        "from gradsync import compat\n"
        "from gradsync.processes.worker_deaths import quiet_elastic_logs\n"
        "quiet_elastic_logs()\n"
        "import torch.distributed.elastic.agent.server.api as agent\n"
        "agent.logger.warning('Received %s death signal, shutting down workers', 2)\n"
        "logging.getLogger('torch.distributed.launcher.api').warning('launcher says')\n"
        f"logging.getLogger(compat.ELASTIC_WORKER_LOGGER).error({TORCH_FORMAT!r}, -9, 1, 7, "
        "'_recorded', 'spawn')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "gradsync: worker process 1 of this machine (pid 7) was killed by SIGKILL\n"
    ), done.stderr
