"""Comments, docstrings and docs name code that exists, and loggers are named after it.

A docstring naming a file that was split up long ago, or a module that never was, sends
a newcomer looking for nothing. So every dotted path under ``qosfs`` (a module, or a
module and attributes it has) and every Python file name in the comments and docstrings
of qosfs, tests and bench, and in README.md, docs/ and bench/*.md, must resolve: a file
name with a directory from the repository's root, from ``qosfs/`` (``qos/engine.py``) or
from the naming file's folder, a bare one anywhere in the tree. A failure lists every
place.

Loggers are the module's own name (``logging.getLogger(__name__)``), so a journal line
says which module wrote it, and docs/administration.md lists each with the name it had
before, for filters written then; those former names are the only dotted names allowed
not to exist.
"""

from __future__ import annotations

import ast
import functools
import importlib
import io
import logging
import re
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.mounting import ROOT

PYTHON = sorted(p for top in ("qosfs", "tests", "bench") for p in (ROOT / top).rglob("*.py")
                if "__pycache__" not in p.parts)
MARKDOWN = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                   *(ROOT / "bench").glob("*.md")])
ADMINISTRATION = ROOT / "docs" / "administration.md"

# ``qosfs.`` and more dotted words; not a host name (``qosfs.io/...``), not part of a
# longer name (``x.qosfs.y``, ``qosfs.toml`` is a file: see _SUFFIXES).
DOTTED = re.compile(r"(?<![\w.])qosfs(?:\.[A-Za-z_]\w*)+(?![\w/-])")
# A Python file name, alone or after a path (``tests/waiting.py``, ``waiting.py``).
PY_FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Za-z_]\w*\.py)\b")
_SUFFIXES = {"toml", "log", "sock", "service", "py", "md"}  # qosfs.toml is a file name


def _texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring line of *path*, every line of a page."""
    source = path.read_text()
    if path.suffix != ".py":
        yield from enumerate(source.splitlines(), 1)
        return
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(first := node.body[0], ast.Expr) \
                and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            for n, line in enumerate(first.value.value.splitlines()):
                yield first.lineno + n, line


@functools.cache
def _resolves(dotted: str) -> bool:
    """Whether *dotted* is a module, or a module followed by attributes it has (a class's
    attribute may be only declared: a protocol's or a dataclass's field)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for n, attribute in enumerate(parts[cut:], cut + 1):
            if not hasattr(found, attribute):
                declared = any(attribute in vars(k).get("__annotations__", {})
                               for k in getattr(found, "__mro__", ()))
                return declared and n == len(parts)
            found = getattr(found, attribute)
        return True
    return False


def _logger_table() -> list[tuple[str, str]]:
    """(former name, name now) of each row of docs/administration.md's table of loggers."""
    return re.findall(r"^\| `(qosfs[\w.]*)`[^|]*\| `(qosfs[\w.]*)`",
                      ADMINISTRATION.read_text(), re.MULTILINE)


def _missing(path: Path, lines: Iterable[tuple[int, str]], files: set[str],
             former: set[str]) -> list[str]:
    """``FILE:LINE: NAME`` for each name in *lines* of *path* that does not resolve."""
    missing = []
    for n, line in lines:
        for found in DOTTED.finditer(line):
            name = found[0]
            if name.rsplit(".", 1)[1] in _SUFFIXES and not _resolves(name):
                continue  # a file name: qosfs.toml, qosfs.log
            if not _resolves(name) and not (path == ADMINISTRATION and name in former):
                missing.append(f"{path.relative_to(ROOT)}:{n}: {name}")
        for found in PY_FILE.finditer(line):
            name = found[1]
            if "/" in name:
                exists = any((base / name).exists()
                             for base in (ROOT, ROOT / "qosfs", path.parent))
            else:
                exists = name in files
            if not exists:
                missing.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    return missing


def test_every_dotted_path_and_python_file_named_in_comments_and_docs_exists() -> None:
    files = {p.name for p in ROOT.rglob("*.py")}
    former = {old for old, _ in _logger_table()}
    missing = []
    for path in PYTHON + MARKDOWN:
        lines = list(enumerate(path.read_text().splitlines(), 1))
        # A cheap pass over every line first; comments and docstrings are told apart from
        # code (tokenize and ast: most of the time taken) only in a file that names
        # something missing somewhere, a name in a string of code being no reference.
        if _missing(path, lines, files, former):
            missing += _missing(path, _texts(path), files, former)
    assert not missing, "named but not there:\n" + "\n".join(missing)


def test_loggers_are_named_after_their_module_and_listed_for_the_journal() -> None:
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in PYTHON
               if p.parts[len(ROOT.parts)] == "qosfs" and "getLogger(" in p.read_text()]
    loggers = {}
    for name in modules:
        log = getattr(importlib.import_module(name), "log", None)
        if isinstance(log, logging.Logger):
            loggers[name] = log.name
    assert loggers, "no module logger found: the scan is broken"
    misnamed = {module: name for module, name in loggers.items() if name != module}
    assert not misnamed, misnamed
    documented = {now for _, now in _logger_table()}
    assert documented >= set(loggers), f"not in {ADMINISTRATION}: {set(loggers) - documented}"
