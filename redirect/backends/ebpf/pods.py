"""One pod's objects in the host maps, keyed by its netns cookie: reading them back through its
inventory (``read_pod``), its ``sk_lookup`` link (pinned at ``<root>/pods/<cookie>-sk_lookup``, running
a program of its own from the pool, ``.pool``, whose slot holds the cookie), and removing them all
(``_remove_pod``): O(its entries).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import SetupError
from .abi import (
    AF,
    GEN_BIT,
    INV_CHUNK,
    INV_CIDRS,
    INV_KEY,
    INV_KEY_MAX,
    INV_KEY_SIZE,
    INV_MAPS,
    INV_PORTS,
    INV_VAL,
    LISTENER_INBOUND,
    LISTENER_KEY,
    LISTENER_OUTBOUND,
    P_INV_BASE,
    P_N_INV,
    POLICY,
    U64,
)
from .pool import refill, release
from .syscalls import _native, link_info, obj_get

if TYPE_CHECKING:
    from .entries import PodEntries
    from .host import HostPrograms


@dataclass
class PodState:
    """What one pod has installed, read back through its inventory."""

    policy: bytes | None
    entries: dict[int, set[bytes]]  # INV_* -> keys
    inv_keys: list[bytes]
    # What an interrupted write left in the generation the policy does not read (inert there):
    # its inventory entries and the keys they list.
    leftover_inv: list[bytes] = field(default_factory=list)
    leftover: list[tuple[int, bytes]] = field(default_factory=list)

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
        for m, off in ((INV_PORTS, 0), (INV_CIDRS, 8)):  # either generation (``pod_keys``)
            st.entries[m] = {k for k in h.maps[INV_MAPS[m]].keys()
                             if U64.unpack(k[off : off + 8])[0] & ~GEN_BIT == cookie}
        return st
    inv = h.maps["inventory"]
    if policy is None:  # an interrupted first write may have left either half
        for half in (0, 1 << 31):
            _read_half(h, cookie, half, None, st.leftover_inv, st.leftover)
        return st
    v = POLICY.unpack(policy)
    base, n = v[P_INV_BASE], v[P_N_INV]
    found: list[tuple[int, bytes]] = []
    _read_half(h, cookie, base, n, st.inv_keys, found)
    for m, k in found:
        if h.maps[INV_MAPS[m]].lookup(k) is not None:
            st.entries[m].add(k)
    # The other half is empty unless a write to it was interrupted: one lookup finds out.
    if inv.lookup(INV_KEY.pack(cookie, base ^ (1 << 31), 0)) is not None:
        _read_half(h, cookie, base ^ (1 << 31), None, st.leftover_inv, st.leftover)
    return st


_MAX_CHUNKS = 1 << 16  # bounds a walk of a half written without a count (a pod's entries are far fewer)


def _read_half(h: HostPrograms, cookie: int, base: int, n: int | None, inv_keys: list[bytes],
               out: list[tuple[int, bytes]]) -> None:
    """The keys listed by the pod's inventory entries at ``base`` (``n`` keys, or, with None, as
    many entries as are there in a row): (map, key) into ``out``, the entries' keys into
    ``inv_keys`` (those of ``n`` whether present or not)."""
    inv = h.maps["inventory"]
    chunks = (n + INV_CHUNK - 1) // INV_CHUNK if n is not None else _MAX_CHUNKS
    for c in range(chunks):
        ik = INV_KEY.pack(cookie, base + c, 0)
        val = inv.lookup(ik)
        if val is None and n is None:
            return
        inv_keys.append(ik)
        if val is None:
            continue
        fields = INV_VAL.unpack(val)
        raw = fields[INV_CHUNK]
        for j in range(INV_CHUNK if n is None else min(INV_CHUNK, n - c * INV_CHUNK)):
            m = fields[j]
            if m in INV_MAPS:
                out.append((m, raw[INV_KEY_MAX * j : INV_KEY_MAX * j + INV_KEY_SIZE[m]]))


def drop_leftovers(h: HostPrograms, st: PodState) -> None:
    """Delete what an interrupted write left in the generation the pod's policy does not read:
    inert there, and in the way of the next write to it (a key it no longer wants would become
    live with that write's policy)."""
    for m, k in st.leftover:
        h.maps[INV_MAPS[m]].delete(k)
    for ik in st.leftover_inv:
        h.maps["inventory"].delete(ik)
    st.leftover, st.leftover_inv = [], []


def _pod_link(root: str, cookie: int) -> str:
    return os.path.join(root, "pods", f"{cookie}-sk_lookup")


def drop_link(h: HostPrograms, cookie: int, path: str) -> bool:
    """Detach and unpin the pod's link at ``path``, then release its pool slot. True if one was there."""
    try:
        fd = obj_get(path)
    except FileNotFoundError:
        return False
    except OSError:  # something pinned there that can't be opened: unpinned all the same
        fd = -1
    prog = None
    if fd >= 0:
        try:
            with contextlib.suppress(OSError):
                prog = link_info(fd)["prog_id"]
            _native().lib.rdr_bpf_link_detach(fd)
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    release(h, cookie, prog)
    return True


def _remove_pod(h: HostPrograms, cookie: int) -> bool:
    """Everything of the pod ``cookie`` in the maps, and its link: O(its entries), from any netns."""
    st = read_pod(h, cookie)
    removed = h.pods.delete(U64.pack(cookie))  # first: switches capture off at once
    removed |= bool(st.leftover_inv)
    drop_leftovers(h, st)
    for m, keys in st.entries.items():
        for k in keys:
            removed |= h.maps[INV_MAPS[m]].delete(k)
    for ik in st.inv_keys:
        h.maps["inventory"].delete(ik)
    for fam in (4, 6):
        for kind in (LISTENER_INBOUND, LISTENER_OUTBOUND):
            removed |= h.maps["listeners"].delete(LISTENER_KEY.pack(cookie, AF[fam], kind))
    removed |= drop_link(h, cookie, _pod_link(h.root, cookie))
    return bool(removed)


def write_pod(h: HostPrograms, cookie: int, want: PodEntries, old: PodState, base: int, listeners: dict[int, int],
              link_netns: int, link_path: str, netns_ino: int = 0, tc_ifs: list[int] | None = None,
              slot_now: int | None = None) -> None:
    """Make the pod ``cookie`` have ``want`` where it has ``old``, in one native call
    (``rdr_ebpf_pod_write``, native/pod_setup.c: the fresh-pod call writes through it too): the
    inventory at ``base``, the keys ``old`` lacks, the proxy's ``listeners`` (family -> fd), the
    pod's sk_lookup link on ``link_netns`` (-1: it has one; its netns inode ``netns_ino``) with
    a pool slot claimed for it, pinned at ``link_path``, our tc filters on the interfaces
    ``tc_ifs`` of the calling thread's netns with that slot (or ``slot_now``, its link's, when it
    has one: ``.tc``), the policy last; then what only ``old`` has goes. A failure undoes it all:
    ``SetupError``."""
    nat = _native()
    ffi, lib = nat.ffi, nat.lib
    by_map = want.by_map()
    items = [(m, k) for m, keys in by_map.items() for k in sorted(keys)]
    stale = [(m, k) for m, had in old.entries.items() for k in sorted(had - by_map[m])]

    def entries(pairs: list[tuple[int, bytes]], have: dict[int, set[bytes]] | None) -> Any:
        out = ffi.new("struct rdr_pod_entry[]", max(len(pairs), 1))
        for i, (m, k) in enumerate(pairs):
            out[i].map = m
            out[i].have = have is not None and k in have[m]
            ffi.memmove(out[i].key, k, len(k))
        return out

    ents, gone = entries(items, old.entries), entries(stale, None)
    old_inv = ffi.new("struct inv_key[]", max(len(old.inv_keys), 1))
    for i, ik in enumerate(old.inv_keys):
        ffi.memmove(ffi.addressof(old_inv, i), ik, len(ik))
    policy = ffi.new("struct pod_policy *")
    ffi.memmove(policy, want.policy, len(want.policy))
    pin = ffi.new("char[]", link_path.encode())
    w = ffi.new("struct rdr_pod_write *")
    m = h.maps
    w.map_pods, w.map_inventory, w.map_ports, w.map_cidrs = (m[n].fd for n in ("pods", "inventory", "ports", "cidrs"))
    w.map_listeners, w.map_lookup_netns, w.map_lookup_prog = (m[n].fd for n in ("listeners", "lookup_netns",
                                                                                 "lookup_prog"))
    w.map_slots, w.map_free, w.map_pool = (m[n].fd if n in m else -1 for n in ("lookup_slots", "lookup_free",
                                                                               "lookup_pool"))
    w.netns_ino, w.slot_hint = netns_ino, h.pool_hint[0]
    low = ffi.new("int *")
    w.pool_low = low
    w.cookie, w.entries, w.n_entries, w.inv_base = cookie, ents, len(items), base
    w.listener_fd[0], w.listener_fd[1] = listeners.get(4, -1), listeners.get(6, -1)
    w.link_netns, w.pin, w.pin_dir_fd, w.pin_name = link_netns, pin, -1, ffi.NULL
    w.policy, w.update_flags = policy, 0  # BPF_ANY: a new config replaces the old one's entries
    w.stale, w.n_stale, w.old_inv, w.n_old_inv = gone, len(stale), old_inv, len(old.inv_keys)
    w.drop_listeners, w.new_pod = not want.inbound, old.policy is None
    tcs = ffi.new("int[]", max(len(tc_ifs or ()), 1))
    for i, idx in enumerate(tc_ifs or ()):
        tcs[i] = idx
    w.tc_ifs, w.n_tc = tcs, len(tc_ifs or ())
    w.tc_prog_in, w.tc_prog_out = h.progs.get("rdr_tc_ingress", -1), h.progs.get("rdr_tc_egress", -1)
    w.slot_now = -1 if slot_now is None else slot_now
    w.prog_fds, w.n_prog_fds = h.prog_fds, h.n_prog_fds
    rc = lib.rdr_ebpf_pod_write(w)
    if rc == 0 and low[0]:
        refill(h)  # it found no slot queued free: the next batch, ahead of the pods that come next
    if rc == lib.RDR_POD_FAULT:
        raise SetupError(f"injected fault at {os.environ.get('REDIRECT_FAULT')}")
    if rc < 0:
        raise SetupError(f"ebpf: setup failed and was undone: {os.strerror(-rc)}")
