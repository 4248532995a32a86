"""The eBPF backend with real traffic: outbound, inbound and DNS capture, IPv4 and IPv6.

The host programs are pinned under a root of this test module's own
(``/sys/fs/bpf/rdrt-ebpf-<pid>``) and unpinned at the end even on failure; the
cgroup-root programs they attach are a no-op for every netns not registered
in that root's maps, so other tests running at the same time are unaffected.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from redirect import api
from redirect.backends import ebpf
from redirect.backends.ebpf import abi
from redirect.backends.ebpf.host import objects, pod_link, syscalls
from redirect.backends.ebpf.pod.entries import policy_core
from redirect.config import RedirectConfig
from redirect.errors import BackendUnavailable, SetupError
from redirect.kernel import netns as rnetns
from redirect.plan.intent import intent_for
from redirect.plan.lower_ebpf import CIDR_KIND, PORT_KIND
from tests import netkit
from tests.kit import bpfroot
from tests.netkit import Pod, TcpListener, UdpListener, landing, link_local, wait_link_detached

APP_UID = 1000
PROXY_UID = 1337
FAMILIES = (4, 6)


@pytest.fixture(scope="module")
def bpf_root() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("the eBPF backend needs root (BPF programs, bpffs, namespaces)")
    root = f"/sys/fs/bpf/rdrt-ebpf-{os.getpid()}"
    old = os.environ.get("REDIRECT_BPF_ROOT")
    os.environ["REDIRECT_BPF_ROOT"] = root
    try:
        ebpf.host(root)  # compile once for the module
        yield root
    finally:
        try:
            ebpf.unload_host(root)
        except SetupError:
            ebpf.force_unload_host(root)  # pods left registered by a failed test: their namespaces are gone anyway
        if old is None:
            os.environ.pop("REDIRECT_BPF_ROOT", None)
        else:
            os.environ["REDIRECT_BPF_ROOT"] = old
        assert not os.path.exists(root), f"left pins under {root}"


@pytest.fixture
def setup_pod(bpf_root: str) -> Iterator[object]:
    """``setup_pod(pod, cfg)`` sets up the eBPF backend; torn down after the test."""
    done: list[Pod] = []

    def do(pod: Pod, cfg: RedirectConfig) -> object:
        res = api.setup(pod.name, cfg, backend="ebpf")
        done.append(pod)
        return res

    yield do
    for pod in done:
        api.teardown(pod.name, backend="ebpf")


def _proxy_listeners(pod: Pod, port: int, label: str) -> list[TcpListener]:
    return [TcpListener(pod.name, port, family=f, label=f"{label}{f}").start() for f in FAMILIES]


def _close(*lists: list[TcpListener] | list[UdpListener]) -> None:
    for lst in lists:
        for x in lst:
            x.close()


OUT_ONLY = RedirectConfig(inbound_ports=())


@pytest.mark.parametrize("family", FAMILIES)
def test_outbound_from_app_reaches_unmodified_proxy_with_original_dst(pod: Pod, setup_pod, family: int) -> None:
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 8080, family=family, label="app").start()]
    try:
        setup_pod(pod, OUT_ONLY)
        hit = landing(pod.name, pod.peer_ip(family), 8080, *proxy, *app, uid=APP_UID)
        assert hit.listener in proxy, hit.result
        # TcpListener reads it with the standard getsockopt(SO_ORIGINAL_DST / IP6T_SO_ORIGINAL_DST).
        assert hit.orig_dst == (pod.peer_ip(family), 8080)
    finally:
        _close(proxy, app)


@pytest.mark.parametrize("family", FAMILIES)
def test_proxy_uid_and_gid_connect_to_original_dst_not_captured(pod: Pod, setup_pod, family: int) -> None:
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 8080, family=family, label="app").start()]
    try:
        setup_pod(pod, OUT_ONLY)
        hit = landing(pod.name, pod.peer_ip(family), 8080, *proxy, *app, uid=PROXY_UID)
        assert hit.listener is app[0], hit.result
        hit = landing(pod.name, pod.peer_ip(family), 8080, *proxy, *app, gid=PROXY_UID, uid=APP_UID)
        assert hit.listener is app[0], "proxy gid is not captured either"
    finally:
        _close(proxy, app)


@pytest.mark.parametrize("family", FAMILIES)
def test_excluded_ports_cidrs_and_loopback_untouched(pod: Pod, setup_pod, family: int) -> None:
    peer_net = pod.main.subnet4 if family == 4 else pod.main.subnet6
    cfg = RedirectConfig(inbound_ports=(), outbound_exclude_ports=(9090,), outbound_exclude_cidrs=(peer_net,))
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, p, family=family, label=f"app{p}").start() for p in (8080, 9090)]
    local = [TcpListener(pod.name, 7070, family=family, label="local").start()]
    try:
        setup_pod(pod, RedirectConfig(inbound_ports=(), outbound_exclude_ports=(9090,)))
        assert landing(pod.name, pod.peer_ip(family), 9090, *proxy, *app, uid=APP_UID).listener is app[1]
        lo = "127.0.0.1" if family == 4 else "::1"
        assert landing(pod.name, lo, 7070, *proxy, *local, uid=APP_UID).listener is local[0]
        setup_pod(pod, cfg)  # replaces: now the peer's subnet is excluded too
        assert landing(pod.name, pod.peer_ip(family), 8080, *proxy, *app, uid=APP_UID).listener is app[0]
        assert api.check(pod.name, cfg, backend="ebpf").ok
    finally:
        _close(proxy, app, local)


@pytest.mark.parametrize("family", FAMILIES)
def test_inbound_lands_on_proxy_with_original_dst_as_local_address(pod: Pod, setup_pod, family: int) -> None:
    inbound = _proxy_listeners(pod, 15006, "inbound")
    app = [TcpListener(pod.name, p, family=family, label=f"app{p}").start() for p in (8080, 15008, 15090)]
    try:
        setup_pod(pod, RedirectConfig())
        hit = landing(pod.peer_name, pod.pod_ip(family), 8080, *inbound, *app)
        assert hit.listener in inbound, hit.result
        assert hit.local == (pod.pod_ip(family), 8080)
        assert hit.orig_dst == (pod.pod_ip(family), 8080)
        # The tunnel port and the excluded ports are not captured.
        assert landing(pod.peer_name, pod.pod_ip(family), 15008, *inbound, *app).listener is app[1]
        assert landing(pod.peer_name, pod.pod_ip(family), 15090, *inbound, *app).listener is app[2]
        # The app to its own pod address is not captured (Istio: lo traffic of non-proxy uids returns)...
        assert landing(pod.name, pod.pod_ip(family), 8080, *inbound, *app, uid=APP_UID).listener is app[0]
        # ...the proxy's is: the service-VIP hairpin goes to inbound capture, original destination kept.
        hit = landing(pod.name, pod.pod_ip(family), 8080, *inbound, *app, uid=PROXY_UID)
        assert hit.listener in inbound and hit.orig_dst == (pod.pod_ip(family), 8080), hit.result
        # The tunnel port is not hairpinned.
        assert landing(pod.name, pod.pod_ip(family), 15008, *inbound, *app, uid=PROXY_UID).listener is app[1]
    finally:
        _close(inbound, app)


def test_the_proxys_unbound_connect_to_the_v6_passthrough_address_is_not_captured(pod: Pod, setup_pod) -> None:
    """An unbound socket's connect to ``::6`` gets ``::6`` as its source (the kernel prefers the
    destination itself), which iptables returns as the proxy's inbound passthrough (``-s ::6 -o
    lo``). connect6 runs before the source is chosen: with none yet and ``::6`` as the destination
    it is the passthrough too, not the proxy's hairpin to its inbound port."""
    setup_pod(pod, RedirectConfig())
    inbound = _proxy_listeners(pod, 15006, "proxy-in")
    app = [TcpListener(pod.name, 9090, family=6, label="app").start()]
    try:
        hit = landing(pod.name, "::6", 9090, *inbound, *app, uid=PROXY_UID)
        assert hit.listener is app[0], hit.result
        # Capture is on: to the pod's own address the proxy's connection is hairpinned.
        assert landing(pod.name, pod.pod_ip6, 9090, *inbound, *app, uid=PROXY_UID).listener is inbound[1]
    finally:
        _close(inbound, app)


@pytest.mark.parametrize("family", FAMILIES)
def test_proxy_that_listens_after_setup_or_restarts_gets_inbound(pod: Pod, setup_pod, family: int) -> None:
    """The CNI order: setup first, the proxy starts later (sock_ops registers its listener), and restarts."""
    setup_pod(pod, RedirectConfig())
    app = TcpListener(pod.name, 8080, family=family, label="app").start()
    try:
        # No proxy yet: fail closed, inbound connections to captured ports do not reach the app
        # (the SYN is dropped); uncaptured ports are served.
        miss = landing(pod.peer_name, pod.pod_ip(family), 8080, app, timeout=0.5)
        assert miss.listener is None and not app.conns, miss.result
        with TcpListener(pod.name, 15021, family=family, label="health") as health:
            assert landing(pod.peer_name, pod.pod_ip(family), 15021, health).listener is health
        for _ in range(2):  # start, then a restart
            proxy = TcpListener(pod.name, 15006, family=family, label="proxy-in").start()
            try:
                hit = landing(pod.peer_name, pod.pod_ip(family), 8080, proxy, app)
                assert hit.listener is proxy, hit.result
                assert hit.orig_dst == (pod.pod_ip(family), 8080)
            finally:
                proxy.close()
    finally:
        app.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_dns_udp_to_53_reaches_dns_proxy_and_reply_comes_from_server(pod: Pod, setup_pod, family: int) -> None:
    cfg = RedirectConfig(inbound_ports=(), dns_capture=True, capture_all_dns=True)
    dnsp = [UdpListener(pod.name, 15053, family=f, label=f"dnsproxy{f}").start() for f in FAMILIES]
    real = [UdpListener(pod.peer_name, 53, family=family, label="real").start()]
    server = pod.peer_ip(family)
    try:
        setup_pod(pod, cfg)
        hit = landing(pod.name, server, 53, *dnsp, *real, proto="udp", uid=APP_UID)
        assert hit.listener in dnsp, hit.result
        # The proxy's own upstream query goes to the server.
        assert landing(pod.name, server, 53, *dnsp, *real, proto="udp", uid=PROXY_UID).listener is real[0]

        def query() -> dict[str, object]:
            af = socket.AF_INET if family == 4 else socket.AF_INET6
            with socket.socket(af, socket.SOCK_DGRAM) as s:  # unconnected: sendmsg + recvmsg hooks
                s.settimeout(2)
                s.sendto(b"q\n", (server, 53))
                data, src = s.recvfrom(100)
            return {"data": data.decode(), "src": [src[0], src[1]]}

        out = netkit.in_child(pod.name, APP_UID, APP_UID, 3.0, query)
        assert out.get("data", "").startswith("dnsproxy"), out
        assert tuple(out["src"]) == (server, 53), "the answer appears to come from the server asked"
    finally:
        _close(dnsp, real)


IPPROTO_UDPLITE = 136


@pytest.mark.parametrize("family", FAMILIES)
def test_udplite_to_53_is_not_dns(pod: Pod, setup_pod, family: int) -> None:
    """DNS capture takes UDP to port 53 (iptables' ``-p udp``), not UDP-Lite (another protocol,
    also a SOCK_DGRAM socket): a UDP-Lite datagram to port 53 reaches its destination."""
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    server = pod.peer_ip(family)
    setup_pod(pod, RedirectConfig(inbound_ports=(), dns_capture=True, capture_all_dns=True))
    with pod.run_peer(socket.socket, af, socket.SOCK_DGRAM, IPPROTO_UDPLITE) as peer:
        peer.bind((server, 53))
        peer.settimeout(2)

        def send(connected: bool) -> dict[str, object]:
            with socket.socket(af, socket.SOCK_DGRAM, IPPROTO_UDPLITE) as s:
                if connected:
                    s.connect((server, 53))
                    s.send(b"connected")
                else:
                    s.sendto(b"sendto", (server, 53))
            return {}

        for connected in (False, True):
            netkit.in_child(pod.name, APP_UID, APP_UID, 3.0, send, connected)
            assert peer.recv(100) == (b"connected" if connected else b"sendto")


def _cookie(pod: Pod) -> int:
    from redirect.kernel import netns as rn

    with rn.enter(pod.name):
        return ebpf.current_netns_cookie()


def entries_mentioning(root: str, cookie: int) -> dict[str, set[bytes]]:
    """Every key of every host map that belongs to the netns ``cookie`` (a full scan: tests only).
    Ports and CIDR keys of either generation (``pod_keys``) are shown as the first's."""
    h = ebpf.host(root, load=False)
    assert h is not None
    c = abi.U64.pack(cookie)
    where = {"pods": 0, "inventory": 0, "ports": 0, "cidrs": 8, "listeners": 0}
    out: dict[str, set[bytes]] = {}
    for name, off in where.items():
        gens = (c, abi.U64.pack(cookie | abi.GEN_BIT)) if name in ("ports", "cidrs") else (c,)
        out[name] = {k[:off] + c + k[off + 8:] for k in h.maps[name].keys() if k[off : off + 8] in gens}
    for name in ("orig_by_cookie", "orig_by_tuple", "dns_by_cookie"):
        m = h.maps[name]
        out[name] = {k for k in m.keys() if (m.lookup(k) or b"")[:8] == c}
    return out


def test_teardown_removes_everything_of_that_pod_and_nothing_else(make_pod, setup_pod, bpf_root: str) -> None:
    a, b = make_pod(), make_pod()
    lists = [_proxy_listeners(p, 15006, "in") for p in (a, b)]
    cfg = RedirectConfig(outbound_exclude_ports=(22,), outbound_exclude_cidrs=("10.255.0.0/16", "fd00:ffff::/32"),
                         dns_capture=True)
    ca, cb = _cookie(a), _cookie(b)
    held: list[socket.socket] = []
    try:
        setup_pod(a, cfg)
        setup_pod(b, cfg)
        # Some per-connection state too: an outbound connection through the proxy in each pod. The
        # other pod's stays open across the teardown (a closing one drops its entries in its own
        # time); this pod's is closed, and its entries gone, before (those of a live connection
        # stay with it).
        for p in (a, b):
            lst = netkit.in_netns(p.name, lambda: socket.create_server(("0.0.0.0", 15001)))
            held.append(lst)
            held.append(netkit.connect_as(p.name, p.peer_ip4, 8080, APP_UID))
            lst.settimeout(10)
            held.append(lst.accept()[0])
        have_a, have_b = entries_mentioning(bpf_root, ca), entries_mentioning(bpf_root, cb)
        for name in ("pods", "inventory", "ports", "cidrs", "listeners", "orig_by_tuple"):
            assert have_a[name] and have_b[name], name
        for x in held[:3]:
            x.close()
        deadline = time.monotonic() + 20
        while entries_mentioning(bpf_root, ca)["orig_by_tuple"]:
            assert time.monotonic() < deadline, "a closed connection's entries stayed"
            time.sleep(0.05)
        before = api.show(b.name, backend="ebpf")
        assert api.teardown(a.name, backend="ebpf")
        left = entries_mentioning(bpf_root, ca)
        assert not any(left.values()), {k: len(v) for k, v in left.items() if v}
        assert entries_mentioning(bpf_root, cb) == have_b, "the other pod's entries are untouched"
        shown = api.show(a.name, backend="ebpf")
        assert not shown["installed"] and not shown["ports"] and not shown["cidrs"] and not shown["addresses"]
        assert shown["sk_lookup_link"] is None
        assert not os.listdir(os.path.join(bpf_root, "pods")) or all(
            str(shown["netns_cookie"]) not in n for n in os.listdir(os.path.join(bpf_root, "pods")))
        assert api.show(b.name, backend="ebpf") == before
        assert api.check(b.name, cfg, backend="ebpf").ok
        assert not api.check(a.name, cfg, backend="ebpf").ok
        assert landing(b.peer_name, b.pod_ip4, 8080, *lists[1]).listener in lists[1]
        assert not api.teardown(a.name, backend="ebpf"), "second teardown removes nothing"
    finally:
        for x in held:
            x.close()
        _close(*lists)


def _conn_entries(root: str, cookie: int) -> dict[str, int]:
    """How many entries of the netns ``cookie`` the per-connection maps hold (their keys start with it)."""
    h = ebpf.host(root, load=False)
    assert h is not None
    c = abi.U64.pack(cookie)
    return {name: sum(1 for k in h.maps[name].keys() if k[:8] == c) for name in ("orig_by_tuple", "local_conns")}


def _conn_entries_left(root: str, cookie: int) -> dict[str, int]:
    """``_conn_entries`` once they are gone (the close callbacks run as the handshakes end), or after 3 s."""
    deadline = time.monotonic() + 3
    while any(left := _conn_entries(root, cookie)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {k: v for k, v in left.items() if v}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_connections_entries_go_when_it_closes(pod: Pod, setup_pod, bpf_root: str, family: int) -> None:
    """sock_ops' close callback: a redirected connection's original destination (orig_by_tuple) goes
    with it whichever side closes first, and with a refused one; the local end of a connection made
    in the pod to the pod from a foreign source (local_conns) goes with that connection."""
    fam = socket.AF_INET if family == 4 else socket.AF_INET6
    cookie = _cookie(pod)
    setup_pod(pod, OUT_ONLY)
    dst = (pod.peer_ip(family), 8080)

    def redirected(first: str) -> dict[str, int]:
        with socket.socket(fam, socket.SOCK_STREAM) as lst:
            lst.bind(("0.0.0.0" if family == 4 else "::", 15001))
            lst.listen(4)
            app = socket.create_connection(dst, timeout=2)
            proxy, _ = lst.accept()
            with app, proxy:
                assert netkit.original_dst(proxy) == dst
                had = _conn_entries(bpf_root, cookie)
                (app if first == "app" else proxy).close()
        return had

    def refused() -> None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(dst, timeout=2)  # (nothing listens on 15001)

    def transparent() -> dict[str, int]:
        with socket.socket(fam, socket.SOCK_STREAM) as s, socket.socket(fam, socket.SOCK_STREAM) as app:
            app.bind((pod.pod_ip(family), 8080))
            app.listen(4)
            s.setsockopt(*((netkit.SOL_IP, netkit.IP_TRANSPARENT) if family == 4 else
                           (netkit.SOL_IPV6, netkit.IPV6_TRANSPARENT)), 1)
            s.bind((pod.peer_ip(family), 0))
            s.setblocking(False)
            assert s.connect_ex((pod.pod_ip(family), 8080)) in (0, errno.EINPROGRESS)
            return _conn_entries(bpf_root, cookie)  # (no route back here: it never completes)

    for first in ("app", "proxy"):
        assert pod.run(redirected, first) == {"orig_by_tuple": 1, "local_conns": 0}, first
        assert _conn_entries_left(bpf_root, cookie) == {}, first
    pod.run(refused)
    assert _conn_entries_left(bpf_root, cookie) == {}
    assert pod.run(transparent) == {"orig_by_tuple": 0, "local_conns": 1}
    assert _conn_entries_left(bpf_root, cookie) == {}


def test_unregistered_netns_is_untouched(make_pod, setup_pod) -> None:
    """The host-wide programs are a no-op for a netns that is not registered."""
    registered, other = make_pod(), make_pod()
    setup_pod(registered, OUT_ONLY)
    proxy = _proxy_listeners(other, 15001, "proxy")
    app = [TcpListener(other.peer_name, 8080, label="app").start()]
    try:
        hit = landing(other.name, other.peer_ip4, 8080, *proxy, *app, uid=APP_UID)
        assert hit.listener is app[0]
        assert hit.orig_dst is None, "getsockopt(SO_ORIGINAL_DST) keeps the kernel's answer (no conntrack: error)"
    finally:
        _close(proxy, app)


def test_unload_host_refuses_while_pods_exist(pod: Pod, setup_pod, bpf_root: str) -> None:
    setup_pod(pod, OUT_ONLY)
    with pytest.raises(SetupError, match="still registered"):
        ebpf.unload_host(bpf_root)
    assert ebpf.HostPrograms.pinned(bpf_root)


@pytest.mark.parametrize("kw", [{"drop_invalid": True}], ids=lambda kw: "-".join(kw))
def test_unsupported_options_raise_backend_unavailable(pod: Pod, bpf_root: str, kw: dict) -> None:
    """What ``redirect.plan.intent.refusals`` says eBPF cannot lower: setup refuses it by name and
    installs nothing."""
    with pytest.raises(BackendUnavailable, match=next(iter(kw))):
        api.setup(pod.name, RedirectConfig(**kw), backend="ebpf")
    assert not api.show(pod.name, backend="ebpf")["installed"]
    assert not any(entries_mentioning(bpf_root, _cookie(pod)).values())


def test_check_reads_the_maps_back_and_setup_repairs(pod: Pod, setup_pod, bpf_root: str) -> None:
    cfg = RedirectConfig(outbound_exclude_ports=(9090,))
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 9090, label="app").start()]
    try:
        setup_pod(pod, cfg)
        assert landing(pod.name, pod.peer_ip4, 9090, *proxy, *app, uid=APP_UID).listener is app[0]
        h = ebpf.host(bpf_root, load=False)
        assert h is not None
        key = abi.PORT_KEY.pack(_cookie(pod), PORT_KIND["out_exclude"], 9090, 0)
        assert h.maps["ports"].delete(key)  # someone else's hand
        res = api.check(pod.name, cfg, backend="ebpf")
        assert not res.ok and "missing port entry outbound-exclude 9090" in res.differences, res.differences
        assert landing(pod.name, pod.peer_ip4, 9090, *proxy, *app, uid=APP_UID).listener in proxy
        assert api.setup(pod.name, cfg, backend="ebpf").changed
        assert api.check(pod.name, cfg, backend="ebpf").ok
        assert landing(pod.name, pod.peer_ip4, 9090, *proxy, *app, uid=APP_UID).listener is app[0]
    finally:
        _close(proxy, app)


@pytest.fixture
def scratch_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A root of its own for tests that break the host pins (compiles once more)."""
    with bpfroot.scratch_root(monkeypatch, "ebpf-scratch") as root:
        yield root


def test_a_removed_link_pin_is_repaired_by_the_next_setup(pod: Pod, scratch_root: str) -> None:
    h = ebpf.host(scratch_root)
    assert h is not None
    ids = {n: syscalls.prog_id(fd) for n, fd in h.progs.items()}
    os.unlink(os.path.join(scratch_root, "links", "rdr_connect4"))  # detaches: outbound IPv4 is off
    assert ebpf.missing_pins(scratch_root) == ["links/rdr_connect4"]
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 8080, label="app").start()]
    try:
        res = api.setup(pod.name, OUT_ONLY, backend="ebpf")
        assert res.detail["compiled"] is False
        assert not ebpf.missing_pins(scratch_root)
        h2 = ebpf.host(scratch_root)
        assert h2 is not None and {n: syscalls.prog_id(fd) for n, fd in h2.progs.items()} == ids
        assert landing(pod.name, pod.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener in proxy
    finally:
        _close(proxy, app)
        api.teardown(pod.name, backend="ebpf")


def test_a_removed_map_pin_reloads_when_no_pod_is_registered_else_fails_clearly(make_pod, scratch_root: str) -> None:
    a, b = make_pod(), make_pod()
    api.setup(a.name, OUT_ONLY, backend="ebpf")
    try:
        os.unlink(os.path.join(scratch_root, "maps", "cidrs"))
        with pytest.raises(SetupError, match=r"incomplete \(missing: maps/cidrs\) while 1 pod\(s\) are registered"):
            api.setup(b.name, OUT_ONLY, backend="ebpf")
        assert api.show(b.name, backend="ebpf")["installed"] is False
    finally:
        ebpf.force_unload_host(scratch_root)
    # No pod left: a partial set of pins is replaced by a clean load.
    ebpf.host(scratch_root)
    os.unlink(os.path.join(scratch_root, "progs", "rdr_sk_lookup"))
    proxy = _proxy_listeners(b, 15001, "proxy")
    app = [TcpListener(b.peer_name, 8080, label="app").start()]
    try:
        res = api.setup(b.name, OUT_ONLY, backend="ebpf")
        assert res.detail["compiled"] is True and not ebpf.missing_pins(scratch_root)
        assert landing(b.name, b.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener in proxy
    finally:
        _close(proxy, app)
        api.teardown(b.name, backend="ebpf")


def test_check_fails_while_any_host_link_is_missing_or_detached(pod: Pod, scratch_root: str) -> None:
    """Every pod depends on every cgroup link: without one (its pin removed, or detached) part of the
    capture is off, and check says which; the next setup re-creates a missing one."""
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 8080, label="app").start()]
    try:
        api.setup(pod.name, OUT_ONLY, backend="ebpf")
        assert api.check(pod.name, OUT_ONLY, backend="ebpf").ok
        link = os.path.join(scratch_root, "links", "rdr_connect4")
        os.unlink(link)
        # The kernel frees the unpinned link when it evicts the bpffs inode, which it may defer:
        # probe until the app gets the connection, bounded.
        deadline = time.monotonic() + 5.0
        while (got := landing(pod.name, pod.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener) is not app[0]:
            assert got in proxy, got
            assert time.monotonic() < deadline, "outbound still captured 5 s after the link pin went"
            time.sleep(0.05)
        res = api.check(pod.name, OUT_ONLY, backend="ebpf")
        assert not res.ok and any(link in d and "missing" in d for d in res.differences), res.differences
        api.setup(pod.name, OUT_ONLY, backend="ebpf")
        assert api.check(pod.name, OUT_ONLY, backend="ebpf").ok
        assert landing(pod.name, pod.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener in proxy
        for name in objects.CGROUP_PROGRAMS:
            link = os.path.join(scratch_root, "links", name)
            fd = syscalls.obj_get(link)
            try:  # detached, pin left in place
                assert syscalls.NATIVE.lib.rdr_bpf_link_detach(fd) == 0
            finally:
                os.close(fd)
            res = api.check(pod.name, OUT_ONLY, backend="ebpf")
            assert not res.ok and any(link in d and "detached" in d for d in res.differences), (name, res)
            os.unlink(link)
            res = api.check(pod.name, OUT_ONLY, backend="ebpf")
            assert not res.ok and any(link in d and "missing" in d for d in res.differences), (name, res)
            api.setup(pod.name, OUT_ONLY, backend="ebpf")
            assert api.check(pod.name, OUT_ONLY, backend="ebpf").ok, name
    finally:
        _close(proxy, app)
        api.teardown(pod.name, backend="ebpf")


@pytest.mark.parametrize("gone", [("maps/pods",), ("maps/pods", "maps/inventory", "progs/rdr_sk_lookup",
                                                   "progs/rdr_connect4")])
def test_teardown_without_map_pins_removes_the_pod_still_captured(pod: Pod, scratch_root: str,
                                                                  gone: tuple[str, ...]) -> None:
    """Pins removed by hand while a pod is captured: check fails naming them, show and teardown find the
    pod through what is still attached, and after the teardown nothing of it captures."""
    inbound = _proxy_listeners(pod, 15006, "in")
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 8080, label="app").start(), TcpListener(pod.name, 4000, label="local").start()]
    try:
        api.setup(pod.name, RedirectConfig(), backend="ebpf")
        for g in gone:
            os.unlink(os.path.join(scratch_root, g))
        res = api.check(pod.name, RedirectConfig(), backend="ebpf")
        assert not res.ok
        for g in gone:
            assert any(os.path.join(scratch_root, g) in d for d in res.differences), (g, res.differences)
        assert api.show(pod.name, backend="ebpf")["installed"] is True
        assert landing(pod.name, pod.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener in proxy, "still captured"
        assert landing(pod.peer_name, pod.pod_ip4, 4000, *inbound, *app).listener in inbound
        assert api.teardown(pod.name, backend="ebpf") is True
        assert api.show(pod.name, backend="ebpf")["installed"] is False
        assert landing(pod.name, pod.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener is app[0]
        assert landing(pod.peer_name, pod.pod_ip4, 4000, *inbound, *app).listener is app[1]
        assert api.teardown(pod.name, backend="ebpf") is False
        # No pod is registered any more: the next setup replaces the partial pins with a clean load.
        res2 = api.setup(pod.name, OUT_ONLY, backend="ebpf")
        assert res2.detail["compiled"] is True and not ebpf.missing_pins(scratch_root)
        assert api.check(pod.name, OUT_ONLY, backend="ebpf").ok
    finally:
        _close(inbound, proxy, app)
        api.teardown(pod.name, backend="ebpf")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
t0 = time.perf_counter()
from redirect import api
from redirect.backends import ebpf
from redirect.backends.ebpf import abi
from redirect.backends.ebpf.host import objects, pod_link, syscalls
from redirect.backends.ebpf.pod.entries import policy_core
from redirect.config import RedirectConfig
res = api.setup({ns!r}, RedirectConfig(inbound_ports=()), backend="ebpf")
ms = (time.perf_counter() - t0) * 1e3
h = ebpf.host()
print(json.dumps({{"compiled": h.compiled, "detail": res.detail, "ms": ms,
                  "ids": {{n: syscalls.prog_id(fd) for n, fd in h.progs.items()}}}}))
"""


def test_pinned_programs_reused_by_a_second_process(pod: Pod, bpf_root: str) -> None:
    h = ebpf.host(bpf_root)
    assert h is not None
    ids = {n: syscalls.prog_id(fd) for n, fd in h.progs.items()}
    code = CHILD.format(repo=REPO, ns=pod.name)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "REDIRECT_BPF_ROOT": bpf_root}, check=False)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"second process: setup in {out['ms']:.1f} ms incl. imports, pod part {out['detail']['pod_ms']} ms,"
              f" compiled={out['compiled']}")
        assert out["compiled"] is False and out["detail"]["compiled"] is False
        assert out["ids"] == ids, "the same pinned programs, not new ones"
    finally:
        api.teardown(pod.name, backend="ebpf")


def test_native_bpf_helpers_report_errno(bpf_root: str) -> None:
    with pytest.raises(OSError) as e:
        syscalls.obj_get(os.path.join(bpf_root, "no-such-pin"))
    assert e.value.errno == 2
    h = ebpf.host(bpf_root)
    assert h is not None
    m = h.maps["ports"]
    key = abi.PORT_KEY.pack(0xFFFF_FFFF_FFFF_0001, PORT_KIND["out_exclude"], 1, 0)  # a cookie no netns has
    try:
        m.update(key, b"\x01")
        assert m.lookup(key) == b"\x01"
        assert key in set(m.keys())
    finally:
        assert m.delete(key)
    assert m.lookup(key) is None and not m.delete(key)


def test_a_removed_pod_link_pin_is_reported_and_repaired(pod: Pod, setup_pod, bpf_root: str) -> None:
    inbound = _proxy_listeners(pod, 15006, "in")
    app = [TcpListener(pod.name, 8080, label="app").start()]
    try:
        setup_pod(pod, RedirectConfig())
        link = os.path.join(bpf_root, "pods", f"{_cookie(pod)}-sk_lookup")
        os.unlink(link)  # the last reference: the link is gone, inbound is not steered any more
        # The kernel frees the unpinned link when it evicts the bpffs inode, which it may defer:
        # probe until the app gets the connection, bounded.
        deadline = time.monotonic() + 5.0
        while (got := landing(pod.peer_name, pod.pod_ip4, 8080, *inbound, *app).listener) is not app[0]:
            assert got in inbound, got
            assert time.monotonic() < deadline, "inbound still steered 5 s after the link pin went"
            time.sleep(0.05)
        res = api.check(pod.name, RedirectConfig(), backend="ebpf")
        assert not res.ok and "no sk_lookup link on this netns" in res.differences, res.differences
        assert api.setup(pod.name, RedirectConfig(), backend="ebpf").changed
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
        assert landing(pod.peer_name, pod.pod_ip4, 8080, *inbound, *app).listener in inbound
    finally:
        _close(inbound, app)


def test_an_address_added_after_setup_is_reported_until_setup_runs_again(pod: Pod, setup_pod) -> None:
    setup_pod(pod, RedirectConfig())
    extra = "10.254.254.9"
    subprocess.run(["ip", "-n", pod.name, "addr", "add", f"{extra}/32", "dev", "lo"], check=True)
    subprocess.run(["ip", "-n", pod.name, "addr", "add", "10.254.253.9/32", "dev", pod.main.pod_if], check=True)
    res = api.check(pod.name, RedirectConfig(), backend="ebpf")
    assert not res.ok
    assert "missing CIDR entry local 10.254.253.9/32" in res.differences, res.differences
    assert "missing CIDR entry local 10.254.254.9/32" in res.differences, res.differences
    assert api.setup(pod.name, RedirectConfig(), backend="ebpf").changed
    assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok


def test_ebpf_lands_every_probe_where_iptables_does(make_pod, bpf_root: str) -> None:
    """Differential, as tests/test_nftables_diff.py for nftables: hypothesis draws configs the eBPF
    backend supports; a probe matrix (app / proxy uid / excluded owner group, ports, CIDRs,
    inbound, DNS over UDP and TCP, IPv4 and IPv6) must land on the same listener with the same
    original destination in a pod set up with ``backend="iptables"`` and one with ``"ebpf"``.

    One documented difference is normalised: a connection steered to the proxy's inbound port by
    sk_lookup (or, arriving on a reroute interface, to its outbound port) keeps its original
    destination as the local address (iptables' REDIRECT makes it ``<pod ip>:15006``, or
    ``:15001``); the original destination read with ``SO_ORIGINAL_DST`` is compared.
    """
    from hypothesis import HealthCheck, given, settings

    from tests import test_nftables_diff as diff


    def matrix(pod: Pod) -> dict[str, Any]:
        """diff.matrix plus the pod talking to itself: own pod IP, loopback, inbound passthrough."""
        out = diff.matrix(pod, ls[pod.name])
        names = {pod.pod_ip4: "POD4", pod.pod_ip6: "POD6"}
        for fam in (4, 6):
            lo, src = ("127.0.0.1", "127.0.0.6") if fam == 4 else ("::1", "::6")
            for key, ip, port, kw in (
                ("self app", pod.pod_ip(fam), 8080, {"uid": APP_UID}),
                ("self proxy", pod.pod_ip(fam), 8080, {"uid": PROXY_UID}),
                ("self proxy tunnel", pod.pod_ip(fam), 15008, {"uid": PROXY_UID}),
                ("loopback app", lo, 9090, {"uid": APP_UID}),
                ("loopback proxy", lo, 9090, {"uid": PROXY_UID}),
                ("passthrough", pod.pod_ip(fam), 8080, {"uid": PROXY_UID, "src": src}),
            ):
                hit = landing(pod.name, ip, port, *ls[pod.name], timeout=1.0, **kw)
                lab = hit.listener.label if hit.listener else hit.result.error
                orig = hit.orig_dst if lab is not None and lab.startswith(("proxy", "dns")) else None
                out[f"{key} v{fam}"] = (lab, None if orig is None else (names.get(orig[0], orig[0]), orig[1]),
                                       None)
        return out

    def norm(m: dict[str, Any]) -> dict[str, Any]:
        return {k: (lab, orig, None if lab == "proxy-in" or (k.startswith("in ") and lab == "proxy-out") else local)
                for k, (lab, orig, local) in m.items()}

    with diff.iptables_and_ebpf_pods(make_pod) as (ipt, bpf, ls):
        seen: list[dict[str, Any]] = []
        labels: set[str] = set()

        @settings(max_examples=15, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(spec=diff.ebpf_specs)
        def example(spec: dict[str, Any]) -> None:
            api.setup(ipt.name, diff.config_for(spec, ipt), backend="iptables")
            api.setup(bpf.name, diff.config_for(spec, bpf), backend="ebpf")
            for group in ls.values():
                for lst in group:
                    lst.clear()
            seen.append(spec)
            got_ipt, got_bpf = (norm(m) for m in diff.both(matrix, (ipt, bpf)))
            labels.update(v[0] for v in got_bpf.values())
            diffs = {k: (got_ipt[k], got_bpf[k]) for k in got_ipt if got_ipt[k] != got_bpf[k]}
            assert not diffs, f"iptables vs ebpf differ for {spec}: {diffs}"

        example()
        print(f"iptables vs ebpf: {len(seen)} configs, {len(seen) * 40} probes each side, labels {sorted(labels)}")
        assert len(seen) >= 10, f"only {len(seen)} configs were compared"
        assert {"proxy-out", "proxy-in", "dns-tcp", "dns-udp", "remote-80", "pod-15008"} <= labels, labels


@pytest.mark.parametrize("order", ["proxy-first", "setup-first"])
def test_setup_again_changes_nothing_whichever_families_the_proxy_listens_on(pod: Pod, setup_pod, order: str) -> None:
    """An IPv4-only proxy (no IPv6 listener ever) does not make every setup a change or a rescan."""
    proxy = None
    try:
        if order == "proxy-first":
            proxy = TcpListener(pod.name, 15006, family=4, label="in4").start()
        assert setup_pod(pod, RedirectConfig()).changed
        if proxy is None:
            proxy = TcpListener(pod.name, 15006, family=4, label="in4").start()
        assert api.show(pod.name, backend="ebpf")["inbound_listeners"] == ["IPv4"]
        assert api.setup(pod.name, RedirectConfig(), backend="ebpf").changed is False
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
        assert landing(pod.peer_name, pod.pod_ip4, 8080, proxy).listener is proxy
    finally:
        if proxy is not None:
            proxy.close()


def test_without_the_pods_map_pin_setup_and_unload_refuse_while_pods_are_registered(
    pod: Pod, scratch_root: str
) -> None:
    api.setup(pod.name, OUT_ONLY, backend="ebpf")
    os.unlink(os.path.join(scratch_root, "maps", "pods"))
    # Counted by their link pins (every pod has one).
    with pytest.raises(SetupError, match=r"missing: maps/pods\) while 1 pod\(s\) are registered"):
        api.setup(pod.name, OUT_ONLY, backend="ebpf")
    with pytest.raises(SetupError, match="force=True"):
        ebpf.unload_host(scratch_root)
    # The registered pod is still captured by the attached programs (nothing was reloaded).
    proxy = _proxy_listeners(pod, 15001, "proxy")
    app = [TcpListener(pod.peer_name, 8080, label="app").start()]
    try:
        assert landing(pod.name, pod.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener in proxy
    finally:
        _close(proxy, app)
    assert ebpf.unload_host(scratch_root, force=True)


def test_a_forced_unload_takes_the_tc_filters_off_a_live_pod_that_forwards(pod: Pod, scratch_root: str) -> None:
    """A pod that forwards has our tc filters (they are not pinned: they live in its netns, with the
    programs they run); a forced unload with the pod still registered finds its netns and takes them
    off, and no program of ours stays loaded for them."""
    netkit.set_forwarding(pod.name, True)
    api.setup(pod.name, RedirectConfig(), backend="ebpf")
    assert netkit.tc_filters(pod.name, "eth0") == netkit.OUR_TC
    ids = {ebpf_prog_id(scratch_root, n) for n in ("rdr_tc_ingress", "rdr_tc_egress")}
    assert ebpf.unload_host(scratch_root, force=True)
    assert netkit.tc_filters(pod.name, "eth0") == {"ingress": [], "egress": []}
    assert "clsact" not in netkit.qdisc_kinds(pod.name, "eth0")
    # (A filter's program is put after an RCU grace period and the classifier's work queue.)
    deadline = time.monotonic() + 10
    while True:
        out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
        left = ids & {int(p["id"]) for p in json.loads(out or "[]")}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"tc programs still loaded: {left}"


def ebpf_prog_id(root: str, name: str) -> int:
    """The id of the host program ``name`` pinned under ``root``."""
    fd = syscalls.obj_get(os.path.join(root, "progs", name))
    try:
        return syscalls.prog_id(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["iptables-nft", "ebpf"])
def test_the_app_sees_the_peer_it_connected_to(pod: Pod, bpf_root: str, backend: str, family: int) -> None:
    """getpeername after a captured connect names the original destination (TCP and connected UDP DNS),
    as through iptables' NAT: the app can't tell it was redirected."""
    server = pod.peer_ip(family)
    cfg = RedirectConfig(inbound_ports=(), dns_capture=True, capture_all_dns=True)
    ls = [TcpListener(pod.name, 15001, family=family, label="proxy").start(),
          UdpListener(pod.name, 15053, family=family, label="dns").start()]
    api.setup(pod.name, cfg, backend=backend)
    try:
        def peers() -> dict[str, object]:
            af = socket.AF_INET if family == 4 else socket.AF_INET6
            out: dict[str, object] = {}
            with socket.socket(af, socket.SOCK_STREAM) as t:
                t.settimeout(2)
                t.connect((server, 8080))
                out["tcp"] = list(t.getpeername()[:2])
            with socket.socket(af, socket.SOCK_DGRAM) as u:
                u.connect((server, 53))
                out["udp"] = list(u.getpeername()[:2])
            return out

        got = netkit.in_child(pod.name, APP_UID, APP_UID, 3.0, peers)
        assert got.get("tcp") == [server, 8080], got
        assert got.get("udp") == [server, 53], got
        assert ls[0].wait_for(1, timeout=2.0), "the TCP connection was captured"  # recorded by its thread
    finally:
        api.teardown(pod.name, backend=backend)
        _close(ls)


def test_pins_of_other_sources_are_replaced_once_no_pod_uses_them(pod: Pod, scratch_root: str) -> None:
    """An upgrade of redirect/bpf/ (here: the build pin renamed, as an older build would have it)."""
    api.setup(pod.name, OUT_ONLY, backend="ebpf")
    mine = os.path.join(scratch_root, "maps", f"build-{ebpf.build_id()}")
    os.rename(mine, os.path.join(scratch_root, "maps", "build-000000000000"))
    with pytest.raises(SetupError, match=rf"missing: maps/build-{ebpf.build_id()}\) while 1 pod"):
        api.setup(pod.name, RedirectConfig(), backend="ebpf")
    assert api.teardown(pod.name, backend="ebpf")  # teardown still works on the old pins
    res = api.setup(pod.name, OUT_ONLY, backend="ebpf")
    assert res.detail["compiled"] is True and not ebpf.missing_pins(scratch_root)
    assert sorted(n for n in os.listdir(os.path.join(scratch_root, "maps")) if n.startswith("build-")) == [
        f"build-{ebpf.build_id()}"]
    api.teardown(pod.name, backend="ebpf")


def test_pods_whose_netns_went_without_teardown_are_collected(make_pod, bpf_root: str) -> None:
    """Their entries, sk_lookup links and pool slots go (one of them forwarding, with our tc
    filters: they went with its interfaces, and its slot, which they named, is free again)."""
    gone_in, gone_out, live = make_pod(extra_iface=True), make_pod(), make_pod()
    netkit.set_forwarding(gone_in.name, True)
    cfgs = {gone_in.name: RedirectConfig(reroute_interfaces=("eth1",)), gone_out.name: OUT_ONLY,
            live.name: RedirectConfig()}
    for p in (gone_in, gone_out, live):
        api.setup(p.name, cfgs[p.name], backend="ebpf")
    cookies = [_cookie(p) for p in (gone_in, gone_out, live)]
    keep = entries_mentioning(bpf_root, cookies[2])
    assert netkit.tc_filters(gone_in.name, "eth1") == netkit.OUR_TC
    try:
        for p in (gone_in, gone_out):  # a DEL that never came: the runtime just removed the netns
            netkit.remove_netns(p.name)
            netkit.remove_netns(p.peer_name)
        for c in cookies[:2]:
            wait_link_detached(bpf_root, c)
        assert sorted(ebpf.collect_garbage(bpf_root)) == sorted(cookies[:2])
        for c in cookies[:2]:
            left = entries_mentioning(bpf_root, c)
            assert not any(left.values()), {k: len(v) for k, v in left.items() if v}
            assert not os.path.exists(pod_link(bpf_root, c))
        assert entries_mentioning(bpf_root, cookies[2]) == keep
        assert api.check(live.name, RedirectConfig(), backend="ebpf").ok
        assert ebpf.collect_garbage(bpf_root) == []
    finally:
        api.teardown(live.name, backend="ebpf")


def _give_address(pod: Pod, ip: str) -> None:
    """``ip`` on the pod's interface, routed to it from its peer (the IPAM gave it that address too)."""
    subprocess.run(["ip", "-n", pod.name, "addr", "add", f"{ip}/32", "dev", pod.main.pod_if], check=True)
    subprocess.run(["ip", "-n", pod.peer_name, "route", "add", f"{ip}/32", "dev", pod.main.peer_if], check=True)


def test_a_pod_with_the_address_of_one_gone_without_teardown_follows_its_own_policy(
    make_pod, bpf_root: str
) -> None:
    """Pod A (inbound capture of every port) loses its netns without a teardown; B gets A's IP with no
    inbound capture: a peer's connection to B's app lands on the app, and check says ok. The dead
    pod's entries are the garbage collector's, not in B's way."""
    old, new = make_pod(), make_pod()
    api.setup(old.name, RedirectConfig(), backend="ebpf")
    c_old, ip = _cookie(old), old.pod_ip4
    netkit.remove_netns(old.name)
    netkit.remove_netns(old.peer_name)
    wait_link_detached(bpf_root, c_old)
    _give_address(new, ip)
    cfg = RedirectConfig(inbound_ports=())
    app = TcpListener(new.name, 4000, label="app").start()
    try:
        api.setup(new.name, cfg, backend="ebpf")
        hit = landing(new.peer_name, ip, 4000, app, timeout=2.0)
        assert hit.listener is app, hit.result
        assert api.check(new.name, cfg, backend="ebpf").ok
        assert ip in api.show(new.name, backend="ebpf")["addresses"]
        assert ebpf.collect_garbage(bpf_root) == [c_old]
        assert not any(entries_mentioning(bpf_root, c_old).values())
        assert landing(new.peer_name, ip, 4000, app, timeout=2.0).listener is app
    finally:
        app.close()
        api.teardown(new.name, backend="ebpf")


def test_two_live_pods_with_one_address_each_follow_their_own_policy(make_pod, bpf_root: str) -> None:
    """The same IP in two separate pod networks, with different policies: inbound and outbound, each
    pod's traffic follows its own (the sk_lookup program knows the netns, not only the address)."""
    a, b = make_pod(), make_pod()
    ip = a.pod_ip4
    _give_address(b, ip)
    cfg_a = RedirectConfig()  # inbound capture of every port, outbound captured
    cfg_b = RedirectConfig(inbound_ports=(), outbound_exclude_ports=(8080,))
    ls: list[TcpListener] = []
    try:
        in_a = TcpListener(a.name, 15006, label="a-proxy-in").start()
        out_a = TcpListener(a.name, 15001, label="a-proxy-out").start()
        out_b = TcpListener(b.name, 15001, label="b-proxy-out").start()
        ls += [in_a, out_a, out_b]
        app_a = TcpListener(a.name, 4000, label="a-app").start()
        app_b = TcpListener(b.name, 4000, label="b-app").start()
        peer_a = TcpListener(a.peer_name, 8080, label="a-peer").start()
        peer_b = TcpListener(b.peer_name, 8080, label="b-peer").start()
        ls += [app_a, app_b, peer_a, peer_b]
        api.setup(a.name, cfg_a, backend="ebpf")
        api.setup(b.name, cfg_b, backend="ebpf")
        for _ in range(2):  # whichever was set up last
            hit = landing(a.peer_name, ip, 4000, *ls, timeout=2.0)
            assert hit.listener is in_a and hit.orig_dst == (ip, 4000), hit.result
            assert landing(b.peer_name, ip, 4000, *ls, timeout=2.0).listener is app_b
            assert landing(a.name, a.peer_ip4, 8080, *ls, uid=APP_UID).listener is out_a
            assert landing(b.name, b.peer_ip4, 8080, *ls, uid=APP_UID).listener is peer_b
            api.setup(a.name, cfg_a, backend="ebpf")
        assert api.check(a.name, cfg_a, backend="ebpf").ok and api.check(b.name, cfg_b, backend="ebpf").ok
        api.teardown(a.name, backend="ebpf")  # B keeps its own
        assert landing(b.peer_name, ip, 4000, *ls, timeout=2.0).listener is app_b
        assert landing(a.peer_name, ip, 4000, *ls, timeout=2.0).listener is app_a
    finally:
        _close(ls)
        for p in (a, b):
            api.teardown(p.name, backend="ebpf")


def test_ebpf_cli_status_gc_and_unload(make_pod, scratch_root: str) -> None:
    """``redirect ebpf``: status lists the registered pods, unload refuses while there are any, gc drops
    the pod whose netns went without a teardown, then unload removes every pin."""
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "redirect.cli", "ebpf", *args], capture_output=True,
                              text=True, timeout=60, check=False)

    st = json.loads(cli("status", "--json").stdout)
    assert st == {"root": scratch_root, "build_id": ebpf.build_id(), "exists": False, "loaded": False,
                  "missing": [], "pods": []}
    live, gone = make_pod(), make_pod()
    for p in (live, gone):
        api.setup(p.name, OUT_ONLY, backend="ebpf")
    cookies = {_cookie(live), _cookie(gone)}
    try:
        st = json.loads(cli("status", "--json").stdout)
        assert st["loaded"] and set(st["pods"]) == cookies, st
        r = cli("unload")
        assert r.returncode == 1 and "2 pod(s) still registered" in r.stderr, r.stdout + r.stderr
        assert not ebpf.missing_pins(scratch_root), "a refused unload removed pins"
        c_gone = _cookie(gone)
        netkit.remove_netns(gone.name)
        netkit.remove_netns(gone.peer_name)
        wait_link_detached(scratch_root, c_gone)
        r = cli("gc")
        assert r.returncode == 0 and f"removed 1 pod(s) whose netns is gone: cookies [{c_gone}]" in r.stdout, r.stdout
        assert json.loads(cli("status", "--json").stdout)["pods"] == [_cookie(live)]
        os.unlink(os.path.join(scratch_root, "maps", "pods"))
        r = cli("status")
        assert r.returncode == 1 and "incomplete: missing maps/pods" in r.stdout, r.stdout
        r = cli("unload", "--force")
        assert r.returncode == 0 and "removed" in r.stdout, r.stdout + r.stderr
        assert not os.path.exists(scratch_root)
        assert "no host programs loaded" in cli("status").stdout
    finally:
        if os.path.exists(scratch_root):
            api.teardown(live.name, backend="ebpf")


def test_ipv6_follows_the_namespace_when_auto(pod: Pod, setup_pod) -> None:
    """The families come from the same netlink dump as the pod's addresses: IPv6 is on while the
    netns has an IPv6 address (disable_ipv6 removes them all); ``ipv6=True`` forces it."""
    assert setup_pod(pod, OUT_ONLY).families == (4, 6)
    assert "v6" in api.show(pod.name, backend="ebpf")["policy"].split("flags=")[1].split()[0]
    api.teardown(pod.name, backend="ebpf")
    subprocess.run(["ip", "netns", "exec", pod.name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], check=True)
    proxy = TcpListener(pod.name, 15001, family=4, label="proxy4").start()
    app = TcpListener(pod.peer_name, 8080, family=4, label="app").start()
    try:
        res = setup_pod(pod, OUT_ONLY)
        assert res.families == (4,)
        assert "v6" not in api.show(pod.name, backend="ebpf")["policy"].split("flags=")[1].split()[0]
        hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID)
        assert hit.listener is proxy and hit.orig_dst == (pod.peer_ip4, 8080), hit.result
        assert api.check(pod.name, OUT_ONLY, backend="ebpf").ok
        # Forcing IPv6 on writes the IPv6 policy anyway (the namespace will get IPv6 later).
        assert api.setup(pod.name, RedirectConfig(inbound_ports=(), ipv6=True), backend="ebpf").families == (4, 6)
    finally:
        proxy.close()
        app.close()


def _snapshot(pod: Pod, root: str) -> dict[str, Any]:
    """What the pod has of ours: its map keys (inventory values as sets), policy, link, ::6."""
    from redirect.kernel import netns as rn
    from redirect.kernel import routes

    h = ebpf.host(root, load=False)
    assert h is not None
    with rn.enter(pod.name):
        cookie = ebpf.current_netns_cookie()
        st = h.store.read(cookie)
        ours = routes.read_ours((6,)).addresses
    return {"keys": entries_mentioning(root, cookie), "entries": st.entries,
            "policy": None if st.policy is None else policy_core(st.policy),
            "link": os.path.exists(pod_link(root, cookie)), "addresses": ours}


FRESH_CONFIGS = {
    "defaults": RedirectConfig(),
    "outbound-only": OUT_ONLY,
    "lists": RedirectConfig(outbound_exclude_ports=(9000, 9001), outbound_exclude_cidrs=("10.9.0.0/16", "fd00:9::/64"),
                            outbound_cidrs=("10.0.0.0/8", "fd00::/8"), inbound_ports=(8080, 9090), dns_capture=True,
                            dns_servers=("10.96.0.10",), proxy_uids=(1337, 1338)),
    "ipv4-only": RedirectConfig(ipv6=False),
}


@pytest.mark.parametrize("name", sorted(FRESH_CONFIGS))
def test_a_fresh_pod_gets_from_the_native_path_what_the_general_path_writes(pod: Pod, bpf_root: str,
                                                                             name: str) -> None:
    """A pod with nothing of ours is set up in one native call (native/pod_setup.c); the result
    must be the general path's, key for key, and pass ``check``."""
    from redirect.kernel import netns as rn

    cfg = FRESH_CONFIGS[name]
    before = _snapshot(pod, bpf_root)
    res = api.setup(pod.name, cfg, backend="ebpf")
    try:
        assert res.detail["path"] == "fresh" and res.changed
        fresh = _snapshot(pod, bpf_root)
        assert fresh["policy"] is not None and fresh["link"]
        assert api.check(pod.name, cfg, backend="ebpf").ok
    finally:
        api.teardown(pod.name, backend="ebpf")
    assert _snapshot(pod, bpf_root) == before
    impl = ebpf.EbpfBackend(root=bpf_root)
    it = intent_for(cfg)
    try:
        with rn.enter(pod.name):
            families = impl.detect_families(it)
            gen = impl.apply(it, families)
        assert gen.detail["path"] == "general" and gen.families == res.families
        assert _snapshot(pod, bpf_root) == fresh
    finally:
        api.teardown(pod.name, backend="ebpf")


def test_a_pod_that_is_not_fresh_takes_the_general_path(pod: Pod, setup_pod) -> None:
    """Set up again (same or new config), or with the proxy already listening: the general path,
    which knows what is there (the native one backs off before changing anything)."""
    assert setup_pod(pod, RedirectConfig()).detail["path"] == "fresh"
    again = api.setup(pod.name, RedirectConfig(), backend="ebpf")
    assert again.detail["path"] == "general" and not again.changed
    other = api.setup(pod.name, OUT_ONLY, backend="ebpf")
    assert other.detail["path"] == "general" and other.changed
    assert api.check(pod.name, OUT_ONLY, backend="ebpf").ok
    api.teardown(pod.name, backend="ebpf")
    proxy = _proxy_listeners(pod, 15006, "proxy-in")
    try:
        res = setup_pod(pod, RedirectConfig())
        assert res.detail["path"] == "general"  # the native path saw the port held
        assert api.show(pod.name, backend="ebpf")["inbound_listeners"] == ["IPv4", "IPv6"]
    finally:
        _close(proxy)


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "127.0.0.1", "::1", "pod-v4", "pod-v6", "pod-link-local"])
def test_a_proxy_already_listening_is_found_however_it_is_bound(pod: Pod, setup_pod, bind: str) -> None:
    """Before it changes anything, the native call asks sock_diag whether a listener takes the
    inbound port at loopback or at a pod address (wildcard binds included; a link-local one, bound
    to its interface, asked there): one does, so the general path sets the pod up and registers
    it, and inbound lands on it."""
    family = 4 if bind in ("0.0.0.0", "127.0.0.1", "pod-v4") else 6
    host = pod.pod_ip(family) if bind.startswith("pod") else bind
    if bind == "pod-link-local":
        host = f"{link_local(pod.name, pod.pod_if)}%{pod.pod_if}"
    proxy = [TcpListener(pod.name, 15006, family=family, host=host, label="proxy").start()]
    app = [TcpListener(pod.name, 8080, family=family, label="app").start()]
    try:
        assert setup_pod(pod, RedirectConfig()).detail["path"] == "general"
        hit = landing(pod.peer_name, pod.pod_ip(family), 8080, *proxy, *app)
        assert hit.listener is proxy[0], hit.result
    finally:
        _close(proxy, app)


@pytest.mark.parametrize("inbound", ["inbound", "no-inbound"])
@pytest.mark.parametrize("path", ["fresh", "general"])
def test_v6_passthrough_is_one_of_the_pods_own_addresses_only_while_it_is_there(
        pod: Pod, bpf_root: str, setup_pod, path: str, inbound: str) -> None:
    """``::6`` on lo is a local address of the pod (a connect to it leaves over lo) once setup
    added it, for a pod with IPv6 of its own, with inbound capture or without (as istio-iptables
    adds it); in one without, there is no ``::6`` and no entry for it. Both the native call and
    the general path (a second setup) write the same."""
    cfg = RedirectConfig() if inbound == "inbound" else OUT_ONLY
    local6 = abi.CIDR_KEY.pack(96 + 128, CIDR_KIND["local6"], _cookie(pod), socket.inet_pton(socket.AF_INET6, "::6"))
    ip6 = ["ip", "-n", pod.name, "-6", "addr"]
    own = [f"{pod.pod_ip6}/64", "dev", pod.pod_if]
    for has_v6 in (True, False):
        subprocess.run([*ip6, "add" if has_v6 else "del", *own, *(["nodad"] if has_v6 else [])],
                       check=has_v6 is False)
        if path == "general":
            setup_pod(pod, RedirectConfig(inbound_ports=(8080,)))  # the next one finds a policy
        res = setup_pod(pod, cfg)
        assert res.detail["path"] == path, res.detail
        assert (local6 in entries_mentioning(bpf_root, _cookie(pod))["cidrs"]) is has_v6
        on_lo = subprocess.run(["ip", "-n", pod.name, "-6", "-o", "addr", "show", "dev", "lo"],
                               capture_output=True, text=True, check=True).stdout
        assert (" ::6/128 " in on_lo) is has_v6
        assert api.check(pod.name, cfg, backend="ebpf").ok
        api.teardown(pod.name, backend="ebpf")


def test_a_pod_with_many_addresses_has_them_all_registered_and_one_with_too_many_is_refused(
        pod: Pod, bpf_root: str, setup_pod) -> None:
    """Every address of a pod is one of its own for capture (here 100 more IPv6 ones, set up by the
    one native call, whose listener check asks for them all at once); a pod with more than the
    backend registers (RDR_SCAN_MAX) is refused with an error that says so, nothing installed."""
    prefix = pod.pod_ip6.rsplit(":", 1)[0]
    extra = [f"{prefix}:{0x100 + i:x}" for i in range(100)]
    batch = "".join(f"address add {a}/128 dev {pod.pod_if} nodad\n" for a in extra)
    subprocess.run(["ip", "-n", pod.name, "-batch", "-"], input=batch, text=True, check=True)
    proxy = [TcpListener(pod.name, 15006, family=6, label="proxy")]
    app = [TcpListener(pod.name, 8080, family=6, label="app")]
    try:
        assert setup_pod(pod, RedirectConfig()).detail["path"] == "fresh"
        for t in proxy + app:
            t.start()
        hit = landing(pod.peer_name, extra[-1], 8080, *proxy, *app)
        assert hit.listener is proxy[0], hit.result
    finally:
        _close(proxy, app)
    api.teardown(pod.name, backend="ebpf")
    most = syscalls.NATIVE.lib.RDR_SCAN_MAX
    more = [f"{prefix}:{0x1000 + i:x}" for i in range(most)]
    batch = "".join(f"address add {a}/128 dev {pod.pod_if} nodad\n" for a in more)
    subprocess.run(["ip", "-n", pod.name, "-batch", "-"], input=batch, text=True, check=True)
    before = _snapshot(pod, bpf_root)
    with pytest.raises(SetupError, match=f"more than {most} addresses"):
        api.setup(pod.name, RedirectConfig(), backend="ebpf")
    assert _snapshot(pod, bpf_root) == before


def test_our_own_address_does_not_count_against_the_pods_addresses(pod: Pod, bpf_root: str) -> None:
    """A pod with exactly RDR_SCAN_MAX addresses of its own (its IPv4 one, its link-local one and
    254 other IPv6 ones) is set up, which adds ``::6`` on lo; that address of ours does not count
    against the limit: check and the same setup again work (they failed naming the limit)."""
    most = syscalls.NATIVE.lib.RDR_SCAN_MAX
    prefix = pod.pod_ip6.rsplit(":", 1)[0]
    more = [f"{prefix}:{0x1000 + i:x}" for i in range(most - 3)]  # (+ its IPv4, IPv6 and link-local ones)
    batch = "".join(f"address add {a}/128 dev {pod.pod_if} nodad\n" for a in more)
    subprocess.run(["ip", "-n", pod.name, "-batch", "-"], input=batch, text=True, check=True)
    try:
        assert api.setup(pod.name, RedirectConfig(), backend="ebpf").changed
        out = subprocess.run(["ip", "-n", pod.name, "-6", "addr", "show", "dev", "lo"], capture_output=True,
                             text=True, check=True).stdout
        assert "::6/128" in out
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
        api.setup(pod.name, RedirectConfig(), backend="ebpf")
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
    finally:
        api.teardown(pod.name, backend="ebpf")


def test_an_address_whose_dad_failed_is_not_the_pods(pod: Pod, bpf_root: str) -> None:
    """An IPv6 address the pod adds after its own, whose duplicate address detection fails (its
    peer has it), is listed first but is not the pod's: it is neither its source (the policy's
    sources name the pod's address) nor one of its addresses for capture, on the fresh-pod call
    and the general path alike, and check agrees."""
    dup = pod.pod_ip6.rsplit(":", 1)[0] + ":99"
    subprocess.run(["ip", "-n", pod.peer_name, "addr", "add", f"{dup}/64", "dev", pod.peer_if, "nodad"], check=True)
    subprocess.run(["ip", "netns", "exec", pod.name, "sysctl", "-qw", f"net.ipv6.conf.{pod.pod_if}.accept_dad=1"],
                   check=True)  # (the kit turns DAD off)
    subprocess.run(["ip", "-n", pod.name, "addr", "add", f"{dup}/64", "dev", pod.pod_if], check=True)
    deadline = time.monotonic() + 10
    while "dadfailed" not in subprocess.run(["ip", "-n", pod.name, "-6", "addr", "show", "dev", pod.pod_if],
                                            capture_output=True, text=True, check=True).stdout:
        assert time.monotonic() < deadline, "DAD did not fail"
        time.sleep(0.1)
    try:
        for cfg in (RedirectConfig(), RedirectConfig(inbound_ports=(8000,))):  # fresh, then general
            api.setup(pod.name, cfg, backend="ebpf")
            shown = api.show(pod.name, backend="ebpf")
            assert dup not in shown["addresses"] and pod.pod_ip6 in shown["addresses"], shown["addresses"]
            assert f"sources={pod.pod_ip4},{pod.pod_ip6}" in shown["policy"], shown["policy"]
            assert api.check(pod.name, cfg, backend="ebpf").ok
    finally:
        api.teardown(pod.name, backend="ebpf")


@pytest.mark.parametrize("path", ["fresh", "general"])
def test_link_local_addresses_are_the_pods_own_but_never_its_source(
        pod_with_extra_iface: Pod, bpf_root: str, setup_pod, path: str) -> None:
    """Each interface's IPv6 link-local address is one of the pod's addresses for capture (a connect
    to it goes over lo, as netfilter sees it; a connection from it is the pod to itself): the first
    held by the policy (no map entry for the one a pod usually has), any other a local6 entry, on
    the fresh-pod call and the general path alike, and check agrees. It is never the source the
    hooks give, even listed first (eth0 keeps only its link-local IPv6 address here): that is
    eth1's address."""
    pod = pod_with_extra_iface
    assert pod.extra is not None
    subprocess.run(["ip", "-n", pod.name, "-6", "addr", "del", f"{pod.pod_ip6}/64", "dev", pod.pod_if], check=True)
    cookie = _cookie(pod)
    if path == "general":
        setup_pod(pod, RedirectConfig(inbound_ports=(8080,)))  # the next one finds a policy
    res = setup_pod(pod, RedirectConfig())
    assert res.detail["path"] == path, res.detail
    cidrs = entries_mentioning(bpf_root, cookie)["cidrs"]
    first, other = (link_local(pod.name, dev) for dev in (pod.pod_if, pod.extra.pod_if))
    for ll, listed in ((first, False), (other, True)):
        key = abi.CIDR_KEY.pack(96 + 128, CIDR_KIND["local6"], cookie, socket.inet_pton(socket.AF_INET6, ll))
        assert (key in cidrs) is listed, ll
    policy = api.show(pod.name, backend="ebpf")["policy"]
    assert f"sources={pod.pod_ip4},{pod.extra.pod_ip6} link-local={first}" in policy, policy
    assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok


@pytest.mark.parametrize("point", ["ebpf.before_entries", "ebpf.before_policy"])
def test_a_failed_native_setup_leaves_the_pod_as_it_was(pod: Pod, bpf_root: str, point: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot(pod, bpf_root)
    monkeypatch.setenv("REDIRECT_FAULT", point)
    with pytest.raises(SetupError, match=f"injected fault at {point}"):
        api.setup(pod.name, RedirectConfig(), backend="ebpf")
    assert _snapshot(pod, bpf_root) == before
    monkeypatch.delenv("REDIRECT_FAULT")
    assert api.setup(pod.name, RedirectConfig(), backend="ebpf").detail["path"] == "fresh"
    api.teardown(pod.name, backend="ebpf")
    assert _snapshot(pod, bpf_root) == before


@pytest.mark.parametrize("holder", ["process", "thread"])
def test_a_fresh_pod_whose_netns_lock_is_held_waits_for_it(pod: Pod, setup_pod, holder: str) -> None:
    """The native call does not wait on the netns lock: held by another process or by another
    thread of this one, it backs off (nothing changed) and the general path waits for the
    holder, then sets the pod up."""
    from redirect.kernel import netns as rn
    from tests.test_netns import _hold_lock, _hold_lock_in_thread

    inode = rn.netns_inode(pod.name)
    if holder == "process":
        proc = _hold_lock(inode, 1.0)
        done = lambda: proc.wait(10) == 0  # noqa: E731
        stop = lambda: (proc.kill(), proc.wait(10))  # noqa: E731
    else:
        thread = _hold_lock_in_thread(inode, 1.0)
        done = lambda: (thread.join(10), not thread.is_alive())[1]  # noqa: E731
        stop = lambda: thread.join(10)  # noqa: E731
    try:
        t0 = time.monotonic()
        res = setup_pod(pod, RedirectConfig())
        waited = time.monotonic() - t0
        assert res.changed and res.detail["path"] == "general" and waited >= 0.5, (res.detail, waited)
        assert done()
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
    finally:
        stop()


def test_leftovers_of_an_earlier_attempt_send_a_fresh_pod_the_general_way_untouched(pod: Pod, bpf_root: str) -> None:
    """A pod with no policy but entries and a pinned link of ours (a setup that died between
    them, or a policy deleted behind our back): the native call finds them by its own writes
    (EEXIST), undoes what it wrote, and backs off; nothing of the leftovers changes. The
    general path then sets the pod up as usual."""
    from redirect.kernel import netns as rn

    api.setup(pod.name, RedirectConfig(), backend="ebpf")
    h = ebpf.host(bpf_root)
    assert h is not None
    with rn.enter(pod.name):
        cookie = ebpf.current_netns_cookie()
    assert h.pods.delete(abi.U64.pack(cookie))  # the policy goes; entries, inventory, link stay
    left = _snapshot(pod, bpf_root)
    assert left["policy"] is None and left["link"] and left["keys"]
    fd = rn.open_netns(pod.name)
    try:
        assert ebpf.setup_fresh(intent_for(RedirectConfig()), fd, pod.name, api.thread_lock_fd()) is None
    finally:
        os.close(fd)
    assert _snapshot(pod, bpf_root) == left
    res = api.setup(pod.name, RedirectConfig(), backend="ebpf")
    try:
        assert res.detail["path"] == "general" and res.changed
        assert api.check(pod.name, RedirectConfig(), backend="ebpf").ok
    finally:
        api.teardown(pod.name, backend="ebpf")


RELOAD = r"""
import sys
sys.path.insert(0, {repo!r})
from redirect.backends import ebpf
from redirect.backends.ebpf import abi
from redirect.backends.ebpf.host import objects, pod_link, syscalls
from redirect.backends.ebpf.pod.entries import policy_core
ebpf.force_unload_host({root!r})
h = ebpf.host({root!r})
print(h.compiled)
"""


def test_host_programs_reloaded_by_another_process_are_picked_up(make_pod, scratch_root: str) -> None:
    """This process holds the host maps open; another unloads and loads them again (new maps).
    The pin watch tells: the next fresh pod is written into the new maps, not the old ones."""
    a, b = make_pod(), make_pod()
    old = ebpf.host(scratch_root)
    assert old is not None and old.store.ok
    api.setup(a.name, OUT_ONLY, backend="ebpf")
    api.teardown(a.name, backend="ebpf")
    r = subprocess.run([sys.executable, "-c", RELOAD.format(repo=REPO, root=scratch_root)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    proxy = _proxy_listeners(b, 15001, "proxy")
    app = [TcpListener(b.peer_name, 8080, label="app").start()]
    try:
        res = api.setup(b.name, OUT_ONLY, backend="ebpf")
        assert res.detail["compiled"] is False  # reopened from the other process's pins
        assert ebpf.host(scratch_root) is not old
        assert api.check(b.name, OUT_ONLY, backend="ebpf").ok
        assert landing(b.name, b.peer_ip4, 8080, *proxy, *app, uid=APP_UID).listener in proxy
    finally:
        _close(proxy, app)
        api.teardown(b.name, backend="ebpf")


def test_thread_netns_fd_names_the_calling_threads_netns(pod: Pod, bpf_root: str) -> None:
    """``rdr_thread_netns`` (how the native path returns a thread home) follows the thread
    into another netns and back, in the main thread and in others."""
    import threading

    from redirect.kernel import netns as rn

    lib = syscalls.NATIVE.lib
    target = rn.netns_inode(pod.name)

    def where() -> int:
        fd = lib.rdr_thread_netns()
        assert fd >= 0
        try:
            return os.fstat(fd).st_ino
        finally:
            os.close(fd)

    home = os.stat("/proc/thread-self/ns/net").st_ino
    seen: list[tuple[int, int, int]] = []

    def run() -> None:
        before = where()
        with rn.enter(pod.name):
            inside = where()
        seen.append((before, inside, where()))

    run()
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == [(home, target, home)] * 2
    # A forked child's thread is not its parent's: it asks for its own (the parent's kept pidfd
    # names the parent's thread, which stays home).
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            with rn.enter(pod.name):
                code = 0 if where() == target else 2
            code = code or (0 if where() == home else 3)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_change_under_the_pin_dirs_sends_the_next_setup_the_general_way_once(make_pod, bpf_root: str) -> None:
    """Anything created or removed in the host pin dirs (here a directory in maps/, there and
    gone) makes the next setup look the host objects over (general path, which finds them
    fine); the one after is native again."""
    a, b = make_pod(), make_pod()
    h = ebpf.host(bpf_root)
    assert h is not None and h.trusted()
    extra = os.path.join(bpf_root, "maps", "not-ours")
    os.mkdir(extra)
    os.rmdir(extra)
    assert not h.trusted()
    try:
        assert api.setup(a.name, OUT_ONLY, backend="ebpf").detail["path"] == "general"
        assert ebpf.host(bpf_root) is h and h.trusted()  # same maps: kept, watched again
        assert api.setup(b.name, OUT_ONLY, backend="ebpf").detail["path"] == "fresh"
    finally:
        api.teardown(a.name, backend="ebpf")
        api.teardown(b.name, backend="ebpf")


def test_a_new_root_in_the_environment_is_followed_from_the_next_pod_on(make_pod, bpf_root: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fresh path reuses the last pod's host handle without reading the environment in
    Python; the native call checks $REDIRECT_BPF_ROOT itself, so a pod set up after it changed
    lands under the new root, and the one after takes the fresh path there."""
    a, b, c = make_pod(), make_pod(), make_pod()
    other = f"/sys/fs/bpf/rdrt-ebpf-other-{os.getpid()}"
    done: list[tuple[str, Pod]] = []
    try:
        res = api.setup(a.name, OUT_ONLY, backend="ebpf")
        done.append((bpf_root, a))
        assert res.detail["root"] == bpf_root and res.detail["path"] == "fresh"
        monkeypatch.setenv("REDIRECT_BPF_ROOT", other)
        res = api.setup(b.name, OUT_ONLY, backend="ebpf")
        done.append((other, b))
        assert res.detail["root"] == other
        res = api.setup(c.name, OUT_ONLY, backend="ebpf")
        done.append((other, c))
        assert res.detail["root"] == other and res.detail["path"] == "fresh"
        for root, p in done:
            with rnetns.enter(p.name):
                cookie = ebpf.current_netns_cookie()
            assert [r for r in (bpf_root, other) if cookie in ebpf.registered_pods(r)] == [root], p.name
    finally:
        for root, p in done:
            monkeypatch.setenv("REDIRECT_BPF_ROOT", root)
            api.teardown(p.name, backend="ebpf")
        monkeypatch.setenv("REDIRECT_BPF_ROOT", bpf_root)
        ebpf.force_unload_host(other)
    assert not os.path.exists(other)


def test_the_map_layouts_are_those_of_the_abi_header() -> None:
    """redirect/bpf/abi.h is the one description of the maps' keys and values: the struct formats the backend
    packs with are derived from cffi's declarations of it (the C compiler's sizes and offsets)."""
    from redirect._native import ffi

    from redirect.backends.ebpf import abi as ebpf_abi

    for name in ("pod_policy", "port_key", "cidr_key", "orig_dst", "tuple_key", "listener_key", "inv_key", "inv_val"):
        lay = ebpf_abi.layout(name)
        assert lay.struct.size == ffi.sizeof(f"struct {name}"), name
        for field, off in lay.offset.items():
            assert off == ffi.offsetof(f"struct {name}", field), (name, field)
    # A value packed in Python reads back field by field through the C declaration.
    addr = b"\x0a\x01\x02" + bytes(13)
    k = abi.CIDR_KEY.pack(abi.CIDR_PREFIX_BASE + 24, CIDR_KIND["out_exclude4"], 0x1122334455667788, addr)
    c = ffi.cast("struct cidr_key *", ffi.from_buffer(k))
    assert (c.prefixlen, c.kind, c.netns, bytes(c.addr)[:3]) == (120, CIDR_KIND["out_exclude4"], 0x1122334455667788,
                                                                  b"\x0a\x01\x02")
    v = list(abi.POLICY.unpack(bytes(abi.POLICY.size)))
    v[abi.P_FLAGS], v[abi.P_N_INV] = abi.flag("v6"), 7
    p = ffi.cast("struct pod_policy *", ffi.from_buffer(abi.POLICY.pack(*v)))
    assert (p.flags, p.n_inv, p.inv_base) == (abi.flag("v6"), 7, 0)
    assert objects.PROGRAMS["rdr_sk_lookup"][1] == abi.const("BPF_SK_LOOKUP") == 36  # BPF_SK_LOOKUP, by name


@pytest.mark.parametrize("how", ["another-users", "writable-by-others", "symlink"])
def test_a_pin_root_another_user_controls_is_refused_before_anything_is_loaded(scratch_root: str, how: str) -> None:
    """bpffs's top is writable by every user by default (mode 1777): another user may make the pin
    root first and could then unpin our cgroup links (detaching them: every pod loses capture).
    Such a root is refused, naming it, and nothing is loaded or pinned there."""
    elsewhere = scratch_root + "-elsewhere"
    try:
        if how == "symlink":
            os.mkdir(elsewhere, 0o700)
            os.symlink(elsewhere, scratch_root)
        else:
            os.mkdir(scratch_root, 0o755)
            if how == "writable-by-others":
                os.chmod(scratch_root, 0o777)
            else:
                os.chown(scratch_root, 65534, 65534)
        with pytest.raises(BackendUnavailable, match=f"pin directory {scratch_root} "):
            ebpf.host(scratch_root)
        assert os.listdir(elsewhere if how == "symlink" else scratch_root) == []
    finally:
        if os.path.islink(scratch_root):
            os.unlink(scratch_root)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(elsewhere)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(scratch_root)


def test_the_pin_directories_are_the_loaders_alone_whatever_the_umask(scratch_root: str) -> None:
    old = os.umask(0)
    try:
        assert ebpf.host(scratch_root) is not None
    finally:
        os.umask(old)
    for d in ("", "maps", "progs", "links", "pods"):
        st = os.stat(os.path.join(scratch_root, d))
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, (d, oct(st.st_mode))
