"""The tree keeps its shape: no import cycles between the library's modules, and no module
grows past ~600 lines unless its docstring says why it is one module (the words "one module:"
and the reason)."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

pytestmark = pytest.mark.noroot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 650  # "about 600"


def _cycles_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("import_cycles", os.path.join(ROOT, "scripts", "import_cycles.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles_between_modules() -> None:
    ic = _cycles_script()
    known = ic.modules()
    graph = {m: ic.imports(m, p, known) for m, p in known.items()}
    assert len(known) > 50 and graph["redirect.api"], "the script reads the tree"
    assert ic.cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    ic = _cycles_script()
    assert ic.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
