"""``gradsync bench allreduce`` through its argparse handler: it starts two ranks and times real
all-reduces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.sim_cli import run_json

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(60)
def test_bench_allreduce_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cal.json"
    doc = run_json(
        [
            "bench",
            "allreduce",
            "--nproc",
            "2",
            "--sizes",
            "4K,256K",
            "--repeats",
            "5",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert [m["bytes"] for m in doc["measurements"]] == [4096, 262144]
    for m in doc["measurements"]:
        assert m["time_s"] > 0
        assert m["busbw"] == pytest.approx(m["algbw"])  # 2(n-1)/n = 1 for two ranks
    saved = json.loads(out.read_text())
    assert saved["kind"] == "gradsync.allreduce_calibration" and saved["nproc"] == 2
    assert {"alpha_s", "beta_s_per_byte"} <= set(saved)
