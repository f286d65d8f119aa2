"""Shell completions and the man page: ``make install-cli-docs`` generates them from the
argument parser under DESTDIR (``make uninstall`` removes them); bash completes the
parser's subcommands, options and paths with them; the man page renders and documents
every subcommand."""

from __future__ import annotations

import argparse
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.daemon import completion
from qosfs.daemon.cli import build_parser
from tests.systemd_units import ROOT

BASH = Path("share/bash-completion/completions/qosfs")
ZSH = Path("share/zsh/site-functions/_qosfs")
MAN = Path("share/man/man1/qosfs.1")


def _make(*args: str) -> str:
    done = subprocess.run(["make", "-s", "-C", str(ROOT), *args,
                           f"CLIDOCS_PY={sys.executable}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("qosfs",)
              ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command of the parser with its own parser, the top level first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [path[-1] for path, _ in _commands(parser) if len(path) == 2]


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What make install-cli-docs puts under DESTDIR, at the default PREFIX."""
    dest = tmp_path_factory.mktemp("dest")
    _make("install-cli-docs", f"DESTDIR={dest}")
    return dest / "usr/local"


def test_make_install_cli_docs_stages_them_under_destdir_and_uninstall_removes_them(
        tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    _make("install-cli-docs", f"DESTDIR={dest}", "PREFIX=/opt/qosfs")
    files = [dest / "opt/qosfs" / path for path in (BASH, ZSH, MAN)]
    for path in files:
        assert path.stat().st_size > 0 and stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert not (dest / "usr").exists()  # PREFIX, not the default
    _make("uninstall", f"DESTDIR={dest}", "PREFIX=/opt/qosfs")
    assert not any(path.exists() for path in files)


def test_make_install_generates_them() -> None:
    dry = _make("-n", "install", "DESTDIR=/nonexistent")
    assert "shtab" in dry and "argparse_manpage" in dry, dry


def test_bash_completes_subcommands_options_and_paths(staged: Path, tmp_path: Path) -> None:
    (tmp_path / "policy.toml").write_text("")
    (tmp_path / "policy.d").mkdir()
    script = f"""
source {staged / BASH}
complete -p qosfs
complete_() {{
    COMP_WORDS=("$@"); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))
    COMP_LINE="$*"; COMP_POINT=${{#COMP_LINE}}; COMPREPLY=()
    _shtab_qosfs qosfs "${{COMP_WORDS[-1]}}" "${{COMP_WORDS[-2]}}"
    echo "$*|${{COMPREPLY[*]}}"
}}
complete_ qosfs ""
complete_ qosfs ctl ""
complete_ qosfs top --
complete_ qosfs mount --io-mode ""
complete_ qosfs check {tmp_path}/pol
complete_ qosfs mount {tmp_path}/pol
"""
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", script],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "complete -o bashdefault -F _shtab_qosfs qosfs", lines
    answers = dict(line.split("|", 1) for line in lines[1:])
    parser = build_parser()
    assert answers["qosfs "].split() == _subcommands(parser)
    ctl = dict(_commands(parser))[("qosfs", "ctl")]
    assert answers["qosfs ctl "].split() == _subcommands(ctl)
    top = dict(_commands(parser))[("qosfs", "top")]
    options = {o for a in top._actions for o in a.option_strings if o.startswith("--")}
    assert set(answers["qosfs top --"].split()) == options
    assert answers["qosfs mount --io-mode "].split() == ["auto", "inline", "nowait", "threads"]
    # A policy file completes as a file, a mount's source only as a directory.
    assert sorted(answers[f"qosfs check {tmp_path}/pol"].split()) == [
        f"{tmp_path}/policy.d", f"{tmp_path}/policy.toml"]
    assert answers[f"qosfs mount {tmp_path}/pol"].split() == [f"{tmp_path}/policy.d"]


def test_zsh_completion_names_every_subcommand(staged: Path) -> None:
    text = (staged / ZSH).read_text()
    assert text.startswith("#compdef qosfs")
    for path, _ in list(_commands(build_parser()))[1:]:
        assert re.search(rf"^\s+{path[-1]}:'", text, re.MULTILINE), path
    # Paths complete as files, a mount's source and mountpoint as directories.
    assert ":PATH:_files" in text and ":_files -/" in text
    if shutil.which("zsh"):  # not installed everywhere: then the text is all we check
        done = subprocess.run(["zsh", "-n", str(staged / ZSH)], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr


def test_the_man_page_renders_and_documents_every_subcommand(staged: Path) -> None:
    if shutil.which("groff") is None:
        pytest.skip("groff missing (groff-base)")
    done = subprocess.run(["groff", "-man", "-Tutf8", "-ww", str(staged / MAN)],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"})
    assert done.returncode == 0 and not done.stderr, done.stderr
    page = done.stdout.replace("\u2010", "-")  # groff's hyphen where a line breaks
    page = subprocess.run(["col", "-b"], input=page, capture_output=True, text=True,
                          timeout=30).stdout  # no overstrike bold
    parser = build_parser()
    assert f"qosfs - {parser.description}" in " ".join(page.split())
    for path, sub in _commands(parser):
        if len(path) > 1:
            assert f"COMMAND '{' '.join(path)}'" in page, path
        for action in sub._actions:  # every option but -h/--help, which every one has
            for option in [] if isinstance(action, argparse._HelpAction) else (
                    action.option_strings):
                assert option in page, (path, option)


def test_path_arguments_are_marked_for_completion_and_nothing_else() -> None:
    commands = dict(_commands(build_parser()))

    def hint(path: tuple[str, ...], dest: str) -> object:
        [action] = [a for a in commands[path]._actions if a.dest == dest]
        return getattr(action, "complete", None)

    assert hint(("qosfs", "mount"), "source") == completion.DIRECTORIES
    assert hint(("qosfs", "mount"), "mountpoint") == completion.DIRECTORIES
    assert hint(("qosfs", "mount"), "policy") == completion.FILES
    assert hint(("qosfs", "check"), "file") == completion.FILES
    assert hint(("qosfs", "top"), "socket") == completion.FILES
    assert hint(("qosfs", "plan"), "policy_out") == completion.FILES
    assert hint(("qosfs", "top"), "interval") is None
    assert hint(("qosfs", "plan"), "params") is None
