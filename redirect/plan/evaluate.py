"""Where one connection lands, by each lowering: pure evaluators, no kernel.

``evaluate_plan`` interprets a netfilter plan (``redirect.plan``): the first packet of a
connection walks the hook chains table by table (raw, mangle, nat), following jumps and
returns, matching on the typed vocabulary, until a verdict. ``evaluate_ebpf`` is a model of
what the eBPF programs do with the map entries of ``redirect.plan.lower_ebpf``: ``connect4/6``
and ``sendmsg4/6`` (``redirect4``/``redirect6`` in ``redirect/bpf/sock_addr.c``, ``outbound_target``
in ``redirect/bpf/policy.h``) for outbound, ``rdr_sk_lookup`` (``redirect/bpf/sk_lookup.c``) for inbound,
``rdr_tc_ingress`` (``redirect/bpf/tc_forward.c``) for what the pod forwards (arriving on any of its
interfaces), these two by one decision (``pod_listener`` in ``redirect/bpf/policy.h``),
statement for statement, with the LPM trie's prefix rules. A change to those programs'
decisions changes this model with it; ``tests/test_lowerings.py`` then says whether they
still agree with the netfilter plan. Both answer a ``Landing``:

- ``("redirect", port)``: the connection goes to the local port (NAT ``REDIRECT``, a connect
  rewritten to loopback, or sk_lookup handing it to the proxy's inbound listener);
- ``("tproxy", port)``: delivered to a transparent listener (netfilter ``TPROXY``);
- ``("direct",)``: untouched; ``("drop",)``: dropped.

The pod is described by ``PodNet`` (its own addresses, IPv6 link-local ones included; a
destination among them, or a loopback one, leaves over lo) and the connection by ``Conn``, both
in ``redirect.plan.podnet`` (the kernel's part: what a connect is before any rule or program).
Modelled: the first packet of a new connection (conntrack state NEW) and its socket's owner and
mark; an IPv6 socket's connect to an IPv4-mapped address (``::ffff:a.b.c.d``: IPv4 packets for
netfilter, ``connect6`` for the programs); in ambient mode, the node proxy's transparent
connections to the app (a bound source that is not the pod's); the plan's policy routes (``local
default dev lo`` by mark: TPROXY's ``tproxy_mark``, ambient's ``conn_mark``), which take a socket
with that mark over lo whatever its destination; a connect to an IPv6 link-local address, which
names its interface by scope id (``fe80::1%eth0``: the kernel binds the socket to it), local only
when the address is on that interface: netfilter's nat REDIRECT of such a connection sends it to
loopback through that interface, where it is lost (``drop``), and the programs, which cannot see a
scope id, judge the address alone (one of the pod's own, on whichever interface, is local to
them). Not modelled: other routing beyond "local or out through the longest matching route of
``PodNet``", ``sendmsg`` with an explicit source (``IP_PKTINFO``), a connect to a link-local
address without a scope id (the kernel refuses it under netfilter), UDP to a link-local address
(whether a redirected datagram is lost depends on whether its socket is connected), a socket with
a policy route's mark connecting to a link-local address.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Union

from ..config import IdSpec
from .intent import PolicyRoute
from .lower_ebpf import (
    LOOPBACK_IFINDEX,
    CidrKind,
    EbpfEntries,
    EbpfPolicy,
    IdRange,
    pod_interfaces,
    pod_local,
)
from .podnet import V6_LOOPBACK, Conn, PodNet
from .podnet import ip_of as _ip
from .podnet import mapped as _mapped
from .podnet import net_of as _net
from .podnet import scoped_link_local as _scoped_link_local
from .vocabulary import (
    Accept,
    Addr,
    Chain,
    ConnMark,
    CtState,
    CtZone,
    Drop,
    Iface,
    Jump,
    Mark,
    Owner,
    Plan,
    Port,
    Proto,
    Redirect,
    RestoreMark,
    Return,
    Rule,
    SaveMark,
    SetConnMark,
    SetMark,
    TProxy,
)

Landing = Union[tuple[Literal["redirect", "tproxy"], int], tuple[Literal["direct", "drop"]]]
DIRECT: Landing = ("direct",)
DROP: Landing = ("drop",)


# --- netfilter -------------------------------------------------------------------------


@dataclass
class _Packet:
    conn: Conn
    src: str
    in_iface: str | None
    out_iface: str | None
    local: bool  # locally generated: has a socket (owner matches)
    mark: int = 0
    ctmark: int = 0


class _Accept:
    """Verdict: accepted in this table's hook."""


_ACCEPT = _Accept()
_Verdict = Union[Landing, _Accept, None]  # None: fell through (Return or end of chain)


def _in_ids(spec: IdSpec, i: int) -> bool:
    lo, hi = (spec, spec) if isinstance(spec, int) else spec
    return lo <= i <= hi


def _matches(m: object, pkt: _Packet) -> bool:
    c = pkt.conn
    if isinstance(m, Proto):
        return c.proto == m.name
    if isinstance(m, Addr):
        ip = _ip(pkt.src if m.side == "src" else c.dst)
        net = _net(m.cidr)
        return (ip.version == net.version and ip in net) != m.neg
    if isinstance(m, Port):
        return ((c.sport if m.side == "src" else c.port) in m.ports) != m.neg
    if isinstance(m, Iface):
        name = pkt.in_iface if m.side == "in" else pkt.out_iface
        return (name == m.name) != m.neg
    if isinstance(m, Owner):
        if not pkt.local:
            return m.neg  # xt_owner without a socket: (match ^ invert) == 0
        return _in_ids(m.id, c.uid if m.kind == "uid" else c.gid) != m.neg
    if isinstance(m, Mark):
        return ((pkt.mark & m.mask) == m.value) != m.neg
    if isinstance(m, ConnMark):
        return ((pkt.ctmark & m.mask) == m.value) != m.neg
    if isinstance(m, CtState):
        return "NEW" in m.states  # the first packet of a connection
    raise NotImplementedError(f"evaluate: no model of match {m!r}")


def _run(chains: dict[str, Chain], chain: Chain, pkt: _Packet, depth: int = 0) -> _Verdict:
    if depth > 16:
        raise RecursionError(f"evaluate: jumps nest deeper than 16 at {chain.name}")
    for rule in chain.rules:
        if not all(_matches(m, pkt) for m in rule.matches):
            continue
        v = _act(chains, rule, pkt, depth)
        if v is not _CONTINUE:
            return v  # type: ignore[return-value]
    return None


_CONTINUE = object()


def _act(chains: dict[str, Chain], rule: Rule, pkt: _Packet, depth: int) -> object:
    a = rule.action
    if isinstance(a, Jump):
        v = _run(chains, chains[a.chain], pkt, depth + 1)
        return _CONTINUE if v is None else v
    if isinstance(a, Return):
        return None
    if isinstance(a, Accept):
        return _ACCEPT
    if isinstance(a, Drop):
        return DROP
    if isinstance(a, Redirect):
        return ("redirect", a.port)
    if isinstance(a, TProxy):
        return ("tproxy", a.port)
    if isinstance(a, SetMark):
        pkt.mark = (pkt.mark & ~a.mask) | a.value
    elif isinstance(a, SetConnMark):
        pkt.ctmark = (pkt.ctmark & ~a.mask) | a.value
    elif isinstance(a, SaveMark):
        pkt.ctmark = (pkt.ctmark & ~a.mask) | (pkt.mark & a.mask)
    elif isinstance(a, RestoreMark):
        pkt.mark = (pkt.mark & ~a.mask) | (pkt.ctmark & a.mask)
    elif not isinstance(a, CtZone):
        raise NotImplementedError(f"evaluate: no model of action {a!r}")
    return _CONTINUE  # MARK, CONNMARK and CT targets do not end the chain


def _hooks(plan_chains: tuple[Chain, ...], hook: str, tables: tuple[str, ...], pkt: _Packet) -> Landing | None:
    """Run ``hook`` through ``tables`` in priority order; a landing, or None (accepted by all)."""
    for table in tables:
        chains = {c.name: c for c in plan_chains if c.table == table}
        entry = next((c for c in chains.values() if c.hook == hook), None)
        if entry is None:
            continue
        v = _run(chains, entry, pkt)
        if isinstance(v, tuple):
            return v
    return None


def _routed_to_lo(routes: tuple[PolicyRoute, ...], family: int, mark: int) -> bool:
    """Whether a socket with ``mark`` is taken over lo by one of the plan's policy routes (``local
    default dev lo``), whatever its destination (the local table, consulted first, keeps the pod's
    own addresses where they are)."""
    return any(r.family == family and (mark & r.mask) == r.fwmark for r in routes)


def evaluate_plan(plan: Plan, families: tuple[int, ...], pod: PodNet, conn: Conn, *,
                  rules_only: bool = False) -> Landing:
    """Where ``conn`` lands under ``plan`` installed for ``families``; with ``rules_only``, where
    its rules send it (a TCP connection to a link-local address that nat redirects is lost after
    them)."""
    conn = conn.on_the_wire()
    fam = conn.family
    if fam not in families:
        return DIRECT
    chains = plan.chains_for(fam)  # type: ignore[arg-type]
    if conn.direction == "in":
        pkt = _Packet(conn, conn.src or "0.0.0.0", conn.iface, None, local=False)
        return _hooks(chains, "prerouting", ("raw", "mangle", "nat"), pkt) or DIRECT
    routed = not pod.is_local(conn.dst) and _routed_to_lo(plan.routes, fam, conn.mark)
    over_lo = routed or pod.is_local(conn.dst)
    # A route of type local gives an unbound socket the destination itself as its source.
    src = (conn.src or conn.dst) if routed else pod.source_for(conn)
    pkt = _Packet(conn, src, None, "lo" if over_lo else pod.out_dev(conn.dst), local=True, mark=conn.mark)
    landed = _hooks(chains, "output", ("raw", "mangle", "nat"), pkt)
    if landed is not None:
        if not rules_only and landed[0] == "redirect" and conn.proto == "tcp" and _scoped_link_local(conn.dst):
            # REDIRECT's new destination (loopback) is routed by the socket's interface, which its
            # scope id bound it to: it leaves the pod there, and the connection is lost.
            return DROP
        return landed
    if over_lo:
        # Looped back in over lo: PREROUTING again, but not nat (the connection has its NAT binding).
        pkt = _Packet(conn, pkt.src, "lo", None, local=False, mark=pkt.mark, ctmark=pkt.ctmark)
        landed = _hooks(chains, "prerouting", ("raw", "mangle"), pkt)
        if landed is not None:
            return landed
    return DIRECT


# --- eBPF ------------------------------------------------------------------------------


class _Maps:
    """The maps of one pod as the programs see them (the netns cookie is implied)."""

    def __init__(self, entries: EbpfEntries, pod: PodNet) -> None:
        p = entries.policy
        fams = (4, 6) if p.v6 else (4,)
        self.policy = p
        self.ports = set(entries.ports)
        #: The pod's first IPv6 link-local address, which its policy holds (``ll6``) with IPv6 captured.
        ll6 = next((x for f, x, i in pod.addrs if f == 6 and i != LOOPBACK_IFINDEX and _ip(x).is_link_local),
                   None) if p.v6 else None
        self.ll6 = _raw(ll6) if ll6 is not None else None
        self.cidrs = (list(entries.cidrs) + list(pod_local(fams, pod.addrs, ll6))
                      + list(pod_interfaces(entries, fams, pod.links, pod.routes)))

    def port_listed(self, kind: str, port: int) -> bool:
        return (kind, port) in self.ports

    def cidr_listed(self, kind: CidrKind, addr: bytes, v6: bool) -> bool:
        """``cidrs.lookup`` of key (96 + 128 or 32, kind, netns, addr): the longest entry whose
        prefix (96 bits of kind and netns, then its own) matches; listed iff there is one."""
        key_bits = 128 if v6 else 32
        best = -1
        for plen, k, raw in self.cidrs:
            if k == kind and plen <= key_bits and _prefix_eq(raw, addr, plen):
                best = max(best, plen)
        return best >= 0


def _prefix_eq(a: bytes, b: bytes, bits: int) -> bool:
    n, rest = divmod(bits, 8)
    if a[:n] != b[:n]:
        return False
    return rest == 0 or (a[n] >> (8 - rest)) == (b[n] >> (8 - rest))


@functools.lru_cache(maxsize=4096)
def _raw(ip: str) -> bytes:
    return _ip(ip).packed.ljust(16, b"\0")


_OWN_NEXT, _OWN_PASS, _OWN_INBOUND = 0, 1, 2


def _id_listed(m: _Maps, kind: CidrKind, first: IdRange, n: int, ident: int) -> bool:
    """``id_listed`` of redirect/bpf/policy.h: in the first range, else in the kind's ``cidrs`` entries."""
    if n == 0:
        return False
    if first[0] <= ident <= first[1]:
        return True
    return n > 1 and m.cidr_listed(kind, ident.to_bytes(4, "big").ljust(16, b"\0"), False)


def _owner_rules(m: _Maps, kind: CidrKind, first: IdRange, n: int, ident: int, out_lo: bool, hairpin: bool,
                 skip: tuple[int, ...], port: int, lo_return: bool) -> int:
    """``owner_rules`` of redirect/bpf/policy.h (``skip``: the kind's hairpin ports, ``hairpin_skips``)."""
    if n == 0:
        return _OWN_NEXT
    if out_lo and lo_return:
        return _OWN_INBOUND if first[0] <= ident <= first[1] and hairpin and port not in skip else _OWN_PASS
    if not _id_listed(m, kind, first, n, ident):
        return _OWN_NEXT
    return _OWN_INBOUND if out_lo and hairpin and port not in skip else _OWN_PASS


def _outbound_target(m: _Maps, conn: Conn, addr: bytes, v6: bool, out_lo: bool, dst_is_lo_cidr: bool,
                     src_passthrough: bool) -> int:
    """``outbound_target`` of redirect/bpf/policy.h: 0 (pass) or the local port to rewrite to."""
    p = m.policy
    if p.excl_if and not out_lo and m.cidr_listed("via_exclude6" if v6 else "via_exclude4", addr, v6):
        return 0  # leaves_excluded (sockets bound to a device aside: none here)
    to = _nat_target(m, conn, addr, v6, out_lo, dst_is_lo_cidr, src_passthrough)
    if to or not p.tproxy or conn.proto != "tcp" or not out_lo or dst_is_lo_cidr or src_passthrough \
            or conn.mark == p.tproxy_mark:
        return to
    if not (_id_listed(m, "uid", p.uid0, p.n_uids, conn.uid) or _id_listed(m, "gid", p.gid0, p.n_gids, conn.gid)):
        return 0
    return p.inbound_port if _inbound_captured(m, conn.port) else 0


def _nat_target(m: _Maps, conn: Conn, addr: bytes, v6: bool, out_lo: bool, dst_is_lo_cidr: bool,
                src_passthrough: bool) -> int:
    """``nat_target`` of redirect/bpf/policy.h."""
    p = m.policy
    tcp = conn.proto == "tcp"
    port = conn.port
    dns53 = p.dns and port == p.resolver_port
    if m.port_listed("out_exclude", port):
        return 0
    if out_lo and src_passthrough:
        return 0
    hairpin = tcp and not dst_is_lo_cidr
    lo_return = p.lo_return and (not p.lo_return_spares_dns or (tcp and port != p.resolver_port))
    own = _owner_rules(m, "uid", p.uid0, p.n_uids, conn.uid, out_lo, hairpin, p.hairpin_uid_skip, port, lo_return)
    if own == _OWN_NEXT:
        own = _owner_rules(m, "gid", p.gid0, p.n_gids, conn.gid, out_lo, hairpin, p.hairpin_gid_skip, port,
                           lo_return)
    if own == _OWN_INBOUND:
        return p.inbound_port
    if own == _OWN_PASS:
        return 0
    if p.groups_mode != "all":
        inside = _id_listed(m, "group", p.group0, p.n_groups, conn.gid)
        if inside == (p.groups_mode == "exclude"):
            return 0
    if dns53 and (p.dns_all or m.cidr_listed("dns6" if v6 else "dns4", addr, v6)):
        return p.dns_port
    if not tcp:
        return 0
    if dst_is_lo_cidr:
        return 0
    if m.cidr_listed("out_exclude6" if v6 else "out_exclude4", addr, v6):
        return 0
    if m.port_listed("out_include", port):
        return p.proxy_port
    if p.out_all:
        return p.proxy_port
    if m.cidr_listed("out_include6" if v6 else "out_include4", addr, v6):
        return p.proxy_port
    return 0


def _routed_by_mark(p: EbpfPolicy, mark: int) -> bool:
    """``routed_to_lo`` of redirect/bpf/policy.h: the policy route of the socket's mark takes it over lo."""
    return p.route_mask != 0 and (mark & p.route_mask) == p.route_mark


def _own_address(m: _Maps, addr: bytes, v6: bool) -> bool:
    """``own_address`` of redirect/bpf/policy.h: loopback, the link-local address the policy holds
    (``ll6``), or a ``local`` entry."""
    if not v6:
        return addr[0] == 127 or m.cidr_listed("local4", addr, False)
    return addr == V6_LOOPBACK.packed or addr == m.ll6 or m.cidr_listed("local6", addr, True)


def _target4(m: _Maps, conn: Conn, dst: str, src: str | None) -> int:
    """``target4`` of redirect/bpf/sock_addr.c."""
    addr = _raw(dst)
    out_lo = _own_address(m, addr, False) or _routed_by_mark(m.policy, conn.mark)
    dst_is_lo = _ip(dst) in _net(m.policy.loopback4)
    if m.policy.ambient:
        return _ambient_target(m, conn, addr, False, out_lo, dst_is_lo)
    return _outbound_target(m, conn, addr, False, out_lo, dst_is_lo,
                            src is not None and _ip(src) == _ip(m.policy.passthrough4))


def _ambient_target(m: _Maps, conn: Conn, addr: bytes, v6: bool, out_lo: bool, dst_is_lo_host: bool) -> int:
    """``ambient_target`` of redirect/bpf/policy.h: 0 (pass) or the local port to rewrite to."""
    p = m.policy
    tcp = conn.proto == "tcp"
    marked = (conn.mark & p.mark_mask) == p.proxy_mark
    if tcp and m.cidr_listed("probe6" if v6 else "probe4", addr, v6):
        return 0
    if p.dns and conn.port == p.resolver_port and not marked and (not dst_is_lo_host if tcp else not out_lo):
        return p.dns_port
    if tcp and (conn.mark & p.mark_mask) == p.conn_mark:
        return 0
    if not dst_is_lo_host and out_lo:
        return 0
    if not dst_is_lo_host and tcp and not marked:
        return p.proxy_port
    return 0


def _connect(m: _Maps, conn: Conn) -> int:
    """``redirect4``/``redirect6`` of redirect/bpf/sock_addr.c (connect, or sendmsg of UDP): the port the
    destination is rewritten to (on the socket family's loopback), or 0."""
    dst = _ip(conn.dst)
    # The socket's source when the hook runs: the bound address, else none yet.
    if dst.version == 4:
        return _target4(m, conn, conn.dst, conn.src)
    mapped = _mapped(conn.dst)
    if mapped is not None:  # a dual-stack socket's IPv4 peer: IPv4's rules, whatever the pod's IPv6
        return _target4(m, conn, mapped, _mapped(conn.src) if conn.src is not None else None)
    if not m.policy.v6:
        return 0
    addr = _raw(conn.dst)
    out_lo = _own_address(m, addr, True) or _routed_by_mark(m.policy, conn.mark)
    if m.policy.ambient:
        return _ambient_target(m, conn, addr, True, out_lo, dst == V6_LOOPBACK)
    # No source yet and ::6 as the destination: the kernel will pick ::6 itself as the source.
    src_passthrough = (_ip(conn.src) if conn.src is not None else dst) == _ip(m.policy.passthrough6)
    return _outbound_target(m, conn, addr, True, out_lo, dst == V6_LOOPBACK, src_passthrough)


def _inbound_listed(m: _Maps, port: int) -> bool:
    """``inbound_listed`` of redirect/bpf/policy.h."""
    p = m.policy
    if not p.inbound or port == p.tunnel_port:
        return False
    return (not m.port_listed("in_exclude", port)) if p.inbound_all else m.port_listed("in_include", port)


def _inbound_captured(m: _Maps, port: int) -> bool:
    return port != m.policy.inbound_port and _inbound_listed(m, port)


def _iface_listed(m: _Maps, kind: CidrKind, ifindex: int) -> bool:
    """``iface_listed`` of redirect/bpf/policy.h."""
    return ifindex != 0 and m.cidr_listed(kind, ifindex.to_bytes(4, "big").ljust(16, b"\0"), False)


def _inbound_taken(m: _Maps, port: int, fwd: bool) -> bool:
    """``inbound_taken`` of redirect/bpf/policy.h: the inbound chain's port rules, which change nothing for
    a local destination already at the inbound port, but do for one the pod forwards (``fwd``)."""
    return _inbound_listed(m, port) if fwd else _inbound_captured(m, port)


def _rerouted_listener(m: _Maps, conn: Conn, out: bool, fwd: bool) -> int | None:
    """``rerouted_listener`` of redirect/bpf/policy.h: the port of the proxy's listener, or None."""
    p = m.policy
    if p.tproxy and _inbound_listed(m, conn.port):
        return p.inbound_port if _inbound_taken(m, conn.port, fwd) else None
    return p.proxy_port if out else None


def _ambient_listener(m: _Maps, conn: Conn, src: str, rerouted: bool) -> int | None:
    """``ambient_listener`` of redirect/bpf/policy.h: the port of the node proxy's listener, or None."""
    p = m.policy
    if rerouted:
        return p.proxy_port
    if not p.inbound or conn.port == p.tunnel_port:
        return None
    v6 = _ip(src).version == 6
    if m.cidr_listed("probe6" if v6 else "probe4", _raw(src), v6):
        return None
    return p.inbound_port


def _pod_listener(m: _Maps, conn: Conn, src: str, ingress_ifindex: int, fwd: bool) -> int | None:
    """``pod_listener`` of redirect/bpf/policy.h, the one decision of inbound capture of both programs that
    see new inbound TCP (``_sk_lookup``: to the pod's own addresses; ``_tc_ingress``: what the pod
    forwards, ``fwd``): the port of the proxy's listener the connection goes to, or None. Ambient:
    ``ambient_listener``. Sidecar: Istio's PREROUTING in its order: an excluded interface returns;
    a reroute interface, ``rerouted_listener``; else the inbound ports decide."""
    p = m.policy
    if p.ambient:
        return _ambient_listener(m, conn, src, p.reroute_if and _iface_listed(m, "iface_reroute", ingress_ifindex))
    taken = _inbound_taken(m, conn.port, fwd)
    if not p.excl_if and not p.reroute_if:
        return p.inbound_port if taken else None
    if p.excl_if and _iface_listed(m, "iface_exclude", ingress_ifindex):
        return None
    if not (p.reroute_if and _iface_listed(m, "iface_reroute", ingress_ifindex)):
        return p.inbound_port if taken else None
    v6 = conn.family == 6
    out = p.out_all or m.cidr_listed("out_include6" if v6 else "out_include4", _raw(conn.dst), v6)
    return _rerouted_listener(m, conn, out, fwd)


def _tc_ingress(m: _Maps, pod: PodNet, conn: Conn, ingress_ifindex: int) -> Landing:
    """``rdr_tc_ingress`` of redirect/bpf/tc_forward.c for the first packet of a connection the pod
    forwards (its destination not the pod's), on any of its interfaces: where ``pod_listener`` sends
    it, rewritten to the pod's first address of the family (dropped without one) and that
    listener's port; from a source of the pod's own (or loopback), dropped instead."""
    if conn.proto != "tcp":
        return DIRECT
    if conn.family == 6 and not m.policy.v6:
        return DIRECT
    src = conn.src or "0.0.0.0"
    port = _pod_listener(m, conn, src, ingress_ifindex, fwd=True)
    if port is None:
        return DIRECT
    if _local_end(m, src):  # spoofed: never an entry, never around the proxy
        return DROP
    if pod.first_own(conn.family) is None:
        return DROP
    return ("redirect", port)


def _local_end(m: _Maps, ip: str) -> bool:
    """``from_this_pod`` of redirect/bpf/sk_lookup.c, ``local_end`` of redirect/bpf/sockopt.c: loopback or one of
    the pod's addresses (``own_address``)."""
    return _own_address(m, _raw(ip), _ip(ip).version == 6)


def _sk_lookup(m: _Maps, conn: Conn, src: str, ingress_ifindex: int, made_here: bool = False) -> Landing:
    """``rdr_sk_lookup`` of redirect/bpf/sk_lookup.c in the pod's netns, the proxy's listeners registered
    (without one, a captured connection is dropped); ``made_here``: the connection is in
    ``local_conns`` (made in the pod from a source not the pod's, redirect/bpf/sockopt.c)."""
    if conn.proto != "tcp":
        return DIRECT
    if ingress_ifindex == LOOPBACK_IFINDEX:
        return DIRECT
    fam = conn.family
    if fam == 6 and not m.policy.v6:
        return DIRECT
    port = _pod_listener(m, conn, src, ingress_ifindex, fwd=False)
    if port is None or _local_end(m, src) or made_here:
        return DIRECT
    return ("redirect", port)


def evaluate_ebpf(entries: EbpfEntries, pod: PodNet, conn: Conn) -> Landing:
    """Where ``conn`` lands under the eBPF programs with ``entries`` written for ``pod``."""
    m = _Maps(entries, pod)
    if conn.direction == "in":
        if not pod.is_local(conn.dst):  # forwarded: routed before any socket lookup
            return _tc_ingress(m, pod, conn, pod.ifindex_named(conn.iface))
        return _sk_lookup(m, conn, conn.src or "0.0.0.0", pod.ifindex_named(conn.iface))
    conn = conn.to_zero_as_loopback()  # (redirect4/6 look at it so too)
    to = _connect(m, conn)
    if to:
        return ("redirect", to)
    conn = conn.on_the_wire()  # sk_lookup sees the packets
    if not pod.is_local(conn.dst) and _routed_by_mark(m.policy, conn.mark):
        return DIRECT  # delivered over lo by the policy route of its mark: sk_lookup leaves lo alone
    if pod.is_local(conn.dst):
        # Delivered locally as it is: sk_lookup runs at the address's device. A TCP connection
        # from a source that is not the pod's is in local_conns (redirect/bpf/sockopt.c).
        src = pod.source_for(conn)
        made_here = conn.proto == "tcp" and not _local_end(m, src)
        return _sk_lookup(m, conn, src, pod.ifindex_of(conn.dst), made_here)
    return DIRECT


__all__ = ["Conn", "PodNet", "Landing", "DIRECT", "DROP", "evaluate_plan", "evaluate_ebpf"]
