"""What the host part is made of: the BPF sources compiled, the programs (their kernel types, and
whether they hang on the cgroup root), and the maps (their key and value sizes), as the loader pins
them under ``<root>/progs``, ``<root>/maps`` and ``<root>/links``. A program or a map of the host
part is one row here, beside its C in ``redirect/bpf/``; nothing else lists them.
"""

from __future__ import annotations

import hashlib
import os

from ....errors import BackendUnavailable
from ..abi import (
    CIDR_KEY,
    INV_KEY,
    INV_VAL,
    LISTENER_KEY,
    ORIG,
    PAIR_KEY,
    PAIR_STATE,
    POLICY,
    POOL_SLOT,
    PORT_KEY,
    TUPLE_KEY,
    const,
)

#: The BPF C sources: package data of ``redirect`` (``redirect/bpf/``), installed with it.
BPF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                       "bpf")
#: The header tree bcc compiles against (``BCC_KERNEL_SOURCE``): the kernel's UAPI headers the programs
#: and bcc's helpers.h include, and a few of ours (``redirect/bpf/headers/README.md``). Package data.
HEADERS_DIR = os.path.join(BPF_DIR, "headers")
#: ``uname -m`` -> the kernel's arch directory (as bcc maps it), for the arches whose UAPI headers
#: ``HEADERS_DIR`` carries.
HEADER_ARCHES = {"x86_64": "x86"}
#: Sources in compile order. bcc only rewrites map calls (``pods.lookup``) in its main text, so the
#: helper header is inlined there rather than #included.
SOURCES = ("policy.h", "sock_addr.c", "sockmap.c", "sockopt.c", "sk_lookup.c", "tc_forward.c")

#: Program name -> (program type, attach type, attached to the cgroup root?), by the kernel's names
#: (bcc 0.26 lacks some of them; the native module has them from <linux/bpf.h>).
PROGRAMS: dict[str, tuple[int, int, bool]] = {
    "rdr_connect4": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_INET4_CONNECT"), True),
    "rdr_connect6": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_INET6_CONNECT"), True),
    "rdr_sendmsg4": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_UDP4_SENDMSG"), True),
    "rdr_sendmsg6": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_UDP6_SENDMSG"), True),
    "rdr_recvmsg4": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_UDP4_RECVMSG"), True),
    "rdr_recvmsg6": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_UDP6_RECVMSG"), True),
    "rdr_getpeername4": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_INET4_GETPEERNAME"), True),
    "rdr_getpeername6": (const("BPF_PROG_TYPE_CGROUP_SOCK_ADDR"), const("BPF_CGROUP_INET6_GETPEERNAME"), True),
    "rdr_getsockopt": (const("BPF_PROG_TYPE_CGROUP_SOCKOPT"), const("BPF_CGROUP_GETSOCKOPT"), True),
    "rdr_sockops": (const("BPF_PROG_TYPE_SOCK_OPS"), const("BPF_CGROUP_SOCK_OPS"), True),
    "rdr_sock_release": (const("BPF_PROG_TYPE_CGROUP_SOCK"), const("BPF_CGROUP_INET_SOCK_RELEASE"), True),
    "rdr_sk_lookup": (const("BPF_PROG_TYPE_SK_LOOKUP"), const("BPF_SK_LOOKUP"), False),
    # The filters on the interfaces of pods that forward (``pod.tc``): no attach type of their own.
    "rdr_tc_ingress": (const("BPF_PROG_TYPE_SCHED_CLS"), -1, False),
    "rdr_tc_egress": (const("BPF_PROG_TYPE_SCHED_CLS"), -1, False),
    # Every send of a socket in ``pairs`` (sockmap: ``redirect/bpf/sockmap.c``), attached to that map.
    "rdr_sk_msg": (const("BPF_PROG_TYPE_SK_MSG"), const("BPF_SK_MSG_VERDICT"), False),
}
#: Programs attached to a map of ours at load (the map holds them; no link): program -> map.
MAP_ATTACHED = {"rdr_sk_msg": "pairs"}
#: The programs attached to the cgroup root, each with a link pinned at ``links/<name>``.
CGROUP_PROGRAMS = tuple(name for name, (_, _, cgroup) in PROGRAMS.items() if cgroup)

#: Map name -> (key size, value size), as ``redirect/bpf/redirect.h`` declares them (a pinned map of
#: other sizes comes from another build of the sources).
MAPS: dict[str, tuple[int, int]] = {
    "pods": (8, POLICY.size), "inventory": (INV_KEY.size, INV_VAL.size), "ports": (PORT_KEY.size, 1),
    "cidrs": (CIDR_KEY.size, 1), "orig_by_cookie": (8, ORIG.size), "orig_by_tuple": (TUPLE_KEY.size, ORIG.size),
    "dns_by_cookie": (8, ORIG.size), "listeners": (LISTENER_KEY.size, 8), "lookup_netns": (4, 8),
    "lookup_prog": (4, 4), "local_conns": (PAIR_KEY.size, 1), "lookup_slots": (4, POOL_SLOT.size),
    "lookup_free": (0, 4), "lookup_pool": (4, 4), "pairs": (PAIR_KEY.size, 4),
    "pair_state": (PAIR_KEY.size, PAIR_STATE.size), "pair_tcp": (4, 8),
}


def build_id() -> str:
    """A digest of ``redirect/bpf/`` (the sources and the headers they are compiled against): pinned as
    ``maps/build-<id>``, so pins of other sources count as missing. (Hashes the tree: the process keeps
    it, ``lifetime.Process.build_id``.)"""
    if missing := [n for n in SOURCES if not os.path.isfile(os.path.join(BPF_DIR, n))]:
        raise BackendUnavailable(f"ebpf: the BPF sources are missing from {BPF_DIR} ({', '.join(missing)}): reinstall")
    h = hashlib.sha256()
    names = sorted(os.path.relpath(os.path.join(d, n), BPF_DIR) for d, _, ns in os.walk(BPF_DIR) for n in ns)
    for n in names:
        if n.endswith((".c", ".h")):
            with open(os.path.join(BPF_DIR, n), "rb") as f:
                h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


def build_pin(build: str) -> str:
    """The pin (under ``maps/``) that says the host part was loaded from the sources of ``build``."""
    return f"build-{build}"


__all__ = ["BPF_DIR", "HEADERS_DIR", "HEADER_ARCHES", "SOURCES", "PROGRAMS", "CGROUP_PROGRAMS", "MAPS", "build_id",
           "build_pin"]
