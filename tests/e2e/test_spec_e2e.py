"""gradsync.spec in a fresh interpreter where torch cannot be imported: it imports and parses.
The parser itself: tests/unit/test_spec.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e


NO_TORCH = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # every "import torch" now raises ImportError
    from gradsync.spec import parse_compression_spec, parse_strategy_spec
    assert str(parse_strategy_spec("ssp:inf")) == "ssp:inf"
    assert str(parse_compression_spec("topk:0.5")) == "topk:0.5"
    try:
        parse_strategy_spec("gossip")
    except ValueError as exc:
        assert "valid: bsp" in str(exc), exc
    assert sys.modules["torch"] is None
    assert not [m for m in sys.modules if m.startswith("torch.")]
    print("spec without torch ok")
    """
)


@pytest.mark.timeout(60)
def test_the_spec_module_imports_and_parses_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=50, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "spec without torch ok" in out.stdout
