"""The host part of the eBPF backend: the programs, maps and cgroup links pinned under one bpffs root.

``HostPrograms`` is one process's handle on them (opened by fd); its ``store`` (``.pods.PodStore``) is
what the per-pod side sees of it. ``HostPrograms.open_or_load`` reuses the pins, or has them compiled
(``redirect/bpf/*.c`` through bcc, against the headers in ``redirect/bpf/headers/``), loaded, pinned
and attached once, under the host lock, by a short-lived process (``.loader``): bcc and LLVM are never
mapped in the caller. A partly pinned root is repaired (missing cgroup links) or reloaded (no pod
registered). ``recover`` reads what is still attached when pins are gone; ``host_problems`` says
what a pod's capture is missing. The process's handles and unloading are in ``.lifetime``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from ....errors import BackendUnavailable, SetupError
from ...base import EBPF_DEFAULT_ROOT
from ..abi import U32
from . import pool
from .objects import CGROUP_PROGRAMS, MAP_ATTACHED, MAPS, PROGRAMS
from .pins import ensure_bpffs, host_lock, missing_pins, probe_kernel, require_cgroup, unpin_all
from .pods import LINK_SUFFIX, PodStore
from .syscalls import (
    NATIVE,
    Map,
    attached_progs,
    fd_by_id,
    link_create,
    link_prog_fd,
    obj_get,
    obj_pin,
    pinned_link_info,
    prog_id,
)

log = logging.getLogger("redirect.ebpf")

_TC = ("rdr_tc_ingress", "rdr_tc_egress")


class HostPrograms:
    """The pinned programs, maps and cgroup links under one root, opened by fd; closed by ``close``."""

    def __init__(self, root: str, maps: dict[str, Map], progs: dict[str, int], compiled: bool = False,
                 load_ms: float = 0.0) -> None:
        self.root, self.maps, self.progs = root, maps, progs
        #: True if this process compiled the programs (and in how long), False if it reused pins.
        self.compiled, self.load_ms = compiled, load_ms
        self.pods_dir = os.path.join(root, "pods")  # where the pods' links are pinned
        self.pods_dir_fd = -1
        with contextlib.suppress(OSError):  # (the pin is then made by path)
            self.pods_dir_fd = os.open(self.pods_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        ffi = NATIVE.ffi
        #: 1 while this handle is in use, 0 while the process looks it over again (the native
        #: fresh-pod call reads it: ``struct rdr_host_maps``'s ``alive``).
        self.alive = ffi.new("int[1]", [1])
        #: Where this process's next batch of pool programs starts (``pool.refill``), read by the
        #: native writer too (where to look for an unclaimed slot when none is queued free).
        self.pool_hint = ffi.new("uint32_t[1]")
        #: The pool's programs kept open by slot (-1: none) and their count: those this process
        #: loaded or claimed (``.pool``); closed with the handle.
        self.prog_fds, self.n_prog_fds = pool.kept_programs()
        #: The strings ``native`` points to (kept as long as it).
        self._strings = tuple(ffi.new("char[]", v.encode()) for v in (root, EBPF_DEFAULT_ROOT, self.pods_dir))
        self.native = self._native()
        self.store = PodStore(root, maps, progs, self.native, self.pool_hint, compiled, load_ms)

    def _native(self) -> Any:
        """``struct rdr_host_maps`` of this handle: what the native writer knows of the host side."""
        h = NATIVE.ffi.new("struct rdr_host_maps *")
        fd = {n: (m.fd if (m := self.maps.get(n)) is not None else -1)
              for n in ("pods", "inventory", "ports", "cidrs", "listeners", "lookup_netns", "lookup_prog",
                        "lookup_slots", "lookup_free", "lookup_pool")}
        h.pods, h.inventory, h.ports, h.cidrs, h.listeners = (fd[n] for n in ("pods", "inventory", "ports", "cidrs",
                                                                              "listeners"))
        h.lookup_netns, h.lookup_prog = fd["lookup_netns"], fd["lookup_prog"]
        h.slots, h.free, h.pool = fd["lookup_slots"], fd["lookup_free"], fd["lookup_pool"]
        h.slot_hint = self.pool_hint
        h.prog_fds, h.n_prog_fds = self.prog_fds, self.n_prog_fds
        h.tc_prog_in, h.tc_prog_out = (self.progs.get(n, -1) for n in _TC)
        root, default_root, pods_dir = self._strings
        h.pin_dir, h.pin_dir_fd = pods_dir, self.pods_dir_fd
        h.alive, h.root, h.default_root = self.alive, root, default_root
        return h

    @property
    def pods(self) -> Map:
        return self.maps["pods"]

    def trusted(self) -> bool:
        """Nothing of the host pins changed since the process last found them all (``PodStore.trusted``)."""
        return self.store.trusted()

    def forget_programs(self) -> None:
        """Close the pool programs this handle keeps open (the next claims look them up)."""
        pool.close_kept(self.prog_fds, self.n_prog_fds)

    def close(self) -> None:
        _close(self.maps, self.progs)
        if self.pods_dir_fd >= 0:
            os.close(self.pods_dir_fd)
        self.forget_programs()
        self.maps, self.progs, self.pods_dir_fd = {}, {}, -1
        self.store.ok = False

    @staticmethod
    def pinned(root: str) -> bool:
        return all(os.path.exists(os.path.join(root, "maps", m)) for m in MAPS) and all(
            os.path.exists(os.path.join(root, "progs", p)) for p in PROGRAMS
        )

    @classmethod
    def open_pinned(cls, root: str, compiled: bool = False, load_ms: float = 0.0) -> HostPrograms:
        maps: dict[str, Map] = {}
        progs: dict[str, int] = {}
        try:
            for m, (key_size, value_size) in MAPS.items():
                fd = obj_get(os.path.join(root, "maps", m))
                maps[m] = Map(m, fd, key_size, value_size)
                have = map_fdinfo(fd)
                if (have.get("key_size"), have.get("value_size")) != (key_size, value_size):
                    raise SetupError(
                        f"ebpf: pinned map {root}/maps/{m} has key/value size {have.get('key_size')}/"
                        f"{have.get('value_size')}, this build needs {key_size}/{value_size}: the pins come from"
                        f" another version of bpf/; tear its pods down with that version, or"
                        f" unload_host({root!r}, force=True)"
                    )
            for p in PROGRAMS:
                progs[p] = obj_get(os.path.join(root, "progs", p))
        except (OSError, SetupError):
            _close(maps, progs)
            raise
        return cls(root, maps, progs, compiled, load_ms)

    @classmethod
    def open_or_load(cls, root: str, cgroup: str, build: str) -> HostPrograms:
        """Reuse the pinned host programs under ``root`` (pinned from the sources of ``build``), or
        compile, load, pin and attach them once.

        Partly pinned (someone removed a pin, an earlier load died): missing cgroup
        links are re-created from the pinned programs; missing maps or programs mean
        a clean reload when no pod is registered, else ``SetupError`` (a reload would
        drop the registered pods' capture).
        """
        ensure_bpffs(root)
        with host_lock(root) as lock_fd:
            missing = missing_pins(root, build)
            if not missing:
                return cls.open_pinned(root)
            objs = [m for m in missing if not m.startswith("links/")]
            if not objs:
                repair_links(root, cgroup, [m.split("/", 1)[1] for m in missing])
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
            require_cgroup(cgroup)
            from .launch import LoaderDied, run_loader

            t0 = time.perf_counter()
            try:
                hint = run_loader(root, cgroup, lock_fd)
            except LoaderDied:
                unpin_all(root)  # (whatever it pinned before it died)
                raise
            ms = (time.perf_counter() - t0) * 1e3
            log.info("ebpf: compiled and pinned host programs under %s in %.0f ms (loader process)", root, ms)
            h = cls.open_pinned(root, compiled=True, load_ms=ms)
            h.pool_hint[0] = hint  # (where this process's next batch starts, as after its own refill)
            return h

    @classmethod
    def recover(cls, root: str) -> HostPrograms | None:
        """A handle on the host objects under ``root`` when pins of maps or programs are gone (removed
        by hand, a half-done unload): what is still attached keeps its programs, and they keep their
        maps. Programs come from their pins or from the pinned links (the cgroup links and the pods'
        sk_lookup links: those reach ``rdr_sk_lookup`` through ``lookup_prog``), maps from their pins
        or by name from those programs. ``inventory`` is used by no program: without its pin it is
        gone, and a pod's entries are then found by a walk of the maps. None if no ``pods`` map can be
        found (nothing of ours can capture). The caller closes it."""
        lib, ffi = NATIVE.lib, NATIVE.ffi
        progs: dict[str, int] = {}
        seeds: list[int] = []
        maps: dict[str, Map] = {}

        def add_map(name: str, fd: int) -> bool:
            if name in maps or name not in MAPS:
                return False
            have = map_fdinfo(fd)
            if (have.get("key_size"), have.get("value_size")) != MAPS[name]:
                return False
            maps[name] = Map(name, fd, *MAPS[name])
            return True

        try:
            for name in PROGRAMS:
                with contextlib.suppress(OSError):
                    progs[name] = obj_get(os.path.join(root, "progs", name))
            for name in CGROUP_PROGRAMS:
                if name not in progs:
                    fd = link_prog_fd(os.path.join(root, "links", name))
                    if fd is not None:
                        progs[name] = fd
            with contextlib.suppress(FileNotFoundError):
                for n in os.listdir(os.path.join(root, "pods")):
                    fd = link_prog_fd(os.path.join(root, "pods", n))
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
                    mfd = fd_by_id("map", ids[i])
                    if mfd is None:
                        continue
                    buf = ffi.new("char[16]")
                    name = ffi.string(buf).decode() if lib.rdr_bpf_map_name(mfd, buf) == 0 else ""
                    if not add_map(name, mfd):
                        os.close(mfd)
                        continue
                    if name == "lookup_prog" and "rdr_sk_lookup" not in progs:
                        v = maps[name].lookup(U32.pack(0))  # a program array answers with the program's id
                        main = None if v is None else fd_by_id("prog", U32.unpack(v)[0])
                        if main is not None:
                            progs["rdr_sk_lookup"] = main
                            todo.append(main)
        finally:
            for fd in seeds:
                os.close(fd)
        if "pods" not in maps:
            _close(maps, progs)
            return None
        return cls(root, maps, progs)


def _close(maps: dict[str, Map], progs: dict[str, int]) -> None:
    for fd in [*(m.fd for m in maps.values()), *progs.values()]:
        with contextlib.suppress(OSError):
            os.close(fd)


def count_pods(root: str) -> int | None:
    """How many pods are registered under ``root``; ``None`` if that can't be told.

    Without the ``pods`` pin: the map the attached programs still use (``HostPrograms.recover``),
    else the per-pod link pins; unknown while cgroup links are pinned (they may serve outbound-only
    pods).
    """
    try:
        fd = obj_get(os.path.join(root, "maps", "pods"))
    except OSError:
        r = HostPrograms.recover(root)
        if r is not None:
            try:
                return len(r.store.cookies())
            finally:
                r.close()
        try:
            pod_links = [n for n in os.listdir(os.path.join(root, "pods")) if n.endswith(LINK_SUFFIX)]
        except FileNotFoundError:
            pod_links = []
        if pod_links:
            return len(pod_links)
        try:
            return None if os.listdir(os.path.join(root, "links")) else 0
        except FileNotFoundError:
            return 0
    try:
        return sum(1 for _ in Map("pods", fd, *MAPS["pods"]).keys())
    finally:
        os.close(fd)


def attach_to_cgroup(root: str, cgroup: str, progs: dict[str, int]) -> None:
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


def repair_links(root: str, cgroup: str, names: list[str]) -> None:
    """Re-create the missing cgroup links ``names`` from the pinned programs."""
    progs: dict[str, int] = {}
    try:
        for name in names:
            progs[name] = obj_get(os.path.join(root, "progs", name))
        attach_to_cgroup(root, cgroup, progs)
    finally:
        for fd in progs.values():
            os.close(fd)


def map_fdinfo(fd: int) -> dict[str, int]:
    """key_size, value_size, map_id ... of a map fd, from /proc/self/fdinfo (no BPF_OBJ_GET_INFO needed)."""
    out: dict[str, int] = {}
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
        for line in f:
            k, _, v = line.partition(":")
            v = v.strip()
            if v.isdigit():
                out[k.strip()] = int(v)
    return out


def host_problems(root: str, cgroup: str, build: str, h: HostPrograms | None) -> list[str]:
    """What is wrong with the host part every pod depends on: pins missing, cgroup links detached,
    attached elsewhere or running another program, ``lookup_prog`` not holding ``rdr_sk_lookup``,
    a map's program (``rdr_sk_msg`` on ``pairs``) not attached to it."""
    out: list[str] = []
    for m in missing_pins(root, build):
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
    for name in CGROUP_PROGRAMS:
        path = os.path.join(root, "links", name)
        info = pinned_link_info(path)
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
    for name, mname in MAP_ATTACHED.items():
        if h is None or mname not in h.maps or name not in h.progs:
            continue
        try:
            there = attached_progs(h.maps[mname].fd, PROGRAMS[name][1])
        except OSError as e:
            out.append(f"{root}/maps/{mname}: can't tell which program is attached to it ({e.strerror})")
            continue
        if prog_id(h.progs[name]) not in there:
            out.append(f"{root}/maps/{mname} does not run {name} (the sockets paired from now on send over TCP)")
    return out


__all__ = ["HostPrograms", "count_pods", "attach_to_cgroup", "repair_links", "map_fdinfo", "host_problems"]
