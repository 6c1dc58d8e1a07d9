"""The simulator is pure Python and numpy: it imports and runs where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

# sys.modules["torch"] = None makes every "import torch" raise ImportError in that process.
SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None
    import gradsync
    import gradsync.sim
    from gradsync.sim import CommModel, ComputeModel, simulate
    from gradsync.sim.__main__ import main

    model = ComputeModel(workers=3, steps=5, base_ms=(20.0, 22.0, 30.0), jitter_ms=1.0)
    res = simulate("ssp:1", model.draw(), CommModel(comm_ms=2.0))
    assert res.wall_ms > 0, res.wall_ms
    assert main(["simulate", "--compute", "20", "--steps", "5", "--json"]) == 0
    assert gradsync.UsageError.__name__ == "UsageError"
    try:
        gradsync.Synchronizer
    except ImportError:
        pass
    else:
        raise AssertionError("gradsync.Synchronizer imported without torch")
    assert sys.modules["torch"] is None
    print("no-torch ok")
    """
)


@pytest.mark.timeout(60)
def test_simulator_runs_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "no-torch ok" in out.stdout
    assert '"wall_ms": 100.0' in out.stdout  # 5 supersteps of 20 ms, no comm
