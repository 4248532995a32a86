"""The host programs' lifetime in a process: the cached handle per root (``host``), kept while an
inotify watch on the pin dirs sees no change; reading through whatever is still attached
(``reading_host``); unloading (``unload_host``); and removing the pods whose netns went without a
teardown (``collect_garbage``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from ...errors import RedirectError, SetupError
from ...kernel import netns as _netns
from .abi import U64
from .host import (
    DEFAULT_ROOT,
    HostPrograms,
    _host_lock,
    _lock_name,
    _map_fdinfo,
    _root,
    _unpin_all,
    count_pods,
    missing_pins,
    recover_host,
)
from .pods import _pod_link, _remove_pod
from .pool import reclaim
from .syscalls import _link_target, _native, obj_get

log = logging.getLogger("redirect.ebpf")

_host_cache: dict[str, HostPrograms] = {}
_host_cache_lock = threading.Lock()
#: Per root, one inotify fd on its maps, progs and links dirs (a pin added or removed there, or a
#: dir going, is an event): ``host()`` trusts its handle while the fd has no events. Kept until
#: ``unload_host`` (an fd closed under a thread that reads it could be another file by then).
_watches: dict[str, int] = {}


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
            n = count_pods(r)  # some pins are missing: count what can be counted
            if n is None or n:
                raise SetupError(
                    f"ebpf: host pins under {r} are incomplete (missing: {', '.join(missing_pins(r))}) and pods may"
                    f" still be registered; tear them down, or unload_host({r!r}, force=True)"
                )
        if force:
            _release_forwarding(r)
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
            from ...kernel import locks

            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(locks.run_dir_path(), _lock_name(r)))
        return existed


def _release_forwarding(root: str) -> None:
    """Before a forced unload: our tc filters off the interfaces of the pods still registered
    (found by their netns inodes among the namespaces of processes and ``/run/netns``), then every
    pod's policy deleted, so that a filter left where its netns could not be found (held only by
    an fd) runs a program that takes nothing. Unlike the pods' links, the filters are not pinned:
    they live in the pods' namespaces, with the programs they run."""
    from . import tc
    from .pool import POOL_SLOT

    h = host(root, load=False)
    if h is None or "lookup_slots" not in h.maps:
        return
    slots = h.maps["lookup_slots"]
    inodes = {int(POOL_SLOT.unpack(v)[1]) for k in list(slots.keys()) if (v := slots.lookup(k)) is not None}
    for path in _netns_paths(inodes):
        try:
            with _netns.enter(path):
                tc.detach_all()
        except (OSError, RedirectError) as e:
            log.warning("ebpf: could not remove our tc filters in %s: %s", path, e)
    for k in list(h.pods.keys()):
        h.pods.delete(k)


def _netns_paths(inodes: set[int]) -> list[str]:
    """A path of each netns whose inode is in ``inodes`` that can be found: ``/run/netns`` names,
    then processes' namespaces (bounded: what is not found is left)."""
    found: dict[int, str] = {}
    cands = [os.path.join("/run/netns", n) for n in _listdir("/run/netns")]
    cands += [f"/proc/{p}/ns/net" for p in _listdir("/proc") if p.isdigit()]
    for path in cands[:100_000]:
        if len(found) == len(inodes):
            break
        try:
            ino = os.stat(path).st_ino
        except OSError:
            continue
        if ino in inodes and ino not in found:
            found[ino] = path
    return list(found.values())


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def force_unload_host(root: str | None = None) -> bool:
    """``unload_host(root, force=True)``: for cleanup after failures."""
    return unload_host(root, force=True)


def collect_garbage(root: str | None = None) -> list[int]:
    """Remove the pods whose netns is gone without a teardown (their sk_lookup link was
    detached by the kernel), and give back the pool slots nothing uses (``pool.reclaim``: a
    setup or teardown killed half-way). Returns the pods' netns cookies. O(registered pods)."""
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
    reclaim(h, lambda cookie: _pod_link(h.root, cookie))
    return gone
