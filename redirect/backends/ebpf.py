"""The eBPF backend: capture without netfilter.

Host part, done once per host (``HostPrograms.open_or_load``): ``bpf/*.c`` is
compiled through bcc, every program and map is pinned under a bpffs directory
(``/sys/fs/bpf/redirect``, or ``$REDIRECT_BPF_ROOT``), and the cgroup programs
(``connect4/6``, ``sendmsg4/6``, ``recvmsg4/6``, ``getpeername4/6``,
``getsockopt``, ``sock_ops``, ``sock_release``)
are attached to the cgroup v2 root (``/sys/fs/cgroup/unified``, or
``$REDIRECT_BPF_CGROUP``) with pinned ``bpf_link``\\ s. A later process finds
the pins and reuses them: nothing is compiled again. The host programs act
only on sockets whose netns cookie is a key of the ``pods`` map; for every
other socket on the host they are a no-op.

Per pod (``apply``, with the calling thread inside the pod netns, as
``redirect.api`` does it; for a pod with nothing of ours yet, ``setup_fresh``
does the same in one native call, ``native/pod_setup.c``, and backs off to
``apply`` before changing anything when the pod is not fresh): map entries keyed by the netns cookie (policy,
ports, CIDRs, the pod's own addresses as ``local`` CIDRs, the proxy's inbound listeners), an
``inventory`` of exactly those keys, one ``sk_lookup`` link on the pod netns
pinned at ``<root>/pods/<cookie>-sk_lookup`` (every pod has one: the kernel
detaches it when the netns dies, which is how ``collect_garbage`` finds pods
whose netns went without a teardown), and ``::6`` on lo (the plan's address for the proxy's
inbound passthrough). The link runs a program of the pod's own
(``native/redirect_native.c: rdr_ebpf_lookup_prog``) that holds the netns cookie, which an
sk_lookup program can't ask the kernel for, and tail-calls the shared ``rdr_sk_lookup``: nothing
is found by address, so pods sharing an IP never see each other's policy. ``remove`` deletes
exactly those, through the inventory: O(entries of that pod), never a walk of the host maps.
Per-socket state (original destinations) is removed with its socket (``sock_release``, TCP
close) and is inert once the pod's policy is gone. ``unload_host`` removes the host part and refuses while any pod is
registered. A partly pinned host (a pin removed by hand) is reported by ``check``
(``host_problems``: missing pins, cgroup links detached or running another program),
read and torn down through what is still attached (``recover_host``), and repaired (missing
cgroup links) or reloaded (no pod registered) by the next setup, else setup raises
``SetupError`` saying what is missing. Fault points for the atomicity
tests: ``ebpf.before_entries``, ``ebpf.before_policy``.

The policy comes from the same intent as the netfilter plan (``redirect.intent``):
``redirect.lower_ebpf`` lowers it to typed map entries, which ``_config_entries``
packs; the programs implement Istio's rule order over map lookups
(``bpf/policy.h: outbound_target``). ``redirect.evaluate`` models them, and a
property test (``tests/test_lowerings.py``) checks that they land every drawn
connection where the netfilter plan does.

Not available with this backend (``apply`` raises ``BackendUnavailable`` naming
the option): ``mode="ambient"``; ``inbound_interception="TPROXY"`` (its mark and
policy-route plumbing; inbound here keeps the original destination anyway);
``drop_invalid`` (needs conntrack); ``exclude_interfaces`` and
``reroute_interfaces`` (the socket hooks run before routing picks an output
interface); more than 8 entries in ``proxy_uids``, ``proxy_gids``,
``owner_groups`` or ``owner_groups_exclude`` (fixed-size policy entry).

The maps' keys and values are laid out once, in ``bpf/abi.h``: the programs and ``native/``
include it, and the struct formats here are derived from cffi's declarations of it
(``ebpf_abi``). Program and attach types are taken by the kernel's names.

How the iptables semantics are met without packets:

- "leaves over lo" (Istio's ``-o lo`` rules) is "the destination is loopback
  or one of the pod's own addresses" (those present at setup, plus ``::6``;
  ``check`` reports addresses added later). So, as with iptables, the app's
  connection to its own pod IP is not captured, and the proxy's (uid/gid 1337)
  goes to inbound capture (the service-VIP hairpin), except to the tunnel port;
- the app's ``getpeername`` names the original destination (TCP and connected
  UDP), as through NAT; its socket's *local* address is loopback, though
  (iptables: the pod address), so the proxy sees outbound connections come
  from ``127.0.0.1`` / ``::1``;
- owner matches use the calling task's uid and primary gid, like iptables'
  ``--uid-owner``/``--gid-owner`` without ``--suppl-groups``;
- inbound: the proxy's inbound listener is put in a sockhash when it starts
  listening (``sock_ops`` ``TCP_LISTEN_CB``, also after a proxy restart), or by
  ``apply`` if it already listens. Until one exists, new inbound connections
  to captured ports are dropped (fail closed; iptables answers them with a
  reset from the unused port).
  The proxy's inbound socket sees the original destination as its local
  address; ``getsockopt(SO_ORIGINAL_DST)`` on it answers the same;
- ``getsockopt(SO_ORIGINAL_DST)`` answers at the level conntrack would: ``SOL_IP`` for IPv4
  connections, also as a dual-stack socket's ``::ffff:a.b.c.d`` peer, ``SOL_IPV6`` for native IPv6
  ones, ENOENT at the other level; an app's IPv6 socket connecting to ``::ffff:a.b.c.d`` follows
  the IPv4 rules (it is IPv4 on the wire).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import ipaddress
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import netns as _netns
from ..config import IdSpec, RedirectConfig
from ..errors import BackendUnavailable, RedirectError, SetupError
from ..intent import intent_of
from ..lower_ebpf import lower_ebpf
from ..netns import NetnsRef
from ..plan import INBOUND_PASSTHROUGH_V6, LocalAddress, Plan
from . import EBPF_DEFAULT_ROOT
from .base import CheckResult, Installed, fault_point
from .ebpf_abi import const, layout

log = logging.getLogger("redirect.ebpf")

DEFAULT_ROOT = EBPF_DEFAULT_ROOT  # (defined with the backends: redirect.api looks for pins there too)
DEFAULT_CGROUP = "/sys/fs/cgroup/unified"
BPF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bpf")
#: Sources in compile order. bcc only rewrites map calls (``pods.lookup``) in
#: its main text, so the helper header is inlined there rather than #included.
SOURCES = ("policy.h", "sock_addr.c", "sockopt.c", "sk_lookup.c")

#: program name -> (prog type, attach type, attached to the cgroup root?), by the kernel's names
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
}
SK_LOOKUP_ATTACH = const("BPF_SK_LOOKUP")
MAPS = ("pods", "inventory", "ports", "cidrs", "orig_by_cookie", "orig_by_tuple", "dns_by_cookie",
        "listeners", "lookup_netns", "lookup_prog")

# The maps' keys and values, from bpf/abi.h (ebpf_abi): addresses and _be ports as raw bytes.
_POLICY = layout("pod_policy", raw=("lo4_addr", "lo4_mask"))
POLICY = _POLICY.struct
P_FLAGS, P_INV_BASE, P_N_INV = (_POLICY.index[f] for f in ("flags", "inv_base", "n_inv"))
PORT_KEY = layout("port_key").struct
CIDR_KEY = layout("cidr_key").struct
ORIG = layout("orig_dst", raw=("port_be",)).struct
TUPLE_KEY = layout("tuple_key", raw=("port_be",)).struct
LISTENER_KEY = layout("listener_key").struct
INV_KEY = layout("inv_key").struct
INV_VAL = layout("inv_val").struct
INV_CHUNK = const("RDR_INV_CHUNK")  # keys per inventory entry
INV_KEY_MAX = const("RDR_INV_KEY_MAX")  # room for one key in an entry
INV_PORTS, INV_CIDRS = const("RDR_INV_PORTS"), const("RDR_INV_CIDRS")
INV_MAPS = {INV_PORTS: "ports", INV_CIDRS: "cidrs"}
INV_KEY_SIZE = {INV_PORTS: PORT_KEY.size, INV_CIDRS: CIDR_KEY.size}
U64 = struct.Struct("=Q")
U32 = struct.Struct("=I")
U8 = struct.Struct("=B")

F_OUT_ALL, F_DNS, F_DNS_ALL, F_INCL_LOOPBACK, F_INBOUND, F_INBOUND_ALL, F_V6 = (
    const(f"RDR_F_{n}") for n in ("OUT_ALL", "DNS", "DNS_ALL", "INCL_LOOPBACK", "INBOUND", "INBOUND_ALL", "V6"))
PORT_OUT_EXCL, PORT_OUT_INCL, PORT_IN_INCL, PORT_IN_EXCL = (
    const(f"RDR_PORT_{n}") for n in ("OUT_EXCL", "OUT_INCL", "IN_INCL", "IN_EXCL"))
CIDR_OUT_EXCL4, CIDR_OUT_INCL4, CIDR_DNS4, CIDR_OUT_EXCL6, CIDR_OUT_INCL6, CIDR_DNS6 = (
    const(f"RDR_CIDR_{n}") for n in ("OUT_EXCL4", "OUT_INCL4", "DNS4", "OUT_EXCL6", "OUT_INCL6", "DNS6"))
CIDR_LOCAL4, CIDR_LOCAL6 = const("RDR_CIDR_LOCAL4"), const("RDR_CIDR_LOCAL6")
CIDR_PREFIX_BASE = const("RDR_CIDR_PREFIX_BASE")  # cidr_key.prefixlen = this + the CIDR's own
MAX_IDS = const("RDR_MAX_IDS")
GROUPS_ALL, GROUPS_ONLY, GROUPS_EXCLUDE = (const(f"RDR_GROUPS_{n}") for n in ("ALL", "ONLY", "EXCLUDE"))
AF = {4: socket.AF_INET, 6: socket.AF_INET6}


# --------------------------------------------------------------------------- syscalls


_NATIVE: Any = None


def _native() -> Any:
    global _NATIVE
    if _NATIVE is None:
        from .. import _native

        _NATIVE = _native
    return _NATIVE


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def obj_get(path: str) -> int:
    return _check(_native().lib.rdr_bpf_obj_get(path.encode()), f"BPF_OBJ_GET {path}")


def obj_pin(fd: int, path: str) -> None:
    _check(_native().lib.rdr_bpf_obj_pin(fd, path.encode()), f"BPF_OBJ_PIN {path}")


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    return _check(_native().lib.rdr_bpf_link_create(prog_fd, target_fd, attach_type, 0), "BPF_LINK_CREATE")


def prog_id(fd: int) -> int:
    n = _native()
    out = n.ffi.new("uint32_t *")
    _check(n.lib.rdr_bpf_prog_id(fd, out), "BPF_OBJ_GET_INFO_BY_FD")
    return int(out[0])


def link_info(fd: int) -> dict[str, int]:
    n = _native()
    lid, typ, pid, at = (n.ffi.new("uint32_t *") for _ in range(4))
    tgt = n.ffi.new("uint64_t *")
    _check(n.lib.rdr_bpf_link_info(fd, lid, typ, pid, at, tgt), "BPF_OBJ_GET_INFO_BY_FD")
    return {"id": int(lid[0]), "type": int(typ[0]), "prog_id": int(pid[0]), "attach_type": int(at[0]),
            "target": int(tgt[0])}


class Map:
    """A pinned map opened by fd; keys and values are bytes in the C layout."""

    def __init__(self, name: str, fd: int, key_size: int, value_size: int) -> None:
        self.name, self.fd, self.key_size, self.value_size = name, fd, key_size, value_size

    def update(self, key: bytes, value: bytes) -> None:
        _check(_native().lib.rdr_bpf_map_update(self.fd, key, value, 0), f"update {self.name}")

    def lookup(self, key: bytes) -> bytes | None:
        n = _native()
        buf = n.ffi.new("char[]", self.value_size)
        rc = n.lib.rdr_bpf_map_lookup(self.fd, key, buf)
        if rc == -errno.ENOENT:
            return None
        _check(rc, f"lookup {self.name}")
        return bytes(n.ffi.buffer(buf, self.value_size))

    def delete(self, key: bytes) -> bool:
        rc = _native().lib.rdr_bpf_map_delete(self.fd, key)
        if rc == -errno.ENOENT:
            return False
        _check(rc, f"delete {self.name}")
        return True

    def keys(self, limit: int = 1 << 20) -> Iterator[bytes]:
        n = _native()
        cur = n.ffi.NULL
        nxt = n.ffi.new("char[]", self.key_size)
        for _ in range(limit):
            rc = n.lib.rdr_bpf_map_next_key(self.fd, cur, nxt)
            if rc == -errno.ENOENT:
                return
            _check(rc, f"next key {self.name}")
            k = bytes(n.ffi.buffer(nxt, self.key_size))
            yield k
            cur = k


# --------------------------------------------------------------------------- host part


def _root(root: str | None) -> str:
    return root or os.environ.get("REDIRECT_BPF_ROOT") or DEFAULT_ROOT


def _cgroup(cgroup: str | None) -> str:
    return cgroup or os.environ.get("REDIRECT_BPF_CGROUP") or DEFAULT_CGROUP


def _is_bpffs(path: str) -> bool:
    # statfs is not in os; /proc/self/mountinfo tells the fs type of mount points.
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            mnt = parts[4]
            sep = parts.index("-")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[sep + 1]
    return fstype == "bpf"


def _ensure_bpffs(root: str) -> None:
    base = "/sys/fs/bpf"
    if root.startswith(base + "/") and not _is_bpffs(base):
        import subprocess

        r = subprocess.run(["mount", "-t", "bpf", "bpf", base], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BackendUnavailable(f"ebpf: bpffs is not mounted at {base} and mounting it failed: {r.stderr.strip()}")
    parent = os.path.dirname(root.rstrip("/"))
    if not _is_bpffs(parent if os.path.exists(parent) else base):
        raise BackendUnavailable(f"ebpf: pin root {root!r} is not on a bpffs mount")


def _lock_name(root: str) -> str:
    """The host lock's file in the run directory (``redirect.locks``)."""
    return "ebpf-" + re.sub(r"[^A-Za-z0-9]", "_", root) + ".lock"


@contextlib.contextmanager
def _host_lock(root: str) -> Iterator[None]:
    """One loader per host at a time (other processes too)."""
    from .. import locks

    fd = locks.open_private(_lock_name(root))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class HostPrograms:
    """The pinned programs, maps and cgroup links under one root, opened by fd."""

    def __init__(self, root: str, maps: dict[str, Map], progs: dict[str, int], loaded: bool, load_ms: float) -> None:
        self.root = root
        self.maps = maps
        self.progs = progs
        #: True if this process compiled the programs, False if it reused pins.
        self.compiled = loaded
        self.load_ms = load_ms
        self.pods_dir = os.path.join(root, "pods")  # where the pods' links are pinned (_pod_link)
        self.pods_dir_fd = -1  # pods_dir open, for the fresh-pod call (``_pods_dir_fd``)
        #: The root's inotify fd on the host pin dirs (``_watch_pins``; not ours to close), -1
        #: without one; ``ok``: every pin was there when ``host()`` last looked, and the pin dirs
        #: were all watched then.
        self.watch = -1
        self.ok = False
        #: 1 while this handle is in use, 0 while ``host()`` looks it over again (the native
        #: fresh-pod call reads it, see ``fresh_request``).
        self.alive = _native().ffi.new("int[1]", [1])
        #: ``fresh_request``'s structs (with the pin-dir buffer they point to), by template.
        self._fresh: dict[FreshPodTemplate, tuple[Any, ...]] = {}

    @property
    def pods(self) -> Map:
        return self.maps["pods"]

    def fresh_request(self, tmpl: FreshPodTemplate) -> Any:
        """The ``struct rdr_pod_req`` for ``tmpl`` on these maps: made once per template, shared by
        threads (the call never writes it). Kept with these fds: a reload makes a new object."""
        hit = self._fresh.get(tmpl)
        if hit is not None:
            return hit[0]
        from .. import routes as rt

        ffi = _native().ffi
        r = ffi.new("struct rdr_pod_req *")
        m = self.maps
        r.map_pods, r.map_inventory, r.map_ports = m["pods"].fd, m["inventory"].fd, m["ports"].fd
        r.map_cidrs = m["cidrs"].fd
        r.map_lookup_netns, r.map_lookup_prog = m["lookup_netns"].fd, m["lookup_prog"].fd
        r.alive = self.alive
        root, default_root = ffi.new("char[]", self.root.encode()), ffi.new("char[]", DEFAULT_ROOT.encode())
        r.root, r.default_root = root, default_root
        pin_dir = ffi.new("char[]", self.pods_dir.encode())
        r.pin_dir, r.pin_dir_fd = pin_dir, self._pods_dir_fd()
        r.ipv6, r.inbound_port = tmpl.ipv6, tmpl.inbound_port
        r.tcp_diag = _tcp_diag_ok()
        r.host_netns_ino = _netns.host_netns_inodes()
        r.addr_proto, r.addr_flags = rt.RT_PROTO, rt.IFA_F_NODAD
        for i, (policy, ports, n_ports, cidrs, n_cidrs, v6_lo) in enumerate(tmpl.sets):
            r.policy[i], r.ports[i], r.n_ports[i], r.cidrs[i], r.n_cidrs[i] = policy, ports, n_ports, cidrs, n_cidrs
            r.add_v6_lo[i] = v6_lo
        self._fresh[tmpl] = (r, pin_dir, root, default_root)  # with tmpl (a key), the buffers r points to
        return r

    def _pods_dir_fd(self) -> int:
        """``pods_dir`` open (``O_PATH``), kept with this object; -1 if it can't be opened."""
        if self.pods_dir_fd < 0:
            with contextlib.suppress(OSError):
                self.pods_dir_fd = os.open(self.pods_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self.pods_dir_fd

    def trusted(self) -> bool:
        """Nothing of the host pins changed since ``host()`` last found them all: one read."""
        return self.ok and self.watch >= 0 and _native().lib.rdr_watch_pending(self.watch) == 0

    def close(self) -> None:
        for m in self.maps.values():
            with contextlib.suppress(OSError):
                os.close(m.fd)
        for fd in [*self.progs.values(), self.pods_dir_fd]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.maps, self.progs, self.pods_dir_fd, self.ok = {}, {}, -1, False

    @staticmethod
    def pinned(root: str) -> bool:
        return all(os.path.exists(os.path.join(root, "maps", m)) for m in MAPS) and all(
            os.path.exists(os.path.join(root, "progs", p)) for p in PROGRAMS
        )

    @classmethod
    def open_pinned(cls, root: str, compiled: bool = False, load_ms: float = 0.0) -> HostPrograms:
        from .. import _native  # noqa: F401  (fail early with an ImportError that names it)

        maps: dict[str, Map] = {}
        progs: dict[str, int] = {}
        sizes = _map_sizes()
        try:
            for m in MAPS:
                fd = obj_get(os.path.join(root, "maps", m))
                maps[m] = Map(m, fd, *sizes[m])
                have = _map_fdinfo(fd)
                if (have.get("key_size"), have.get("value_size")) != sizes[m]:
                    raise SetupError(
                        f"ebpf: pinned map {root}/maps/{m} has key/value size {have.get('key_size')}/"
                        f"{have.get('value_size')}, this build needs {sizes[m][0]}/{sizes[m][1]}: the pins come from"
                        f" another version of bpf/; tear its pods down with that version, or"
                        f" unload_host({root!r}, force=True)"
                    )
            for p in PROGRAMS:
                progs[p] = obj_get(os.path.join(root, "progs", p))
        except (OSError, SetupError):
            for mm in maps.values():
                os.close(mm.fd)
            for fd in progs.values():
                os.close(fd)
            raise
        return cls(root, maps, progs, compiled, load_ms)

    @classmethod
    def open_or_load(cls, root: str | None = None, cgroup: str | None = None) -> HostPrograms:
        """Reuse the pinned host programs, or compile, load, pin and attach them once.

        Partly pinned (someone removed a pin, an earlier load died): missing cgroup
        links are re-created from the pinned programs; missing maps or programs mean
        a clean reload when no pod is registered, else ``SetupError`` (a reload would
        drop the registered pods' capture).
        """
        root = _root(root)
        cg = _cgroup(cgroup)
        _ensure_bpffs(root)
        with _host_lock(root):
            missing = missing_pins(root)
            if not missing:
                return cls.open_pinned(root)
            objs = [m for m in missing if not m.startswith("links/")]
            if not objs:
                _repair_links(root, cg, [m.split("/", 1)[1] for m in missing])
                log.warning("ebpf: re-created missing cgroup links under %s: %s", root, ", ".join(missing))
                return cls.open_pinned(root)
            if len(objs) < len(MAPS) + 1 + len(PROGRAMS):  # some pins are there: is anyone using them?
                pods = _pods_in(root)
                if pods is None or pods:
                    who = (f"{pods} pod(s) are registered" if pods else
                           "pods may be registered (no pods map pin, but the programs are still attached)")
                    raise SetupError(
                        f"ebpf: the host programs under {root} are incomplete (missing: {', '.join(missing)}) while"
                        f" {who}; reloading would drop their capture. Tear those pods down"
                        f" (or unload_host({root!r}, force=True)) and set up again"
                    )
                log.warning("ebpf: host pins under %s incomplete (missing: %s); reloading", root, ", ".join(missing))
            t0 = time.perf_counter()
            _load_and_pin(root, cg)
            ms = (time.perf_counter() - t0) * 1e3
            log.info("ebpf: compiled and pinned host programs under %s in %.0f ms", root, ms)
            return cls.open_pinned(root, compiled=True, load_ms=ms)


def _cgroup_progs() -> list[str]:
    return [p for p, (_, _, cg) in PROGRAMS.items() if cg]


@functools.lru_cache(maxsize=1)
def build_id() -> str:
    """A digest of ``bpf/``: pinned as ``maps/build-<id>``, so pins of other sources count as missing."""
    import hashlib

    h = hashlib.sha256()
    for n in sorted(os.listdir(BPF_DIR)):
        if n.endswith((".c", ".h")):
            with open(os.path.join(BPF_DIR, n), "rb") as f:
                h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


def _build_pin() -> str:
    return f"build-{build_id()}"


def missing_pins(root: str) -> list[str]:
    """The host pins (``maps/x``, ``progs/x``, ``links/x``) not present under ``root``.

    ``maps/build-<id>`` stands for "pinned from these sources": after an upgrade of ``bpf/``
    it is missing, so the old programs are replaced (or, with pods registered, setup says so).
    """
    out: list[str] = []
    for d, names in (("maps", (*MAPS, _build_pin())), ("progs", tuple(PROGRAMS)), ("links", tuple(_cgroup_progs()))):
        try:
            have = set(os.listdir(os.path.join(root, d)))
        except FileNotFoundError:
            have = set()
        out += [f"{d}/{n}" for n in names if n not in have]
    return out


def _pods_in(root: str) -> int | None:
    """How many pods are registered under ``root``; ``None`` if that can't be told.

    Without the ``pods`` pin: the map the attached programs still use (``recover_host``), else the
    per-pod link pins; unknown while cgroup links are pinned (they may serve outbound-only pods).
    """
    try:
        fd = obj_get(os.path.join(root, "maps", "pods"))
    except OSError:
        r = recover_host(root)
        if r is not None:
            try:
                return sum(1 for _ in r.pods.keys())
            finally:
                r.close()
        try:
            pod_links = os.listdir(os.path.join(root, "pods"))
        except FileNotFoundError:
            pod_links = []
        if pod_links:
            return len(pod_links)
        try:
            return None if os.listdir(os.path.join(root, "links")) else 0
        except FileNotFoundError:
            return 0
    try:
        return sum(1 for _ in Map("pods", fd, 8, POLICY.size).keys())
    finally:
        os.close(fd)


def _repair_links(root: str, cgroup: str, names: list[str]) -> None:
    cgfd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in names:
            pfd = obj_get(os.path.join(root, "progs", name))
            try:
                lfd = link_create(pfd, cgfd, PROGRAMS[name][1])
            finally:
                os.close(pfd)
            try:
                obj_pin(lfd, os.path.join(root, "links", name))
            finally:
                os.close(lfd)
    finally:
        os.close(cgfd)


def _map_fdinfo(fd: int) -> dict[str, int]:
    """key_size, value_size, ... of a map fd, from /proc/self/fdinfo (no BPF_OBJ_GET_INFO needed)."""
    out: dict[str, int] = {}
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
        for line in f:
            k, _, v = line.partition(":")
            v = v.strip()
            if v.isdigit():
                out[k.strip()] = int(v)
    return out


def _map_sizes() -> dict[str, tuple[int, int]]:
    return {
        "pods": (8, POLICY.size), "inventory": (INV_KEY.size, INV_VAL.size), "ports": (PORT_KEY.size, 1),
        "cidrs": (CIDR_KEY.size, 1),
        "orig_by_cookie": (8, ORIG.size), "orig_by_tuple": (TUPLE_KEY.size, ORIG.size),
        "dns_by_cookie": (8, ORIG.size), "listeners": (LISTENER_KEY.size, 8), "lookup_netns": (4, 8),
        "lookup_prog": (4, 4),
    }


def probe_kernel() -> None:
    """What the backend needs from this host; ``BackendUnavailable`` names what is missing."""
    rel = os.uname().release
    m = re.match(r"(\d+)\.(\d+)", rel)
    if m and (int(m.group(1)), int(m.group(2))) < (5, 17):
        raise BackendUnavailable(
            f"ebpf: kernel {rel} is too old: needs 5.17+ (sk_lookup ingress_ifindex, netns cookies in sock_ops)"
        )
    build = f"/lib/modules/{rel}/build/include"
    if not os.path.exists(build):
        raise BackendUnavailable(f"ebpf: no kernel headers at {build} for bcc: run scripts/bootstrap.sh")
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"ebpf: bcc's Python module is missing ({e}): install python3-bpfcc") from None


def _load_and_pin(root: str, cgroup: str) -> None:
    probe_kernel()
    from bcc import BPF

    if not os.path.isdir(cgroup) or not os.path.exists(os.path.join(cgroup, "cgroup.procs")):
        raise BackendUnavailable(f"ebpf: cgroup v2 not mounted at {cgroup} (set REDIRECT_BPF_CGROUP)")
    text = "".join(open(os.path.join(BPF_DIR, n), encoding="utf-8").read() for n in SOURCES)
    text += "\n/* which sources these pins came from (see build_id) */\nBPF_ARRAY(build_id, __u32, 1);\n"
    try:
        b = BPF(text=text.encode(), cflags=[f"-I{BPF_DIR}", "-Wno-unused-function"])
    except Exception as e:
        raise BackendUnavailable(f"ebpf: compiling bpf/ with bcc failed: {e}") from None
    fns: dict[str, Any] = {}
    try:
        for name, (ptype, atype, _cg) in PROGRAMS.items():
            try:
                fns[name] = b.load_func(name.encode(), ptype, attach_type=atype)
            except Exception as e:
                raise BackendUnavailable(f"ebpf: the kernel refused program {name}: {e}") from None
        # Clear leftovers of a half-done earlier load (ours only: this root).
        _unpin_all(root)
        for d in ("maps", "progs", "links", "pods"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        from bcc import libbcc

        for m in MAPS:
            # By fd, not b[m]: bcc's Table class has no type for sockhash.
            fd = libbcc.lib.bpf_table_fd(b.module, m.encode())
            if fd < 0:
                raise BackendUnavailable(f"ebpf: map {m} missing from the compiled object")
            obj_pin(fd, os.path.join(root, "maps", m))
        fd = libbcc.lib.bpf_table_fd(b.module, b"build_id")
        if fd < 0:
            raise BackendUnavailable("ebpf: map build_id missing from the compiled object")
        obj_pin(fd, os.path.join(root, "maps", _build_pin()))
        for name, fn in fns.items():
            obj_pin(fn.fd, os.path.join(root, "progs", name))
        # The pods' sk_lookup programs tail-call this one (bpf/redirect.h, lookup_netns).
        _check(_native().lib.rdr_bpf_map_update(libbcc.lib.bpf_table_fd(b.module, b"lookup_prog"), U32.pack(0),
                                                U32.pack(fns["rdr_sk_lookup"].fd), 0), "update lookup_prog")
        cgfd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name, (_pt, atype, cg) in PROGRAMS.items():
                if not cg:
                    continue
                try:
                    lfd = link_create(fns[name].fd, cgfd, atype)
                except OSError as e:
                    raise BackendUnavailable(f"ebpf: attaching {name} to cgroup {cgroup} failed: {e}") from None
                try:
                    obj_pin(lfd, os.path.join(root, "links", name))
                finally:
                    os.close(lfd)
        finally:
            os.close(cgfd)
    except BaseException:
        _unpin_all(root)
        raise
    finally:
        b.cleanup()


def _unpin_all(root: str) -> None:
    """Unpin everything under ``root`` (links first: unpinning the last ref detaches)."""
    for d in ("links", "pods", "progs", "maps"):
        p = os.path.join(root, d)
        if os.path.isdir(p):
            for n in os.listdir(p):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(p, n))
            with contextlib.suppress(OSError):
                os.rmdir(p)
    with contextlib.suppress(OSError):
        os.rmdir(root)


_host_cache: dict[str, HostPrograms] = {}
_host_cache_lock = threading.Lock()


def host(root: str | None = None, cgroup: str | None = None, load: bool = True) -> HostPrograms | None:
    """This process's handle on the host programs (``None`` if not loaded and ``load`` is False)."""
    r = _root(root)
    with _host_cache_lock:
        h = _host_cache.get(r)
        if h is not None and h.trusted():
            return h  # no pin was added or removed since we found them all (inotify)
        if h is not None:
            h.alive[0] = 0  # native calls of other threads back off until the look below is done
        # Watched (and drained) before looking: a change from here on shows on the next call.
        watch, watched = _watch_pins(r)
        missing = missing_pins(r)
        if h is not None and not missing and _still_pinned(h):
            h.watch, h.ok = watch, watched
            h.alive[0] = 1
            return h
        if h is not None:  # pins gone, or others in their place (another process reloaded)
            h.close()
            del _host_cache[r]
        if not load:
            # Reading (check, show, teardown) works on whatever maps and programs are pinned.
            if any(m.startswith(("maps/", "progs/")) and not m.startswith("maps/build-") for m in missing):
                return None
            h = HostPrograms.open_pinned(r)
            h.watch, h.ok = watch, watched and not missing
        else:
            h = HostPrograms.open_or_load(r, cgroup)
            watch, watched = _watch_pins(r)  # the load may have made the dirs; its pins are events
            h.watch = watch
            h.ok = watched and not missing_pins(r)
        _host_cache[r] = h
        return h


def _still_pinned(h: HostPrograms) -> bool:
    """``h``'s maps are the pinned ones (its pods map is: a load makes every map anew)."""
    try:
        fd = obj_get(os.path.join(h.root, "maps", "pods"))
    except OSError:
        return False
    try:
        return _map_fdinfo(fd).get("map_id", -1) == _map_fdinfo(h.pods.fd).get("map_id", -2)
    finally:
        os.close(fd)


def force_unload_host(root: str | None = None) -> bool:
    """``unload_host(root, force=True)``: for cleanup after failures."""
    return unload_host(root, force=True)


#: Per root, one inotify fd on its maps, progs and links dirs (a pin added or removed there, or a
#: dir going, is an event): ``host()`` trusts its handle while the fd has no events. Kept until
#: ``unload_host`` (an fd closed under a thread that reads it could be another file by then).
_watches: dict[str, int] = {}


def _watch_pins(root: str) -> tuple[int, bool]:
    """``root``'s watch fd (-1: none) and whether every pin dir is watched now (dirs made again
    since need their watch again); with no watch, ``host()`` lists the pins on every call."""
    lib, ffi = _native().lib, _native().ffi
    fd = _watches.get(root, -1)
    if fd < 0:
        fd = int(lib.rdr_watch_new())
        if fd < 0:
            log.debug("ebpf: no inotify watch on %s (%s): pins are listed on every use", root, os.strerror(-fd))
            return -1, False
        _watches[root] = fd
    dirs = [ffi.new("char[]", os.path.join(root, d).encode()) for d in ("maps", "progs", "links")]
    watched = lib.rdr_watch_add(fd, ffi.new("const char *[]", dirs), len(dirs)) == 0
    lib.rdr_watch_changed(fd)  # what happened before now, the caller's look at the pins covers
    return fd, watched


def _fd_by_id(kind: str, ident: int) -> int | None:
    lib = _native().lib
    fd = int(lib.rdr_bpf_prog_get_fd_by_id(ident) if kind == "prog" else lib.rdr_bpf_map_get_fd_by_id(ident))
    return fd if fd >= 0 else None


def _link_prog_fd(path: str) -> int | None:
    """A new fd of the program of the link pinned at ``path``, None if there is none."""
    info = _pinned_link_info(path)
    return None if info is None else _fd_by_id("prog", info["prog_id"])


def recover_host(root: str) -> HostPrograms | None:
    """A handle on the host objects under ``root`` when pins of maps or programs are gone (removed by
    hand, a half-done unload): what is still attached keeps its programs, and they keep their maps.
    Programs come from their pins or from the pinned links (the cgroup links and the pods' sk_lookup
    links: those reach ``rdr_sk_lookup`` through ``lookup_prog``), maps from their pins or by name from
    those programs. ``inventory`` is used by no program: without its pin it is gone, and a pod's entries
    are then found by a walk of the maps. None if no ``pods`` map can be found (nothing of ours can
    capture). Not cached: the caller closes it."""
    lib, ffi = _native().lib, _native().ffi
    progs: dict[str, int] = {}
    seeds: list[int] = []
    maps: dict[str, Map] = {}
    sizes = _map_sizes()

    def add_map(name: str, fd: int) -> bool:
        if name in maps or name not in sizes:
            return False
        have = _map_fdinfo(fd)
        if (have.get("key_size"), have.get("value_size")) != sizes[name]:
            return False
        maps[name] = Map(name, fd, *sizes[name])
        return True

    try:
        for name in PROGRAMS:
            with contextlib.suppress(OSError):
                progs[name] = obj_get(os.path.join(root, "progs", name))
        for name in _cgroup_progs():
            if name not in progs:
                fd = _link_prog_fd(os.path.join(root, "links", name))
                if fd is not None:
                    progs[name] = fd
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(os.path.join(root, "pods")):
                fd = _link_prog_fd(os.path.join(root, "pods", n))
                if fd is not None:
                    seeds.append(fd)
        for name in MAPS:
            with contextlib.suppress(OSError):
                fd = obj_get(os.path.join(root, "maps", name))
                if not add_map(name, fd):
                    os.close(fd)
        todo = [*progs.values(), *seeds]
        seen: set[int] = set()
        while todo:
            pfd = todo.pop()
            ids = ffi.new("uint32_t[]", 32)
            count = int(lib.rdr_bpf_prog_map_ids(pfd, ids, 32))
            for i in range(max(count, 0)):
                if ids[i] in seen:
                    continue
                seen.add(ids[i])
                mfd = _fd_by_id("map", ids[i])
                if mfd is None:
                    continue
                buf = ffi.new("char[16]")
                name = ffi.string(buf).decode() if lib.rdr_bpf_map_name(mfd, buf) == 0 else ""
                if not add_map(name, mfd):
                    os.close(mfd)
                    continue
                if name == "lookup_prog" and "rdr_sk_lookup" not in progs:
                    v = maps[name].lookup(U32.pack(0))  # a program array answers with the program's id
                    main = None if v is None else _fd_by_id("prog", U32.unpack(v)[0])
                    if main is not None:
                        progs["rdr_sk_lookup"] = main
                        todo.append(main)
    finally:
        for fd in seeds:
            os.close(fd)
    if "pods" not in maps:
        for m in maps.values():
            os.close(m.fd)
        for fd in progs.values():
            os.close(fd)
        return None
    return HostPrograms(root, maps, progs, False, 0.0)


@contextlib.contextmanager
def reading_host(root: str) -> Iterator[HostPrograms | None]:
    """``host(root, load=False)``, or while pins are gone ``recover_host(root)`` (closed on exit):
    what reading and removing a pod work on, so a missing pin never hides a pod still captured."""
    h = host(root, load=False)
    if h is not None:
        yield h
        return
    r = recover_host(root)
    if r is not None:
        log.warning("ebpf: host pins under %s are incomplete (missing: %s); using the objects still attached",
                    root, ", ".join(missing_pins(root)))
    try:
        yield r
    finally:
        if r is not None:
            r.close()


def host_problems(root: str, cgroup: str, h: HostPrograms | None) -> list[str]:
    """What is wrong with the host part every pod depends on: pins missing, cgroup links detached,
    attached elsewhere or running another program, ``lookup_prog`` not holding ``rdr_sk_lookup``."""
    out: list[str] = []
    for m in missing_pins(root):
        if m.startswith("maps/build-"):
            out.append(f"host pin {root}/{m} is missing: the pinned programs come from another build of bpf/")
        elif m.startswith("links/"):
            out.append(f"host link {root}/{m} is missing: {m[6:]} is not attached (its capture is off)")
        else:
            out.append(f"host pin {root}/{m} is missing")
    try:
        cg = os.stat(cgroup).st_ino  # a cgroup v2 directory's inode number is its cgroup id
    except OSError:
        cg = 0
        out.append(f"cgroup {cgroup} is not there")
    for name in _cgroup_progs():
        path = os.path.join(root, "links", name)
        info = _pinned_link_info(path)
        if info is None:
            if os.path.exists(path):
                out.append(f"host link {path} can't be read as a link")
            continue  # else reported above
        if info["target"] == 0:
            out.append(f"host link {path} is detached (its capture is off)")
        elif cg and info["target"] != cg:
            out.append(f"host link {path} is attached to another cgroup than {cgroup}")
        elif h is not None and name in h.progs and info["prog_id"] != prog_id(h.progs[name]):
            out.append(f"host link {path} runs another program than {root}/progs/{name}")
    if h is not None and "lookup_prog" in h.maps and "rdr_sk_lookup" in h.progs:
        v = h.maps["lookup_prog"].lookup(U32.pack(0))
        if v is None or U32.unpack(v)[0] != prog_id(h.progs["rdr_sk_lookup"]):
            out.append(f"{root}/maps/lookup_prog does not hold rdr_sk_lookup (inbound capture is off)")
    return out


def registered_pods(root: str | None = None) -> list[int]:
    h = host(root, load=False)
    return [] if h is None else [U64.unpack(k)[0] for k in h.pods.keys()]


def unload_host(root: str | None = None, force: bool = False) -> bool:
    """Remove the host programs, maps and cgroup links. Refuses while pods are registered.

    ``force=True`` removes them anyway (the registered pods lose capture at once).
    True if anything was removed.
    """
    r = _root(root)
    with _host_lock(r):
        if not force:
            collect_garbage(r)
        pods = [] if force else registered_pods(r)
        if pods:
            raise SetupError(
                f"ebpf: {len(pods)} pod(s) still registered under {r} (netns cookies {pods[:5]}): tear them down first"
            )
        if not force and os.path.isdir(r) and host(r, load=False) is None:
            n = _pods_in(r)  # some pins are missing: count what can be counted
            if n is None or n:
                raise SetupError(
                    f"ebpf: host pins under {r} are incomplete (missing: {', '.join(missing_pins(r))}) and pods may"
                    f" still be registered; tear them down, or unload_host({r!r}, force=True)"
                )
        with _host_cache_lock:
            h = _host_cache.pop(r, None)
            if h is not None:
                h.close()
            watch = _watches.pop(r, -1)  # unloading under threads still setting pods up is theirs to avoid
            if watch >= 0:
                os.close(watch)
        existed = os.path.exists(r)
        _unpin_all(r)
        if r != DEFAULT_ROOT:  # a scratch root (tests): leave no lock file behind either
            from .. import locks

            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(locks.run_dir_path(), _lock_name(r)))
        return existed


# --------------------------------------------------------------------------- per pod


def current_netns_cookie() -> int:
    n = _native()
    out = n.ffi.new("uint64_t *")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        _check(n.lib.rdr_sock_netns_cookie(s.fileno(), out), "SO_NETNS_COOKIE")
    return int(out[0])


def _unsupported(cfg: RedirectConfig) -> None:
    def no(option: str, why: str) -> None:
        raise BackendUnavailable(f"backend=ebpf: {option} is not available with eBPF ({why}); use backend=iptables")

    if cfg.mode != "sidecar":
        no(f"mode={cfg.mode!r}", "only sidecar mode is implemented for now")
    if cfg.inbound_interception == "TPROXY":
        no("inbound_interception='TPROXY'", "mark and policy-route plumbing; inbound keeps the original dst anyway")
    if cfg.drop_invalid:
        no("drop_invalid=True", "needs conntrack")
    if cfg.exclude_interfaces:
        no(f"exclude_interfaces={cfg.exclude_interfaces!r}", "socket hooks run before routing picks an interface")
    if cfg.reroute_interfaces:
        no(f"reroute_interfaces={cfg.reroute_interfaces!r}", "needs a packet-level hook")
    if cfg.dns_effective and cfg.proxy_gids and not cfg.gid_hairpin_skips_dns:
        no("gid_hairpin_skips_dns=False", "the programs leave port 53 alone for proxy uids and gids alike")
    for name in ("proxy_uids", "proxy_gids", "owner_groups", "owner_groups_exclude"):
        if getattr(cfg, name) != "*" and len(getattr(cfg, name)) > MAX_IDS:
            no(f"{name} with more than {MAX_IDS} entries", "fixed-size policy entry")


def _ranges(ids: tuple[IdSpec, ...]) -> list[int]:
    out: list[int] = []
    for i in ids:
        lo, hi = (i, i) if isinstance(i, int) else i
        out += [lo, hi]
    return out + [0] * (2 * MAX_IDS - len(out))


def _addr16(ip: str) -> bytes:
    return ipaddress.ip_address(ip).packed.ljust(16, b"\0")


@dataclass(frozen=True)
class PodEntries:
    """Everything one pod has in the maps (listeners, the inventory and the link aside).

    ``policy`` has its inventory fields zeroed (``apply`` fills them in).
    """

    policy: bytes
    ports: frozenset[bytes]
    cidrs: frozenset[bytes]

    @property
    def inbound(self) -> bool:
        return bool(POLICY.unpack(self.policy)[P_FLAGS] & F_INBOUND)

    def by_map(self) -> dict[int, frozenset[bytes]]:
        return {INV_PORTS: self.ports, INV_CIDRS: self.cidrs}


def _policy_core(policy: bytes) -> bytes:
    """The policy without its inventory bookkeeping: what a config decides."""
    v = list(POLICY.unpack(policy))
    v[P_INV_BASE] = v[P_N_INV] = 0
    return POLICY.pack(*v)


def _with_inventory(policy: bytes, base: int, n: int) -> bytes:
    v = list(POLICY.unpack(policy))
    v[P_INV_BASE], v[P_N_INV] = base, n
    return POLICY.pack(*v)


@functools.lru_cache(maxsize=256)
def _config_entries(cfg: RedirectConfig, families: tuple[int, ...]) -> tuple[bytes, tuple[tuple[int, int], ...],
                                                                             tuple[tuple[int, int, bytes], ...]]:
    """What ``cfg`` writes, whatever the pod: the policy, (kind, port)s and (prefix, kind, addr)s.

    The eBPF lowering of the config's intent (``redirect.lower_ebpf``), packed. Cached (configs
    are frozen): many pods share a config, and lowering is ~20 us of ``ipaddress``.
    """
    e = lower_ebpf(intent_of(cfg), families)
    p = e.policy
    flags = sum(bit for on, bit in ((p.out_all, F_OUT_ALL), (p.dns, F_DNS), (p.dns_all, F_DNS_ALL),
                                     (p.incl_loopback, F_INCL_LOOPBACK), (p.inbound, F_INBOUND),
                                     (p.inbound_all, F_INBOUND_ALL), (p.v6, F_V6)) if on)
    lo = ipaddress.ip_network(p.loopback4)
    groups_mode = {"all": GROUPS_ALL, "only": GROUPS_ONLY, "exclude": GROUPS_EXCLUDE}[p.groups_mode]
    policy = POLICY.pack(
        p.proxy_port, p.inbound_port, p.tunnel_port, p.dns_port, flags,
        lo.network_address.packed, lo.netmask.packed, len(p.uids), len(p.gids), 0, 0,
        *_ranges(p.uids), *_ranges(p.gids), groups_mode, len(p.groups), *_ranges(p.groups),
    )
    port_kind = {"out_exclude": PORT_OUT_EXCL, "out_include": PORT_OUT_INCL, "in_include": PORT_IN_INCL,
                 "in_exclude": PORT_IN_EXCL}
    cidr_kind = {"out_exclude4": CIDR_OUT_EXCL4, "out_include4": CIDR_OUT_INCL4, "dns4": CIDR_DNS4,
                 "out_exclude6": CIDR_OUT_EXCL6, "out_include6": CIDR_OUT_INCL6, "dns6": CIDR_DNS6,
                 "local4": CIDR_LOCAL4, "local6": CIDR_LOCAL6}
    # (::6 on lo, which the plan adds for the proxy's passthrough to a pod with IPv6 of its own, is
    # one of the pod's addresses once there: pod_entries has it from the scan, or from apply.)
    return (policy, tuple(sorted((port_kind[k], port) for k, port in e.ports)),
            tuple(sorted((CIDR_PREFIX_BASE + plen, cidr_kind[k], raw) for plen, k, raw in e.cidrs)))


def pod_entries(cfg: RedirectConfig, families: tuple[int, ...], cookie: int,
                local: tuple[tuple[int, str, int], ...] | list[tuple[int, str, int]] | None = None) -> PodEntries:
    """The map entries for ``cfg`` in the netns ``cookie`` whose own addresses are ``local``.

    ``local`` is (family, address, ifindex), as ``NetnsScan.local`` gives it.
    """
    policy, port_specs, cidr_specs = _config_entries(cfg, families)
    ports = frozenset(PORT_KEY.pack(cookie, kind, p, 0) for kind, p in port_specs)
    cidrs = {CIDR_KEY.pack(plen, kind, cookie, raw) for plen, kind, raw in cidr_specs}
    # The pod's own addresses: a connect to them leaves over lo (Istio's "-o lo" rules).
    for f, ip, _dev in local or ():
        if f in families:
            raw = socket.inet_pton(AF[f], ip).ljust(16, b"\0")
            cidrs.add(CIDR_KEY.pack(CIDR_PREFIX_BASE + (32 if f == 4 else 128), CIDR_LOCAL4 if f == 4 else CIDR_LOCAL6,
                                    cookie, raw))
    return PodEntries(policy, ports, frozenset(cidrs))


@functools.lru_cache(maxsize=1)
def _tcp_diag_ok() -> bool:
    """Whether sock_diag answers for TCP here (the fresh-pod call then looks the proxy's listener
    up that way instead of probing the port with a bind)."""
    return bool(_native().lib.rdr_tcp_diag_ok())


class FreshPodTemplate:
    """What ``cfg`` writes for any fresh pod, laid out for ``rdr_ebpf_pod_add`` (native/pod_setup.c):
    per family set ((4,) and (4, 6)), the policy and the port and CIDR keys with a zero netns
    cookie. Built once per config; the cffi buffers live as long as this object."""

    def __init__(self, cfg: RedirectConfig, plan: Plan) -> None:
        ffi = _native().ffi
        self.ipv6 = -1 if cfg.ipv6 is None else int(bool(cfg.ipv6))
        self.inbound_port = 0
        self.sets: list[tuple[Any, Any, int, Any, int, bool]] = []
        for families in ((4,), (4, 6)):
            policy, port_specs, cidr_specs = _config_entries(cfg, families)
            if POLICY.unpack(policy)[P_FLAGS] & F_INBOUND:
                self.inbound_port = cfg.inbound_port
            ports = b"".join(PORT_KEY.pack(0, kind, p, 0) for kind, p in port_specs)
            cidrs = b"".join(CIDR_KEY.pack(plen, kind, 0, raw) for plen, kind, raw in cidr_specs)
            bufs = [ffi.new(t, max(n, 1)) for t, n in (("struct pod_policy[]", 1), ("struct port_key[]",
                                                       len(port_specs)), ("struct cidr_key[]", len(cidr_specs)))]
            for buf, b in zip(bufs, (policy, ports, cidrs), strict=True):
                ffi.memmove(buf, b, len(b))
            v6_lo = any(a.family == 6 and a.dev == "lo" for a in _plan_addresses(plan, families, True))
            self.sets.append((bufs[0], bufs[1], len(port_specs), bufs[2], len(cidr_specs), v6_lo))


@functools.lru_cache(maxsize=64)
def fresh_pod_template(cfg: RedirectConfig) -> FreshPodTemplate | None:
    """The template for ``cfg`` (cached), or None when its pods need the general path (the plan
    adds an address other than ``::6`` on lo). Raises ``BackendUnavailable`` as ``apply`` would."""
    from ..plan import build_plan

    _unsupported(cfg)
    plan = build_plan(cfg)
    if any(not (a.family == 6 and a.dev == "lo" and a.cidr == INBOUND_PASSTHROUGH_V6) for a in plan.addresses):
        return None
    return FreshPodTemplate(cfg, plan)




_V6_LOOPBACK = bytes(15) + b"\1"
LOOPBACK_IFINDEX = 1  # lo's index in every netns
#: ``::6`` on lo as ``NetnsScan.local`` lists it.
_V6_ON_LO = (6, INBOUND_PASSTHROUGH_V6.split("/")[0], LOOPBACK_IFINDEX)


@dataclass(frozen=True)
class NetnsScan:
    """What one netlink socket tells of the calling thread's netns: all a pod's setup needs to know
    of it (its cookie, its addresses, whether IPv6 is on), in one address dump."""

    inode: int
    thread: int
    cookie: int
    #: (family, address, ifindex) of its addresses, loopback and IPv6 link-local aside.
    local: tuple[tuple[int, str, int], ...]
    #: IPv6 is on: it has an IPv6 address (``::1`` at least; disable_ipv6 removes them all).
    v6_on: bool
    #: It has an IPv6 address of its own (``routes.own_ipv6``): the plan's ``::6`` is wanted.
    own_v6: bool


def scan_netns() -> NetnsScan:
    """``NetnsScan`` of the calling thread's netns: ~20 us, where the cookie socket, the IPv6
    sysctl and the address listings it replaces cost ~70 us in a fresh netns (first /proc reads)."""
    from .. import rtnl
    from ..routes import own_ipv6

    out: list[tuple[int, str, int]] = []
    v6_on = own_v6 = False
    with rtnl.open_socket() as s:
        c = _native().ffi.new("uint64_t *")
        _check(_native().lib.rdr_sock_netns_cookie(s.fileno(), c), "SO_NETNS_COOKIE")
        msgs = rtnl.dump(rtnl.RTM_GETADDR, socket.AF_UNSPEC, sock=s)
    for m in msgs:
        raw = m.attrs.get(rtnl.IFA_LOCAL) or m.attrs.get(rtnl.IFA_ADDRESS)
        if raw is None:
            continue
        index = m.fields[3]  # ifaddrmsg: prefixlen flags scope index
        if m.family == socket.AF_INET and len(raw) == 4:
            if raw[0] != 127:
                out.append((4, socket.inet_ntoa(raw), index))
        elif m.family == socket.AF_INET6 and len(raw) == 16:
            v6_on = True
            if raw != _V6_LOOPBACK and not (raw[0] == 0xFE and raw[1] & 0xC0 == 0x80):
                out.append((6, socket.inet_ntop(socket.AF_INET6, raw), index))
                own_v6 = own_v6 or own_ipv6(raw)
    return NetnsScan(_netns.current_inode(), threading.get_ident(), int(c[0]), tuple(out), v6_on, own_v6)


def _unserved(h: HostPrograms, cookie: int, families: tuple[int, ...]) -> tuple[int, ...]:
    """The families without a registered inbound listener (a dual-stack IPv6 one serves IPv4 too)."""
    have = {f for f in (4, 6) if h.maps["listeners"].lookup(LISTENER_KEY.pack(cookie, AF[f], 0)) is not None}
    return tuple(f for f in families if f not in have and not (f == 4 and 6 in have))


def _port_bound(port: int, families: tuple[int, ...]) -> bool:
    """Whether any socket of this netns holds TCP ``port`` (a cheap superset of "someone listens
    on it": a wildcard bind conflicts with every listener on the port). About 10 us a family,
    against about 40 us for the sock_diag listener dump it saves on a pod's first setup.

    Both families at once with one dual-stack bind (it conflicts with IPv4 and IPv6 holders
    alike); only if that fails, family by family (an IPv6-off netns can't bind ``::``)."""
    if set(families) == {4, 6}:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                s.bind(("::", port))
                return False
            except OSError:
                pass
    for fam in families:
        with socket.socket(AF[fam], socket.SOCK_STREAM) as s:
            if fam == 6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(("0.0.0.0" if fam == 4 else "::", port))
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:  # IPv6 off: nothing listens there
                    return True  # in use, or can't tell: let the listener dump decide
    return False


def _listener_inodes(port: int) -> dict[int, int]:
    """Socket inode -> family of TCP listeners on ``port`` in the current netns.

    Asked over NETLINK_SOCK_DIAG for listeners only: reading /proc/net/tcp walks
    every socket of the host (about 12 ms here), a listener dump about 50 us.
    """
    out: dict[int, int] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as nl:  # NETLINK_SOCK_DIAG
        nl.settimeout(2.0)
        for fam in (4, 6):
            req = struct.pack("=BBBBI48x", AF[fam], socket.IPPROTO_TCP, 0, 0, 1 << 10)  # TCP_LISTEN
            nl.send(struct.pack("=IHHII", 16 + len(req), 20, 0x301, fam, 0) + req)  # SOCK_DIAG_BY_FAMILY, DUMP
            done = False
            for _ in range(10_000):
                if done:
                    break
                data = nl.recv(65536)
                off = 0
                while off + 16 <= len(data):
                    ln, typ = struct.unpack_from("=IH", data, off)
                    if typ == 3 or typ == 2:  # NLMSG_DONE, NLMSG_ERROR
                        done = True
                        break
                    sport = struct.unpack_from("!H", data, off + 16 + 4)[0]
                    inode = struct.unpack_from("=I", data, off + 16 + 68)[0]
                    if sport == port:
                        out[inode] = fam
                    off += (ln + 3) & ~3
    return out


@contextlib.contextmanager
def proxy_listeners(port: int) -> Iterator[dict[int, int]]:
    """family -> an fd of the proxy's listening socket(s) on ``port`` in this netns (closed on exit).

    Looks in this process first, then in every process (``pidfd_getfd`` dups it).
    """
    want = _listener_inodes(port)
    found: dict[int, int] = {}
    owned: list[int] = []
    try:
        if want:
            me = str(os.getpid())

            def pids() -> Iterator[str]:
                yield me  # listing /proc (every process) only if the proxy is not us
                yield from (p for p in os.listdir("/proc") if p.isdigit() and p != me)

            for pid in pids():
                if len(found) == len(set(want.values())):
                    break
                try:
                    fds = os.listdir(f"/proc/{pid}/fd")
                except OSError:
                    continue
                for fd in fds:
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if not target.startswith("socket:["):
                        continue
                    fam = want.get(int(target[8:-1]))
                    if fam is None or fam in found:
                        continue
                    if pid == me:
                        dup = os.dup(int(fd))
                    else:
                        try:
                            pidfd = os.pidfd_open(int(pid))
                        except OSError:
                            continue
                        try:
                            dup = _check(_native().lib.rdr_pidfd_getfd(pidfd, int(fd)), "pidfd_getfd")
                        except OSError:
                            continue
                        finally:
                            os.close(pidfd)
                    owned.append(dup)
                    found[fam] = dup
        yield found
    finally:
        for ofd in owned:
            os.close(ofd)


@dataclass
class PodState:
    """What one pod has installed, read back through its inventory."""

    policy: bytes | None
    entries: dict[int, set[bytes]]  # INV_* -> keys
    inv_keys: list[bytes]

    @property
    def ports(self) -> set[bytes]:
        return self.entries[INV_PORTS]

    @property
    def cidrs(self) -> set[bytes]:
        return self.entries[INV_CIDRS]


class EbpfBackend:
    """Sidecar capture with cgroup sock_addr/sockopt/sock_ops programs and sk_lookup."""

    name = "ebpf"

    def __init__(self, cfg: RedirectConfig | None = None, root: str | None = None, cgroup: str | None = None) -> None:
        #: The config ``render`` describes (the plan is netfilter-shaped; see the module docstring).
        self.cfg = cfg
        self.root = _root(root)
        self.cgroup = _cgroup(cgroup)
        self._scan: NetnsScan | None = None

    def detect_families(self, cfg: RedirectConfig) -> tuple[int, ...]:
        """The families ``cfg`` captures here (``redirect.setup``/``check`` ask the backend when it
        has this): IPv6 is on when the netns has an IPv6 address. Read in the dump that ``apply``
        and ``check`` need anyway (kept for them), so a pod costs no IPv6 sysctl read."""
        self._scan = scan_netns()
        if cfg.ipv6 is None:
            return (4, 6) if self._scan.v6_on else (4,)
        return (4, 6) if cfg.ipv6 else (4,)

    def _take_scan(self) -> NetnsScan:
        """The scan ``detect_families`` made, if it was of this thread's current netns; else a new one."""
        sc, self._scan = self._scan, None
        if sc is not None and sc.thread == threading.get_ident() and sc.inode == _netns.current_inode():
            return sc
        return scan_netns()

    def _pod_link_path(self, cookie: int) -> str:
        return _pod_link(self.root, cookie)

    # --- reading what is installed -----------------------------------------------
    def _read(self, h: HostPrograms, cookie: int) -> PodState:
        """The pod's policy and its entries, by its inventory: O(entries of this pod).

        An entry counts only if it is in its map, so entries deleted behind our back show as
        missing and the next ``apply`` rewrites them.
        """
        policy = h.pods.lookup(U64.pack(cookie))
        st = PodState(policy, {m: set() for m in INV_MAPS}, [])
        if "inventory" not in h.maps:  # its pin is gone (``recover_host``): find them by a walk of the maps
            cv = U64.pack(cookie)
            for m, off in ((INV_PORTS, 0), (INV_CIDRS, 8)):
                st.entries[m] = {k for k in h.maps[INV_MAPS[m]].keys() if k[off : off + 8] == cv}
            return st
        if policy is None:
            return st
        v = POLICY.unpack(policy)
        base, n = v[P_INV_BASE], v[P_N_INV]
        inv = h.maps["inventory"]
        for c in range((n + INV_CHUNK - 1) // INV_CHUNK):
            ik = INV_KEY.pack(cookie, base + c, 0)
            val = inv.lookup(ik)
            st.inv_keys.append(ik)
            if val is None:
                continue
            fields = INV_VAL.unpack(val)
            raw = fields[INV_CHUNK]
            for j in range(min(INV_CHUNK, n - c * INV_CHUNK)):
                m = fields[j]
                if m not in INV_MAPS:
                    continue
                k = raw[INV_KEY_MAX * j : INV_KEY_MAX * j + INV_KEY_SIZE[m]]
                live = h.maps[INV_MAPS[m]].lookup(k)
                if live is not None:
                    st.entries[m].add(k)
        return st

    def installed(self) -> bool:
        with reading_host(self.root) as h:
            return h is not None and h.pods.lookup(U64.pack(current_netns_cookie())) is not None

    # --- apply / remove ------------------------------------------------------------
    def apply(self, plan: Plan, cfg: RedirectConfig, families: tuple[int, ...]) -> Installed:
        _unsupported(cfg)
        t0 = time.perf_counter()
        h = host(self.root, self.cgroup)
        assert h is not None
        t_host = time.perf_counter()
        sc = self._take_scan()
        cookie, local = sc.cookie, sc.local
        old = self._read(h, cookie)
        plan_addrs = _plan_addresses(plan, families, sc.own_v6)
        # A config without the plan's addresses (or a pod without an IPv6 address of its own): ours
        # (::6) go at the end, so they are not the pod's own.
        dropping = (_our_addresses() if not plan_addrs and (old.policy is not None or _V6_ON_LO in local)
                    else ())
        if dropping:
            gone = {(a.family, a.cidr.split("/")[0]) for a in dropping}
            local = tuple(x for x in local if (x[0], x[1]) not in gone)
        # The plan's local addresses (::6 on lo for the proxy's inbound passthrough), as the
        # netfilter backends add them; read from the same listing, no netlink dump per pod.
        on_lo = {(f, ip) for f, ip, idx in local if idx == LOOPBACK_IFINDEX}
        add_addrs = [a for a in plan_addrs if (a.family, a.cidr.split("/")[0]) not in on_lo]
        # Once added they are the pod's own, as what the scan found.
        local = (*local, *((a.family, a.cidr.split("/")[0], LOOPBACK_IFINDEX) for a in add_addrs))
        want = pod_entries(cfg, families, cookie, local)
        inbound = want.inbound
        link_path = self._pod_link_path(cookie)
        # Every pod has one sk_lookup link (outbound-only ones too: it no-ops there). It is the
        # pod's tie to its netns: the kernel detaches it when the netns dies, which is how
        # collect_garbage() finds pods whose netns went without a teardown.
        pinned_target = _link_target(link_path)  # None: no pin
        have_link = pinned_target == sc.inode and _link_prog_cookie(link_path) == cookie
        # Listeners the proxy opened before this setup (those opened later the sock_ops program
        # registers as they start listening): looked for only while a family has none.
        unserved = _unserved(h, cookie, families) if old.policy is not None else families  # a new pod has none
        scan = inbound and _port_bound(cfg.inbound_port, unserved)
        unchanged = (not scan and old.policy is not None and _policy_core(old.policy) == want.policy and not add_addrs
                     and not dropping
                     and all(old.entries[m] == w for m, w in want.by_map().items()) and have_link)
        if unchanged:
            return Installed(self.name, "", families, False, _general_detail(h, cookie, t0, t_host, link_path))
        old_base = POLICY.unpack(old.policy)[P_INV_BASE] if old.policy is not None else 1 << 31
        base = 0 if old_base else 1 << 31  # the other half: old and new inventories never overlap
        listeners_cm: contextlib.AbstractContextManager[dict[int, int]] = (
            proxy_listeners(cfg.inbound_port) if scan else contextlib.nullcontext({})
        )
        inv = h.maps["inventory"]
        with listeners_cm as lfds:
            written: list[tuple[Map, bytes]] = []
            created_link = False
            added: list[LocalAddress] = []
            try:
                from .. import routes as rt

                for la in add_addrs:
                    _add_address(la)
                    added.append(la)
                fault_point("ebpf.before_entries")
                items = [(m, k) for m, keys in want.by_map().items() for k in sorted(keys)]
                n = len(items)
                for c in range(0, n, INV_CHUNK):
                    chunk = items[c : c + INV_CHUNK]
                    maps_ = [m for m, _ in chunk] + [0] * (INV_CHUNK - len(chunk))
                    ik = INV_KEY.pack(cookie, base + c // INV_CHUNK, 0)
                    inv.update(ik, INV_VAL.pack(*maps_, b"".join(k.ljust(INV_KEY_MAX, b"\0") for _, k in chunk)))
                    written.append((inv, ik))
                for m, k in items:
                    if k not in old.entries[m]:
                        target = h.maps[INV_MAPS[m]]
                        target.update(k, U8.pack(1))
                        written.append((target, k))
                # Listeners already open; the sock_ops program adds those opened later.
                for fam, lfd in lfds.items():
                    h.maps["listeners"].update(LISTENER_KEY.pack(cookie, AF[fam], 0), U64.pack(lfd))
                if not have_link:
                    if pinned_target is not None:
                        _detach_pinned(link_path)  # a detached, foreign or unreadable one
                    nsfd = _netns.current_fd()  # the fd redirect.setup entered the netns with
                    own_fd = nsfd is None
                    if nsfd is None:
                        nsfd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        lfd = _pod_lookup_link(h, cookie, nsfd)
                    finally:
                        if own_fd:
                            os.close(nsfd)
                    try:
                        obj_pin(lfd, link_path)
                        created_link = True
                    finally:
                        os.close(lfd)
                fault_point("ebpf.before_policy")
                # The policy entry goes last: it is what switches capture on (or to the new config).
                h.pods.update(U64.pack(cookie), _with_inventory(want.policy, base, n))
            except BaseException as e:
                for mp, k in reversed(written):
                    with contextlib.suppress(OSError):
                        mp.delete(k)
                if created_link:
                    _detach_pinned(link_path)
                for la in added:
                    with contextlib.suppress(OSError, RedirectError):
                        rt.remove_address(la)
                if old.policy is None:
                    for fam in (4, 6):
                        with contextlib.suppress(OSError):
                            h.maps["listeners"].delete(LISTENER_KEY.pack(cookie, AF[fam], 0))
                if isinstance(e, OSError):
                    raise SetupError(f"ebpf: setup failed and was undone: {e}") from e
                raise
        # Stale entries of the previous config, now that the new policy is live.
        for m, had in old.entries.items():
            for k in had - want.by_map()[m]:
                h.maps[INV_MAPS[m]].delete(k)
        for ik in old.inv_keys:
            inv.delete(ik)
        if not inbound:
            for fam in (4, 6):
                h.maps["listeners"].delete(LISTENER_KEY.pack(cookie, AF[fam], 0))
        for ours in dropping:
            rt.remove_address(ours)
        d = _general_detail(h, cookie, t0, t_host, link_path)
        log.debug("ebpf apply cookie=%d pod=%.3f ms", cookie, d["pod_ms"])
        return Installed(self.name, "", families, True, d)

    def remove(self, keep_routes: bool = False) -> bool:
        """Delete this pod's policy, its inventoried entries, listeners and link: O(its entries).

        Per-socket state (original destinations) goes with the sockets, and is inert once the
        policy is gone: every program looks the pod up first.
        """
        cookie = current_netns_cookie()
        with reading_host(self.root) as h:
            if h is None:  # no pods map anywhere: no program of ours can capture; a link pin may be left
                link = self._pod_link_path(cookie)
                if os.path.exists(link):
                    _detach_pinned(link)
                    return True
                return False
            had_policy = h.pods.lookup(U64.pack(cookie)) is not None
            removed = _remove_pod(h, cookie)
        if had_policy and not keep_routes:  # (kept: another backend's capture uses them now)
            _remove_our_addresses()
        return removed

    # --- check / show / render ----------------------------------------------------
    def check(self, plan: Plan, cfg: RedirectConfig, families: tuple[int, ...]) -> CheckResult:
        """Compare the maps, read back entry by entry, and the link with what ``cfg`` wants here."""
        _unsupported(cfg)
        with reading_host(self.root) as h:
            host_diffs = host_problems(self.root, self.cgroup, h)
            if h is None:
                return CheckResult(False, self.name, (f"host programs are not pinned under {self.root}", *host_diffs))
            return self._check(h, host_diffs, plan, cfg, families)

    def _check(self, h: HostPrograms, diffs: list[str], plan: Plan, cfg: RedirectConfig,
               families: tuple[int, ...]) -> CheckResult:
        sc = self._take_scan()
        cookie = sc.cookie
        want = pod_entries(cfg, families, cookie, sc.local)
        st = self._read(h, cookie)
        if st.policy is None:
            diffs.append(f"no policy entry for netns cookie {cookie}")
        elif _policy_core(st.policy) != want.policy:
            diffs.append("policy entry differs: have " + _fmt_policy(st.policy) + ", want " + _fmt_policy(want.policy))
        fmt = {INV_PORTS: _fmt_port, INV_CIDRS: _fmt_cidr}
        what = {INV_PORTS: "port entry", INV_CIDRS: "CIDR entry"}
        for m, w in want.by_map().items():
            target = h.maps[INV_MAPS[m]]
            # Read back from the maps (not only our inventory): an entry deleted by hand is drift.
            live = st.entries[m] | {k for k in w if target.lookup(k) is not None}
            diffs += [f"missing {what[m]} {fmt[m](k)}" for k in sorted(w - live)]
            diffs += [f"extra {what[m]} {fmt[m](k)}" for k in sorted(live - w)]
        link = self._pod_link_path(cookie)
        if not os.path.exists(link):
            diffs.append("no sk_lookup link on this netns")
        else:
            fd = obj_get(link)
            try:
                info = link_info(fd)
            finally:
                os.close(fd)
            if info["target"] != os.stat("/proc/thread-self/ns/net").st_ino:
                diffs.append("sk_lookup link is not attached to this netns (netns gone or detached)")
            if _lookup_prog_cookie(info["prog_id"]) != cookie:
                diffs.append("sk_lookup link runs another program than this pod's")
        from .. import routes as rt

        diffs += rt.differences(plan, families)
        return CheckResult(not diffs, self.name, tuple(diffs))

    def show(self) -> dict[str, Any]:
        with reading_host(self.root) as h:
            if h is None:
                return {"backend": self.name, "root": self.root, "host_programs": None, "installed": False}
            return self._show(h)

    def _show(self, h: HostPrograms) -> dict[str, Any]:
        cookie = current_netns_cookie()
        st = self._read(h, cookie)
        link = self._pod_link_path(cookie)
        listening = [f for f in (4, 6) if h.maps["listeners"].lookup(LISTENER_KEY.pack(cookie, AF[f], 0))]
        return {
            "backend": self.name, "root": self.root, "netns_cookie": cookie, "installed": st.policy is not None,
            "host_programs": {n: prog_id(fd) for n, fd in h.progs.items()},
            "policy": _fmt_policy(st.policy) if st.policy else None,
            "ports": sorted(_fmt_port(k) for k in st.ports), "cidrs": sorted(_fmt_cidr(k) for k in st.cidrs),
            "addresses": sorted(_fmt_cidr(k).split(" ", 1)[1].rsplit("/", 1)[0] for k in st.cidrs
                                if CIDR_KEY.unpack(k)[1] in (CIDR_LOCAL4, CIDR_LOCAL6)),
            "inbound_listeners": [f"IPv{f}" for f in listening],
            "sk_lookup_link": link if os.path.exists(link) else None,
            "missing_host_pins": missing_pins(self.root),
        }

    def render(self, plan: Plan, families: tuple[int, ...]) -> str:
        """What ``apply`` would write for the config this backend was made with."""
        return self.render_config(self.cfg or RedirectConfig(), families)

    def render_config(self, cfg: RedirectConfig, families: tuple[int, ...]) -> str:
        """The map entries ``apply`` would write, as text (netns cookie shown as <netns>)."""
        _unsupported(cfg)
        e = pod_entries(cfg, families, 0)
        lines = [f"pods[<netns>] = {_fmt_policy(e.policy)}"]
        lines += [f"ports[{_fmt_port(k)}]" for k in sorted(e.ports)]
        lines += [f"cidrs[{_fmt_cidr(k)}]" for k in sorted(e.cidrs)]
        lines.append("cidrs[local <each pod address>]")
        lines.append("sk_lookup link on the pod netns (its program holds the netns cookie)")
        if e.inbound:
            lines.append(f"listeners[<netns>, family] = proxy socket listening on {cfg.inbound_port}")
        return "\n".join(lines) + "\n"


def _detail(h: HostPrograms, cookie: int, host_ms: float, pod_ms: float, link_path: str,
            path: str = "general") -> dict[str, Any]:
    """``Installed.detail``; ``path``: "fresh" (one native call, ``setup_fresh``) or "general";
    ``host_ms`` the time to find (or load) the host programs, ``pod_ms`` the pod's own part.
    (No ``round()`` here: rounding a float to digits is slow next to the rest of a fresh pod's
    Python; the general path rounds its own.)"""
    return {"netns_cookie": cookie, "root": h.root, "compiled": h.compiled, "host_ms": host_ms, "pod_ms": pod_ms,
            "sk_lookup_link": link_path, "path": path}


def _general_detail(h: HostPrograms, cookie: int, t0: float, t_host: float, link_path: str) -> dict[str, Any]:
    """``_detail`` of ``apply``, which started at ``t0`` and had the host programs at ``t_host``."""
    return _detail(h, cookie, round((t_host - t0) * 1e3, 3), round((time.perf_counter() - t_host) * 1e3, 3), link_path)


#: Per thread: ``call``, the ``struct rdr_pod_call`` its fresh-pod setups fill in turn.
_tls = threading.local()
#: The last fresh-pod setup's config, host handle and request: the next pod with the same config
#: object reuses them without look-ups while the handle is ok (a closed one is not; the native
#: call backs off if the environment names another root, and then this is forgotten).
_last_fresh: tuple[Any, Any, Any] = (None, None, None)


def setup_fresh(cfg: RedirectConfig, netns: NetnsRef, name: str, lock_fd: int) -> Installed | None:
    """``EbpfBackend.apply`` for a pod with nothing of ours yet, on the default root (or
    ``REDIRECT_BPF_ROOT``), in one native call (native/pod_setup.c): what
    ``redirect.setup(..., backend="ebpf")`` tries first. From outside the netns, it opens
    ``netns``, takes its lock on ``lock_fd`` (the calling thread's own fd of
    the netns lock file, ``redirect.locks``), enters, sets the pod up and comes back.

    None when the pod is not fresh, the lock is held, or anything looks unusual (the namespace
    too: the general path reports it): nothing was changed and the caller takes the general
    path. Per pod this is the hot path, so it stays short: with the last pod's config, no look-up
    at all (not even of the environment, which the native call reads), one call."""
    global _last_fresh
    host_ms = 0.0
    cfg0, h, req = _last_fresh
    if cfg0 is not cfg or not h.ok:  # else the last pod's config and handle: its request (the native
        tmpl = fresh_pod_template(cfg)  # call checks the root is still the one the environment names)
        if tmpl is None:
            return None
        h = _host_cache.get(os.environ.get("REDIRECT_BPF_ROOT") or DEFAULT_ROOT)
        if h is None or not h.ok:  # else the native call asks the pin watch itself
            t0 = time.perf_counter()
            h = host()  # (the root and cgroup from the environment, as above)
            assert h is not None
            host_ms = round((time.perf_counter() - t0) * 1e3, 3)
        req = h.fresh_request(tmpl)
        _last_fresh = (cfg, h, req)
    nat = _native()
    c = _tls.__dict__.get("call")
    if c is None:
        c = _tls.call = nat.ffi.new("struct rdr_pod_call *")
    path = _netns.path_of(netns)
    lib = nat.lib
    rc = lib.rdr_ebpf_pod_add(req, c, nat.ffi.NULL if path is None else path.encode(),
                              -1 if path is not None else int(netns), h.watch if h.ok else -1,  # type: ignore[arg-type]
                              lock_fd)
    if rc != 0:
        if rc in (lib.RDR_POD_SLOW, lib.RDR_POD_BUSY, lib.RDR_POD_STALE):
            log.debug("ebpf: not a fresh pod, its lock is held, or the host pins changed: general path (%d)", rc)
            if rc == lib.RDR_POD_STALE:
                _last_fresh = (None, None, None)  # look the handle up again next time
            return None
        if rc == lib.RDR_POD_STRANDED:
            raise SystemError("could not return to the thread's own netns after an eBPF setup")
        if rc == lib.RDR_POD_FAULT:
            raise SetupError(f"injected fault at {os.environ.get('REDIRECT_FAULT')}")
        raise SetupError(f"ebpf: setup failed and was undone: {os.strerror(-rc)}")
    cookie = c.cookie
    d = _detail(h, cookie, host_ms, c.wall_ns / 1e6, f"{h.pods_dir}/{cookie}-sk_lookup", "fresh")
    return Installed("ebpf", name, (4, 6) if c.v6 else (4,), True, d)


def _pod_lookup_link(h: HostPrograms, cookie: int, netns_fd: int) -> int:
    """A new sk_lookup link on ``netns_fd`` running the pod's own program (it holds ``cookie``:
    bpf/redirect.h, lookup_netns); the link fd."""
    pfd = _check(_native().lib.rdr_ebpf_lookup_prog(h.maps["lookup_netns"].fd, h.maps["lookup_prog"].fd, cookie),
                 "BPF_PROG_LOAD sk_lookup")
    try:
        return link_create(pfd, netns_fd, SK_LOOKUP_ATTACH)
    finally:
        os.close(pfd)


def _lookup_prog_cookie(prog: int) -> int | None:
    """The netns cookie the pod's sk_lookup program ``prog`` (an id) holds; None if it is not one."""
    out = _native().ffi.new("uint64_t *")
    return int(out[0]) if _native().lib.rdr_ebpf_lookup_prog_cookie(prog, out) == 0 else None


def _pod_link(root: str, cookie: int) -> str:
    return os.path.join(root, "pods", f"{cookie}-sk_lookup")


def _link_target(path: str) -> int | None:
    """The netns inode a pinned netns link is attached to (0: detached, its netns is gone);
    None: no pin; -1: something is pinned there that can't be read as a netns link."""
    try:
        fd = obj_get(path)
    except FileNotFoundError:
        return None
    except OSError:
        return -1
    try:
        return int(link_info(fd)["target"])
    except OSError:
        return -1
    finally:
        os.close(fd)


def _pinned_link_info(path: str) -> dict[str, int] | None:
    """``link_info`` of the link pinned at ``path``; None if there is none (or it can't be read)."""
    try:
        fd = obj_get(path)
    except OSError:
        return None
    try:
        return link_info(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _link_prog_cookie(path: str) -> int | None:
    """The netns cookie held by the program of the link pinned at ``path`` (None: none, or not ours)."""
    info = _pinned_link_info(path)
    return None if info is None else _lookup_prog_cookie(info["prog_id"])


def _remove_pod(h: HostPrograms, cookie: int) -> bool:
    """Everything of the pod ``cookie`` in the maps, and its link: O(its entries), from any netns."""
    st = EbpfBackend(root=h.root)._read(h, cookie)
    removed = h.pods.delete(U64.pack(cookie))  # first: switches capture off at once
    for m, keys in st.entries.items():
        for k in keys:
            removed |= h.maps[INV_MAPS[m]].delete(k)
    for ik in st.inv_keys:
        h.maps["inventory"].delete(ik)
    for fam in (4, 6):
        removed |= h.maps["listeners"].delete(LISTENER_KEY.pack(cookie, AF[fam], 0))
    link = _pod_link(h.root, cookie)
    if os.path.exists(link):
        _detach_pinned(link)
        removed = True
    return bool(removed)


def collect_garbage(root: str | None = None) -> list[int]:
    """Remove the pods whose netns is gone without a teardown (their sk_lookup link was
    detached by the kernel). Returns their netns cookies. O(registered pods)."""
    h = host(root, load=False)
    if h is None:
        return []
    pod_dir = os.path.join(h.root, "pods")
    cookies = {U64.unpack(k)[0] for k in h.pods.keys()}
    try:
        cookies |= {int(n.split("-", 1)[0]) for n in os.listdir(pod_dir) if n.split("-", 1)[0].isdigit()}
    except FileNotFoundError:
        pass
    gone = [c for c in sorted(cookies) if _link_target(_pod_link(h.root, c)) == 0]
    for c in gone:
        _remove_pod(h, c)
        log.info("ebpf: removed pod with netns cookie %d: its netns is gone", c)
    return gone


def _plan_addresses(plan: Plan, families: tuple[int, ...], own_v6: bool) -> tuple[LocalAddress, ...]:
    """The plan's addresses wanted here (as ``routes.usable_addresses``: IPv6 ones when the pod has
    an IPv6 address of its own)."""
    return tuple(a for a in plan.addresses if a.family in families and (a.family == 4 or own_v6))


def _add_address(a: LocalAddress) -> None:
    """``routes.add_address`` without its link dump when the device is lo (ifindex 1 in every netns)."""
    from .. import routes as rt
    from .. import rtnl

    if a.dev != "lo":
        rt.add_address(a)
        return
    address, plen = a.cidr.split("/")
    try:
        rtnl.addr("add", AF[a.family], 1, address, int(plen), rt.RT_PROTO, rt.IFA_F_NODAD)
    except OSError as e:
        if e.errno != errno.EEXIST:
            raise


def _our_addresses() -> tuple[LocalAddress, ...]:
    """The addresses we added here (routing protocol ours; the plan only ever adds IPv6 ones, ::6)."""
    from .. import routes as rt

    return tuple(rt.read_ours((6,)).addresses)


def _remove_our_addresses() -> None:
    """The addresses we added, removed as the netfilter backends remove them."""
    from .. import routes as rt

    for a in _our_addresses():
        rt.remove_address(a)


def _detach_pinned(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = obj_get(path)
        try:
            _native().lib.rdr_bpf_link_detach(fd)
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_PORT_KINDS = {PORT_OUT_EXCL: "outbound-exclude", PORT_OUT_INCL: "outbound-include",
               PORT_IN_INCL: "inbound-include", PORT_IN_EXCL: "inbound-exclude"}
_CIDR_KINDS = {CIDR_OUT_EXCL4: "outbound-exclude", CIDR_OUT_INCL4: "outbound-include", CIDR_DNS4: "dns-server",
               CIDR_OUT_EXCL6: "outbound-exclude", CIDR_OUT_INCL6: "outbound-include", CIDR_DNS6: "dns-server",
               CIDR_LOCAL4: "local", CIDR_LOCAL6: "local"}


def _fmt_port(k: bytes) -> str:
    _c, kind, port, _ = PORT_KEY.unpack(k)
    return f"{_PORT_KINDS.get(kind, kind)} {port}"


def _fmt_cidr(k: bytes) -> str:
    plen, kind, _c, raw = CIDR_KEY.unpack(k)
    v6 = kind in (CIDR_OUT_EXCL6, CIDR_OUT_INCL6, CIDR_DNS6, CIDR_LOCAL6)
    ip = ipaddress.ip_address(raw if v6 else raw[:4])
    return f"{_CIDR_KINDS.get(kind, kind)} {ip}/{plen - 96}"


def _fmt_policy(raw: bytes) -> str:
    v = POLICY.unpack(raw)
    flags = v[P_FLAGS]
    names = ["out_all", "dns", "dns_all", "incl_loopback", "inbound", "inbound_all", "v6"]
    on = [n for i, n in enumerate(names) if flags & (1 << i)]
    f = {name: v[i] for name, i in _POLICY.index.items()}

    def ids(name: str, n: str) -> str:
        i = _POLICY.index[name]
        return _fmt_ids(v[i : i + 2 * MAX_IDS], f[n])

    groups = f["groups_mode"]
    return (f"proxy_port={f['proxy_port']} inbound_port={f['inbound_port']} tunnel_port={f['tunnel_port']}"
            f" dns_port={f['dns_port']} flags={'+'.join(on) or '-'}"
            f" loopback={socket.inet_ntoa(f['lo4_addr'])}/{socket.inet_ntoa(f['lo4_mask'])}"
            f" uids={ids('uids', 'n_uids')} gids={ids('gids', 'n_gids')}"
            + ("" if groups == GROUPS_ALL else
               f" {'owner_groups' if groups == GROUPS_ONLY else 'owner_groups_exclude'}={ids('groups', 'n_groups')}"))


def _fmt_ids(flat: tuple[int, ...], n: int) -> str:
    return ",".join(str(flat[2 * i]) if flat[2 * i] == flat[2 * i + 1] else f"{flat[2 * i]}-{flat[2 * i + 1]}"
                    for i in range(n)) or "-"


__all__ = ["EbpfBackend", "HostPrograms", "host", "unload_host", "registered_pods", "probe_kernel", "collect_garbage",
           "RedirectError"]
