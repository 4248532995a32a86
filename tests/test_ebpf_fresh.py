"""The eBPF backend's one-call setup of a fresh pod (native/pod_setup.c, redirect/backends/ebpf/pod/fresh.py):
it writes what the general path writes, from the lowering's entries, for every kind of pod; and it
tells a netns that may hold netfilter capture of ours by the run dir's marks (redirect.locks),
asking the kernel for netfilter tables only then."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from redirect import api
from redirect.backends import ebpf
from redirect.backends.ebpf.abi import F_FWMARK_ACCEPT_OURS
from redirect.backends.ebpf.host import pod_link
from redirect.backends.ebpf.pod.entries import policy_core, policy_flags
from redirect.config import RedirectConfig
from redirect.errors import SetupError
from redirect.kernel import locks, routes
from redirect.kernel import netns as rnetns
from redirect.plan.intent import intent_for
from tests import netkit
from tests.netkit import Pod, TcpListener, landing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


FWMARK_ACCEPT = "/proc/sys/net/ipv4/tcp_fwmark_accept"


def _fwmark_accept() -> int:
    with open(FWMARK_ACCEPT) as f:
        return int(f.read())


def _snapshot(ns: str, root: str) -> dict[str, object]:
    """What the netns has of ours: its policy (and whether it records ``tcp_fwmark_accept`` as
    ours), entries, link, addresses, policy routes, and that sysctl."""
    h = ebpf.host(root)  # (loaded if it is not yet)
    assert h is not None
    with rnetns.enter(ns):
        cookie = ebpf.current_netns_cookie()
        st = h.store.read(cookie)
        ours = routes.read_ours()
        fwmark = _fwmark_accept()
    return {"entries": st.entries, "policy": None if st.policy is None else policy_core(st.policy),
            "fwmark_ours": st.policy is not None and bool(policy_flags(st.policy) & F_FWMARK_ACCEPT_OURS),
            "link": os.path.exists(pod_link(root, cookie)), "addresses": ours.addresses, "routes": ours.routes,
            "fwmark_accept": fwmark}


#: Sidecar; ambient (policy routes, tcp_fwmark_accept), also without inbound capture (routes only);
#: TPROXY (its own policy routes and the sysctl).
CONFIGS = {"sidecar": RedirectConfig(), "ambient": RedirectConfig(mode="ambient"),
           "ambient-no-inbound": RedirectConfig(mode="ambient", bypass_inbound_capture=True),
           "tproxy": RedirectConfig(inbound_interception="TPROXY")}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("ipv6", ["lo-only", "lo-only-ipv6-off", "own-ipv6"])
def test_a_fresh_pod_of_any_kind_gets_what_the_general_path_writes(ebpf_root: str, make_pod, ipv6: str,
                                                                   config: str) -> None:
    """A netns with lo alone (IPv6 on or off: no address of its own, no ``::6``) or with an IPv6
    address of its own (``::6`` added, and one of its own), in each mode: the one call and the
    general path write the same, key for key, route for route (ambient and TPROXY: the policy
    routes of the families captured, and ``tcp_fwmark_accept`` turned on, recorded as ours)."""
    ebpf.host(ebpf_root)
    if ipv6 == "own-ipv6":
        ns = make_pod().name
    else:
        ns = netkit.create_netns(f"{netkit.PREFIX}{os.urandom(4).hex()}")
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        if ipv6 == "lo-only-ipv6-off":
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
                           check=True)
    cfg = CONFIGS[config]
    try:
        before = _snapshot(ns, ebpf_root)
        res = api.setup(ns, cfg, backend="ebpf")
        try:
            assert res.detail["path"] == "fresh" and res.changed
            assert res.families == ((4,) if ipv6 == "lo-only-ipv6-off" else (4, 6))
            fresh = _snapshot(ns, ebpf_root)
            sidecar = config in ("sidecar", "tproxy")
            assert bool(fresh["addresses"]) == (ipv6 == "own-ipv6" and sidecar), fresh["addresses"]
            routed = set(res.families) if config != "sidecar" else set()
            assert {r.family for r in fresh["routes"]} == routed, fresh["routes"]  # type: ignore[attr-defined]
            assert fresh["fwmark_accept"] == fresh["fwmark_ours"] == (config in ("ambient", "tproxy"))
            assert api.check(ns, cfg, backend="ebpf").ok
        finally:
            api.teardown(ns, backend="ebpf")
        assert _snapshot(ns, ebpf_root) == before
        impl = ebpf.EbpfBackend(root=ebpf_root)
        it = intent_for(cfg)
        try:
            with rnetns.enter(ns):
                gen = impl.apply(it, impl.detect_families(it))
            assert gen.detail["path"] == "general" and gen.families == res.families
            assert _snapshot(ns, ebpf_root) == fresh
        finally:
            api.teardown(ns, backend="ebpf")
    finally:
        if ipv6 != "own-ipv6":
            netkit.remove_netns(ns)


@pytest.mark.parametrize("config", ["sidecar", "ambient"])
def test_a_fresh_pods_call_says_where_its_time_went(ebpf_root: str, pod: Pod, config: str) -> None:
    """``ebpf.last_steps`` (the benchmark's breakdown): each step the call took has a time, the
    steps it did not take (a sidecar pod's routes and sysctl) none, and together they are the
    whole call."""
    ebpf.host(ebpf_root)
    res = api.setup(pod.name, CONFIGS[config], backend="ebpf")
    try:
        assert res.detail["path"] == "fresh"
        steps = ebpf.last_steps()
        assert steps is not None
        call = steps.pop("call")
        assert call == pytest.approx(res.detail["pod_ms"] * 1e3)
        taken = {"open", "enter", "scan", "fresh", "listener", "forwarding", "maps", "link", "policy", "leave"}
        if config == "ambient":
            taken |= {"sysctl", "routes"}
        assert {k for k, v in steps.items() if v > 0} - {"tc"} == taken, steps  # (tc: if the pod forwards)
        assert set(steps) == taken | {"sysctl", "routes", "tc"}
        assert sum(steps.values()) == pytest.approx(call, abs=1e-3)
    finally:
        api.teardown(pod.name, backend="ebpf")


def test_a_setup_of_a_netfilter_backend_marks_the_netns_first(ebpf_root: str, pod: Pod) -> None:
    _fd, ready = locks.netfilter_marks()
    assert ready
    inode = rnetns.netns_inode(pod.name)
    locks.unmark_netfilter(inode)  # (as if a netns gone that had this inode left none)
    try:
        api.setup(pod.name, RedirectConfig(), backend="nftables")
        assert locks.netfilter_mark(inode) == rnetns.netns_cookie(pod.name)
    finally:
        api.teardown(pod.name)


@pytest.mark.parametrize("mark", ["own", "stale"])
def test_a_mark_counts_only_for_the_netns_whose_cookie_it_holds(ebpf_root: str, pod: Pod, mark: str) -> None:
    """Inodes are reused as pods come and go, cookies never are: a mark with this netns's cookie
    sends its setup to look at the tables (with one there, the general path takes it); a mark with
    another netns's cookie (one gone that had this inode) is stale, and the one call goes on."""
    inode, cookie = rnetns.netns_inode(pod.name), rnetns.netns_cookie(pod.name)
    locks.mark_netfilter(inode, cookie if mark == "own" else cookie + 1)
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "add table inet theirs"], check=True)
    try:
        res = api.setup(pod.name, RedirectConfig(), backend="ebpf")
        assert res.detail["path"] == ("general" if mark == "own" else "fresh"), res.detail
    finally:
        api.teardown(pod.name)


@pytest.mark.parametrize("backend", ["nftables", "iptables-nft"])
def test_a_teardown_of_every_backends_capture_clears_the_mark(ebpf_root: str, pod: Pod, backend: str) -> None:
    """Pods come and go and their netns inodes are reused: a mark left by a torn down netfilter pod
    would send every later eBPF pod with that inode to look at its tables. A teardown without a
    backend removes every backend's capture and clears it (someone's own table stays, and is not
    ours); a teardown of one backend's capture keeps it."""
    inode, cookie = rnetns.netns_inode(pod.name), rnetns.netns_cookie(pod.name)
    api.setup(pod.name, RedirectConfig(), backend=backend)
    assert locks.netfilter_mark(inode) == cookie
    assert api.teardown(pod.name, backend=backend)
    assert locks.netfilter_mark(inode) == cookie
    api.setup(pod.name, RedirectConfig(), backend=backend)
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "add", "table", "inet", "someones"], check=True)
    assert api.teardown(pod.name)
    assert locks.netfilter_mark(inode) == 0
    assert "someones" in subprocess.run(["ip", "netns", "exec", pod.name, "nft", "list", "tables"], check=True,
                                        capture_output=True, text=True).stdout
    res = api.setup(pod.name, RedirectConfig(), backend="ebpf")
    assert res.detail["path"] == "fresh"
    api.teardown(pod.name)


def test_a_new_unmarked_pod_with_a_foreign_netfilter_table_is_fresh_and_the_table_untouched(
        ebpf_root: str, pod: Pod) -> None:
    """Netfilter tables that are not ours do not stop the one call: with no mark, no netfilter
    capture of ours can be there. (A marked netns with a table takes the general path, which
    replaces our netfilter capture: tests/test_backend_switch.py.)"""
    locks.unmark_netfilter(rnetns.netns_inode(pod.name))  # (as if a netns gone with this inode left none)
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "add table inet theirs"], check=True)
    out = TcpListener(pod.name, 15001, 4, label="proxy-out")
    app = TcpListener(pod.peer_name, 8080, 4, label="remote-app")
    with out, app:
        try:
            res = api.setup(pod.name, RedirectConfig(), backend="ebpf")
            assert res.detail["path"] == "fresh", res.detail
            assert landing(pod.name, pod.peer_ip4, 8080, out, app, uid=1000).listener is out
        finally:
            api.teardown(pod.name, backend="ebpf")
    listed = subprocess.run(["ip", "netns", "exec", pod.name, "nft", "list tables"], capture_output=True, text=True,
                            check=True).stdout
    assert "table inet theirs" in listed


OLDER = """
import os, sys
from redirect import api
from redirect.kernel import locks
fd, ready = locks.netfilter_marks()
res = api.setup(sys.argv[1], backend="ebpf")
print(ready, locks.netfilter_mark(int(sys.argv[2])) == locks.MARK_UNKNOWN, res.detail["path"])
"""


def test_a_pod_there_before_the_marks_with_a_netfilter_table_is_not_taken_as_fresh(ebpf_root: str, pod: Pod) -> None:
    """Netfilter capture made before the marks existed was not marked: the netns there when they
    are made are marked then (the pod's is bind-mounted), so its tables are looked at, and with
    one the general path takes it."""
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "add table inet theirs"], check=True)
    inode = rnetns.netns_inode(pod.name)
    with tempfile.TemporaryDirectory() as run_dir:  # marks made now: after the pod
        env = {**os.environ, "REDIRECT_RUN_DIR": os.path.join(run_dir, "redirect"), "REDIRECT_BPF_ROOT": ebpf_root}
        try:
            r = subprocess.run([sys.executable, "-c", OLDER, pod.name, str(inode)], env=env, cwd=REPO,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == ["True", "True", "general"], r.stdout
        finally:
            api.teardown(pod.name, backend="ebpf")


@pytest.mark.parametrize("config", ["ambient", "tproxy"])
@pytest.mark.parametrize("point", ["ebpf.before_entries", "ebpf.after_claim", "ebpf.before_policy"])
def test_a_fresh_pod_with_policy_routes_whose_setup_fails_is_left_as_it_was(
        ebpf_root: str, pod: Pod, config: str, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one call adds the policy routes first and reads ``tcp_fwmark_accept``; a failure in the
    pod's write after them (injected at each of its points) removes the routes again and leaves the
    sysctl off: the netns is as it was, and the next setup takes the one call again."""
    cfg = CONFIGS[config]
    before = _snapshot(pod.name, ebpf_root)
    monkeypatch.setenv("REDIRECT_FAULT", point)
    with pytest.raises(SetupError, match=f"injected fault at {point}"):
        api.setup(pod.name, cfg, backend="ebpf")
    assert _snapshot(pod.name, ebpf_root) == before
    monkeypatch.delenv("REDIRECT_FAULT")
    try:
        assert api.setup(pod.name, cfg, backend="ebpf").detail["path"] == "fresh"
    finally:
        api.teardown(pod.name, backend="ebpf")
    assert _snapshot(pod.name, ebpf_root) == before


@pytest.mark.parametrize("path", ["fresh", "general"])
def test_a_setup_that_fails_before_turning_tcp_fwmark_accept_on_has_it_recorded_and_the_next_one_turns_it_on(
        ebpf_root: str, pod: Pod, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sysctl is turned on after the policy, which records it as ours: a setup stopped between
    the two (one call, or the general path's change from a config without inbound capture) leaves
    capture on, the sysctl off and recorded; check says so, the next setup turns it on, and teardown
    off again."""
    cfg = CONFIGS["ambient"]
    before = _snapshot(pod.name, ebpf_root)
    if path == "general":
        api.setup(pod.name, CONFIGS["ambient-no-inbound"], backend="ebpf")
    monkeypatch.setenv("REDIRECT_FAULT", "ebpf.before_fwmark_accept")
    try:
        with pytest.raises(SetupError, match="injected fault at ebpf.before_fwmark_accept"):
            api.setup(pod.name, cfg, backend="ebpf")
        monkeypatch.delenv("REDIRECT_FAULT")
        mid = _snapshot(pod.name, ebpf_root)
        assert mid["policy"] is not None and mid["fwmark_ours"] and mid["fwmark_accept"] == 0 and mid["routes"]
        res = api.check(pod.name, cfg, backend="ebpf")
        assert not res.ok and any("tcp_fwmark_accept" in d for d in res.differences), res.differences
        again = api.setup(pod.name, cfg, backend="ebpf")
        assert again.changed and again.detail["path"] == "general"
        assert api.check(pod.name, cfg, backend="ebpf").ok and _snapshot(pod.name, ebpf_root)["fwmark_accept"] == 1
    finally:
        api.teardown(pod.name, backend="ebpf")
    assert _snapshot(pod.name, ebpf_root) == before


def test_a_fresh_pod_with_a_policy_route_of_ours_left_takes_the_general_path(ebpf_root: str, pod: Pod) -> None:
    """A route of ours already there (a setup killed after adding it) fails the one call's add:
    nothing of the call is left, the general path sets the pod up, and passes check."""
    cfg = CONFIGS["ambient"]
    before = _snapshot(pod.name, ebpf_root)
    with rnetns.enter(pod.name):
        routes.add_route(intent_for(cfg).routes[1])  # (the IPv6 one: the call's IPv4 adds are undone)
    try:
        res = api.setup(pod.name, cfg, backend="ebpf")
        assert res.detail["path"] == "general" and res.changed
        assert api.check(pod.name, cfg, backend="ebpf").ok
    finally:
        api.teardown(pod.name, backend="ebpf")
    assert _snapshot(pod.name, ebpf_root) == before


def test_a_fresh_pod_whose_policy_routes_fail_is_left_as_it_was(ebpf_root: str, pod: Pod) -> None:
    """With lo down the routes cannot be added (their rules can): the one call removes the rules it
    added and backs off, and the general path fails saying why; nothing is left."""
    cfg = CONFIGS["ambient"]
    subprocess.run(["ip", "-n", pod.name, "link", "set", "lo", "down"], check=True)
    try:
        before = _snapshot(pod.name, ebpf_root)
        with pytest.raises(SetupError, match="lo is down"):
            api.setup(pod.name, cfg, backend="ebpf")
        assert _snapshot(pod.name, ebpf_root) == before
    finally:
        subprocess.run(["ip", "-n", pod.name, "link", "set", "lo", "up"], check=True)
