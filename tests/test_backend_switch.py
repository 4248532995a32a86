"""One backend's capture per netns: ``show``, ``check`` and ``teardown`` without a backend find
what is installed, whichever backend put it there, and a setup with another backend replaces it.

Every pair of backends, with real traffic: captured after the switch, captured by the new
backend alone (tearing the new one down leaves the pod uncaptured), and uncaptured after a
teardown that names no backend. The eBPF backend's host programs go to a scratch root of this
module, removed at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

import redirect
from redirect.config import RedirectConfig
from redirect.kernel import netns as rnetns
from redirect.plan.intent import intent_for
from tests.netkit import Pod, TcpListener, landing

CFG = RedirectConfig()
T = 5.0



@contextlib.contextmanager
def listeners(pod: Pod) -> Iterator[dict[str, TcpListener]]:
    """The proxy's outbound and inbound listeners and an app in the pod, an app in the peer (IPv4)."""
    ls = {
        "out": TcpListener(pod.name, 15001, 4, label="proxy-out"),
        "in": TcpListener(pod.name, 15006, 4, label="proxy-in"),
        "podapp": TcpListener(pod.name, 8080, 4, label="pod-app"),
        "app": TcpListener(pod.peer_name, 8080, 4, label="remote-app"),
    }
    with contextlib.ExitStack() as st:
        for x in ls.values():
            st.enter_context(x)
        yield ls


def assert_captured(pod: Pod, ls: dict[str, TcpListener]) -> None:
    hit = landing(pod.name, pod.peer_ip4, 8080, *ls.values(), uid=1000, timeout=T)
    assert hit.listener is ls["out"] and hit.orig_dst == (pod.peer_ip4, 8080), hit.result
    hit = landing(pod.peer_name, pod.pod_ip4, 8080, *ls.values(), timeout=T)
    assert hit.listener is ls["in"], hit.result


def assert_not_captured(pod: Pod, ls: dict[str, TcpListener]) -> None:
    assert landing(pod.name, pod.peer_ip4, 8080, *ls.values(), uid=1000, timeout=T).listener is ls["app"]
    assert landing(pod.peer_name, pod.pod_ip4, 8080, *ls.values(), timeout=T).listener is ls["podapp"]


def kind(name: str | None) -> str | None:
    return None if name is None else "iptables" if name.startswith("iptables") else name


PAIRS = [("iptables", "nftables"), ("nftables", "iptables"), ("iptables", "ebpf"), ("ebpf", "iptables"),
         ("nftables", "ebpf"), ("ebpf", "nftables"), ("iptables-legacy", "ebpf"), ("ebpf", "iptables-legacy")]


@pytest.mark.parametrize("first,second", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_setup_with_another_backend_replaces_the_old_capture(
    request: pytest.FixtureRequest, pod: Pod, first: str, second: str
) -> None:
    if "ebpf" in (first, second):
        request.getfixturevalue("ebpf_root")
    with listeners(pod) as ls:
        try:
            redirect.setup(pod.name, CFG, backend=first)
            assert kind(redirect.show(pod.name)["backend"]) == kind(first)
            assert_captured(pod, ls)

            res = redirect.setup(pod.name, CFG, backend=second)
            assert kind(res.backend) == kind(second) and res.changed
            shown = redirect.show(pod.name)
            assert [kind(b) for b in shown["backends"]] == [kind(second)] and "also_installed" not in shown
            assert not redirect.show(pod.name, backend=first)["installed"]
            checked = redirect.check(pod.name, CFG)
            assert checked.ok and kind(checked.backend) == kind(second), checked.differences
            assert_captured(pod, ls)
            assert not redirect.setup(pod.name, CFG, backend=second).changed

            # The new backend's capture is all there is: without it the pod is not captured.
            assert redirect.teardown(pod.name, backend=second)
            assert not redirect.show(pod.name)["installed"]
            assert_not_captured(pod, ls)
        finally:
            redirect.teardown(pod.name)


@pytest.mark.parametrize("backend", ["iptables", "iptables-legacy", "nftables", "ebpf"])
def test_show_check_and_teardown_without_a_backend_find_any(
    request: pytest.FixtureRequest, pod: Pod, backend: str
) -> None:
    if backend == "ebpf":
        request.getfixturevalue("ebpf_root")
        # A fresh pod (no proxy listening yet, no netfilter table) still takes the one-call path.
        assert redirect.setup(pod.name, CFG, backend=backend).detail["path"] == "fresh"
        assert redirect.teardown(pod.name)
    with listeners(pod) as ls:
        try:
            redirect.setup(pod.name, CFG, backend=backend)
            shown = redirect.show(pod.name)
            assert shown["installed"] and kind(shown["backend"]) == kind(backend)
            assert redirect.check(pod.name, CFG).ok
            drift = redirect.check(pod.name, RedirectConfig(outbound_exclude_ports=(9999,)))
            assert not drift.ok and kind(drift.backend) == kind(backend)
            assert_captured(pod, ls)
            assert redirect.teardown(pod.name)
            assert_not_captured(pod, ls)
            assert not redirect.show(pod.name)["installed"] and redirect.show(pod.name)["backend"] is None
            nothing = redirect.check(pod.name, CFG)
            assert not nothing.ok and "no capture of ours" in nothing.differences[0]
            assert not redirect.teardown(pod.name)
        finally:
            redirect.teardown(pod.name)


def test_two_backends_left_by_an_interrupted_switch_are_shown_checked_and_torn_down(
    ebpf_root: str, pod: Pod
) -> None:
    from redirect.backends import ebpf

    with listeners(pod) as ls:
        try:
            redirect.setup(pod.name, CFG, backend="nftables")
            # eBPF capture put in beside it without the switch's second step (as a setup killed
            # between the two would leave it).
            impl, it = ebpf.EbpfBackend(), intent_for(CFG)
            with rnetns.enter(pod.name):
                impl.apply(it, impl.detect_families(it))
            shown = redirect.show(pod.name)
            assert shown["backends"] == ["nftables", "ebpf"] and "ebpf" in shown["also_installed"]
            checked = redirect.check(pod.name, CFG)
            assert not checked.ok and any("ebpf backend is installed too" in d for d in checked.differences)
            assert_captured(pod, ls)
            # A setup repairs it: one backend left.
            assert redirect.setup(pod.name, CFG, backend="nftables").changed
            assert redirect.show(pod.name)["backends"] == ["nftables"]
            with rnetns.enter(pod.name):
                impl.apply(it, impl.detect_families(it))
            assert redirect.teardown(pod.name)
            assert redirect.show(pod.name)["backends"] == []
            assert_not_captured(pod, ls)
        finally:
            redirect.teardown(pod.name)


def test_cli_without_backend_shows_and_tears_down_what_is_installed(ebpf_root: str, pod: Pod) -> None:
    import subprocess
    import sys

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "redirect.cli", *argv], capture_output=True, text=True,
                              timeout=60)

    try:
        assert run("setup", pod.name, "--backend", "ebpf").returncode == 0
        out = run("show", pod.name).stdout
        assert "installed by the ebpf backend" in out, out
        assert run("check", pod.name).returncode == 0
        p = run("teardown", pod.name)
        assert p.returncode == 0 and "removed" in p.stdout, p.stdout
        assert "nothing of ours installed" in run("show", pod.name).stdout
    finally:
        redirect.teardown(pod.name)


@pytest.mark.parametrize("first", ["iptables", "iptables-legacy", "nftables"])
def test_the_one_call_ebpf_path_replaces_netfilter_capture_too(ebpf_root: str, pod: Pod, first: str) -> None:
    """No proxy listening yet: the eBPF setup would be the one native call for a fresh pod; a pod
    with netfilter capture is not one (the call finds a netfilter table and backs off)."""
    out = TcpListener(pod.name, 15001, 4, label="proxy-out")
    app = TcpListener(pod.peer_name, 8080, 4, label="remote-app")
    with out, app:
        try:
            redirect.setup(pod.name, CFG, backend=first)
            res = redirect.setup(pod.name, CFG, backend="ebpf")
            assert redirect.show(pod.name)["backends"] == ["ebpf"]
            assert res.detail["path"] == "general" and res.changed
            hit = landing(pod.name, pod.peer_ip4, 8080, out, app, uid=1000, timeout=T)
            assert hit.listener is out and hit.orig_dst == (pod.peer_ip4, 8080), hit.result
            assert redirect.teardown(pod.name, backend="ebpf")
            assert landing(pod.name, pod.peer_ip4, 8080, out, app, uid=1000, timeout=T).listener is app
        finally:
            redirect.teardown(pod.name)


def test_cni_del_removes_capture_of_any_backend(ebpf_root: str, pod: Pod) -> None:
    """The conflist's backend changed between a pod's ADD and its DEL: the DEL still removes it."""
    import json
    import subprocess
    import sys

    plugin = os.path.join(os.path.dirname(sys.executable), "redirect-cni")

    def cni(command: str, backend: str) -> int:
        conf = {"cniVersion": "1.0.0", "name": "rdrt-switch", "type": "redirect-cni", "backend": backend,
                "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": f"{pod.pod_ip4}/24"}]}}
        env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": command, "CNI_CONTAINERID": "c1",
               "CNI_NETNS": pod.path, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni", "REDIRECT_BPF_ROOT": ebpf_root}
        return subprocess.run([plugin], input=json.dumps(conf).encode(), env=env, capture_output=True,
                              timeout=60).returncode

    from redirect.backends import ebpf

    try:
        assert cni("ADD", "ebpf") == 0
        assert redirect.show(pod.name)["backends"] == ["ebpf"]
        assert cni("DEL", "iptables") == 0
        assert redirect.show(pod.name)["backends"] == [] and ebpf.registered_pods(ebpf_root) == []
    finally:
        redirect.teardown(pod.name)


def _ours_in(ns: str, variant: str) -> str:
    """Our chains and jumps in both families of ``variant`` (its ``*-save`` lines naming ``RDR``)."""
    import subprocess

    out = []
    for tool in (f"iptables-{variant}-save", f"ip6tables-{variant}-save"):
        p = subprocess.run(["ip", "netns", "exec", ns, tool], capture_output=True, text=True, check=True)
        out += [ln for ln in p.stdout.splitlines() if "RDR" in ln]
    return "\n".join(out)


@pytest.mark.parametrize("how", ["forced", "detected"])
def test_a_change_of_iptables_variant_removes_ours_from_the_old_one(pod: Pod, how: str) -> None:
    """Setup with the other iptables variant (forced, or chosen because legacy tables appeared)
    puts the new config in there, then removes ours from the old variant: the old config's rules
    would decide first there (port 22 still captured). ``check`` names ours left in the other
    variant."""
    import subprocess

    from redirect.backends.iptables_rules import add_payload, desired_state
    from redirect.plan import netfilter_plan

    new = RedirectConfig(outbound_exclude_ports=(22,))
    with listeners(pod) as ls, TcpListener(pod.peer_name, 22, 4, label="remote-ssh") as ssh:
        try:
            redirect.setup(pod.name, CFG, backend="iptables-nft")
            assert _ours_in(pod.name, "nft") and not _ours_in(pod.name, "legacy")
            if how == "forced":
                res = redirect.setup(pod.name, new, backend="iptables-legacy")
            else:  # a legacy table appears: the detection now picks legacy
                subprocess.run(["ip", "netns", "exec", pod.name, "iptables-legacy", "-L", "-n"], check=True,
                               capture_output=True)
                res = redirect.setup(pod.name, new, backend="iptables")
            assert res.changed and res.detail["variant"] == "legacy"
            assert _ours_in(pod.name, "legacy") and not _ours_in(pod.name, "nft")
            assert redirect.check(pod.name, new, backend=res.backend).ok
            assert not redirect.setup(pod.name, new, backend=res.backend).changed
            hit = landing(pod.name, pod.peer_ip4, 22, ssh, *ls.values(), uid=1000, timeout=T)
            assert hit.listener is ssh, hit.result
            assert_captured(pod, ls)

            # Ours in both variants (as a setup before this fix left it): check names the other one.
            plan = netfilter_plan(intent_for(CFG))
            for fam, tool in ((4, "iptables-nft-restore"), (6, "ip6tables-nft-restore")):
                subprocess.run(["ip", "netns", "exec", pod.name, tool, "--noflush"], check=True, capture_output=True,
                               text=True, input=add_payload(desired_state(plan, fam)))
            res2 = redirect.check(pod.name, new, backend=res.backend)
            assert not res2.ok and any("iptables-nft too" in d for d in res2.differences), res2.differences
            assert redirect.setup(pod.name, new, backend=res.backend).changed
            assert not _ours_in(pod.name, "nft") and redirect.check(pod.name, new, backend=res.backend).ok
        finally:
            redirect.teardown(pod.name)
    assert not _ours_in(pod.name, "nft") and not _ours_in(pod.name, "legacy")
