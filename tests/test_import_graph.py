"""`protocol`'s modules import each other along a DAG: no import cycle, not even one held open by a deferred
(function-level) import.

The graph is read from the source with `ast`, like tests/test_import_contract.py: every import statement at
any depth counts (inside a function, a class or an ``if TYPE_CHECKING:`` block too), so a cycle cannot hide
behind a lazy import.  An edge goes to the module an import names (``from protocol import crypto`` names the
submodule `protocol.crypto`; ``from protocol.crypto import x`` names `protocol.crypto`), not to the parent
packages Python runs first: `protocol/__init__.py` loads its exports lazily (PEP 562), so it starts no chain.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "protocol"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _target(name: str, modules: set[str]) -> str | None:
    """The most specific module of ``modules`` that an import of ``name`` loads, or None (not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, read from every ``*.py`` under ``root / package``."""
    paths = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    modules = set(paths)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    # A relative import: strip one package level per dot beyond the first (from the
                    # module's own package; a package's __init__ is its own package).
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base_parts = here[: len(here) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from base import x`` loads ``base.x`` when that is a module, else ``base``.
                names = [f"{base}.{alias.name}" for alias in node.names]
            for imported in names:
                target = _target(imported, modules)
                if target is not None and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None if it is a DAG (depth-first search)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_protocol_has_no_import_cycle() -> None:
    graph = import_graph(ROOT)
    assert "protocol.crypto" in graph and "protocol.families.lightfr" in graph, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in protocol/: " + " -> ".join(cycle or [])


def test_the_graph_counts_deferred_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle closed only by a function-level import is found, and named; relative
    imports and ``from package import submodule`` resolve to the module they load."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "a.py").write_text("from pkg import b\n", encoding="utf-8")
    (pkg / "b.py").write_text("from .sub.c import f\n", encoding="utf-8")
    (pkg / "sub" / "__init__.py").write_text("from .. import a as _a\n", encoding="utf-8")
    (pkg / "sub" / "c.py").write_text("def f():\n    import pkg.a\n", encoding="utf-8")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": {"pkg.a"},
        "pkg.sub.c": {"pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    graph["pkg.sub.c"].clear()
    assert find_cycle(graph) is None
