"""The docs cannot drift from the code: every command, policy and link they show is
checked here against the real parser, policy loader, Makefile and tree.

Covered: README.md, docs/*.md and bench/*.md. A fenced ``toml`` block that looks like a
policy must load (fragments are completed with ``[classes.default]``); one preceded by
``<!-- doc-check: invalid -->`` must be rejected. Every ``qosfs ...`` line of a shell
block must parse with ``qosfs``'s own argument parser (``ctl set`` settings must also be
accepted by the policy), every ``make TARGET`` must be a Makefile target, every
``python -m bench SUITE`` a suite, and every relative link must point at a file.
"""

from __future__ import annotations

import contextlib
import grp
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.control.protocol import parse_assignments, parse_target
from qosfs.daemon.cli import _build_parser
from qosfs.policy.loading import PolicyError, parse_policy, with_changes
from tests.mounting import ROOT

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")])
SHELL = {"", "sh", "bash", "console", "shell"}
INVALID_MARK = "<!-- doc-check: invalid -->"


def _blocks(path: Path) -> Iterator[tuple[str, int, str, bool]]:
    """(language, first line number, text, marked invalid) of each fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        marked = i > 0 and lines[i - 1].strip() == INVALID_MARK
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        yield fence[2], start + 1, "\n".join(body), marked
        i += 1


def _commands(text: str, first: int) -> Iterator[tuple[int, list[str]]]:
    """Shell commands of a block, continuation lines joined, prompts and sudo dropped."""
    pending, at = "", first
    for n, raw in enumerate(text.splitlines(), first):
        line = raw.strip()
        if not pending:
            at = n
            line = line.removeprefix("$ ").removeprefix("# ") if line.startswith("$ ") \
                else line
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command, pending = pending + line, ""
        # Usage-style optional parts ("[--json]", "[--interval 1]") are shown as options.
        command = re.sub(r"\[(--?[^\]]*)\]", r"\1", command)
        try:
            words = shlex.split(command, comments=True)
        except ValueError:
            continue  # not shell (output shown in a block)
        while words and words[0] in ("sudo", "env"):
            words = words[1:]
        for part in _split_pipeline(words):
            if part:
                yield at, part


def _split_pipeline(words: list[str]) -> Iterator[list[str]]:
    """Each command of a pipeline or list, without its redirections."""
    part: list[str] = []
    redirected = False
    for word in words:
        if word in ("|", "&&", "||", ";"):
            yield part
            part, redirected = [], False
        elif word in (">", ">>", "<", "2>", "2>&1") or redirected:
            redirected = word in (">", ">>", "<", "2>")  # the next word is the file
        else:
            part.append(word)
    yield part


def _shell_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for lang, first, text, _ in _blocks(path):
            if lang in SHELL:
                for n, words in _commands(text, first):
                    found.append((f"{path.relative_to(ROOT)}:{n}", words))
    return found


COMMANDS = _shell_commands()


@pytest.mark.parametrize("where,words", [c for c in COMMANDS if c[1][0] == "qosfs"],
                         ids=[c[0] for c in COMMANDS if c[1][0] == "qosfs"])
def test_every_qosfs_command_shown_parses(where: str, words: list[str]) -> None:
    parser = _build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(words[1:])
    except SystemExit as exc:
        if exc.code == 0:  # --help, --version
            return
        pytest.fail(f"{where}: {shlex.join(words)}: {err.getvalue().strip()}")
    if args.command == "ctl" and args.ctl_command == "set":
        kind, name = parse_target(args.target)
        changes = parse_assignments(args.settings)
        text = {"class": f"[classes.{name}]\n[classes.default]\n" if name != "default"
                else "[classes.default]\n",
                "tenant": f"[tenants.{name}]\nuids = [12345]\n[classes.default]\n",
                "backend": "[backend]\nread_bandwidth = \"1GiB/s\"\n[classes.default]\n"}[kind]
        try:
            with_changes(parse_policy(text), kind, name, changes)
        except PolicyError as exc:
            pytest.fail(f"{where}: {shlex.join(words)}: {exc}")


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for line in text.splitlines()
            if (found := re.match(r"^([A-Za-z][\w.-]*(?:\s+[\w.-]+)*)\s*:(?!=)", line))
            for m in found[1].split()}


def test_every_make_target_shown_exists() -> None:
    targets = _makefile_targets()
    assert {"demo", "test", "bench", "install"} <= targets
    shown = [(where, words[1]) for where, words in COMMANDS
             if words[0] == "make" and len(words) > 1 and "=" not in words[1]]
    assert shown
    missing = [(where, target) for where, target in shown if target not in targets]
    assert not missing, missing


def test_every_bench_suite_shown_exists() -> None:
    from bench.__main__ import build_parser

    suites = set(build_parser()[1])
    shown = [(where, words[3]) for where, words in COMMANDS
             if words[:3] == ["python", "-m", "bench"] and len(words) > 3]
    shown += [(where, m) for path in DOCS for where, m in _inline_bench(path)]
    assert shown
    missing = [(where, suite) for where, suite in shown if suite not in suites]
    assert not missing, missing


def _inline_bench(path: Path) -> Iterator[tuple[str, str]]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for m in re.finditer(r"`python -m bench ([\w-]+)", line):
            yield f"{path.relative_to(ROOT)}:{n}", m[1]


def _policies() -> list[tuple[str, str, bool]]:
    out = []
    for path in DOCS:
        for lang, first, text, marked in _blocks(path):
            if lang == "toml":
                out.append((f"{path.relative_to(ROOT)}:{first}", text, marked))
    return out


POLICIES = _policies()


@pytest.mark.parametrize("where,text,marked", POLICIES, ids=[p[0] for p in POLICIES])
def test_every_policy_shown_loads(where: str, text: str, marked: bool) -> None:
    complete = text if "[classes.default]" in text else text + "\n[classes.default]\n"
    # A group named in an example ("storage-admins") need not exist on this machine: the
    # loader resolves names, so check the rest with root's group in its place.
    for name in re.findall(r'admin_group = "([^"]+)"', complete):
        with contextlib.suppress(KeyError):
            grp.getgrnam(name)
            continue
        complete = complete.replace(f'admin_group = "{name}"', 'admin_group = "root"')
    try:
        parse_policy(complete, where)
    except PolicyError as exc:
        if not marked:
            pytest.fail(f"{where}: {exc}")
        return
    assert not marked, f"{where} is marked invalid but loads"


def test_there_are_policies_and_commands_to_check() -> None:
    assert len(POLICIES) >= 6
    assert sum(1 for _, words in COMMANDS if words[0] == "qosfs") >= 20


def _links(path: Path) -> Iterator[tuple[int, str]]:
    fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            fence = not fence
        if fence:
            continue
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            yield n, m[1]


def test_every_relative_link_points_at_a_file() -> None:
    broken = []
    for path in DOCS:
        for n, target in _links(path):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not broken, broken


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, len(lines)
    assert lines[2] == "```sh" and lines[3].startswith("make demo") \
        and lines[4].startswith("make test")
    contents = (ROOT / "docs" / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in contents, f"{doc.name} missing from docs/README.md"
