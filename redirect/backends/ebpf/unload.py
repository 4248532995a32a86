"""Removing the host part (``unload_host``): where the host side (its pins, the process's handles) and
the per-pod side (the tc filters of pods that forward) meet.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ...errors import RedirectError, SetupError
from ...kernel import locks
from ...kernel import netns as _netns
from ..base import EBPF_DEFAULT_ROOT
from .abi import POOL_SLOT
from .host import PROCESS, HostPrograms, collect_garbage, count_pods, registered_pods, resolve_root
from .host.pins import host_lock, lock_name, unpin_all
from .pod import detach_all

log = logging.getLogger("redirect.ebpf")


def unload_host(root: str | None = None, force: bool = False) -> bool:
    """Remove the host programs, maps and cgroup links. Refuses while pods are registered.

    ``force=True`` removes them anyway (the registered pods lose capture at once).
    True if anything was removed.
    """
    r = resolve_root(root)
    with host_lock(r):
        if not force:
            collect_garbage(r)
        pods = [] if force else registered_pods(r)
        if pods:
            raise SetupError(
                f"ebpf: {len(pods)} pod(s) still registered under {r} (netns cookies {pods[:5]}): tear them down first"
            )
        if not force and os.path.isdir(r) and PROCESS.host(r, load=False) is None:
            n = count_pods(r)  # some pins are missing: count what can be counted
            if n is None or n:
                raise SetupError(
                    f"ebpf: host pins under {r} are incomplete (missing: {', '.join(PROCESS.missing_pins(r))}) and"
                    f" pods may still be registered; tear them down, or unload_host({r!r}, force=True)"
                )
        if force:
            h = PROCESS.host(r, load=False)
            if h is not None:
                _release_forwarding(h)
        PROCESS.forget(r)
        existed = os.path.exists(r)
        unpin_all(r)
        if r != EBPF_DEFAULT_ROOT:  # a scratch root (tests): leave no lock file behind either
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(locks.run_dir_path(), lock_name(r)))
        return existed


def force_unload_host(root: str | None = None) -> bool:
    """``unload_host(root, force=True)``: for cleanup after failures."""
    return unload_host(root, force=True)


def _release_forwarding(h: HostPrograms) -> None:
    """Before a forced unload: our tc filters off the interfaces of the pods still registered
    (found by their netns inodes among the namespaces of processes and ``/run/netns``), then every
    pod's policy deleted, so that a filter left where its netns could not be found (held only by
    an fd) runs a program that takes nothing. Unlike the pods' links, the filters are not pinned:
    they live in the pods' namespaces, with the programs they run."""
    slots = h.maps.get("lookup_slots")
    if slots is None:
        return
    inodes = {int(POOL_SLOT.unpack(v)[1]) for k in list(slots.keys()) if (v := slots.lookup(k)) is not None}
    for path in _netns_paths(inodes):
        try:
            with _netns.enter(path):
                detach_all()
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


__all__ = ["unload_host", "force_unload_host"]
