"""The capture intent: what a config captures, decided once, before any backend's shape.

``intent_of(cfg)`` turns a sidecar ``RedirectConfig`` into an ``Intent`` (``ambient_intent_of``
an ambient one into an ``AmbientIntent``): a small, typed, frozen
statement of the capture semantics (which outbound ports and CIDRs are excluded or
included, whose traffic is the proxy's, which owner groups are captured, DNS capture and its
servers, which inbound ports go to the proxy, the loopback and passthrough addresses, the
families). Every derived decision the backends share is made here, once (Istio's "DNS
capture is off without servers", "an included loopback CIDR keeps the app's lo traffic",
"the hairpin skips the tunnel port and DNS", ...).

Lowerings turn an intent into one backend family's shape, each without consulting the config
again:

- ``redirect.plan`` (``build_plan``): netfilter chains in the plan vocabulary, which the
  iptables and nftables backends render;
- ``redirect.plan.lower_ebpf`` (``lower_ebpf``): the eBPF backend's map entries, which
  ``redirect/bpf/policy.h`` reads.

``redirect.plan.evaluate`` interprets both for one connection (where it lands), and the tests
check, without root, that the two lowerings agree. What a backend cannot lower is decided here
too (``refusals``), and so are the addresses and policy routes every backend installs besides
its rules or entries (``local_addresses``, ``routes``). Backends are given the intent, never the
config (``intent_for``).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from dataclasses import dataclass
from typing import Literal, Union

from ..config import IdSpec, Interception, RedirectConfig

Family = Literal[4, 6]
OwnerKind = Literal["uid", "gid"]
#: Owner groups: every group captured, only the listed ones, or all but the listed ones.
GroupsMode = Literal["all", "only", "exclude"]

FAMILIES: tuple[Family, ...] = (4, 6)
# Istio's fixed values that are not configurable there either.
INBOUND_PASSTHROUGH_V4 = "127.0.0.6/32"
INBOUND_PASSTHROUGH_V6 = "::6/128"
LOOPBACK_V6 = "::1/128"
#: The port DNS capture takes traffic to (Istio's, not configurable there).
DNS_PORT = 53
#: A policy route's mask that compares the whole mark.
WHOLE_MARK = 0xFFFFFFFF


@dataclass(frozen=True)
class LocalAddress:
    """An address the plan needs on an interface (``::6`` on ``lo``: the source of the proxy's IPv6
    inbound passthrough; backends add IPv6 ones only in a pod with IPv6 of its own)."""

    family: Family
    cidr: str
    dev: str = "lo"


@dataclass(frozen=True)
class PolicyRoute:
    """``ip rule fwmark MARK/MASK lookup TABLE`` + ``local default dev lo table TABLE``: what a
    socket (or packet) with that mark sends, whatever its destination, is delivered in the pod
    (over lo)."""

    family: Family
    fwmark: int
    mask: int
    table: int


@dataclass(frozen=True)
class Refusal:
    """An option of an intent that a backend cannot lower, and why."""

    option: str
    why: str


def _cached_hash(self: object) -> int:
    """A frozen dataclass's hash, computed once: intents key the lowering and plan caches on every
    setup, and the hash of every field (nested tuples) is the same each time."""
    h: int | None = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))  # type: ignore[arg-type]
        object.__setattr__(self, "_hash", h)
    return h


@dataclass(frozen=True)
class Intent:
    """What one sidecar config captures (``intent_of``). Field order follows Istio's rule purposes."""

    __hash__ = _cached_hash

    proxy_port: int
    inbound_port: int
    tunnel_port: int
    dns_port: int
    #: The proxy's identities, uids first, in config order: its traffic is never captured again.
    proxy_owners: tuple[tuple[OwnerKind, IdSpec], ...]
    #: Owner groups (primary gid of the connecting task) whose outbound is captured.
    groups_mode: GroupsMode
    groups: tuple[IdSpec, ...]
    # --- interfaces and packet-level options ---
    exclude_interfaces: tuple[str, ...]
    reroute_interfaces: tuple[str, ...]
    #: Drop what conntrack deems INVALID (netfilter only: ``refusals``).
    drop_invalid: bool
    #: The app <-> proxy connections are paired in a sockmap (eBPF only).
    sockmap: bool
    # --- inbound ---
    #: Inbound TCP is captured at all (``inbound_ports`` not empty).
    inbound: bool
    #: Every inbound port is captured but ``inbound_exclude_ports`` (and the tunnel port).
    inbound_all: bool
    #: With ``inbound_all``: the ports not captured, in config order.
    inbound_exclude_ports: tuple[int, ...]
    #: Without ``inbound_all``: the ports captured (listed, not excluded; the tunnel port, never
    #: captured, may be among them), in config order.
    inbound_include_ports: tuple[int, ...]
    interception: Interception
    tproxy_mark: int
    # --- outbound ---
    outbound_exclude_ports: tuple[int, ...]
    #: Ports captured whatever their destination (after the exclusions).
    outbound_include_ports: tuple[int, ...]
    #: Every destination is captured (``outbound_cidrs == "*"``); else only ``outbound_include_cidrs``.
    outbound_all: bool
    outbound_include_cidrs: tuple[str, ...]
    outbound_exclude_cidrs: tuple[str, ...]
    #: Per family, the loopback range never captured outbound (IPv4: ``ipv4_loopback_cidr``).
    loopback: tuple[tuple[Family, str], ...]
    #: Per family, the source of the proxy's inbound passthrough (never captured over lo).
    passthrough: tuple[tuple[Family, str], ...]
    #: Others' traffic over lo returns at each proxy owner's rules (Istio's "app traffic over lo");
    #: not when an included CIDR is loopback (then the app's lo traffic meets the CIDR rules).
    lo_return: bool
    #: That return leaves DNS alone (UDP, and TCP to ``resolver_port``), which DNS capture then takes.
    lo_return_spares_dns: bool
    # --- DNS ---
    #: DNS capture is on (Istio: only with ``capture_all_dns`` or some servers).
    dns: bool
    dns_all: bool
    #: Without ``dns_all``: the servers whose DNS traffic is captured, as host CIDRs.
    dns_servers: tuple[tuple[Family, str], ...]
    #: The port DNS capture takes traffic to (53).
    resolver_port: int
    #: Per owner kind, the ports the proxy's lo hairpin to inbound capture leaves alone.
    hairpin_exclude: tuple[tuple[OwnerKind, tuple[int, ...]], ...]
    # --- what every backend installs besides its rules or entries ---
    #: Addresses the pod needs (on lo) when it has an IPv6 address of its own.
    local_addresses: tuple[LocalAddress, ...]
    #: Policy routes (TPROXY with inbound capture: the proxy's marked traffic is delivered over lo).
    routes: tuple[PolicyRoute, ...]
    #: IPv6 captured: True, False, or None = whenever the namespace has IPv6.
    ipv6: bool | None

    def loopback_of(self, family: Family) -> str:
        return dict(self.loopback)[family]

    def passthrough_of(self, family: Family) -> str:
        return dict(self.passthrough)[family]

    def dns_servers_of(self, family: Family) -> tuple[str, ...]:
        return tuple(c for f, c in self.dns_servers if f == family)

    def owners_of(self, kind: OwnerKind) -> tuple[IdSpec, ...]:
        return tuple(i for k, i in self.proxy_owners if k == kind)

    def hairpin_exclude_of(self, kind: OwnerKind) -> tuple[int, ...]:
        return dict(self.hairpin_exclude)[kind]


@dataclass(frozen=True)
class AmbientIntent:
    """What one ambient config captures (``ambient_intent_of``), for a node proxy that opens its
    listeners in the pod's netns and marks its sockets."""

    __hash__ = _cached_hash

    proxy_port: int
    inbound_port: int
    tunnel_port: int
    dns_port: int
    #: The node proxy's socket mark under ``mark_mask``: its traffic is never captured.
    proxy_mark: int
    mark_mask: int
    #: Connmark of the proxy's connections to the app, under ``mark_mask``: their replies are
    #: routed back to it by ``routes``.
    conn_mark: int
    #: Inbound TCP is captured (not Istio's ingress mode, ``bypass_inbound_capture``).
    inbound: bool
    #: UDP and TCP to ``resolver_port`` go to the DNS port (``dns_capture``; ambient needs no servers).
    dns: bool
    #: The port DNS capture takes traffic to (53).
    resolver_port: int
    #: Interfaces whose inbound TCP goes to the outbound port.
    reroute_interfaces: tuple[str, ...]
    #: The app <-> node proxy connections are paired in a sockmap (eBPF only).
    sockmap: bool
    #: Per family, the host address kubelet probes come from: they reach the app directly.
    probe_sources: tuple[tuple[Family, str], ...]
    #: Per family, loopback: never captured.
    loopback: tuple[tuple[Family, str], ...]
    #: The policy routes by ``conn_mark``: the app's replies to the proxy's transparent connections
    #: are delivered over lo, back to it.
    routes: tuple[PolicyRoute, ...]
    #: Addresses the pod needs: none in ambient mode.
    local_addresses: tuple[LocalAddress, ...]
    ipv6: bool | None

    def probe_source_of(self, family: Family) -> str:
        return dict(self.probe_sources)[family]

    def loopback_of(self, family: Family) -> str:
        return dict(self.loopback)[family]


@functools.lru_cache(maxsize=64)
def ambient_intent_of(cfg: RedirectConfig) -> AmbientIntent:
    """The intent of an ambient ``cfg`` (cached)."""
    return AmbientIntent(
        proxy_port=cfg.proxy_port, inbound_port=cfg.inbound_port, tunnel_port=cfg.tunnel_port,
        dns_port=cfg.dns_port, proxy_mark=cfg.proxy_mark, mark_mask=cfg.proxy_mark_mask, conn_mark=cfg.conn_mark,
        inbound=not cfg.bypass_inbound_capture, dns=cfg.dns_capture, resolver_port=DNS_PORT,
        reroute_interfaces=cfg.reroute_interfaces, sockmap=cfg.sockmap,
        probe_sources=((4, f"{cfg.probe_snat_ipv4}/32"), (6, f"{cfg.probe_snat_ipv6}/128")),
        loopback=((4, "127.0.0.1/32"), (6, LOOPBACK_V6)),
        routes=tuple(PolicyRoute(fam, cfg.conn_mark, cfg.proxy_mark_mask, cfg.route_table) for fam in FAMILIES),
        local_addresses=(), ipv6=cfg.ipv6,
    )


@functools.lru_cache(maxsize=256)
def intent_of(cfg: RedirectConfig) -> Intent:
    """The intent of ``cfg`` (cached: configs are frozen and pods share a few)."""
    dns = cfg.dns_effective
    if cfg.owner_groups_exclude:
        groups_mode: GroupsMode = "exclude"
        groups: tuple[IdSpec, ...] = cfg.owner_groups_exclude
    elif cfg.owner_groups != "*":
        groups_mode, groups = "only", tuple(cfg.owner_groups)
    else:
        groups_mode, groups = "all", ()
    include = cfg.outbound_cidrs
    inbound_all = cfg.inbound_ports == "*"
    servers: list[tuple[Family, str]] = []
    if not cfg.capture_all_dns:
        servers += [(4, f"{s}/32") for s in cfg.dns_servers_of_family(4)]
        servers += [(6, f"{s}/128") for s in cfg.dns_servers_of_family(6)]
    inbound = cfg.inbound_ports != ()
    excluded = set(cfg.inbound_exclude_ports)  # a set: both lists may be long
    # With DNS capture the proxy's own DNS over lo is not hairpinned either (Istio: only for uids;
    # for gids only with gid_hairpin_skips_dns, our default, see docs/api.md).
    hairpin: dict[OwnerKind, tuple[int, ...]] = {
        kind: (DNS_PORT, cfg.tunnel_port) if dns and (kind == "uid" or cfg.gid_hairpin_skips_dns)
        else (cfg.tunnel_port,) for kind in ("uid", "gid")}
    tproxy = cfg.inbound_interception == "TPROXY"
    return Intent(
        proxy_port=cfg.proxy_port,
        inbound_port=cfg.inbound_port,
        tunnel_port=cfg.tunnel_port,
        dns_port=cfg.dns_port,
        proxy_owners=tuple([("uid", i) for i in cfg.proxy_uids] + [("gid", i) for i in cfg.proxy_gids]),
        groups_mode=groups_mode,
        groups=groups,
        exclude_interfaces=cfg.exclude_interfaces,
        reroute_interfaces=cfg.reroute_interfaces,
        drop_invalid=cfg.drop_invalid,
        sockmap=cfg.sockmap,
        inbound=inbound,
        inbound_all=inbound_all,
        inbound_exclude_ports=cfg.inbound_exclude_ports if inbound_all else (),
        inbound_include_ports=() if cfg.inbound_ports == "*" else tuple(
            p for p in cfg.inbound_ports if p not in excluded),
        interception=cfg.inbound_interception,
        tproxy_mark=cfg.tproxy_mark,
        outbound_exclude_ports=cfg.outbound_exclude_ports,
        outbound_include_ports=cfg.outbound_ports,
        outbound_all=include == "*",
        outbound_include_cidrs=() if include == "*" else tuple(include),
        outbound_exclude_cidrs=cfg.outbound_exclude_cidrs,
        loopback=((4, cfg.ipv4_loopback_cidr), (6, LOOPBACK_V6)),
        passthrough=((4, INBOUND_PASSTHROUGH_V4), (6, INBOUND_PASSTHROUGH_V6)),
        # An included loopback CIDR keeps the app's lo traffic for the CIDR rules; with DNS capture
        # the return leaves DNS to it (Istio: "-o lo -p tcp ! --dport 53 ... -j RETURN").
        lo_return=include == "*" or not any(ipaddress.ip_network(c).is_loopback for c in include),
        lo_return_spares_dns=dns,
        dns=dns,
        dns_all=dns and cfg.capture_all_dns,
        dns_servers=tuple(servers) if dns else (),
        resolver_port=DNS_PORT,
        hairpin_exclude=tuple(hairpin.items()),
        # The proxy's inbound passthrough binds ::6 (IPv4 has all of 127/8 on lo already). As in
        # istio-iptables, it comes whatever the inbound ports (the backends add it only in a pod
        # with IPv6 of its own, Istio's EnableIPv6).
        local_addresses=(LocalAddress(6, INBOUND_PASSTHROUGH_V6),),
        # TPROXY delivers by mark: the policy route takes the marked traffic to lo (istio-iptables'
        # ConfigureRoutes), only with inbound capture.
        routes=tuple(PolicyRoute(fam, cfg.tproxy_mark, WHOLE_MARK, cfg.tproxy_route_table) for fam in FAMILIES)
        if tproxy and inbound else (),
        ipv6=cfg.ipv6,
    )


#: An intent of either mode.
AnyIntent = Union[Intent, AmbientIntent]


def intent_for(cfg: RedirectConfig) -> AnyIntent:
    """The intent of ``cfg``, sidecar or ambient (cached): what the backends are given."""
    return ambient_intent_of(cfg) if cfg.mode == "ambient" else intent_of(cfg)


#: The kinds of capture, by what their backends lower an intent to.
BackendKind = Literal["iptables", "nftables", "ebpf"]


def refusals(it: AnyIntent, kind: BackendKind) -> tuple[Refusal, ...]:
    """The options of ``it`` that backends of ``kind`` cannot lower, and why: every such decision,
    here once (setup with that backend raises ``BackendUnavailable`` naming the first; ``auto``
    chooses another)."""
    out: list[Refusal] = []
    if kind == "ebpf" and isinstance(it, Intent) and it.drop_invalid:
        out.append(Refusal(
            "drop_invalid=True",
            "conntrack's INVALID verdict exists only for packets conntrack tracks, and it tracks none in a"
            " netns without netfilter rules that use it: bpf_skb_ct_lookup finds no entry there and BPF cannot"
            " run conntrack on a packet"))
    if kind != "ebpf" and it.sockmap:
        out.append(Refusal(
            "sockmap=True",
            "it pairs the two ends of the app's connections with its proxy in a BPF sockmap, which only the"
            " eBPF backend installs"))
    return tuple(out)


__all__ = ["Intent", "intent_of", "AmbientIntent", "ambient_intent_of", "AnyIntent", "intent_for", "LocalAddress",
           "PolicyRoute", "Refusal", "refusals", "BackendKind", "Family", "OwnerKind", "GroupsMode", "FAMILIES",
           "INBOUND_PASSTHROUGH_V4", "INBOUND_PASSTHROUGH_V6", "LOOPBACK_V6", "DNS_PORT", "WHOLE_MARK"]
