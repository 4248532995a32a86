"""The host part of the eBPF backend: the programs, maps and cgroup links pinned under one bpffs root.

``HostPrograms`` is one process's handle on them (opened by fd). ``HostPrograms.open_or_load``
reuses the pins, or has them compiled (``redirect/bpf/*.c`` through bcc, against the headers in
``redirect/bpf/headers/``), loaded, pinned and attached once, under a host lock, by a short-lived
process (``.loader``): bcc and LLVM are never mapped in the caller. A partly pinned root is repaired
(missing cgroup links) or reloaded (no pod registered).
``recover_host`` reads what is still attached when pins are gone; ``host_problems`` says what a pod's
capture is missing. The per-process cache of handles and unloading are in ``.lifetime``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailable, SetupError
from ...kernel import netns as _netns
from ..base import EBPF_DEFAULT_ROOT
from .abi import MAP_SIZES, MAPS, POLICY, PROGRAMS, U32
from .pool import close_kept, kept_programs
from .syscalls import (
    Map,
    _fd_by_id,
    _link_prog_fd,
    _native,
    _pinned_link_info,
    _tcp_diag_ok,
    link_create,
    obj_get,
    obj_pin,
    prog_id,
)

if TYPE_CHECKING:
    from .fresh import FreshPodTemplate

log = logging.getLogger("redirect.ebpf")

DEFAULT_ROOT = EBPF_DEFAULT_ROOT  # (defined with the backends: redirect.api looks for pins there too)
DEFAULT_CGROUP = "/sys/fs/cgroup/unified"
#: The BPF C sources: package data of ``redirect`` (``redirect/bpf/``), installed with it.
BPF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bpf")
#: The header tree bcc compiles against (``BCC_KERNEL_SOURCE``): the kernel's UAPI headers the programs
#: and bcc's helpers.h include, and a few of ours (``redirect/bpf/headers/README.md``). Package data.
HEADERS_DIR = os.path.join(BPF_DIR, "headers")
#: ``uname -m`` -> the kernel's arch directory (as bcc maps it), for the arches whose UAPI headers
#: ``HEADERS_DIR`` carries.
HEADER_ARCHES = {"x86_64": "x86"}
#: Sources in compile order. bcc only rewrites map calls (``pods.lookup``) in
#: its main text, so the helper header is inlined there rather than #included.
SOURCES = ("policy.h", "sock_addr.c", "sockmap.c", "sockopt.c", "sk_lookup.c", "tc_forward.c")


def _root(root: str | None) -> str:
    return root or os.environ.get("REDIRECT_BPF_ROOT") or DEFAULT_ROOT


def _cgroup(cgroup: str | None) -> str:
    """The cgroup v2 directory the host programs attach to: ``cgroup``, else ``$REDIRECT_BPF_CGROUP``,
    else the cgroup v2 root of the host (``/sys/fs/cgroup/unified`` on a hybrid host, else
    ``/sys/fs/cgroup``). A directory given that is not cgroup v2 but has it as ``unified`` (a hybrid
    host's ``/sys/fs/cgroup``) stands for that child: a container given the node's
    ``/sys/fs/cgroup`` finds the node's cgroup v2 root whatever the node's layout."""
    given = cgroup or os.environ.get("REDIRECT_BPF_CGROUP")
    for c in ((given, os.path.join(given, "unified")) if given else (DEFAULT_CGROUP, "/sys/fs/cgroup")):
        if os.path.isfile(os.path.join(c, "cgroup.controllers")):  # (only cgroup v2 directories have it)
            return c
    return given or DEFAULT_CGROUP


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
    """The host lock's file in the run directory (``redirect.kernel.locks``)."""
    return "ebpf-" + re.sub(r"[^A-Za-z0-9]", "_", root) + ".lock"


@contextlib.contextmanager
def _host_lock(root: str) -> Iterator[int]:
    """One loader per host at a time (other processes too); the lock file's fd (a process it is
    passed to holds the lock with it)."""
    from ...kernel import locks

    fd = locks.open_private(_lock_name(root))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


class HostPrograms:
    """The pinned programs, maps and cgroup links under one root, opened by fd."""

    def __init__(self, root: str, maps: dict[str, Map], progs: dict[str, int], loaded: bool, load_ms: float) -> None:
        self.root, self.maps, self.progs, self.load_ms = root, maps, progs, load_ms
        #: True if this process compiled the programs, False if it reused pins.
        self.compiled = loaded
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
        #: Where this process's next batch of pool programs starts (``pool.refill``), read by the
        #: native writer too (where to look for an unclaimed slot when none is queued free).
        self.pool_hint = _native().ffi.new("uint32_t[1]")
        #: ``fresh_request``'s structs (with the pin-dir buffer they point to), by template.
        self._fresh: dict[FreshPodTemplate, tuple[Any, ...]] = {}
        #: The pool's programs kept open by slot (-1: none) and their count: those this process
        #: loaded or claimed (``.pool``); closed with the handle (``forget_programs``).
        self.prog_fds, self.n_prog_fds = kept_programs()

    def forget_programs(self) -> None:
        """Close the pool programs this handle keeps open (the next claims look them up)."""
        close_kept(self.prog_fds, self.n_prog_fds)

    @property
    def pods(self) -> Map:
        return self.maps["pods"]

    def fresh_request(self, tmpl: FreshPodTemplate) -> Any:
        """The ``struct rdr_pod_req`` for ``tmpl`` on these maps: made once per template, shared by
        threads (the call never writes it). Kept with these fds: a reload makes a new object."""
        hit = self._fresh.get(tmpl)
        if hit is not None:
            return hit[0]
        from ...kernel import routes as rt

        ffi = _native().ffi
        r = ffi.new("struct rdr_pod_req *")
        m = self.maps
        r.map_pods, r.map_inventory, r.map_ports = m["pods"].fd, m["inventory"].fd, m["ports"].fd
        r.map_cidrs = m["cidrs"].fd
        r.map_lookup_netns, r.map_lookup_prog = m["lookup_netns"].fd, m["lookup_prog"].fd
        r.map_slots, r.map_free, r.map_pool = m["lookup_slots"].fd, m["lookup_free"].fd, m["lookup_pool"].fd
        r.slot_hint = self.pool_hint
        r.alive = self.alive
        root, default_root = ffi.new("char[]", self.root.encode()), ffi.new("char[]", DEFAULT_ROOT.encode())
        r.root, r.default_root = root, default_root
        pin_dir = ffi.new("char[]", self.pods_dir.encode())
        r.pin_dir, r.pin_dir_fd = pin_dir, self._pods_dir_fd()
        r.inbound_port = tmpl.inbound_port
        r.tc_forwarded = tmpl.tc_forwarded
        r.prog_fds, r.n_prog_fds = self.prog_fds, self.n_prog_fds
        r.tc_prog_in, r.tc_prog_out = self.progs.get("rdr_tc_ingress", -1), self.progs.get("rdr_tc_egress", -1)
        r.tcp_diag = _tcp_diag_ok()
        r.host_netns_ino = _netns.host_netns_inodes()
        from ...kernel import locks

        r.nf_marks_fd, r.nf_marks_ready = locks.netfilter_marks()
        r.addr_proto, r.addr_flags = rt.RT_PROTO, rt.IFA_F_NODAD
        for i, row in enumerate(tmpl.sets):
            for j, (policy, ports, n_ports, cidrs, n_cidrs, local, v6, add) in enumerate(row):
                st = r.sets[i][j]
                st.policy, st.ports, st.n_ports, st.cidrs, st.n_cidrs = policy, ports, n_ports, cidrs, n_cidrs
                for k, f in enumerate((4, 6)):
                    st.has_local[k] = f in local
                    if f in local:
                        ffi.memmove(ffi.addressof(st.local, k), local[f], len(local[f]))
                st.v6, st.n_add = v6, add is not None
                if add is not None:
                    ffi.memmove(st.add, add, 16)
        r.n_ours_v6 = len(rt.PLAN_V6)
        for i, raw in enumerate(rt.PLAN_V6):
            ffi.memmove(r.ours_v6[i], raw, 16)
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
        self.forget_programs()
        self.maps, self.progs, self.pods_dir_fd, self.ok = {}, {}, -1, False

    @staticmethod
    def pinned(root: str) -> bool:
        return all(os.path.exists(os.path.join(root, "maps", m)) for m in MAPS) and all(
            os.path.exists(os.path.join(root, "progs", p)) for p in PROGRAMS
        )

    @classmethod
    def open_pinned(cls, root: str, compiled: bool = False, load_ms: float = 0.0) -> HostPrograms:
        maps: dict[str, Map] = {}
        progs: dict[str, int] = {}
        sizes = MAP_SIZES
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
        with _host_lock(root) as lock_fd:
            missing = missing_pins(root)
            if not missing:
                return cls.open_pinned(root)
            objs = [m for m in missing if not m.startswith("links/")]
            if not objs:
                _repair_links(root, cg, [m.split("/", 1)[1] for m in missing])
                log.warning("ebpf: re-created missing cgroup links under %s: %s", root, ", ".join(missing))
                return cls.open_pinned(root)
            if len(objs) < len(MAPS) + 1 + len(PROGRAMS):  # some pins are there: is anyone using them?
                pods = count_pods(root)
                if pods is None or pods:
                    who = (f"{pods} pod(s) are registered" if pods else
                           "pods may be registered (no pods map pin, but the programs are still attached)")
                    raise SetupError(
                        f"ebpf: the host programs under {root} are incomplete (missing: {', '.join(missing)}) while"
                        f" {who}; reloading would drop their capture. Tear those pods down"
                        f" (or unload_host({root!r}, force=True)) and set up again"
                    )
                log.warning("ebpf: host pins under %s incomplete (missing: %s); reloading", root, ", ".join(missing))
            probe_kernel()  # (what the loader would refuse, without starting it)
            _require_cgroup(cg)
            from .launch import LoaderDied, run_loader

            t0 = time.perf_counter()
            try:
                hint = run_loader(root, cg, lock_fd)
            except LoaderDied:
                _unpin_all(root)  # (whatever it pinned before it died)
                raise
            ms = (time.perf_counter() - t0) * 1e3
            log.info("ebpf: compiled and pinned host programs under %s in %.0f ms (loader process)", root, ms)
            h = cls.open_pinned(root, compiled=True, load_ms=ms)
            h.pool_hint[0] = hint  # (where this process's next batch starts, as after its own refill)
            return h


def _cgroup_progs() -> list[str]:
    return [p for p, (_, _, cg) in PROGRAMS.items() if cg]


@functools.lru_cache(maxsize=1)
def build_id() -> str:
    """A digest of ``redirect/bpf/``: pinned as ``maps/build-<id>``, so pins of other sources count as missing."""
    import hashlib

    if missing := [n for n in SOURCES if not os.path.isfile(os.path.join(BPF_DIR, n))]:
        raise BackendUnavailable(f"ebpf: the BPF sources are missing from {BPF_DIR} ({', '.join(missing)}): reinstall")
    h = hashlib.sha256()
    names = sorted(os.path.relpath(os.path.join(d, n), BPF_DIR) for d, _, ns in os.walk(BPF_DIR) for n in ns)
    for n in names:  # the sources and the headers they are compiled against
        if n.endswith((".c", ".h")):
            with open(os.path.join(BPF_DIR, n), "rb") as f:
                h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


def _build_pin() -> str:
    return f"build-{build_id()}"


def missing_pins(root: str) -> list[str]:
    """The host pins (``maps/x``, ``progs/x``, ``links/x``) not present under ``root``.

    ``maps/build-<id>`` stands for "pinned from these sources": after an upgrade of ``redirect/bpf/``
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


def count_pods(root: str) -> int | None:
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
            pod_links = [n for n in os.listdir(os.path.join(root, "pods")) if n.endswith("-sk_lookup")]
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


def _require_cgroup(cgroup: str) -> None:
    if not os.path.isdir(cgroup) or not os.path.exists(os.path.join(cgroup, "cgroup.procs")):
        raise BackendUnavailable(f"ebpf: cgroup v2 not mounted at {cgroup} (set REDIRECT_BPF_CGROUP)")


def _attach_to_cgroup(root: str, cgroup: str, progs: dict[str, int]) -> None:
    """Attach each program (name -> fd) to ``cgroup`` with a ``bpf_link`` pinned at ``links/<name>``."""
    cgfd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, pfd in progs.items():
            try:
                lfd = link_create(pfd, cgfd, PROGRAMS[name][1])
            except OSError as e:
                raise BackendUnavailable(f"ebpf: attaching {name} to cgroup {cgroup} failed: {e}") from None
            try:
                obj_pin(lfd, os.path.join(root, "links", name))
            finally:
                os.close(lfd)
    finally:
        os.close(cgfd)


def _repair_links(root: str, cgroup: str, names: list[str]) -> None:
    """Re-create the missing cgroup links ``names`` from the pinned programs."""
    progs: dict[str, int] = {}
    try:
        for name in names:
            progs[name] = obj_get(os.path.join(root, "progs", name))
        _attach_to_cgroup(root, cgroup, progs)
    finally:
        for fd in progs.values():
            os.close(fd)


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


def probe_kernel() -> None:
    """What the backend needs from this host; ``BackendUnavailable`` names what is missing."""
    rel = os.uname().release
    m = re.match(r"(\d+)\.(\d+)", rel)
    if m and (int(m.group(1)), int(m.group(2))) < (5, 17):
        raise BackendUnavailable(
            f"ebpf: kernel {rel} is too old: needs 5.17+ (sk_lookup ingress_ifindex, netns cookies in sock_ops)"
        )
    why = headers_refusal()
    if why is not None:
        raise BackendUnavailable(why)
    # Found, not imported: bcc (and LLVM with it) is loaded only by the loader process (``.loader``).
    if importlib.util.find_spec("bcc") is None:
        raise BackendUnavailable("ebpf: bcc's Python module is missing (it compiles the host programs once per"
                                 " host): install python3-bpfcc (in a venv: --system-site-packages)")


def headers_refusal() -> str | None:
    """Why the header tree the package carries can't serve bcc on this machine (None: it can)."""
    machine = os.uname().machine
    arch = HEADER_ARCHES.get(machine)
    if arch is None:
        return (f"ebpf: no UAPI headers for this machine's architecture ({machine}) under {HEADERS_DIR}: only"
                f" {', '.join(sorted(HEADER_ARCHES))} is carried")
    for p in ("include/linux/kconfig.h", f"arch/{arch}/include/uapi/asm/types.h"):
        if not os.path.isfile(os.path.join(HEADERS_DIR, p)):
            return f"ebpf: the header tree bcc compiles against is incomplete: {os.path.join(HEADERS_DIR, p)} is" \
                   " missing (an installation without redirect's package data redirect/bpf/headers/)"
    return None


@functools.lru_cache(maxsize=4)
def host_refusal(root: str, cgroup: str) -> str | None:
    """Why this host can't run the backend with pins under ``root`` (None: it can): the kernel,
    bcc, bpffs (mounted where the pins go, or ``/sys/fs/bpf`` there to mount) and cgroup v2.
    Asked once per process."""
    try:
        probe_kernel()
    except BackendUnavailable as e:
        return str(e)
    parent = os.path.dirname(root.rstrip("/"))
    if not (_is_bpffs(parent if os.path.exists(parent) else root)
            or (root.startswith("/sys/fs/bpf/") and os.path.isdir("/sys/fs/bpf"))):
        return f"ebpf: no bpffs for the pins under {root}"
    try:
        _require_cgroup(cgroup)
    except BackendUnavailable as e:
        return str(e)
    return None


def _unpin_all(root: str) -> None:
    """Unpin everything under ``root`` (links first: unpinning the last ref detaches)."""
    for d in ("links", "pods", "progs", "maps"):
        p = os.path.join(root, d)
        if os.path.isdir(p):
            for n in os.listdir(p):
                q = os.path.join(p, n)
                if os.path.isdir(q):  # (<cookie>-tcx: pinned tcx links of an earlier version)
                    for m in os.listdir(q):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(q, m))
                    with contextlib.suppress(OSError):
                        os.rmdir(q)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(q)
            with contextlib.suppress(OSError):
                os.rmdir(p)
    with contextlib.suppress(OSError):
        os.rmdir(root)


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
    sizes = MAP_SIZES

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


def host_problems(root: str, cgroup: str, h: HostPrograms | None) -> list[str]:
    """What is wrong with the host part every pod depends on: pins missing, cgroup links detached,
    attached elsewhere or running another program, ``lookup_prog`` not holding ``rdr_sk_lookup``."""
    out: list[str] = []
    for m in missing_pins(root):
        if m.startswith("maps/build-"):
            out.append(f"host pin {root}/{m} is missing: the pinned programs come from another build of redirect/bpf/")
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
