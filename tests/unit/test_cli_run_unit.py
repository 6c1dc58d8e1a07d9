"""`gradsync run`'s flags: every default stated in its help, and every flag in the README's
reference. The command run end to end: tests/e2e/test_cli_run.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def _run_parser() -> argparse.ArgumentParser:
    from gradsync.runner.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def test_run_help_states_every_default_and_the_slow_grammar() -> None:
    run = _run_parser()
    flags = [a for a in run._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 20
    for action in flags:
        shown = (action.help or "") % {"default": action.default}
        assert "default" in shown, f"{action.option_strings[0]}: no default in its help"
    text = run.format_help()
    # The grammar the parser accepts (a start step and an optional exclusive end).
    assert "--slow RANK:FACTOR[@START[-END]]" in text
    assert "(default: 16)" in text  # --batch-size
    assert "(default: an eighth of the gradient, from 1 to 25 MB;" in " ".join(text.split())


def test_readme_run_reference_lists_every_run_flag() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    reference = readme.split("## `gradsync run` reference", 1)[1].split("\n## ", 1)[0]
    missing = [
        a.option_strings[-1]
        for a in _run_parser()._actions
        if a.option_strings and a.dest != "help" and f"`{a.option_strings[-1]}" not in reference
    ]
    assert not missing, f"README's gradsync run reference lacks {missing}"
