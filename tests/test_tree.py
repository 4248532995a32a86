"""The tree keeps its shape: no import cycles between the library's modules (lazy and type-only
imports count), no module reaching into another's private names, no private name in an
``__all__``, the eBPF backend in its two parts (the host side never imports the per-pod side, which
sees the host side through its package's names alone) with no state kept at module level, and no
module grows past ~600 lines unless its docstring says why it is one module (the words "one
module:" and the reason)."""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.noroot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 650  # "about 600"
EBPF = "redirect.backends.ebpf"


def _cycles_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles", os.path.join(ROOT, "scripts", "import_cycles.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


IC = _cycles_script()
KNOWN: dict[str, str] = IC.modules()
GRAPH: dict[str, set[str]] = {m: IC.imports(m, p, KNOWN) for m, p in KNOWN.items()}


def _tree(mod: str) -> ast.Module:
    with open(KNOWN[mod], encoding="utf-8") as f:
        return ast.parse(f.read())


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_import_cycles_between_modules() -> None:
    assert len(KNOWN) > 50 and GRAPH["redirect.api"], "the script reads the tree"
    assert IC.cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert IC.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cycle_finder_counts_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """A cycle made by an import in a function and one under ``if TYPE_CHECKING:`` is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    known = IC.modules(str(pkg))
    graph = {m: IC.imports(m, p, known) for m, p in known.items()}
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert IC.cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_module_imports_another_modules_private_names() -> None:
    """``from x import _y`` of a module of ours, or ``x._y`` on one imported as a module, is a name
    its module keeps to itself: a name another module needs is public (no underscore)."""
    found = []
    for mod, path in KNOWN.items():
        tree = _tree(mod)
        modules_here: set[str] = set()  # local names bound to modules of ours
        for node in IC.import_nodes(tree):
            if isinstance(node, ast.Import):
                modules_here |= {a.asname for a in node.names if a.asname and a.name in KNOWN}
                continue
            base = IC.base_of(node, mod, path)
            if not base.startswith("redirect"):
                continue
            for a in node.names:
                if f"{base}.{a.name}" in KNOWN:
                    modules_here.add(a.asname or a.name)
                elif _private(a.name) and base in KNOWN:
                    found.append(f"{mod}:{node.lineno}: from {base} import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in modules_here):
                found.append(f"{mod}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, found


def test_no_private_name_is_exported() -> None:
    found = []
    for mod in KNOWN:
        for node in _tree(mod).body:
            names = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            if names == ["__all__"]:
                found += [f"{mod}: {n}" for n in ast.literal_eval(node.value) if _private(n)]
    assert not found, found


def _call_name(node: ast.expr) -> str:
    f = node.func if isinstance(node, ast.Call) else node
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


#: What keeps state when bound at module level: containers, thread-locals, locks, counters, caches.
STATEFUL_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "local", "Lock", "RLock",
                  "count", "lru_cache", "cache", "WeakValueDictionary", "WeakKeyDictionary"}


def _module_state(mod: str) -> list[str]:
    """What ``mod`` keeps at module level: a ``global`` rebinding, a container, lock, thread-local or
    counter bound to a module name (a table, in CAPITALS and written out in the source, is no state:
    nothing changes it), a function with a ``functools`` cache."""
    tree = _tree(mod)
    out = [f"{mod}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [f"{mod}:{node.lineno}: cached function {node.name}" for d in node.decorator_list
                    if _call_name(d) in ("lru_cache", "cache")]
        targets, value = ((node.targets, node.value) if isinstance(node, ast.Assign) else
                          ([node.target], node.value) if isinstance(node, ast.AnnAssign) else ([], None))
        if value is None:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if names == ["__all__"]:
            continue
        table = isinstance(value, (ast.Dict, ast.List, ast.Set)) and all(n.lstrip("_").isupper() for n in names)
        stateful = (isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
                    or (isinstance(value, ast.Call) and (_call_name(value) in STATEFUL_CALLS
                                                         or (isinstance(value.func, ast.Call)
                                                             and _call_name(value.func) in STATEFUL_CALLS))))
        if stateful and not table:
            out.append(f"{mod}:{node.lineno}: {', '.join(names)} = {ast.unparse(value)[:60]}")
    return out


def test_the_ebpf_backend_keeps_no_state_at_module_level() -> None:
    """The eBPF package keeps a process's state in objects with a lifetime (``host.lifetime.Process``:
    the handles per pin root, which carry what the per-pod side computed for an intent), never in
    module globals or module-level caches."""
    found = [x for mod in KNOWN if mod == EBPF or mod.startswith(EBPF + ".") for x in _module_state(mod)]
    assert not found, found


def test_the_state_finder_finds_module_state(tmp_path: Path) -> None:
    src = ("import functools, threading\nTABLE = {'a': 1}\n_cache = {}\n_tls = threading.local()\n"
           "@functools.lru_cache(maxsize=4)\ndef f():\n    global _x\n")
    (tmp_path / "m.py").write_text(src)
    KNOWN["tmp.m"] = str(tmp_path / "m.py")
    try:
        found = _module_state("tmp.m")
    finally:
        del KNOWN["tmp.m"]
    assert [x.split(": ", 1)[1].split(" =")[0] for x in found] == ["global _x", "_cache", "_tls",
                                                                    "cached function f"]


def test_the_ebpf_host_side_never_imports_the_per_pod_side() -> None:
    """``ebpf.host`` (programs, pins, pool, lifetime, syscalls, loader) is done once per host and
    imports nothing of ``ebpf.pod`` or of the package above it but ``ebpf.abi``."""
    host = [m for m in KNOWN if m.startswith(EBPF + ".host")]
    assert len(host) >= 8
    found = [f"{m} imports {d}" for m in host for d in GRAPH[m]
             if d.startswith(EBPF) and not d.startswith(EBPF + ".host") and d != EBPF + ".abi"]
    assert not found, found


def test_the_per_pod_side_sees_the_host_side_through_its_package_names() -> None:
    """``ebpf.pod`` (entries, pod network, tc, fresh, apply) takes the host side's public names
    (``redirect.backends.ebpf.host``: ``PodStore`` and a few), never one of its modules."""
    pod = [m for m in KNOWN if m.startswith(EBPF + ".pod")]
    assert len(pod) >= 5
    assert all(EBPF + ".host" in GRAPH[m] for m in (EBPF + ".pod.backend", EBPF + ".pod.fresh"))
    found = [f"{m} imports {d}" for m in pod for d in GRAPH[m] if d.startswith(EBPF + ".host.")]
    found += [f"{m} imports {d}" for m in pod for d in GRAPH[m] if d in (EBPF, EBPF + ".unload")]
    assert not found, found


def test_no_module_is_long_without_saying_why() -> None:
    long = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "redirect")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path) as fh:
                text = fh.read()
            doc = ast.get_docstring(ast.parse(text)) or ""
            if text.count("\n") > MAX_LINES and "one module:" not in doc:
                long.append(f"{os.path.relpath(path, ROOT)}: {text.count(chr(10))} lines")
    assert not long, long
