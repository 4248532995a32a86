"""Ambient mode against the real kernel: in-pod rules for a node proxy, and the node's probe rules.

A "pod" is a netns joined by a veth to a peer netns, which stands for the rest of the
network and, in the probe tests, for the node itself. The test node proxy (like
ztunnel) opens its listeners inside the pod netns with SO_MARK 0x539 and connects
onward with marked sockets.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import redirect
from redirect.ambient import node
from redirect.config import RedirectConfig
from tests.netkit import (
    IP_TRANSPARENT,
    IPV6_TRANSPARENT,
    SO_MARK,
    SOL_IP,
    SOL_IPV6,
    VM_NET,
    Landing,
    Pod,
    TcpListener,
    UdpListener,
    in_netns,
    landing,
    vm_behind,
)

pytestmark = pytest.mark.timeout(60)

#: Backends that install ambient capture (the netfilter ones render the ambient plan; eBPF its
#: lowering, with the same policy route).
BACKENDS = ["iptables", "nftables", "ebpf"]
FAMILIES = [4, 6]
MARK = 0x539
APP_PORT = 8080
PROBE_SRC = {4: "169.254.7.127", 6: "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"}


# --- the test node proxy -------------------------------------------------------------


@dataclass
class NodeProxy:
    """Marked listeners inside the pod netns, one set per family (ztunnel's in-pod sockets)."""

    outbound: dict[int, TcpListener]
    inbound: dict[int, TcpListener]
    hbone: dict[int, TcpListener]
    dns_udp: dict[int, UdpListener]
    dns_tcp: dict[int, TcpListener]

    def all(self) -> list[TcpListener | UdpListener]:
        return [*self.outbound.values(), *self.inbound.values(), *self.hbone.values(),
                *self.dns_udp.values(), *self.dns_tcp.values()]


@contextlib.contextmanager
def node_proxy(pod: Pod) -> Iterator[NodeProxy]:
    with contextlib.ExitStack() as stack:

        def tcp(port: int, fam: int, label: str) -> TcpListener:
            return stack.enter_context(TcpListener(pod.name, port, family=fam, mark=MARK, label=f"{label}{fam}"))

        proxy = NodeProxy(
            outbound={f: tcp(15001, f, "proxy-out") for f in FAMILIES},
            inbound={f: tcp(15006, f, "proxy-in") for f in FAMILIES},
            hbone={f: tcp(15008, f, "proxy-hbone") for f in FAMILIES},
            dns_udp={f: stack.enter_context(UdpListener(pod.name, 15053, family=f, mark=MARK, label=f"proxy-dns{f}"))
                     for f in FAMILIES},
            dns_tcp={f: tcp(15053, f, "proxy-dns-tcp") for f in FAMILIES},
        )
        yield proxy


@pytest.fixture(autouse=True)
def _ebpf_root(request: pytest.FixtureRequest) -> None:
    """eBPF cases run with the host programs under a scratch root of this module (``ebpf_root``)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "ebpf":
        request.getfixturevalue("ebpf_root")


@pytest.fixture
def proxy(pod: Pod) -> Iterator[NodeProxy]:
    with node_proxy(pod) as p:
        yield p


@pytest.fixture
def apps(pod: Pod) -> Iterator[dict[str, dict[int, TcpListener | UdpListener]]]:
    """The app in the pod (8080), and a server (8080) and resolver (53) in the peer."""
    with contextlib.ExitStack() as stack:
        out: dict[str, dict[int, TcpListener | UdpListener]] = {"app": {}, "peer": {}, "dns": {}, "dns_tcp": {}}
        for f in FAMILIES:
            out["app"][f] = stack.enter_context(TcpListener(pod.name, APP_PORT, family=f, label=f"app{f}"))
            out["peer"][f] = stack.enter_context(TcpListener(pod.peer_name, APP_PORT, family=f, label=f"peer{f}"))
            out["dns"][f] = stack.enter_context(UdpListener(pod.peer_name, 53, family=f, label=f"resolver{f}"))
            out["dns_tcp"][f] = stack.enter_context(TcpListener(pod.peer_name, 53, family=f, label=f"resolver-tcp{f}"))
        yield out


def ambient(**kw: object) -> RedirectConfig:
    return RedirectConfig(mode="ambient", **kw)  # type: ignore[arg-type]


def spoofed_connect(src_ip: str, dst: tuple[str, int], timeout: float = 2.0) -> str | None:
    """Like ztunnel's inbound passthrough: a marked, transparent socket that connects to the
    app from the original client's (non-local) address. Returns the app's answer line."""
    fam = socket.AF_INET6 if ":" in src_ip else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.setsockopt(socket.SOL_SOCKET, SO_MARK, MARK)
        if fam == socket.AF_INET:
            s.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        else:
            s.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        s.bind((src_ip, 0))
        try:
            s.connect(dst)
            s.sendall(b"spoofed\n")
            data = s.recv(4096)
        except OSError:
            return None
        return data.split(b"\n", 1)[0].decode() if data else None


def snapshot(ns: str) -> dict[str, str]:
    """What our setup could change in ``ns``: both families' rules, policy rules and routes."""
    cmds = {
        "iptables": ["iptables-save"], "ip6tables": ["ip6tables-save"],
        "iptables-legacy": ["iptables-legacy-save"], "ip6tables-legacy": ["ip6tables-legacy-save"],
        "nft": ["nft", "-s", "list", "ruleset"],  # -s: no counters (ND packets move them)
        "rule4": ["ip", "-4", "rule"], "rule6": ["ip", "-6", "rule"],
        "route4": ["ip", "-4", "route", "show", "table", "all"],
        "route6": ["ip", "-6", "route", "show", "table", "all"],
        "sysctl": ["sysctl", "net.ipv4.tcp_fwmark_accept"],
    }

    def run() -> dict[str, str]:
        out = {}
        for k, argv in cmds.items():
            p = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
            out[k] = "\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("#"))
        return out

    return in_netns(ns, run)


# --- rendering (no root needed) ---------------------------------------------------------


def test_render_ambient_is_a_readable_ruleset() -> None:
    text = redirect.render(ambient(dns_capture=True))
    assert "# IPv4" in text and "# IPv6" in text
    for line in (
        "-A RDR_PREROUTING -m mark --mark 0x539/0xfff",
        "-j CONNMARK --set-xmark 0x111/0xfff",
        "-m connmark --mark 0x111/0xfff",
        "-j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
        "-A RDR_PREROUTING -s 169.254.7.127/32 -p tcp",
        "-A RDR_PREROUTING -s fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 -p tcp",
        "! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff",
        "-j REDIRECT --to-ports 15006",
        "-j REDIRECT --to-ports 15001",
        "-j REDIRECT --to-ports 15053",
        "-j CT --zone 1",
    ):
        assert line in text, line


def test_plan_has_the_policy_route_for_connmarked_replies() -> None:
    from redirect.plan import build_plan
    from redirect.plan.vocabulary import PolicyRoute

    plan = build_plan(ambient())
    assert set(plan.routes) == {PolicyRoute(4, 0x111, 0xFFF, 100), PolicyRoute(6, 0x111, 0xFFF, 100)}
    assert not any(c.table == "raw" for c in plan.chains)  # no DNS, no zones


def test_bypass_inbound_capture_keeps_only_outbound() -> None:
    text = redirect.render(ambient(bypass_inbound_capture=True))
    assert "--to-ports 15006" not in text and "--set-xmark" not in text
    assert "--to-ports 15001" in text and "--restore-mark" in text


# --- in-pod traffic ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ambient_traffic_reaches_the_node_proxy(pod: Pod, proxy: NodeProxy, apps: dict, backend: str,
                                                family: int) -> None:
    redirect.setup(pod.name, ambient(), backend=backend)
    peer_ip, pod_ip = pod.peer_ip(family), pod.pod_ip(family)
    app, peer = apps["app"][family], apps["peer"][family]

    # Outbound app traffic lands on 15001 with its original destination.
    hit = landing(pod.name, peer_ip, APP_PORT, proxy.outbound[family], peer)
    assert hit.listener is proxy.outbound[family], hit.result
    assert hit.orig_dst == (peer_ip, APP_PORT)

    # The proxy's own (marked) connections go out uncaptured, and their replies come back.
    hit = landing(pod.name, peer_ip, APP_PORT, proxy.outbound[family], peer, mark=MARK)
    assert hit.listener is peer, hit.result

    # Inbound lands on 15006 with its original destination; the app does not see it.
    hit = landing(pod.peer_name, pod_ip, APP_PORT, proxy.inbound[family], app)
    assert hit.listener is proxy.inbound[family], hit.result
    assert hit.orig_dst == (pod_ip, APP_PORT)

    # HBONE on 15008 is not redirected: it reaches the 15008 listener at its own address.
    hit = landing(pod.peer_name, pod_ip, 15008, proxy.hbone[family], proxy.inbound[family])
    assert hit.listener is proxy.hbone[family], hit.result
    assert hit.local == (pod_ip, 15008) and hit.orig_dst in (None, (pod_ip, 15008))

    # The app talking to its own pod address over lo is not captured.
    hit = landing(pod.name, pod_ip, APP_PORT, app, proxy.outbound[family], proxy.inbound[family])
    assert hit.listener is app, hit.result

    # UDP other than DNS, and DNS without dns_capture, are not captured.
    dns = apps["dns"][family]
    hit = landing(pod.name, peer_ip, 53, dns, proxy.dns_udp[family], proto="udp")
    assert hit.listener is dns, hit.result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_proxy_passthrough_from_the_client_address_gets_the_apps_replies(
    pod: Pod, proxy: NodeProxy, apps: dict, backend: str, family: int
) -> None:
    """ztunnel connects to the app from the original client's address (transparent, marked);
    the app's replies to that non-local address must come back to ztunnel, not leave the pod:
    connmark 0x111 on the marked SYN, restore-mark on the reply, fwmark rule -> table 100."""
    peer_ip, pod_ip = pod.peer_ip(family), pod.pod_ip(family)
    app = apps["app"][family]
    # Without our rules and routes the reply leaves through eth0 and the connection fails.
    assert in_netns(pod.name, spoofed_connect, peer_ip, (pod_ip, APP_PORT), 0.5) is None
    redirect.setup(pod.name, ambient(), backend=backend)
    assert in_netns(pod.name, spoofed_connect, peer_ip, (pod_ip, APP_PORT)) == app.label
    assert app.last is not None and app.last.peer[0] == peer_ip and app.last.line == "spoofed"


def assert_proxy_query_in_zone_1(pod: Pod, family: int, peer_ip: str) -> None:
    """The proxy's own upstream query went out in conntrack zone 1 (netfilter backends)."""
    ct = in_netns(pod.name, subprocess.run, ["conntrack", "-L", "-f", "ipv4" if family == 4 else "ipv6",
                                             "-p", "udp", "--dport", "53", "-w", "1"],
                  capture_output=True, text=True, timeout=10, check=False)
    assert "zone=1" in ct.stdout and peer_ip in ct.stdout, ct.stdout + ct.stderr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_dns_goes_to_15053_only_when_enabled(pod: Pod, proxy: NodeProxy, apps: dict, backend: str,
                                             family: int) -> None:
    peer_ip = pod.peer_ip(family)
    dns, dns_tcp = apps["dns"][family], apps["dns_tcp"][family]
    redirect.setup(pod.name, ambient(dns_capture=True), backend=backend)

    hit = landing(pod.name, peer_ip, 53, proxy.dns_udp[family], dns, proto="udp")
    assert hit.listener is proxy.dns_udp[family], hit.result
    hit = landing(pod.name, peer_ip, 53, proxy.dns_tcp[family], dns_tcp)
    assert hit.listener is proxy.dns_tcp[family], hit.result
    assert hit.orig_dst == (peer_ip, 53)

    # The proxy's own upstream query goes to the resolver, in conntrack zone 1.
    hit = landing(pod.name, peer_ip, 53, proxy.dns_udp[family], dns, proto="udp", mark=MARK)
    assert hit.listener is dns, hit.result
    if backend != "ebpf":  # (eBPF rewrites sockets, not packets: no conntrack entry to keep apart)
        assert_proxy_query_in_zone_1(pod, family, peer_ip)

    # Turned off again (a config change replaces ours), DNS goes straight to the resolver.
    redirect.setup(pod.name, ambient(dns_capture=False), backend=backend)
    hit = landing(pod.name, peer_ip, 53, proxy.dns_udp[family], dns, proto="udp")
    assert hit.listener is dns, hit.result
    # TCP to 53 is then ordinary outbound TCP: the proxy's outbound port, not its DNS port.
    hit = landing(pod.name, peer_ip, 53, proxy.dns_tcp[family], proxy.outbound[family], dns_tcp)
    assert hit.listener is proxy.outbound[family], hit.result


@pytest.mark.parametrize("backend", BACKENDS)
def test_bypass_inbound_capture_leaves_inbound_alone(pod: Pod, proxy: NodeProxy, apps: dict,
                                                     backend: str) -> None:
    redirect.setup(pod.name, ambient(bypass_inbound_capture=True), backend=backend)
    for fam in FAMILIES:
        hit = landing(pod.peer_name, pod.pod_ip(fam), APP_PORT, proxy.inbound[fam], apps["app"][fam])
        assert hit.listener is apps["app"][fam], hit.result
        hit = landing(pod.name, pod.peer_ip(fam), APP_PORT, proxy.outbound[fam], apps["peer"][fam])
        assert hit.listener is proxy.outbound[fam], hit.result


@pytest.mark.parametrize("backend", BACKENDS)
def test_rerouted_interface_inbound_goes_to_the_outbound_port(pod_with_extra_iface: Pod, backend: str) -> None:
    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None
    with node_proxy(pod) as proxy:
        redirect.setup(pod.name, ambient(reroute_interfaces=(extra.pod_if,)), backend=backend)
        for fam, dst in ((4, extra.pod_ip4), (6, extra.pod_ip6)):
            hit = landing(pod.peer_name, dst, APP_PORT, proxy.outbound[fam], proxy.inbound[fam])
            assert hit.listener is proxy.outbound[fam], hit.result
            assert hit.orig_dst == (dst, APP_PORT)
        # The main interface is still inbound-captured as usual.
        hit = landing(pod.peer_name, pod.pod_ip4, APP_PORT, proxy.outbound[4], proxy.inbound[4])
        assert hit.listener is proxy.inbound[4], hit.result


@pytest.mark.parametrize("backend", BACKENDS)
def test_rerouted_interface_forwarded_traffic_goes_to_the_outbound_port(pod: Pod, proxy: NodeProxy, apps: dict,
                                                                       backend: str) -> None:
    """A VM behind a reroute interface connects to a host beyond the pod (the pod forwards it): the
    connection lands on the node proxy's outbound listener with its original destination."""
    with vm_behind(pod) as vm:
        redirect.setup(pod.name, ambient(reroute_interfaces=("vm0",)), backend=backend)
        for fam in FAMILIES:
            dst = pod.peer_ip(fam)
            hit = landing(vm, dst, APP_PORT, proxy.outbound[fam], proxy.inbound[fam], apps["peer"][fam])
            assert hit.listener is proxy.outbound[fam], hit.result
            assert hit.orig_dst == (dst, APP_PORT) and hit.conn is not None and hit.conn.peer[0] == VM_NET[fam][1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forwarded_traffic_lands_on_the_inbound_port(pod: Pod, proxy: NodeProxy, apps: dict, backend: str) -> None:
    """TCP the pod forwards from an interface that is not a reroute one (a VM behind ``vm0``
    connecting to a host beyond the pod) is inbound-captured, as the in-pod nat PREROUTING rule
    (no destination match) has it: it lands on the node proxy's inbound listener with its original
    destination and the VM as the peer. Before setup and after teardown the pod forwards it."""
    with vm_behind(pod) as vm:
        def land(fam: int) -> Landing:
            return landing(vm, pod.peer_ip(fam), APP_PORT, proxy.outbound[fam], proxy.inbound[fam], apps["app"][fam],
                           apps["peer"][fam])

        assert all(land(fam).listener is apps["peer"][fam] for fam in FAMILIES)
        redirect.setup(pod.name, ambient(), backend=backend)
        for fam in FAMILIES:
            hit = land(fam)
            assert hit.listener is proxy.inbound[fam], hit.result
            assert hit.orig_dst == (pod.peer_ip(fam), APP_PORT), hit.conn
            assert hit.peer is not None and hit.peer[0] == VM_NET[fam][1], hit.conn
            # The pod's own traffic is captured as in a pod that does not forward.
            hit = landing(pod.peer_name, pod.pod_ip(fam), APP_PORT, proxy.inbound[fam], apps["app"][fam])
            assert hit.listener is proxy.inbound[fam] and hit.orig_dst == (pod.pod_ip(fam), APP_PORT), hit.result
            hit = landing(pod.name, pod.peer_ip(fam), APP_PORT, proxy.outbound[fam], apps["peer"][fam])
            assert hit.listener is proxy.outbound[fam], hit.result
            hit = landing(pod.name, pod.peer_ip(fam), APP_PORT, proxy.outbound[fam], apps["peer"][fam], mark=MARK)
            assert hit.listener is apps["peer"][fam], hit.result
        redirect.teardown(pod.name, backend=backend)
        assert all(land(fam).listener is apps["peer"][fam] for fam in FAMILIES)

@pytest.mark.parametrize("backend", BACKENDS)
def test_setup_twice_is_once_and_teardown_restores_the_netns(pod: Pod, backend: str) -> None:
    before = snapshot(pod.name)
    cfg = ambient(dns_capture=True, reroute_interfaces=("eth0",))
    first = redirect.setup(pod.name, cfg, backend=backend)
    assert first.changed and first.families == (4, 6)
    installed = snapshot(pod.name)
    assert installed != before
    assert "lookup 100" in installed["rule4"] and "lookup 100" in installed["rule6"]
    assert "local default dev lo" in installed["route4"] and "local default dev lo" in installed["route6"]
    second = redirect.setup(pod.name, cfg, backend=backend)
    assert not second.changed
    assert snapshot(pod.name) == installed
    assert redirect.check(pod.name, cfg, backend=backend).ok
    assert redirect.teardown(pod.name, backend=backend)
    assert snapshot(pod.name) == before
    assert not redirect.teardown(pod.name, backend=backend)


# --- node side: kubelet probes ---------------------------------------------------------------


def _nat_save(ns: str, fam: int) -> str:
    argv = ["iptables-save" if fam == 4 else "ip6tables-save", "-t", "nat"]
    p = in_netns(ns, subprocess.run, argv, capture_output=True, text=True, timeout=10, check=False)
    return "\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("#"))


@pytest.fixture
def node_ns(pod: Pod) -> Iterator[str]:
    """The pod's peer netns plays the node; our node rules are removed after the test."""
    try:
        yield pod.peer_name
    finally:
        node.teardown_node(pod.peer_name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_kubelet_probe_from_the_node_reaches_the_app_directly(
    pod: Pod, node_ns: str, proxy: NodeProxy, backend: str, family: int
) -> None:
    pod_ip = pod.pod_ip(family)
    redirect.setup(pod.name, ambient(), backend=backend)
    assert node.setup_node(node_ns)
    with TcpListener(pod.name, APP_PORT, family=family, label="app") as app:
        # Pod not in the set yet: the node's connection is ordinary inbound, captured.
        hit = landing(node_ns, pod_ip, APP_PORT, app, proxy.inbound[family])
        assert hit.listener is proxy.inbound[family], hit.result

        assert node.add_pods([pod.pod_ip4, pod.pod_ip6], node_ns, owner="pod-a") == [pod.pod_ip4, pod.pod_ip6]
        hit = landing(node_ns, pod_ip, APP_PORT, app, proxy.inbound[family])
        assert hit.listener is app, hit.result
        assert hit.peer is not None and hit.peer[0] == PROBE_SRC[family]

        assert node.remove_pods([pod_ip], node_ns, owner="pod-a") == [pod_ip]
        hit = landing(node_ns, pod_ip, APP_PORT, app, proxy.inbound[family])
        assert hit.listener is proxy.inbound[family], hit.result


def test_node_pod_set_is_idempotent_and_owned(pod: Pod, node_ns: str) -> None:
    node.setup_node(node_ns)
    assert node.add_pods(["10.9.0.1", "fd00:9::1"], node_ns, owner="uid-a") == ["10.9.0.1", "fd00:9::1"]
    assert node.add_pods(["10.9.0.1"], node_ns, owner="uid-a") == []  # again: nothing to do
    node.add_pods(["10.9.0.2"], node_ns, owner="uid-b")
    # The IP is recycled to another pod: it takes the entry over.
    assert node.add_pods(["10.9.0.1"], node_ns, owner="uid-c") == ["10.9.0.1"]
    # The old pod going away does not remove the new pod's entry, nor anyone else's.
    assert node.remove_pods(["10.9.0.1"], node_ns, owner="uid-a") == []
    assert node.list_pods(node_ns) == {"10.9.0.1": "uid-c", "10.9.0.2": "uid-b", "fd00:9::1": "uid-a"}
    assert node.remove_pods(["10.9.0.1", "10.9.0.3"], node_ns, owner="uid-c") == ["10.9.0.1"]
    assert node.remove_pods(["fd00:9::1"], node_ns) == ["fd00:9::1"]
    assert node.list_pods(node_ns) == {"10.9.0.2": "uid-b"}
    with pytest.raises(redirect.ConfigError, match="ips"):
        node.add_pods(["10.9.0.300"], node_ns)
    assert node.list_pods(node_ns) == {"10.9.0.2": "uid-b"}
    # Never the node's own traffic's destinations: in the sets, the node's own connections to them
    # would be SNAT'd (loopback: kubelet's and etcd's; the node's own addresses: its local services).
    for bad, words in (("127.0.0.1", "loopback"), ("::1", "loopback"), ("169.254.169.254", "link-local"),
                       ("0.0.0.0", "unspecified"), (pod.peer_ip4, "node's own"), (pod.peer_ip6, "node's own")):
        with pytest.raises(redirect.ConfigError, match=words):
            node.add_pods(["10.9.0.5", bad], node_ns, owner="uid-d")
    assert node.list_pods(node_ns) == {"10.9.0.2": "uid-b"}


def test_node_rules_are_reasserted_and_removed_cleanly(pod: Pod, node_ns: str) -> None:
    before = {f: _nat_save(node_ns, f) for f in FAMILIES}
    assert node.setup_node(node_ns)
    assert not node.setup_node(node_ns)  # intact: untouched
    assert node.check_node(node_ns).ok
    installed = {f: _nat_save(node_ns, f) for f in FAMILIES}
    for f in FAMILIES:
        assert f'-A POSTROUTING -m comment --comment "redirect: kubelet probes" -j {node.CHAIN}' in installed[f]
        assert f"--match-set {node.SET_NAMES[f]} dst" in installed[f]
        assert f"--to-source {PROBE_SRC[f]}" in installed[f]
    # Someone deletes our rule (IPv4) and our jump (IPv6): check says so, setup restores them.
    in_netns(node_ns, subprocess.run, ["iptables", "-t", "nat", "-F", node.CHAIN], check=True)
    in_netns(node_ns, subprocess.run, ["ip6tables", "-t", "nat", "-D", "POSTROUTING", "1"], check=True)
    res = node.check_node(node_ns)
    assert not res.ok and len(res.differences) == 2, res.differences
    assert node.setup_node(node_ns)
    assert {f: _nat_save(node_ns, f) for f in FAMILIES} == installed
    # A foreign rule in POSTROUTING survives setup and teardown.
    in_netns(node_ns, subprocess.run, ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "RETURN"],
             check=True)
    assert not node.setup_node(node_ns)
    assert node.teardown_node(node_ns)
    after = _nat_save(node_ns, 4)
    assert "-A POSTROUTING -o lo -j RETURN" in after and node.CHAIN not in after
    assert node.CHAIN not in _nat_save(node_ns, 6)
    in_netns(node_ns, subprocess.run, ["iptables", "-t", "nat", "-D", "POSTROUTING", "-o", "lo", "-j", "RETURN"],
             check=True)
    assert {f: _nat_save(node_ns, f) for f in FAMILIES} == before or all(
        node.CHAIN not in _nat_save(node_ns, f) for f in FAMILIES)
    p = in_netns(node_ns, subprocess.run, ["ipset", "list", "-n"], capture_output=True, text=True, check=True)
    assert not any(n.startswith("rdr-") for n in p.stdout.split())
    assert not node.teardown_node(node_ns)


def test_node_add_before_setup_says_what_to_do(pod: Pod, node_ns: str) -> None:
    with pytest.raises(redirect.SetupError, match="node setup"):
        node.add_pods(["10.9.0.1"], node_ns)


def test_node_cli_round_trip(pod: Pod, node_ns: str) -> None:
    import sys

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "redirect.cli", "node", *argv], capture_output=True,
                              text=True, timeout=30, check=False)

    assert "add-pod" in cli("--help").stdout
    p = cli("setup", "--netns", node_ns)
    assert p.returncode == 0 and "installed" in p.stdout, p.stderr
    assert cli("check", "--netns", node_ns).returncode == 0
    p = cli("add-pod", "10.9.0.7", "fd00:9::7", "--owner", "uid-x", "--netns", node_ns)
    assert p.returncode == 0 and "10.9.0.7" in p.stdout, p.stderr
    listed = json.loads(cli("list-pods", "--json", "--netns", node_ns).stdout)
    assert listed == {"10.9.0.7": "uid-x", "fd00:9::7": "uid-x"}
    p = cli("add-pod", "10.9.0.999", "--netns", node_ns)
    assert p.returncode == 2 and "ips" in p.stderr and "10.9.0.999" in p.stderr, p.stderr
    p = cli("setup", "--netns", node_ns, "--probe-snat-ipv4", "fd00::1")
    assert p.returncode == 2 and "probe_snat_ipv4" in p.stderr, p.stderr
    assert cli("remove-pod", "10.9.0.7", "fd00:9::7", "--netns", node_ns).returncode == 0
    in_netns(node_ns, subprocess.run, ["iptables", "-t", "nat", "-F", node.CHAIN], check=True)
    p = cli("check", "--netns", node_ns, "--json")
    assert p.returncode == 1 and not json.loads(p.stdout)["ok"]
    assert cli("teardown", "--netns", node_ns).returncode == 0
    assert node.CHAIN not in _nat_save(node_ns, 4)


# --- eBPF: the sysctl its passthrough needs, and switching backends ---------------------------


def _fwmark_accept(ns: str, value: int | None = None) -> int:
    def run() -> int:
        path = "/proc/sys/net/ipv4/tcp_fwmark_accept"
        if value is not None:
            with open(path, "w") as f:
                f.write(f"{value}\n")
        with open(path) as f:
            return int(f.read())

    return in_netns(ns, run)


def test_ebpf_turns_tcp_fwmark_accept_on_and_off_only_when_it_is_its_own(pod: Pod, ebpf_root: str) -> None:
    cfg = ambient()
    # Someone else's setting: kept, and left on at teardown.
    _fwmark_accept(pod.name, 1)
    redirect.setup(pod.name, cfg, backend="ebpf")
    assert redirect.check(pod.name, cfg, backend="ebpf").ok
    assert redirect.teardown(pod.name, backend="ebpf")
    assert _fwmark_accept(pod.name) == 1
    # Off before: setup turns it on; turned off by hand, check says so and setup repairs it.
    _fwmark_accept(pod.name, 0)
    redirect.setup(pod.name, cfg, backend="ebpf")
    assert _fwmark_accept(pod.name) == 1
    _fwmark_accept(pod.name, 0)
    res = redirect.check(pod.name, cfg, backend="ebpf")
    assert not res.ok and any("tcp_fwmark_accept" in d for d in res.differences), res.differences
    assert redirect.setup(pod.name, cfg, backend="ebpf").changed
    assert _fwmark_accept(pod.name) == 1 and redirect.check(pod.name, cfg, backend="ebpf").ok
    # Not needed any more (no inbound capture): off again; and at teardown.
    redirect.setup(pod.name, ambient(bypass_inbound_capture=True), backend="ebpf")
    assert _fwmark_accept(pod.name) == 0
    redirect.setup(pod.name, cfg, backend="ebpf")
    assert redirect.teardown(pod.name, backend="ebpf")
    assert _fwmark_accept(pod.name) == 0


def test_switching_an_ambient_pod_between_backends_keeps_the_passthrough(pod: Pod, proxy: NodeProxy, apps: dict,
                                                                         ebpf_root: str) -> None:
    before = snapshot(pod.name)
    app = apps["app"][4]
    for backend in ("iptables", "ebpf", "nftables", "ebpf"):
        res = redirect.setup(pod.name, ambient(), backend=backend)
        assert res.backend == backend and redirect.check(pod.name, ambient()).ok, backend
        for fam in FAMILIES:
            got = in_netns(pod.name, spoofed_connect, pod.peer_ip(fam), (pod.pod_ip(fam), APP_PORT))
            assert got == apps["app"][fam].label, (backend, fam)
        hit = landing(pod.name, pod.peer_ip4, APP_PORT, proxy.outbound[4], apps["peer"][4])
        assert hit.listener is proxy.outbound[4], (backend, hit.result)
        assert app.last is not None and app.last.peer[0] == pod.peer_ip4
    assert redirect.teardown(pod.name)
    assert snapshot(pod.name) == before


def test_ebpf_ambient_to_sidecar_and_back_leaves_no_route_or_sysctl_of_the_other(pod: Pod, ebpf_root: str) -> None:
    """A config change between modes on eBPF: the ambient policy route and tcp_fwmark_accept go
    with the ambient config and come back with it; teardown gives the netns back as it was."""
    before = snapshot(pod.name)
    redirect.setup(pod.name, ambient(), backend="ebpf")
    assert "lookup 100" in snapshot(pod.name)["rule4"] and _fwmark_accept(pod.name) == 1
    sidecar = RedirectConfig(ipv6=False)
    assert redirect.setup(pod.name, sidecar, backend="ebpf").changed
    now = snapshot(pod.name)
    assert "lookup 100" not in now["rule4"] + now["rule6"] and _fwmark_accept(pod.name) == 0
    assert redirect.check(pod.name, sidecar, backend="ebpf").ok
    assert redirect.setup(pod.name, ambient(), backend="ebpf").changed
    assert redirect.check(pod.name, ambient(), backend="ebpf").ok and _fwmark_accept(pod.name) == 1
    assert redirect.teardown(pod.name)
    assert snapshot(pod.name) == before
