"""``gradsync simulate`` and ``gradsync bench`` through their argparse handlers, in the test
process, for tests/*/test_sim_cli*.py."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from gradsync.sim.cli import add_parsers


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="gradsync")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    return json.loads(run_cli([*argv, "--json"], capsys))
