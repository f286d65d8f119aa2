"""The shape a newcomer can find their way in (issue 39): modules of one job and a
readable size, one name per module, one place that makes an open file's handle, and
packages whose docstring lists what they hold.

The limits are the ones the restructure set: 600 lines for any module, 650 for the
filesystem class's module, which answers FUSE's ~30 requests and nothing else. A module
that grows past them is a module doing a second job; split it by that job, do not raise
the limit."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "qosfs"
LARGEST_MODULE = 600
LARGEST_OPERATIONS = 650


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py")
                  if "__pycache__" not in p.parts and p.parent != PACKAGE)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_its_size() -> None:
    limits = {PACKAGE / "passthrough" / "operations.py": LARGEST_OPERATIONS}
    over = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := _lines(p)) > limits.get(p, LARGEST_MODULE)}
    assert not over, (f"modules over {LARGEST_MODULE} lines "
                      f"(operations {LARGEST_OPERATIONS}): {over}")


def test_the_filesystem_class_is_the_only_thing_in_its_module() -> None:
    """operations.py holds the FUSE handlers' class and what its handlers share (the
    decorator, the options): no second class of parts assembled inside it."""
    tree = ast.parse((PACKAGE / "passthrough" / "operations.py").read_text())
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert "PassthroughOperations" in classes
    assert len(classes) <= 2, classes  # the class, and at most its options


def test_no_module_name_is_used_twice() -> None:
    """``explain`` in two layers reads as one thing in a traceback, a grep or an import."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name[path.stem].append(str(path.relative_to(PACKAGE)))
    twice = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not twice, twice


def test_one_module_constructs_a_file_handle() -> None:
    """An open file is written down in one record; the journal, the handover and crash
    recovery all load it through the one place that makes a ``FileHandle``."""
    makers = sorted(str(p.relative_to(PACKAGE)) for p in _modules()
                    if re.search(r"\bFileHandle\(", p.read_text()))
    assert len(makers) == 1, makers


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_packages_face_lists_what_it_holds(package: Path) -> None:
    """Every package's ``__init__`` is its docstring, and the docstring names each of its
    modules and subpackages: ``ls`` and the docstring tell the same story."""
    tree = ast.parse((package / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    where = package.relative_to(PACKAGE)
    assert doc, f"qosfs/{where}/__init__.py says what the package is for"
    assert len(tree.body) == 1, f"qosfs/{where}/__init__.py holds more than its docstring"
    held = sorted(p.stem for p in package.glob("*.py")
                  if p.name not in ("__init__.py", "__main__.py"))
    held += sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists())
    missing = [name for name in held if not re.search(rf"\b{re.escape(name)}\b", doc)]
    assert not missing, f"qosfs/{where}/__init__.py does not mention {missing}"
