"""A pod whose netns a user namespace of its own owns (Kubernetes ``hostUsers: false``): the eBPF
programs read a task's ids as the initial user namespace numbers them, so the config's owner ids
are translated through the pod's ``uid_map``/``gid_map`` (redirect/backends/ebpf/pod/userns.py;
the fresh-pod call backs off to the general path, which does it). Real user namespaces (in-pod ids
0..65535 are host 200000..265535), real connections made by tasks inside them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from redirect import api
from redirect.backends.ebpf.pod import backend as ebpf_pod_backend
from redirect.backends.ebpf.pod import userns
from redirect.config import RedirectConfig
from redirect.errors import BackendUnavailable
from redirect.kernel import netns as rnetns
from redirect.kernel import podkit
from redirect.plan.intent import intent_for
from tests import netkit
from tests.kit.pods import _pick_subnet, _release_subnet, link_for

BASE = 200000

# --- the translation itself (no kernel) ---------------------------------------


@pytest.mark.noroot
def test_ranges_are_split_at_the_map_extents_and_unmapped_ids_dropped() -> None:
    m = userns.parse_map("         0     200000       1000\n      1000     300000       1000\n")
    assert m == ((0, 200000, 1000), (1000, 300000, 1000))
    assert userns.to_host([(2500, 2500)], m) == []  # not mapped: no task of the pod has it
    assert userns.to_host([(5, 5)], m) == [(200005, 200005)]
    assert userns.to_host([(990, 1010)], m) == [(200990, 200999), (300000, 300010)]
    assert userns.to_host([(1990, 5000), (0, 0)], m) == [(200000, 200000), (300990, 300999)]
    ident = userns.parse_map("0 0 4294967295\n")
    assert userns.to_host([(1, 3), (4, 9)], ident) == [(1, 9)]  # adjacent ranges merge


@pytest.mark.noroot
def test_an_intent_gets_its_owner_ids_translated() -> None:
    m = ((0, BASE, 65536),)
    it = intent_for(RedirectConfig(proxy_uids=(1337, (2000, 2001)), proxy_gids=(1337,), owner_groups=(1000,)))
    t = userns.translated(it, m, m)
    assert t.proxy_owners == (("uid", BASE + 1337), ("uid", (BASE + 2000, BASE + 2001)), ("gid", BASE + 1337))
    assert t.groups == (BASE + 1000,) and t.groups_mode == it.groups_mode
    amb = intent_for(RedirectConfig(mode="ambient"))
    assert userns.translated(amb, m, m) is amb and not userns.owns_ids(amb)


# --- real user namespaces --------------------------------------------------------


@dataclass
class UsernsPod:
    name: str
    peer_name: str
    holder: subprocess.Popen[bytes]
    pod_ip4: str
    peer_ip4: str


@contextmanager
def userns_pod() -> Iterator[UsernsPod]:
    """A pod netns owned by a new user namespace mapping 0..65535 to 200000..265535 (a process holds
    both, the netns pinned under /run/netns as runtimes pin it), joined to a peer netns."""
    name = f"{netkit.PREFIX}{os.urandom(4).hex()}"
    peer = f"{name}-peer"
    rx = _pick_subnet()
    link = link_for(0, rx)
    holder = subprocess.Popen(["unshare", "--user", "--net", "--", "sleep", "600"])
    made: list[str] = []
    try:
        for _ in range(100):  # until unshare has made them
            if os.stat(f"/proc/{holder.pid}/ns/user").st_ino != os.stat("/proc/self/ns/user").st_ino:
                break
            time.sleep(0.01)
        for f, text in (("uid_map", f"0 {BASE} 65536\n"), ("setgroups", "deny\n"), ("gid_map", f"0 {BASE} 65536\n")):
            with open(f"/proc/{holder.pid}/{f}", "w") as fh:
                fh.write(text)
        subprocess.run(["ip", "netns", "attach", name, str(holder.pid)], check=True)
        made.append(name)
        made.append(podkit.create_netns(peer))
        for ns in (name, peer):
            podkit._prepare(ns)
        podkit.connect_netns(name, peer, link)
        subprocess.run(["ip", "-n", name, "route", "add", "default", "via", link.peer_ip4], check=True)
        subprocess.run(["ip", "-n", peer, "route", "add", "default", "via", link.pod_ip4], check=True)
        yield UsernsPod(name, peer, holder, link.pod_ip4, link.peer_ip4)
    finally:
        holder.kill()
        holder.wait()
        for ns in made:
            podkit.remove_netns(ns)
        _release_subnet(rx)


PROBE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
s.sendall(sys.argv[3].encode() + b"\\n")
print(s.makefile().readline().strip())
"""


def probe_as(pod: UsernsPod, uid: int, gid: int, port: int, token: str) -> str:
    """A connection to the peer's ``port`` by a task inside the pod's user namespace and netns with
    in-pod ``uid``/``gid``: the label of the listener that answered."""
    r = subprocess.run(["nsenter", "-t", str(pod.holder.pid), "-U", "-n", "-S", str(uid), "-G", str(gid), "--",
                        sys.executable, "-I", "-c", PROBE, pod.peer_ip4, str(port), token],
                       capture_output=True, text=True, timeout=15)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def landed(pod: UsernsPod, uid: int, gid: int, *listeners: netkit.TcpListener) -> tuple[str, object]:
    token = f"u{uid}g{gid}-{os.urandom(4).hex()}"
    label = probe_as(pod, uid, gid, 8080, token)
    for x in listeners:
        c = x.conn_for(token)
        if c is not None:
            return label, c.orig_dst
    return label, None


CONFIG = RedirectConfig(inbound_ports=())


@pytest.mark.parametrize("backend", ["ebpf", "auto"])
def test_the_proxy_uid_of_a_pod_in_its_own_user_namespace_is_not_captured(ebpf_root: str, backend: str) -> None:
    """In-pod uid 1337 (host 201337) is the proxy: its connection leaves uncaptured; the app's
    (in-pod 1000) goes to the proxy. eBPF is chosen (``auto`` too), by the general path (the fresh
    call backs off), and ``check`` agrees with what was written."""
    with userns_pod() as pod, netkit.TcpListener(pod.name, 15001, label="proxy") as proxy, \
            netkit.TcpListener(pod.peer_name, 8080, label="peer") as peer:
        res = api.setup(pod.name, CONFIG, backend=backend)
        try:
            assert res.backend == "ebpf" and res.detail["path"] == "general"
            assert landed(pod, 1000, 1000, proxy, peer) == ("proxy", (pod.peer_ip4, 8080))
            assert landed(pod, 1337, 1337, proxy, peer) == ("peer", None)
            assert landed(pod, 1000, 1337, proxy, peer) == ("peer", None)  # proxy_gids: 1337
            chk = api.check(pod.name, CONFIG, backend="ebpf")
            assert chk.ok, chk.differences
            assert not api.setup(pod.name, CONFIG, backend=backend).changed
        finally:
            api.teardown(pod.name, backend="ebpf")


def test_owner_groups_are_translated_too(ebpf_root: str) -> None:
    """``owner_groups``: only the app's group (in-pod gid 1000) is captured, another is not."""
    cfg = RedirectConfig(inbound_ports=(), owner_groups=(1000,))
    with userns_pod() as pod, netkit.TcpListener(pod.name, 15001, label="proxy") as proxy, \
            netkit.TcpListener(pod.peer_name, 8080, label="peer") as peer:
        api.setup(pod.name, cfg, backend="ebpf")
        try:
            assert landed(pod, 1000, 1000, proxy, peer) == ("proxy", (pod.peer_ip4, 8080))
            assert landed(pod, 1000, 2000, proxy, peer) == ("peer", None)
        finally:
            api.teardown(pod.name, backend="ebpf")


def test_check_reports_untranslated_owner_ids(ebpf_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries written with the config's ids as they are (what earlier releases wrote): ``check``
    reports the policy's difference, and setup again fixes it."""
    with userns_pod() as pod:
        monkeypatch.setattr(ebpf_pod_backend, "in_host_ids_here", lambda it: it)
        api.setup(pod.name, CONFIG, backend="ebpf")
        monkeypatch.undo()
        try:
            chk = api.check(pod.name, CONFIG, backend="ebpf")
            assert not chk.ok and any("policy entry differs" in d for d in chk.differences), chk.differences
            assert any(str(BASE + 1337) in d for d in chk.differences), chk.differences
            assert api.setup(pod.name, CONFIG, backend="ebpf").changed
            assert api.check(pod.name, CONFIG, backend="ebpf").ok
        finally:
            api.teardown(pod.name, backend="ebpf")


def test_maps_that_cannot_be_read_refuse_ebpf(ebpf_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the user namespace's maps cannot be read (here: as if setns() into it failed), eBPF is
    refused before anything is written (``BackendUnavailable`` naming why), and ``check`` says so."""
    with userns_pod() as pod:
        real = userns.netns_id_maps

        def refused(nsfd: int) -> None:
            maps = real(nsfd)  # (the real call: it is such a netns)
            assert maps is not None
            raise BackendUnavailable("backend=ebpf: the pod's netns is owned by a user namespace of its own"
                                     " (hostUsers: false), whose uid_map/gid_map could not be read (injected)")

        monkeypatch.setattr(userns, "netns_id_maps", refused)
        with pytest.raises(BackendUnavailable, match="user namespace of its own"):
            api.setup(pod.name, CONFIG, backend="ebpf")
        with rnetns.enter(pod.name):
            assert not ebpf_pod_backend.EbpfBackend().installed()
        chk = api.check(pod.name, CONFIG, backend="ebpf")
        assert not chk.ok and any("user namespace of its own" in d for d in chk.differences), chk.differences


def test_the_maps_are_read_as_the_host_numbers_them(ebpf_root: str) -> None:
    """``netns_id_maps``: None for a netns of the initial user namespace; the pod's maps, with the
    host's ids, for one of its own; the child it forks is gone after."""
    with userns_pod() as pod, netkit.make_pod() as plain:
        fd = rnetns.open_netns(plain.name)
        try:
            assert userns.netns_id_maps(fd) is None
        finally:
            os.close(fd)
        fd = rnetns.open_netns(pod.name)
        try:
            assert userns.netns_id_maps(fd) == (((0, BASE, 65536),), ((0, BASE, 65536),))
        finally:
            os.close(fd)
        children = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                children |= {int(x) for x in f.read().split()}
        assert children == {pod.holder.pid}  # the one that read the maps is gone (reaped)
