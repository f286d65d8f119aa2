"""The docs cannot drift from the code: every command, policy and link they show is
checked here against the real parser, policy loader, Makefile and tree.

Covered: README.md, docs/*.md and bench/*.md. Every fenced block names its language.

- ``sh``/``bash``/``shell`` blocks are commands (a leading ``$ `` is dropped);
  ``console`` blocks are transcripts: only ``$ `` or ``# `` lines are commands, the rest
  is output. Comments, ``sudo``, ``env``, ``VAR=value`` and line continuations are
  handled. Every ``qosfs ...`` command must parse with qosfs's own argument parser, and
  the settings of ``qosfs ctl set`` must be accepted by a policy; every ``make TARGET``
  (also inline, in backquotes) must be a Makefile target; every ``python -m bench ...``
  (also inline) must parse with the bench runner's parser.
- Every ``toml`` block is a policy (the only TOML qosfs reads), so it must load with the
  loader ``qosfs check`` uses; a misspelt table must not make a block look like
  something else and be skipped. A fragment may rely on what the rest of a policy would
  give it (a ``[backend]`` for a guarantee, a ``[cluster]`` for ``scope = "cluster"``,
  the tenants a class names): :func:`complete_fragment` adds only what is missing.
  ``[classes.default]`` is never needed: the loader adds it. A block preceded by
  ``<!-- doc-check: invalid -->`` shows a mistake and must be *rejected*.
- Every relative link (inline, image or reference-style) must point at a file.

The checks are functions of a list of documents, so the self-tests at the end feed each
of them a broken document and see it fail.
"""

from __future__ import annotations

import contextlib
import grp
import io
import json
import re
import shlex
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.protocol import ProtocolError, parse_assignments, parse_target
from qosfs.daemon.cli import _build_parser
from qosfs.policy.loading import PolicyError, parse_policy, with_changes
from tests.mounting import ROOT

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")])
SHELL = {"sh", "bash", "shell"}
CONSOLE = {"console"}
INVALID_MARK = "<!-- doc-check: invalid -->"
FENCE = re.compile(r"^\s*```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text, whether marked invalid."""

    path: Path
    line: int  # of the block's first line of text
    lang: str
    text: str
    marked_invalid: bool

    def where(self, n: int | None = None) -> str:
        return f"{_rel(self.path)}:{self.line if n is None else n}"


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(ROOT))
    return str(path)


def blocks(paths: Iterable[Path]) -> Iterator[Block]:
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            marked = i > 0 and lines[i - 1].strip() == INVALID_MARK
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            yield Block(path, start + 1, fence[1], "\n".join(body), marked)
            i += 1


def commands(block: Block) -> Iterator[tuple[int, list[str]]]:
    """(line, words) of each simple command in a shell or console block."""
    transcript = block.lang in CONSOLE
    pending, at = "", block.line
    for n, raw in enumerate(block.text.splitlines(), block.line):
        line = raw.strip()
        if not pending:
            prompt = re.match(r"^[$#] ", line)
            if transcript and not prompt:
                continue  # output
            if prompt and (transcript or line.startswith("$ ")):
                line = line[2:]
            at = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command, pending = pending + line, ""
        # Usage-style optional parts ("[--json]", "[--interval 1]") are shown as options.
        command = re.sub(r"\[(--?[^\]]*)\]", r"\1", command)
        try:
            words = shlex.split(command, comments=True)
        except ValueError:
            words = [command]  # unbalanced quotes: reported by whoever checks it
        for part in _split_list(words):
            if command_words := _drop_prefixes(part):
                yield at, command_words


def _split_list(words: list[str]) -> Iterator[list[str]]:
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


def _drop_prefixes(words: list[str]) -> list[str]:
    """``sudo -u alice``, ``env``, ``VAR=value`` in front of the command itself."""
    while words:
        if words[0] in ("sudo", "env"):
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[2:] if words[0] in ("-u", "-g") else words[1:]
        elif re.match(r"^[A-Za-z_]\w*=", words[0]):
            words = words[1:]
        else:
            break
    return words


def shell_commands(paths: Iterable[Path]) -> list[tuple[str, list[str]]]:
    return [(b.where(n), words) for b in blocks(paths) if b.lang in SHELL | CONSOLE
            for n, words in commands(b)]


def _inline(paths: Iterable[Path], pattern: str) -> Iterator[tuple[str, list[str]]]:
    """Backquoted commands in the prose (outside fenced blocks) that match ``pattern``."""
    for path in paths:
        fenced = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FENCE.match(line) or (fenced and line.strip().startswith("```")):
                fenced = not fenced
                continue
            if not fenced:
                for m in re.finditer(r"`([^`]+)`", line):
                    if re.match(pattern, m[1]):
                        yield f"{_rel(path)}:{n}", shlex.split(m[1])


def _parse(parser: Any, where: str, words: list[str], skip: int) -> tuple[Any, str | None]:
    """(namespace, None), or (None, the problem) if the parser refuses ``words[skip:]``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(words[skip:]), None
    except SystemExit as exc:
        if exc.code == 0:  # --help, --version
            return None, None
        reason = err.getvalue().strip().splitlines()[-1:]  # argparse's error, not the usage
        return None, f"{where}: {shlex.join(words)}: {''.join(reason)}"


# A policy each `ctl set` target can be changed in: a backend (guarantees need one), the
# class or tenant named.
_SET_BASE = '[backend]\nread_bandwidth = "1000GiB/s"\nwrite_bandwidth = "1000GiB/s"\n'


def qosfs_problem(where: str, words: list[str]) -> str | None:
    """Why ``qosfs ARGS`` as shown at ``where`` would be refused, or None."""
    args, problem = _parse(_build_parser(), where, words, 1)
    if args is None or args.command != "ctl" or args.ctl_command != "set":
        return problem
    try:
        kind, name = parse_target(args.target)
        changes = parse_assignments(args.settings)
        text = _SET_BASE + {"class": f"[classes.{json.dumps(name)}]\n",
                            "tenant": f"[tenants.{json.dumps(name)}]\nuids = [12345]\n",
                            "backend": ""}[kind]
        with_changes(parse_policy(text if name != "default" else _SET_BASE), kind, name,
                     changes)
    except (ProtocolError, PolicyError) as exc:
        return f"{where}: {shlex.join(words)}: {exc}"
    return None


def complete_fragment(text: str) -> str:
    """``text`` plus what a policy around it would have to give it, and nothing else."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return text  # the loader reports it, with the line
    classes = [c for c in _table(raw, "classes").values() if isinstance(c, dict)]
    tenants = [t for t in _table(raw, "tenants").values() if isinstance(t, dict)]
    extra = []
    if "backend" not in raw and any(k.startswith("min_") for c in classes for k in c):
        extra.append(_SET_BASE)
    if "cluster" not in raw and any(t.get("scope") == "cluster" for t in classes + tenants):
        extra.append('[cluster]\nredis = "unix:///run/redis.sock"\n')
    named = {n for c in classes if isinstance(c.get("tenants"), list)
             for n in c["tenants"] if isinstance(n, str)} - set(_table(raw, "tenants"))
    for uid, name in enumerate(sorted(named), 60000):
        extra.append(f"[tenants.{json.dumps(name)}]\nuids = [{uid}]\n")
    # A group named in an example ("storage-admins") need not exist on this machine: the
    # loader resolves names, so check the rest with root's group in its place.
    for name in re.findall(r'admin_group = "([^"]+)"', text):
        try:
            grp.getgrnam(name)
        except KeyError:
            text = text.replace(f'admin_group = "{name}"', 'admin_group = "root"')
    return "\n".join([text, *extra])


def _table(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    return value if isinstance(value, dict) else {}


def policy_problem(block: Block) -> str | None:
    """Why a policy block does not do what the doc says (load, or be rejected), or None."""
    try:
        parse_policy(complete_fragment(block.text), block.where())
    except PolicyError as exc:
        if block.marked_invalid:
            return None
        # The loader counts lines from the block's first; say the doc's line instead.
        line = block.line if exc.line is None else block.line + exc.line - 1
        return f"{block.where(line)}: " + (exc.reason if exc.key is None
                                           else f"{exc.key}: {exc.reason}")
    return f"{block.where()} is marked invalid but loads" if block.marked_invalid else None


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for line in text.splitlines()
            if (found := re.match(r"^([A-Za-z][\w.-]*(?:\s+[\w.-]+)*)\s*:(?!=)", line))
            for m in found[1].split()}


def make_problems(paths: list[Path]) -> tuple[int, list[str]]:
    """(how many ``make TARGET`` are shown, those whose target does not exist)."""
    targets = _makefile_targets()
    shown = [(where, words) for where, words in [*shell_commands(paths),
                                                 *_inline(paths, r"make\b")]
             if words[0] == "make"]
    named = [(where, w) for where, words in shown for w in words[1:]
             if not w.startswith("-") and "=" not in w]
    return len(named), [f"{where}: make {t}" for where, t in named if t not in targets]


def bench_problems(paths: list[Path]) -> tuple[int, list[str]]:
    """(how many ``python -m bench ...`` are shown, those its parser refuses)."""
    from bench.__main__ import build_parser

    shown = [(where, words) for where, words in [*shell_commands(paths),
                                                 *_inline(paths, r"python3? -m bench\b")]
             if re.search(r"python3?$", words[0]) and words[1:3] == ["-m", "bench"]]
    problems = [_parse(build_parser()[0], where, words, 3)[1] for where, words in shown]
    return len(shown), [p for p in problems if p]


def _links(path: Path) -> Iterator[tuple[int, str]]:
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        prose = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
            yield n, m[1]
        if ref := re.match(r"^\s*\[[^\]]+\]:\s*(\S+)", prose):
            yield n, ref[1]


def link_problems(paths: list[Path]) -> list[str]:
    broken = []
    for path in paths:
        for n, target in _links(path):
            if re.match(r"^([a-z][a-z0-9+.-]*:|#)", target):
                continue  # a URL or a section of the same page
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{_rel(path)}:{n}: {target}")
    return broken


def unlabelled_fences(paths: list[Path]) -> list[str]:
    """A block without a language would escape every check above."""
    return [b.where(b.line - 1) for b in blocks(paths) if not b.lang]


# ---- the documents as they are ---------------------------------------------------------

COMMANDS = [c for c in shell_commands(DOCS) if c[1][0] == "qosfs"]
POLICIES = [b for b in blocks(DOCS) if b.lang == "toml"]


@pytest.mark.parametrize("where,words", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_qosfs_command_shown_parses(where: str, words: list[str]) -> None:
    problem = qosfs_problem(where, words)
    assert problem is None, problem


@pytest.mark.parametrize("block", POLICIES, ids=[b.where() for b in POLICIES])
def test_every_policy_shown_loads_or_is_rejected_as_marked(block: Block) -> None:
    problem = policy_problem(block)
    assert problem is None, problem


def test_there_are_policies_and_commands_to_check() -> None:
    assert len(POLICIES) >= 6
    assert len(COMMANDS) >= 20


def test_every_make_target_shown_exists() -> None:
    assert {"demo", "test", "bench", "install"} <= _makefile_targets()
    shown, problems = make_problems(DOCS)
    assert shown >= 5 and not problems, problems


def test_every_bench_command_shown_parses() -> None:
    shown, problems = bench_problems(DOCS)
    assert shown >= 3 and not problems, problems


def test_every_relative_link_points_at_a_file() -> None:
    broken = link_problems(DOCS)
    assert not broken, broken


def test_every_fenced_block_names_its_language() -> None:
    unlabelled = unlabelled_fences(DOCS)
    assert not unlabelled, unlabelled


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, len(lines)
    assert lines[2] == "```sh" and lines[3].startswith("make demo ") \
        and lines[4].startswith("make test ")


def test_the_contents_page_lists_every_document() -> None:
    contents = (ROOT / "docs" / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in contents, f"{doc.name} missing from docs/README.md"


# Keys build.py checks inline rather than through a tuple of qosfs.policy.model.
_OTHER_POLICY_KEYS = ("backend", "control", "metrics", "cluster", "tenants", "classes",
                      "admin_group", "user_series", "user_series_idle")


def test_every_policy_key_is_in_the_policy_reference() -> None:
    from qosfs.policy import model

    keys = {*model.CLASS_KEYS, *model.TENANT_KEYS, *model.CLUSTER_KEYS, *model.LIMIT_KEYS,
            *_OTHER_POLICY_KEYS}
    reference = (ROOT / "docs" / "policy.md").read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in reference and f"[{k}" not in reference)
    assert not missing, f"docs/policy.md does not name {missing}"


def test_every_ctl_command_and_metric_family_is_in_the_reference() -> None:
    import argparse

    reference = (ROOT / "docs" / "control-and-metrics.md").read_text()
    cluster = (ROOT / "docs" / "cluster.md").read_text()
    subcommands = [a for a in _build_parser()._actions
                   if isinstance(a, argparse._SubParsersAction)]
    ctl = subcommands[0].choices["ctl"]
    commands = [name for a in ctl._actions if isinstance(a, argparse._SubParsersAction)
                for name in a.choices]
    assert {"status", "set", "reload", "stats"} <= set(commands)
    missing = [f"ctl {c}" for c in commands if f"ctl {c}" not in reference]
    # Every family the exporter yields is named as a literal there (counters without
    # _total, which prometheus_client adds); the cluster's are documented with the cluster.
    source = (ROOT / "qosfs" / "control" / "metrics.py").read_text()
    families = set(re.findall(r'"(qosfs_[a-z_]+)"', source))
    assert len(families) >= 30
    missing += sorted(f for f in families
                      if f not in (cluster if f.startswith("qosfs_cluster_") else reference))
    assert not missing, f"not in the reference: {missing}"


# ---- each check fails on a broken document ---------------------------------------------

def _doc(tmp_path: Path, text: str) -> list[Path]:
    path = tmp_path / "broken.md"
    path.write_text(text)
    return [path]


@pytest.mark.parametrize("shown", [
    "```sh\nqosfs mount /a /b --no-such-option\n```",
    "```sh\nsudo qosfs ctl set checkpoints write_bandwith=1GiB/s  # misspelt key\n```",
    "```sh\nqosfs ctl set checkpoints write_bandwidth=fast\n```",
    "```sh\nqosfs ctl set nosuchkind:x write_bandwidth=1GiB/s\n```",
    "```sh\nQOSFS_X=1 qosfs \\\n    ctl sat\n```",
    "```console\n$ qosfs chek policy.toml\nqosfs: output, not checked\n```",
])
def test_a_wrong_qosfs_command_is_caught(tmp_path: Path, shown: str) -> None:
    found = [c for c in shell_commands(_doc(tmp_path, shown)) if c[1][0] == "qosfs"]
    assert len(found) == 1
    problem = qosfs_problem(*found[0])
    assert problem is not None and problem.startswith(f"{tmp_path}/broken.md:2: qosfs ")


def test_console_output_is_not_taken_for_commands(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "```console\n$ qosfs plan --params 7B\nqosfs plan: 7B\n# qosfs top\n```")
    assert [w for _, w in shell_commands(doc)] == [
        ["qosfs", "plan", "--params", "7B"], ["qosfs", "top"]]


@pytest.mark.parametrize("policy,marked", [
    ('[classes.a]\npaths = ["x/**"]\nwrite_bandwidth = "fast"\n', False),
    ('[clases.a]\npaths = ["x/**"]\n', False),  # a misspelt table is not skipped
    ('[classes.a]\npaths = ["x/**"]\nwrite_bandwidth = "1GiB/s"\n', True),
])
def test_a_wrong_policy_is_caught(tmp_path: Path, policy: str, marked: bool) -> None:
    mark = INVALID_MARK + "\n" if marked else ""
    [block] = blocks(_doc(tmp_path, f"text\n{mark}```toml\n{policy}```\n"))
    assert block.marked_invalid == marked
    problem = policy_problem(block)
    assert problem is not None
    if not marked:
        assert problem.startswith(f"{tmp_path}/broken.md:{5 if 'fast' in policy else 3}: ")


def test_a_fragment_gets_only_what_a_policy_around_it_would_give(tmp_path: Path) -> None:
    fragment = ('[classes.a]\npaths = ["x/**"]\ntenants = ["t"]\nscope = "cluster"\n'
                'min_read_bandwidth = "1GiB/s"\nwrite_bandwidth = "1GiB/s"\n')
    [block] = blocks(_doc(tmp_path, f"```toml\n{fragment}```\n"))
    assert policy_problem(block) is None
    with pytest.raises(PolicyError):
        parse_policy(fragment)  # what the completion is for
    [wrong] = blocks(_doc(tmp_path, f"```toml\n{fragment}priority = 'urgent'\n```\n"))
    assert policy_problem(wrong) is not None


def test_a_missing_make_target_or_bench_suite_is_caught(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "```sh\nmake -j2 demo PREFIX=/opt\nmake nosuch\n"
                         "sudo .venv/bin/python -m bench nosuchsuite\n```\n"
                         "Run `make alsonot` or `python -m bench caps --nosuchflag`.\n")
    assert make_problems(doc) == (3, [f"{tmp_path}/broken.md:3: make nosuch",
                                      f"{tmp_path}/broken.md:6: make alsonot"])
    shown, problems = bench_problems(doc)
    assert shown == 2 and len(problems) == 2 and "nosuchsuite" in problems[0]


def test_a_broken_link_or_an_unlabelled_fence_is_caught(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("")
    doc = _doc(tmp_path, "[ok](there.md#a) [gone](gone.md) ![img](img.png) `[x](code.md)`\n"
                         "[ref]: ../nowhere/file.md\n[web](https://example.org/x)\n"
                         "```\nqosfs nothing\n```\n")
    assert link_problems(doc) == [f"{tmp_path}/broken.md:1: gone.md",
                                  f"{tmp_path}/broken.md:1: img.png",
                                  f"{tmp_path}/broken.md:2: ../nowhere/file.md"]
    assert unlabelled_fences(doc) == [f"{tmp_path}/broken.md:4"]
