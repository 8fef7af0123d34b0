"""The ``asyncgrpo`` command's dispatch: each subcommand's parser names its handler
(``set_defaults(func=...)``), ``main`` calls it, and only ``train`` takes flags its own parser
does not know (they are AsyncGRPOConfig fields, parsed by ``run_train``)."""

from __future__ import annotations

import argparse

import pytest

from asyncgrpo.shell.commands.cli import build_parser, main

SUBCOMMANDS = ("compare", "demo", "eval", "model", "plan", "plot", "simulate", "sweep", "train")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_every_subcommand_sets_its_handler() -> None:
    parsers = subparsers(build_parser())
    assert sorted(parsers) == sorted(SUBCOMMANDS)
    for name, parser in parsers.items():
        assert callable(parser.get_default("func")), f"asyncgrpo {name} sets no handler"
    forwarding = [name for name, p in parsers.items() if p.get_default("forwards_unknown_flags")]
    assert forwarding == ["train"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_each_subcommand_help_exits_0(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage: asyncgrpo" in capsys.readouterr().out


def test_unknown_flags_of_other_subcommands_fail_with_argparse_status(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plot", "run-dir", "--max_steps", "3"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --max_steps 3" in capsys.readouterr().err


def test_a_handler_error_is_named_with_exit_status_2(tmp_path, capsys) -> None:
    assert main(["model", "not-a-model"]) == 2
    assert "asyncgrpo model: 'not-a-model' is neither a packaged model" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("asyncgrpo plot: ")
