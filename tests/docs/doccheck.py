"""Reading the docs' fenced blocks, commands and links, and checking each against the
real parser, policy loader, Makefile and tree. The checks are functions of a list of
documents so that tests/docs/test_doccheck.py can feed each one a broken document.

What is checked, and how, is described in tests/docs/test_doc_commands.py.
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

from qosfs.control.ctl import parse_assignments, parse_target
from qosfs.core.errors import QosfsError
from qosfs.daemon.cli import _build_parser
from qosfs.policy.loading import parse_policy, with_changes
from qosfs.policy.model import PolicyError
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
    except QosfsError as exc:  # a malformed target or setting, or a PolicyError
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


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for line in text.splitlines()
            if (found := re.match(r"^([A-Za-z][\w.-]*(?:\s+[\w.-]+)*)\s*:(?!=)", line))
            for m in found[1].split()}


def make_problems(paths: list[Path]) -> tuple[int, list[str]]:
    """(how many ``make TARGET`` are shown, those whose target does not exist)."""
    targets = makefile_targets()
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
