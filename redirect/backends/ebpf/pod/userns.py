"""A pod whose netns is owned by a user namespace of its own (Kubernetes ``hostUsers: false``).

The programs match the proxy's owners with ``bpf_get_current_uid_gid()``, which gives a task's ids
as the initial user namespace numbers them (in-pod uid 1337 mapped to host 201337 reads 201337),
while a config names ids as the pod sees them. netfilter's owner match translates through the
netns owner's user namespace itself (``meta skuid``: ``from_kuid_munged``). So here the config's
uid and gid ranges (``proxy_uids``, ``proxy_gids``, ``owner_groups``/``owner_groups_exclude``) are
translated through that user namespace's ``uid_map``/``gid_map`` before the intent is lowered:
a range crossing map extents is split, ids the map does not cover are dropped (no task can have
them in the pod). ``in_host_ids(it, nsfd)`` is what ``apply`` and ``check`` lower; a pod in the
initial user namespace costs one ioctl. The fresh-pod call (``native/pod_setup.c``) backs off to
the general path for such a pod. docs/backends.md, docs/kernel-facts.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from ....config import IdSpec
from ....errors import BackendUnavailable
from ....kernel import netns as _netns
from ....plan.intent import AnyIntent, Intent
from ..host import NATIVE

#: One line of a ``uid_map``/``gid_map``: (first id inside, first id outside, count).
Extent = tuple[int, int, int]
IdMap = tuple[Extent, ...]
IdRange = tuple[int, int]


def parse_map(text: str) -> IdMap:
    """A ``/proc/<pid>/uid_map`` (or ``gid_map``)'s lines as extents."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if f:
            inside, outside, count = (int(x) for x in f)
            out.append((inside, outside, count))
    return tuple(out)


def to_host(ranges: Iterable[IdRange], m: IdMap) -> list[IdRange]:
    """``ranges`` (ids inside the user namespace of map ``m``) as the ids outside: each range split at
    the map's extents, ids no extent covers dropped; sorted, adjacent ones merged."""
    out: list[IdRange] = []
    for lo, hi in ranges:
        for inside, outside, count in m:
            a, b = max(lo, inside), min(hi, inside + count - 1)
            if a <= b:
                out.append((outside + a - inside, outside + b - inside))
    out.sort()
    merged: list[IdRange] = []
    for lo, hi in out:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _spec(r: IdRange) -> IdSpec:
    return r[0] if r[0] == r[1] else r


def _ranges(ids: Iterable[IdSpec]) -> list[IdRange]:
    return [(i, i) if isinstance(i, int) else i for i in ids]


def translated(it: AnyIntent, uid_map: IdMap, gid_map: IdMap) -> AnyIntent:
    """``it`` with its owner ids as the initial user namespace numbers them, through ``uid_map`` and
    ``gid_map`` (``to_host``); an ambient intent has none."""
    if not isinstance(it, Intent):
        return it
    owners = [("uid", _spec(r)) for r in to_host(_ranges(it.owners_of("uid")), uid_map)]
    owners += [("gid", _spec(r)) for r in to_host(_ranges(it.owners_of("gid")), gid_map)]
    groups = tuple(_spec(r) for r in to_host(_ranges(it.groups), gid_map))
    return dataclasses.replace(it, proxy_owners=tuple(owners), groups=groups)  # type: ignore[arg-type]


def netns_id_maps(nsfd: int) -> tuple[IdMap, IdMap] | None:
    """The uid and gid maps of the user namespace owning the netns ``nsfd`` (as the initial one numbers
    the ids), None when that is the initial user namespace. ``BackendUnavailable`` when they cannot
    be read (then the programs could not tell the proxy's tasks apart there)."""
    ffi, lib = NATIVE.ffi, NATIVE.lib
    ub, gb = ffi.new("char[]", lib.RDR_USERNS_MAP_MAX), ffi.new("char[]", lib.RDR_USERNS_MAP_MAX)
    rc = lib.rdr_netns_id_maps(nsfd, ub, lib.RDR_USERNS_MAP_MAX, gb, lib.RDR_USERNS_MAP_MAX)
    if rc < 0:
        raise BackendUnavailable(
            "backend=ebpf: the pod's netns is owned by a user namespace of its own (hostUsers: false), whose"
            f" uid_map/gid_map could not be read ({os.strerror(-rc)}): the programs read the host's ids and"
            " could not tell the proxy's connections from the app's")
    if rc == 0:
        return None
    return parse_map(ffi.string(ub).decode()), parse_map(ffi.string(gb).decode())


def owns_ids(it: AnyIntent) -> bool:
    """Whether ``it`` matches owner ids at all (an ambient intent does not)."""
    return isinstance(it, Intent) and bool(it.proxy_owners or it.groups)


def in_host_ids(it: AnyIntent, nsfd: int) -> AnyIntent:
    """``it`` as the programs must see it in the netns ``nsfd``: its owner ids translated when a user
    namespace of its own owns the netns (``netns_id_maps``), else ``it`` itself."""
    if not owns_ids(it):
        return it
    maps = netns_id_maps(nsfd)
    return it if maps is None else translated(it, *maps)


def in_host_ids_here(it: AnyIntent) -> AnyIntent:
    """``in_host_ids`` in the calling thread's netns."""
    if not owns_ids(it):
        return it
    fd = _netns.current_fd()
    if fd is not None:
        return in_host_ids(it, fd)
    fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return in_host_ids(it, fd)
    finally:
        os.close(fd)


__all__ = ["Extent", "IdMap", "parse_map", "to_host", "translated", "netns_id_maps", "owns_ids", "in_host_ids",
           "in_host_ids_here"]
