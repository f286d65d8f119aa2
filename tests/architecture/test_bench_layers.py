"""bench/ is layered too (bench/__init__.py, docs/architecture.md): ``core`` below the
suites of the report (``suites``), and on top the modules of bench/ itself: the command
line, the catalog and the subcommands. A suite imports no other suite and a subcommand
no other subcommand: what two of them share is in ``core``; only the command line and
the catalog import the modules beside them. Checked from the source, imports inside
functions and under ``TYPE_CHECKING`` included, so a cycle cannot creep in behind a lazy
import or a type hint; and qosfs, the product, never imports its benchmarks."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from tests.architecture.module_graph import first_cycle, imports_under

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# Bottom to top; the modules of bench/ itself are above both.
LAYERS: dict[str, int] = {"core": 0, "suites": 1}
TOP = 2
ENTRY = {"bench.__main__", "bench.catalog"}  # may import the modules beside them
MAX_LINES = 600


def _modules() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top: str) -> set[str]:
    """The modules under *top* (``bench``, ``qosfs``) *path* imports, absolute names."""
    return imports_under(path, ROOT, top)


def _place(module: str) -> tuple[int, str]:
    """(rank, unit) of a bench module: its layer's rank, and the unit it may not import a
    sibling of (``bench.suites.caps``; ``bench.suites.training``, a suite's own package,
    is one unit; a subcommand ``bench.demo`` is one; ``bench.core`` is one)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return TOP, module
    unit = ".".join(parts[:3]) if parts[1] != "core" else "bench.core"
    return LAYERS[parts[1]], unit


MODULES = {_module_name(p): p for p in _modules()}


def test_bench_is_laid_out_in_its_layers() -> None:
    folders = {p.name for p in BENCH.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS), folders ^ set(LAYERS)
    from bench.catalog import COMMANDS, SUITES

    # every suite lives in bench/suites/, and bench/ itself holds no suite of the report
    suites = {s.runner.__module__ for s in SUITES}
    assert all(m.startswith("bench.suites.") for m in suites), suites
    beside = {_module_name(p) for p in BENCH.glob("*.py")} - {"bench", *ENTRY}
    # beside the command line and the catalog: the subcommands, and the profiling tools
    # run by hand (opcost, probecost, walkcost)
    commands = {m.split(".")[1].replace("_", "-") for m in beside}
    assert commands <= {c.name for c in COMMANDS} | {"opcost", "probecost", "walkcost"}, commands


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(BENCH)))
def test_a_bench_module_imports_only_below_it_and_no_sibling(path: Path) -> None:
    name = _module_name(path)
    rank, unit = _place(name)
    wrong = []
    for other in sorted(_imports(path, "bench")):
        if other not in MODULES or other == name:
            continue  # a name imported from a module, counted as the module itself
        other_rank, other_unit = _place(other)
        if other_unit == unit:
            continue  # within a suite's own package
        if other_rank > rank or (other_rank == rank and rank != 0 and name not in ENTRY):
            wrong.append(other)
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_no_two_bench_modules_import_each_other_even_through_a_chain() -> None:
    """Within a layer too: a cycle means neither module can be understood first."""
    graph = {name: {m for m in _imports(path, "bench") if m in MODULES and m != name
                    and MODULES[m].name != "__init__.py"}
             for name, path in MODULES.items()}
    cycle = first_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_qosfs_never_imports_bench() -> None:
    found = {str(p.relative_to(ROOT)): sorted(names)
             for p in sorted((ROOT / "qosfs").rglob("*.py")) if "__pycache__" not in p.parts
             and (names := _imports(p, "bench"))}
    assert not found, found


def test_no_bench_module_name_is_used_twice_and_none_is_long() -> None:
    names = Counter(p.stem for p in _modules() if p.name != "__init__.py")
    assert not [n for n, k in names.items() if k > 1], names
    long = {str(p.relative_to(ROOT)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


@pytest.mark.parametrize("package", sorted({p.parent for p in _modules()}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_a_bench_packages_init_lists_its_modules(package: Path) -> None:
    """A package's ``__init__`` is its docstring and nothing else, naming each module
    (and subpackage) it holds, so the docstring is where to start reading."""
    tree = ast.parse((package / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(tree.body) == 1, f"{package.relative_to(ROOT)}/__init__.py"
    held = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"] + \
        [p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()]
    missing = [m for m in held if f"``{m}``" not in doc]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py does not list {missing}"
