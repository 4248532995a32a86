"""The connection and the pod the evaluators of ``redirect.plan.evaluate`` judge it in: what the
kernel does with a socket's connect before any rule or program sees it.

``Conn`` is a new connection (or datagram flow) seen from the pod: the unspecified address is
connected to as the loopback host, an IPv4-mapped destination is IPv4 on the wire. ``PodNet`` is
the pod's netns: its own addresses (IPv6 link-local ones included, each on its interface), its
interfaces and the routes of its main table, which say whether a destination is local (delivered
over lo), where another leaves, and which source an unbound socket gets. A link-local destination
names its interface by scope id (``fe80::1%eth0``, which the kernel binds the socket to): it is
local only when the address is on that interface.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from dataclasses import dataclass
from typing import Literal

from .lower_ebpf import LOOPBACK_IFINDEX, LocalAddr, Route

V6_LOOPBACK = ipaddress.ip_address("::1")

#: Parsed once: the evaluators run for thousands of connections of a few addresses.
ip_of = functools.lru_cache(maxsize=4096)(ipaddress.ip_address)
net_of = functools.lru_cache(maxsize=4096)(ipaddress.ip_network)


def scoped_link_local(ip: str) -> bool:
    """An IPv6 link-local address with a scope id (``fe80::1%eth0``): a socket connecting to it is
    bound to that interface."""
    a = ip_of(ip)
    return isinstance(a, ipaddress.IPv6Address) and a.is_link_local and a.scope_id is not None


def _same(a: str, b: str) -> bool:
    """The same address, scope ids aside."""
    x, y = ip_of(a), ip_of(b)
    return x.version == y.version and int(x) == int(y)


def mapped(ip: str) -> str | None:
    """The IPv4 address of an IPv4-mapped IPv6 address, else None."""
    a = ip_of(ip)
    return str(a.ipv4_mapped) if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None else None


@dataclass(frozen=True)
class Conn:
    """A new connection (TCP) or datagram flow (UDP) seen from the pod."""

    direction: Literal["out", "in"]
    proto: Literal["tcp", "udp"]
    #: Destination address and port.
    dst: str
    port: int
    #: Outbound: the owner of the socket (the connecting task's uid and primary gid), its SO_MARK.
    uid: int = 0
    gid: int = 0
    mark: int = 0
    #: Outbound: the address the socket is bound to (None: the kernel picks one).
    #: Inbound: the peer's address.
    src: str | None = None
    sport: int = 40000
    #: Inbound: the interface it arrives on.
    iface: str = "eth0"

    @property
    def family(self) -> int:
        """The socket's family (6 for an IPv4-mapped destination)."""
        return ip_of(self.dst).version

    def to_zero_as_loopback(self) -> Conn:
        """An outbound connection to the unspecified address (``0.0.0.0``, ``::``,
        ``::ffff:0.0.0.0``) as the kernel makes it: to the family's loopback host (``127.0.0.1``,
        ``::1``, ``::ffff:127.0.0.1``), over lo, before any hook or rule sees it."""
        if self.direction != "out":
            return self
        a = ip_of(self.dst)
        if a.is_unspecified:
            return dataclasses.replace(self, dst="127.0.0.1" if a.version == 4 else "::1")
        if mapped(self.dst) == "0.0.0.0":
            return dataclasses.replace(self, dst="::ffff:127.0.0.1")
        return self

    def on_the_wire(self) -> Conn:
        """The connection as its packets carry it: to the loopback host for the unspecified
        address (``to_zero_as_loopback``), an IPv4-mapped destination (and bound source) as the
        IPv4 address."""
        conn = self.to_zero_as_loopback()
        dst, src = mapped(conn.dst), mapped(conn.src) if conn.src is not None else None
        if dst is None:
            return conn
        return dataclasses.replace(conn, dst=dst, src=src or conn.src)


@dataclass(frozen=True)
class PodNet:
    """The pod's netns: its own addresses, loopback ones aside (``::6`` on lo among them when
    present; an IPv6 link-local address on its interface's ifindex), and the device (ifindex 2)
    everything non-local leaves through."""

    addrs: tuple[LocalAddr, ...] = ()
    dev: str = "eth0"
    #: Its interfaces (name, ifindex), lo aside.
    links: tuple[tuple[str, int], ...] = (("eth0", 2),)
    #: Routes of its main table through other interfaces than ``dev`` (family, CIDR, (device,)).
    routes: tuple[Route, ...] = ()

    def out_dev(self, ip: str) -> str:
        """The interface a non-local destination leaves through: a link-local one's scope, else
        the longest matching route's."""
        a = ip_of(ip)
        if scoped_link_local(ip):
            return str(a.scope_id)  # type: ignore[union-attr]
        best = max(((net.prefixlen, devs[0]) for f, c, devs in self.routes
                    if f == a.version and a in (net := net_of(c))), default=None)
        return self.dev if best is None else best[1]

    def ifindex_named(self, name: str) -> int:
        return LOOPBACK_IFINDEX if name == "lo" else dict(self.links).get(name, 2)

    def _owners(self, ip: str) -> list[int]:
        """The ifindexes of the pod's addresses equal to ``ip``: for a link-local one with a scope
        id, only on the interface it names (the kernel's strict look-up)."""
        found = [i for _f, x, i in self.addrs if _same(x, ip)]
        if scoped_link_local(ip):
            want = self.ifindex_named(str(ip_of(ip).scope_id))  # type: ignore[union-attr]
            found = [i for i in found if i == want]
        return found

    def is_local(self, ip: str) -> bool:
        """Delivered locally (routed over lo): loopback or one of the pod's addresses."""
        return ip_of(ip).is_loopback or bool(self._owners(ip))

    def ifindex_of(self, ip: str) -> int:
        """The device of a local address (sk_lookup's ingress for a connect to it)."""
        return next(iter(self._owners(ip)), LOOPBACK_IFINDEX)

    def first_own(self, family: int) -> str | None:
        """The pod's first address of ``family`` not on lo and not IPv6 link-local: the source the
        kernel picks for a destination off the pod, and the one the eBPF backend gives (its
        policy's ``src4``/``src6``, ``rdr_pod_sources``)."""
        return next((x for f, x, i in self.addrs
                     if f == family and i != LOOPBACK_IFINDEX and not ip_of(x).is_link_local), None)

    def source_for(self, conn: Conn) -> str:
        """The source address of an outbound connection: bound, or the kernel's pick (a local
        destination is its own source, except 127/8 which answers from 127.0.0.1; a link-local one
        has the link-local address of its interface)."""
        if conn.src is not None:
            return conn.src
        a = ip_of(conn.dst)
        if a.is_loopback:
            return "127.0.0.1" if a.version == 4 else "::1"
        if self.is_local(conn.dst):
            return conn.dst
        if scoped_link_local(conn.dst):
            dev = self.ifindex_named(str(a.scope_id))  # type: ignore[union-attr]
            return next((x for f, x, i in self.addrs if f == 6 and i == dev and ip_of(x).is_link_local), "::")
        return self.first_own(a.version) or ("0.0.0.0" if a.version == 4 else "::")


__all__ = ["Conn", "PodNet", "V6_LOOPBACK", "ip_of", "mapped", "net_of", "scoped_link_local"]
