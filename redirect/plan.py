"""The plan: a pure function ``config -> Plan`` in a small typed vocabulary.

A ``Plan`` says, per netfilter-style table and hook, which ordered rules to run
(matches + one action), which policy routes and local addresses come with them,
and for which address families; the iptables and nftables backends render it. A
sidecar plan is the netfilter lowering of the config's ``Intent``
(``redirect.intent``), which it carries: the eBPF backend lowers the same intent to
map entries (``redirect.lower_ebpf``). The ambient plan (``redirect.ambient``) is
built with the same vocabulary. It never touches a kernel, so it is unit-testable
without root (``redirect.evaluate`` interprets it), and each behaviour is written
here once however many backends there are.

Chain names are logical (``"OUTBOUND"``); each backend adds its own prefix. A chain
with ``hook`` set is an entry point: the backend hooks it into that table's built-in
chain (iptables: one unconditional jump appended to ``PREROUTING``/``OUTPUT``;
nftables: a base chain at the table's priority).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal, Union

from .config import IdSpec, RedirectConfig
from .intent import (
    DNS_PORT,
    FAMILIES,
    INBOUND_PASSTHROUGH_V4,
    INBOUND_PASSTHROUGH_V6,
    LOOPBACK_V6,
    AmbientIntent,
    Family,
    Intent,
    LocalAddress,
    OwnerKind,
    intent_of,
)

Table = Literal["raw", "mangle", "nat"]
Hook = Literal["prerouting", "output"]

OUTBOUND_MARK = 1338  # TPROXY: proxy-to-app over lo, so inbound does not capture it again
DNS_ZONE_PROXY = 1  # proxy <-> upstream resolver
DNS_ZONE_APP = 2  # app <-> proxy


# --- matches -------------------------------------------------------------------------


@dataclass(frozen=True)
class Proto:
    name: Literal["tcp", "udp"]


@dataclass(frozen=True)
class Addr:
    """Source or destination address in a CIDR (the rule's family follows from it)."""

    side: Literal["src", "dst"]
    cidr: str
    neg: bool = False


@dataclass(frozen=True)
class Port:
    """Source or destination port(s); needs a ``Proto`` in the same rule.

    Several ports mean "any of" (``neg``: "none of").
    """

    side: Literal["src", "dst"]
    ports: tuple[int, ...]
    neg: bool = False


@dataclass(frozen=True)
class Iface:
    side: Literal["in", "out"]
    name: str
    neg: bool = False


@dataclass(frozen=True)
class Owner:
    """Socket owner (only meaningful on locally generated traffic)."""

    kind: Literal["uid", "gid"]
    id: IdSpec
    neg: bool = False


@dataclass(frozen=True)
class Mark:
    value: int
    mask: int = 0xFFFFFFFF
    neg: bool = False


@dataclass(frozen=True)
class ConnMark:
    value: int
    mask: int = 0xFFFFFFFF
    neg: bool = False


@dataclass(frozen=True)
class CtState:
    states: tuple[Literal["INVALID", "NEW", "ESTABLISHED", "RELATED"], ...]


@dataclass(frozen=True)
class Socket:
    """A local socket exists for the packet (``transparent``: only IP_TRANSPARENT ones)."""

    transparent: bool = False
    nowildcard: bool = False


@dataclass(frozen=True)
class SocketExists:
    """The packet belongs to a local socket: made on this host, not forwarded (node rules)."""


@dataclass(frozen=True)
class InSet:
    """The packet's ``side`` address is in the ipset ``name`` (node rules)."""

    name: str
    side: Literal["src", "dst"] = "dst"


Match = Union[Proto, Addr, Port, Iface, Owner, Mark, ConnMark, CtState, Socket, SocketExists, InSet]


# --- actions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Redirect:
    """NAT to a local port; the proxy reads the original destination with SO_ORIGINAL_DST."""

    port: int


@dataclass(frozen=True)
class TProxy:
    """Deliver to a local transparent listener on ``port`` and mark the packet."""

    port: int
    mark: int
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class Return:
    """Stop evaluating this chain; back to the caller (and on to other rules of the hook)."""


@dataclass(frozen=True)
class Accept:
    """Accept the packet in this table's hook (skips later rules of that hook)."""


@dataclass(frozen=True)
class Drop:
    pass


@dataclass(frozen=True)
class Jump:
    chain: str


@dataclass(frozen=True)
class SetMark:
    value: int
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class SetConnMark:
    value: int
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class SaveMark:
    """Copy the packet mark into the connmark (under ``mask``)."""

    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class RestoreMark:
    """Copy the connmark into the packet mark (under ``mask``)."""

    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class CtZone:
    zone: int


@dataclass(frozen=True)
class Snat:
    """Rewrite the source address to ``address`` (nat POSTROUTING; node rules)."""

    address: str


Action = Union[Redirect, TProxy, Return, Accept, Drop, Jump, SetMark, SetConnMark, SaveMark, RestoreMark, CtZone,
               Snat]


# --- structure -----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    matches: tuple[Match, ...]
    action: Action
    #: None: both families; 4 or 6: only that one (set from address matches).
    family: Family | None = None
    #: Why the rule exists, for ``--dry-run``, ``show`` and review.
    comment: str = ""


@dataclass(frozen=True)
class Chain:
    table: Table
    name: str
    rules: tuple[Rule, ...]
    hook: Hook | None = None


@dataclass(frozen=True)
class PolicyRoute:
    """``ip rule fwmark MARK/MASK lookup TABLE`` + ``local default dev lo table TABLE``."""

    family: Family
    fwmark: int
    mask: int
    table: int


@dataclass(frozen=True)
class Plan:
    mode: str
    chains: tuple[Chain, ...]
    routes: tuple[PolicyRoute, ...] = ()
    addresses: tuple[LocalAddress, ...] = ()
    #: Families the plan wants; ``None`` entries are resolved by the backend (auto IPv6).
    ipv6: bool | None = None
    #: What the rules were lowered from (a sidecar plan's the eBPF backend lowers to map entries too).
    intent: Intent | AmbientIntent | None = None

    def chains_for(self, family: Family) -> tuple[Chain, ...]:
        """The chains with only the rules of ``family``; empty non-hook chains are kept
        (they are jump targets), empty hook chains are dropped."""
        out = []
        for c in self.chains:
            rules = tuple(r for r in c.rules if r.family in (None, family))
            if c.hook is not None and not rules:
                continue
            out.append(Chain(c.table, c.name, rules, c.hook))
        return _prune(tuple(out))

    def routes_for(self, family: Family) -> tuple[PolicyRoute, ...]:
        return tuple(r for r in self.routes if r.family == family)

    def addresses_for(self, family: Family) -> tuple[LocalAddress, ...]:
        return tuple(a for a in self.addresses if a.family == family)

    def tables_for(self, family: Family) -> tuple[Table, ...]:
        return tuple(dict.fromkeys(c.table for c in self.chains_for(family)))


def _prune(chains: tuple[Chain, ...]) -> tuple[Chain, ...]:
    """Drop non-hook chains that nothing jumps to (per table), repeatedly."""
    while True:
        used = {
            (c.table, r.action.chain) for c in chains for r in c.rules if isinstance(r.action, Jump)
        }
        kept = tuple(c for c in chains if c.hook is not None or (c.table, c.name) in used)
        if len(kept) == len(chains):
            return kept
        chains = kept


def _family_of(cidr: str) -> Family:
    return 4 if ipaddress.ip_network(cidr).version == 4 else 6


class ChainBuilder:
    """Collects rules per (table, chain) in order of creation (the sidecar and ambient plans)."""

    def __init__(self) -> None:
        self._chains: dict[tuple[Table, str], list[Rule]] = {}
        self._hooks: dict[tuple[Table, str], Hook | None] = {}

    def chain(self, table: Table, name: str, hook: Hook | None = None) -> None:
        key = (table, name)
        if key not in self._chains:
            self._chains[key] = []
            self._hooks[key] = hook

    def add(
        self,
        table: Table,
        chain: str,
        matches: tuple[Match, ...] | list[Match],
        action: Action,
        comment: str = "",
        family: Family | None = None,
    ) -> None:
        self.chain(table, chain, _HOOKS.get(chain))
        for m in matches:
            if isinstance(m, Addr):
                fam = _family_of(m.cidr)
                if family is not None and family != fam:
                    raise AssertionError(f"rule mixes families: {matches}")
                family = fam
        self._chains[(table, chain)].append(Rule(tuple(matches), action, family, comment))

    def build(self) -> tuple[Chain, ...]:
        return tuple(
            Chain(t, n, tuple(rules), self._hooks[(t, n)]) for (t, n), rules in self._chains.items()
        )


#: Logical chain names that are hook entry points.
_HOOKS: dict[str, Hook] = {"PREROUTING": "prerouting", "OUTPUT": "output"}

TCP = Proto("tcp")
UDP = Proto("udp")


def build_plan(cfg: RedirectConfig) -> Plan:
    """The plan for ``cfg`` (dispatches on ``cfg.mode``)."""
    if cfg.mode == "ambient":
        from .ambient import build_ambient_plan

        return build_ambient_plan(cfg)
    return _sidecar_plan(intent_of(cfg))


def _sidecar_plan(it: Intent) -> Plan:
    """The netfilter lowering of a sidecar intent: Istio ``istio-iptables`` rule purposes, in its order."""
    b = ChainBuilder()
    tproxy = it.interception == "TPROXY"
    inbound_table: Table = "mangle" if tproxy else "nat"
    dns = it.dns
    loop: dict[Family, str] = dict(it.loopback)
    passthrough: dict[Family, str] = dict(it.passthrough)

    # Hook chains first, so each table's entry is created in a stable order.
    b.chain("nat", "PREROUTING", "prerouting")
    b.chain("nat", "OUTPUT", "output")

    # 1. Excluded interfaces: nothing on them is captured.
    for ifname in it.exclude_interfaces:
        b.add("nat", "PREROUTING", [Iface("in", ifname)], Return(), f"exclude interface {ifname}")
        b.add("nat", "OUTPUT", [Iface("out", ifname)], Return(), f"exclude interface {ifname}")
        if tproxy:
            b.add("mangle", "PREROUTING", [Iface("in", ifname)], Return(), f"exclude interface {ifname}")
            b.add("mangle", "OUTPUT", [Iface("out", ifname)], Return(), f"exclude interface {ifname}")

    # 2. Reroute (kube-virt) interfaces: their inbound goes to the outbound port.
    #    Istio inserts these at the top of nat PREROUTING (return when not capturing all).
    reroute_rules: list[tuple[tuple[Match, ...], Action, str]] = []
    for ifname in it.reroute_interfaces:
        if it.outbound_all:
            reroute_rules.append(((Iface("in", ifname),), Jump("REDIRECT"), f"reroute {ifname} to outbound"))
        else:
            for cidr in it.outbound_include_cidrs:
                reroute_rules.append(
                    ((Iface("in", ifname), Addr("dst", cidr)), Jump("REDIRECT"), f"reroute {ifname} {cidr}")
                )
        reroute_rules.append(((Iface("in", ifname),), Return(), f"rest of {ifname} is not captured"))
    for matches, action, comment in reroute_rules:
        b.add("nat", "PREROUTING", matches, action, comment)

    # 3. Drop conntrack-INVALID packets rather than letting them reset connections.
    if it.drop_invalid:
        b.add("mangle", "PREROUTING", [CtState(("INVALID",))], Jump("DROP"), "drop invalid")
        b.add("mangle", "DROP", [], Drop(), "drop invalid")

    # 4. The redirect targets.
    b.add("nat", "REDIRECT", [TCP], Redirect(it.proxy_port), "to the proxy outbound port")
    b.add("nat", "IN_REDIRECT", [TCP], Redirect(it.inbound_port), "to the proxy inbound port")

    # 5. Inbound.
    if it.inbound:
        if tproxy:
            b.add("mangle", "DIVERT", [], SetMark(it.tproxy_mark), "mark for the policy route to lo")
            b.add("mangle", "DIVERT", [], Accept(), "deliver locally")
            for fam, lo in loop.items():
                b.add(
                    "mangle",
                    "TPROXY",
                    [Addr("dst", lo, neg=True), TCP],
                    TProxy(it.inbound_port, it.tproxy_mark),
                    "new inbound to the proxy inbound port",
                    family=fam,
                )
            # Prevent loops: ours and proxy -> app traffic is not captured again.
            b.add("mangle", "INBOUND", [TCP, Mark(it.tproxy_mark)], Return(), "already diverted")
            for fam in FAMILIES:
                b.add("mangle", "INBOUND", [TCP, Addr("src", passthrough[fam]), Iface("in", "lo")], Return(),
                      "inbound passthrough from the proxy")
            b.add("mangle", "INBOUND", [TCP, Iface("in", "lo"), Mark(OUTBOUND_MARK, neg=True)], Return(),
                  "app to itself over lo")
        b.add(inbound_table, "PREROUTING", [TCP], Jump("INBOUND"), "inbound TCP")
        b.add(inbound_table, "INBOUND", [TCP, Port("dst", (it.tunnel_port,))], Return(), "tunnel (HBONE) port")
        if it.inbound_all:
            for p in it.inbound_exclude_ports:
                b.add(inbound_table, "INBOUND", [TCP, Port("dst", (p,))], Return(), f"excluded inbound port {p}")
            if tproxy:
                b.add("mangle", "INBOUND", [TCP, CtState(("RELATED", "ESTABLISHED"))], Jump("DIVERT"),
                      "established: route to lo")
                b.add("mangle", "INBOUND", [TCP], Jump("TPROXY"), "new: to the proxy")
            else:
                b.add("nat", "INBOUND", [TCP], Jump("IN_REDIRECT"), "inbound to the proxy")
        else:
            for p in it.inbound_include_ports:
                if p == it.tunnel_port:
                    continue  # returned above
                if tproxy:
                    b.add("mangle", "INBOUND", [TCP, Port("dst", (p,)), CtState(("RELATED", "ESTABLISHED"))],
                          Jump("DIVERT"), f"established inbound port {p}")
                    b.add("mangle", "INBOUND", [TCP, Port("dst", (p,))], Jump("TPROXY"), f"inbound port {p}")
                else:
                    b.add("nat", "INBOUND", [TCP, Port("dst", (p,))], Jump("IN_REDIRECT"), f"inbound port {p}")

    # 6. Outbound.
    b.add("nat", "OUTPUT", [], Jump("OUTBOUND"), "outbound")
    for p in it.outbound_exclude_ports:
        b.add("nat", "OUTBOUND", [TCP, Port("dst", (p,))], Return(), f"excluded outbound port {p}")
        b.add("nat", "OUTBOUND", [UDP, Port("dst", (p,))], Return(), f"excluded outbound port {p}")
    for fam in FAMILIES:
        b.add("nat", "OUTBOUND", [Iface("out", "lo"), Addr("src", passthrough[fam])], Return(),
              "inbound passthrough from the proxy")

    for kind in ("uid", "gid"):
        for i in it.owners_of(kind):  # type: ignore[arg-type]
            # app -> own service VIP -> proxy -> app: the proxy's lo traffic to a
            # non-loopback address goes to inbound capture.
            for fam, lo in loop.items():
                b.add("nat", "OUTBOUND",
                      [Iface("out", "lo"), Addr("dst", lo, neg=True), TCP,
                       Port("dst", it.hairpin_exclude_of(kind), neg=True), Owner(kind, i)],  # type: ignore[arg-type]
                      Jump("IN_REDIRECT"), f"proxy {kind} {_id(i)} hairpin over lo", family=fam)
            if not it.include_has_loopback:
                m: list[Match] = [Iface("out", "lo")]
                if dns:
                    m += [TCP, Port("dst", (DNS_PORT,), neg=True)]
                m.append(Owner(kind, i, neg=True))  # type: ignore[arg-type]
                b.add("nat", "OUTBOUND", m, Return(), f"app traffic over lo (not {kind} {_id(i)})")
            b.add("nat", "OUTBOUND", [Owner(kind, i)], Return(), f"proxy {kind} {_id(i)}")  # type: ignore[arg-type]

    # Owner groups: only (or all but) these groups' traffic is captured.
    if it.groups_mode == "exclude":
        for g in it.groups:
            b.add("nat", "OUTBOUND", [Owner("gid", g)], Return(), f"owner group {_id(g)} not captured")
    elif it.groups_mode == "only":
        b.add("nat", "OUTBOUND", [Owner("gid", g, neg=True) for g in it.groups], Return(),
              "not in a captured owner group")

    if dns:
        _sidecar_dns(b, it)

    for fam, lo in loop.items():
        b.add("nat", "OUTBOUND", [Addr("dst", lo)], Return(), "loopback", family=fam)
    for cidr in it.outbound_exclude_cidrs:
        b.add("nat", "OUTBOUND", [Addr("dst", cidr)], Return(), f"excluded CIDR {cidr}")
    for p in it.outbound_include_ports:
        b.add("nat", "OUTBOUND", [TCP, Port("dst", (p,))], Jump("REDIRECT"), f"included outbound port {p}")
    if it.outbound_all:
        b.add("nat", "OUTBOUND", [], Jump("REDIRECT"), "all other outbound to the proxy")
    else:
        for cidr in it.outbound_include_cidrs:
            b.add("nat", "OUTBOUND", [Addr("dst", cidr)], Jump("REDIRECT"), f"included CIDR {cidr}")

    routes: list[PolicyRoute] = []
    if tproxy and it.inbound:
        b.add("mangle", "PREROUTING", [TCP, Mark(it.tproxy_mark)], SaveMark(), "remember the divert mark")
        b.add("mangle", "OUTPUT", [TCP, Iface("out", "lo"), Mark(it.tproxy_mark)], Return(), "proxy to app, marked")
        for kind in ("uid", "gid"):
            for i in it.owners_of(kind):  # type: ignore[arg-type]
                for fam, lo in loop.items():
                    b.add("mangle", "OUTPUT",
                          [Addr("dst", lo, neg=True), TCP, Iface("out", "lo"), Owner(kind, i)],  # type: ignore[arg-type]
                          SetMark(OUTBOUND_MARK), f"proxy {kind} {_id(i)} to app over lo", family=fam)
        b.add("mangle", "OUTPUT", [TCP, ConnMark(it.tproxy_mark)], RestoreMark(), "replies follow the policy route")
        for fam in FAMILIES:
            routes.append(PolicyRoute(fam, it.tproxy_mark, 0xFFFFFFFF, it.tproxy_route_table))

    return Plan("sidecar", b.build(), tuple(routes), it.local_addresses, it.ipv6, it)


def _sidecar_dns(b: ChainBuilder, it: Intent) -> None:
    """DNS to port 53 goes to the DNS proxy, with conntrack zones splitting the flows."""
    owners: list[tuple[OwnerKind, IdSpec]] = [("uid", i) for i in it.owners_of("uid")]
    owners += [("gid", i) for i in it.owners_of("gid")]
    dns53 = Port("dst", (DNS_PORT,))
    # nat: TCP and UDP to 53 -> dns_port, except the proxy's own queries.
    b.chain("nat", "DNS")
    for fam in FAMILIES:
        if it.dns_all or it.dns_servers_of(fam):
            b.add("nat", "OUTBOUND", [], Jump("DNS"), "DNS", family=fam)
    if it.dns_all:
        b.add("nat", "DNS", [TCP, dns53], Redirect(it.dns_port), "TCP DNS to the DNS proxy")
    else:
        for fam in FAMILIES:
            for s in it.dns_servers_of(fam):
                b.add("nat", "DNS", [TCP, dns53, Addr("dst", s)], Redirect(it.dns_port), f"TCP DNS to {s}")
    for kind, i in owners:
        b.add("nat", "DNS", [UDP, dns53, Owner(kind, i)], Return(), f"proxy {kind} {_id(i)} DNS upstream")
    if it.dns_all:
        b.add("nat", "DNS", [UDP, dns53], Redirect(it.dns_port), "UDP DNS to the DNS proxy")
    else:
        for fam in FAMILIES:
            for s in it.dns_servers_of(fam):
                b.add("nat", "DNS", [UDP, dns53, Addr("dst", s)], Redirect(it.dns_port), f"UDP DNS to {s}")

    # raw: conntrack zones, so the proxy's upstream flow and the app's flow to the
    # proxy never share a conntrack entry (UDP races).
    b.chain("raw", "OUTPUT", "output")
    b.add("raw", "OUTPUT", [], Jump("DNS"), "DNS conntrack zones")
    for kind, i in owners:
        b.add("raw", "DNS", [UDP, dns53, Owner(kind, i)], CtZone(DNS_ZONE_PROXY), "proxy upstream queries")
        b.add("raw", "DNS", [UDP, Port("src", (it.dns_port,)), Owner(kind, i)], CtZone(DNS_ZONE_APP),
              "proxy answers to apps")
    if it.dns_all:
        b.add("raw", "PREROUTING", [], Jump("DNS_IN"), "DNS conntrack zones")
        b.add("raw", "DNS", [UDP, dns53], CtZone(DNS_ZONE_APP), "app queries")
        b.add("raw", "DNS_IN", [UDP, Port("src", (DNS_PORT,))], CtZone(DNS_ZONE_PROXY), "resolver answers")
    else:
        for fam in FAMILIES:
            if it.dns_servers_of(fam):
                b.add("raw", "PREROUTING", [], Jump("DNS_IN"), "DNS conntrack zones", family=fam)
            for s in it.dns_servers_of(fam):
                b.add("raw", "DNS", [UDP, dns53, Addr("dst", s)], CtZone(DNS_ZONE_APP), f"app queries to {s}")
                b.add("raw", "DNS_IN", [UDP, Port("src", (DNS_PORT,)), Addr("src", s)], CtZone(DNS_ZONE_PROXY),
                      f"answers from {s}")


def _id(i: IdSpec) -> str:
    return f"{i[0]}-{i[1]}" if isinstance(i, tuple) else str(i)


__all__ = [
    "Plan", "Chain", "Rule", "PolicyRoute", "LocalAddress", "ChainBuilder", "build_plan", "Intent",
    "Family", "FAMILIES", "DNS_PORT", "INBOUND_PASSTHROUGH_V4", "INBOUND_PASSTHROUGH_V6", "LOOPBACK_V6",
    "Proto", "Addr", "Port", "Iface", "Owner", "Mark", "ConnMark", "CtState", "Socket",
    "Redirect", "TProxy", "Return", "Accept", "Drop", "Jump", "SetMark", "SetConnMark",
    "SaveMark", "RestoreMark", "CtZone",
]
