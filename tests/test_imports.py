"""No two modules of the package import each other, directly or around a loop.

The import graph is read from the source with :mod:`ast`, never by importing:
every ``import`` and ``from ... import`` counts wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING:``), relative imports are
resolved against the importing module's package.

What an edge is:

- ``import a.b.c`` and ``from a.b.c import name`` point at module ``a.b.c``;
  ``from a.b import c`` points at ``a.b.c`` when that is a module, otherwise
  at ``a.b`` (``c`` is a name defined there).
- The parents that Python runs on the way (``a`` and ``a.b`` for ``a.b.c``)
  are not edges. So a package ``__init__`` that imports its own submodules
  is never a cycle on its own; a submodule that imports back from its
  package's ``__init__`` while the ``__init__`` imports it is one, and fails
  (it would see a half-initialised package).
- Imports of modules outside the package (torch, the standard library) are
  not followed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "streamkv"


@dataclass(frozen=True, slots=True)
class ImportEdge:
    """``importer`` imports ``imported`` at ``path:lineno``."""

    importer: str
    imported: str
    path: Path
    lineno: int


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under ``root`` (the folder of ``package``)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        if level - 1 > len(base):
            raise ValueError(f"{module}: relative import goes above the top-level package")
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _imported_names(module: str, is_package: bool, tree: ast.AST) -> Iterator[tuple[str, int, list[str]]]:
    """``(absolute module, lineno, names imported from it)`` for every import statement in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, []
        elif isinstance(node, ast.ImportFrom):
            target = node.module
            if node.level:
                target = _resolve_relative(module, is_package, node.level, node.module)
            assert target is not None
            yield target, node.lineno, [alias.name for alias in node.names]


def import_edges(modules: dict[str, Path]) -> list[ImportEdge]:
    """Every import between two modules of ``modules`` (self-imports dropped)."""
    edges: list[ImportEdge] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, lineno, names in _imported_names(module, is_package, tree):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            plain_names = len(submodules) < len(names)
            imported = submodules + ([target] if (plain_names or not names) and target in modules else [])
            edges.extend(ImportEdge(module, m, path, lineno) for m in imported if m != module)
    return edges


def strongly_connected(nodes: list[str], edges: list[ImportEdge]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module, members sorted, components sorted."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.importer].append(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for n in nodes:
        if n not in index:
            visit(n)
    return sorted(components)


def describe_cycles(components: list[list[str]], edges: list[ImportEdge], base: Path) -> str:
    """One paragraph per component: its modules and the import lines (paths from ``base``) that tie them."""
    lines = []
    for component in components:
        members = set(component)
        lines.append("cycle: " + " <-> ".join(component))
        for e in sorted(edges, key=lambda e: (e.importer, e.imported, e.lineno)):
            if e.importer in members and e.imported in members:
                lines.append(f"    {e.importer} -> {e.imported}  ({e.path.relative_to(base)}:{e.lineno})")
    return "\n".join(lines)


def find_cycles(root: Path, package: str) -> tuple[list[list[str]], str]:
    modules = module_files(root, package)
    edges = import_edges(modules)
    components = strongly_connected(list(modules), edges)
    return components, describe_cycles(components, edges, root.parent)


# ------------------------------------------------------------------ the rule


def test_the_package_has_no_import_cycle() -> None:
    components, report = find_cycles(REPO / PACKAGE, PACKAGE)
    assert not components, f"import cycles in {PACKAGE} (TYPE_CHECKING and function-level imports count):\n{report}"


# ------------------------------------------------------- the walker itself


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_walker_finds_cycles_through_type_checking_function_and_relative_imports(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "pkg/b.py": "def f():\n    from . import a\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from ..d import x\n",
            "pkg/d.py": "import pkg.sub.c\nimport torch\n",
            "pkg/e.py": "import pkg.a\n",
        },
    )
    components, report = find_cycles(root, "pkg")
    assert components == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub.c"]]
    assert "pkg.a -> pkg.b  (" in report and "a.py:3)" in report
    assert "pkg.b -> pkg.a  (" in report and "b.py:2)" in report


def test_walker_lets_an_init_import_its_submodules_but_not_the_reverse(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\nfrom . import b\n",
            "pkg/a.py": "import pkg.b\nA = 1\n",
            "pkg/b.py": "from pkg import c\n",
            "pkg/c.py": "C = 1\n",
        },
    )
    assert find_cycles(root, "pkg")[0] == []
    (root / "c.py").write_text("from pkg import A\n", encoding="utf-8")  # back into the package __init__
    assert find_cycles(root, "pkg")[0] == [["pkg", "pkg.a", "pkg.b", "pkg.c"]]
