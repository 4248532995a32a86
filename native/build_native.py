"""cffi build script for ``redirect._native`` (API mode, out of line).

``setup.py`` runs this through ``cffi_modules``; ``python native/build_native.py``
builds it in place for development.

The cdef is made of the headers themselves, one list to keep true: ``redirect_native.h`` (the
functions) and ``redirect/bpf/abi.h`` (the eBPF maps' keys and values, which ``redirect.backends.ebpf``
reads its layouts and constants from), less what cdef does not read (preprocessor lines other
than ``#define NAME <integer>``), plus the kernel's names of the program and attach types.
"""

from __future__ import annotations

import pathlib
import re

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
BPF = HERE.parent / "redirect" / "bpf"

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


ffibuilder = FFI()
ffibuilder.cdef("typedef uint8_t __u8; typedef uint16_t __u16; typedef uint32_t __u32; typedef uint64_t __u64;")
ffibuilder.cdef(cdef_of(BPF / "abi.h"))
ffibuilder.cdef(cdef_of(HERE / "redirect_native.h"))
ffibuilder.cdef("\n".join(f"static const int {n};" for n in BPF_TYPES))
ffibuilder.set_source(
    "redirect._native",
    '#include <linux/bpf.h>\n#include "abi.h"\n#include "redirect_native.h"',
    sources=[str(HERE / "redirect_native.c"), str(HERE / "pod_setup.c"), str(HERE / "netfilter_probe.c"),
             str(HERE / "tc_filter.c")],
    include_dirs=[str(HERE), str(BPF)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
