"""Sidecar capture, with real traffic: where each connection lands, and with what original destination.

Every test builds a pod netns joined to a peer netns, installs redirection, runs
listeners standing for the proxy (15001 outbound, 15006 inbound, 15053 DNS) and for
real servers, sends traffic as the app or as the proxy, and asserts which listener
saw it. Parametrized over backends: add a backend to ``BACKENDS`` once it renders
the sidecar plan.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

import redirect
from redirect import RedirectConfig
from redirect.kernel import netlink
from redirect.kernel import netns as rnetns
from redirect.kernel import routes as rt
from redirect.plan.lower_ebpf import CIDR_KIND
from tests.netkit import (
    IP_TRANSPARENT,
    IPV6_TRANSPARENT,
    OUR_TC,
    SO_MARK,
    SOL_IP,
    SOL_IPV6,
    VM_NET,
    Pod,
    TcpListener,
    UdpListener,
    in_netns,
    landing,
    link_local,
    qdisc_kinds,
    set_forwarding,
    tc_filters,
    tcp_probe_detail,
    udp_probe_detail,
    vm_behind,
)

BACKENDS = ["iptables-nft", "iptables-legacy", "nftables", "ebpf"]
APP_UID = 1000
PROXY_UID = 1337
PROXY = (PROXY_UID, PROXY_UID)
FAMILIES = [4, 6]


@pytest.fixture(scope="module")
def ebpf_root() -> Iterator[str]:
    """The eBPF backend's host programs, pinned under a scratch root of this module (removed at the end)."""
    from redirect.backends import ebpf

    root = f"/sys/fs/bpf/rdrt-sidecar-{os.getpid()}"
    old = os.environ.get("REDIRECT_BPF_ROOT")
    os.environ["REDIRECT_BPF_ROOT"] = root
    try:
        yield root
    finally:
        ebpf.force_unload_host(root)  # pods of failed tests may be left: their namespaces are gone
        if old is None:
            os.environ.pop("REDIRECT_BPF_ROOT", None)
        else:
            os.environ["REDIRECT_BPF_ROOT"] = old
        assert not os.path.exists(root), f"left pins under {root}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ebpf":
        request.getfixturevalue("ebpf_root")
    return str(request.param)


@contextlib.contextmanager
def installed(pod: Pod, cfg: RedirectConfig | None, backend: str) -> Iterator[redirect.Installed]:
    res = redirect.setup(pod.name, cfg, backend=backend)
    try:
        yield res
    finally:
        redirect.teardown(pod.name, backend=backend)


@contextlib.contextmanager
def listeners(*specs: tuple[str, int, int, str]) -> Iterator[dict[str, TcpListener]]:
    """Start TCP listeners given as (netns, port, family, label); yield them by label."""
    with contextlib.ExitStack() as st:
        out = {}
        for ns, port, fam, label in specs:
            out[label] = st.enter_context(TcpListener(ns, port, family=fam, label=label))
        yield out


def proxy_and_app(
    pod: Pod, fam: int, app_port: int = 8080
) -> contextlib.AbstractContextManager[dict[str, TcpListener]]:
    return listeners(
        (pod.name, 15001, fam, "proxy-out"),
        (pod.name, 15006, fam, "proxy-in"),
        (pod.peer_name, app_port, fam, "peer-app"),
    )


def save_all(ns: str) -> str:
    """Both families and both iptables variants, minus comments and counters.

    A table with no rules is left out: legacy xtables can't unload a table once
    something touched it, and an empty table changes nothing for traffic.
    """
    out = []
    for tool in ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        p = subprocess.run(["ip", "netns", "exec", ns, tool], capture_output=True, text=True, check=True)
        out.append(tool)
        block: list[str] = []
        for ln in p.stdout.splitlines():
            if ln.startswith("#"):
                continue
            block.append(ln)
            if ln == "COMMIT":
                if any(x.startswith(("-A", ":RDR", ":FOREIGN")) for x in block):
                    out += [x for x in block if not x.startswith(":") or x.startswith((":RDR", ":FOREIGN"))]
                block = []
    return "\n".join(out)


def rules_only(ns: str) -> str:
    """The rules (-A lines) of every table, both variants and families."""
    return "\n".join(ln for ln in save_all(ns).splitlines() if ln.startswith("-A") or "save" in ln)


def snapshot(ns: str, backend: str) -> str:
    """Our state in ``ns``: the rules of every table, plus the eBPF backend's map entries and link."""
    out = save_all(ns)
    if backend == "ebpf":
        shown = redirect.show(ns, backend="ebpf")
        out += "\nebpf " + repr({k: shown.get(k) for k in ("policy", "ports", "cidrs", "addresses", "sk_lookup_link")})
    return out


def routing_state(ns: str) -> str:
    cmds = [["ip", "rule"], ["ip", "-6", "rule"], ["ip", "route", "show", "table", "all"],
            ["ip", "-6", "route", "show", "table", "all"], ["ip", "-o", "addr"]]
    return "\n".join(subprocess.run(["ip", "-n", ns, *c[1:]], capture_output=True, text=True).stdout for c in cmds)


# --------------------------------------------------------------------------- outbound


@pytest.mark.parametrize("fam", FAMILIES)
def test_outbound_from_app_is_captured_with_original_destination(pod: Pod, backend: str, fam: int) -> None:
    with installed(pod, None, backend), proxy_and_app(pod, fam) as L:
        hit = landing(pod.name, pod.peer_ip(fam), 8080, *L.values(), uid=APP_UID)
        assert hit.label == "proxy-out"
        assert hit.orig_dst == (pod.peer_ip(fam), 8080)


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("who", [{"uid": PROXY_UID}, {"uid": APP_UID, "gid": PROXY_UID}])
def test_outbound_from_proxy_uid_or_gid_is_not_captured(pod: Pod, backend: str, fam: int, who: dict) -> None:
    with installed(pod, None, backend), proxy_and_app(pod, fam) as L:
        hit = landing(pod.name, pod.peer_ip(fam), 8080, *L.values(), **who)
        assert hit.label == "peer-app"


@pytest.mark.parametrize("fam", FAMILIES)
def test_excluded_outbound_port_and_cidr_are_not_captured(pod: Pod, backend: str, fam: int) -> None:
    subnet = pod.main.subnet4 if fam == 4 else pod.main.subnet6
    cfg = RedirectConfig(outbound_exclude_ports=(9090,), outbound_exclude_cidrs=(subnet,))
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.peer_name, 9090, fam, "peer-9090"),
        (pod.peer_name, 8080, fam, "peer-8080"),
    ) as L:
        # The whole peer subnet is excluded, so even 8080 goes direct...
        assert landing(pod.name, pod.peer_ip(fam), 8080, *L.values(), uid=APP_UID).label == "peer-8080"
        assert landing(pod.name, pod.peer_ip(fam), 9090, *L.values(), uid=APP_UID).label == "peer-9090"
    # ...and without the CIDR exclusion only the excluded port does.
    with installed(pod, RedirectConfig(outbound_exclude_ports=(9090,)), backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.peer_name, 9090, fam, "peer-9090"),
        (pod.peer_name, 8080, fam, "peer-8080"),
    ) as L:
        assert landing(pod.name, pod.peer_ip(fam), 8080, *L.values(), uid=APP_UID).label == "proxy-out"
        assert landing(pod.name, pod.peer_ip(fam), 9090, *L.values(), uid=APP_UID).label == "peer-9090"


def test_only_included_cidrs_and_ports_are_captured(pod: Pod, backend: str) -> None:
    other = "10.255.255.0/24"  # a CIDR the pod never talks to
    cfg = RedirectConfig(outbound_cidrs=(other,), outbound_ports=(9090,))
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15001, 4, "proxy-out"), (pod.peer_name, 9090, 4, "peer-9090"),
        (pod.peer_name, 8080, 4, "peer-8080"),
    ) as L:
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID).label == "peer-8080"
        hit = landing(pod.name, pod.peer_ip4, 9090, *L.values(), uid=APP_UID)
        assert hit.label == "proxy-out" and hit.orig_dst == (pod.peer_ip4, 9090)


def test_empty_outbound_cidrs_capture_nothing_outbound(pod: Pod, backend: str) -> None:
    with installed(pod, RedirectConfig(outbound_cidrs=()), backend), proxy_and_app(pod, 4) as L:
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID).label == "peer-app"


@pytest.mark.parametrize("fam", FAMILIES)
def test_loopback_and_inbound_passthrough_are_not_captured(pod: Pod, backend: str, fam: int) -> None:
    lo = "127.0.0.1" if fam == 4 else "::1"
    with installed(pod, None, backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.name, 15006, fam, "proxy-in"), (pod.name, 7000, fam, "local-app"),
    ) as L:
        assert landing(pod.name, lo, 7000, *L.values(), uid=APP_UID).label == "local-app"
        # The app talking to its own pod IP over lo stays local too (Istio: lo, not the proxy uid).
        assert landing(pod.name, pod.pod_ip(fam), 7000, *L.values(), uid=APP_UID).label == "local-app"
        # The proxy's inbound passthrough (from 127.0.0.6 / ::6) reaches the app directly.
        src = "127.0.0.6" if fam == 4 else "::6"
        hit = landing(pod.name, pod.pod_ip(fam), 7000, *L.values(), uid=PROXY_UID, src=src)
        assert hit.label == "local-app"


@pytest.mark.parametrize("fam", FAMILIES)
def test_proxy_calling_own_pod_ip_hairpins_to_inbound(pod: Pod, backend: str, fam: int) -> None:
    """app -> service VIP -> proxy (uid 1337) -> pod IP: the proxy's call goes to inbound capture."""
    with installed(pod, None, backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.name, 15006, fam, "proxy-in"), (pod.name, 7000, fam, "local-app"),
    ) as L:
        hit = landing(pod.name, pod.pod_ip(fam), 7000, *L.values(), uid=PROXY_UID)
        assert hit.label == "proxy-in"
        assert hit.orig_dst == (pod.pod_ip(fam), 7000)


def test_own_link_local_address_is_the_pods_own(pod: Pod, backend: str) -> None:
    """The pod's IPv6 link-local address (its eth0's fe80::, which a socket names with its scope id)
    is one of its own addresses: the app's connection to it goes over lo and reaches the app, as
    istio-iptables' "app traffic over lo" rule leaves it (the proxy could not reach it anyway: an
    original destination has no scope id), from that address as its source. A peer's connection to
    it is inbound as any other and is captured. The proxy's own connection to it is a difference
    (docs/backends.md): under netfilter REDIRECT sends it to ::1 out through the socket's interface,
    where it is lost; on eBPF it is the hairpin to inbound capture."""
    own = link_local(pod.name, pod.pod_if)
    with installed(pod, None, backend), listeners(
        (pod.name, 15001, 6, "proxy-out"), (pod.name, 15006, 6, "proxy-in"), (pod.name, 7000, 6, "local-app"),
    ) as L:
        hit = landing(pod.name, f"{own}%{pod.pod_if}", 7000, *L.values(), uid=APP_UID)
        assert hit.label == "local-app", hit.result
        assert hit.peer is not None and hit.peer[0] == own
        hit = landing(pod.peer_name, f"{own}%{pod.peer_if}", 7000, *L.values())
        assert hit.label == "proxy-in" and hit.orig_dst == (own, 7000), hit.result
        if backend == "ebpf":
            hit = landing(pod.name, f"{own}%{pod.pod_if}", 7000, *L.values(), uid=PROXY_UID)
            assert hit.label == "proxy-in" and hit.orig_dst == (own, 7000), hit.result


@pytest.mark.parametrize("fam", FAMILIES)
def test_tcp_to_port_zero_is_captured_as_any_port(pod: Pod, backend: str, fam: int) -> None:
    """Port 0 is a port as any other to istio-iptables' rules (the kernel sends a SYN to it): the
    app's connection to a peer's port 0 goes to the outbound port, a peer's to the pod's port 0 to
    the inbound port, each with port 0 as its original destination, and the proxy's hairpin to the
    pod's own address too; nothing captures it over lo, where nothing listens on port 0. The app's
    getpeername differs (docs/backends.md): netfilter leaves the socket's port 0, which the kernel
    answers with ENOTCONN; eBPF names the original destination, port 0."""
    lo = "127.0.0.1" if fam == 4 else "::1"
    peer, own = pod.peer_ip(fam), pod.pod_ip(fam)
    with installed(pod, None, backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.name, 15006, fam, "proxy-in"),
    ) as L:
        hit = landing(pod.name, peer, 0, *L.values(), uid=APP_UID)
        assert hit.label == "proxy-out" and hit.orig_dst == (peer, 0), hit.result
        hit = landing(pod.peer_name, own, 0, *L.values())
        assert hit.label == "proxy-in" and hit.orig_dst == (own, 0), hit.result
        hit = landing(pod.name, own, 0, *L.values(), uid=PROXY_UID)
        assert hit.label == "proxy-in" and hit.orig_dst == (own, 0), hit.result
        for uid in (APP_UID, PROXY_UID):
            for dst in (lo, own):
                if (uid, dst) == (PROXY_UID, own):
                    continue
                hit = landing(pod.name, dst, 0, *L.values(), uid=uid)
                assert (hit.listener, hit.result.error) == (None, "refused"), (uid, dst, hit.result)

        def peername() -> object:
            with socket.socket(socket.AF_INET if fam == 4 else socket.AF_INET6, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect((peer, 0))
                try:
                    return tuple(s.getpeername()[:2])
                except OSError as e:
                    return errno.errorcode[e.errno]

        assert in_netns(pod.name, peername) == ((peer, 0) if backend == "ebpf" else "ENOTCONN")


def test_owner_groups_limit_what_is_captured(pod: Pod, backend: str) -> None:
    with installed(pod, RedirectConfig(owner_groups=(2000,)), backend), proxy_and_app(pod, 4) as L:
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID, gid=2000).label == "proxy-out"
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID, gid=3000).label == "peer-app"
    with installed(pod, RedirectConfig(owner_groups_exclude=(3000,)), backend), proxy_and_app(pod, 4) as L:
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID, gid=2000).label == "proxy-out"
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID, gid=3000).label == "peer-app"


def test_uid_range_is_not_captured(pod: Pod, backend: str) -> None:
    with installed(pod, RedirectConfig(proxy_uids=((1300, 1400),), proxy_gids=()), backend), \
            proxy_and_app(pod, 4) as L:
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=1350).label == "peer-app"
        assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=1401).label == "proxy-out"


@pytest.mark.parametrize("fam", FAMILIES)
def test_any_number_of_owner_ids_and_ranges(pod: Pod, backend: str, fam: int) -> None:
    """Dozens of proxy uids, gids and owner groups (ids and ranges) act as one list each, as
    iptables' one rule per entry does; the first uid alone hairpins over lo (the others' lo traffic
    returns at its "! --uid-owner" rule)."""
    uids = (PROXY_UID, *range(3000, 3019), (4000, 4099), 5000, (70000, 70999))
    gids = (*range(6000, 6011), (7000, 7999))
    groups = (*range(2000, 2009), (2100, 2355), 9000)
    cfg = RedirectConfig(proxy_uids=uids, proxy_gids=gids, owner_groups=groups)
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.name, 15006, fam, "proxy-in"),
        (pod.name, 7000, fam, "local-app"), (pod.peer_name, 8080, fam, "peer-app"),
    ) as L:
        assert redirect.check(pod.name, cfg, backend=backend).ok
        peer = pod.peer_ip(fam)

        def lands(uid: int, gid: int, ip: str = peer, port: int = 8080) -> str | None:
            return landing(pod.name, ip, port, *L.values(), uid=uid, gid=gid).label

        assert lands(APP_UID, 2008) == "proxy-out"  # the 9th owner group
        assert lands(APP_UID, 2300) == "proxy-out"  # inside a group range
        assert lands(APP_UID, 2356) == "peer-app"  # past it: not an owner group
        assert lands(APP_UID, 9001) == "peer-app"
        assert lands(3015, 2000) == "peer-app"  # the 17th proxy uid
        assert lands(4050, 2000) == "peer-app"  # inside a uid range
        assert lands(70999, 2000) == "peer-app"
        assert lands(4100, 2000) == "proxy-out"
        assert lands(APP_UID, 6010) == "peer-app"  # a proxy gid (the 11th)
        assert lands(APP_UID, 7500) == "peer-app"
        # Over lo to the pod's own address: the first proxy uid hairpins to inbound capture,
        # the others return.
        assert lands(PROXY_UID, PROXY_UID, pod.pod_ip(fam), 7000) == "proxy-in"
        assert lands(3015, 2000, pod.pod_ip(fam), 7000) == "local-app"
    assert not redirect.show(pod.name, backend=backend)["installed"]


# --------------------------------------------------------------------------- inbound


@pytest.mark.parametrize("fam", FAMILIES)
def test_inbound_to_app_port_lands_on_15006(pod: Pod, backend: str, fam: int) -> None:
    with installed(pod, None, backend), listeners(
        (pod.name, 15006, fam, "proxy-in"), (pod.name, 8000, fam, "pod-app"),
    ) as L:
        hit = landing(pod.peer_name, pod.pod_ip(fam), 8000, *L.values())
        assert hit.label == "proxy-in"
        assert hit.orig_dst == (pod.pod_ip(fam), 8000)


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("port", [15008, 15021, 15090])
def test_tunnel_and_excluded_inbound_ports_are_not_captured(pod: Pod, backend: str, fam: int, port: int) -> None:
    with installed(pod, None, backend), listeners(
        (pod.name, 15006, fam, "proxy-in"), (pod.name, port, fam, "direct"),
    ) as L:
        assert landing(pod.peer_name, pod.pod_ip(fam), port, *L.values()).label == "direct"


def test_only_included_inbound_ports_are_captured(pod: Pod, backend: str) -> None:
    cfg = RedirectConfig(inbound_ports=(8000,))
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15006, 4, "proxy-in"), (pod.name, 8000, 4, "app-8000"), (pod.name, 8001, 4, "app-8001"),
    ) as L:
        assert landing(pod.peer_name, pod.pod_ip4, 8000, *L.values()).label == "proxy-in"
        assert landing(pod.peer_name, pod.pod_ip4, 8001, *L.values()).label == "app-8001"


def test_bypass_inbound_capture_is_an_ambient_option_a_sidecar_still_captures_inbound(
        pod: Pod, backend: str) -> None:
    with installed(pod, RedirectConfig(bypass_inbound_capture=True), backend), listeners(
        (pod.name, 15006, 4, "proxy-in"), (pod.name, 8000, 4, "pod-app"),
    ) as L:
        assert landing(pod.peer_name, pod.pod_ip4, 8000, *L.values()).label == "proxy-in"


@pytest.mark.parametrize("fam", FAMILIES)
def test_tproxy_inbound_keeps_the_destination_as_local_address(pod: Pod, backend: str, fam: int) -> None:
    cfg = RedirectConfig(inbound_interception="TPROXY", outbound_exclude_ports=(8001,))
    with installed(pod, cfg, backend), contextlib.ExitStack() as st:
        assert redirect.check(pod.name, cfg, backend=backend).ok
        proxy = st.enter_context(TcpListener(pod.name, 15006, family=fam, transparent=True, label="proxy-in"))
        app = st.enter_context(TcpListener(pod.name, 8000, family=fam, label="pod-app"))
        hit = landing(pod.peer_name, pod.pod_ip(fam), 8000, proxy, app)
        assert hit.label == "proxy-in"
        assert hit.local == (pod.pod_ip(fam), 8000)
        # Excluded ports still go straight to the app.
        with TcpListener(pod.name, 15021, family=fam, label="health") as health:
            assert landing(pod.peer_name, pod.pod_ip(fam), 15021, proxy, health).label == "health"
        # The tunnel port is never captured.
        with TcpListener(pod.name, 15008, family=fam, label="tunnel") as tunnel:
            assert landing(pod.peer_name, pod.pod_ip(fam), 15008, proxy, tunnel).label == "tunnel"
        # The proxy's inbound passthrough (from 127.0.0.6 / ::6) reaches the app; unbound, its
        # connection to its own pod's address goes to inbound capture (the hairpin).
        six = "127.0.0.6" if fam == 4 else "::6"
        assert landing(pod.name, pod.pod_ip(fam), 8000, proxy, app, uid=PROXY_UID, src=six).label == "pod-app"
        assert landing(pod.name, pod.pod_ip(fam), 8000, proxy, app, uid=PROXY_UID).label == "proxy-in"
        # TPROXY's mangle rules take the proxy's lo traffic that nat leaves alone (here an excluded
        # outbound port) to the proxy as well; a socket with the TPROXY mark (the proxy's own
        # connection to the app) reaches the app. (The proxy's gid with uid 0: setting the mark
        # needs root.)
        app2 = st.enter_context(TcpListener(pod.name, 8001, family=fam, label="pod-app-8001"))
        proxy_gid = {"uid": 0, "gid": PROXY_UID}
        assert landing(pod.name, pod.pod_ip(fam), 8001, proxy, app2, **proxy_gid).label == "proxy-in"
        assert landing(pod.name, pod.pod_ip(fam), 8001, proxy, app2, mark=1337, **proxy_gid).label == "pod-app-8001"
        assert landing(pod.name, pod.pod_ip(fam), 8001, proxy, app2, uid=APP_UID).label == "pod-app-8001"
    assert redirect.check(pod.name, cfg, backend=backend).ok is False  # torn down: nothing matches


@pytest.mark.parametrize("fam", FAMILIES)
def test_tproxy_proxy_connects_to_the_app_from_the_clients_address(pod: Pod, backend: str, fam: int) -> None:
    """Envoy's ``original_src`` under TPROXY: the proxy's transparent socket, bound to the client's
    address and carrying the TPROXY mark, connects to the app. It reaches the app (not the proxy's
    inbound listener), the app sees the client as its peer, and its replies, addressed to the
    client, come back to the proxy (the policy route by mark) instead of leaving the pod."""
    cfg = RedirectConfig(inbound_interception="TPROXY")
    peer, dst = pod.peer_ip(fam), pod.pod_ip(fam)

    def state() -> tuple[str, str]:
        rules = subprocess.run(["ip", f"-{fam}", "rule"], capture_output=True, text=True, check=True).stdout
        with open("/proc/sys/net/ipv4/tcp_fwmark_accept") as f:
            return rules, f.read().strip()

    with contextlib.ExitStack() as st:
        proxy = st.enter_context(TcpListener(pod.name, 15006, family=fam, transparent=True, label="proxy-in"))
        app = st.enter_context(TcpListener(pod.name, 8000, family=fam, label="pod-app"))
        before = in_netns(pod.name, state)
        # Nothing routes the replies back yet: they leave the pod towards the client.
        assert landing(pod.name, dst, 8000, proxy, app, src=peer, mark=1337, timeout=0.5).label is None
        with installed(pod, cfg, backend):
            hit = landing(pod.name, dst, 8000, proxy, app, src=peer, mark=1337)
            assert hit.listener is app, hit.result
            assert hit.conn is not None and hit.conn.peer[0] == peer
            assert redirect.check(pod.name, cfg, backend=backend).ok
        assert in_netns(pod.name, state) == before  # the policy route (and eBPF's sysctl) went with teardown


def _transparent_to_the_app(src: str, dst: tuple[str, int], mark: int) -> socket.socket:
    """A proxy's transparent socket (``original_src``), bound to the client's address, connected to
    the app and kept open (the caller closes it)."""
    fam = socket.AF_INET6 if ":" in src else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(2)
    s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
    s.setsockopt(*((SOL_IP, IP_TRANSPARENT) if fam == socket.AF_INET else
                   (SOL_IPV6, IPV6_TRANSPARENT)), 1)
    s.bind((src, 0))
    s.connect(dst)
    return s


def _from_port(src: tuple[str, int], dst: tuple[str, int]) -> str | None:
    """A client's connection from the address and port ``src``: the line its listener answers."""
    with socket.socket(socket.AF_INET6 if ":" in src[0] else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(src)
        try:
            s.connect(dst)
            s.sendall(b"client\n")
            return s.recv(100).split(b"\n", 1)[0].decode() or None
        except OSError:
            return None


@pytest.mark.parametrize("fam", FAMILIES)
def test_tproxy_clients_new_connection_from_the_transparent_connections_end_is_captured(
    pod: Pod, backend: str, fam: int
) -> None:
    """While the proxy's transparent connection to the app from the client's address and port is
    open, a new connection from outside from that same address and port to another of the pod's
    ports is ordinary inbound: captured into the proxy, not handed to the app (eBPF passes only the
    transparent connection itself, by both its ends, as netfilter never sees it)."""
    cfg = RedirectConfig(inbound_interception="TPROXY")
    peer, dst = pod.peer_ip(fam), pod.pod_ip(fam)
    with contextlib.ExitStack() as st:
        proxy = st.enter_context(TcpListener(pod.name, 15006, family=fam, transparent=True, label="proxy-in"))
        st.enter_context(TcpListener(pod.name, 8000, family=fam, label="pod-app"))
        st.enter_context(TcpListener(pod.name, 8001, family=fam, label="pod-app-8001"))
        st.enter_context(installed(pod, cfg, backend))
        held = in_netns(pod.name, _transparent_to_the_app, peer, (dst, 8000), 1337)
        st.callback(held.close)
        sport = held.getsockname()[1]
        assert in_netns(pod.peer_name, _from_port, (peer, sport), (dst, 8001)) == "proxy-in"
        assert proxy.last is not None and proxy.last.orig_dst == (dst, 8001)
        held.sendall(b"transparent\n")  # the transparent connection itself still works
        assert held.recv(100) == b"pod-app\n"


def test_ebpf_excluded_interface_follows_the_routes_check_reports_changes(pod_with_extra_iface: Pod,
                                                                           ebpf_root: str) -> None:
    """eBPF reads which destinations leave through an excluded interface from the pod's main
    table at setup: a route added later is reported by check and followed by the next setup."""
    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None
    cfg = RedirectConfig(exclude_interfaces=(extra.pod_if,))
    far = "10.250.0.1"  # routed through the excluded interface once the route is there
    with installed(pod, cfg, "ebpf"), listeners(
        (pod.name, 15001, 4, "proxy-out"), (pod.peer_name, 8080, 4, "peer-app"),
    ) as L:
        shown = redirect.show(pod.name)
        assert any("via-excluded-interface" in c for c in shown["cidrs"]), shown["cidrs"]
        subprocess.run(["ip", "-n", pod.peer_name, "addr", "add", f"{far}/32", "dev", extra.peer_if], check=True)
        subprocess.run(["ip", "-n", pod.name, "route", "add", "10.250.0.0/16", "via", extra.peer_ip4], check=True)
        chk = redirect.check(pod.name, cfg, backend="ebpf")
        assert not chk.ok and any("via-excluded-interface 10.250.0.0/16" in d for d in chk.differences), chk
        assert landing(pod.name, far, 8080, *L.values(), uid=APP_UID).label == "proxy-out"  # until setup runs
        assert redirect.setup(pod.name, cfg, backend="ebpf").changed
        assert redirect.check(pod.name, cfg, backend="ebpf").ok
        assert landing(pod.name, far, 8080, *L.values(), uid=APP_UID).label == "peer-app"


def test_tproxy_policy_route_survives_a_switch_to_ebpf_and_goes_with_tproxy(pod: Pod, ebpf_root: str) -> None:
    """eBPF installs TPROXY's policy route as netfilter does (the replies to the proxy's transparent
    connections to the app): a switch from netfilter TPROXY capture keeps it, a config without
    TPROXY removes it."""
    before = routing_state(pod.name)
    cfg = RedirectConfig(inbound_interception="TPROXY")
    redirect.setup(pod.name, cfg, backend="nftables")
    assert "lookup 133" in routing_state(pod.name)
    res = redirect.setup(pod.name, cfg, backend="ebpf")
    assert res.backend == "ebpf" and res.changed
    assert "lookup 133" in routing_state(pod.name)
    assert redirect.check(pod.name, cfg).ok
    assert redirect.setup(pod.name, None, backend="ebpf").changed
    assert "lookup 133" not in routing_state(pod.name)
    assert redirect.check(pod.name, None).ok
    redirect.teardown(pod.name)
    assert routing_state(pod.name) == before


@pytest.mark.parametrize("fam", FAMILIES)
def test_excluded_interface_is_not_captured(pod_with_extra_iface: Pod, backend: str, fam: int) -> None:
    """Inbound arriving on an excluded interface and outbound leaving through it are not
    captured; the other interface's are."""
    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None
    cfg = RedirectConfig(exclude_interfaces=(extra.pod_if,))
    extra_pod, extra_peer = (extra.pod_ip4, extra.peer_ip4) if fam == 4 else (extra.pod_ip6, extra.peer_ip6)
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15006, fam, "proxy-in"), (pod.name, 15001, fam, "proxy-out"), (pod.name, 8000, fam, "pod-app"),
        (pod.peer_name, 8080, fam, "peer-app"),
    ) as L:
        assert redirect.check(pod.name, cfg, backend=backend).ok
        assert landing(pod.peer_name, pod.pod_ip(fam), 8000, *L.values()).label == "proxy-in"
        assert landing(pod.peer_name, extra_pod, 8000, *L.values()).label == "pod-app"
        assert landing(pod.name, pod.peer_ip(fam), 8080, *L.values(), uid=APP_UID).label == "proxy-out"
        assert landing(pod.name, extra_peer, 8080, *L.values(), uid=APP_UID).label == "peer-app"


@pytest.mark.parametrize("fam", FAMILIES)
def test_rerouted_interface_inbound_goes_to_the_outbound_port(pod_with_extra_iface: Pod, backend: str,
                                                              fam: int) -> None:
    """Inbound TCP arriving on a reroute (kube-virt) interface goes to the proxy's outbound port
    with its original destination; with ``outbound_cidrs`` only to those, the rest of that
    interface is not captured at all; the other interface's inbound is captured as usual."""
    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None
    extra_pod = extra.pod_ip4 if fam == 4 else extra.pod_ip6
    host = f"{extra_pod}/{32 if fam == 4 else 128}"
    cfg = RedirectConfig(reroute_interfaces=(extra.pod_if,))
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15006, fam, "proxy-in"), (pod.name, 15001, fam, "proxy-out"), (pod.name, 8000, fam, "pod-app"),
    ) as L:
        assert redirect.check(pod.name, cfg, backend=backend).ok
        hit = landing(pod.peer_name, extra_pod, 8000, *L.values())
        assert hit.label == "proxy-out" and hit.orig_dst == (extra_pod, 8000), hit.result
        assert landing(pod.peer_name, pod.pod_ip(fam), 8000, *L.values()).label == "proxy-in"
        # Only the included destinations, once outbound capture is limited to some CIDRs.
        cfg = RedirectConfig(reroute_interfaces=(extra.pod_if,), outbound_cidrs=(host,))
        assert redirect.setup(pod.name, cfg, backend=backend).changed
        hit = landing(pod.peer_name, extra_pod, 8000, *L.values())
        assert hit.label == "proxy-out" and hit.orig_dst == (extra_pod, 8000), hit.result
        # Documentation ranges: never a pod's subnet (those are 10.R.x.0/24 and fd00:R:x::/64).
        cfg = RedirectConfig(reroute_interfaces=(extra.pod_if,), outbound_cidrs=("192.0.2.0/24", "2001:db8::/64"))
        assert redirect.setup(pod.name, cfg, backend=backend).changed
        assert landing(pod.peer_name, extra_pod, 8000, *L.values()).label == "pod-app"
        assert landing(pod.peer_name, pod.pod_ip(fam), 8000, *L.values()).label == "proxy-in"
        assert redirect.check(pod.name, cfg, backend=backend).ok


@pytest.mark.parametrize("fam", FAMILIES)
def test_rerouted_interface_forwarded_traffic_goes_to_the_outbound_port(pod: Pod, backend: str, fam: int) -> None:
    """A VM behind a reroute interface connects to a host beyond the pod, which the pod forwards:
    the connection lands on the proxy's outbound listener with its original destination, as
    netfilter's nat PREROUTING has it (eBPF: our tc filters on the interface). Before setup and
    after teardown it reaches that host; eBPF leaves no filter or qdisc behind."""
    dst, vm_ip = pod.peer_ip(fam), VM_NET[fam][1]
    with vm_behind(pod) as vm, listeners((pod.name, 15001, fam, "proxy-out"), (pod.peer_name, 8080, fam, "peer-app"),
                                         (pod.name, 15006, fam, "proxy-in")) as L:
        assert landing(vm, dst, 8080, *L.values()).label == "peer-app"  # forwarded by the pod
        cfg = RedirectConfig(reroute_interfaces=("vm0",))
        with installed(pod, cfg, backend):
            assert redirect.check(pod.name, cfg, backend=backend).ok
            hit = landing(vm, dst, 8080, *L.values())
            assert hit.label == "proxy-out" and hit.orig_dst == (dst, 8080), hit.result
            assert hit.conn is not None and hit.conn.peer[0] == vm_ip
            if backend == "ebpf":
                assert tc_filters(pod.name, "vm0") == OUR_TC
        assert landing(vm, dst, 8080, *L.values()).label == "peer-app"
        assert tc_filters(pod.name, "vm0") == {"ingress": [], "egress": []}
        assert "clsact" not in qdisc_kinds(pod.name, "vm0")  # the one made for ours went with them


# --------------------------------------------------------------------------- forwarded by the pod

#: No tc filter on an interface (``tc_filters``).
NO_TC: dict[str, list[str]] = {"ingress": [], "egress": []}


@pytest.mark.parametrize("fam", FAMILIES)
def test_forwarded_traffic_lands_on_the_inbound_port_with_its_original_destination(pod: Pod, backend: str,
                                                                                   fam: int) -> None:
    """TCP the pod forwards (ip_forward on) arriving on an interface that is neither excluded nor
    rerouted is inbound-captured, as netfilter's nat PREROUTING (no destination match) has it: a VM
    behind the pod's ``vm0`` connecting to a host beyond the pod, and that host connecting to the VM
    through the pod's ``eth0``, land on the proxy's inbound listener with their original
    destination and their client as the peer. Before setup and after teardown the pod forwards
    them untouched. eBPF: its programs are on each interface's tc ingress while installed; teardown
    leaves no program and no qdisc of its own on them."""
    dst, vm_ip = pod.peer_ip(fam), VM_NET[fam][1]
    with vm_behind(pod) as vm, listeners((pod.name, 15006, fam, "proxy-in"), (pod.name, 15001, fam, "proxy-out"),
                                         (pod.peer_name, 8080, fam, "peer-app"), (vm, 8080, fam, "vm-app")) as L:
        qdiscs = {dev: qdisc_kinds(pod.name, dev) for dev in ("vm0", "eth0")}
        assert landing(vm, dst, 8080, *L.values()).label == "peer-app"  # forwarded by the pod
        assert landing(pod.peer_name, vm_ip, 8080, *L.values()).label == "vm-app"
        with installed(pod, None, backend):
            assert redirect.check(pod.name, None, backend=backend).ok
            for src_ns, client, server in ((vm, vm_ip, dst), (pod.peer_name, dst, vm_ip)):
                hit = landing(src_ns, server, 8080, *L.values())
                assert hit.label == "proxy-in" and hit.orig_dst == (server, 8080), hit.result
                assert hit.peer is not None and hit.peer[0] == client, hit.conn
            # The pod's own traffic is captured as in a pod that does not forward.
            hit = landing(pod.peer_name, pod.pod_ip(fam), 8000, *L.values())
            assert hit.label == "proxy-in" and hit.orig_dst == (pod.pod_ip(fam), 8000), hit.result
            hit = landing(pod.name, dst, 8080, *L.values(), uid=APP_UID)
            assert hit.label == "proxy-out" and hit.orig_dst == (dst, 8080), hit.result
            assert landing(pod.name, dst, 8080, *L.values(), uid=PROXY_UID).label == "peer-app"
            if backend == "ebpf":
                for dev in ("vm0", "eth0"):
                    assert tc_filters(pod.name, dev) == OUR_TC, dev
        assert landing(vm, dst, 8080, *L.values()).label == "peer-app"
        assert landing(pod.peer_name, vm_ip, 8080, *L.values()).label == "vm-app"
        if backend == "ebpf":
            for dev in ("vm0", "eth0"):
                assert tc_filters(pod.name, dev) == NO_TC, dev
                assert qdisc_kinds(pod.name, dev) == qdiscs[dev], dev


@pytest.mark.parametrize("fam", FAMILIES)
def test_forwarded_traffic_to_an_uncaptured_port_or_from_an_excluded_interface_is_forwarded(pod: Pod, backend: str,
                                                                                             fam: int) -> None:
    """Forwarded TCP to an excluded inbound port or to one outside ``inbound_ports``, or arriving on
    an excluded interface, is not captured: the pod forwards it to its destination. What the same
    config still captures (another port; the same port arriving on another interface) lands on the
    proxy's inbound listener."""
    dst, vm_ip = pod.peer_ip(fam), VM_NET[fam][1]
    with vm_behind(pod) as vm, listeners((pod.name, 15006, fam, "proxy-in"), (pod.peer_name, 8080, fam, "peer-app"),
                                         (vm, 8080, fam, "vm-app")) as L:
        cases = [  # the config; (from, to, port) forwarded untouched; (from, to, port) the config captures
            (RedirectConfig(inbound_exclude_ports=(8080,)), (vm, dst, 8080), (vm, dst, 8081)),
            (RedirectConfig(inbound_ports=(8081,)), (vm, dst, 8080), (vm, dst, 8081)),
            (RedirectConfig(exclude_interfaces=("vm0",)), (vm, dst, 8080), (pod.peer_name, vm_ip, 8080)),
        ]
        with installed(pod, cases[0][0], backend):
            for cfg, (src, to, port), (csrc, cto, cport) in cases:
                redirect.setup(pod.name, cfg, backend=backend)
                assert redirect.check(pod.name, cfg, backend=backend).ok
                hit = landing(src, to, port, *L.values())
                assert hit.label == ("peer-app" if to == dst else "vm-app") and hit.local == (to, port), (cfg, hit)
                hit = landing(csrc, cto, cport, *L.values())
                assert hit.label == "proxy-in" and hit.orig_dst == (cto, cport), (cfg, hit.result)
                if backend == "ebpf":  # none on an excluded interface
                    assert tc_filters(pod.name, "vm0") == (NO_TC if cfg.exclude_interfaces else OUR_TC), cfg


def _csum(b: bytes) -> int:
    b += b"\0" * (len(b) % 2)
    t = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while t >> 16:
        t = (t & 0xFFFF) + (t >> 16)
    return ~t & 0xFFFF


def _unseen_syns(src: str, dst: str, sport: int, dport: int) -> dict[str, list[bytes]]:
    """A TCP SYN from ``src:sport`` to ``dst:dport`` (with 8 bytes of data) as raw IP packets whose
    ports a program that does not reassemble cannot read: by name, its packets. In two fragments
    (the TCP header, then the data); for IPv6 also whole behind a Destination Options header."""
    v6 = ":" in src
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    a, b = socket.inet_pton(fam, src), socket.inet_pton(fam, dst)
    data = b"unseen\r\n"
    tcp = struct.pack("!HHIIBBHHHBBH", sport, dport, 12345, 0, 6 << 4, 0x02, 64240, 0, 0, 2, 4, 1400)  # MSS option
    n = len(tcp) + len(data)
    pseudo = a + b + (struct.pack("!IxxxB", n, 6) if v6 else struct.pack("!xBH", 6, n))
    tcp = tcp[:16] + struct.pack("!H", _csum(pseudo + tcp + data)) + tcp[18:]
    off = len(tcp) // 8  # the data's fragment offset, in 8-byte units
    if not v6:
        def ip4(payload: bytes, flags_off: int) -> bytes:
            h = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 4242, flags_off, 64, 6, 0, a, b)
            return h[:10] + struct.pack("!H", _csum(h)) + h[12:] + payload
        return {"fragments": [ip4(tcp, 0x2000), ip4(data, off)]}  # more fragments; then the offset

    def ip6(nh: int, payload: bytes) -> bytes:
        return struct.pack("!IHBB", 6 << 28, len(payload), nh, 64) + a + b + payload
    return {
        "fragments": [ip6(44, struct.pack("!BxHI", 6, 1, 4242) + tcp),  # offset 0, more fragments
                      ip6(44, struct.pack("!BxHI", 6, off << 3, 4242) + data)],
        "extension headers": [ip6(60, struct.pack("!BB6x", 6, 0) + tcp + data)],  # Destination Options
    }


def _send_raw(dst: str, packets: list[bytes]) -> None:
    with socket.socket(socket.AF_INET6 if ":" in dst else socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
        for pkt in packets:
            s.sendto(pkt, (dst, 0))


def _arrived(watch: socket.socket, sport: int, dport: int, seconds: float = 1.0) -> bool:
    """Whether a TCP packet from ``sport`` to ``dport`` reaches the raw socket ``watch`` in time."""
    deadline = time.monotonic() + seconds
    watch.settimeout(0.1)
    while time.monotonic() < deadline:
        try:
            pkt = watch.recv(4096)
        except TimeoutError:
            continue
        tcp = pkt[(pkt[0] & 0xF) * 4:] if watch.family == socket.AF_INET else pkt  # (IPv6: no header)
        if struct.unpack("!HH", tcp[:4]) == (sport, dport):
            return True
    return False


@pytest.mark.parametrize("fam", FAMILIES)
def test_forwarded_syn_in_fragments_or_behind_extension_headers_never_goes_around_the_proxy(
    pod: Pod, backend: str, fam: int
) -> None:
    """A forwarded TCP SYN in IPv4 or IPv6 fragments, or behind IPv6 extension headers: netfilter
    reassembles it and captures it; eBPF's tc program cannot read its ports and drops it (fail
    closed). On no backend does it reach its destination around the proxy; without capture it
    does (which shows the packets are good ones)."""
    dst, vm_ip = pod.peer_ip(fam), VM_NET[fam][1]
    af = socket.AF_INET6 if fam == 6 else socket.AF_INET
    with vm_behind(pod) as vm, in_netns(pod.peer_name, socket.socket, af, socket.SOCK_RAW, socket.IPPROTO_TCP) as watch:
        kinds = list(_unseen_syns(vm_ip, dst, 1, 8080))
        for i, kind in enumerate(kinds):
            in_netns(vm, _send_raw, dst, _unseen_syns(vm_ip, dst, 40000 + i, 8080)[kind])
            assert _arrived(watch, 40000 + i, 8080), f"{kind}: not even forwarded without capture"
        with installed(pod, RedirectConfig(), backend):
            for i, kind in enumerate(kinds):
                in_netns(vm, _send_raw, dst, _unseen_syns(vm_ip, dst, 41000 + i, 8080)[kind])
                assert not _arrived(watch, 41000 + i, 8080), f"{kind}: forwarded around the proxy"


@pytest.mark.parametrize("fam", FAMILIES)
def test_tproxy_forwarded_traffic_lands_on_the_inbound_port(pod: Pod, backend: str, fam: int) -> None:
    """Under TPROXY inbound capture (mangle PREROUTING, no destination match) a connection the pod
    forwards lands on the proxy's transparent inbound listener with the original destination as
    its local address, as inbound connections to the pod do; after teardown it is forwarded. eBPF
    (a difference docs/backends.md names): its tc programs rewrite the connection as REDIRECT does, to
    the pod's first address and the inbound port, and ``SO_ORIGINAL_DST`` names the original
    destination."""
    cfg = RedirectConfig(inbound_interception="TPROXY")
    dst, vm_ip = pod.peer_ip(fam), VM_NET[fam][1]
    with vm_behind(pod) as vm, contextlib.ExitStack() as st:
        proxy = st.enter_context(TcpListener(pod.name, 15006, family=fam, transparent=True, label="proxy-in"))
        peer_app = st.enter_context(TcpListener(pod.peer_name, 8080, family=fam, label="peer-app"))
        with installed(pod, cfg, backend):
            assert redirect.check(pod.name, cfg, backend=backend).ok
            hit = landing(vm, dst, 8080, proxy, peer_app)
            assert hit.label == "proxy-in" and hit.peer is not None and hit.peer[0] == vm_ip, (hit.result, hit.conn)
            if backend == "ebpf":
                assert hit.local == (pod.pod_ip(fam), 15006) and hit.orig_dst == (dst, 8080), hit.conn
            else:
                assert hit.local == (dst, 8080), hit.conn
        assert landing(vm, dst, 8080, proxy, peer_app).label == "peer-app"


@pytest.mark.parametrize("fam", FAMILIES)
def test_without_forwarding_netfilter_still_captures_ebpf_has_no_tc_filter_until_a_setup_sees_it_on(
        pod: Pod, backend: str, fam: int) -> None:
    """With forwarding off the kernel drops what a VM behind the pod sends to a host beyond it.
    Netfilter's nat PREROUTING rewrites the destination before the routing decision, so its inbound
    capture takes such a connection to the proxy all the same; eBPF puts no tc filter on a pod that
    does not forward (its socket hooks see only local destinations), and the connection goes
    nowhere, as without capture. Forwarding turned on after setup: eBPF's check reports it, and
    the next setup puts the filters on; then every backend captures the connection."""
    dst = pod.peer_ip(fam)
    with vm_behind(pod) as vm, listeners((pod.name, 15006, fam, "proxy-in"),
                                         (pod.peer_name, 8080, fam, "peer-app")) as L:
        set_forwarding(pod.name, False)
        hit = landing(vm, dst, 8080, *L.values(), timeout=0.5)
        assert hit.label is None and hit.result.error == "timeout", hit.result
        with installed(pod, None, backend):
            assert redirect.check(pod.name, None, backend=backend).ok
            hit = landing(vm, dst, 8080, *L.values(), timeout=0.5)
            if backend == "ebpf":
                assert hit.label is None and hit.result.error == "timeout", hit.result
                for dev in ("vm0", "eth0"):
                    assert tc_filters(pod.name, dev) == NO_TC, dev
            else:
                assert hit.label == "proxy-in" and hit.orig_dst == (dst, 8080), hit.result
            set_forwarding(pod.name, True)
            assert redirect.check(pod.name, None, backend=backend).ok is (backend != "ebpf")
            redirect.setup(pod.name, None, backend=backend)
            assert redirect.check(pod.name, None, backend=backend).ok
            hit = landing(vm, dst, 8080, *L.values())
            assert hit.label == "proxy-in" and hit.orig_dst == (dst, 8080), hit.result
            if backend == "ebpf":
                assert tc_filters(pod.name, "vm0") == OUR_TC


def test_ebpf_interface_made_again_gets_its_tc_filters_at_the_next_setup(pod_with_extra_iface: Pod,
                                                                        ebpf_root: str) -> None:
    """An interface the pod forwards on, removed and made again (a VM restarted), here with its old
    ifindex, has lost our filters (the kernel removed them with it): check reports it, the next
    setup puts them back; a config without capture that could take forwarded traffic removes
    them; teardown leaves none."""
    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None
    set_forwarding(pod.name, True)
    cfg = RedirectConfig(reroute_interfaces=(extra.pod_if,))
    idx = socket_ifindex(pod.name, extra.pod_if)
    with installed(pod, cfg, "ebpf"):
        assert tc_filters(pod.name, extra.pod_if) == OUR_TC
        assert tc_filters(pod.name, "eth0") == OUR_TC  # (inbound capture: what arrives there too)
        subprocess.run(["ip", "-n", pod.name, "link", "del", extra.pod_if], check=True)
        subprocess.run(["ip", "-n", pod.name, "link", "add", extra.pod_if, "index", str(idx), "type", "veth",
                        "peer", "name", "x"], check=True)
        assert tc_filters(pod.name, extra.pod_if) == {"ingress": [], "egress": []}
        chk = redirect.check(pod.name, cfg, backend="ebpf")
        assert not chk.ok and any("tc filters on " + extra.pod_if in d for d in chk.differences), chk
        assert redirect.setup(pod.name, cfg, backend="ebpf").changed
        assert redirect.check(pod.name, cfg, backend="ebpf").ok
        assert tc_filters(pod.name, extra.pod_if) == OUR_TC
        out_only = RedirectConfig(inbound_ports=())
        assert redirect.setup(pod.name, out_only, backend="ebpf").changed
        assert redirect.check(pod.name, out_only, backend="ebpf").ok
        assert tc_filters(pod.name, extra.pod_if) == tc_filters(pod.name, "eth0") == {"ingress": [], "egress": []}
        assert redirect.setup(pod.name, cfg, backend="ebpf").changed
    for dev in (extra.pod_if, "eth0"):
        assert tc_filters(pod.name, dev) == {"ingress": [], "egress": []} and "clsact" not in qdisc_kinds(pod.name, dev)


def socket_ifindex(ns: str, dev: str) -> int:
    """``dev``'s ifindex in ``ns``."""
    out = subprocess.run(["ip", "-n", ns, "-j", "link", "show", "dev", dev], capture_output=True, text=True,
                         check=True).stdout
    return int(json.loads(out)[0]["ifindex"])


def test_ebpf_reroute_registers_an_outbound_listener_already_open(pod_with_extra_iface: Pod, ebpf_root: str) -> None:
    """A proxy already listening when reroute_interfaces is set up gets the rerouted connections
    (setup registers its listener; one started later registers itself as it listens); a config
    without reroute_interfaces drops the registration, and teardown leaves none."""
    from redirect.backends import ebpf
    from redirect.backends.ebpf.abi import AF, LISTENER_KEY

    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None
    cfg = RedirectConfig(reroute_interfaces=(extra.pod_if,))
    with listeners(*((pod.name, port, fam, f"{label}{fam}") for fam in FAMILIES
                     for port, label in ((15001, "proxy-out"), (8000, "pod-app")))) as L, \
            installed(pod, cfg, "ebpf"):
        assert redirect.show(pod.name)["outbound_listeners"] == ["IPv4", "IPv6"]
        for fam, dst in ((4, extra.pod_ip4), (6, extra.pod_ip6)):
            hit = landing(pod.peer_name, dst, 8000, *L.values())
            assert hit.label == f"proxy-out{fam}" and hit.orig_dst == (dst, 8000), hit.result
        redirect.setup(pod.name, RedirectConfig(), backend="ebpf")
        assert redirect.show(pod.name)["outbound_listeners"] == []
        cookie = redirect.show(pod.name)["netns_cookie"]
    h = ebpf.host()
    assert h is not None
    assert all(h.maps["listeners"].lookup(LISTENER_KEY.pack(cookie, AF[f], k)) is None
               for f in (4, 6) for k in (0, 1))


def _sendto_and_answer(ns: str, ip: str, port: int, fam: int) -> tuple[str, int] | None:
    """One datagram from an unbound, unconnected UDP socket of family ``fam`` in ``ns`` (``sendto``),
    as resolvers send; the answer's source, or None if none came within a second."""
    out: list[tuple[str, int]] = []

    def run() -> None:
        with rnetns.enter(ns), socket.socket(socket.AF_INET if fam == 4 else socket.AF_INET6,
                                             socket.SOCK_DGRAM) as s:
            if fam == 6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.settimeout(1.0)
            s.sendto(b"query\n", (ip, port))
            with contextlib.suppress(OSError):
                out.append(s.recvfrom(512)[1][:2])

    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    return out[0] if out else None


@pytest.mark.parametrize("fam", FAMILIES)
def test_captured_connections_come_from_the_pod_address(pod: Pod, backend: str, fam: int) -> None:
    """A captured connection of an unbound socket has the source routing picked for its original
    destination (iptables' nat runs after that choice): the proxy sees the pod's address as the
    peer and the app sees it as its socket's local address; the proxy's hairpin to its own pod's
    address comes from that address; DNS over UDP, connected or sent with sendto, too."""
    server = pod.peer_ip(fam)
    cfg = RedirectConfig(dns_capture=True, dns_servers=(server,))
    own = pod.pod_ip(fam)
    with installed(pod, cfg, backend), listeners(
        (pod.name, 15001, fam, "proxy-out"), (pod.name, 15006, fam, "proxy-in"), (pod.name, 8000, fam, "pod-app"),
        (pod.peer_name, 8080, fam, "peer-app"),
    ) as L, UdpListener(pod.name, 15053, family=fam, label="dns-proxy", owner=PROXY) as dns:
        assert redirect.check(pod.name, cfg, backend=backend).ok  # (eBPF: a fresh pod's sources as apply's)
        hit = landing(pod.name, server, 8080, *L.values(), uid=APP_UID)
        assert hit.label == "proxy-out" and hit.orig_dst == (server, 8080), hit.result
        assert hit.conn is not None and hit.conn.peer[0] == own and hit.result.local == hit.conn.peer, hit
        hit = landing(pod.name, own, 8000, *L.values(), uid=PROXY_UID)
        assert hit.label == "proxy-in" and hit.conn is not None and hit.conn.peer[0] == own, hit
        r = udp_probe_detail(pod.name, server, 53, uid=APP_UID)
        assert r.label == "dns-proxy" and r.local is not None and r.local[0] == own, r
        assert _sendto_and_answer(pod.name, server, 53, fam) == (server, 53)
        assert [c.peer[0] for c in dns.conns] == [own, own], dns.conns
        if fam == 4:  # a dual-stack socket to an IPv4 peer: IPv4 on the wire
            assert _sendto_and_answer(pod.name, f"::ffff:{server}", 53, 6) == (f"::ffff:{server}", 53)
            assert dns.conns[-1].peer[0] == own, dns.conns
            hit = landing(pod.name, f"::ffff:{server}", 8080, *L.values(), uid=APP_UID)
            assert hit.label == "proxy-out" and hit.conn is not None and hit.conn.peer[0] == own, hit
            assert hit.result.local is not None and hit.result.local[0] == f"::ffff:{own}", hit.result


# --------------------------------------------------------------------------- DNS


@pytest.mark.parametrize("fam", FAMILIES)
def test_dns_udp_and_tcp_go_to_the_dns_proxy(pod: Pod, backend: str, fam: int) -> None:
    server = pod.peer_ip(fam)
    cfg = RedirectConfig(dns_capture=True, dns_servers=(server,))
    with installed(pod, cfg, backend), contextlib.ExitStack() as st:
        # The DNS proxy runs as the proxy uid: its answers are what conntrack zone 2 un-NATs.
        dns_proxy_u = st.enter_context(UdpListener(pod.name, 15053, family=fam, label="dns-proxy", owner=PROXY))
        dns_proxy_t = st.enter_context(TcpListener(pod.name, 15053, family=fam, label="dns-proxy-tcp"))
        real_u = st.enter_context(UdpListener(pod.peer_name, 53, family=fam, label="resolver"))
        real_t = st.enter_context(TcpListener(pod.peer_name, 53, family=fam, label="resolver-tcp"))
        out = st.enter_context(TcpListener(pod.name, 15001, family=fam, label="proxy-out"))
        r = udp_probe_detail(pod.name, server, 53, uid=APP_UID)
        assert r.label == "dns-proxy", r
        t = landing(pod.name, server, 53, dns_proxy_t, real_t, out, uid=APP_UID)
        assert t.label == "dns-proxy-tcp"
        assert t.orig_dst == (server, 53)
        # The proxy's own upstream queries are not captured.
        assert udp_probe_detail(pod.name, server, 53, uid=PROXY_UID).label == "resolver"
        assert landing(pod.name, server, 53, dns_proxy_t, real_t, out, uid=PROXY_UID).label == "resolver-tcp"
        assert dns_proxy_u.conns and real_u.conns


def test_dns_is_not_captured_without_dns_capture(pod: Pod, backend: str) -> None:
    with installed(pod, None, backend), UdpListener(pod.name, 15053, label="dns-proxy"), \
            UdpListener(pod.peer_name, 53, label="resolver"):
        assert udp_probe_detail(pod.name, pod.peer_ip4, 53, uid=APP_UID).label == "resolver"


def test_capture_all_dns_catches_any_server(pod: Pod, backend: str) -> None:
    cfg = RedirectConfig(dns_capture=True, capture_all_dns=True)
    with installed(pod, cfg, backend), UdpListener(pod.name, 15053, label="dns-proxy", owner=PROXY), \
            UdpListener(pod.peer_name, 53, label="resolver"):
        assert udp_probe_detail(pod.name, pod.peer_ip4, 53, uid=APP_UID).label == "dns-proxy"


# --------------------------------------------------------------------------- lifecycle


def _foreign_rules(ns: str) -> None:
    payload = (
        "*nat\n:FOREIGN - [0:0]\n-A FOREIGN -p tcp -m tcp --dport 4444 -j RETURN\n"
        "-A OUTPUT -p udp -m udp --dport 4445 -j RETURN\n-A PREROUTING -j FOREIGN\nCOMMIT\n"
        "*filter\n-A INPUT -p tcp -m tcp --dport 4446 -j ACCEPT\nCOMMIT\n"
    )
    for tool in ("iptables-restore", "ip6tables-restore"):
        subprocess.run(["ip", "netns", "exec", ns, tool, "--noflush"], input=payload, text=True, check=True)


def test_foreign_rules_survive_setup_and_teardown(pod: Pod) -> None:
    backend = "iptables-nft"
    _foreign_rules(pod.name)
    before = save_all(pod.name)
    cfg = RedirectConfig(inbound_interception="TPROXY", dns_capture=True, capture_all_dns=True, drop_invalid=True)
    redirect.setup(pod.name, cfg, backend=backend)
    during = save_all(pod.name)
    for line in before.splitlines():
        assert line in during, f"foreign line lost during setup: {line}"
    redirect.setup(pod.name, RedirectConfig(), backend=backend)  # a config change
    redirect.teardown(pod.name, backend=backend)
    assert save_all(pod.name) == before


def test_setup_twice_is_setup_once_and_a_new_config_replaces(pod: Pod, backend: str) -> None:
    first = redirect.setup(pod.name, None, backend=backend)
    try:
        assert first.changed
        before = snapshot(pod.name, backend)
        assert redirect.setup(pod.name, None, backend=backend).changed is False
        assert snapshot(pod.name, backend) == before
        cfg = RedirectConfig(outbound_exclude_ports=(8080,))
        assert redirect.setup(pod.name, cfg, backend=backend).changed
        assert redirect.check(pod.name, cfg, backend=backend).ok
        assert not redirect.check(pod.name, None, backend=backend).ok
        with proxy_and_app(pod, 4) as L:
            assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID).label == "peer-app"
    finally:
        redirect.teardown(pod.name, backend=backend)
    assert redirect.teardown(pod.name, backend=backend) is False  # nothing left: fine


def _flush_outbound_chain(ns: str, backend: str) -> None:
    """Someone else's hand deletes the rules of our outbound chain (eBPF: the pod's own-address entry,
    which makes its lo traffic return)."""
    if backend == "ebpf":
        from redirect.backends import ebpf
        from redirect.backends.ebpf.abi import CIDR_KEY

        with rnetns.enter(ns):
            h = ebpf.host(load=False)
            assert h is not None
            cookie = ebpf.current_netns_cookie()
            for k in list(h.maps["cidrs"].keys()):
                if CIDR_KEY.unpack(k)[1:3] == (CIDR_KIND["local4"], cookie):
                    assert h.maps["cidrs"].delete(k)
        return
    if backend == "nftables":
        cmd = ["nft", "flush", "chain", "inet", "rdr_redirect", "nat_OUTBOUND"]
    else:
        cmd = [f"iptables-{backend.split('-')[1]}", "-t", "nat", "-F", "RDR_OUTBOUND"]
    subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True)


def test_check_reports_drift(pod: Pod, backend: str) -> None:
    with installed(pod, None, backend):
        assert redirect.check(pod.name, None, backend=backend).ok
        _flush_outbound_chain(pod.name, backend)
        res = redirect.check(pod.name, None, backend=backend)
        assert not res.ok
        what = "local" if backend == "ebpf" else "OUTBOUND"
        assert any(what in d for d in res.differences), res.differences
        redirect.setup(pod.name, None, backend=backend)  # repairs
        assert redirect.check(pod.name, None, backend=backend).ok


#: Where each backend can be made to fail: after routes are in, and after the first family/transaction.
FAULT_POINTS = {
    "iptables": ("iptables.before_restore_v6", "iptables.before_restore_v4"),  # IPv6 goes in first
    "nftables": ("nftables.before_transaction", "nftables.after_transaction"),
    "ebpf": ("ebpf.before_entries", "ebpf.before_policy"),
}


@pytest.mark.parametrize("stage", [0, 1], ids=["early", "late"])
def test_failure_half_way_leaves_the_namespace_as_it_was(
    pod: Pod, backend: str, stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    point = FAULT_POINTS[backend if backend in FAULT_POINTS else "iptables"][stage]
    _foreign_rules(pod.name)
    redirect.setup(pod.name, RedirectConfig(outbound_exclude_ports=(22,)), backend=backend)
    before_rules, before_routes = snapshot(pod.name, backend), routing_state(pod.name)
    monkeypatch.setenv("REDIRECT_FAULT", point)
    # A config that changes everything (eBPF: TPROXY changes none of its entries, so other ports).
    new = RedirectConfig(inbound_interception="TPROXY") if backend != "ebpf" else RedirectConfig(
        inbound_ports=(8000,), outbound_ports=(9000,), outbound_exclude_cidrs=("10.0.0.0/8",), dns_capture=True)
    with pytest.raises(redirect.SetupError, match="injected fault"):
        redirect.setup(pod.name, new, backend=backend)
    monkeypatch.delenv("REDIRECT_FAULT")
    assert snapshot(pod.name, backend) == before_rules
    assert routing_state(pod.name) == before_routes
    assert redirect.check(pod.name, RedirectConfig(outbound_exclude_ports=(22,)), backend=backend).ok
    redirect.teardown(pod.name, backend=backend)


def test_failed_first_setup_leaves_nothing(pod: Pod, monkeypatch: pytest.MonkeyPatch) -> None:
    before_rules, before_routes = rules_only(pod.name), routing_state(pod.name)
    monkeypatch.setenv("REDIRECT_FAULT", "iptables.before_restore_v4")  # after IPv6's rules went in
    with pytest.raises(redirect.SetupError):
        redirect.setup(pod.name, RedirectConfig(inbound_interception="TPROXY"), backend="iptables-nft")
    assert rules_only(pod.name) == before_rules
    assert routing_state(pod.name) == before_routes


def test_teardown_restores_routes_and_addresses(pod: Pod, backend: str) -> None:
    before = routing_state(pod.name)
    redirect.setup(pod.name, RedirectConfig(inbound_interception="TPROXY"), backend=backend)
    during = routing_state(pod.name)
    assert "lookup 133" in during and "::6" in during
    redirect.teardown(pod.name, backend=backend)
    assert routing_state(pod.name) == before


def _passthrough_on_lo(ns: str) -> bool:
    out = subprocess.run(["ip", "-n", ns, "-6", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True,
                         check=True).stdout
    return " ::6/128 " in out


def test_passthrough_address_comes_with_the_pods_own_ipv6(pod: Pod, backend: str) -> None:
    """``::6`` (the source of the proxy's IPv6 inbound passthrough) goes on lo only in a pod with
    an IPv6 address of its own, as Istio adds it; IPv6 capture does not depend on it. When the
    pod gets or loses its IPv6 address, ``check`` says so and the next setup follows."""
    ip6 = ["ip", "-n", pod.name, "-6", "addr"]
    own = [f"{pod.pod_ip6}/64", "dev", pod.pod_if]
    subprocess.run([*ip6, "del", *own], check=True)  # left: ::1 and eth0's link-local address
    res = redirect.setup(pod.name, None, backend=backend)
    assert 6 in res.families and not _passthrough_on_lo(pod.name)
    assert redirect.check(pod.name, None, backend=backend).ok
    subprocess.run([*ip6, "add", *own, "nodad"], check=True)
    chk = redirect.check(pod.name, None, backend=backend)
    assert not chk.ok and any("::6" in d for d in chk.differences), chk.differences
    assert redirect.setup(pod.name, None, backend=backend).changed
    assert _passthrough_on_lo(pod.name)
    assert redirect.check(pod.name, None, backend=backend).ok
    subprocess.run([*ip6, "del", *own], check=True)
    assert redirect.setup(pod.name, None, backend=backend).changed
    assert not _passthrough_on_lo(pod.name)
    assert redirect.check(pod.name, None, backend=backend).ok
    redirect.teardown(pod.name, backend=backend)
    # A ::6 of ours (our routing protocol) that is not wanted goes at setup; someone else's stays.
    for proto, stays in ((rt.RT_PROTO, False), (0, True)):
        pod.run(netlink.addr, "add", socket.AF_INET6, 1, "::6", 128, proto, rt.IFA_F_NODAD)
        redirect.setup(pod.name, None, backend=backend)
        assert _passthrough_on_lo(pod.name) == stays
        redirect.teardown(pod.name, backend=backend)
        assert _passthrough_on_lo(pod.name) == stays


def test_passthrough_address_comes_with_ipv6_whatever_the_inbound_ports(pod: Pod, backend: str) -> None:
    """istio-iptables adds ``::6`` whenever the pod has IPv6 (its EnableIPv6), inbound capture or
    not: with ``inbound_ports=()`` a pod with IPv6 of its own gets it (a proxy can bind it and its
    passthrough reaches the app), and one without does not."""
    cfg = RedirectConfig(inbound_ports=())
    with TcpListener(pod.name, 7000, family=6, label="app") as app:
        res = redirect.setup(pod.name, cfg, backend=backend)
        assert 6 in res.families and _passthrough_on_lo(pod.name)
        assert redirect.check(pod.name, cfg, backend=backend).ok
        hit = landing(pod.name, pod.pod_ip6, 7000, app, uid=PROXY_UID, src="::6")
        assert hit.listener is app, hit.result
        redirect.teardown(pod.name, backend=backend)
    assert not _passthrough_on_lo(pod.name)
    subprocess.run(["ip", "-n", pod.name, "-6", "addr", "del", f"{pod.pod_ip6}/64", "dev", pod.pod_if], check=True)
    res = redirect.setup(pod.name, cfg, backend=backend)
    assert 6 in res.families and not _passthrough_on_lo(pod.name)
    assert redirect.check(pod.name, cfg, backend=backend).ok
    redirect.teardown(pod.name, backend=backend)


def test_twenty_namespaces_set_up_concurrently(make_pod, backend: str) -> None:  # type: ignore[no-untyped-def]
    pods = [make_pod() for _ in range(20)]
    errors: list[BaseException] = []
    results: list[redirect.Installed] = []
    barrier = threading.Barrier(len(pods), timeout=30)

    home = rnetns.current_inode()
    wrong_ns: list[int] = []

    def work(p: Pod) -> None:
        try:
            barrier.wait()
            results.append(redirect.setup(p.name, None, backend=backend))
            if rnetns.current_inode() != home:
                wrong_ns.append(rnetns.current_inode())
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == 20
    assert not wrong_ns, "a thread was left in a pod namespace"
    for p in pods:
        assert redirect.check(p.name, None, backend=backend).ok
    for p in pods[:3]:
        with proxy_and_app(p, 4) as L:
            assert landing(p.name, p.peer_ip4, 8080, *L.values(), uid=APP_UID).label == "proxy-out"
    for p in pods:
        redirect.teardown(p.name, backend=backend)


def test_probe_timeouts_do_not_hang_when_nothing_listens(pod: Pod, backend: str) -> None:
    with installed(pod, None, backend):
        r = tcp_probe_detail(pod.name, pod.peer_ip4, 8080, uid=APP_UID, timeout=1.0)
        assert r.label is None  # captured to 15001 where nobody listens: refused, quickly
        assert r.elapsed < 1.5


def test_ipv6_rules_follow_the_namespace_when_auto(pod: Pod) -> None:
    assert redirect.setup(pod.name, None, backend="iptables-nft").families == (4, 6)
    redirect.teardown(pod.name, backend="iptables-nft")
    subprocess.run(["ip", "netns", "exec", pod.name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], check=True)
    try:
        res = redirect.setup(pod.name, None, backend="iptables-nft")
        assert res.families == (4,)
        assert "RDR_" not in subprocess.run(["ip", "netns", "exec", pod.name, "ip6tables-nft-save"],
                                            capture_output=True, text=True).stdout
        # Forcing IPv6 on still installs it (the user knows the namespace will get IPv6).
        assert redirect.setup(pod.name, RedirectConfig(ipv6=True), backend="iptables-nft").families == (4, 6)
    finally:
        redirect.teardown(pod.name, backend="iptables-nft")


def test_setup_rejects_a_non_config(pod: Pod) -> None:
    with pytest.raises(redirect.ConfigError, match="RedirectConfig"):
        redirect.setup(pod.name, {"proxy_port": 0}, backend="iptables-nft")  # type: ignore[arg-type]
    assert "RDR_" not in save_all(pod.name)


@pytest.mark.parametrize("variant", ["legacy", "nft"])
def test_existing_ruleset_decides_the_iptables_variant(pod: Pod, variant: str) -> None:
    subprocess.run(["ip", "netns", "exec", pod.name, f"iptables-{variant}", "-t", "filter", "-A", "INPUT", "-p",
                    "tcp", "--dport", "4446", "-j", "ACCEPT"], check=True)
    try:
        res = redirect.setup(pod.name, None, backend="iptables")
        assert res.detail["variant"] == variant
        out = subprocess.run(["ip", "netns", "exec", pod.name, f"iptables-{variant}-save"], capture_output=True,
                             text=True).stdout
        assert "RDR_OUTBOUND" in out
        with proxy_and_app(pod, 4) as L:
            assert landing(pod.name, pod.peer_ip4, 8080, *L.values(), uid=APP_UID).label == "proxy-out"
    finally:
        redirect.teardown(pod.name, backend="iptables")
    assert "RDR_" not in save_all(pod.name)


# --------------------------------------------------------------------------- dual-stack proxy


class DualStackListener(TcpListener):
    """One ``[::]`` socket with ``IPV6_V6ONLY=0`` (squid's, HAProxy's ``v4v6``, Go's and Java's default):
    IPv4 connections arrive as ``::ffff:a.b.c.d``. Records what both getsockopt levels answer:
    (family, address, port) or the errno name."""

    def __init__(self, netns: str, port: int, label: str) -> None:
        super().__init__(netns, port, family=6, label=label)
        self.answers: list[dict[str, object]] = []

    def _configure(self, s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)

    def _handle(self, c: socket.socket, peer: object) -> None:
        got: dict[str, object] = {}
        for level, size in (("SOL_IP", 16), ("SOL_IPV6", 28)):
            try:
                raw = c.getsockopt(socket.IPPROTO_IP if level == "SOL_IP" else socket.IPPROTO_IPV6, 80, size)
            except OSError as e:
                got[level] = errno.errorcode.get(e.errno or 0, str(e.errno))
                continue
            fam = int.from_bytes(raw[:2], "little")
            port = int.from_bytes(raw[2:4], "big")
            if fam == socket.AF_INET:
                got[level] = ("AF_INET", socket.inet_ntop(socket.AF_INET, raw[4:8]), port)
            else:
                got[level] = ("AF_INET6", socket.inet_ntop(socket.AF_INET6, raw[8:24]), port)
        with self._cond:
            self.answers.append(got)
        super()._handle(c, peer)


def _dual_stack_answers(pod: Pod, backend: str) -> dict[str, dict[str, object]]:
    """What a dual-stack proxy reads, outbound (15001) and inbound (15006), for IPv4 and IPv6 connections."""
    out: dict[str, dict[str, object]] = {}
    with installed(pod, None, backend), DualStackListener(pod.name, 15001, "proxy-out") as po, \
            DualStackListener(pod.name, 15006, "proxy-in") as pi:
        for fam in FAMILIES:
            hit = landing(pod.name, pod.peer_ip(fam), 8080, po, pi, uid=APP_UID)
            assert hit.listener is po, hit.result
            out[f"out{fam}"] = po.answers[-1]
            hit = landing(pod.peer_name, pod.pod_ip(fam), 8000, po, pi)
            assert hit.listener is pi, hit.result
            out[f"in{fam}"] = pi.answers[-1]
    return out


def test_a_dual_stack_proxy_reads_the_original_destination_at_both_levels(pod: Pod, backend: str) -> None:
    """As netfilter answers (conntrack looks the socket's tuple up in the level's family): an IPv4
    connection (``::ffff:a.b.c.d`` on the socket) has its original destination at ``SOL_IP`` and none
    (ENOENT) at ``SOL_IPV6``; a native IPv6 one the reverse. Outbound and inbound alike."""
    got = _dual_stack_answers(pod, backend)
    want = {}
    for way, ip4, ip6, port in (("out", pod.peer_ip4, pod.peer_ip6, 8080), ("in", pod.pod_ip4, pod.pod_ip6, 8000)):
        want[f"{way}4"] = {"SOL_IP": ("AF_INET", ip4, port), "SOL_IPV6": "ENOENT"}
        want[f"{way}6"] = {"SOL_IP": "ENOENT", "SOL_IPV6": ("AF_INET6", ip6, port)}
    assert got == want


@pytest.mark.parametrize("ipv6", [None, False])
def test_an_ipv4_destination_through_a_dual_stack_app_socket_is_captured_as_ipv4(
    pod: Pod, backend: str, ipv6: bool | None
) -> None:
    """The app's AF_INET6 socket connecting to ``::ffff:a.b.c.d`` sends IPv4: IPv4's rules capture it
    (also when IPv6 is not captured), the proxy reads it at ``SOL_IP``, and the app's getpeername
    names what it asked for."""
    from tests import netkit

    cfg = RedirectConfig(ipv6=ipv6)
    with installed(pod, cfg, backend), DualStackListener(pod.name, 15001, "proxy-out") as po, \
            TcpListener(pod.peer_name, 8080, family=4, label="peer-app") as app:
        mapped = f"::ffff:{pod.peer_ip4}"

        def connect() -> dict[str, object]:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                s.settimeout(3)
                s.connect((mapped, 8080))
                s.sendall(b"hi\n")
                return {"peer": list(s.getpeername()[:2]), "answer": s.recv(100).decode().strip()}

        got = netkit.in_child(pod.name, APP_UID, APP_UID, 5.0, connect)
        assert got.get("answer") == "proxy-out", got
        assert got["peer"] == [mapped, 8080]
        assert not app.conns
        assert po.answers[-1] == {"SOL_IP": ("AF_INET", pod.peer_ip4, 8080), "SOL_IPV6": "ENOENT"}



@pytest.mark.parametrize("fam", FAMILIES)
def test_the_original_destination_outlives_a_client_that_closed_before_the_proxy_accepted(
        pod: Pod, backend: str, fam: int) -> None:
    """A client that connects, sends and closes before the proxy accepts (a short request on a
    busy proxy): the proxy still reads the original destination and the data, as netfilter's
    conntrack keeps it for the connection, not for the client's socket; once the proxy's side
    closes too, nothing of it is kept."""
    from redirect.relay import original_dst

    server = pod.peer_ip(fam)
    af = socket.AF_INET if fam == 4 else socket.AF_INET6

    def listen() -> socket.socket:
        s = socket.socket(af, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0" if fam == 4 else "::", 15001))
        s.listen(8)
        s.settimeout(5)
        return s

    def client() -> None:
        with socket.create_connection((server, 8080), timeout=5) as c:
            c.sendall(b"short request")

    with installed(pod, RedirectConfig(), backend):
        lsock = in_netns(pod.name, listen)
        try:
            in_netns(pod.name, client)
            time.sleep(0.2)  # the client's FIN is acked: its socket is gone from the kernel's view
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(5)
                assert original_dst(conn) == (server, 8080)
                assert conn.recv(100) == b"short request"
        finally:
            lsock.close()


# --------------------------------------------------------------------------- forwarded from a tun device

TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _tcp4(src: str, dst: str, sport: int, dport: int, seq: int, ack: int, flags: int, data: bytes = b"") -> bytes:
    """An IPv4 TCP segment, checksums right."""
    import struct

    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, 65535, 0, 0) + data
    tcp = tcp[:16] + _csum(s + d + struct.pack("!BBH", 0, 6, len(tcp)) + tcp).to_bytes(2, "big") + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0, 64, 6, 0, s, d)
    return ip[:10] + _csum(ip).to_bytes(2, "big") + ip[12:] + tcp


def test_forwarded_traffic_from_a_tun_device_lands_on_the_inbound_port(pod: Pod, backend: str) -> None:
    """An interface without a link-layer header (a tun device, as VPN pods have) that the pod
    forwards on: a client behind it connecting to a host beyond the pod lands on the proxy's inbound
    listener with its original destination, and the replies come back from that destination, as
    with netfilter's nat PREROUTING (eBPF: its tc programs find the IP header at the start)."""
    import fcntl
    import select
    import struct

    client, dst = ("10.77.0.2", 40000), ("192.0.2.10", 80)
    with rnetns.enter(pod.name):
        tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(tun, TUNSETIFF, struct.pack("16sH", b"rdrtun0", IFF_TUN | IFF_NO_PI))
        subprocess.run(["ip", "-n", pod.name, "addr", "add", "10.77.0.1/24", "dev", "rdrtun0"], check=True)
        subprocess.run(["ip", "-n", pod.name, "link", "set", "rdrtun0", "up"], check=True)
        set_forwarding(pod.name, True)

        def reply_to(segment: bytes) -> bytes | None:
            """What comes back out of the tun device for the client, within 5 s."""
            os.write(tun, segment)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if not select.select([tun], [], [], 0.2)[0]:
                    continue
                pkt = os.read(tun, 65535)
                if len(pkt) >= 40 and pkt[0] >> 4 == 4 and pkt[9] == 6 and pkt[16:20] == socket.inet_aton(client[0]):
                    return pkt
            return None

        with installed(pod, None, backend), listeners((pod.name, 15006, 4, "proxy-in")) as L:
            assert redirect.check(pod.name, None, backend=backend).ok
            if backend == "ebpf":
                assert tc_filters(pod.name, "rdrtun0") == OUR_TC
            synack = reply_to(_tcp4(client[0], dst[0], client[1], dst[1], 1000, 0, 0x02))
            assert synack is not None, "no answer to the SYN: not captured"
            ihl = (synack[0] & 0xF) * 4
            sport, dport, seq, ack, _off, flags = struct.unpack("!HHIIBB", synack[ihl:ihl + 14])
            assert (socket.inet_ntoa(synack[12:16]), sport, dport) == (dst[0], dst[1], client[1])
            assert flags & 0x12 == 0x12 and ack == 1001
            assert _csum(synack[:ihl]) == 0  # the rewritten header's checksum holds
            os.write(tun, _tcp4(client[0], dst[0], client[1], dst[1], 1001, seq + 1, 0x10))
            os.write(tun, _tcp4(client[0], dst[0], client[1], dst[1], 1001, seq + 1, 0x18, b"hi\n"))
            (conn,) = L["proxy-in"].wait_for(1, timeout=10)
            assert conn.orig_dst == dst and conn.peer == client and conn.line == "hi", conn
    finally:
        os.close(tun)
