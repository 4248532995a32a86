"""Differential test: the nftables backend captures exactly what iptables does.

Hypothesis draws configs that both backends support; each is set up in one pod with
``backend="iptables"`` and in another with ``backend="nftables"`` (the same two pods
for every example: setup replaces the config atomically). A probe matrix (app
uid vs proxy uid 1337 vs an excluded owner group, included/excluded ports and
CIDRs, inbound ports, DNS over UDP and TCP, IPv4 and IPv6) then runs against both,
and every probe must land on the same listener with the same original destination.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import redirect
from redirect.config import RedirectConfig
from tests.netkit import Listener, Pod, TcpListener, UdpListener, landing

OUT_PORTS = (80, 443, 8080)
IN_PORTS = (8080, 9090, 15008)
APP_GID = 2000

specs = st.fixed_dictionaries({
    "inbound_interception": st.sampled_from(["REDIRECT", "TPROXY"]),
    "inbound_ports": st.sampled_from(["*", (8080,), (8080, 9090), ()]),
    "inbound_exclude_ports": st.sampled_from([(), (9090,)]),
    "outbound_exclude_ports": st.sampled_from([(), (443,), (443, 8080)]),
    "outbound_ports": st.sampled_from([(), (443,)]),
    "exclude_peer": st.sampled_from([None, 4, 6]),
    "include": st.sampled_from(["*", "peer4-subnet"]),
    "dns": st.booleans(),
    "drop_invalid": st.booleans(),
    "ipv6": st.booleans(),
    "owner_groups_exclude": st.sampled_from([(), (APP_GID,)]),
    # The pod's one interface as a reroute (kube-virt) one: its inbound goes to the outbound port.
    "reroute": st.sampled_from([False, False, True]),
})


def config_for(spec: dict[str, Any], pod: Pod) -> RedirectConfig:
    kw = {k: v for k, v in spec.items() if k not in ("exclude_peer", "include", "dns", "reroute")}
    if spec["exclude_peer"] == 4:
        kw["outbound_exclude_cidrs"] = (f"{pod.peer_ip4}/32",)
    elif spec["exclude_peer"] == 6:
        kw["outbound_exclude_cidrs"] = (f"{pod.peer_ip6}/128",)
    if spec["include"] != "*":
        kw["outbound_cidrs"] = (pod.main.subnet4,)
    if spec["dns"]:
        kw.update(dns_capture=True, capture_all_dns=True)
    if spec.get("reroute"):
        kw["reroute_interfaces"] = (pod.pod_if,)
    return RedirectConfig(**kw)


def listeners(pod: Pod) -> list[Listener]:
    ls: list[Listener] = []
    for fam in (4, 6):
        ls += [TcpListener(pod.name, 15001, fam, label="proxy-out"),
               TcpListener(pod.name, 15006, fam, label="proxy-in", transparent=True),
               TcpListener(pod.name, 15053, fam, label="dns-tcp"),
               UdpListener(pod.name, 15053, fam, label="dns-udp"),
               TcpListener(pod.peer_name, 53, fam, label="resolver-tcp"),
               UdpListener(pod.peer_name, 53, fam, label="resolver-udp")]
        ls += [TcpListener(pod.name, p, fam, label=f"pod-{p}") for p in IN_PORTS]
        ls += [TcpListener(pod.peer_name, p, fam, label=f"remote-{p}") for p in OUT_PORTS]
    return ls


#: The drawn configs that the eBPF backend supports too (REDIRECT inbound, no drop_invalid).
ebpf_specs = specs.map(lambda d: {**d, "inbound_interception": "REDIRECT", "drop_invalid": False})


@contextlib.contextmanager
def iptables_and_ebpf_pods(make_pod: Callable[[], Pod]) -> Iterator[tuple[Pod, Pod, dict[str, list[Listener]]]]:
    """Two pods (one for the iptables backend, one for eBPF) with the matrix's listeners started
    and IPv6 warmed up; on the way out the listeners close and each pod's capture is torn down."""
    ipt, bpf = make_pod(), make_pod()
    ls = {ipt.name: listeners(ipt), bpf.name: listeners(bpf)}
    try:
        for group in ls.values():
            for lst in group:
                lst.start()
        for p in (ipt, bpf):  # a fresh pod's first IPv6 connections wait for neighbour discovery
            landing(p.name, p.peer_ip6, 80, *ls[p.name], timeout=3.0)
            landing(p.peer_name, p.pod_ip6, 8080, *ls[p.name], timeout=3.0)
        yield ipt, bpf, ls
    finally:
        for group in ls.values():
            for lst in group:
                lst.close()
        redirect.teardown(ipt.name, backend="iptables")
        redirect.teardown(bpf.name, backend="ebpf")


def matrix(pod: Pod, ls: list[Listener]) -> dict[str, Any]:
    """Where each probe landed, with the pod's addresses replaced by symbols."""
    names = {pod.pod_ip4: "POD4", pod.pod_ip6: "POD6", pod.peer_ip4: "PEER4", pod.peer_ip6: "PEER6"}

    def sym(a: tuple[str, int] | None) -> Any:
        return None if a is None else (names.get(a[0], a[0]), a[1])

    out: dict[str, Any] = {}

    def probe(key: str, ns: str, ip: str, port: int, **kw: Any) -> None:
        hit = landing(ns, ip, port, *ls, **kw)
        lab = hit.listener.label if hit.listener else hit.result.error
        # The original destination means something where the proxy got the connection; for
        # uncaptured ones the local address is the destination (and SO_ORIGINAL_DST only says
        # whether conntrack tracks the family: an inet table tracks IPv6 even when ipv6=False).
        captured = lab is not None and lab.startswith(("proxy", "dns"))
        orig = sym(hit.orig_dst) if captured and hit.conn and hit.conn.proto == "tcp" else None
        out[key] = (lab, orig, sym(hit.local))

    for fam in (4, 6):
        for who, kw in (("app", {}), ("proxy", {"uid": 1337}), ("group", {"uid": 1000, "gid": APP_GID})):
            for port in OUT_PORTS:
                probe(f"out {who} v{fam} :{port}", pod.name, pod.peer_ip(fam), port, timeout=1.0, **kw)
        probe(f"dns tcp v{fam}", pod.name, pod.peer_ip(fam), 53, timeout=1.0)
        # A captured UDP query gets no answer (that needs the DNS proxy's uid): short wait.
        probe(f"dns udp v{fam}", pod.name, pod.peer_ip(fam), 53, proto="udp", timeout=0.15)
        for port in IN_PORTS:
            probe(f"in v{fam} :{port}", pod.peer_name, pod.pod_ip(fam), port, timeout=1.0)
    return out


def both(fn: Callable[[Pod], Any], pods: tuple[Pod, Pod]) -> list[Any]:
    """``fn`` on both pods at once (two threads), results in pod order."""
    res: list[Any] = [None, None]
    err: list[BaseException] = []

    def run(i: int) -> None:
        try:
            res[i] = fn(pods[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if err:
        raise err[0]
    return res


def test_nftables_lands_every_probe_where_iptables_does(make_pod: Callable[..., Pod]) -> None:
    ipt, nft = make_pod(), make_pod()
    ls = {ipt.name: listeners(ipt), nft.name: listeners(nft)}
    for group in ls.values():
        for lst in group:
            lst.start()
    try:
        for p in (ipt, nft):  # a fresh pod's first IPv6 connections wait for neighbour discovery
            landing(p.name, p.peer_ip6, 80, *ls[p.name], timeout=3.0)
            landing(p.peer_name, p.pod_ip6, 8080, *ls[p.name], timeout=3.0)

        seen: list[dict[str, Any]] = []
        labels: set[str] = set()

        @settings(max_examples=15, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(spec=specs)
        def example(spec: dict[str, Any]) -> None:
            assert redirect.setup(ipt.name, config_for(spec, ipt), backend="iptables").backend == "iptables"
            assert redirect.setup(nft.name, config_for(spec, nft), backend="nftables").backend == "nftables"
            for group in ls.values():
                for lst in group:
                    lst.clear()
            seen.append(spec)
            got_ipt, got_nft = both(lambda p: matrix(p, ls[p.name]), (ipt, nft))
            labels.update(v[0] for v in got_nft.values())
            diffs = {k: (got_ipt[k], got_nft[k]) for k in got_ipt if got_ipt[k] != got_nft[k]}
            assert not diffs, f"iptables vs nftables differ for {spec}: {diffs}"

        example()
        assert len(seen) >= 10, f"only {len(seen)} configs were compared"
        # the matrix is not trivially equal: probes were captured and passed through
        assert {"proxy-out", "proxy-in", "dns-tcp", "remote-80", "pod-15008"} <= labels, labels
    finally:
        for group in ls.values():
            for lst in group:
                lst.close()
