"""Policy routes and local addresses an intent needs, over rtnetlink (``redirect.kernel.netlink``).

Everything we create carries routing protocol ``RT_PROTO`` (rules: FRA_PROTOCOL,
routes: rtm_protocol, addresses: IFA_PROTO), so what is ours is found in the kernel
and nothing else is ever removed. All functions act on the netns of the calling
thread.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import SetupError
from ..plan.intent import AnyIntent, LocalAddress, PolicyRoute
from . import netlink

#: Our routing protocol number (unassigned in iproute2's rt_protos).
RT_PROTO = 201
RULE_PRIORITY = 32764
LOOPBACK_IFINDEX = 1  # lo, in every netns (no dump to look it up)
IFA_F_NODAD = 0x02  # usable at once
_AF = {4: socket.AF_INET, 6: socket.AF_INET6}


@dataclass(frozen=True)
class RouteState:
    """Our rules, routes and addresses as found in the kernel."""

    routes: frozenset[PolicyRoute]
    addresses: frozenset[LocalAddress]
    #: The namespace has an IPv6 address of its own (``own_ipv6``): the intent's IPv6 addresses
    #: (``::6`` for the proxy's inbound passthrough) are wanted only then, as Istio adds ``::6``
    #: only to a pod with an IPv6 address.
    own_v6: bool = False


_V6_LOOPBACK = bytes(15) + b"\1"
_V6_PASSTHROUGH = bytes(15) + b"\6"
#: The IPv6 addresses an intent adds (``::6``): never one of the pod's own (``own_ipv6``).
PLAN_V6 = (_V6_PASSTHROUGH,)


def own_ipv6(raw: bytes) -> bool:
    """Whether the IPv6 address ``raw`` (16 bytes) is one of the pod's own: not ``::1``, not
    link-local (fe80::/10), not the ``::6`` the intent adds (Istio's test for "the pod has IPv6",
    which decides whether it adds ``::6``: its proxy binds ``::6`` only when it serves IPv6)."""
    return raw != _V6_LOOPBACK and raw != _V6_PASSTHROUGH and not (raw[0] == 0xFE and raw[1] & 0xC0 == 0x80)


IFA_F_DADFAILED = 0x08


def _dad_failed(m: Any) -> bool:
    """Whether the address message ``m``'s duplicate address detection failed (``IFA_FLAGS``, else
    the header's flags): such an address is not the pod's, as the eBPF backend's scan has it
    (native/pod_setup.c, ``on_address``)."""
    flags = m.u32(netlink.IFA_FLAGS)
    return bool((m.fields[1] if flags is None else flags) & IFA_F_DADFAILED)


def _ip(raw: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


RTN_LOCAL = 2


def _table(m: Any) -> int:
    return m.u32(netlink.RTA_TABLE) or m.fields[3]


def _like_ours(m: Any) -> bool:
    """Route message ``m`` is a policy route's half as we make it, whoever made it: ``local
    default dev lo`` (rtmsg: dst_len 0, src_len 0, tos 0, type local; RTA_OIF lo)."""
    return (m.fields[0] == 0 and m.fields[1] == 0 and m.fields[2] == 0 and m.fields[6] == RTN_LOCAL
            and m.u32(netlink.RTA_OIF) == LOOPBACK_IFINDEX)


def _default_routes(family: int, table: int) -> list[Any]:
    """The default routes (any type, anyone's) of ``table``."""
    return [m for m in netlink.dump(netlink.RTM_GETROUTE, _AF[family])
            if m.family == _AF[family] and _table(m) == table and m.fields[0] == 0 and m.fields[1] == 0]


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
    # Ours, or another's exactly like ours (istio-iptables leaves ``local default dev lo table 133``):
    # that one serves our rule as well, and is never removed (a delete names our protocol).
    tables_with_local = {
        (m.family, _table(m)) for m in netlink.dump(netlink.RTM_GETROUTE, af)
        if m.family in fam_of and (m.fields[4] == RT_PROTO or _like_ours(m))  # rtmsg.rtm_protocol
    }
    if tables_with_local:
        for m in netlink.dump(netlink.RTM_GETRULE, af):
            if m.family not in fam_of or m.u8(netlink.FRA_PROTOCOL) != RT_PROTO:
                continue
            table = m.u32(netlink.FRA_TABLE) or m.fields[3]
            if (m.family, table) not in tables_with_local:
                continue
            mask = m.u32(netlink.FRA_FWMASK)
            routes.add(PolicyRoute(fam_of[m.family], m.u32(netlink.FRA_FWMARK) or 0,  # type: ignore[arg-type]
                                   0xFFFFFFFF if mask is None else mask, table))
    names: dict[int, str] | None = None
    own_v6 = False
    for m in netlink.dump(netlink.RTM_GETADDR, af):
        if m.family not in fam_of or netlink.IFA_ADDRESS not in m.attrs:
            continue
        if m.u8(netlink.IFA_PROTO) == RT_PROTO:
            names = netlink.link_names() if names is None else names
            addresses.add(LocalAddress(fam_of[m.family], f"{_ip(m.attrs[netlink.IFA_ADDRESS])}/{m.fields[0]}",  # type: ignore[arg-type]
                                       names.get(m.fields[3], "?")))
        elif m.family == socket.AF_INET6 and not own_v6 and not _dad_failed(m):
            own_v6 = own_ipv6(m.attrs[netlink.IFA_ADDRESS])
    return RouteState(frozenset(routes), frozenset(addresses), own_v6)


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


#: A policy route's two halves (``native/pod_setup.c``, ``struct rdr_route_op``): the route, and the rule
#: that leads to it.
ROUTE, RULE = 0, 1


def route_ops(r: PolicyRoute, add: bool = True) -> tuple[tuple[int, ...], ...]:
    """The halves of ``r`` as ``rdr_route_op`` fields (kind, add, family, proto, table, fwmark, mask,
    priority, oif), in the order they are made (the route, then its rule: the rule never leads to an
    empty table) or, for ``add=False``, removed (the rule first)."""
    ops = ((ROUTE, int(add), r.family, RT_PROTO, r.table, 0, 0, 0, LOOPBACK_IFINDEX),
           (RULE, int(add), r.family, RT_PROTO, r.table, r.fwmark, r.mask, RULE_PRIORITY, 0))
    return ops if add else ops[::-1]


def _route_op(op: tuple[int, ...]) -> None:
    """One half of a policy route added or removed, by the native netlink client (the one
    statement of these messages, which the eBPF backend's fresh-pod call sends too)."""
    from ..native import load

    native = load()
    ffi, lib = native.ffi, native.lib
    c = ffi.new("struct rdr_route_op *")
    c.kind, c.add, c.family, c.proto, c.table, c.fwmark, c.mask, c.priority, c.oif = op
    errs = ffi.new("int[1]")
    ret = lib.rdr_route_ops(-1, c, 1, errs)
    err = ret if ret < 0 else errs[0]
    if err < 0:
        raise OSError(-err, os.strerror(-err))


def add_route(r: PolicyRoute) -> None:
    """The local default route in ``r.table``, then the fwmark rule that leads to it. A route of
    another's exactly like ours there (``local default dev lo``) serves our rule (and stays theirs:
    never removed); any other default route there is refused, naming it, before our rule is added."""
    route, rule = route_ops(r)
    try:
        _route_op(route)
    except OSError as e:
        if e.errno == ENETDOWN:
            raise OSError(e.errno, "lo is down in this namespace; bring it up (ip link set lo up)") from None
        if e.errno != EEXIST:
            raise
        there = _default_routes(r.family, r.table)
        if not any(_like_ours(m) for m in there):
            what = "; ".join(f"type {m.fields[6]} protocol {m.fields[4]} oif {m.u32(netlink.RTA_OIF) or '-'}"
                             for m in there) or "unknown"
            raise SetupError(
                f"IPv{r.family} routing table {r.table} already holds a default route that is not ours and not"
                f" 'local default dev lo' ({what}); our policy route (fwmark {r.fwmark:#x} lookup {r.table}) needs"
                f" that: setup refused, rolled back. Remove that route or choose another table"
                f" (tproxy_route_table, or the ambient route table)") from None
    _ignoring((EEXIST,), _route_op, rule)


def remove_route(r: PolicyRoute) -> None:
    for op in route_ops(r, add=False):
        _ignoring((ENOENT, ESRCH), _route_op, op)


def _address_args(a: LocalAddress) -> tuple[int, int, str, int]:
    address, plen = a.cidr.split("/")
    return _AF[a.family], netlink.link_index(a.dev), address, int(plen)


def add_address(a: LocalAddress) -> None:
    _ignoring((EEXIST,), netlink.addr, "add", *_address_args(a), RT_PROTO, IFA_F_NODAD)


def remove_address(a: LocalAddress) -> None:
    _ignoring((ENOENT, ENODEV, EADDRNOTAVAIL), netlink.addr, "del", *_address_args(a), RT_PROTO)


def ipv6_enabled() -> bool:
    """Whether the calling thread's netns has IPv6 (so an uncaptured v6 path would exist).

    lo's IPv6 ``disable_ipv6`` (writing ``net.ipv6.conf.all.disable_ipv6`` sets every
    device's), read over rtnetlink: not from /proc/sys, where an open walks one dcache chain
    shared by the same-named entries of every netns on the host, so its cost grows with the
    number of pods while this request's does not. False when the kernel has no IPv6 at all.
    """
    try:
        link = netlink.get_link(1)  # lo: ifindex 1 in every netns
    except OSError:
        return False
    inet6 = netlink.parse_attrs(link.attrs.get(netlink.IFLA_AF_SPEC, b"")).get(socket.AF_INET6)
    if inet6 is None:
        return False
    conf = netlink.parse_attrs(inet6).get(netlink.IFLA_INET6_CONF, b"")
    if len(conf) < 4 * (netlink.DEVCONF_DISABLE_IPV6 + 1):
        return True  # IPv6 is there; a kernel without this field can't disable it per netns
    return struct.unpack_from("=i", conf, 4 * netlink.DEVCONF_DISABLE_IPV6)[0] == 0


def usable_addresses(addresses: tuple[LocalAddress, ...] | list[LocalAddress],
                     own_v6: bool) -> tuple[LocalAddress, ...]:
    """The addresses wanted here: IPv6 ones only when the namespace has an IPv6 address of its
    own (``RouteState.own_v6``).

    (IPv6 rules do not depend on it: with IPv6 on, or ``ipv6=True``, they are installed, so
    capture is in place whatever addresses come later; ``::6``, which only the proxy's IPv6
    inbound passthrough binds, comes with the pod's first IPv6 address, at the next setup:
    ``check`` reports it missing until then.)
    """
    return tuple(a for a in addresses if a.family == 4 or own_v6)


def wanted(it: AnyIntent, families: tuple[int, ...],
           state: RouteState) -> tuple[tuple[PolicyRoute, ...], tuple[LocalAddress, ...]]:
    """The routes and addresses ``it`` wants for ``families`` in the namespace ``state`` was read from."""
    routes = tuple(r for r in it.routes if r.family in families)
    return routes, usable_addresses([a for a in it.local_addresses if a.family in families], state.own_v6)


def txn_for(it: AnyIntent, families: tuple[int, ...]) -> RouteTxn:
    state = read_ours()
    routes, addresses = wanted(it, families, state)
    return RouteTxn(routes, addresses, families, state)


def differences(it: AnyIntent, families: tuple[int, ...]) -> list[str]:
    """How our routes and addresses in the kernel differ from what ``it`` wants."""
    state = read_ours()
    routes, addresses = wanted(it, families, state)
    want_routes, want_addrs = set(routes), set(addresses)
    diffs = []
    for r in sorted(want_routes - state.routes, key=str):
        diffs.append(f"missing policy route: IPv{r.family} fwmark {r.fwmark:#x} lookup {r.table}")
    # Another config's (a setup adds the new config's before its rules and removes the old
    # config's after them: a setup killed in between leaves both); setup removes them.
    left = "(another config's, as an interrupted setup leaves them; setup removes it)"
    for r in sorted(state.routes - want_routes, key=str):
        diffs.append(f"unexpected policy route: IPv{r.family} fwmark {r.fwmark:#x} lookup {r.table} {left}")
    for a in sorted(want_addrs - state.addresses, key=str):
        diffs.append(f"missing address {a.cidr} on {a.dev}")
    for a in sorted(state.addresses - want_addrs, key=str):
        diffs.append(f"unexpected address {a.cidr} on {a.dev} {left}")
    return diffs


class RouteTxn:
    """Apply a desired set of our routes/addresses, and undo it if asked."""

    def __init__(self, routes: tuple[PolicyRoute, ...], addresses: tuple[LocalAddress, ...],
                 families: tuple[int, ...], before: RouteState | None = None) -> None:
        self.want_routes = frozenset(routes)
        self.want_addresses = frozenset(addresses)
        self.families = families
        self.before = read_ours() if before is None else before
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
        for m in netlink.dump(netlink.RTM_GETRULE, _AF[fam]):
            if m.u8(netlink.FRA_PROTOCOL) == RT_PROTO:
                stray = True
                _ignoring((ENOENT, ESRCH), _route_op, (
                    RULE, 0, fam, RT_PROTO, m.u32(netlink.FRA_TABLE) or m.fields[3], m.u32(netlink.FRA_FWMARK) or 0,
                    m.u32(netlink.FRA_FWMASK) or 0xFFFFFFFF, m.u32(netlink.FRA_PRIORITY) or 0, 0))
        for m in netlink.dump(netlink.RTM_GETROUTE, _AF[fam]):
            if m.fields[4] == RT_PROTO:
                stray = True
                _ignoring((ENOENT, ESRCH), _route_op, (ROUTE, 0, fam, RT_PROTO, m.u32(netlink.RTA_TABLE) or m.fields[3],
                                                       0, 0, 0, m.u32(netlink.RTA_OIF) or 0))
    return bool(state.routes or state.addresses or stray)


def describe_ours() -> dict[str, list[str]]:
    """Our routes and addresses, as text for ``show``."""
    state = read_ours()
    return {
        "routes": [f"IPv{r.family} fwmark {r.fwmark:#x} lookup {r.table}" for r in sorted(state.routes, key=str)],
        "addresses": [f"{a.cidr} dev {a.dev}" for a in sorted(state.addresses, key=str)],
    }
