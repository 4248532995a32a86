"""What a pod's own netns holds, as its setup needs it: its cookie and addresses (``scan_netns``, one
netlink dump), the proxy's inbound listeners (a bind probe, a sock_diag dump, their fds), its links
and routes, and the intent's local address (``::6`` on lo: added by the native writer, removed here).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ....errors import SetupError
from ....kernel import netlink
from ....kernel import netns as _netns
from ....kernel import routes as rt
from ....plan.intent import INBOUND_PASSTHROUGH_V6, AnyIntent, LocalAddress
from ..abi import AF, LISTENER_INBOUND
from ..host import NATIVE, PodStore, check

LOOPBACK_IFINDEX = 1  # lo's index in every netns
#: ``::6`` on lo as ``NetnsScan.local`` lists it.
V6_ON_LO = (6, INBOUND_PASSTHROUGH_V6.split("/")[0], LOOPBACK_IFINDEX)


@dataclass(frozen=True)
class NetnsScan:
    """What one netlink socket tells of the calling thread's netns: all a pod's setup needs to know
    of it (its cookie, its addresses, whether IPv6 is on), in one address dump."""

    inode: int
    thread: int
    cookie: int
    #: (family, address, ifindex) of its addresses, loopback aside (IPv6 link-local ones included:
    #: a connection to one goes over lo, as to any of its addresses).
    local: tuple[tuple[int, str, int], ...]
    #: IPv6 is on: it has an IPv6 address (``::1`` at least; disable_ipv6 removes them all).
    v6_on: bool
    #: It has an IPv6 address of its own (``routes.own_ipv6``): the intent's ``::6`` is wanted.
    own_v6: bool
    #: The ``struct rdr_netns_scan`` it was read from (for ``listener_maybe``).
    native: Any = field(default=None, compare=False, repr=False)


def scan_netns() -> NetnsScan:
    """``NetnsScan`` of the calling thread's netns, from ``rdr_scan_netns`` (native/pod_setup.c: the
    fresh-pod call scans with it too): its cookie and one address dump."""
    sc = NATIVE.ffi.new("struct rdr_netns_scan *")
    rc = NATIVE.lib.rdr_scan_netns(sc, rt.RT_PROTO)
    if rc == -errno.E2BIG:
        raise SetupError(f"backend=ebpf: the netns has more than {NATIVE.lib.RDR_SCAN_MAX} addresses (IPv6"
                         " link-local ones included, loopback and ours aside), the most the eBPF backend"
                         " registers; nftables and iptables take any number")
    if rc == -errno.EINTR:
        raise SetupError("backend=ebpf: the netns's addresses kept changing while they were read (every dump"
                         " of them flagged inconsistent by the kernel): run setup again")
    check(rc, "scanning the netns (RTM_GETADDR)")
    buf = NATIVE.ffi.buffer
    raw = [(a.family, buf(a.addr, 4 if a.family == 4 else 16)[:], a.ifindex) for a in sc.a[0 : sc.n]]
    out = tuple((f, socket.inet_ntop(AF[f], b), i) for f, b, i in raw)
    own_v6 = any(f == 6 and rt.own_ipv6(b) for f, b, _i in raw)
    return NetnsScan(_netns.current_inode(), threading.get_ident(), int(sc.cookie), out, bool(sc.v6_on), own_v6, sc)


def families_for(it: AnyIntent, v6_on: bool) -> tuple[int, ...]:
    """The families ``it`` captures in a netns where IPv6 is on (``NetnsScan.v6_on``) or not."""
    if it.ipv6 is None:
        return (4, 6) if v6_on else (4,)
    return (4, 6) if it.ipv6 else (4,)


def unserved(store: PodStore, cookie: int, families: tuple[int, ...], kind: int = LISTENER_INBOUND) -> tuple[int, ...]:
    """The families without a registered listener of ``kind`` (``RDR_LISTENER_*``, inbound by
    default; a dual-stack IPv6 one serves IPv4 too)."""
    have = {f for f in (4, 6) if store.has_listener(cookie, f, kind)}
    return tuple(f for f in families if f not in have and not (f == 4 and 6 in have))


def listener_maybe(sc: NetnsScan, port: int, families: tuple[int, ...], tcp_diag: bool) -> bool:
    """Whether a TCP listener may take connections to ``port`` in the scanned netns, for
    ``families`` (none: False): ``rdr_inbound_listener_maybe``, the fresh-pod call's own check
    (``tcp_diag``: ``PodStore.tcp_diag``)."""
    lib = NATIVE.lib
    fams = (lib.RDR_FAM4 if 4 in families else 0) | (lib.RDR_FAM6 if 6 in families else 0)
    return bool(lib.rdr_inbound_listener_maybe(port, fams, sc.native, int(tcp_diag)))


@contextlib.contextmanager
def proxy_listeners(port: int) -> Iterator[dict[int, int]]:
    """family -> an fd of the proxy's listening socket(s) on ``port`` in this netns (closed on exit).

    Its listeners are found by inode over sock_diag (``netlink.tcp_listeners``); their fds in this
    process first, then in every process (``pidfd_getfd`` dups it).
    """
    want = netlink.tcp_listeners(port)
    found: dict[int, int] = {}
    owned: list[int] = []
    try:
        if want:
            me = str(os.getpid())

            def pids() -> Iterator[str]:
                yield me  # listing /proc (every process) only if the proxy is not us
                yield from (p for p in os.listdir("/proc") if p.isdigit() and p != me)

            for pid in pids():
                if len(found) == len(set(want.values())):
                    break
                try:
                    fds = os.listdir(f"/proc/{pid}/fd")
                except OSError:
                    continue
                for fd in fds:
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if not target.startswith("socket:["):
                        continue
                    fam = want.get(int(target[8:-1]))
                    if fam is None or fam in found:
                        continue
                    if pid == me:
                        dup = os.dup(int(fd))
                    else:
                        try:
                            pidfd = os.pidfd_open(int(pid))
                        except OSError:
                            continue
                        try:
                            dup = check(NATIVE.lib.rdr_pidfd_getfd(pidfd, int(fd)), "pidfd_getfd")
                        except OSError:
                            continue
                        finally:
                            os.close(pidfd)
                    owned.append(dup)
                    found[fam] = dup
        yield found
    finally:
        for ofd in owned:
            os.close(ofd)


def intent_addresses(it: AnyIntent, families: tuple[int, ...], own_v6: bool) -> tuple[LocalAddress, ...]:
    """The intent's addresses wanted here (as ``routes.usable_addresses``: IPv6 ones when the pod has
    an IPv6 address of its own)."""
    return tuple(a for a in it.local_addresses if a.family in families and (a.family == 4 or own_v6))


def lo_v6(adds: tuple[LocalAddress, ...] | list[LocalAddress]) -> bytes | None:
    """The one address of ``adds`` as the native writer adds it (``rdr_pod_write.add_v6``: an IPv6
    /128 on lo, what an intent adds, ``::6``); None for none. ``SetupError`` for any other shape."""
    if not adds:
        return None
    a = adds[0]
    if len(adds) > 1 or a.family != 6 or a.dev != "lo" or not a.cidr.endswith("/128"):
        raise SetupError(f"backend=ebpf: adds one IPv6 /128 address on lo, not {', '.join(str(x) for x in adds)}")
    return socket.inet_pton(socket.AF_INET6, a.cidr.split("/")[0])


def our_addresses() -> tuple[LocalAddress, ...]:
    """The addresses we added here (routing protocol ours; an intent only ever adds IPv6 ones, ::6)."""
    return tuple(rt.read_ours((6,)).addresses)


def remove_our_addresses() -> None:
    """The addresses we added, removed as the netfilter backends remove them."""
    for a in our_addresses():
        rt.remove_address(a)


_RTA_MULTIPATH, _RTN_UNICAST, _RT_TABLE_MAIN = 9, 1, 254


def links_and_routes() -> tuple[list[tuple[str, int]], list[tuple[int, str, tuple[str, ...]]]]:
    """The calling thread's netns: its links (name, ifindex) and the unicast routes of its main
    table (family, destination CIDR, the interfaces of the next hops), in the kernel's order."""
    names = netlink.link_names()
    routes: list[tuple[int, str, tuple[str, ...]]] = []
    for fam in (socket.AF_INET, socket.AF_INET6):
        for m in netlink.dump(netlink.RTM_GETROUTE, fam):
            dst_len, _src_len, _tos, table, _proto, _scope, rtype, _flags = m.fields
            table = m.u32(netlink.RTA_TABLE) or table
            if table != _RT_TABLE_MAIN or rtype != _RTN_UNICAST:
                continue
            raw = m.attrs.get(netlink.RTA_DST, bytes(4 if fam == socket.AF_INET else 16))
            dst = socket.inet_ntop(fam, raw)
            oif = m.u32(netlink.RTA_OIF)
            devs: list[str] = [names.get(oif, str(oif))] if oif else []
            mp = m.attrs.get(_RTA_MULTIPATH, b"")
            off = 0
            while off + 8 <= len(mp):  # struct rtnexthop: len, flags, hops, ifindex
                nlen, _nflags, _hops, ifindex = struct.unpack_from("=HBBi", mp, off)
                if nlen < 8:
                    break
                devs.append(names.get(ifindex, str(ifindex)))
                off += (nlen + 3) & ~3
            routes.append((4 if fam == socket.AF_INET else 6, f"{dst}/{dst_len}", tuple(dict.fromkeys(devs))))
    return [(n, i) for i, n in names.items()], routes
