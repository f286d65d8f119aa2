"""The package layout is the architecture: each folder is a layer, and a layer imports
only the layers below it (docs/architecture.md). Checked from the source, imports under
``TYPE_CHECKING`` included, so a cycle cannot creep in behind a type hint."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.architecture.module_graph import first_cycle, imports_under

PACKAGE = Path(__file__).resolve().parents[2] / "qosfs"

# Bottom to top. Layers on the same rank are siblings and must not import each other.
LAYERS: dict[str, int] = {
    "core": 0,
    "policy": 1,
    "qos": 2,
    "passthrough": 3,
    "control": 3,
    "plan": 3,
    "daemon": 4,
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "qosfs" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _imports(path: Path) -> set[str]:
    """The qosfs modules *path* imports (absolute names)."""
    return imports_under(path, PACKAGE.parent, "qosfs")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_lives_in_a_layer() -> None:
    loose = [p.name for p in PACKAGE.glob("*.py")
             if p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules outside a layer folder: {loose}"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS), folders ^ set(LAYERS)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_layers_below_it(path: Path) -> None:
    own = _layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    if own is None:
        return  # qosfs/__init__.py and __main__.py sit above every layer
    upward = sorted({name for name in _imports(path)
                     if (other := _layer(name)) is not None and other != own
                     and LAYERS[other] >= LAYERS[own]})
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports {upward}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_import_each_other_even_through_a_chain() -> None:
    """Within a layer too: a cycle means neither module can be understood first."""
    modules = {_module_name(p): p for p in _modules()}
    graph = {name: {m for m in _imports(path) if m in modules and m != name
                    and modules[m].name != "__init__.py"}
             for name, path in modules.items()}
    cycle = first_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layers_init_only_describes_it(layer: str) -> None:
    """A layer's ``__init__`` is its docstring and nothing else: every name is imported
    from the module that defines it, so there is one place to look for it, and importing
    a layer (``qosfs ctl`` imports the control layer) costs nothing it does not use."""
    tree = ast.parse((PACKAGE / layer / "__init__.py").read_text())
    assert ast.get_docstring(tree), f"qosfs/{layer}/__init__.py says what the layer is for"
    assert len(tree.body) == 1, f"qosfs/{layer}/__init__.py holds more than its docstring"


def _runtime_imports(tree: ast.AST) -> set[str]:
    """Every module name *tree* imports outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


BELOW_PASSTHROUGH = [p for p in _modules()
                     if (layer := _layer(_module_name(p))) is not None
                     and LAYERS[layer] < LAYERS["passthrough"]]


@pytest.mark.parametrize("path", BELOW_PASSTHROUGH, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_below_the_passthrough_imports_fuse(path: Path) -> None:
    """FUSE is the pass-through's business: the engine learns of a request's caller only
    through the ``CallerWatch`` it is given (qosfs.passthrough.interrupts). Type hints may
    name ``pyfuse3.RequestContext`` (what a handler hands the engine), nothing more."""
    fuse = {name for name in _runtime_imports(ast.parse(path.read_text(), str(path)))
            if name.split(".")[0] == "pyfuse3"}
    assert not fuse, f"{path.relative_to(PACKAGE)} imports {sorted(fuse)}"
