"""Finding the agent's pods after a restart: the records in the node's network namespaces.

The namespaces are listed from ``/run/netns`` and ``/proc/*/ns/net`` and deduplicated by
inode. A record is read only from a namespace that root made or pinned:

- owned by the agent's own (the node's) user namespace (``NS_GET_USERNS``): only root on the
  node can make one; or
- bind-mounted under ``/run/netns``, as runtimes pin pod sandboxes, whichever user namespace
  owns them (only root can mount there; a symlink there pins nothing).

Any user can make a network namespace of their own (``unshare -Urn``) and put a set of our
name in it; such a record is logged and ignored, as is a record in the host's netns. What a
record says is validated like an ``add`` event (``redirect.ambient.agent.pods.from_record``); a record
that is not one the agent writes is logged and ignored. Nothing found here stops the agent.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import logging
import os
from dataclasses import dataclass, field
from typing import Union

from ...errors import RedirectError
from ...kernel import netns as _netns
from . import identity
from .logs import jlog
from .pods import INTENT, BadPod, PodRecord, from_record

NS_GET_USERNS = 0xB701  # ioctl on an nsfs fd: an fd of the user namespace that owns it


@dataclass
class Found:
    """What a scan found: committed pods by uid, enrolments that never committed, and how many
    records were ignored (not trusted or not valid)."""

    enrolled: dict[str, PodRecord] = field(default_factory=dict)
    unfinished: list[PodRecord] = field(default_factory=list)
    ignored: int = 0


def userns_of(path: str) -> tuple[int, int] | None:
    """(dev, inode) of the user namespace owning the network namespace at ``path``; None if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        ufd = fcntl.ioctl(fd, NS_GET_USERNS)
        try:
            st = os.fstat(ufd)
            return st.st_dev, st.st_ino
        finally:
            os.close(ufd)
    except OSError:
        return None
    finally:
        os.close(fd)


def same_inode(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _candidates(scan_proc: bool) -> tuple[dict[tuple[int, int], list[str]], set[str]]:
    """Every reachable netns, by (dev, inode) with its paths; and the paths pinned under /run/netns."""
    paths: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        paths += [os.path.join(_netns.NETNS_RUN_DIR, n) for n in sorted(os.listdir(_netns.NETNS_RUN_DIR))]
    if scan_proc:
        paths += [f"/proc/{p}/ns/net" for p in os.listdir("/proc") if p.isdigit()]
    by_inode: dict[tuple[int, int], list[str]] = {}
    pinned: set[str] = set()
    for p in paths:
        try:
            st = os.stat(p)
            if p.startswith(_netns.NETNS_RUN_DIR + "/"):
                lst = os.lstat(p)  # a mount point shows the netns itself; a symlink, itself
                if (lst.st_dev, lst.st_ino) == (st.st_dev, st.st_ino):
                    pinned.add(p)
        except OSError:
            continue
        by_inode.setdefault((st.st_dev, st.st_ino), []).append(p)
    return by_inode, pinned


#: What reading one netns gave: a pod (its phase, and whether its record names the path it is
#: at), "ignored" (a record not trusted or not valid), or None (no record of ours).
_Read = Union[tuple[PodRecord, str, bool], str, None]


def _read(names: list[str], ino: int, pinned: set[str], own_userns: tuple[int, int], node: str) -> _Read:
    try:
        if not pinned.intersection(names) and userns_of(names[0]) != own_userns:
            if identity.exists(names[0]):
                jlog(logging.WARNING, "pod record ignored: its netns was made by another user namespace "
                     "and is not pinned under /run/netns", netns=names[0])
                return "ignored"
            return None
        rec = identity.scan(names[0])
        if rec is None:
            return None
        host = _netns.host_netns_reason_of(names[0])
    except Exception as e:  # noqa: BLE001 - a netns that can't be read is not adopted, never fatal
        if not isinstance(e, (RedirectError, OSError)):  # gone meanwhile: the common, quiet case
            jlog(logging.WARNING, "netns could not be read: not adopted", netns=names[0], error=str(e))
        return None
    if host is not None:
        jlog(logging.ERROR, "pod record ignored: a pod is never the host", netns=names[0], error=host)
        return "ignored"
    recorded = rec.get("netns")
    recorded = recorded if isinstance(recorded, str) else ""
    named_here = bool(recorded) and same_inode(recorded, ino)
    try:
        pod, phase = from_record(rec, recorded if named_here else names[0], ino, node)
    except BadPod as e:
        if e.field == "record.node":  # another node's pod (a shared /run/netns): not ours, quietly
            return None
        jlog(logging.ERROR, "pod record ignored: not a record the agent writes", netns=names[0], error=str(e))
        return "ignored"
    return pod, phase, named_here


def discover(node: str, scan_proc: bool = True) -> Found:
    """The pods whose records name ``node``, in the namespaces root made or pinned (see above)."""
    by_inode, pinned = _candidates(scan_proc)
    own = os.stat("/proc/self/ns/user")
    found = Found()
    named: dict[str, bool] = {}  # uid -> its adopted record names the path it is at
    with concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="agent-scan") as ex:
        reads = ex.map(lambda item: _read(item[1], item[0][1], pinned, (own.st_dev, own.st_ino), node),
                       by_inode.items())
        for got in reads:
            if got == "ignored":
                found.ignored += 1
            if not isinstance(got, tuple):
                continue
            pod, phase, named_here = got
            if phase == INTENT:
                found.unfinished.append(pod)
                continue
            other = found.enrolled.get(pod.uid)
            if other is not None:
                # Two namespaces hold a record of one uid (an old sandbox still held open): adopt
                # the one whose record names where it is (the first such), the other not at all.
                if named[pod.uid] or not named_here:
                    jlog(logging.ERROR, "two namespaces hold a record of one pod: adopting one", pod=pod.uid,
                         adopted=other.netns, ignored=pod.netns)
                    continue
                jlog(logging.ERROR, "two namespaces hold a record of one pod: adopting one", pod=pod.uid,
                     adopted=pod.netns, ignored=other.netns)
            found.enrolled[pod.uid] = pod
            named[pod.uid] = named_here
    return found


__all__ = ["Found", "discover", "userns_of", "same_inode", "NS_GET_USERNS"]
