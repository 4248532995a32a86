"""The sidecar plan: the netfilter lowering of a sidecar ``Intent``, in Istio's ``istio-iptables`` order."""

from __future__ import annotations

from ..config import IdSpec
from .intent import FAMILIES, Family, Intent, OwnerKind
from .vocabulary import (
    DNS_ZONE_APP,
    DNS_ZONE_PROXY,
    OUTBOUND_MARK,
    TCP,
    UDP,
    Accept,
    Action,
    Addr,
    ChainBuilder,
    ConnMark,
    CtState,
    CtZone,
    Drop,
    Iface,
    Jump,
    Mark,
    Match,
    Owner,
    Plan,
    Port,
    Proto,
    Redirect,
    RestoreMark,
    Return,
    SaveMark,
    SetMark,
    Table,
    TProxy,
)


def sidecar_plan(it: Intent) -> Plan:
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
            if it.lo_return:
                m: list[Match] = [Iface("out", "lo")]
                if it.lo_return_spares_dns:
                    m += [TCP, Port("dst", (it.resolver_port,), neg=True)]
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

    return Plan("sidecar", b.build(), it.routes, it.local_addresses, it.ipv6)


def _sidecar_dns(b: ChainBuilder, it: Intent) -> None:
    """DNS to port 53 goes to the DNS proxy, with conntrack zones splitting the flows."""
    owners: list[tuple[OwnerKind, IdSpec]] = [("uid", i) for i in it.owners_of("uid")]
    owners += [("gid", i) for i in it.owners_of("gid")]
    dns53 = Port("dst", (it.resolver_port,))
    # nat: TCP and UDP to 53 -> dns_port, except the proxy's own queries.
    b.chain("nat", "DNS")
    for fam in FAMILIES:
        if it.dns_all or it.dns_servers_of(fam):
            b.add("nat", "OUTBOUND", [], Jump("DNS"), "DNS", family=fam)
    _dns_to_proxy(b, it, TCP)
    for kind, i in owners:
        b.add("nat", "DNS", [UDP, dns53, Owner(kind, i)], Return(), f"proxy {kind} {_id(i)} DNS upstream")
    _dns_to_proxy(b, it, UDP)

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
        b.add("raw", "DNS_IN", [UDP, Port("src", (it.resolver_port,))], CtZone(DNS_ZONE_PROXY), "resolver answers")
    else:
        for fam in FAMILIES:
            if it.dns_servers_of(fam):
                b.add("raw", "PREROUTING", [], Jump("DNS_IN"), "DNS conntrack zones", family=fam)
            for s in it.dns_servers_of(fam):
                b.add("raw", "DNS", [UDP, dns53, Addr("dst", s)], CtZone(DNS_ZONE_APP), f"app queries to {s}")
                b.add("raw", "DNS_IN", [UDP, Port("src", (it.resolver_port,)), Addr("src", s)], CtZone(DNS_ZONE_PROXY),
                      f"answers from {s}")


def _dns_to_proxy(b: ChainBuilder, it: Intent, proto: Proto) -> None:
    """``proto`` to the resolver port (of every resolver, or of the pod's DNS servers) -> the DNS proxy."""
    dns53 = Port("dst", (it.resolver_port,))
    name = proto.name.upper()
    if it.dns_all:
        b.add("nat", "DNS", [proto, dns53], Redirect(it.dns_port), f"{name} DNS to the DNS proxy")
        return
    for fam in FAMILIES:
        for s in it.dns_servers_of(fam):
            b.add("nat", "DNS", [proto, dns53, Addr("dst", s)], Redirect(it.dns_port), f"{name} DNS to {s}")


def _id(i: IdSpec) -> str:
    return f"{i[0]}-{i[1]}" if isinstance(i, tuple) else str(i)
