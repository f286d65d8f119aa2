"""Every package qosfs imports at run time is one a plain ``pip install .`` installs.

A mount from an installed tree once failed on every start with "No module named
'xxhash'" (issue 38): the crash journal imported it, and pyproject declared it only in the
test extra, which every development venv has. Two checks, each failing where the other
cannot see:

* **Statically, by rule** (every module, in milliseconds). An import in ``qosfs/`` names
  the standard library, qosfs itself, or a distribution, found through
  ``importlib.metadata.packages_distributions()`` of this venv. Then:

  1. an import that runs when its module is imported (module level, class bodies and
     module-level ``if``/``try``/``with`` included) must come from a distribution in
     ``[project] dependencies``;
  2. an import inside a function runs only when that function is called: it may also come
     from a distribution that only an optional extra lists, if the module *guards* that
     package: at least one of its imports of it sits in a ``try`` whose handler catches
     ``ImportError`` (or ``ModuleNotFoundError``) and whose message names the extra to
     install as ``qosfs[EXTRA]``, an extra that lists the distribution (``qosfs top``'s
     live view and ``rich``: "pip install 'qosfs[top]'"). Other functions of the module
     may then import it bare: they run after the guard;
  3. imports under ``if TYPE_CHECKING:`` never run and are not checked.

* **By importing** every module of the package in a virtualenv made by ``pip install .``
  alone (no extras; built once per session, from a copy of the package so the work tree
  gets no build/ or egg-info), in a fresh interpreter. It catches what the rule cannot
  read: an import made through ``importlib``, a dependency whose import name is not its
  distribution's, a package that some test extra drags in behind the declared ones.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.systemd_units import ROOT

PACKAGE = ROOT / "qosfs"
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})
EXTRA_NAMED = re.compile(r"qosfs\[([A-Za-z0-9_,.-]+)\]")


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them (``PyYAML`` and ``pyyaml``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert found, f"unreadable requirement in pyproject.toml: {requirement!r}"
    return normalized(found[0])


@dataclass(frozen=True)
class Declared:
    """What pyproject.toml declares: the run-time distributions, and each extra's."""

    dependencies: frozenset[str]
    extras: dict[str, frozenset[str]]

    @classmethod
    def read(cls, path: Path = ROOT / "pyproject.toml") -> Declared:
        project = tomllib.loads(path.read_text())["project"]
        return cls(frozenset(_requirement_name(r) for r in project["dependencies"]),
                   {extra: frozenset(_requirement_name(r) for r in requirements)
                    for extra, requirements in project["optional-dependencies"].items()})


@dataclass(frozen=True)
class Import:
    """One import of a third-party package in a module."""

    package: str  # the top-level import name: "rich" for rich.console
    line: int
    at_import: bool  # runs when the module is imported (rule 1)
    guard_extras: frozenset[str]  # extras a surrounding ImportError handler names (rule 2)


def _handler_extras(node: ast.Try) -> frozenset[str]:
    """The extras named (``qosfs[EXTRA]``) in the handlers of *node* that catch
    ImportError; empty if none catches it."""
    extras: set[str] = set()
    for handler in node.handlers:
        caught = handler.type
        names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
        if not any(isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in names):
            continue
        for sub in ast.walk(handler):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                for found in EXTRA_NAMED.findall(sub.value):
                    extras.update(found.split(","))
    return frozenset(extras)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def third_party_imports(source: str, name: str = "<module>") -> list[Import]:
    """The imports of packages outside the standard library and qosfs in *source*."""
    found: list[Import] = []

    def visit(node: ast.AST, at_import: bool, guard: frozenset[str]) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # `else:` of TYPE_CHECKING runs
                visit(child, at_import, guard)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            if isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module or ""]
            else:
                names = [alias.name for alias in node.names]
            for full in names:
                top = full.split(".")[0]
                if top and top != "qosfs" and top not in sys.stdlib_module_names:
                    found.append(Import(top, node.lineno, at_import, guard))
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import = False
        if isinstance(node, ast.Try | ast.TryStar):
            inner = guard | _handler_extras(node)
            for child in node.body:
                visit(child, at_import, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, at_import, guard)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, at_import, guard)

    visit(ast.parse(source, name), True, frozenset())
    return found


def violations(source: str, name: str, declared: Declared,
               distributions: dict[str, list[str]]) -> list[str]:
    """Where *source* breaks the rules of the module docstring, one line each.
    *distributions*: import name -> the distributions that provide it."""
    imports = third_party_imports(source, name)
    guarded: set[tuple[str, str]] = set()  # (package, extra) a guard names
    for imp in imports:
        guarded.update((imp.package, extra) for extra in imp.guard_extras)
    found = []
    for imp in imports:
        where = f"{name}:{imp.line}: {imp.package}"
        dists = {normalized(d) for d in distributions.get(imp.package, [])}
        if not dists:
            found.append(f"{where}: no installed distribution provides it")
            continue
        if dists & declared.dependencies:
            continue
        if imp.at_import:
            found.append(f"{where} is imported with the module, and {'/'.join(sorted(dists))}"
                         " is not in [project] dependencies")
            continue
        extras = {extra for package, extra in guarded if package == imp.package
                  and dists & declared.extras.get(extra, frozenset())}
        if not extras:
            found.append(f"{where}: {'/'.join(sorted(dists))} is not in [project] "
                         "dependencies, and no import of it in this module is guarded by "
                         "an ImportError handler naming an extra that lists it "
                         "(qosfs[EXTRA])")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


# ------------------------------------------------------------------------- the rule


def test_every_module_imports_only_declared_packages_or_guarded_extras() -> None:
    declared = Declared.read()
    distributions = importlib.metadata.packages_distributions()
    found = [line for path in _modules()
             for line in violations(path.read_text(), str(path.relative_to(ROOT)), declared,
                                    distributions)]
    assert not found, "\n".join(found)


# What the rule is checked on: a declaration like pyproject's, and the distributions of
# this venv's packages as packages_distributions() gives them.
DECLARED = Declared(frozenset({"trio", "pyfuse3"}),
                    {"top": frozenset({"rich"}), "test": frozenset({"pyyaml", "rich"})})
DISTRIBUTIONS = {"trio": ["trio"], "pyfuse3": ["pyfuse3"], "rich": ["rich"],
                 "yaml": ["PyYAML"]}


@pytest.mark.parametrize(("source", "wrong"), [
    ("import trio\nimport pyfuse3.asyncio\n", []),
    ("import os\nimport yaml\n", ["m.py:2: yaml is imported with the module, and pyyaml"]),
    ("try:\n    import yaml\nexcept ImportError:\n    yaml = None\n",
     ["m.py:2: yaml is imported with the module"]),  # still an import at import time
    ("class A:\n    from rich.text import Text\n", ["m.py:2: rich is imported with the"]),
    ("def f():\n    import rich\n", ["m.py:2: rich: rich is not in [project] dependencies"]),
    ("def f():\n    try:\n        import rich\n    except ImportError:\n"
     "        raise SystemExit(\"pip install 'qosfs[top]'\") from None\n"
     "def g():\n    from rich.text import Text\n", []),
    # The guard names an extra that does not list the package, or names none.
    ("def f():\n    try:\n        import yaml\n    except ImportError:\n"
     "        raise SystemExit(\"pip install 'qosfs[top]'\")\n", ["m.py:3: yaml: pyyaml"]),
    ("def f():\n    try:\n        import rich\n    except ImportError:\n"
     "        raise SystemExit('pip install rich')\n", ["m.py:3: rich: rich"]),
    ("def f():\n    try:\n        import rich\n    except OSError:\n"
     "        raise SystemExit(\"pip install 'qosfs[top]'\")\n", ["m.py:3: rich: rich"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import yaml\n", []),
    ("import nosuchpackage\n", ["m.py:1: nosuchpackage: no installed distribution"]),
    ("from . import sibling\nfrom qosfs.core import units\n", []),
])
def test_the_rule_tells_declared_guarded_and_undeclared_imports(
        source: str, wrong: list[str]) -> None:
    found = violations(source, "m.py", DECLARED, DISTRIBUTIONS)
    assert len(found) == len(wrong), found
    for line, start in zip(found, wrong, strict=True):
        assert line.startswith(start), (line, start)


# ------------------------------------------------------------------- by importing


@pytest.fixture(scope="session")
def declared_only_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A virtualenv with qosfs installed by ``pip install .`` (no extras), from a copy of
    what the wheel is built from. Built once per session: a minute cold, seconds with
    pip's cache."""
    top = tmp_path_factory.mktemp("declared-only")
    tree = top / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(PACKAGE, tree / "qosfs", ignore=shutil.ignore_patterns("__pycache__"))
    venv = top / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    done = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", str(tree)],
                          capture_output=True, text=True, timeout=900, cwd=top)
    assert done.returncode == 0, done.stdout + done.stderr
    yield venv


# Imports every module of the installed qosfs by name (not the work tree's: -P and cwd /)
# and prints the ones that fail, with why.
IMPORT_ALL = """
import importlib, pkgutil, sys, qosfs
assert qosfs.__file__.startswith(sys.prefix), qosfs.__file__
failed = 0
for module in pkgutil.walk_packages(qosfs.__path__, "qosfs."):
    if module.name.endswith(".__main__"):
        continue  # runs the command line
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed += 1
        print(f"{module.name}: {type(exc).__name__}: {exc}")
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_in_a_venv_of_the_declared_dependencies_alone(
        declared_only_venv: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(declared_only_venv / "bin/python"), "-P", "-c", IMPORT_ALL],
                          capture_output=True, text=True, timeout=300, cwd="/", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # And the module list was the package's: a walk that found nothing would pass.
    count = subprocess.run([str(declared_only_venv / "bin/python"), "-P", "-c",
                            "import pkgutil, qosfs; print(len(list(pkgutil.walk_packages("
                            "qosfs.__path__, 'qosfs.'))))"],
                           capture_output=True, text=True, timeout=60, cwd="/", env=env)
    here = sum(1 for p in _modules() if p.name != "__init__.py" or p.parent != PACKAGE)
    assert int(count.stdout) == here, (count.stdout, count.stderr)
