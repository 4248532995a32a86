"""The host part's lifetime in a process: ``Process``, what a process keeps of it (a handle per pin
root, kept while an inotify watch on the pin dirs sees no change; what it asked of this host once),
and what works through those handles: reading through whatever is still attached (``reading``), the
pods registered, and removing the pods whose netns went without a teardown (``collect_garbage``).
Unloading the host part is the package's (``redirect.backends.ebpf.unload_host``): it takes the
per-pod side's tc filters off first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from .objects import build_id
from .pins import check_dirs, host_refusal, missing_pins, resolve_cgroup, resolve_root
from .pool import reclaim
from .programs import HostPrograms, map_fdinfo
from .syscalls import NATIVE, obj_get

log = logging.getLogger("redirect.ebpf")


class Process:
    """What this process keeps of the host part: its handle on the pinned objects per pin root (each
    kept while the root's inotify watch on its maps, progs and links dirs sees no pin added or
    removed: ``host``), the handle it used last (``last``: the fresh-pod path's first look), and what
    it asked of this host once (``build_id``, ``host_refusal``). One per process, ``PROCESS``, made at
    import; ``forget`` drops a root's handle and watch (``unload_host``). Threads share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, HostPrograms] = {}
        #: Per root, one inotify fd on its pin dirs (a pin added or removed there, or a dir going, is
        #: an event). Kept until ``forget`` (an fd closed under a thread that reads it could be
        #: another file by then).
        self._watches: dict[str, int] = {}
        self._refusals: dict[tuple[str, str], str | None] = {}
        self._build: str | None = None
        #: The handle ``host`` returned last (None: none yet, or forgotten).
        self.last: HostPrograms | None = None

    def build_id(self) -> str:
        """``objects.build_id`` (a digest of the sources), computed once."""
        if self._build is None:
            self._build = build_id()
        return self._build

    def host_refusal(self, root: str, cgroup: str) -> str | None:
        """``pins.host_refusal``, asked once per root and cgroup."""
        key = (root, cgroup)
        if key not in self._refusals:
            self._refusals[key] = host_refusal(root, cgroup)
        return self._refusals[key]

    def missing_pins(self, root: str) -> list[str]:
        return missing_pins(root, self.build_id())

    def cached(self, root: str) -> HostPrograms | None:
        """The handle kept for ``root``, as it is (no look at the pins)."""
        return self._handles.get(root)

    def host(self, root: str | None = None, cgroup: str | None = None, load: bool = True) -> HostPrograms | None:
        """This process's handle on the host programs under ``root`` (``None`` if not loaded and
        ``load`` is False): the kept one while nothing of its pins changed, else opened (or loaded)
        anew."""
        r = resolve_root(root)
        with self._lock:
            h = self._handles.get(r)
            if h is not None and h.store.trusted():
                self.last = h
                return h  # no pin was added or removed since we found them all (inotify)
            if h is not None:
                h.alive[0] = 0  # native calls of other threads back off until the look below is done
            check_dirs(r)  # (pins under a directory another user controls are not taken for ours)
            # Watched (and drained) before looking: a change from here on shows on the next call.
            watch, watched = self._watch(r)
            missing = self.missing_pins(r)
            if h is not None and not missing and _still_pinned(h):
                h.store.watch, h.store.ok = watch, watched
                h.alive[0] = 1
                self.last = h
                return h
            if h is not None:  # pins gone, or others in their place (another process reloaded)
                self._drop(r)
            if not load:
                # Reading (check, show, teardown) works on whatever maps and programs are pinned.
                if any(m.startswith(("maps/", "progs/")) and not m.startswith("maps/build-") for m in missing):
                    return None
                h = HostPrograms.open_pinned(r)
                h.store.watch, h.store.ok = watch, watched and not missing
            else:
                h = HostPrograms.open_or_load(r, resolve_cgroup(cgroup), self.build_id())
                watch, watched = self._watch(r)  # the load may have made the dirs; its pins are events
                h.store.watch = watch
                h.store.ok = watched and not self.missing_pins(r)
            self._handles[r] = h
            self.last = h
            return h

    def _drop(self, root: str) -> None:
        h = self._handles.pop(root, None)
        if h is not None:
            h.close()
        if self.last is h:
            self.last = None

    def forget(self, root: str) -> None:
        """Close the handle and the watch kept for ``root`` (its pins are going; unloading under
        threads still setting pods up is theirs to avoid)."""
        with self._lock:
            self._drop(root)
            watch = self._watches.pop(root, -1)
            if watch >= 0:
                os.close(watch)

    def _watch(self, root: str) -> tuple[int, bool]:
        """``root``'s watch fd (-1: none) and whether every pin dir is watched now (dirs made again
        since need their watch again); with no watch, ``host`` lists the pins on every call."""
        lib, ffi = NATIVE.lib, NATIVE.ffi
        fd = self._watches.get(root, -1)
        if fd < 0:
            fd = int(lib.rdr_watch_new())
            if fd < 0:
                log.debug("ebpf: no inotify watch on %s (%s): pins are listed on every use", root, os.strerror(-fd))
                return -1, False
            self._watches[root] = fd
        dirs = [ffi.new("char[]", os.path.join(root, d).encode()) for d in ("maps", "progs", "links")]
        watched = lib.rdr_watch_add(fd, ffi.new("const char *[]", dirs), len(dirs)) == 0
        lib.rdr_watch_changed(fd)  # what happened before now, the caller's look at the pins covers
        return fd, watched


#: This process's ``Process``.
PROCESS = Process()


def host(root: str | None = None, cgroup: str | None = None, load: bool = True) -> HostPrograms | None:
    """``PROCESS.host``: this process's handle on the host programs (``None`` if not loaded and
    ``load`` is False)."""
    return PROCESS.host(root, cgroup, load)


def _still_pinned(h: HostPrograms) -> bool:
    """``h``'s maps are the pinned ones (its pods map is: a load makes every map anew)."""
    try:
        fd = obj_get(os.path.join(h.root, "maps", "pods"))
    except OSError:
        return False
    try:
        return map_fdinfo(fd).get("map_id", -1) == map_fdinfo(h.pods.fd).get("map_id", -2)
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(root: str) -> Iterator[HostPrograms | None]:
    """``host(root, load=False)``, or while pins are gone ``HostPrograms.recover(root)`` (closed on
    exit): what reading and removing a pod work on, so a missing pin never hides a pod still captured."""
    h = host(root, load=False)
    if h is not None:
        yield h
        return
    r = HostPrograms.recover(root)
    if r is not None:
        log.warning("ebpf: host pins under %s are incomplete (missing: %s); using the objects still attached",
                    root, ", ".join(PROCESS.missing_pins(root)))
    try:
        yield r
    finally:
        if r is not None:
            r.close()


def registered_pods(root: str | None = None) -> list[int]:
    """The netns cookies of the pods registered under ``root``."""
    h = host(root, load=False)
    return [] if h is None else h.store.cookies()


def collect_garbage(root: str | None = None) -> list[int]:
    """Remove the pods whose netns is gone without a teardown (their sk_lookup link was
    detached by the kernel), and give back the pool slots nothing uses (``pool.reclaim``: a
    setup or teardown killed half-way). Returns the pods' netns cookies. O(registered pods)."""
    h = host(root, load=False)
    if h is None:
        return []
    st = h.store
    cookies = set(st.cookies())
    with contextlib.suppress(FileNotFoundError):
        cookies |= {int(n.split("-", 1)[0]) for n in os.listdir(h.pods_dir) if n.split("-", 1)[0].isdigit()}
    gone = [c for c in sorted(cookies) if st.link_target(c) == 0]
    for c in gone:
        st.remove(c)
        log.info("ebpf: removed pod with netns cookie %d: its netns is gone", c)
    m = h.maps
    reclaim(m.get("lookup_slots"), m.get("lookup_free"), m.get("lookup_pool"), int(h.pool_hint[0]), st.link_path)
    return gone


__all__ = ["Process", "PROCESS", "host", "reading", "registered_pods", "collect_garbage"]
