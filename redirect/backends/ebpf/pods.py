"""One pod's objects in the host maps, keyed by its netns cookie: reading them back through its
inventory (``read_pod``), its ``sk_lookup`` link (pinned at ``<root>/pods/<cookie>-sk_lookup``, running
a program of its own that holds the cookie), and removing them all (``_remove_pod``): O(its entries).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .abi import (
    AF,
    INV_CHUNK,
    INV_CIDRS,
    INV_KEY,
    INV_KEY_MAX,
    INV_KEY_SIZE,
    INV_MAPS,
    INV_PORTS,
    INV_VAL,
    LISTENER_KEY,
    P_INV_BASE,
    P_N_INV,
    POLICY,
    SK_LOOKUP_ATTACH,
    U64,
)
from .syscalls import _check, _detach_pinned, _native, _pinned_link_info, link_create

if TYPE_CHECKING:
    from .host import HostPrograms


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


def read_pod(h: HostPrograms, cookie: int) -> PodState:
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


def _pod_link(root: str, cookie: int) -> str:
    return os.path.join(root, "pods", f"{cookie}-sk_lookup")


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


def _link_prog_cookie(path: str) -> int | None:
    """The netns cookie held by the program of the link pinned at ``path`` (None: none, or not ours)."""
    info = _pinned_link_info(path)
    return None if info is None else _lookup_prog_cookie(info["prog_id"])


def _remove_pod(h: HostPrograms, cookie: int) -> bool:
    """Everything of the pod ``cookie`` in the maps, and its link: O(its entries), from any netns."""
    st = read_pod(h, cookie)
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
