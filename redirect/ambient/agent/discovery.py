"""Finding the agent's pods after a restart: its records on the node, and each one's netns.

The records come from the agent's store on the node (``store``), which only root writes; each
names its netns by what the kernel says of it (inode and cookie). For each record of this node
the netns is looked for at the path the add named, else among ``/run/netns/*`` and (unless
``--no-proc-scan``) ``/proc/*/ns/net`` by inode, and it is that netns only if its cookie is the
record's. A record whose netns is gone (none found, or written before the node's last boot) is
removed: its pod is gone, and what it still holds elsewhere (node-set entries, a proxy's
listeners) goes as it would for any pod the agent does not adopt. A record that is not one the
agent writes is logged and ignored. Records of another node (a run dir shared between nodes)
are left alone.

Nothing in a pod's netns is read to find pods: whatever is there a pod may have written. A set
of the name earlier releases kept their in-pod record under (``legacy``), in a netns the store
has no record of, is logged and ignored, whoever made it. Nothing found here stops the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

from ...errors import NetnsError, RedirectError
from ...kernel import netns as _netns
from . import legacy, store
from .logs import jlog
from .pods import INTENT, BadPod, PodRecord, from_record


@dataclass
class Found:
    """What the start found: committed pods by uid, enrolments that never committed, how many
    records (or earlier releases' in-pod records) were ignored, and how many records were removed
    because their netns is gone."""

    enrolled: dict[str, PodRecord] = field(default_factory=dict)
    unfinished: list[PodRecord] = field(default_factory=list)
    ignored: int = 0
    gone: int = 0


class NodeNetns:
    """The node's network namespaces that have a path (``/run/netns/*``, ``/proc/*/ns/net``), by
    inode; listed once, when first asked."""

    def __init__(self, scan_proc: bool) -> None:
        self.scan_proc = scan_proc
        self._by_inode: dict[int, list[str]] | None = None

    def by_inode(self) -> dict[int, list[str]]:
        if self._by_inode is None:
            paths: list[str] = []
            with contextlib.suppress(FileNotFoundError):
                paths += [os.path.join(_netns.NETNS_RUN_DIR, n) for n in sorted(os.listdir(_netns.NETNS_RUN_DIR))]
            if self.scan_proc:
                paths += [f"/proc/{p}/ns/net" for p in os.listdir("/proc") if p.isdigit()]
            out: dict[int, list[str]] = {}
            for p in paths:
                with contextlib.suppress(OSError):
                    out.setdefault(os.stat(p).st_ino, []).append(p)
            self._by_inode = out
        return self._by_inode


def key_at(path: str) -> store.Key | None:
    """(inode, cookie) of the netns at ``path``; None if there is none (or it is not a netns)."""
    try:
        return _netns.netns_key(path)
    except (RedirectError, OSError):
        return None


def open_as(path: str, key: store.Key | None = None) -> tuple[int, store.Key]:
    """Open the netns at ``path`` once: (an fd the caller closes, its key). With ``key``, it must be
    that netns (``NetnsError`` "gone or replaced" otherwise, nothing left open). Whatever is done
    to the pod then goes through that fd, so a path that changes meanwhile (a symlink swapped, a
    name deleted and re-made, a pid reused) can never make it act on another netns."""
    fd = _netns.open_netns(path)
    try:
        got = os.fstat(fd).st_ino, _netns.netns_cookie(_netns.Fd(fd))
    except BaseException:
        os.close(fd)
        raise
    if key is not None and got != key:
        os.close(fd)
        raise NetnsError(f"netns={path[:4096]!r}: gone or replaced: it is not the pod's netns (inode {key[0]}, "
                         f"cookie {key[1]}) any more")
    return fd, got


def locate(key: store.Key, recorded: str, node_netns: NodeNetns) -> str | None:
    """A path of the netns ``key``: ``recorded`` if it is still that netns, else one found by its
    inode whose cookie is the record's; None when it is gone (or has no path left)."""
    if recorded and key_at(recorded) == key:
        return recorded
    for path in node_netns.by_inode().get(key[0], ()):
        if path != recorded and key_at(path) == key:
            return path
    return None


def find(path: str, key: store.Key, scan_proc: bool = True) -> tuple[int, str]:
    """Open the netns ``key`` where it is now: at ``path`` if that is still it, else at a path
    found by its inode among ``/run/netns/*`` and (``scan_proc``) ``/proc/*/ns/net`` whose cookie is
    the key's (as the start finds a record's netns: ``locate``). (an fd the caller closes, the path
    it was opened at). A path that names another netns by now (a pid reused, a name made again) is
    only opened to be compared, never used; ``NetnsError`` if the netns has no path left (gone, or
    held only by an fd)."""
    try:
        return open_as(path, key)[0], path
    except RedirectError as e:
        missed = e
    where = locate(key, "", NodeNetns(scan_proc))
    if where is None:
        raise missed
    return open_as(where, key)[0], where  # (checked again as opened: it may have changed since)


def discover(node: str, scan_proc: bool = True) -> Found:
    """The pods of ``node`` in the agent's store whose netns is there (see above)."""
    found = Found()
    netnses = NodeNetns(scan_proc)
    recorded: set[int] = set()
    at_recorded_path: dict[str, bool] = {}  # uid -> its adopted record's netns is where the add named it
    for key, rec in store.records():
        if isinstance(rec, store.BadRecord):
            jlog(logging.ERROR, "pod record ignored: not a record the agent writes", error=str(rec))
            found.ignored += 1
            continue
        if rec.get("node") != node:
            continue  # another node's (a run dir shared between nodes): not ours to judge
        recorded.add(key[0])
        path = rec.get("netns")
        path = path if isinstance(path, str) else ""
        where = locate(key, path, netnses) if rec.get("boot") == store.boot_id() else None
        if where is None:
            store.remove(key)
            found.gone += 1
            jlog(logging.INFO, "pod netns is gone: its record removed", pod=str(rec.get("uid"))[:128],
                 netns=path[:4096], phase=str(rec.get("phase"))[:16])
            continue
        try:
            host = _netns.host_netns_reason_of(where)
            if host is not None:
                raise BadPod("record.netns", where, host)
            pod, phase = from_record(rec, where, key, node)
        except (BadPod, RedirectError) as e:
            jlog(logging.ERROR, "pod record ignored: not a record the agent writes", netns=where,
                 record=store.path_of(key), error=str(e))
            found.ignored += 1
            continue
        if phase == INTENT:
            found.unfinished.append(pod)
            continue
        other = found.enrolled.get(pod.uid)
        if other is not None:
            # Two netns enrolled for one uid (an old sandbox whose DEL never came): adopt the one
            # still at the path its add named (the first such); the other's DEL removes it.
            if at_recorded_path[pod.uid] or where != path:
                jlog(logging.ERROR, "two namespaces are recorded for one pod: adopting one", pod=pod.uid,
                     adopted=other.netns, ignored=pod.netns)
                continue
            jlog(logging.ERROR, "two namespaces are recorded for one pod: adopting one", pod=pod.uid,
                 adopted=pod.netns, ignored=other.netns)
        found.enrolled[pod.uid] = pod
        at_recorded_path[pod.uid] = where == path
    found.ignored += _untrusted_in_pod_records(netnses, recorded)
    return found


def _untrusted_in_pod_records(netnses: NodeNetns, recorded: set[int]) -> int:
    """Log each netns the store has no record of that holds an earlier release's in-pod record
    (``legacy``); how many. Nothing of it is read, and it is left where it is."""
    n = 0
    for inode, paths in netnses.by_inode().items():
        if inode in recorded:
            continue
        try:
            if _netns.host_netns_reason_of(paths[0]) is not None or not legacy.exists(paths[0]):
                continue
        except Exception:  # noqa: BLE001 - a netns that went meanwhile, or can't be read: nothing to say
            continue
        jlog(logging.WARNING, "pod record ignored: a record inside a netns is not trusted (the agent's records "
             "are on the node); no pod is adopted from it", netns=paths[0], set=legacy.SET)
        n += 1
    return n


__all__ = ["Found", "NodeNetns", "discover", "find", "locate", "key_at", "open_as"]
