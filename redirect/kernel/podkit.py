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
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import netns as _netns

NETNS_DIR = "/run/netns"
IFA_F_NODAD = 0x02

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
    from pyroute2 import netns as pr_netns

    pr_netns.create(name)
    with _live_lock:
        _live.add(name)
    return name


def remove_netns(name: str) -> None:
    """Remove ``/run/netns/<name>`` (its interfaces go with it); quiet if it is already gone."""
    from pyroute2 import netns as pr_netns

    try:
        pr_netns.remove(name)
    except FileNotFoundError:
        pass
    finally:
        with _live_lock:
            _live.discard(name)


def iproute_in(ns: str) -> Any:
    """A pyroute2 ``IPRoute`` whose netlink socket lives in ``ns`` (a socket keeps the netns it
    was made in); the caller closes it."""
    from pyroute2 import IPRoute

    with _netns.enter(ns):
        return IPRoute()


def _prepare(ns: str) -> None:
    """``lo`` up, and new interfaces skip duplicate address detection, link-local included:
    neighbour discovery needs a link-local source, which stays tentative until DAD ends, so
    the first IPv6 connection would wait for it."""
    from pyroute2 import IPRoute

    with _netns.enter(ns):
        for scope in ("all", "default"):
            with open(f"/proc/sys/net/ipv6/conf/{scope}/accept_dad", "w") as f:
                f.write("0")
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")


def connect(pod_ipr: Any, peer_ipr: Any, peer_ns: str, link: Link) -> None:
    """Add ``link``'s veth pair between the namespaces of two ``IPRoute``s (the peer's is
    ``peer_ns``), with its addresses, up, and wait (bounded) until both ends have carrier: a
    neighbour solicitation sent before that is lost, and the first IPv6 connection would wait
    for its retransmit."""
    p, q = pod_ipr, peer_ipr
    p.link("add", ifname=link.pod_if, kind="veth", peer={"ifname": link.peer_if, "net_ns_fd": peer_ns})
    for ipr, ifname, ip4, ip6 in ((p, link.pod_if, link.pod_ip4, link.pod_ip6),
                                  (q, link.peer_if, link.peer_ip4, link.peer_ip6)):
        (idx,) = ipr.link_lookup(ifname=ifname)
        ipr.addr("add", index=idx, address=ip4, prefixlen=link.prefix4)
        if ip6:
            ipr.addr("add", index=idx, address=ip6, prefixlen=link.prefix6, flags=IFA_F_NODAD)
        ipr.link("set", index=idx, state="up")
    deadline = time.monotonic() + 3.0
    for ipr, ifname in ((p, link.pod_if), (q, link.peer_if)):
        (idx,) = ipr.link_lookup(ifname=ifname)
        while time.monotonic() < deadline and ipr.get_links(idx)[0].get_attr("IFLA_OPERSTATE") != "UP":
            time.sleep(0.005)


def connect_netns(pod_ns: str, peer_ns: str, link: Link) -> None:
    """``connect`` between two namespaces by name."""
    pod_ipr = iproute_in(pod_ns)
    try:
        peer_ipr = iproute_in(peer_ns)
        try:
            connect(pod_ipr, peer_ipr, peer_ns, link)
        finally:
            peer_ipr.close()
    finally:
        pod_ipr.close()


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
    from pyroute2 import IPRoute

    with _live_lock:
        _live.update(names)
    _ip_batch(f"netns add {name}" for name in names)
    for name in names:
        with _netns.enter(name), IPRoute() as ipr:
            ipr.link("set", index=1, state="up")
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
        pod_ipr = iproute_in(name)
        peer_ipr = iproute_in(peer_name)
        try:
            for link in links:
                connect(pod_ipr, peer_ipr, peer_name, link)
            m = links[0]
            pod_ipr.route("add", dst="0.0.0.0/0", gateway=m.peer_ip4)
            pod_ipr.route("add", dst="::/0", gateway=m.peer_ip6, family=socket.AF_INET6)
            if peer_routes_back:
                peer_ipr.route("add", dst="0.0.0.0/0", gateway=m.pod_ip4)
                peer_ipr.route("add", dst="::/0", gateway=m.pod_ip6, family=socket.AF_INET6)
        finally:
            pod_ipr.close()
            peer_ipr.close()
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
           "remove_netns_many", "iproute_in",
           "live_namespaces", "NETNS_DIR"]
