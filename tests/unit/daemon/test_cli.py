"""The command line: under a closed pipe (`qosfs plan ... | head` must not print an
internal error: a reader that went away is not a bug of ours), every subcommand's
--help, and usage errors of `ctl set`."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qosfs.core.errors import EXIT_USAGE
from qosfs.daemon.cli import _build_parser, _command_named, main
from tests.mounting import ROOT


@pytest.mark.parametrize("args", [
    ["policy", "default"],
    ["plan", "--params", "70B", "--nodes", "8", "--ranks", "64", "--backend-write", "20GB/s"],
])
def test_a_closed_pipe_ends_the_command_quietly_as_sigpipe_would(args: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        out = subprocess.run([sys.executable, "-m", "qosfs", *args], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60)
    finally:
        os.close(write_end)
    assert out.stderr == ""
    assert out.returncode == 128 + signal.SIGPIPE


def _subcommands(parser: argparse.ArgumentParser,
                 path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every subcommand of the parser, as the words that name it (``("ctl", "set")``)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(*path, name), *_subcommands(sub, (*path, name))]
    return found


SUBCOMMANDS = _subcommands(_build_parser())


def test_the_parser_has_the_documented_subcommands() -> None:
    assert {("mount",), ("check",), ("plan",), ("ctl",), ("ctl", "set"), ("ctl", "reload"),
            ("ctl", "status"), ("ctl", "stats"), ("top",), ("policy",)} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=[" ".join(w) for w in SUBCOMMANDS])
def test_every_subcommands_help_has_a_description(
        words: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*words, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    # usage, a blank line, then the description: a sentence before the argument lists.
    blocks = out.split("\n\n")
    assert blocks[0].startswith(f"usage: qosfs {' '.join(words)}"), out
    description = " ".join(blocks[1].split())
    assert not description.startswith(("positional arguments:", "options:")), out
    assert len(description.split()) >= 4, out


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=[" ".join(w) for w in SUBCOMMANDS])
def test_the_parser_main_builds_for_a_command_is_the_whole_parsers(
        words: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    """main builds only the subcommand it runs (a command imports nothing for the others,
    issue 38); its help and its parse are those of the whole parser."""
    assert _command_named(["--debug", *words, "--help"]) == words[0]
    lean = _build_parser(only=words[0])
    assert list(_subcommands(lean)) == [w for w in SUBCOMMANDS if w[0] == words[0]]
    helps = []
    for parser in (lean, _build_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args([*words, "--help"])
        helps.append(capsys.readouterr().out)
    assert helps[0] == helps[1]


def test_main_builds_every_subcommand_for_help_and_for_mistakes() -> None:
    assert _command_named([]) is None
    assert _command_named(["--help"]) is None
    assert _command_named(["--version"]) is None
    assert _command_named(["mnt", "--help"]) is None  # "invalid choice" lists them all
    assert _command_named(["--", "ctl"]) is None
    assert _command_named(["--debug", "ctl", "--socket", "x", "status"]) == "ctl"
    args = ["--debug", "ctl", "--socket", "s", "set", "ckpt", "write_bandwidth=1MiB/s"]
    lean, full = _build_parser(only="ctl").parse_args(args), _build_parser().parse_args(args)
    assert vars(lean) == vars(full)


@pytest.mark.parametrize(("settings", "message"), [
    (["write_bandwidth"], "qosfs: ctl set: bad setting 'write_bandwidth' (expected "
                          "KEY=VALUE, e.g. write_bandwidth=400MiB/s)"),
    (["=1MiB/s"], "qosfs: ctl set: bad setting '=1MiB/s' (expected KEY=VALUE"),
    (["write_bandwidth=1MiB/s", "write_bandwidth=2MiB/s"],
     "qosfs: ctl set: write_bandwidth is given twice"),
])
def test_a_malformed_setting_is_a_usage_error(
        settings: list[str], message: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    # Refused before any socket is looked for: the socket named does not exist.
    code = main(["ctl", "--socket", str(tmp_path / "none.sock"), "set", "ckpt", *settings])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_malformed_target_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    code = main(["ctl", "--socket", str(tmp_path / "none.sock"), "set", "zone:x",
                 "write_bandwidth=1MiB/s"])
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        "qosfs: ctl set: bad target 'zone:x' (expected NAME, class:NAME, tenant:NAME or "
        "backend)\n")
