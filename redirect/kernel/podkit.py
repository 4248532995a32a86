"""Scratch pods for the demo, the tests and the benchmarks (capture itself never uses this).

A pod is a network namespace joined to a peer namespace ("the rest of the network", or a
node) by veth pairs with IPv4 and IPv6 addresses, ``lo`` up, duplicate address detection off
(addresses are usable at once) and default routes via the peer::

    link = Link("eth0", "peer0", "10.9.0.2", "10.9.0.1", "fd00:9::2", "fd00:9::1")
    with make_pod("demo-pod", "demo-peer", [link]):
        ...

Every namespace made here is removed on the way out, even when the body raises;
``live_namespaces`` lists those this process made and has not removed yet. Bare
namespaces in bulk, as a runtime hands them to CNI (the benchmarks' pods), come from
``create_netns_many`` and go with ``remove_netns_many``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from . import netlink
from . import netns as _netns

NETNS_DIR = "/run/netns"
IFA_F_NODAD = 0x02
LOOPBACK_IFINDEX = 1

_live: set[str] = set()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class Link:
    """One veth pair between a pod and its peer, with both ends' names and addresses."""

    pod_if: str
    peer_if: str
    pod_ip4: str
    peer_ip4: str
    pod_ip6: str = ""  # "": no IPv6 on this link
    peer_ip6: str = ""
    prefix4: int = 24
    prefix6: int = 64

    @property
    def subnet4(self) -> str:
        return str(ipaddress.ip_network(f"{self.pod_ip4}/{self.prefix4}", strict=False))

    @property
    def subnet6(self) -> str:
        return str(ipaddress.ip_network(f"{self.pod_ip6}/{self.prefix6}", strict=False))


def live_namespaces() -> set[str]:
    """Names of the namespaces this process made here and has not removed yet."""
    with _live_lock:
        return set(_live)


def create_netns(name: str) -> str:
    """Create ``/run/netns/<name>`` and remember it; returns the name."""
    with _live_lock:
        _live.add(name)
    _ip_batch([f"netns add {name}"])
    return name


def remove_netns(name: str) -> None:
    """Remove ``/run/netns/<name>`` (its interfaces go with it); quiet if it is already gone."""
    try:
        if os.path.lexists(os.path.join(NETNS_DIR, name)):
            _ip_batch([f"netns delete {name}"])
    finally:
        with _live_lock:
            _live.discard(name)


def netlink_in(ns: str) -> netlink.NetlinkSocket:
    """A netlink socket that lives in ``ns`` (a socket keeps the netns it was made in); the caller
    closes it."""
    with _netns.enter(ns):
        return netlink.NetlinkSocket()


def _prepare(ns: str) -> None:
    """``lo`` up, and new interfaces skip duplicate address detection, link-local included:
    neighbour discovery needs a link-local source, which stays tentative until DAD ends, so
    the first IPv6 connection would wait for it."""
    with _netns.enter(ns):
        for scope in ("all", "default"):
            with open(f"/proc/sys/net/ipv6/conf/{scope}/accept_dad", "w") as f:
                f.write("0")
        netlink.set_up(LOOPBACK_IFINDEX)


def connect(pod_nl: netlink.NetlinkSocket, peer_nl: netlink.NetlinkSocket, peer_ns: str, link: Link) -> None:
    """Add ``link``'s veth pair between the namespaces of two netlink sockets (the peer's is
    ``peer_ns``), with its addresses, up, and wait (bounded) until both ends have carrier: a
    neighbour solicitation sent before that is lost, and the first IPv6 connection would wait
    for its retransmit."""
    peer_fd = os.open(os.path.join(NETNS_DIR, peer_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        netlink.add_veth(link.pod_if, link.peer_if, peer_fd, sock=pod_nl)
    finally:
        os.close(peer_fd)
    ends = ((pod_nl, link.pod_if, link.pod_ip4, link.pod_ip6), (peer_nl, link.peer_if, link.peer_ip4, link.peer_ip6))
    up: list[tuple[netlink.NetlinkSocket, int]] = []
    for nl, ifname, ip4, ip6 in ends:
        idx = netlink.link_index(ifname, sock=nl)
        netlink.addr("add", socket.AF_INET, idx, ip4, link.prefix4, 0, sock=nl)
        if ip6:
            netlink.addr("add", socket.AF_INET6, idx, ip6, link.prefix6, 0, IFA_F_NODAD, sock=nl)
        netlink.set_up(idx, sock=nl)
        up.append((nl, idx))
    deadline = time.monotonic() + 3.0
    for nl, idx in up:
        while time.monotonic() < deadline and not netlink.link_up(idx, sock=nl):
            time.sleep(0.005)


def connect_netns(pod_ns: str, peer_ns: str, link: Link) -> None:
    """``connect`` between two namespaces by name."""
    with netlink_in(pod_ns) as pod_nl, netlink_in(peer_ns) as peer_nl:
        connect(pod_nl, peer_nl, peer_ns, link)


def _ip_batch(lines: Iterable[str], check: bool = True) -> None:
    text = "".join(line + "\n" for line in lines)
    if not text:
        return
    r = subprocess.run(["ip", "-force", "-batch", "-"], input=text.encode(), capture_output=True, timeout=300)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip -batch failed: {r.stderr.decode(errors='replace').strip()[:400]}")


def create_netns_many(names: Sequence[str]) -> list[str]:
    """Create ``/run/netns/<name>`` for each of ``names`` with one ``ip -batch`` (hundreds at a
    runtime's pace, one process for all), remember them, and bring ``lo`` up in each; returns
    the names. Bare namespaces, as a runtime hands them to CNI: no links, DAD as the kernel's."""
    with _live_lock:
        _live.update(names)
    _ip_batch(f"netns add {name}" for name in names)
    for name in names:
        with _netns.enter(name):
            netlink.set_up(LOOPBACK_IFINDEX)
    return list(names)


def remove_netns_many(names: Iterable[str]) -> None:
    """Remove ``/run/netns/<name>`` for each of ``names`` with one ``ip -batch``; quiet for
    those already gone."""
    names = list(names)
    with _live_lock:
        _live.difference_update(names)
    _ip_batch((f"netns delete {n}" for n in names), check=False)


@contextlib.contextmanager
def make_pod(name: str, peer_name: str, links: Sequence[Link], *, make_peer: bool = True,
             peer_routes_back: bool = True) -> Iterator[None]:
    """Namespace ``name`` joined to ``peer_name`` by ``links`` (the first carries the default
    routes, both families, via the peer); both namespaces are removed on exit.

    ``make_peer=False``: the peer exists already (a node a second pod hangs off) and stays.
    ``peer_routes_back``: the peer routes everything to the pod, so it can answer any source
    the pod uses.
    """
    made: list[str] = []
    try:
        for ns in (name, peer_name) if make_peer else (name,):
            made.append(create_netns(ns))
            _prepare(ns)
        with netlink_in(name) as pod_nl, netlink_in(peer_name) as peer_nl:
            for link in links:
                connect(pod_nl, peer_nl, peer_name, link)
            m = links[0]
            netlink.default_route(socket.AF_INET, m.peer_ip4, sock=pod_nl)
            netlink.default_route(socket.AF_INET6, m.peer_ip6, sock=pod_nl)
            if peer_routes_back:
                netlink.default_route(socket.AF_INET, m.pod_ip4, sock=peer_nl)
                netlink.default_route(socket.AF_INET6, m.pod_ip6, sock=peer_nl)
        yield
    finally:
        _remove_all(made)


def _remove_all(names: list[str]) -> None:
    """Remove every namespace of ``names`` (in order) even if one fails; then raise the first error."""
    first: BaseException | None = None
    for ns in names:
        try:
            remove_netns(ns)
        except BaseException as e:  # noqa: BLE001 - the others still go; the first is raised below
            first = first or e
    if first is not None:
        raise first


__all__ = ["Link", "make_pod", "connect", "connect_netns", "create_netns", "remove_netns", "create_netns_many",
           "remove_netns_many", "netlink_in",
           "live_namespaces", "NETNS_DIR"]
