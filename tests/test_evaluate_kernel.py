"""The evaluators against the kernel: ``redirect.plan.evaluate`` says where real rules and programs land.

The no-root property (``test_lowerings.py``) compares the two lowerings through their
evaluators; this keeps the evaluators honest. Hypothesis draws configs the eBPF backend
supports (``test_nftables_diff.specs``); each is set up in one pod with ``backend="iptables"``
and in another with ``backend="ebpf"``; a probe matrix (the app, the proxy's uid, an owner
group; outbound ports and CIDRs, DNS over UDP and TCP, inbound ports, the pod to itself, the
inbound passthrough, a dual-stack socket to an IPv4 peer, under TPROXY the proxy's transparent
connection to the app; IPv4 and IPv6; the pod's own and its peer's IPv6 link-local address, named
with the interface's scope id) runs in both, and
each probe must land where ``evaluate_plan`` (iptables) and ``evaluate_ebpf`` (eBPF) say. The
same for ambient configs, with the node proxy's marked listeners: sockets of every kind of mark,
DNS, the probe address both ways, the tunnel port, a rerouted interface, and the node proxy's
transparent connection to the app.
"""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

from hypothesis import HealthCheck, given, settings

import redirect
from redirect.config import RedirectConfig
from redirect.plan import build_plan
from redirect.plan.evaluate import DIRECT, DROP, Conn, Landing, PodNet, evaluate_ebpf, evaluate_plan
from redirect.plan.intent import ambient_intent_of, intent_of
from redirect.plan.lower_ebpf import lower_ebpf
from tests import test_nftables_diff as diff
from tests.netkit import Listener, Pod, TcpListener, UdpListener, in_netns, landing, link_local
from tests.test_ebpf import bpf_root  # noqa: F401 - the fixture: host programs under a scratch root

#: Listener label -> where the evaluators say such a connection lands.
CAPTURED: dict[str, Landing] = {"proxy-out": ("redirect", 15001), "proxy-in": ("redirect", 15006),
                                "dns-tcp": ("redirect", 15053), "dns-udp": ("redirect", 15053)}


def probes(pod: Pod, v6_passthrough: bool, tproxy: bool) -> list[tuple[str, Conn, dict[str, Any]]]:
    """(name, the connection as the evaluators see it, landing()'s arguments); the IPv6
    passthrough probe only when ``::6`` is on lo (setup adds it when IPv6 is captured); with
    TPROXY's policy route (``tproxy``), a proxy's transparent connection to the app from a peer's
    address with the TPROXY mark (Envoy's ``original_src``; without the route its replies leave)."""
    out: list[tuple[str, Conn, dict[str, Any]]] = []
    for fam in (4, 6):
        peer, own = pod.peer_ip(fam), pod.pod_ip(fam)
        for who, ids in (("app", (0, 0)), ("proxy", (1337, 0)), ("group", (1000, diff.APP_GID))):
            kw = {} if who == "app" else {"uid": ids[0], "gid": ids[1]}
            for port in diff.OUT_PORTS:
                out.append((f"out {who} v{fam} :{port}", Conn("out", "tcp", peer, port, uid=ids[0], gid=ids[1]),
                            {"ip": peer, "port": port, **kw}))
            out.append((f"self {who} v{fam}", Conn("out", "tcp", own, 8080, uid=ids[0], gid=ids[1]),
                        {"ip": own, "port": 8080, **kw}))
        out.append((f"dns tcp v{fam}", Conn("out", "tcp", peer, 53), {"ip": peer, "port": 53}))
        out.append((f"dns udp v{fam}", Conn("out", "udp", peer, 53),
                    {"ip": peer, "port": 53, "proto": "udp", "timeout": 0.15}))
        lo, src = ("127.0.0.1", "127.0.0.6") if fam == 4 else ("::1", "::6")
        out.append((f"loopback v{fam}", Conn("out", "tcp", lo, 9090, uid=1337), {"ip": lo, "port": 9090, "uid": 1337}))
        zero = "0.0.0.0" if fam == 4 else "::"  # the kernel connects to the loopback host
        for who, uid in (("app", 0), ("proxy", 1337)):
            out.append((f"unspecified {who} v{fam}", Conn("out", "tcp", zero, 9090, uid=uid),
                        {"ip": zero, "port": 9090, "uid": uid}))
        if fam == 4 or v6_passthrough:
            out.append((f"passthrough v{fam}", Conn("out", "tcp", own, 8080, uid=1337, src=src),
                        {"ip": own, "port": 8080, "uid": 1337, "src": src}))
        if fam == 6 and v6_passthrough:
            # Unbound: the kernel picks ::6 as the source, so it is the passthrough on every backend.
            out.append(("proxy to ::6", Conn("out", "tcp", "::6", 9090, uid=1337), {"ip": "::6", "port": 9090,
                                                                                   "uid": 1337}))
        for port in diff.IN_PORTS:
            out.append((f"in v{fam} :{port}", Conn("in", "tcp", own, port, src=peer, iface=pod.pod_if),
                        {"ns": pod.peer_name, "ip": own, "port": port}))
        if tproxy:
            out.append((f"transparent v{fam}", Conn("out", "tcp", own, 8080, mark=1337, src=peer),
                        {"ip": own, "port": 8080, "mark": 1337, "src": peer}))
    # The pod's own link-local address and its peer's, with the interface's scope id: the app's
    # connection to its own stays in the pod; to the peer's, when captured, netfilter loses it (the
    # loopback its REDIRECT gives is routed through that interface: no answer, evaluate's drop) and
    # eBPF takes it to the proxy. (The proxy's to its own: the same loss under netfilter, a
    # difference docs/backends.md names; not probed.)
    for name, ll in (("own", link_local(pod.name, pod.pod_if)), ("peer's", link_local(pod.peer_name, pod.peer_if))):
        scoped = f"{ll}%{pod.pod_if}"
        for who, ids in (("app", (0, 0)), ("group", (1000, diff.APP_GID))):
            kw = {} if who == "app" else {"uid": ids[0], "gid": ids[1]}
            out.append((f"{name} link-local {who}", Conn("out", "tcp", scoped, 8080, uid=ids[0], gid=ids[1]),
                        {"ip": scoped, "port": 8080, "timeout": 0.5, **kw}))
    mapped = f"::ffff:{pod.peer_ip4}"
    out.append(("dual-stack socket to IPv4 :80", Conn("out", "tcp", mapped, 80), {"ip": mapped, "port": 80}))
    out.append(("dual-stack socket to ::ffff:0.0.0.0", Conn("out", "tcp", "::ffff:0.0.0.0", 9090),
                {"ip": "::ffff:0.0.0.0", "port": 9090}))
    return out


def landed(pod: Pod, ls: list[Listener], kw: dict[str, Any]) -> Landing | str:
    kw = dict(kw)
    hit = landing(kw.pop("ns", pod.name), kw.pop("ip"), kw.pop("port"), *ls, **{"timeout": 1.0, **kw})
    if hit.listener is None:
        return DROP if hit.result.error == "timeout" else f"nowhere ({hit.result.error})"
    return CAPTURED.get(hit.listener.label, DIRECT)


def test_evaluators_land_every_probe_where_the_kernel_does(make_pod, bpf_root: str) -> None:  # noqa: F811
    kinds: set[Landing | str] = set()
    with diff.iptables_and_ebpf_pods(make_pod) as (ipt, bpf, ls):
        seen: list[dict[str, Any]] = []

        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(spec=diff.ebpf_specs)
        def example(spec: dict[str, Any]) -> None:
            wrong: dict[str, Any] = {}
            for pod, backend in ((ipt, "iptables"), (bpf, "ebpf")):
                cfg = diff.config_for(spec, pod)
                fams = (4, 6) if cfg.ipv6 is not False else (4,)
                redirect.setup(pod.name, cfg, backend=backend)
                own = ((4, pod.pod_ip4, 2), (6, pod.pod_ip6, 2), (6, link_local(pod.name, pod.pod_if), 2))
                net = PodNet(own + (((6, "::6", 1),) if 6 in fams else ()), dev=pod.pod_if, links=((pod.pod_if, 2),))
                plan, entries = build_plan(cfg), lower_ebpf(intent_of(cfg), fams)
                for lst in ls[pod.name]:
                    lst.clear()
                for name, conn, kw in probes(pod, 6 in fams, bool(plan.routes)):
                    want = evaluate_plan(plan, fams, net, conn) if backend == "iptables" else \
                        evaluate_ebpf(entries, net, conn)
                    got = landed(pod, ls[pod.name], kw)
                    kinds.add(got)
                    if got != want:
                        wrong[f"{backend}: {name}"] = (got, want)
            seen.append(spec)
            assert not wrong, f"kernel vs evaluator (got, predicted) for {spec}: {wrong}"

        example()
        print(f"evaluators vs kernel: {len(seen)} configs, landings {sorted(map(str, kinds))}")
        assert len(seen) >= 8, f"only {len(seen)} configs were compared"
        assert {DIRECT, *CAPTURED.values()} <= kinds, kinds


# --- ambient mode ---------------------------------------------------------------------------------

#: Ambient configs (the pod's interface stands for a rerouted one in the last).
AMBIENT = [{}, {"dns_capture": True}, {"bypass_inbound_capture": True, "dns_capture": True}, {"reroute": True}]
MARKS = {"app": 0, "proxy": 0x539, "proxy+": 0x10539, "conn": 0x111, "other": 0x12}
PROBE_SRC = {4: "169.254.7.127", 6: "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"}


def ambient_probes(pod: Pod) -> list[tuple[str, Conn, dict[str, Any]]]:
    """Outbound from sockets of every kind of mark (TCP to a peer and to the pod itself, DNS over
    UDP and TCP, to the probe address), inbound (to the app, the tunnel port, from the probe
    address)."""
    out: list[tuple[str, Conn, dict[str, Any]]] = []
    for fam in (4, 6):
        peer, own, probe = pod.peer_ip(fam), pod.pod_ip(fam), PROBE_SRC[fam]
        for who, mark in MARKS.items():
            kw = {"mark": mark} if mark else {}
            out.append((f"out {who} v{fam}", Conn("out", "tcp", peer, 8080, mark=mark),
                        {"ip": peer, "port": 8080, **kw}))
            out.append((f"dns udp {who} v{fam}", Conn("out", "udp", peer, 53, mark=mark),
                        {"ip": peer, "port": 53, "proto": "udp", "timeout": 0.15, **kw}))
            if who == "conn":
                # (TCP DNS with the connection mark: netfilter's nat takes it to the DNS proxy, but
                # the policy route keeps the connection in the pod and the proxy's answer to the
                # peer's address leaves it: no handshake, no landing to compare.)
                continue
            out.append((f"dns tcp {who} v{fam}", Conn("out", "tcp", peer, 53, mark=mark),
                        {"ip": peer, "port": 53, **kw}))
        out.append((f"self v{fam}", Conn("out", "tcp", own, 8080), {"ip": own, "port": 8080}))
        out.append((f"to the probe address v{fam}", Conn("out", "tcp", probe, 8080), {"ip": probe, "port": 8080}))
        for port in (8080, 15008):
            out.append((f"in v{fam} :{port}", Conn("in", "tcp", own, port, src=peer, iface=pod.pod_if),
                        {"ns": pod.peer_name, "ip": own, "port": port}))
        out.append((f"in from the probe address v{fam}", Conn("in", "tcp", own, 8080, src=probe, iface=pod.pod_if),
                    {"ns": pod.peer_name, "ip": own, "port": 8080, "src": probe}))
    return out


def test_evaluators_land_ambient_probes_where_the_kernel_does(make_pod, bpf_root: str) -> None:  # noqa: F811
    """Ambient configs on iptables and eBPF: a probe matrix (marks, DNS, the probe address, the
    tunnel port, a rerouted interface) lands where each evaluator says; the node proxy's
    transparent connection to the app from a peer's address reaches the app on both."""
    from tests.test_ambient import node_proxy, spoofed_connect

    ambient_labels: dict[str, Landing] = {"proxy-out4": ("redirect", 15001), "proxy-out6": ("redirect", 15001),
                                          "proxy-in4": ("redirect", 15006), "proxy-in6": ("redirect", 15006),
                                          "proxy-dns4": ("redirect", 15053), "proxy-dns6": ("redirect", 15053),
                                          "proxy-dns-tcp4": ("redirect", 15053), "proxy-dns-tcp6": ("redirect", 15053)}
    kinds: set[Landing | str] = set()
    for backend in ("iptables", "ebpf"):
        pod = make_pod()
        for fam in (4, 6):  # the probe addresses on the peer, routed to from the pod
            plen = 32 if fam == 4 else 128
            in_peer = ["ip", "-n", pod.peer_name, f"-{fam}", "addr", "add", f"{PROBE_SRC[fam]}/{plen}", "dev",
                       pod.peer_if] + (["nodad"] if fam == 6 else [])
            subprocess.run(in_peer, check=True)
            subprocess.run(["ip", "-n", pod.name, f"-{fam}", "route", "add", PROBE_SRC[fam], "dev", pod.pod_if],
                           check=True)
        with node_proxy(pod) as proxy, contextlib.ExitStack() as st:
            ls: list[Listener] = [*proxy.all()]
            for fam in (4, 6):
                ls += [st.enter_context(TcpListener(pod.name, 8080, fam, label=f"app{fam}")),
                       st.enter_context(TcpListener(pod.peer_name, 8080, fam, label=f"peer{fam}")),
                       st.enter_context(TcpListener(pod.peer_name, 53, fam, label=f"resolver-tcp{fam}")),
                       st.enter_context(UdpListener(pod.peer_name, 53, fam, label=f"resolver{fam}"))]
            for fam in (4, 6):  # neighbour discovery first
                landing(pod.peer_name, pod.pod_ip(fam), 8080, *ls, timeout=3.0)
            try:
                for spec in AMBIENT:
                    kw = {k: v for k, v in spec.items() if k != "reroute"}
                    if spec.get("reroute"):
                        kw["reroute_interfaces"] = (pod.pod_if,)
                    cfg = RedirectConfig(mode="ambient", **kw)
                    redirect.setup(pod.name, cfg, backend=backend)
                    net = PodNet(((4, pod.pod_ip4, 2), (6, pod.pod_ip6, 2)), dev=pod.pod_if, links=((pod.pod_if, 2),))
                    plan, entries = build_plan(cfg), lower_ebpf(ambient_intent_of(cfg), (4, 6))
                    wrong: dict[str, Any] = {}
                    for name, conn, pkw in ambient_probes(pod):
                        want = evaluate_plan(plan, (4, 6), net, conn) if backend == "iptables" else \
                            evaluate_ebpf(entries, net, conn)
                        pkw = dict(pkw)
                        hit = landing(pkw.pop("ns", pod.name), pkw.pop("ip"), pkw.pop("port"), *ls,
                                      **{"timeout": 1.0, **pkw})
                        got = (f"nowhere ({hit.result.error})" if hit.listener is None else
                               ambient_labels.get(hit.listener.label or "", DIRECT))
                        if " conn " in f" {name} " and hit.listener is None:
                            # Uncaptured, and the policy route of the connection mark keeps it in the
                            # pod, where nothing listens on the peer's address: nowhere, on both.
                            got = DIRECT
                        kinds.add(got)
                        if got != want:
                            wrong[name] = (got, want)
                    for fam in (4, 6):  # the node proxy's transparent connection to the app
                        spoofed = Conn("out", "tcp", pod.pod_ip(fam), 8080, mark=0x539, src=pod.peer_ip(fam))
                        want = evaluate_plan(plan, (4, 6), net, spoofed) if backend == "iptables" else \
                            evaluate_ebpf(entries, net, spoofed)
                        got_label = in_netns(pod.name, spoofed_connect, pod.peer_ip(fam), (pod.pod_ip(fam), 8080))
                        got = DIRECT if got_label == f"app{fam}" else f"{got_label}"
                        if not cfg.bypass_inbound_capture:  # (then no connection mark: the replies leave the pod)
                            if got != want:
                                wrong[f"transparent v{fam}"] = (got, want)
                    assert not wrong, f"{backend} {spec}: kernel vs evaluator (got, predicted): {wrong}"
            finally:
                redirect.teardown(pod.name, backend=backend)
    assert {DIRECT, ("redirect", 15001), ("redirect", 15006), ("redirect", 15053)} <= kinds, kinds
