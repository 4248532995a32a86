"""cffi build script for ``redirect._native`` (API mode, out of line).

The package build runs this through ``cffi_modules`` (``setup.py``): a wheel build, and the
editable install of ``make bootstrap`` (in place).

The cdef is made of the headers themselves, one list to keep true: ``redirect_native.h`` (the
functions) and ``redirect/bpf/abi.h`` (the eBPF maps' keys and values, which ``redirect.backends.ebpf``
reads its layouts and constants from), less what cdef does not read (preprocessor lines other
than ``#define NAME <integer>``), plus the kernel's names of the program and attach types.

First it writes ``redirect/bpf/kinds.h`` (the numbers of the maps' entry kinds) from the kind
table of ``redirect/plan/lower_ebpf.py``, the one place they are written.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
from typing import Any

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
BPF = HERE.parent / "redirect" / "bpf"


def _load_kinds() -> Any:
    """native/kinds.py (the header's generator), loaded by path: cffi runs this file outside any package."""
    spec = importlib.util.spec_from_file_location("rdr_kinds", HERE / "kinds.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KINDS_H = _load_kinds().write_kinds_header()

#: The bpf(2) program and attach types the eBPF backend uses, by the kernel's names (their values
#: come from <linux/bpf.h> when the module is compiled).
BPF_TYPES = (
    "BPF_PROG_TYPE_CGROUP_SOCK", "BPF_PROG_TYPE_SOCK_OPS", "BPF_PROG_TYPE_CGROUP_SOCK_ADDR",
    "BPF_PROG_TYPE_CGROUP_SOCKOPT", "BPF_PROG_TYPE_SK_LOOKUP", "BPF_PROG_TYPE_SCHED_CLS", "BPF_PROG_TYPE_SK_MSG",
    "BPF_CGROUP_INET4_CONNECT", "BPF_CGROUP_INET6_CONNECT", "BPF_CGROUP_UDP4_SENDMSG", "BPF_CGROUP_UDP6_SENDMSG",
    "BPF_CGROUP_UDP4_RECVMSG", "BPF_CGROUP_UDP6_RECVMSG", "BPF_CGROUP_INET4_GETPEERNAME",
    "BPF_CGROUP_INET6_GETPEERNAME", "BPF_CGROUP_GETSOCKOPT", "BPF_CGROUP_SOCK_OPS", "BPF_CGROUP_INET_SOCK_RELEASE",
    "BPF_SK_LOOKUP", "BPF_SK_MSG_VERDICT",
)

_DEFINE = re.compile(r"#\s*define\s+\w+\s+(0x[0-9a-fA-F]+|\d+)\b")


def cdef_of(path: pathlib.Path) -> str:
    """``path``'s text as cdef reads it: its preprocessor lines dropped, but integer ``#define``s."""
    return "\n".join(ln for ln in path.read_text().splitlines()
                     if not ln.lstrip().startswith("#") or _DEFINE.match(ln.lstrip()))


def _rel(path: pathlib.Path) -> str:
    """``path`` as setuptools wants the paths it is given: relative to setup.py's directory, where the
    package build runs."""
    return os.path.relpath(path)


ffibuilder = FFI()
ffibuilder.cdef("typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;")
ffibuilder.cdef(cdef_of(KINDS_H))
ffibuilder.cdef(cdef_of(BPF / "abi.h"))
ffibuilder.cdef(cdef_of(HERE / "redirect_native.h"))
ffibuilder.cdef("\n".join(f"static const int {n};" for n in BPF_TYPES))
ffibuilder.set_source(
    "redirect._native",
    '#include <linux/bpf.h>\n#include "abi.h"\n#include "redirect_native.h"',
    sources=[_rel(HERE / n) for n in ("redirect_native.c", "netlink.c", "pod_setup.c", "netfilter_probe.c",
                                      "tc_filter.c")],
    include_dirs=[_rel(HERE), _rel(BPF)],
    depends=[_rel(p) for p in (*sorted(HERE.glob("*.h")), BPF / "abi.h")],  # rebuilt when a header changes
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)
