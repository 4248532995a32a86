"""The intent, both lowerings and both evaluators, without root: Istio's capture semantics as a table.

Each row is one behaviour ("outbound from uid 1337 is not captured") asked of the netfilter
plan (interpreted rule by rule) and of the eBPF map entries (the model of ``redirect/bpf/policy.h``);
the kernel tests check the same behaviours with real rules, programs and sockets.
"""

from __future__ import annotations

from typing import Any

import pytest

from redirect import RedirectConfig
from redirect.plan import build_plan, netfilter_plan
from redirect.plan.evaluate import DIRECT, Conn, Landing, PodNet, evaluate_ebpf, evaluate_plan
from redirect.plan.intent import (
    AmbientIntent,
    LocalAddress,
    PolicyRoute,
    ambient_intent_of,
    intent_for,
    intent_of,
    refusals,
)
from redirect.plan.lower_ebpf import lower_ebpf, pod_local
from redirect.plan.vocabulary import ChainBuilder, Redirect

pytestmark = pytest.mark.noroot

POD = PodNet(((4, "10.1.0.2", 2), (6, "fd00::2", 2), (6, "::6", 1)))
APP, PROXY = {"uid": 1000, "gid": 1000}, {"uid": 1337, "gid": 1337}
DNS_ALL = {"dns_capture": True, "capture_all_dns": True}


def out(dst: str, port: int, proto: str = "tcp", who: dict[str, int] = APP, **kw: Any) -> Conn:
    return Conn("out", proto, dst, port, **who, **kw)  # type: ignore[arg-type]


def inbound(dst: str, port: int, proto: str = "tcp", src: str = "10.1.0.9") -> Conn:
    return Conn("in", proto, dst, port, src=src)  # type: ignore[arg-type]


#: (what, config fields, connection, where Istio's rules put it)
TABLE: list[tuple[str, dict[str, Any], Conn, Landing]] = [
    ("app outbound TCP goes to the proxy", {}, out("10.2.0.1", 80), ("redirect", 15001)),
    ("app outbound TCP over IPv6 too", {}, out("2001:db8::1", 443), ("redirect", 15001)),
    ("outbound from uid 1337 is not captured", {}, out("10.2.0.1", 80, who={"uid": 1337, "gid": 0}), DIRECT),
    ("outbound from gid 1337 is not captured", {}, out("10.2.0.1", 80, who={"uid": 1000, "gid": 1337}), DIRECT),
    ("outbound UDP is not captured", {}, out("10.2.0.1", 80, "udp"), DIRECT),
    ("an excluded outbound port is not captured", {"outbound_exclude_ports": (22,)}, out("10.2.0.1", 22), DIRECT),
    ("an excluded CIDR is not captured", {"outbound_exclude_cidrs": ("10.2.0.0/16",)}, out("10.2.0.1", 80),
     DIRECT),
    ("only included CIDRs are captured", {"outbound_cidrs": ("10.3.0.0/16",)}, out("10.2.0.1", 80), DIRECT),
    ("an included port is captured outside the CIDRs", {"outbound_cidrs": (), "outbound_ports": (443,)},
     out("10.2.0.1", 443), ("redirect", 15001)),
    ("loopback is not captured", {}, out("127.0.0.1", 8080), DIRECT),
    ("the app to its own pod address is not captured", {}, out("10.1.0.2", 8080), DIRECT),
    ("the proxy to the pod address hairpins to inbound capture", {}, out("10.1.0.2", 8080, who=PROXY),
     ("redirect", 15006)),
    ("the proxy's hairpin skips the tunnel port", {}, out("10.1.0.2", 15008, who=PROXY), DIRECT),
    ("the proxy's inbound passthrough from 127.0.0.6 is not captured", {},
     out("10.1.0.2", 8080, who=PROXY, src="127.0.0.6"), DIRECT),
    ("the proxy's IPv6 passthrough from ::6 is not captured", {}, out("fd00::2", 8080, who=PROXY, src="::6"),
     DIRECT),
    ("UDP DNS goes to the DNS proxy", DNS_ALL, out("10.2.0.53", 53, "udp"), ("redirect", 15053)),
    ("TCP DNS goes to the DNS proxy", DNS_ALL, out("10.2.0.53", 53), ("redirect", 15053)),
    ("the proxy's own UDP DNS is not captured", DNS_ALL, out("10.2.0.53", 53, "udp", who=PROXY), DIRECT),
    ("DNS to a listed server only", {"dns_capture": True, "dns_servers": ("10.2.0.53",)},
     out("10.2.0.54", 53, "udp"), DIRECT),
    ("DNS capture is off without servers (Istio)", {"dns_capture": True}, out("10.2.0.53", 53, "udp"), DIRECT),
    ("an excluded owner group is not captured", {"owner_groups_exclude": (2000,)},
     out("10.2.0.1", 80, who={"uid": 1000, "gid": 2000}), DIRECT),
    ("only listed owner groups are captured", {"owner_groups": (2000,)}, out("10.2.0.1", 80), DIRECT),
    ("inbound TCP goes to the proxy inbound port", {}, inbound("10.1.0.2", 8080), ("redirect", 15006)),
    ("inbound over IPv6 too", {}, inbound("fd00::2", 8080, src="fd00::9"), ("redirect", 15006)),
    ("the tunnel port is never captured inbound", {"inbound_ports": (15008, 8080)}, inbound("10.1.0.2", 15008),
     DIRECT),
    ("an excluded inbound port is not captured", {}, inbound("10.1.0.2", 15090), DIRECT),
    ("only listed inbound ports are captured", {"inbound_ports": (9090,)}, inbound("10.1.0.2", 8080), DIRECT),
    ("no inbound capture without inbound ports", {"inbound_ports": ()}, inbound("10.1.0.2", 8080), DIRECT),
    ("inbound UDP is not captured", {}, inbound("10.1.0.2", 8080, "udp"), DIRECT),
    ("bypass_inbound_capture is an ambient option: a sidecar still captures inbound",
     {"bypass_inbound_capture": True}, inbound("10.1.0.2", 8080), ("redirect", 15006)),
    # What the pod forwards (a destination not its own): inbound capture matches no destination.
    ("forwarded TCP goes to the proxy inbound port", {}, inbound("10.2.0.1", 8080), ("redirect", 15006)),
    ("forwarded IPv6 too", {}, inbound("2001:db8::1", 8080, src="fd00::9"), ("redirect", 15006)),
    ("forwarded to the inbound port itself is captured (it would leave the pod)", {}, inbound("10.2.0.1", 15006),
     ("redirect", 15006)),
    ("forwarded to the tunnel port is not captured", {}, inbound("10.2.0.1", 15008), DIRECT),
    ("forwarded to an excluded inbound port is not captured", {}, inbound("10.2.0.1", 15090), DIRECT),
    ("forwarded from an excluded interface is not captured", {"exclude_interfaces": ("eth0",)},
     inbound("10.2.0.1", 8080), DIRECT),
    ("forwarded UDP is not captured", {}, inbound("10.2.0.1", 8080, "udp"), DIRECT),
]


@pytest.mark.parametrize(("what", "fields", "conn", "want"), TABLE, ids=[t[0] for t in TABLE])
def test_both_lowerings_follow_istio(what: str, fields: dict[str, Any], conn: Conn, want: Landing) -> None:
    cfg = RedirectConfig(**fields)
    assert evaluate_plan(build_plan(cfg), (4, 6), POD, conn) == want, "netfilter"
    assert evaluate_ebpf(lower_ebpf(intent_of(cfg), (4, 6)), POD, conn) == want, "eBPF"


def test_the_gid_hairpin_takes_dns_only_as_istio_when_asked() -> None:
    istio = RedirectConfig(dns_capture=True, capture_all_dns=True, gid_hairpin_skips_dns=False)
    gid_proxy = {"uid": 1000, "gid": 1337}
    assert evaluate_plan(build_plan(istio), (4, 6), POD, out("10.1.0.2", 53, who=gid_proxy)) == ("redirect", 15006)
    assert evaluate_plan(build_plan(istio), (4, 6), POD, out("10.1.0.2", 53, who=PROXY)) == DIRECT
    # The eBPF lowering says it too: each owner kind's hairpin ports are its own.
    entries = lower_ebpf(intent_of(istio), (4, 6))
    assert evaluate_ebpf(entries, POD, out("10.1.0.2", 53, who=gid_proxy)) == ("redirect", 15006)
    assert evaluate_ebpf(entries, POD, out("10.1.0.2", 53, who=PROXY)) == DIRECT


@pytest.mark.parametrize(("fields", "dst", "want"), [
    ({"ipv6": False}, "::ffff:10.2.0.1", ("redirect", 15001)),
    ({"outbound_cidrs": ("10.0.0.0/8",)}, "::ffff:10.2.0.1", ("redirect", 15001)),
    ({"outbound_exclude_cidrs": ("10.2.0.0/16",)}, "::ffff:10.2.0.1", DIRECT),
    ({}, "::ffff:127.0.0.1", DIRECT),
])
def test_an_ipv4_mapped_destination_follows_the_ipv4_rules(fields: dict[str, Any], dst: str, want: Landing) -> None:
    """An IPv6 socket's connect to ``::ffff:a.b.c.d`` sends IPv4 packets: Istio's IPv4 rules judge
    it, whatever the IPv6 capture and the IPv6 CIDRs (dual-stack clients)."""
    cfg, conn = RedirectConfig(**fields), out(dst, 80)
    families = (4,) if fields.get("ipv6") is False else (4, 6)
    assert evaluate_plan(build_plan(cfg), families, POD, conn) == want
    assert evaluate_ebpf(lower_ebpf(intent_of(cfg), families), POD, conn) == want


def test_ipv6_is_not_captured_when_only_ipv4_is_installed() -> None:
    cfg, conn = RedirectConfig(), out("2001:db8::1", 443)
    assert evaluate_plan(build_plan(cfg), (4,), POD, conn) == DIRECT
    assert evaluate_ebpf(lower_ebpf(intent_of(cfg), (4,)), POD, conn) == DIRECT


def test_intent_decides_istio_derived_values_once() -> None:
    it = intent_of(RedirectConfig(dns_capture=True, outbound_cidrs=("127.0.0.0/8", "10.0.0.0/8"),
                                  inbound_ports=(8080, 9090, 15008), inbound_exclude_ports=(9090,),
                                  owner_groups_exclude=(5,), proxy_gids=((10, 20),)))
    assert not it.dns and it.dns_servers == ()  # Istio: no servers and not all DNS -> off
    assert not it.lo_return and not it.outbound_all  # an included loopback CIDR keeps the app's lo traffic
    assert it.resolver_port == 53 and it.passthrough == ((4, "127.0.0.6/32"), (6, "::6/128"))
    assert it.inbound and not it.inbound_all and it.inbound_include_ports == (8080, 15008)
    assert (it.groups_mode, it.groups) == ("exclude", (5,))
    assert it.proxy_owners == (("uid", 1337), ("gid", (10, 20)))
    assert it.hairpin_exclude_of("uid") == it.hairpin_exclude_of("gid") == (15008,)
    assert it.local_addresses == (LocalAddress(6, "::6/128"),)
    dns = intent_of(RedirectConfig(dns_capture=True, dns_servers=("10.0.0.10", "fd00::a"), inbound_ports=()))
    assert dns.dns and dns.dns_servers == ((4, "10.0.0.10/32"), (6, "fd00::a/128"))
    assert dns.hairpin_exclude_of("uid") == dns.hairpin_exclude_of("gid") == (53, 15008)
    assert dns.local_addresses == (LocalAddress(6, "::6/128"),)  # whatever the inbound ports, as Istio
    istio = intent_of(RedirectConfig(dns_capture=True, capture_all_dns=True, gid_hairpin_skips_dns=False))
    assert istio.hairpin_exclude_of("uid") == (53, 15008) and istio.hairpin_exclude_of("gid") == (15008,)
    assert intent_of(RedirectConfig()) is intent_of(RedirectConfig())  # computed once per config


def test_the_intent_decides_addresses_and_routes_the_plan_installs() -> None:
    cfg = RedirectConfig()
    assert netfilter_plan(intent_for(cfg)) is build_plan(cfg)  # one plan per intent
    assert build_plan(cfg).addresses == intent_of(cfg).local_addresses and not build_plan(cfg).routes
    tproxy = RedirectConfig(inbound_interception="TPROXY", tproxy_mark=4242, tproxy_route_table=200)
    assert build_plan(tproxy).routes == intent_of(tproxy).routes == (
        PolicyRoute(4, 4242, 0xFFFFFFFF, 200), PolicyRoute(6, 4242, 0xFFFFFFFF, 200))
    assert not intent_of(tproxy.replace(inbound_ports=())).routes  # TPROXY's route comes with inbound capture
    ambient = intent_for(RedirectConfig(mode="ambient", bypass_inbound_capture=True, dns_capture=True))
    assert isinstance(ambient, AmbientIntent)
    assert not ambient.inbound and ambient.dns  # ambient: DNS capture needs no servers
    assert ambient.probe_source_of(4) == "169.254.7.127/32"
    assert build_plan(RedirectConfig(mode="ambient")).routes == ambient.routes == (
        PolicyRoute(4, 0x111, 0xFFF, 100), PolicyRoute(6, 0x111, 0xFFF, 100))


def test_refusals_are_decided_in_the_intent() -> None:
    """Which options a backend cannot lower is one function of the intent: eBPF refuses
    ``drop_invalid`` (a sidecar option), netfilter nothing; Istio's gid hairpin (DNS over lo of a
    proxy gid goes to inbound capture) is lowered by eBPF too."""
    drop = intent_for(RedirectConfig(drop_invalid=True))
    assert [r.option for r in refusals(drop, "ebpf")] == ["drop_invalid=True"]
    assert refusals(drop, "iptables") == refusals(drop, "nftables") == ()
    assert refusals(intent_for(RedirectConfig(mode="ambient", drop_invalid=True)), "ebpf") == ()
    istio = intent_for(RedirectConfig(dns_capture=True, capture_all_dns=True, gid_hairpin_skips_dns=False))
    assert refusals(istio, "ebpf") == ()
    e = lower_ebpf(istio, (4, 6)).policy
    assert (e.hairpin_uid_skip, e.hairpin_gid_skip) == ((53, 15008), (15008, 15008))


def test_ebpf_lowering_is_typed_and_skips_ipv6_entries_without_ipv6() -> None:
    cfg = RedirectConfig(outbound_exclude_cidrs=("10.96.0.0/12", "fd00:96::/64"), outbound_exclude_ports=(22,),
                         inbound_ports=(8080, 9090), inbound_exclude_ports=(9090,),
                         dns_capture=True, dns_servers=("10.96.0.10",), owner_groups=(3000, (4000, 4001)))
    e4, e46 = lower_ebpf(intent_of(cfg), (4,)), lower_ebpf(intent_of(cfg), (4, 6))
    assert not e4.policy.v6 and e46.policy.v6
    assert e4.ports == (("out_exclude", 22), ("in_include", 8080))
    assert (12, "out_exclude4", bytes([10, 96]) + bytes(14)) in e4.cidrs
    # An owner kind's first range is in the policy, the others prefix blocks in the CIDR trie.
    assert [k for _p, k, _a in e4.cidrs] == ["out_exclude4", "dns4", "group"]
    assert [k for _p, k, _a in e46.cidrs] == ["out_exclude4", "out_exclude6", "dns4", "group"]
    assert (31, "group", (4000).to_bytes(4, "big") + bytes(12)) in e4.cidrs
    assert e4.policy.groups_mode == "only" and (e4.policy.group0, e4.policy.n_groups) == ((3000, 3000), 2)
    assert e4.policy.dns and not e4.policy.dns_all and e4.policy.inbound and not e4.policy.inbound_all
    assert [k for _p, k, _a in pod_local((4, 6), POD.addrs)] == ["local4", "local6", "local6"]
    assert [k for _p, k, _a in pod_local((4,), POD.addrs)] == ["local4"]
    # A link-local address is one of the pod's own too, but for the one its policy holds (ll6).
    got = pod_local((4, 6), (*POD.addrs, (6, "fe80::2", 2), (6, "fe80::3", 3), (6, "fe80::2", 3)), "fe80::2")
    assert [k for _p, k, _a in got] == ["local4", "local6", "local6", "local6"]
    assert got[-1] == (128, "local6", bytes.fromhex("fe80" + "0" * 27 + "3"))


def test_the_evaluator_follows_marks_accepts_and_tproxy() -> None:
    tproxy = build_plan(RedirectConfig(inbound_interception="TPROXY"))
    assert evaluate_plan(tproxy, (4, 6), POD, inbound("10.1.0.2", 8080)) == ("tproxy", 15006)
    assert evaluate_plan(tproxy, (4, 6), POD, inbound("10.1.0.2", 15008)) == DIRECT
    ambient = build_plan(RedirectConfig(mode="ambient"))
    assert evaluate_plan(ambient, (4, 6), POD, out("10.2.0.1", 80)) == ("redirect", 15001)
    assert evaluate_plan(ambient, (4, 6), POD, out("10.2.0.1", 80, mark=0x539)) == DIRECT  # the proxy's socket
    assert evaluate_plan(ambient, (4, 6), POD, inbound("10.1.0.2", 8080)) == ("redirect", 15006)
    assert evaluate_plan(ambient, (4, 6), POD, inbound("10.1.0.2", 8080, src="169.254.7.127")) == DIRECT  # probe
    assert evaluate_plan(ambient, (4, 6), POD, out("169.254.7.127", 80)) == DIRECT  # probe reply: Accept
    invalid = build_plan(RedirectConfig(drop_invalid=True))
    assert evaluate_plan(invalid, (4, 6), POD, inbound("10.1.0.2", 8080)) == ("redirect", 15006)  # NEW, not INVALID
    excluded = build_plan(RedirectConfig(exclude_interfaces=("eth1",)))
    assert evaluate_plan(excluded, (4, 6), PodNet(POD.addrs, dev="eth1"), out("10.2.0.1", 80)) == DIRECT


@pytest.mark.parametrize(("fields", "conn", "want"), [
    ({}, inbound("10.2.0.1", 8080), ("redirect", 15006)),
    ({}, inbound("10.2.0.1", 15006), ("redirect", 15006)),
    ({}, inbound("10.2.0.1", 15008), DIRECT),
    ({}, inbound("10.2.0.1", 8080, src="169.254.7.127"), DIRECT),
    ({"bypass_inbound_capture": True}, inbound("10.2.0.1", 8080), DIRECT),
    ({"reroute_interfaces": ("eth0",)}, inbound("10.2.0.1", 15008), ("redirect", 15001)),
], ids=["to the inbound port", "to the inbound port itself", "not to the tunnel port", "not from the probe address",
        "not with bypass_inbound_capture", "a reroute interface's to the outbound port"])
def test_what_an_ambient_pod_forwards_is_captured_as_inbound(fields: dict[str, Any], conn: Conn,
                                                              want: Landing) -> None:
    cfg = RedirectConfig(mode="ambient", **fields)
    assert evaluate_plan(build_plan(cfg), (4, 6), POD, conn) == want, "netfilter"
    assert evaluate_ebpf(lower_ebpf(ambient_intent_of(cfg), (4, 6)), POD, conn) == want, "eBPF"


def test_chain_builder_is_the_one_vocabulary_of_both_modes() -> None:
    b = ChainBuilder()
    b.add("nat", "OUTPUT", [], Redirect(1))
    (chain,) = b.build()
    assert (chain.table, chain.name, chain.hook) == ("nat", "OUTPUT", "output")
