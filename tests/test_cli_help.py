"""Every command's ``--help`` is plain text for a terminal: no reStructuredText markup
from docstrings (````name````, ``:func:``), and every option of the demo says what it is."""

from __future__ import annotations

import re

import pytest

from otel_training.cli import _COMMANDS, main

MARKUP = re.compile(r"``|:(?:func|class|mod|meth|envvar|ref):`")


def _help(capsys, command: str) -> str:
    try:
        code = main([command, "--help"])
    except SystemExit as exited:
        code = exited.code
    assert code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(set(_COMMANDS) - {"config"}))
def test_help_is_plain_text(capsys, command):
    text = _help(capsys, command)
    assert text.startswith(f"usage: otel-training {command}"), text
    assert not MARKUP.search(text), text


def test_every_demo_option_says_what_it_is(capsys):
    from otel_training.cli.demo import _parser

    assert [a.dest for a in _parser()._actions if not a.help] == []
    assert "slow data pipeline" in _help(capsys, "demo")
