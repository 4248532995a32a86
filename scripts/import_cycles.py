"""Print the import cycles between the modules of ``redirect`` (exit 1 if there is one).

Every ``import`` that names a module counts: one at the top, one inside a function (a lazy import
hides a cycle, it does not remove it) and one under ``if TYPE_CHECKING:`` (a type-only import is
still a dependency a reader follows; a cycle through it is a cycle of the design). A package's
``__init__`` counts as the module it is, importing what it names: that Python runs it before a
module of the package is no cycle of ours.

    .venv/bin/python scripts/import_cycles.py
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "redirect")


NATIVE = {"redirect._native"}  # the compiled cffi module: imports nothing of ours


def modules(root: str = ROOT) -> dict[str, str]:
    """Module name -> file, of every module under ``root`` (a package directory)."""
    out = {}
    top = os.path.dirname(os.path.abspath(root))
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), top)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands (top level, in a function, under
    ``if TYPE_CHECKING:``)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def base_of(node: ast.ImportFrom, mod: str, path: str) -> str:
    """The absolute module ``from <base> import ...`` names, in module ``mod`` (file ``path``)."""
    base = node.module or ""
    if node.level:
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        parts = pkg.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return base


def imports(mod: str, path: str, known: dict[str, str]) -> set[str]:
    """The modules of ``known`` that module ``mod`` (file ``path``) imports, anywhere in it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out: set[str] = set()
    for node in import_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        base = base_of(node, mod, path)
        for a in node.names:
            if f"{base}.{a.name}" in known:
                out.add(f"{base}.{a.name}")
            elif f"{base}.{a.name}" not in NATIVE:
                out.add(base)
    return {m for m in out if m in known and m != mod}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    found = cycles(graph)
    for comp in found:
        print("cycle:", " <-> ".join(comp))
    print(f"{len(known)} modules, {len(found)} cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
