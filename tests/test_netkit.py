"""The test kit itself, against the real kernel: pods, listeners, probes, cleanup."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from typing import Any

import pytest

from redirect.kernel import netlink
from redirect.kernel import netns as rnetns
from tests import netkit
from tests.kit import secctx
from tests.netkit import (
    Pod,
    TcpListener,
    UdpListener,
    in_netns,
    landing,
    tcp_probe,
    tcp_probe_detail,
    udp_probe,
    udp_probe_detail,
)

pytestmark = pytest.mark.timeout(30)


def _links(ns: str) -> dict[str, list[str]]:
    """ifname -> addresses in ``ns``."""

    def read() -> dict[str, list[str]]:
        names = netlink.link_names()
        out: dict[str, list[str]] = {n: [] for n in names.values()}
        for _family, index, address in netlink.addresses():
            out[names[index]].append(address)
        return out

    return in_netns(ns, read)


def test_pod_has_two_namespaces_joined_by_a_veth(pod: Pod) -> None:
    assert pod.name.startswith("rdrt-") and pod.peer_name == pod.name + "-peer"
    assert os.path.exists(pod.path) and os.path.exists(pod.peer_path)
    assert rnetns.netns_inode(pod.name) != rnetns.netns_inode(pod.peer_name)
    mine, peer = _links(pod.name), _links(pod.peer_name)
    assert set(mine) == {"lo", pod.pod_if} and set(peer) == {"lo", pod.peer_if}
    assert {pod.pod_ip4, pod.pod_ip6} <= set(mine[pod.pod_if])
    assert {pod.peer_ip4, pod.peer_ip6} <= set(peer[pod.peer_if])


def test_pod_addresses_are_written_as_the_kernel_writes_them() -> None:
    # Listeners report inet_ntop's text, so fd00:16:0::1 must be spelled fd00:16::1.
    link = netkit.link_for(1, (22, 0))
    assert (link.pod_if, link.peer_if) == ("eth1", "peer1")
    assert (link.pod_ip4, link.peer_ip4, link.pod_ip6, link.peer_ip6) == (
        "10.22.0.2",
        "10.22.0.1",
        "fd00:16::2",
        "fd00:16::1",
    )
    assert (link.subnet4, link.subnet6) == ("10.22.0.0/24", "fd00:16::/64")


def test_extra_iface_is_a_second_veth_to_the_same_peer(pod_with_extra_iface: Pod) -> None:
    pod = pod_with_extra_iface
    extra = pod.extra
    assert extra is not None and extra.pod_if == "eth1"
    assert extra.subnet4 != pod.main.subnet4 and extra.subnet6 != pod.main.subnet6
    assert extra.pod_ip4 in _links(pod.name)["eth1"]
    with TcpListener(pod.peer_name, 8080, label="peer") as peer:
        hit = landing(pod.name, extra.peer_ip4, 8080, peer, src=extra.pod_ip4)
        assert hit.label == "peer"
        assert hit.peer is not None and hit.peer[0] == extra.pod_ip4


@pytest.mark.parametrize("family", [4, 6])
def test_tcp_probe_reaches_the_peer_listener(pod: Pod, family: int) -> None:
    dst = pod.peer_ip(family)
    with TcpListener(pod.peer_name, 8080, family=family, label="peer-app") as app:
        hit = landing(pod.name, dst, 8080, app)
        assert hit.label == "peer-app"
        assert hit.listener is app and app.last == hit.conn
        assert hit.local == (dst, 8080)
        assert hit.peer == hit.result.local and hit.peer is not None and hit.peer[0] == pod.pod_ip(family)
        # Without NAT, SO_ORIGINAL_DST answers from conntrack: the real destination when
        # conntrack tracks the netns, an error (None) when nothing made it active there.
        assert hit.orig_dst in (None, (dst, 8080))


def test_orig_dst_is_the_real_destination_once_conntrack_is_active(pod: Pod) -> None:
    # A nat chain alone (nft, iptables-nft or iptables-legacy) does not make the kernel track
    # connections in a netns; a rule using conntrack does. (nft 1.0.6 also wants a newline,
    # not just "}", after a chain block.)
    ct = "table ip rdrt_kit {\n chain in { type filter hook input priority 0; ct state new accept; }\n}\n"
    subprocess.run(
        ["ip", "netns", "exec", pod.peer_name, "nft", "-f", "-"], input=ct, text=True, check=True, timeout=10
    )
    with TcpListener(pod.peer_name, 8080) as app:
        hit = landing(pod.name, pod.peer_ip4, 8080, app)
        assert hit.orig_dst == (pod.peer_ip4, 8080)


def test_orig_dst_fails_in_a_netns_without_conntrack(pod: Pod) -> None:
    with TcpListener(pod.peer_name, 8080) as app:
        assert landing(pod.name, pod.peer_ip4, 8080, app).orig_dst is None


def test_probe_to_a_closed_port_is_refused_quickly(pod: Pod) -> None:
    r = tcp_probe_detail(pod.name, pod.peer_ip4, 9)
    assert r.label is None and r.error == "refused" and r.elapsed < 0.5
    assert udp_probe_detail(pod.name, pod.peer_ip4, 9).error == "refused"


def test_probe_to_a_silent_address_times_out(pod: Pod) -> None:
    # 10.R.x.3 is on the pod's subnet but nobody has it: ARP fails, nothing answers.
    silent = pod.peer_ip4.rsplit(".", 1)[0] + ".3"
    r = tcp_probe_detail(pod.name, silent, 80, timeout=0.3)
    assert r.label is None and r.error in ("timeout", "unreachable")


@pytest.mark.parametrize("fork", [False, True], ids=["thread", "fork"])
def test_uid_probe_runs_as_that_uid_and_gid(pod: Pod, fork: bool) -> None:
    with TcpListener(pod.peer_name, 8080, label="app") as app:
        r = tcp_probe_detail(pod.name, pod.peer_ip4, 8080, uid=1337, gid=1337, fork=fork)
        assert r.label == "app", r.error
        assert r.creds == (1337,) * 6 and r.groups == ()
        assert r.seen_by(app) is not None
        only_gid = tcp_probe_detail(pod.name, pod.peer_ip4, 8080, gid=4242, fork=fork)
        assert only_gid.label == "app" and only_gid.creds == (0, 0, 0, 4242, 4242, 4242)
        assert tcp_probe_detail(pod.name, pod.peer_ip4, 8080).creds == (0, 0, 0, 0, 0, 0)
    assert os.getresuid() == (0, 0, 0) and os.getresgid() == (0, 0, 0)  # only the probe dropped


@pytest.mark.parametrize("fork", [False, True], ids=["thread", "fork"])
def test_netfilter_owner_match_sees_the_probe_uid_and_gid(pod: Pod, fork: bool) -> None:
    rules = (
        "table inet rdrt_kit {\n chain out { type filter hook output priority 0;"
        " meta skuid 1337 tcp dport 8080 reject with tcp reset;"
        " meta skgid 4242 tcp dport 8080 reject with tcp reset; }\n}\n"
    )
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "-f", "-"], input=rules, text=True, check=True, timeout=10)
    with TcpListener(pod.peer_name, 8080, label="app"):
        assert tcp_probe(pod.name, pod.peer_ip4, 8080) == "app"
        assert tcp_probe(pod.name, pod.peer_ip4, 8080, uid=1000, gid=1000, fork=fork) == "app"
        assert tcp_probe_detail(pod.name, pod.peer_ip4, 8080, uid=1337, gid=1337, fork=fork).error == "refused"
        assert tcp_probe_detail(pod.name, pod.peer_ip6, 8080, gid=4242, fork=fork).error == "refused"


def test_uid_probe_reports_refusal_too(pod: Pod) -> None:
    r = tcp_probe_detail(pod.name, pod.peer_ip4, 9, uid=1337, gid=1337)
    assert r.label is None and r.error == "refused" and r.creds == (1337,) * 6


@pytest.mark.parametrize("family", [4, 6])
def test_udp_probe_reaches_the_peer_listener(pod: Pod, family: int) -> None:
    dst = pod.peer_ip(family)
    with UdpListener(pod.peer_name, 5353, family=family, label="dns") as dns:
        assert udp_probe(pod.name, dst, 5353) == "dns"
        c = dns.wait_for(1)[0]
        assert c.proto == "udp" and c.local == (dst, 5353) and c.orig_dst == (dst, 5353)
        assert c.peer[0] == pod.pod_ip(family)
        peer_if_index = in_netns(pod.peer_name, lambda: netlink.link_index(pod.peer_if))
        assert c.ifindex == peer_if_index
        assert udp_probe(pod.name, dst, 5353, uid=1337, gid=1337) == "dns"


def test_udp_listener_answers_from_the_address_it_was_sent_to(pod: Pod) -> None:
    # Bound to 0.0.0.0 and asked on 127.0.0.1 and on the pod address: a connected client only
    # accepts the answer if its source is the address it sent to.
    with UdpListener(pod.name, 5353, label="local") as lst:
        assert udp_probe(pod.name, "127.0.0.1", 5353) == "local"
        assert udp_probe(pod.name, pod.pod_ip4, 5353) == "local"
        assert [c.local[0] for c in lst.conns] == ["127.0.0.1", pod.pod_ip4]


def test_listener_options_transparent_and_mark(pod: Pod) -> None:
    # IP_TRANSPARENT lets a socket bind an address the netns doesn't have (TPROXY style).
    with TcpListener(pod.name, 15001, host="192.0.2.10", transparent=True) as t:
        assert t.port == 15001
    with TcpListener(pod.name, 0, family=6, transparent=True, mark=0x539, label="ztunnel") as z:
        assert z.port > 0
        assert tcp_probe(pod.name, "::1", z.port, mark=0x539) == "ztunnel"


def test_bind_errors_are_raised_by_the_listener(pod: Pod) -> None:
    with TcpListener(pod.name, 8080), pytest.raises(OSError, match="listener .*bind"):
        TcpListener(pod.name, 8080, host="192.0.2.10").start()  # not local, not transparent


def test_in_netns_returns_results_and_reraises(pod: Pod) -> None:
    assert in_netns(pod.name, rnetns.current_inode) == rnetns.netns_inode(pod.name)
    assert rnetns.current_inode() != rnetns.netns_inode(pod.name)

    def boom() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        in_netns(pod.name, boom)


def test_namespaces_vanish_after_teardown_even_on_error() -> None:
    with pytest.raises(RuntimeError), netkit.make_pod(extra_iface=True) as pod:
        assert {pod.name, pod.peer_name} <= netkit.existing_namespaces()
        raise RuntimeError("test body failed")
    assert not {pod.name, pod.peer_name} & netkit.existing_namespaces()
    assert not {pod.name, pod.peer_name} & netkit.live_namespaces()


def test_several_pods_are_isolated(pod_pair: tuple[Pod, Pod]) -> None:
    a, b = pod_pair
    assert a.main.subnet4 != b.main.subnet4
    with TcpListener(b.peer_name, 8080, label="b-peer"):
        assert tcp_probe(b.name, b.peer_ip4, 8080) == "b-peer"
        assert tcp_probe(a.name, b.peer_ip4, 8080, timeout=0.3) is None


def test_probe_speed(pod: Pod) -> None:
    with TcpListener(pod.peer_name, 8080) as app:
        tcp_probe(pod.name, pod.peer_ip4, 8080)

        def median_ms(**kw: Any) -> float:
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                assert tcp_probe(pod.name, pod.peer_ip4, 8080, **kw) == app.label
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1000

        plain, as_uid, forked = median_ms(), median_ms(uid=1337, gid=1337), median_ms(uid=1337, fork=True)
        print(f"\nprobe median: plain {plain:.2f} ms, as uid {as_uid:.2f} ms, as uid forked {forked:.2f} ms")
        assert plain < 20 and as_uid < 20 and forked < 100


@pytest.mark.parametrize("family", [4, 6])
def test_the_kit_sees_what_a_redirect_does(pod: Pod, family: int) -> None:
    # A plain nft REDIRECT in the pod, to check the kit's reading of SO_ORIGINAL_DST (both
    # families) and that a UDP answer survives reverse NAT to a connected client.
    rules = (
        "table inet rdrt_kit {\n chain out { type nat hook output priority -100;"
        " tcp dport 8080 redirect to :15001; udp dport 53 redirect to :15053; }\n}\n"
    )
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "-f", "-"], input=rules, text=True, check=True, timeout=10)
    dst = pod.peer_ip(family)
    with (
        TcpListener(pod.name, 15001, family=family, label="proxy-out") as proxy,
        TcpListener(pod.peer_name, 8080, family=family, label="app") as app,
        UdpListener(pod.name, 15053, family=family, label="dns-proxy") as dns,
    ):
        hit = landing(pod.name, dst, 8080, proxy, app)
        assert hit.label == "proxy-out" and hit.listener is proxy
        assert hit.orig_dst == (dst, 8080)
        assert hit.local == ("127.0.0.1" if family == 4 else "::1", 15001)
        udp = landing(pod.name, dst, 53, dns, proto="udp")
        assert udp.label == "dns-proxy" and udp.local is not None and udp.local[1] == 15053


def test_transparent_listener_sees_the_original_destination_under_tproxy(pod: Pod) -> None:
    rules = (
        "table ip rdrt_kit {\n chain pre { type filter hook prerouting priority mangle;"
        " tcp dport 9080 tproxy to :15006 meta mark set 1337 accept; }\n}\n"
    )
    ns = ["ip", "netns", "exec", pod.name]
    subprocess.run([*ns, "nft", "-f", "-"], input=rules, text=True, check=True, timeout=10)
    subprocess.run([*ns, "ip", "rule", "add", "fwmark", "1337", "lookup", "133"], check=True, timeout=10)
    subprocess.run([*ns, "ip", "route", "add", "local", "default", "dev", "lo", "table", "133"], check=True, timeout=10)
    with TcpListener(pod.name, 15006, transparent=True, label="proxy-in") as proxy:
        hit = landing(pod.peer_name, pod.pod_ip4, 9080, proxy)
        assert hit.label == "proxy-in"
        assert hit.local == (pod.pod_ip4, 9080)
        assert hit.peer is not None and hit.peer[0] == pod.peer_ip4


# --- security contexts --------------------------------------------------------------------------

SECURITY_CONTEXTS = [
    ({"runAsUser": 0, "allowPrivilegeEscalation": False,
      "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}}, {"NET_ADMIN", "NET_RAW"}),
    ({"runAsUser": 0}, secctx.CONTAINERD_DEFAULT_CAPS),
    ({"runAsUser": 0, "capabilities": {"drop": ["NET_RAW", "cap_mknod"]}},
     secctx.CONTAINERD_DEFAULT_CAPS - {"NET_RAW", "MKNOD"}),
    ({"privileged": True}, None),  # every capability of the kernel
    ({"runAsUser": 0, "capabilities": {"add": ["ALL"], "drop": ["SYS_ADMIN"]}}, "all but SYS_ADMIN"),
    ({"runAsUser": 1337, "runAsGroup": 1337, "allowPrivilegeEscalation": False,
      "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}}, {"NET_ADMIN"}),
]


@pytest.mark.parametrize("sc,caps", SECURITY_CONTEXTS, ids=range(len(SECURITY_CONTEXTS)))
def test_a_security_context_runs_as_a_runtime_runs_it(sc: dict[str, Any], caps: Any) -> None:
    """``secctx.creds_of`` (the runtime's translation) and ``Creds.setpriv`` give a process exactly
    those credentials: the bounding set is the granted one, effective too for root and empty for
    another user (no ambient capabilities), no_new_privs as asked."""
    want_caps = (secctx.kernel_caps() if caps is None else
                 secctx.kernel_caps() - {"SYS_ADMIN"} if caps == "all but SYS_ADMIN" else frozenset(caps))
    creds = secctx.creds_of({"name": "c", "securityContext": sc}, {"securityContext": {"supplementalGroups": [5]}})
    assert creds.bounding == want_caps and creds.uid == sc.get("runAsUser", 0)
    p = subprocess.run([*creds.setpriv(), "cat", "/proc/self/status"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    status = p.stdout.splitlines()
    caps_of = {k: int(v, 16) for k, v in (ln.split(":\t") for ln in status if ln.startswith("Cap"))}
    seen = {k: frozenset(n for i, n in enumerate(secctx.NAMES) if caps_of[k] >> i & 1) for k in caps_of}
    assert seen["CapBnd"] == creds.bounding and seen["CapEff"] == seen["CapPrm"] == creds.effective
    assert seen["CapInh"] == seen["CapAmb"] == frozenset()
    assert ("NoNewPrivs:\t1" in status) == creds.no_new_privs == (sc.get("allowPrivilegeEscalation") is False)
    assert f"Uid:\t{creds.uid}\t{creds.uid}\t{creds.uid}\t{creds.uid}" in status
    assert "Groups:\t5 " in status or "Groups:\t5" in status
    if sc.get("runAsUser") == 1337:
        assert creds.effective == frozenset()  # granted, but a non-root container process has none
    with pytest.raises(ValueError, match="capability"):
        secctx.creds_of({"name": "c", "securityContext": {"capabilities": {"add": ["NO_SUCH"]}}})
