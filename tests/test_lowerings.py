"""The netfilter lowering and the eBPF lowering of one intent agree (property test, no root).

Hypothesis draws a config of the options the eBPF backend supports, a pod (its own IPv4 and
IPv6 addresses, its interfaces' IPv6 link-local ones, ``::6`` on lo when the plan adds it) and
thousands of connections (owner, bound source, destination, port (0 too), protocol, direction;
TCP also to a link-local address named with an interface's scope id; inbound ones also to hosts
beyond the pod, which it forwards, on any of its interfaces), and asks both evaluators of
``redirect.plan.evaluate`` where each lands: the netfilter plan interpreted rule by rule, and the
model of the eBPF programs over the lowered map entries. They must agree (``known_difference``
is where a difference is documented: TCP to a link-local address, docs/backends.md).
``test_evaluate_kernel.py`` keeps the evaluators honest: real iptables rules and real eBPF
programs land a probe matrix where they say; the kernel-level differential tests
(``test_nftables_diff.py``, ``test_ebpf.py``) compare the backends themselves.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redirect import RedirectConfig
from redirect.plan import build_plan
from redirect.plan.evaluate import DIRECT, DROP, Conn, Landing, PodNet, evaluate_ebpf, evaluate_plan
from redirect.plan.intent import ambient_intent_of, intent_of, refusals
from redirect.plan.lower_ebpf import lower_ebpf

pytestmark = pytest.mark.noroot

IDS = [0, 1000, 1337, (1300, 1400), (2000, 2001), 3000, 1350, (2990, 3005), 4000, (5, 999), 65534,
       (100000, 165535)]
PORTS = [22, 53, 80, 443, 8080, 9090, 15001, 15006, 15008, 15021, 15053, 15090]
CIDRS = ["10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/23", "10.1.2.3/32", "10.1.2.4/31", "127.0.0.0/8", "127.0.0.1/32",
         "0.0.0.0/0", "172.16.0.0/12", "fd00::/8", "fc00::/7", "fd00:1::/64", "fd00:1::8/125", "fd00:1::9/128",
         "::1/128", "::/0", "2001:db8::/32"]
POD4 = ["10.1.2.3", "10.1.5.5", "192.168.1.2"]
POD6 = ["fd00:1::2", "fd00:2::2"]
PEERS = ["10.1.2.4", "10.1.3.1", "10.2.0.1", "172.20.0.1", "172.32.0.1", "8.8.8.8", "fd00:1::9", "fd00:1::17",
         "fd00:2::9", "fe00::1", "2001:db8::1"]
#: The pod's IPv6 link-local addresses (address, ifindex: eth0 is 2, eth1 3), one on both at times,
#: and a neighbour's (outbound TCP only: a connect names its interface by scope id).
LINK_LOCALS = [(), (("fe80::2", 2),), (("fe80::2", 2), ("fe80::3", 3)), (("fe80::2", 2), ("fe80::2", 3))]
LL_PEERS = ["fe80::9"]
LOOPBACKS = ["127.0.0.1", "127.0.0.6", "127.1.0.1", "::1", "0.0.0.0", "::"]  # (the unspecified: to loopback)
SERVERS = ["10.1.2.4", "10.96.0.10", "fd00:1::9"]
UIDS = [0, 1000, 1337, 1350, 2000, 3000, 2995, 4000, 65534, 120000, 7]
GIDS = [0, 1000, 1337, 2000, 2001, 3000, 2995, 4000, 65534, 165535, 7]


def subsets(pool: list[Any], max_size: int = 3) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.lists(st.sampled_from(pool), max_size=max_size, unique=True).map(tuple)


# Strategies are built once: hypothesis validates each new one, which costs more than an example.
# Owner ids: any number of them (past a kind's first range they are entries of the CIDR trie).
S_IDS, S_INBOUND = subsets(IDS, 10), st.one_of(st.just("*"), subsets(PORTS, 4))
S_IN_EXCLUDE = subsets([15090, 15021, 9090, 15008, 80])
S_OUT = st.one_of(st.just("*"), subsets(CIDRS, 4))
S_CIDRS, S_PORTS, S_SERVERS = subsets(CIDRS), subsets(PORTS), subsets(SERVERS)
S_LOOPBACK = st.sampled_from(["127.0.0.1/32", "127.0.0.0/8", "127.0.0.0/16"])
S_GROUPS = st.sampled_from(["all", "only", "exclude"])
S_POD4, S_POD6 = subsets(POD4, 2), subsets(POD6, 2)
# A second interface, eth1, and routes through it (besides the defaults through eth0).
ETH1_ROUTES = [(4, "10.1.2.0/24"), (4, "10.2.0.0/16"), (4, "172.16.0.0/12"), (4, "8.8.8.0/24"), (4, "0.0.0.0/1"),
               (6, "fd00:1::/64"), (6, "fd00:2::/64"), (6, "2001:db8::/32"), (6, "fd00::/8")]
S_ETH1_ROUTES = subsets(ETH1_ROUTES, 4)
S_EXCL_IF = subsets(["eth0", "eth1", "eth9"], 2)
S_REROUTE_IF = subsets(["eth0", "eth1", "eth8"], 2)
S_IFACE = st.sampled_from(["eth0", "eth0", "eth1"])
S_PROTO, S_PORT = st.sampled_from(["tcp", "tcp", "udp"]), st.sampled_from([*PORTS, 0])
S_LINK_LOCAL = st.sampled_from(LINK_LOCALS)
S_UID, S_GID = st.sampled_from(UIDS), st.sampled_from(GIDS)
S_PICK = st.integers(0, 2**16)
S_QUARTER, S_TENTH = st.integers(0, 3), st.integers(0, 9)
S_INTERCEPTION = st.sampled_from(["REDIRECT", "TPROXY"])


@st.composite
def configs(draw: st.DrawFn) -> RedirectConfig:
    """Sidecar configs of the options the eBPF backend lowers (``refusals`` has none for them)."""
    kw: dict[str, Any] = {
        "proxy_uids": draw(S_IDS),
        "proxy_gids": draw(S_IDS),
        "inbound_ports": draw(S_INBOUND),
        "inbound_exclude_ports": draw(S_IN_EXCLUDE),
        "outbound_cidrs": draw(S_OUT),
        "outbound_exclude_cidrs": draw(S_CIDRS),
        "outbound_ports": draw(S_PORTS),
        "outbound_exclude_ports": draw(S_PORTS),
        "dns_capture": draw(st.booleans()),
        "capture_all_dns": draw(st.booleans()),
        "dns_servers": draw(S_SERVERS),
        "ipv4_loopback_cidr": draw(S_LOOPBACK),
        # An ambient option: sidecar capture ignores it on every backend.
        "bypass_inbound_capture": draw(st.booleans()),
        "gid_hairpin_skips_dns": draw(st.booleans()),
        "inbound_interception": draw(S_INTERCEPTION),
        "exclude_interfaces": draw(S_EXCL_IF),
    }
    kw["reroute_interfaces"] = tuple(i for i in draw(S_REROUTE_IF) if i not in kw["exclude_interfaces"])
    if not kw["proxy_uids"] and not kw["proxy_gids"]:
        kw["proxy_uids"] = (1337,)
    groups = draw(S_GROUPS)
    if groups != "all":
        kw["owner_groups" if groups == "only" else "owner_groups_exclude"] = draw(S_IDS) or (3000,)
    if draw(S_TENTH) == 0:
        kw.update(proxy_port=16001, inbound_port=16006, tunnel_port=16008, dns_port=16053)
    cfg = RedirectConfig(**kw)
    assert not refusals(intent_of(cfg), "ebpf"), cfg
    return cfg


@st.composite
def pods(draw: st.DrawFn) -> PodNet:
    addrs = [(4, a, 2) for a in draw(S_POD4)]
    # (Link-local first: never the pod's source, wherever the kernel lists it.)
    addrs += [(6, a, i) for a, i in draw(S_LINK_LOCAL)]
    addrs += [(6, a, 2) for a in draw(S_POD6)]
    routes = [(4, "0.0.0.0/0", ("eth0",)), (6, "::/0", ("eth0",))]
    routes += [(f, c, ("eth1",)) for f, c in draw(S_ETH1_ROUTES)]
    return PodNet(tuple(addrs), links=(("eth0", 2), ("eth1", 3)), routes=tuple(routes))


def with_plan_addresses(pod: PodNet, cfg: RedirectConfig, families: tuple[int, ...]) -> PodNet:
    """The pod after setup: the plan's addresses (``::6`` on lo) when it has IPv6 of its own,
    as every backend adds them."""
    own_v6 = any(f == 6 and not _link_local(a) for f, a, _i in pod.addrs)
    extra = tuple((a.family, a.cidr.split("/")[0], 1) for a in build_plan(cfg).addresses
                  if a.family in families and (a.family == 4 or own_v6))
    return dataclasses.replace(pod, addrs=pod.addrs + extra)


def _fam(ip: str) -> int:
    return ipaddress.ip_address(ip).version


def _link_local(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_link_local and _fam(ip) == 6


def _scoped(draw: st.DrawFn, ip: str) -> str:
    """A link-local destination named with one of the pod's interfaces as its scope id."""
    return f"{ip}%{draw(S_IFACE)}" if _link_local(ip) else ip


def _outbound_dst(draw: st.DrawFn, proto: str, mark: int, pool: list[str]) -> str:
    """A destination of ``pool``; a link-local one (TCP from an unmarked socket only: what the
    evaluators model) with a scope id."""
    if proto != "tcp" or mark:
        pool = [a for a in pool if not _link_local(a)]
    return _scoped(draw, pick(draw, pool))


def _inbound_link_local(draw: st.DrawFn, pod: PodNet, peers: list[str]) -> Conn | None:
    """Sometimes, an inbound connection to one of the pod's link-local addresses, arriving on its
    interface."""
    lls = [(a, i) for f, a, i in pod.addrs if f == 6 and _link_local(a)]
    if not lls or draw(S_TENTH) != 0:
        return None
    dst, index = lls[draw(S_PICK) % len(lls)]
    iface = next(n for n, i in pod.links if i == index)
    return Conn("in", draw(S_PROTO), dst, draw(S_PORT), src=pick(draw, [p for p in peers if _fam(p) == 6]),
                iface=iface)


def pick(draw: st.DrawFn, items: list[str]) -> str:
    return items[draw(S_PICK) % len(items)]


@st.composite
def conns(draw: st.DrawFn, pod: PodNet, cfg: RedirectConfig) -> Conn:
    """An inbound connection from a peer to a pod address (or to a host beyond the pod, which it
    forwards), or an outbound one from an owner (uid, primary gid; sometimes marked with
    ``tproxy_mark``; sometimes bound, TCP only, also to a peer's address: a proxy's transparent
    connection to the app) to a peer, a loopback or a pod address."""
    own = [a for _f, a, _i in pod.addrs]
    proto, port = draw(S_PROTO), draw(S_PORT)
    arrive = [a for _f, a, i in pod.addrs if i != 1 and not _link_local(a)]
    inbound_ll = _inbound_link_local(draw, pod, PEERS + LL_PEERS)
    if inbound_ll is not None:
        return inbound_ll
    if arrive and draw(S_QUARTER) == 0:
        dst = pick(draw, arrive)
        if draw(S_QUARTER) == 0:  # to a host beyond the pod, which forwards it (a VM behind it)
            dst = pick(draw, [p for p in PEERS if _fam(p) == _fam(dst) and p not in own])
        return Conn("in", proto, dst, port, src=pick(draw, [p for p in PEERS if _fam(p) == _fam(dst)]),
                    iface=draw(S_IFACE))
    mark = cfg.tproxy_mark if draw(S_QUARTER) == 0 else 0
    dst = _outbound_dst(draw, proto, mark, PEERS + LL_PEERS + LOOPBACKS + SERVERS + own)
    src = None
    if _fam(dst) == 4 and draw(S_TENTH) == 0:
        # An IPv6 socket's connect to an IPv4 address (dual-stack clients: Java, Go's net).
        dst = f"::ffff:{dst}"
    elif proto == "tcp" and draw(S_QUARTER) == 0:
        # (bound to a link-local address it would need a scope id too: not drawn)
        same = [a for a in own + PEERS + ["127.0.0.6", "127.0.0.1", "::1"] if _fam(a) == _fam(dst)
                and not _link_local(a)]
        src = pick(draw, same) if same else None
    return Conn("out", proto, dst, port, uid=draw(S_UID), gid=draw(S_GID), mark=mark, src=src)


def normalized(pod: PodNet, conn: Conn, landing: Landing) -> Landing:
    # What the pod forwards (its destination not the pod's): any landing but direct takes it off
    # its way to that destination, whatever the port.
    if conn.direction == "in" and not pod.is_local(conn.dst):
        return ("redirect", landing[1]) if landing[0] == "tproxy" else landing
    # TPROXY and sk_lookup both hand the connection to the proxy's inbound listener with the original
    # destination as its local address (which REDIRECT's SO_ORIGINAL_DST also names: the kernel
    # tests check both).
    if landing == ("tproxy", conn.port):  # to the port it has: the same socket, the same local address
        return DIRECT
    if landing[0] == "tproxy":
        landing = ("redirect", landing[1])
    # Inbound REDIRECT to the port a connection already has changes nothing its receiver sees.
    if conn.direction == "in" and landing == ("redirect", conn.port):
        return DIRECT
    return landing


def known_difference(cfg: RedirectConfig, pod: PodNet, conn: Conn, nf: Landing, bpf: Landing,
                     rules: Landing) -> str | None:
    """Why the two may differ for this connection (None: they must not), as docs/backends.md says;
    ``rules``: where netfilter's rules send it (``evaluate_plan(..., rules_only=True)``)."""
    dst = ipaddress.ip_address(conn.dst)
    if conn.direction != "out" or not _link_local(conn.dst) or dst.scope_id is None:  # type: ignore[union-attr]
        return None
    if not pod.is_local(conn.dst) and any(f == 6 and int(ipaddress.ip_address(a)) == int(dst)
                                          for f, a, _i in pod.addrs):
        return "one of the pod's own link-local addresses with another interface's scope id: the eBPF hooks" \
               " cannot see a scope id and take it for the pod's own"
    if cfg.exclude_interfaces and pod.out_dev(conn.dst) != pod.out_dev(conn.dst.split("%")[0]):
        return "exclude_interfaces: the eBPF hooks judge the interface a link-local destination leaves by" \
               " from the main table's routes, not from the scope id they cannot see"
    if nf == DROP and bpf == rules:
        return "TCP to a link-local address that netfilter's nat redirects: lost there (the loopback it" \
               " redirects to is routed through the scope's interface); eBPF's hook redirects it"
    return None


@settings(max_examples=2000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), pod0=pods(), families=st.sampled_from([(4,), (4, 6)]), data=st.data())
def test_netfilter_and_ebpf_lowerings_land_every_connection_alike(
        cfg: RedirectConfig, pod0: PodNet, families: tuple[int, ...], data: st.DataObject) -> None:
    plan = build_plan(cfg)
    entries = lower_ebpf(intent_of(cfg), families)
    pod = with_plan_addresses(pod0, cfg, families)
    for _ in range(5):
        conn = data.draw(conns(pod, cfg))
        nf = normalized(pod, conn, evaluate_plan(plan, families, pod, conn))
        bpf = normalized(pod, conn, evaluate_ebpf(entries, pod, conn))
        rules = normalized(pod, conn, evaluate_plan(plan, families, pod, conn, rules_only=True))
        if nf != bpf and known_difference(cfg, pod, conn, nf, bpf, rules) is None:
            raise AssertionError(f"netfilter {nf} vs eBPF {bpf} for {conn} in {pod} under {cfg.to_dict()} "
                                 f"(families {families})")


# --- ambient mode: the node proxy known by its sockets' mark ---------------------------------

PROBES = {4: ["169.254.7.127", "10.1.3.1"], 6: ["fd16:9254:7127:1337:ffff:ffff:ffff:ffff", "fd00:2::9"]}
S_MARKS = st.sampled_from([(0x539, 0xFFF, 0x111), (0x100, 0xF00, 0x200), (0x10, 0x30, 0x20), (0x53A, 0xFFF, 0x111),
                           (0x539, 0xFFF, 0x222)])


@st.composite
def ambient_configs(draw: st.DrawFn) -> RedirectConfig:
    """Ambient configs (every option the eBPF backend supports)."""
    mark, mask, conn = draw(S_MARKS)
    kw: dict[str, Any] = {
        "mode": "ambient", "dns_capture": draw(st.booleans()), "bypass_inbound_capture": draw(st.booleans()),
        "proxy_mark": mark, "proxy_mark_mask": mask, "conn_mark": conn,
        "probe_snat_ipv4": pick(draw, PROBES[4]), "probe_snat_ipv6": pick(draw, PROBES[6]),
        "reroute_interfaces": draw(S_EXCL_IF),
    }
    if draw(S_TENTH) == 0:
        kw.update(proxy_port=16001, inbound_port=16006, tunnel_port=16008, dns_port=16053)
    cfg = RedirectConfig(**kw)
    assert not refusals(ambient_intent_of(cfg), "ebpf"), cfg
    return cfg


@st.composite
def ambient_conns(draw: st.DrawFn, pod: PodNet, cfg: RedirectConfig) -> Conn:
    """An inbound connection from a peer or the probe address, or an outbound one from a socket with
    some mark (none, the proxy's, its connection mark, others), sometimes bound: to one of the pod's
    addresses, also from a peer's address (the node proxy's transparent connection to the app)."""
    own = [a for _f, a, _i in pod.addrs]
    probes = [cfg.probe_snat_ipv4, cfg.probe_snat_ipv6]
    proto, port = draw(S_PROTO), draw(S_PORT)
    arrive = [a for _f, a, i in pod.addrs if i != 1 and not _link_local(a)]
    inbound_ll = _inbound_link_local(draw, pod, PEERS + LL_PEERS + probes)
    if inbound_ll is not None:
        return inbound_ll
    if arrive and draw(S_QUARTER) == 0:
        dst = pick(draw, arrive)
        if draw(S_QUARTER) == 0:  # to a host beyond the pod, which forwards it (a VM behind it)
            dst = pick(draw, [p for p in PEERS if _fam(p) == _fam(dst) and p not in own])
        return Conn("in", proto, dst, port, src=pick(draw, [p for p in PEERS + probes if _fam(p) == _fam(dst)]),
                    iface=draw(S_IFACE))
    marks = [0, cfg.proxy_mark, cfg.conn_mark, cfg.proxy_mark | 0x10000, 0x12, cfg.proxy_mark_mask]
    mark = marks[draw(S_PICK) % len(marks)]
    # (A marked socket to a link-local address is not modelled: unmarked ones only.)
    dst = _outbound_dst(draw, proto, mark, PEERS + LL_PEERS + LOOPBACKS + SERVERS + own + probes)
    src = None
    if _fam(dst) == 4 and draw(S_TENTH) == 0:
        dst = f"::ffff:{dst}"
    elif proto == "tcp" and draw(S_QUARTER) < 2:
        same = [a for a in own + PEERS + ["127.0.0.6", "127.0.0.1", "::1"] if _fam(a) == _fam(dst)
                and not _link_local(a)]
        src = pick(draw, same) if same else None
    return Conn("out", proto, dst, port, mark=mark, src=src)


@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=ambient_configs(), pod0=pods(), families=st.sampled_from([(4,), (4, 6)]), data=st.data())
def test_ambient_lowerings_land_every_connection_alike(
        cfg: RedirectConfig, pod0: PodNet, families: tuple[int, ...], data: st.DataObject) -> None:
    plan = build_plan(cfg)
    entries = lower_ebpf(ambient_intent_of(cfg), families)
    for _ in range(5):
        conn = data.draw(ambient_conns(pod0, cfg))
        nf = normalized(pod0, conn, evaluate_plan(plan, families, pod0, conn))
        bpf = normalized(pod0, conn, evaluate_ebpf(entries, pod0, conn))
        rules = normalized(pod0, conn, evaluate_plan(plan, families, pod0, conn, rules_only=True))
        if nf != bpf and known_difference(cfg, pod0, conn, nf, bpf, rules) is None:
            raise AssertionError(f"netfilter {nf} vs eBPF {bpf} for {conn} in {pod0} under {cfg.to_dict()} "
                                 f"(families {families})")


def test_a_pods_sources_are_its_first_address_of_each_captured_family_off_lo() -> None:
    """``pod_sources`` (the choice ``rdr_pod_sources`` makes for both setup paths): per family the
    config captures, the first of the pod's addresses not on lo and not IPv6 link-local (listed
    first here, as the kernel lists an interface's before another's); none for a family it has
    none of or does not capture. With IPv6 captured, the first link-local address is the one the
    policy holds (``ll6``)."""
    from redirect.backends.ebpf.pod.entries import pod_sources

    local = ((6, "::6", 1), (4, "10.0.0.7", 1), (4, "10.1.0.2", 2), (6, "fe80::2", 2), (6, "fd00::2", 3),
             (4, "10.2.0.3", 3), (6, "fe80::3", 3), (6, "fd00::9", 2))
    assert pod_sources((4, 6), local) == {"src4": "10.1.0.2", "src6": "fd00::2", "ll6": "fe80::2"}
    assert pod_sources((4,), local) == {"src4": "10.1.0.2"}
    assert pod_sources((4, 6), ((4, "10.0.0.7", 1), (6, "::6", 1))) == {}
    assert pod_sources((6,), local[:4]) == {"ll6": "fe80::2"}
