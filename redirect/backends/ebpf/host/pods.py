"""The pods' records in the host maps, keyed by netns cookie: what the per-pod side (``..pod``) reads,
writes and removes through, and all it sees of the host side (``PodStore``).

A pod's records: its policy (``pods``), its ``ports`` and ``cidrs`` entries listed by its
``inventory``, the proxy's listeners (``listeners``), and its ``sk_lookup`` link, pinned at
``<root>/pods/<cookie>-sk_lookup`` and running a program of the pool (``.pool``) whose slot holds the
cookie. ``read`` reads them back through the inventory, ``write`` writes a difference in one native
call (``rdr_ebpf_pod_write``, native/pod_setup.c: the fresh-pod call writes through it too),
``remove`` deletes them all: each O(that pod's entries), never a walk of the host maps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ....errors import SetupError
from ..abi import (
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
from . import pool
from .syscalls import (
    NATIVE,
    Map,
    detach_pinned,
    link_info,
    link_target,
    obj_get,
    pinned_link_info,
    prog_id,
    tcp_diag_ok,
)

#: Bounds a walk of a generation written without a count (a pod's entries are far fewer).
_MAX_CHUNKS = 1 << 16

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


@dataclass(frozen=True)
class PodWrite:
    """What ``PodStore.write`` is to make a pod have: its entries (``INV_*`` -> keys), its policy
    (inventory fields zero), whether it captures inbound (else its listener entries go)."""

    entries: Mapping[int, frozenset[bytes]]
    policy: bytes
    inbound: bool


class PodStore:
    """The host maps as one pod's setup, check and teardown use them: the per-pod side's one view of
    a handle on the host programs (``programs.HostPrograms.store``), living as long as it.

    ``native`` is the ``struct rdr_host_maps`` the native writer takes (map fds, the pool's state,
    the tc programs, the pin dir); ``memo`` keeps what the per-pod side computed for an intent on
    these maps (its packed entries, its fresh-pod request), gone with the handle; ``ok`` and
    ``watch`` say whether the handle may be used without looking at the pins again
    (``lifetime.Process.host``)."""

    def __init__(self, root: str, maps: dict[str, Map], progs: dict[str, int], native: Any, hint: Any,
                 compiled: bool = False, load_ms: float = 0.0) -> None:
        self.root, self.native, self.hint, self.compiled, self.load_ms = root, native, hint, compiled, load_ms
        self.pods_dir = os.path.join(root, "pods")
        self._maps, self._progs = maps, progs
        self._tc_ids: tuple[int, int] | None = None
        #: What the per-pod side computed for an intent on these maps (``pod.entries.remembered``).
        self.memo: dict[Hashable, Any] = {}
        #: (intent, its ``pod.fresh.FreshPodTemplate``) of the last fresh pod set up on these maps: the
        #: next pod of the same intent finds it without hashing the intent.
        self.fresh_last: tuple[Any, Any] | None = None
        self._tcp_diag: bool | None = None
        #: The root's inotify fd on the host pin dirs (not ours to close), -1 without one.
        self.watch = -1
        #: Every pin was there when the process last looked, and the pin dirs were all watched then.
        self.ok = False

    def trusted(self) -> bool:
        """Nothing of the host pins changed since the process last found them all: one read."""
        return self.ok and self.watch >= 0 and NATIVE.lib.rdr_watch_pending(self.watch) == 0

    # --- one pod -------------------------------------------------------------------------
    def policy(self, cookie: int) -> bytes | None:
        """The pod's policy entry (None: no pod of that cookie)."""
        return self._maps["pods"].lookup(U64.pack(cookie))

    def cookies(self) -> list[int]:
        """The netns cookies of the pods registered here."""
        return [U64.unpack(k)[0] for k in self._maps["pods"].keys()]

    def read(self, cookie: int) -> PodState:
        """The pod's policy and its entries, by its inventory: O(entries of this pod).

        An entry counts only if it is in its map, so entries deleted behind our back show as
        missing and the next ``apply`` rewrites them.
        """
        policy = self.policy(cookie)
        st = PodState(policy, {m: set() for m in INV_MAPS}, [])
        if "inventory" not in self._maps:  # its pin is gone (``recover``): a walk of the maps finds them
            for m, off in ((INV_PORTS, 0), (INV_CIDRS, 8)):  # either generation (``pod_keys``)
                st.entries[m] = {k for k in self._maps[INV_MAPS[m]].keys()
                                 if U64.unpack(k[off : off + 8])[0] & ~GEN_BIT == cookie}
            return st
        if policy is None:  # an interrupted first write may have left either half
            for half in (0, 1 << 31):
                self._read_half(cookie, half, None, st.leftover_inv, st.leftover)
            return st
        v = POLICY.unpack(policy)
        base, n = v[P_INV_BASE], v[P_N_INV]
        found: list[tuple[int, bytes]] = []
        self._read_half(cookie, base, n, st.inv_keys, found)
        for m, k in found:
            if self._maps[INV_MAPS[m]].lookup(k) is not None:
                st.entries[m].add(k)
        # The other half is empty unless a write to it was interrupted: one lookup finds out.
        if self._maps["inventory"].lookup(INV_KEY.pack(cookie, base ^ (1 << 31), 0)) is not None:
            self._read_half(cookie, base ^ (1 << 31), None, st.leftover_inv, st.leftover)
        return st

    def _read_half(self, cookie: int, base: int, n: int | None, inv_keys: list[bytes],
                   out: list[tuple[int, bytes]]) -> None:
        """The keys listed by the pod's inventory entries at ``base`` (``n`` keys, or, with None, as
        many entries as are there in a row): (map, key) into ``out``, the entries' keys into
        ``inv_keys`` (those of ``n`` whether present or not)."""
        inv = self._maps["inventory"]
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

    def has_entry(self, inv_map: int, key: bytes) -> bool:
        """Whether ``key`` is in the map ``inv_map`` (``INV_PORTS``, ``INV_CIDRS``): ``check`` reads the
        maps back, not only the inventory (an entry deleted by hand is drift)."""
        return self._maps[INV_MAPS[inv_map]].lookup(key) is not None

    def drop_leftovers(self, st: PodState) -> None:
        """Delete what an interrupted write left in the generation the pod's policy does not read:
        inert there, and in the way of the next write to it (a key it no longer wants would become
        live with that write's policy)."""
        for m, k in st.leftover:
            self._maps[INV_MAPS[m]].delete(k)
        for ik in st.leftover_inv:
            self._maps["inventory"].delete(ik)
        st.leftover, st.leftover_inv = [], []

    def write(self, cookie: int, want: PodWrite, old: PodState, base: int, listeners: dict[int, int],
              link_netns: int, netns_ino: int = 0, tc_ifs: list[int] | None = None, slot_now: int | None = None,
              add_v6: bytes | None = None, addr: tuple[int, int] = (0, 0)) -> None:
        """Make the pod ``cookie`` have ``want`` where it has ``old``, in one native call
        (``rdr_ebpf_pod_write``): the address ``add_v6`` on lo (``addr``: its protocol and flags),
        the inventory at ``base``, the keys ``old`` lacks, the proxy's ``listeners`` (family -> fd),
        the pod's sk_lookup link on ``link_netns`` (-1: it has one; its netns inode ``netns_ino``)
        with a pool slot claimed for it, our tc filters on the interfaces ``tc_ifs`` of the calling
        thread's netns with that slot (or ``slot_now``, its link's, when it has one), the policy
        last; then what only ``old`` has goes. A failure undoes it all: ``SetupError``."""
        ffi, lib = NATIVE.ffi, NATIVE.lib
        items = [(m, k) for m, keys in want.entries.items() for k in sorted(keys)]
        stale = [(m, k) for m, had in old.entries.items() for k in sorted(had - want.entries[m])]

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
        w = ffi.new("struct rdr_pod_write *")
        w.host = self.native
        w.netns_ino = netns_ino
        low = ffi.new("int *")
        w.pool_low = low
        v6 = ffi.new("uint8_t[16]", add_v6) if add_v6 is not None else ffi.NULL
        w.add_v6, (w.addr_proto, w.addr_flags), w.nl = v6, addr, -1
        w.cookie, w.entries, w.n_entries, w.inv_base = cookie, ents, len(items), base
        w.listener_fd[0], w.listener_fd[1] = listeners.get(4, -1), listeners.get(6, -1)
        w.link_netns = link_netns
        w.policy, w.update_flags = policy, 0  # BPF_ANY: a new config replaces the old one's entries
        w.stale, w.n_stale, w.old_inv, w.n_old_inv = gone, len(stale), old_inv, len(old.inv_keys)
        w.drop_listeners, w.new_pod = not want.inbound, old.policy is None
        tcs = ffi.new("int[]", max(len(tc_ifs or ()), 1))
        for i, idx in enumerate(tc_ifs or ()):
            tcs[i] = idx
        w.tc_ifs, w.n_tc = tcs, len(tc_ifs or ())
        w.slot_now = -1 if slot_now is None else slot_now
        blame = w.tc_blame = ffi.new("struct rdr_tc_blame *")
        rc = lib.rdr_ebpf_pod_write(w)
        if rc == 0 and low[0]:
            self.refill()  # it found no slot queued free: the next batch, ahead of the pods that come next
        if rc == lib.RDR_POD_FAULT:
            raise SetupError(f"injected fault at {os.environ.get('REDIRECT_FAULT')}")
        if rc < 0:
            raise SetupError(setup_failed(rc, blame))

    def remove(self, cookie: int) -> bool:
        """Everything of the pod ``cookie`` in the maps, and its link: O(its entries), from any netns."""
        st = self.read(cookie)
        removed = self._maps["pods"].delete(U64.pack(cookie))  # first: switches capture off at once
        removed |= bool(st.leftover_inv)
        self.drop_leftovers(st)
        for m, keys in st.entries.items():
            for k in keys:
                removed |= self._maps[INV_MAPS[m]].delete(k)
        for ik in st.inv_keys:
            self._maps["inventory"].delete(ik)
        for fam in (4, 6):
            for kind in (LISTENER_INBOUND, LISTENER_OUTBOUND):
                removed |= self.drop_listener(cookie, fam, kind)
        removed |= self.drop_link(cookie)
        return bool(removed)

    # --- the proxy's listeners ---------------------------------------------------------------
    def has_listener(self, cookie: int, family: int, kind: int = LISTENER_INBOUND) -> bool:
        return self._maps["listeners"].lookup(LISTENER_KEY.pack(cookie, AF[family], kind)) is not None

    def add_listener(self, cookie: int, family: int, kind: int, fd: int) -> bool:
        """Register the proxy's listening socket ``fd`` unless one is: True if this did."""
        key = LISTENER_KEY.pack(cookie, AF[family], kind)
        if self._maps["listeners"].lookup(key) is not None:
            return False
        self._maps["listeners"].update(key, U64.pack(fd))
        return True

    def drop_listener(self, cookie: int, family: int, kind: int) -> bool:
        return self._maps["listeners"].delete(LISTENER_KEY.pack(cookie, AF[family], kind))

    # --- the pod's link --------------------------------------------------------------------
    def link_path(self, cookie: int) -> str:
        """Where the pod's sk_lookup link is pinned (native/pod_setup.c pins it there)."""
        return _link_in(self.pods_dir, cookie)

    def link_target(self, cookie: int) -> int | None:
        """``syscalls.link_target`` of the pod's link: its netns inode, 0 detached, None no pin."""
        return link_target(self.link_path(cookie))

    def link_info(self, cookie: int, strict: bool = False) -> dict[str, int] | None:
        """``syscalls.link_info`` of the pod's link: None when there is none or it can't be read (with
        ``strict``: only when there is none; one that can't be read is an ``OSError``)."""
        if not strict:
            return pinned_link_info(self.link_path(cookie))
        try:
            fd = obj_get(self.link_path(cookie))
        except FileNotFoundError:
            return None
        try:
            return link_info(fd)
        finally:
            os.close(fd)

    def link_slot(self, cookie: int) -> int | None:
        """The pool slot of the pod's link (None: none, or not ours)."""
        info = self.link_info(cookie)
        return None if info is None else pool.prog_slot(info["prog_id"])

    def link_cookie(self, cookie: int) -> int | None:
        """The netns cookie the program of the pod's link serves (None: none, or not ours)."""
        info = self.link_info(cookie)
        return None if info is None else self.prog_cookie(info["prog_id"])

    def prog_cookie(self, prog: int) -> int | None:
        return pool.prog_cookie(self._maps.get("lookup_slots"), prog)

    def drop_link(self, cookie: int) -> bool:
        """Detach and unpin the pod's link, then release its pool slot. True if one was there."""
        path = self.link_path(cookie)
        if not os.path.lexists(path):
            return False
        prog = detach_pinned(path)
        pool.release(self._maps.get("lookup_slots"), self._maps.get("lookup_free"), cookie, prog)
        return True

    # --- the host's programs, as a pod's state refers to them ---------------------------------------
    def tc_program_ids(self) -> tuple[int, int]:
        """The ids of the host's tc programs (what our filters on a pod's interfaces run; 0: not found)."""
        if self._tc_ids is None:
            ids = program_ids({n: fd for n, fd in self._progs.items() if n in ("rdr_tc_ingress", "rdr_tc_egress")})
            self._tc_ids = (ids.get("rdr_tc_ingress", 0), ids.get("rdr_tc_egress", 0))
        return self._tc_ids

    def program_ids(self) -> dict[str, int]:
        """The host programs' ids by name (``show``)."""
        return program_ids(self._progs)

    def tcp_diag(self) -> bool:
        """Whether sock_diag answers for TCP here (``syscalls.tcp_diag_ok``), asked once."""
        if self._tcp_diag is None:
            self._tcp_diag = tcp_diag_ok()
        return self._tcp_diag

    def refill(self) -> None:
        """The pool's next batch (``pool.refill``), after a setup found no slot queued free."""
        pool.refill(self.native, self.hint)


_PROTOCOLS = {0x0003: "all", 0x0800: "ip", 0x86DD: "ipv6", 0x0806: "arp", 0x8100: "802.1Q"}


def in_the_way(blame: Any) -> str:
    """What held our tc filters' place on an interface (a ``struct rdr_tc_blame`` that
    ``rdr_tc_attach`` filled in when it failed), for an error message: "" when nothing was found."""
    lib, ffi = NATIVE.lib, NATIVE.ffi
    if not blame.ifindex or blame.what not in (lib.RDR_TC_BLAME_FILTER, lib.RDR_TC_BLAME_QDISC,
                                               lib.RDR_TC_BLAME_LINK):
        return ""
    kind = ffi.string(blame.kind).decode(errors="replace") or "?"
    where = f"interface {ffi.string(blame.ifname).decode(errors='replace') or '?'} (ifindex {blame.ifindex})"
    if blame.what == lib.RDR_TC_BLAME_LINK:
        return (f"the pod forwards on {where}, whose link type ({blame.protocol}) has a header eBPF capture of"
                " forwarded TCP cannot parse (it parses Ethernet and headerless IP); use backend iptables or"
                " nftables, or exclude the interface")
    if blame.what == lib.RDR_TC_BLAME_QDISC:
        return (f"{where} has a qdisc of kind {kind!r} where the clsact qdisc of our tc filters goes (not ours:"
                " left alone)")
    proto = _PROTOCOLS.get(blame.protocol, f"{blame.protocol:#06x}")
    handle = f", handle {blame.handle:#x}" if blame.handle else ""
    return (f"{where} has a tc filter that is not ours at our priority {lib.RDR_TC_PRIO} on its"
            f" {'egress' if blame.egress else 'ingress'} (kind {kind!r}, protocol {proto}{handle}; left alone)")


def setup_failed(rc: int, blame: Any) -> str:
    """The message of a pod's write (or fresh-pod call) that failed with ``rc`` (-errno) and was
    undone; ``blame``: its ``struct rdr_tc_blame``."""
    why = in_the_way(blame)
    return f"ebpf: setup failed and was undone: {why + ': ' if why else ''}{os.strerror(-rc)}"


#: What a pod's link pin's name has after its netns cookie (``rdr_pod_link_suffix``, the name
#: native/pod_setup.c pins it by).
LINK_SUFFIX: str = NATIVE.ffi.string(NATIVE.lib.rdr_pod_link_suffix).decode()


def _link_in(pods_dir: str, cookie: int) -> str:
    """The pin of the pod ``cookie``'s link in ``pods_dir``."""
    return f"{pods_dir}/{cookie}{LINK_SUFFIX}"


def pod_link(root: str, cookie: int) -> str:
    """Where the link of the pod ``cookie`` is pinned under ``root`` (``PodStore.link_path``)."""
    return _link_in(os.path.join(root, "pods"), cookie)


def program_ids(progs: dict[str, int]) -> dict[str, int]:
    """Program name -> id, of open program fds."""
    out = {}
    for n, fd in progs.items():
        with contextlib.suppress(OSError):
            out[n] = prog_id(fd)
    return out


__all__ = ["PodState", "PodWrite", "PodStore", "LINK_SUFFIX", "in_the_way", "pod_link", "program_ids",
           "setup_failed"]
