"""Ambient mode: Istio's in-pod rules for a node proxy (ztunnel) that lives in the pod netns.

The node proxy gets the pod's netns, opens its listeners inside it and marks every
socket with ``proxy_mark`` (0x539/0xfff). The rules below send the pod's traffic to
those listeners and keep the proxy's own traffic out of capture. They follow the
purposes and order of istio/istio ``cni/pkg/iptables/iptables.go``
(``AppendInpodRules``) as of the change that moved ambient from TPROXY to REDIRECT
(Istio found various problems caused by TPROXY there):

mangle (``PREROUTING`` / ``OUTPUT``)
    Packets carrying the proxy mark get connmark ``conn_mark`` (0x111). That happens
    when the proxy connects to the app over ``lo`` from a spoofed (original client)
    source; the app's replies, addressed to that non-local source, restore the mark
    in ``OUTPUT`` and the policy route (``fwmark conn_mark/mask lookup route_table``,
    ``local default dev lo``) delivers them back to the proxy instead of the wire.
nat ``PREROUTING``
    Rerouted (VM / kube-virt) interfaces: their inbound TCP goes to the outbound
    port. Probes from the SNAT address are accepted (they reach the app directly).
    Other inbound TCP, except to the tunnel (HBONE) port, goes to the inbound port.
nat ``OUTPUT``
    Replies to probes are accepted; optional DNS (UDP and TCP 53) goes to the DNS
    port; connmark-routed traffic and traffic to the pod itself over ``lo`` are
    accepted; other outbound TCP without the proxy mark goes to the outbound port.
raw (DNS only)
    The proxy's upstream queries and their answers get conntrack zone 1, so they
    never share an entry with the app-to-proxy flow.

Not captured in ambient mode (as in Istio): UDP other than DNS, loopback.
"""

from __future__ import annotations

from .intent import AmbientIntent
from .vocabulary import (
    DNS_ZONE_PROXY,
    FAMILIES,
    TCP,
    UDP,
    Accept,
    Addr,
    ChainBuilder,
    ConnMark,
    CtZone,
    Family,
    Iface,
    Mark,
    Plan,
    Port,
    Redirect,
    RestoreMark,
    Return,
    SetConnMark,
)


def ambient_plan(it: AmbientIntent) -> Plan:
    """The netfilter lowering of an ambient intent."""
    b = ChainBuilder()
    mark = Mark(it.proxy_mark, it.mark_mask)
    not_mark = Mark(it.proxy_mark, it.mark_mask, neg=True)
    conn = ConnMark(it.conn_mark, it.mark_mask)
    conn_as_mark = Mark(it.conn_mark, it.mark_mask)
    snat: dict[Family, str] = dict(it.probe_sources)
    loopback: dict[Family, str] = dict(it.loopback)
    capture_inbound = it.inbound
    dns = it.dns

    # Hook chains first, so each table's entry is created in a stable order.
    b.chain("mangle", "PREROUTING", "prerouting")
    b.chain("mangle", "OUTPUT", "output")
    b.chain("nat", "PREROUTING", "prerouting")
    b.chain("nat", "OUTPUT", "output")

    # --- mangle: the proxy's connections to the app route their replies back to it.
    if capture_inbound:
        b.add("mangle", "PREROUTING", [mark], SetConnMark(it.conn_mark, it.mark_mask),
              "proxy-marked: remember the connection")
    b.add("mangle", "OUTPUT", [conn], RestoreMark(), "replies to the proxy take the local route")

    # --- nat PREROUTING: inbound.
    for ifname in it.reroute_interfaces:
        b.add("nat", "PREROUTING", [Iface("in", ifname), TCP], Redirect(it.proxy_port),
              f"reroute {ifname} inbound to the proxy outbound port")
        b.add("nat", "PREROUTING", [Iface("in", ifname), TCP], Return(), f"rest of {ifname} is not captured")
    if capture_inbound:
        for fam in FAMILIES:
            b.add("nat", "PREROUTING", [Addr("src", snat[fam]), TCP], Accept(), "kubelet probe (SNAT source)")
        for fam in FAMILIES:
            b.add("nat", "PREROUTING",
                  [Addr("dst", loopback[fam], neg=True), TCP, Port("dst", (it.tunnel_port,), neg=True), not_mark],
                  Redirect(it.inbound_port), "inbound to the proxy inbound port (not the tunnel port)")

    # --- nat OUTPUT: outbound.
    for fam in FAMILIES:
        b.add("nat", "OUTPUT", [Addr("dst", snat[fam]), TCP], Accept(), "replies to kubelet probes")
    if dns:
        for fam in FAMILIES:
            b.add("nat", "OUTPUT", [Iface("out", "lo", neg=True), UDP, Port("dst", (it.resolver_port,)), not_mark],
                  Redirect(it.dns_port), "UDP DNS to the DNS proxy", family=fam)
        for fam in FAMILIES:
            b.add("nat", "OUTPUT",
                  [Addr("dst", loopback[fam], neg=True), TCP, Port("dst", (it.resolver_port,)), not_mark],
                  Redirect(it.dns_port), "TCP DNS to the DNS proxy")
    b.add("nat", "OUTPUT", [TCP, conn_as_mark], Accept(), "connmark-routed: not captured")
    for fam in FAMILIES:
        b.add("nat", "OUTPUT", [Addr("dst", loopback[fam], neg=True), Iface("out", "lo")], Accept(),
              "to the pod itself over lo")
    for fam in FAMILIES:
        b.add("nat", "OUTPUT", [Addr("dst", loopback[fam], neg=True), TCP, not_mark], Redirect(it.proxy_port),
              "outbound to the proxy outbound port")

    # --- raw: conntrack zone for the proxy's upstream DNS (apart from the app's redirected queries).
    if dns:
        b.chain("raw", "PREROUTING", "prerouting")
        b.chain("raw", "OUTPUT", "output")
        b.add("raw", "OUTPUT", [UDP, Port("dst", (it.resolver_port,)), mark], CtZone(DNS_ZONE_PROXY),
              "proxy upstream DNS queries")
        b.add("raw", "PREROUTING", [UDP, Port("src", (it.resolver_port,)), not_mark], CtZone(DNS_ZONE_PROXY),
              "upstream DNS answers")

    return Plan("ambient", b.build(), it.routes, it.local_addresses, it.ipv6)


__all__ = ["ambient_plan"]
