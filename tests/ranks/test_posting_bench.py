"""``benchmarks.posting`` in its quick mode, so that it cannot rot unseen: both settings timed,
both variants, a ratio each (the full run: BENCHMARKS.md, "Exchanges posted once the gate
opens")."""

from __future__ import annotations

import pytest

from benchmarks import posting

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_the_quick_run_times_both_variants_in_both_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert posting.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "ms/step" not in r]
    assert [r.split(" | ")[0] for r in rows] == [f"| {s}" for s in posting.SETTINGS]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        at_step, once_open, ratio = (float(c) for c in cells[1:4])
        assert at_step > 0 and once_open > 0
        assert ratio == pytest.approx(once_open / at_step, rel=0.05)
    assert "Command: `python -m benchmarks.posting --quick`" in out
