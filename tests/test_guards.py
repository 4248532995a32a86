"""Guards: an option is carried through every layer, or a test here says which layer it stopped at.

A capture option goes config -> intent -> netfilter plan (``redirect/plan/sidecar.py``) and eBPF
lowering (``redirect/plan/lower_ebpf.py``) -> the programs' reader (``redirect/bpf/policy.h``) and
their model (``redirect.plan.evaluate``). These tests fail for an option that stops half-way
(docs/development.md, "Adding an option"). No root, no kernel.
"""

from __future__ import annotations

import importlib.util
import pathlib
import typing

import pytest

from redirect.plan import lower_ebpf

pytestmark = pytest.mark.noroot

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _native_kinds() -> typing.Any:
    spec = importlib.util.spec_from_file_location("rdr_kinds", ROOT / "native" / "kinds.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_kinds_header_is_generated_from_the_one_kind_table() -> None:
    """redirect/bpf/kinds.h is what native/kinds.py makes of lower_ebpf's table (run ``make bootstrap``
    after changing the table), the build reads the same table the package does, and the kinds'
    names, numbers and types are each written once."""
    kinds = _native_kinds()
    table = kinds.kind_table()
    assert table == {"PORT_KINDS": lower_ebpf.PORT_KINDS, "CIDR_KINDS": lower_ebpf.CIDR_KINDS}
    assert kinds.KINDS_H.read_text() == kinds.kinds_header(table), \
        "redirect/bpf/kinds.h is not current with redirect/plan/lower_ebpf.py's kind table: run make bootstrap"
    assert set(typing.get_args(lower_ebpf.PortKind)) == set(lower_ebpf.PORT_KIND)
    assert set(typing.get_args(lower_ebpf.CidrKind)) == set(lower_ebpf.CIDR_KIND)
    for rows in (lower_ebpf.PORT_KINDS, lower_ebpf.CIDR_KINDS):
        numbers = [r[1] for r in rows]
        assert len(set(numbers)) == len(numbers) and 0 not in numbers, rows
    assert set(lower_ebpf.CIDR_SHAPE.values()) <= set(typing.get_args(lower_ebpf.Shape))
