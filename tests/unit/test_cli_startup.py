"""The ``gradsync`` parser built lazily: the top-level help lists every command from
``cli.COMMANDS`` without importing their modules, so that table must say what each module's own
parser says; a command named on the command line is built in full, and only it."""

from __future__ import annotations

import argparse
import importlib.metadata

import pytest

from gradsync.runner import cli

pytestmark = pytest.mark.unit


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_every_command_is_listed_with_its_modules_own_help_line() -> None:
    """A command whose module changes its help line (or adds a command) fails here, not in a
    help that quietly disagrees with the command's own."""
    full = _subparsers(cli.build_parser())
    listed = {a.dest: a.help for a in full._choices_actions}
    assert listed == {name: help_line for name, (help_line, _) in cli.COMMANDS.items()}


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_a_named_command_is_built_in_full_and_the_others_are_stubs(name: str) -> None:
    sub = _subparsers(cli.build_parser(full={name}))
    assert list(sub.choices) == list(cli.COMMANDS)  # every command still a valid choice
    whole = _subparsers(cli.build_parser()).choices[name]
    assert sub.choices[name].format_help() == whole.format_help()
    for other, stub in sub.choices.items():
        if other != name:
            assert [a.dest for a in stub._actions] == ["help"], other


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        ([], None),
        (["--help"], None),
        (["--version"], None),
        (["report", "--json", "runs/x"], "report"),
        (["-h", "simulate"], "simulate"),
        (["bench", "allreduce"], "bench"),
    ],
)
def test_the_command_is_the_first_word_that_is_not_an_option(
    argv: list[str], command: str | None
) -> None:
    assert cli._command_of(argv) == command


def test_version_is_the_installed_distributions_else_the_packages(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gradsync

    assert cli.version() == importlib.metadata.version("gradsync")

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setattr(gradsync, "__version__", "9.8.7", raising=False)
    assert cli.version() == "9.8.7"
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == "gradsync 9.8.7\n"


def test_compare_help_offers_no_flag_compare_refuses() -> None:
    """--strategy is run's; compare refuses it (naming --strategies), so its help hides it."""
    compare = _subparsers(cli.build_parser(full={"compare"})).choices["compare"]
    text = compare.format_help()
    assert "--strategies" in text and "--strategy " not in text and "--strategy\n" not in text
    with pytest.raises(cli.UsageError, match="--strategies"):
        cli.cmd_compare(compare.parse_args(["--strategy", "ssp:2"]))
