"""The eBPF lowering: an intent as the eBPF backend's map entries, typed.

``lower_ebpf(intent, families)`` says what a config writes for any pod: the ``pods`` map's
policy (``EbpfPolicy``: ports, flags, loopback range, owner ranges, owner groups, the resolver
port, each owner kind's hairpin ports, the passthrough addresses, the policy route's mark), the
``ports`` map's (kind, port) entries and the ``cidrs`` LPM trie's (prefix length, kind,
address) entries. ``pod_local`` adds what depends on the pod: its own addresses (``local``
CIDRs: a connect to them leaves over lo; inbound from them is the pod to itself).
``redirect.backends.ebpf`` only packs these into the structs of ``redirect/bpf/abi.h``; the programs
read them (``redirect/bpf/policy.h`` decides over these values, no literal of its own), and
``redirect.plan.evaluate`` models what they do with them.

Kinds are named, numbered and displayed here, once (``PORT_KINDS``, ``CIDR_KINDS``: the C header
redirect/bpf/kinds.h is generated from the table). A CIDR's prefix length is
its own (0-32 or 0-128): the trie key's prefix adds ``RDR_CIDR_PREFIX_BASE``, the 96 bits
of kind and netns cookie.
An ambient intent (``AmbientIntent``) lowers to a policy with ``ambient`` set (the node proxy's
marks, the ports, DNS, inbound capture) and the probe addresses as ``probe4``/``probe6`` entries;
its policy route (``fwmark conn_mark/mask lookup route_table``) is the intent's, which the backend
adds as the netfilter backends do, and whose mark the policy carries (a socket with it leaves over
lo). Options the eBPF backend refuses (``redirect.plan.intent.refusals``: ``drop_invalid``) have
no place here. ``pod_interfaces`` adds what ``exclude_interfaces`` and ``reroute_interfaces`` mean
in one pod (its links and routes). Nothing here touches a kernel or the native module.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..config import IdSpec
from .intent import AmbientIntent, AnyIntent, GroupsMode, PolicyRoute

PortKind = Literal["out_exclude", "out_include", "in_include", "in_exclude"]
CidrKind = Literal["out_exclude4", "out_include4", "dns4", "out_exclude6", "out_include6", "dns6",
                   "local4", "local6", "uid", "gid", "group", "iface_exclude", "via_exclude4", "via_exclude6",
                   "iface_reroute", "probe4", "probe6"]
#: What a ``cidrs`` key of a kind holds in its 16 bytes: an IPv4 or IPv6 network, an ifindex or an
#: owner id (both network order in the first 4 bytes, prefix blocks of the 32-bit number).
Shape = Literal["addr4", "addr6", "ifindex", "id"]

# The kinds of the ``ports`` and ``cidrs`` entries, the one table of them: (name, number, [shape,]
# display name). The number is the key's ``kind`` in the maps: native/build_native.py writes
# redirect/bpf/kinds.h from this table (``RDR_PORT_<NAME>``, ``RDR_CIDR_<NAME>``, which the
# programs read), and the display name is what ``check``, ``show`` and ``render`` print. Plain
# literals: the build reads them without importing the package. A kind added here is a kind the
# programs must read (tests/test_guards.py fails until redirect/bpf/ and redirect.plan.evaluate do).
PORT_KINDS = (
    ("out_exclude", 1, "outbound-exclude"),  # outbound_exclude_ports: never captured
    ("out_include", 2, "outbound-include"),  # outbound_ports: captured whatever the destination
    ("in_include", 3, "inbound-include"),  # inbound_ports (not "*"): captured
    ("in_exclude", 4, "inbound-exclude"),  # inbound_exclude_ports (inbound_ports "*"): not captured
)
CIDR_KINDS = (
    ("out_exclude4", 1, "addr4", "outbound-exclude"),  # outbound_exclude_cidrs
    ("out_include4", 2, "addr4", "outbound-include"),  # outbound_cidrs (not "*")
    ("dns4", 3, "addr4", "dns-server"),  # dns_servers (without capture_all_dns)
    ("out_exclude6", 4, "addr6", "outbound-exclude"),
    ("out_include6", 5, "addr6", "outbound-include"),
    ("dns6", 6, "addr6", "dns-server"),
    ("local4", 7, "addr4", "local"),  # the pod's own addresses: a connect to them leaves over lo
    ("local6", 8, "addr6", "local"),
    ("uid", 9, "id", "proxy-uid"),  # proxy_uids past the first range
    ("gid", 10, "id", "proxy-gid"),  # proxy_gids past the first range
    ("group", 11, "id", "owner-group"),  # owner_groups / owner_groups_exclude past the first range
    ("iface_exclude", 12, "ifindex", "excluded-interface"),  # exclude_interfaces, resolved in the pod
    ("via_exclude4", 13, "addr4", "via-excluded-interface"),  # destinations routed through one
    ("via_exclude6", 14, "addr6", "via-excluded-interface"),
    ("probe4", 15, "addr4", "probe-source"),  # ambient: probe_snat_ipv4
    ("probe6", 16, "addr6", "probe-source"),  # ambient: probe_snat_ipv6
    ("iface_reroute", 17, "ifindex", "reroute-interface"),  # reroute_interfaces, resolved in the pod
)
#: Kind name -> its number in the maps, and back; its display name; a CIDR kind's shape.
PORT_KIND: dict[PortKind, int] = {n: i for n, i, _d in PORT_KINDS}  # type: ignore[misc]
CIDR_KIND: dict[CidrKind, int] = {n: i for n, i, _s, _d in CIDR_KINDS}  # type: ignore[misc]
PORT_KIND_NAME: dict[int, PortKind] = {i: n for n, i in PORT_KIND.items()}
CIDR_KIND_NAME: dict[int, CidrKind] = {i: n for n, i in CIDR_KIND.items()}
KIND_DISPLAY: dict[str, str] = {n: d for n, _i, d in PORT_KINDS} | {n: d for n, _i, _s, d in CIDR_KINDS}
CIDR_SHAPE: dict[CidrKind, Shape] = {n: s for n, _i, s, _d in CIDR_KINDS}  # type: ignore[misc]
IdRange = tuple[int, int]
#: (family, address, ifindex) of one of the pod's own addresses; lo is ifindex 1 in every netns.
LocalAddr = tuple[int, str, int]
#: (family, destination CIDR, the interfaces of its next hops) of a route of the pod's main table.
Route = tuple[int, str, tuple[str, ...]]
LOOPBACK_IFINDEX = 1


@dataclass(frozen=True)
class EbpfPolicy:
    """The ``pods`` map's value for a pod (``struct pod_policy``, inventory and sources aside).

    Packed by name (``redirect.backends.ebpf.pod.entries``): a boolean is the flag ``RDR_F_<NAME>``,
    anything else the ``struct pod_policy`` field of its name (``loopback4`` is ``lo4_addr`` and
    ``lo4_mask``; ``groups_mode`` is ``RDR_GROUPS_<MODE>``); tests/test_guards.py checks that
    every one is packed and read by the programs."""

    proxy_port: int
    inbound_port: int
    tunnel_port: int
    dns_port: int
    #: Flags: every destination captured; DNS capture; to every server; others' lo traffic returns
    #: at the proxy owners' rules (sparing DNS); inbound capture; of every port; IPv6 captured too.
    out_all: bool
    dns: bool
    dns_all: bool
    lo_return: bool
    lo_return_spares_dns: bool
    inbound: bool
    inbound_all: bool
    v6: bool
    #: The IPv4 loopback range never captured (``ipv4_loopback_cidr``; ambient: 127.0.0.1/32).
    loopback4: str
    #: Per owner kind (proxy uids, proxy gids, owner groups): the first range and how many there
    #: are; the others are ``cidrs`` entries of kind ``uid``/``gid``/``group`` (any number).
    uid0: IdRange
    n_uids: int
    gid0: IdRange
    n_gids: int
    groups_mode: GroupsMode
    group0: IdRange
    n_groups: int
    #: ``inbound_interception="TPROXY"``: the proxy's lo traffic that nat leaves alone meets inbound
    #: capture (but from a socket with ``tproxy_mark``).
    tproxy: bool
    tproxy_mark: int
    #: ``exclude_interfaces`` is not empty: the pod's ``iface_exclude``/``via_exclude*`` entries count.
    excl_if: bool
    #: The port DNS capture takes traffic to.
    resolver_port: int
    #: Per owner kind, the ports its hairpin to inbound capture leaves alone (``HAIRPIN_SKIP_MAX``,
    #: a shorter list repeating its first).
    hairpin_uid_skip: tuple[int, ...]
    hairpin_gid_skip: tuple[int, ...]
    #: The source addresses of the proxy's inbound passthrough.
    passthrough4: str
    passthrough6: str
    #: The mark (under ``route_mask``) of sockets the plan's policy route delivers over lo, whatever
    #: their destination; ``route_mask`` 0: no such route.
    route_mark: int
    route_mask: int
    #: ``reroute_interfaces`` is not empty: inbound arriving on an ``iface_reroute`` interface goes to
    #: the outbound port (to an ``out_include*`` CIDR unless ``out_all``).
    reroute_if: bool = False
    #: ``sockmap``: the pod's app <-> proxy connections are paired (``redirect/bpf/sockmap.c``).
    sockmap: bool = False
    #: Ambient mode: the node proxy's sockets carry ``proxy_mark`` under ``mark_mask``; its
    #: transparent connections to the app carry ``conn_mark`` (the owner fields are unused).
    ambient: bool = False
    proxy_mark: int = 0
    mark_mask: int = 0
    conn_mark: int = 0


#: Room for the ports one owner kind's hairpin leaves alone (``RDR_HAIRPIN_SKIP_MAX``, abi.h).
HAIRPIN_SKIP_MAX = 2


@dataclass(frozen=True)
class EbpfEntries:
    """What one config writes for any pod: the policy, ``ports`` and ``cidrs`` entries."""

    policy: EbpfPolicy
    ports: tuple[tuple[PortKind, int], ...]
    #: (prefix length of the CIDR, kind, its network address as 16 bytes, IPv4 in the first 4);
    #: an owner id range past its kind's first as prefix blocks of the 32-bit id (network order).
    cidrs: tuple[tuple[int, CidrKind, bytes], ...]
    #: ``exclude_interfaces``, ``reroute_interfaces``: what ``pod_interfaces`` resolves in each pod.
    exclude_interfaces: tuple[str, ...] = ()
    reroute_interfaces: tuple[str, ...] = ()


def _range(i: IdSpec) -> IdRange:
    return (i, i) if isinstance(i, int) else i


def _id_blocks(ranges: Iterable[IdRange], kind: CidrKind) -> list[tuple[int, CidrKind, bytes]]:
    """Owner id ranges as LPM prefix blocks of the id, big-endian in the first 4 bytes."""
    out: list[tuple[int, CidrKind, bytes]] = []
    for lo, hi in ranges:
        for net in ipaddress.summarize_address_range(ipaddress.IPv4Address(lo), ipaddress.IPv4Address(hi)):
            out.append((net.prefixlen, kind, net.network_address.packed.ljust(16, b"\0")))
    return out


def _cidr_spec(cidr: str, kind4: CidrKind, kind6: CidrKind) -> tuple[int, CidrKind, bytes]:
    net = ipaddress.ip_network(cidr, strict=False)
    return net.prefixlen, kind4 if net.version == 4 else kind6, net.network_address.packed.ljust(16, b"\0")


def _hairpin_skip(ports: tuple[int, ...]) -> tuple[int, ...]:
    if not 1 <= len(ports) <= HAIRPIN_SKIP_MAX:
        raise ValueError(f"eBPF lowering: a hairpin leaves {len(ports)} ports alone; the policy has room for"
                         f" 1 to {HAIRPIN_SKIP_MAX}")
    return ports + (ports[0],) * (HAIRPIN_SKIP_MAX - len(ports))


def _host(cidr: str, bits: int) -> str:
    net = ipaddress.ip_network(cidr)
    if net.prefixlen != bits:
        raise ValueError(f"eBPF lowering: {cidr} is not one address")
    return str(net.network_address)


def _route_mark(routes: tuple[PolicyRoute, ...]) -> tuple[int, int]:
    """(mark, mask) of the intent's policy routes (all by one mark), (0, 0) without any."""
    marks = {(r.fwmark, r.mask) for r in routes}
    if len(marks) > 1:
        raise ValueError(f"eBPF lowering: policy routes by {len(marks)} marks; the policy has room for one")
    return marks.pop() if marks else (0, 0)


def lower_ebpf(it: AnyIntent, families: tuple[int, ...]) -> EbpfEntries:
    """The map entries of ``it`` for a pod captured in ``families`` (``(4,)`` or ``(4, 6)``).

    Options a backend refuses (``redirect.plan.intent.refusals``: ``drop_invalid``) have no place
    here; ``ValueError`` only for an intent past the policy's room (none ``intent_of`` makes).
    """
    if isinstance(it, AmbientIntent):
        return lower_ambient(it, families)
    uids = [_range(i) for i in it.owners_of("uid")]
    gids = [_range(i) for i in it.owners_of("gid")]
    groups = [_range(g) for g in it.groups]
    route_mark, route_mask = _route_mark(it.routes)
    policy = EbpfPolicy(
        proxy_port=it.proxy_port, inbound_port=it.inbound_port, tunnel_port=it.tunnel_port, dns_port=it.dns_port,
        out_all=it.outbound_all, dns=it.dns, dns_all=it.dns_all, lo_return=it.lo_return,
        lo_return_spares_dns=it.lo_return_spares_dns,
        inbound=it.inbound, inbound_all=it.inbound and it.inbound_all, v6=6 in families,
        loopback4=it.loopback_of(4),
        uid0=uids[0] if uids else (0, 0), n_uids=len(uids), gid0=gids[0] if gids else (0, 0), n_gids=len(gids),
        groups_mode=it.groups_mode, group0=groups[0] if groups else (0, 0), n_groups=len(groups),
        tproxy=it.interception == "TPROXY", tproxy_mark=it.tproxy_mark if it.interception == "TPROXY" else 0,
        excl_if=bool(it.exclude_interfaces), resolver_port=it.resolver_port,
        hairpin_uid_skip=_hairpin_skip(it.hairpin_exclude_of("uid")),
        hairpin_gid_skip=_hairpin_skip(it.hairpin_exclude_of("gid")),
        passthrough4=_host(it.passthrough_of(4), 32), passthrough6=_host(it.passthrough_of(6), 128),
        route_mark=route_mark, route_mask=route_mask, reroute_if=bool(it.reroute_interfaces), sockmap=it.sockmap,
    )
    ports: dict[tuple[PortKind, int], None] = {}
    for p in it.outbound_exclude_ports:
        ports[("out_exclude", p)] = None
    for p in it.outbound_include_ports:
        ports[("out_include", p)] = None
    if it.inbound:
        if it.inbound_all:
            for p in it.inbound_exclude_ports:
                ports[("in_exclude", p)] = None
        else:
            for p in it.inbound_include_ports:
                ports[("in_include", p)] = None
    cidrs: dict[tuple[int, CidrKind, bytes], None] = {}

    def add(items: Iterable[str], kind4: CidrKind, kind6: CidrKind) -> None:
        for c in items:
            spec = _cidr_spec(c, kind4, kind6)
            if spec[1] == kind6 and 6 not in families:
                continue
            cidrs[spec] = None

    add(it.outbound_exclude_cidrs, "out_exclude4", "out_exclude6")
    add(it.outbound_include_cidrs, "out_include4", "out_include6")
    add((c for _f, c in it.dns_servers), "dns4", "dns6")
    owner_kinds: tuple[tuple[list[IdRange], CidrKind], ...] = ((uids, "uid"), (gids, "gid"), (groups, "group"))
    for ranges, kind in owner_kinds:
        for spec in _id_blocks(ranges[1:], kind):
            cidrs[spec] = None
    return EbpfEntries(policy, tuple(ports), tuple(cidrs), it.exclude_interfaces, it.reroute_interfaces)


def lower_ambient(it: AmbientIntent, families: tuple[int, ...]) -> EbpfEntries:
    """The map entries of an ambient intent: the ports, DNS and inbound capture, the marks, and
    the probe addresses (``probe4``/``probe6``); ``reroute_interfaces`` as for a sidecar (each pod's
    ``iface_reroute`` entries, ``pod_interfaces``: all their inbound TCP to the outbound port)."""
    route_mark, route_mask = _route_mark(it.routes)
    policy = EbpfPolicy(
        proxy_port=it.proxy_port, inbound_port=it.inbound_port, tunnel_port=it.tunnel_port, dns_port=it.dns_port,
        out_all=False, dns=it.dns, dns_all=False, lo_return=False, lo_return_spares_dns=False, inbound=it.inbound,
        inbound_all=False, v6=6 in families, loopback4=it.loopback_of(4), uid0=(0, 0), n_uids=0, gid0=(0, 0),
        n_gids=0, groups_mode="all", group0=(0, 0), n_groups=0, tproxy=False, tproxy_mark=0, excl_if=False,
        resolver_port=it.resolver_port, hairpin_uid_skip=(0,) * HAIRPIN_SKIP_MAX,
        hairpin_gid_skip=(0,) * HAIRPIN_SKIP_MAX, passthrough4="0.0.0.0", passthrough6="::",
        route_mark=route_mark, route_mask=route_mask,
        reroute_if=bool(it.reroute_interfaces), sockmap=it.sockmap, ambient=True, proxy_mark=it.proxy_mark,
        mark_mask=it.mark_mask, conn_mark=it.conn_mark,
    )
    cidrs = tuple(_cidr_spec(c, "probe4", "probe6") for f, c in it.probe_sources if f in families)
    return EbpfEntries(policy, (), cidrs, (), it.reroute_interfaces)


def pod_local(families: tuple[int, ...], local: Iterable[LocalAddr],
              held: str | None = None) -> tuple[tuple[int, CidrKind, bytes], ...]:
    """The ``local`` CIDR entries of a pod's own addresses ``local`` (every one but loopback, IPv6
    link-local ones included, as the backend's scan lists them): a connect to them leaves over lo
    (Istio's ``-o lo`` rules), and inbound from them is the pod talking to itself. ``held``: the
    IPv6 link-local address the pod's policy holds (``ll6``, the first it has): one of its own
    too, without an entry. A link-local address counts alone: the programs cannot see the scope
    id a connect names its interface by."""
    skip = ipaddress.ip_address(held).packed if held is not None else None
    out: dict[tuple[int, CidrKind, bytes], None] = {}
    for f, ip, _index in local:
        raw = ipaddress.ip_address(ip).packed
        if f in families and raw != skip:
            out[(32 if f == 4 else 128, "local4" if f == 4 else "local6", raw.ljust(16, b"\0"))] = None
    return tuple(out)


def pod_interfaces(entries: EbpfEntries, families: tuple[int, ...], links: Iterable[tuple[str, int]],
                   routes: Iterable[Route]) -> tuple[tuple[int, CidrKind, bytes], ...]:
    """The entries of ``exclude_interfaces`` and ``reroute_interfaces`` in a pod with ``links``
    (name, ifindex) and the main table's ``routes``: each rerouted interface's ifindex (inbound
    arriving on it goes to the outbound port); each excluded interface's ifindex (inbound
    arriving on it, or a socket bound to it, is not captured), and the destinations the routes
    send through an excluded interface (outbound to them is not captured): a route through one,
    less the more specific routes inside it (those through an excluded interface count on their
    own). Link-local routes (``fe80::/64`` on each interface) are left out: a link-local
    destination's interface is its socket's scope id, which no program sees, so the route that
    covers it (the default) decides, as for any destination.
    ``ValueError`` for a route whose next hops are on excluded and other interfaces alike (where
    such a connection leaves is the kernel's pick per flow).
    """
    excl, reroute = set(entries.exclude_interfaces), set(entries.reroute_interfaces)
    out: list[tuple[int, CidrKind, bytes]] = []
    for name, index in links:
        if name in reroute:
            out.append((32, "iface_reroute", index.to_bytes(4, "big").ljust(16, b"\0")))
    if not excl:
        return tuple(out)
    for name, index in links:
        if name in excl:
            out.append((32, "iface_exclude", index.to_bytes(4, "big").ljust(16, b"\0")))
    for fam in families:
        best: dict[ipaddress.IPv4Network | ipaddress.IPv6Network, bool] = {}
        for f, cidr, devs in routes:
            net = ipaddress.ip_network(cidr, strict=False)
            if f != fam or net.is_link_local or net in best or not devs:
                continue  # (the first of equal prefixes: the dump's order is the kernel's preference)
            via = {d in excl for d in devs}
            if len(via) > 1:
                raise ValueError(f"exclude_interfaces: the route to {cidr} has next hops through "
                                 f"{', '.join(sorted(devs))}, excluded and not alike")
            best[net] = via.pop()
        kind: CidrKind = "via_exclude4" if fam == 4 else "via_exclude6"
        for net, excluded in best.items():
            if not excluded:
                continue
            pieces = [net]
            for other in best:
                if other != net and other.prefixlen > net.prefixlen and other.subnet_of(net):  # type: ignore[arg-type]
                    pieces = [q for p in pieces for q in ((p,) if not other.overlaps(p) else
                              (() if p.subnet_of(other) else p.address_exclude(other)))]  # type: ignore[arg-type]
            out += [(p.prefixlen, kind, p.network_address.packed.ljust(16, b"\0")) for p in pieces]
    return tuple(dict.fromkeys(out))


__all__ = ["pod_interfaces", "Route", "HAIRPIN_SKIP_MAX", "PORT_KINDS", "CIDR_KINDS", "PORT_KIND", "CIDR_KIND",
           "PORT_KIND_NAME", "CIDR_KIND_NAME", "KIND_DISPLAY", "CIDR_SHAPE", "Shape",
           "EbpfPolicy", "EbpfEntries", "PortKind", "CidrKind", "IdRange", "LocalAddr", "lower_ebpf", "lower_ambient",
           "pod_local",
           "LOOPBACK_IFINDEX"]
