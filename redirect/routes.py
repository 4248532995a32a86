"""Policy routes and local addresses a plan needs, over netlink (pyroute2).

Everything we create carries routing protocol ``RT_PROTO`` (rules: FRA_PROTOCOL,
routes: rtm_protocol, addresses: IFA_PROTO), so what is ours is found in the kernel
and nothing else is ever removed. All functions act on the netns of the calling
thread.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from .plan import LocalAddress, Plan, PolicyRoute

#: Our routing protocol number (unassigned in iproute2's rt_protos).
RT_PROTO = 201
RULE_PRIORITY = 32764
_AF = {4: socket.AF_INET, 6: socket.AF_INET6}
_DEFAULT = {4: "0.0.0.0", 6: "::"}


@dataclass(frozen=True)
class RouteState:
    """Our rules, routes and addresses as found in the kernel."""

    routes: frozenset[PolicyRoute]
    addresses: frozenset[LocalAddress]


def _lo_index(ipr: IPRoute) -> int:
    return int(ipr.link_lookup(ifname="lo")[0])


def _all_routes(ipr: IPRoute, fam: int) -> list[Any]:
    """Our routes, in every table."""
    return list(ipr.get_routes(family=_AF[fam], match={"proto": RT_PROTO}))


def read_ours(families: tuple[int, ...] = (4, 6)) -> RouteState:
    """Read back our policy routes (rule + local default route) and addresses."""
    routes: set[PolicyRoute] = set()
    addresses: set[LocalAddress] = set()
    with IPRoute() as ipr:
        for fam in families:
            tables_with_local = {
                r.get("table") if r.get_attr("RTA_TABLE") is None else r.get_attr("RTA_TABLE")
                for r in _all_routes(ipr, fam)
                if r["proto"] == RT_PROTO
            }
            for rule in ipr.get_rules(family=_AF[fam]):
                if rule.get_attr("FRA_PROTOCOL") != RT_PROTO:
                    continue
                table = rule.get_attr("FRA_TABLE") or rule["table"]
                if table not in tables_with_local:
                    continue  # half a policy route: reported as missing, repaired by apply
                fwmark = rule.get_attr("FRA_FWMARK") or 0
                mask = rule.get_attr("FRA_FWMASK")
                routes.add(PolicyRoute(fam, fwmark, 0xFFFFFFFF if mask is None else mask, table))  # type: ignore[arg-type]
            for a in ipr.get_addr(family=_AF[fam]):
                if a.get_attr("IFA_PROTO") == RT_PROTO:
                    dev = ipr.get_links(a["index"])[0].get_attr("IFLA_IFNAME")
                    addresses.add(LocalAddress(fam, f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", dev))  # type: ignore[arg-type]
    return RouteState(frozenset(routes), frozenset(addresses))


def _rule(ipr: IPRoute, op: str, r: PolicyRoute) -> None:
    ipr.rule(op, family=_AF[r.family], table=r.table, priority=RULE_PRIORITY, fwmark=r.fwmark,
             fwmask=r.mask, FRA_PROTOCOL=RT_PROTO)


def _route(ipr: IPRoute, op: str, r: PolicyRoute) -> None:
    try:
        ipr.route(op, family=_AF[r.family], dst=_DEFAULT[r.family], dst_len=0, type="local",
                  oif=_lo_index(ipr), table=r.table, proto=RT_PROTO, scope=254)
    except NetlinkError as e:
        if e.code == 100:  # ENETDOWN
            raise NetlinkError(e.code, "lo is down in this namespace; bring it up (ip link set lo up)") from None
        raise


def _addr(ipr: IPRoute, op: str, a: LocalAddress) -> None:
    addr, plen = a.cidr.split("/")
    idx = int(ipr.link_lookup(ifname=a.dev)[0])
    kw: dict[str, Any] = {"index": idx, "address": addr, "prefixlen": int(plen), "family": _AF[a.family]}
    if op == "add":
        kw["IFA_PROTO"] = RT_PROTO
        kw["IFA_FLAGS"] = 0x02  # IFA_F_NODAD: usable at once
    ipr.addr(op, **kw)


def add_route(r: PolicyRoute) -> None:
    with IPRoute() as ipr:
        try:
            _route(ipr, "add", r)
        except NetlinkError as e:
            if e.code != 17:  # EEXIST: an identical route is fine
                raise
        try:
            _rule(ipr, "add", r)
        except NetlinkError as e:
            if e.code != 17:
                raise


def remove_route(r: PolicyRoute) -> None:
    with IPRoute() as ipr:
        for fn in (_rule, _route):
            try:
                fn(ipr, "del", r)
            except NetlinkError as e:
                if e.code not in (2, 3):  # ENOENT, ESRCH: already gone
                    raise


def add_address(a: LocalAddress) -> None:
    with IPRoute() as ipr:
        try:
            _addr(ipr, "add", a)
        except NetlinkError as e:
            if e.code != 17:
                raise


def remove_address(a: LocalAddress) -> None:
    with IPRoute() as ipr:
        try:
            _addr(ipr, "del", a)
        except NetlinkError as e:
            if e.code not in (2, 19, 99):  # ENOENT, ENODEV, EADDRNOTAVAIL
                raise


def ipv6_enabled() -> bool:
    """Whether the calling thread's netns has IPv6 (so an uncaptured v6 path would exist)."""
    try:
        with open("/proc/sys/net/ipv6/conf/all/disable_ipv6") as f:
            return f.read().strip() == "0"
    except OSError:
        return False


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
    with IPRoute() as ipr:
        for fam in (4, 6):
            for rule in ipr.get_rules(family=_AF[fam]):
                if rule.get_attr("FRA_PROTOCOL") == RT_PROTO:
                    stray = True
                    try:
                        ipr.rule("del", family=_AF[fam], priority=rule.get_attr("FRA_PRIORITY"),
                                 table=rule.get_attr("FRA_TABLE") or rule["table"],
                                 fwmark=rule.get_attr("FRA_FWMARK"), fwmask=rule.get_attr("FRA_FWMASK"))
                    except NetlinkError:
                        pass
            for rt in _all_routes(ipr, fam):
                if rt["proto"] == RT_PROTO:
                    stray = True
                    try:
                        ipr.route("del", family=_AF[fam], dst=_DEFAULT[fam], dst_len=0, type="local",
                                  table=rt.get_attr("RTA_TABLE"), proto=RT_PROTO,
                                  oif=rt.get_attr("RTA_OIF"))
                    except NetlinkError:
                        pass
    return bool(state.routes or state.addresses or stray)
