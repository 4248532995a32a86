"""Policy routes and local addresses a plan needs, over rtnetlink (``redirect.rtnl``).

Everything we create carries routing protocol ``RT_PROTO`` (rules: FRA_PROTOCOL,
routes: rtm_protocol, addresses: IFA_PROTO), so what is ours is found in the kernel
and nothing else is ever removed. All functions act on the netns of the calling
thread.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

from . import rtnl
from .plan import LocalAddress, Plan, PolicyRoute

#: Our routing protocol number (unassigned in iproute2's rt_protos).
RT_PROTO = 201
RULE_PRIORITY = 32764
IFA_F_NODAD = 0x02  # usable at once
_AF = {4: socket.AF_INET, 6: socket.AF_INET6}


@dataclass(frozen=True)
class RouteState:
    """Our rules, routes and addresses as found in the kernel."""

    routes: frozenset[PolicyRoute]
    addresses: frozenset[LocalAddress]


def _ip(raw: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def read_ours(families: tuple[int, ...] = (4, 6)) -> RouteState:
    """Read back our policy routes (rule + local default route) and addresses (raw netlink).

    One dump each of routes and addresses for all families, and of rules only when a route of
    ours exists (a rule of ours without its route is half a policy route: reported as missing,
    repaired by apply).
    """
    fam_of: dict[int, int] = {int(af): fam for fam, af in _AF.items() if fam in families}
    af = _AF[families[0]] if len(families) == 1 else socket.AF_UNSPEC
    routes: set[PolicyRoute] = set()
    addresses: set[LocalAddress] = set()
    tables_with_local = {
        (m.family, m.u32(rtnl.RTA_TABLE) or m.fields[3]) for m in rtnl.dump(rtnl.RTM_GETROUTE, af)
        if m.fields[4] == RT_PROTO and m.family in fam_of  # rtmsg.rtm_protocol
    }
    if tables_with_local:
        for m in rtnl.dump(rtnl.RTM_GETRULE, af):
            if m.family not in fam_of or m.u8(rtnl.FRA_PROTOCOL) != RT_PROTO:
                continue
            table = m.u32(rtnl.FRA_TABLE) or m.fields[3]
            if (m.family, table) not in tables_with_local:
                continue
            mask = m.u32(rtnl.FRA_FWMASK)
            routes.add(PolicyRoute(fam_of[m.family], m.u32(rtnl.FRA_FWMARK) or 0,  # type: ignore[arg-type]
                                   0xFFFFFFFF if mask is None else mask, table))
    names: dict[int, str] | None = None
    for m in rtnl.dump(rtnl.RTM_GETADDR, af):
        if m.family in fam_of and m.u8(rtnl.IFA_PROTO) == RT_PROTO and rtnl.IFA_ADDRESS in m.attrs:
            names = rtnl.link_names() if names is None else names
            addresses.add(LocalAddress(fam_of[m.family], f"{_ip(m.attrs[rtnl.IFA_ADDRESS])}/{m.fields[0]}",  # type: ignore[arg-type]
                                       names.get(m.fields[3], "?")))
    return RouteState(frozenset(routes), frozenset(addresses))


# errno values a change may meet that mean "already as wanted"
EEXIST, ENOENT, ESRCH, ENODEV, EADDRNOTAVAIL, ENETDOWN = 17, 2, 3, 19, 99, 100


def _ignoring(codes: tuple[int, ...], fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except OSError as e:
        if e.errno == ENETDOWN:
            raise OSError(e.errno, "lo is down in this namespace; bring it up (ip link set lo up)") from None
        if e.errno not in codes:
            raise


def add_route(r: PolicyRoute) -> None:
    """The local default route in ``r.table``, then the fwmark rule that leads to it."""
    lo = rtnl.link_index("lo")
    _ignoring((EEXIST,), rtnl.local_default_route, "add", _AF[r.family], r.table, lo, RT_PROTO)
    _ignoring((EEXIST,), rtnl.fwmark_rule, "add", _AF[r.family], r.fwmark, r.mask, r.table, RULE_PRIORITY, RT_PROTO)


def remove_route(r: PolicyRoute) -> None:
    _ignoring((ENOENT, ESRCH), rtnl.fwmark_rule, "del", _AF[r.family], r.fwmark, r.mask, r.table, RULE_PRIORITY,
              RT_PROTO)
    _ignoring((ENOENT, ESRCH), rtnl.local_default_route, "del", _AF[r.family], r.table, rtnl.link_index("lo"),
              RT_PROTO)


def _address_args(a: LocalAddress) -> tuple[int, int, str, int]:
    address, plen = a.cidr.split("/")
    return _AF[a.family], rtnl.link_index(a.dev), address, int(plen)


def add_address(a: LocalAddress) -> None:
    _ignoring((EEXIST,), rtnl.addr, "add", *_address_args(a), RT_PROTO, IFA_F_NODAD)


def remove_address(a: LocalAddress) -> None:
    _ignoring((ENOENT, ENODEV, EADDRNOTAVAIL), rtnl.addr, "del", *_address_args(a), RT_PROTO)


def ipv6_enabled() -> bool:
    """Whether the calling thread's netns has IPv6 (so an uncaptured v6 path would exist).

    lo's IPv6 ``disable_ipv6`` (writing ``net.ipv6.conf.all.disable_ipv6`` sets every
    device's), read over rtnetlink: not from /proc/sys, where a lookup walks one dcache chain
    shared by the same-named entries of every netns (~0.15 ms an open with 1000 pods on the
    host, against ~15 us for this request whatever their number). False when the kernel has
    no IPv6 at all.
    """
    try:
        link = rtnl.get_link(1)  # lo: ifindex 1 in every netns
    except OSError:
        return False
    inet6 = rtnl.parse_attrs(link.attrs.get(rtnl.IFLA_AF_SPEC, b"")).get(socket.AF_INET6)
    if inet6 is None:
        return False
    conf = rtnl.parse_attrs(inet6).get(rtnl.IFLA_INET6_CONF, b"")
    if len(conf) < 4 * (rtnl.DEVCONF_DISABLE_IPV6 + 1):
        return True  # IPv6 is there; a kernel without this field can't disable it per netns
    return struct.unpack_from("=i", conf, 4 * rtnl.DEVCONF_DISABLE_IPV6)[0] == 0


def usable_addresses(addresses: tuple[LocalAddress, ...] | list[LocalAddress]) -> tuple[LocalAddress, ...]:
    """The addresses that can exist here: IPv6 ones only while IPv6 is enabled.

    (``ipv6=True`` on a namespace with IPv6 disabled still installs the IPv6 rules, so
    capture is in place the moment IPv6 is switched on; ``::6`` cannot be added until then.)
    """
    v6 = ipv6_enabled()
    return tuple(a for a in addresses if a.family == 4 or v6)


def for_plan(plan: Plan, families: tuple[int, ...]) -> tuple[tuple[PolicyRoute, ...], tuple[LocalAddress, ...]]:
    """The routes and (usable) addresses ``plan`` wants for ``families``."""
    routes = tuple(r for r in plan.routes if r.family in families)
    return routes, usable_addresses([a for a in plan.addresses if a.family in families])


def txn_for(plan: Plan, families: tuple[int, ...]) -> RouteTxn:
    routes, addresses = for_plan(plan, families)
    return RouteTxn(routes, addresses, families)


def differences(plan: Plan, families: tuple[int, ...]) -> list[str]:
    """How our routes and addresses in the kernel differ from what ``plan`` wants."""
    routes, addresses = for_plan(plan, families)
    want_routes, want_addrs = set(routes), set(addresses)
    state = read_ours()
    diffs = []
    for r in sorted(want_routes - state.routes, key=str):
        diffs.append(f"missing policy route: IPv{r.family} fwmark {r.fwmark:#x} lookup {r.table}")
    for r in sorted(state.routes - want_routes, key=str):
        diffs.append(f"unexpected policy route: IPv{r.family} fwmark {r.fwmark:#x} lookup {r.table}")
    for a in sorted(want_addrs - state.addresses, key=str):
        diffs.append(f"missing address {a.cidr} on {a.dev}")
    for a in sorted(state.addresses - want_addrs, key=str):
        diffs.append(f"unexpected address {a.cidr} on {a.dev}")
    return diffs


class RouteTxn:
    """Apply a desired set of our routes/addresses, and undo it if asked."""

    def __init__(self, routes: tuple[PolicyRoute, ...], addresses: tuple[LocalAddress, ...],
                 families: tuple[int, ...]) -> None:
        self.want_routes = frozenset(routes)
        self.want_addresses = frozenset(addresses)
        self.families = families
        self.before = read_ours()
        self._done: list[tuple[str, Any]] = []

    @property
    def changed(self) -> bool:
        return self.before.routes != self.want_routes or self.before.addresses != self.want_addresses

    def apply(self) -> None:
        for r in self.want_routes - self.before.routes:
            add_route(r)
            self._done.append(("route", r))
        for a in self.want_addresses - self.before.addresses:
            add_address(a)
            self._done.append(("addr", a))

    def finish(self) -> None:
        """After the rules are in: remove what the old config had and the new one doesn't."""
        for r in self.before.routes - self.want_routes:
            remove_route(r)
        for a in self.before.addresses - self.want_addresses:
            remove_address(a)

    def rollback(self) -> None:
        for kind, obj in reversed(self._done):
            if kind == "route":
                remove_route(obj)
            else:
                remove_address(obj)
        self._done.clear()


def remove_all_ours() -> bool:
    """Remove every rule, route and address of ours; True if there were any."""
    state = read_ours()
    for r in state.routes:
        remove_route(r)
    for a in state.addresses:
        remove_address(a)
    # Stray halves (a rule without its route or the reverse) are ours too.
    stray = False
    for fam in (4, 6):
        for m in rtnl.dump(rtnl.RTM_GETRULE, _AF[fam]):
            if m.u8(rtnl.FRA_PROTOCOL) == RT_PROTO:
                stray = True
                _ignoring((ENOENT, ESRCH), rtnl.fwmark_rule, "del", _AF[fam], m.u32(rtnl.FRA_FWMARK) or 0,
                          m.u32(rtnl.FRA_FWMASK) or 0xFFFFFFFF, m.u32(rtnl.FRA_TABLE) or m.fields[3],
                          m.u32(rtnl.FRA_PRIORITY) or 0, RT_PROTO)
        for m in rtnl.dump(rtnl.RTM_GETROUTE, _AF[fam]):
            if m.fields[4] == RT_PROTO:
                stray = True
                _ignoring((ENOENT, ESRCH), rtnl.local_default_route, "del", _AF[fam],
                          m.u32(rtnl.RTA_TABLE) or m.fields[3], m.u32(rtnl.RTA_OIF) or 0, RT_PROTO)
    return bool(state.routes or state.addresses or stray)


def describe_ours() -> dict[str, list[str]]:
    """Our routes and addresses, as text for ``show``."""
    state = read_ours()
    return {
        "routes": [f"IPv{r.family} fwmark {r.fwmark:#x} lookup {r.table}" for r in sorted(state.routes, key=str)],
        "addresses": [f"{a.cidr} dev {a.dev}" for a in sorted(state.addresses, key=str)],
    }
