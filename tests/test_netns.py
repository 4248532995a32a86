"""Entering namespaces and the small rtnetlink client, against real namespaces."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess

import pytest

from redirect import netns as rnetns
from redirect import rtnl
from tests.netkit import Pod


def _v6_addrs_on_lo(ns: str) -> set[str]:
    out = subprocess.run(["ip", "-n", ns, "-j", "-6", "addr", "show", "dev", "lo"], check=True,
                         capture_output=True, text=True).stdout
    return {a["local"] for link in json.loads(out) for a in link.get("addr_info", [])}


def test_current_fd_and_inode_follow_nested_enters(pod_pair: tuple[Pod, Pod]) -> None:
    a, b = pod_pair
    home = os.stat("/proc/thread-self/ns/net").st_ino
    assert rnetns.current_fd() is None
    assert rnetns.current_inode() == home
    with rnetns.enter(a.name) as fa:
        assert rnetns.current_fd() == fa
        assert rnetns.current_inode() == rnetns.netns_inode(a.name) != home
        with rnetns.enter(b.name) as fb:
            assert rnetns.current_fd() == fb
            assert rnetns.current_inode() == rnetns.netns_inode(b.name)
            assert os.stat("/proc/thread-self/ns/net").st_ino == rnetns.netns_inode(b.name)
        assert rnetns.current_fd() == fa
        assert os.stat("/proc/thread-self/ns/net").st_ino == rnetns.netns_inode(a.name)
    assert rnetns.current_fd() is None
    assert os.stat("/proc/thread-self/ns/net").st_ino == home


def test_current_fd_is_cleared_when_the_body_raises(pod: Pod) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with rnetns.enter(pod.name):
            raise RuntimeError("boom")
    assert rnetns.current_fd() is None
    assert rnetns.current_inode() == os.stat("/proc/thread-self/ns/net").st_ino


def test_one_rtnetlink_socket_serves_dumps_and_changes_in_turn(pod: Pod) -> None:
    """A shared socket matches replies by sequence number: an error reply (EEXIST) leaves it usable."""
    with rnetns.enter(pod.name), rtnl.open_socket() as s:
        before = rtnl.dump(rtnl.RTM_GETADDR, socket.AF_INET6, sock=s)
        assert any(m.attrs.get(rtnl.IFA_ADDRESS) == socket.inet_pton(socket.AF_INET6, "::1") for m in before)
        rtnl.addr("add", socket.AF_INET6, 1, "fd00::77", 128, 0xBC, 0x02, sock=s)  # IFA_F_NODAD
        with pytest.raises(OSError) as ei:
            rtnl.addr("add", socket.AF_INET6, 1, "fd00::77", 128, 0xBC, 0x02, sock=s)
        assert ei.value.errno == errno.EEXIST
        after = rtnl.dump(rtnl.RTM_GETADDR, socket.AF_INET6, sock=s)
        assert len(after) == len(before) + 1
        assert "fd00::77" in _v6_addrs_on_lo(pod.name)
        rtnl.addr("del", socket.AF_INET6, 1, "fd00::77", 128, 0xBC, sock=s)
        assert len(rtnl.dump(rtnl.RTM_GETADDR, socket.AF_INET6, sock=s)) == len(before)
    assert "fd00::77" not in _v6_addrs_on_lo(pod.name)


def test_ipv6_enabled_reads_the_disable_ipv6_switch_without_proc_sys(pod: Pod) -> None:
    """``routes.ipv6_enabled`` follows ``net.ipv6.conf.all.disable_ipv6`` (as lo's devconf over
    rtnetlink), also while lo is down and has no ``::1``."""
    from redirect import routes

    def sysctl(value: int) -> None:
        subprocess.run(["ip", "netns", "exec", pod.name, "sysctl", "-qw", f"net.ipv6.conf.all.disable_ipv6={value}"],
                       check=True)

    with rnetns.enter(pod.name):
        assert routes.ipv6_enabled()
    sysctl(1)
    try:
        with rnetns.enter(pod.name):
            assert not routes.ipv6_enabled()
    finally:
        sysctl(0)
    subprocess.run(["ip", "-n", pod.name, "link", "set", "lo", "down"], check=True)
    try:
        assert "::1" not in _v6_addrs_on_lo(pod.name)
        with rnetns.enter(pod.name):
            assert routes.ipv6_enabled()
    finally:
        subprocess.run(["ip", "-n", pod.name, "link", "set", "lo", "up"], check=True)
