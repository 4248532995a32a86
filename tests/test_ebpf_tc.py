"""The eBPF backend's tc filters against what a pod writes into its own netns: qdiscs and filters of
its own where ours go (a failed setup leaves the netns as it was and names what is in the way), and
more interfaces or qdiscs than the native lists hold (setup, check and teardown still work)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from redirect import api
from redirect.backends import ebpf
from redirect.backends.ebpf.host import NATIVE
from redirect.config import RedirectConfig
from redirect.errors import SetupError
from redirect.kernel import netns as rnetns
from tests import netkit

PRIO = 0xC0DE


@pytest.fixture
def ns(ebpf_root: str) -> Iterator[str]:
    """A netns with lo up and veths v0/p0 and v1/p1 (both ends inside), IPv4 forwarding on every
    interface, IPv6 forwarding off; the eBPF host programs loaded."""
    ebpf.host(ebpf_root)
    name = netkit.create_netns(f"{netkit.PREFIX}{os.urandom(4).hex()}")
    try:
        ip(name, "link", "set", "lo", "up")
        for i in (0, 1):
            ip(name, "link", "add", f"v{i}", "type", "veth", "peer", "name", f"p{i}")
        for dev in ("v0", "p0", "v1", "p1"):
            ip(name, "link", "set", dev, "up")
        ip(name, "addr", "add", "10.0.0.1/24", "dev", "v0")
        sysctl(name, "net.ipv4.conf.all.forwarding", 1)
        yield name
    finally:
        try:
            api.teardown(name, backend="ebpf")
        finally:
            netkit.remove_netns(name)


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)


def tc(ns: str, *args: str) -> str:
    return subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True, text=True).stdout


def sysctl(ns: str, key: str, value: int) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=True)


def tc_state(ns: str) -> dict[str, tuple[str, str, str]]:
    """Every interface's qdiscs and filters (both sides), as tc prints them."""
    devs = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], check=True, capture_output=True,
                          text=True).stdout
    names = [ln.split(":")[1].strip().split("@")[0] for ln in devs.splitlines()]
    return {d: (tc(ns, "qdisc", "show", "dev", d), tc(ns, "filter", "show", "dev", d, "ingress"),
                tc(ns, "filter", "show", "dev", d, "egress")) for d in names}


def installed(ns: str) -> bool:
    return bool(api.show(ns, backend="ebpf").get("installed"))


#: What a pod may put where our filters go on v1, and what the error names.
IN_THE_WAY = {
    # someone's cBPF filter at our priority (same kind and protocol: the kernel answers EEXIST)
    "filter": (("qdisc", "add", "dev", "v1", "clsact"),
               ("filter", "add", "dev", "v1", "ingress", "prio", str(PRIO), "protocol", "all", "bpf", "bytecode",
                "1,6 0 0 0"),
               "interface v1 (ifindex {idx}) has a tc filter that is not ours at our priority 49374 on its ingress"
               " (kind 'bpf', protocol all"),
    # one of another protocol (the kernel answers EINVAL)
    "filter-ip": (("qdisc", "add", "dev", "v1", "clsact"),
                  ("filter", "add", "dev", "v1", "egress", "prio", str(PRIO), "protocol", "ip", "bpf", "bytecode",
                   "1,6 0 0 0"),
                  "interface v1 (ifindex {idx}) has a tc filter that is not ours at our priority 49374 on its"
                  " egress (kind 'bpf', protocol ip"),
    # one of the same kind and protocol under another handle (ours would join it: the kernel takes it)
    "filter-handle": (("qdisc", "add", "dev", "v1", "clsact"),
                      ("filter", "add", "dev", "v1", "ingress", "prio", str(PRIO), "protocol", "all", "handle", "5",
                       "bpf", "bytecode", "1,6 0 0 0"),
                      "interface v1 (ifindex {idx}) has a tc filter that is not ours at our priority 49374 on its"
                      " ingress (kind 'bpf', protocol all, handle 0x5"),
    # an ingress qdisc where clsact goes
    "ingress-qdisc": (("qdisc", "add", "dev", "v1", "ingress"), None,
                      "interface v1 (ifindex {idx}) has a qdisc of kind 'ingress' where the clsact qdisc"),
}


def ifindex(ns: str, dev: str) -> int:
    with rnetns.enter(ns):
        return socket.if_nametoindex(dev)


@pytest.mark.parametrize("what", sorted(IN_THE_WAY))
def test_a_failed_setup_leaves_the_pods_own_qdiscs_and_names_what_is_in_the_way(ns: str, what: str) -> None:
    """An empty clsact qdisc of the pod's own on v0 (where our filters go on first), and something of
    the pod's where ours go on v1: setup fails naming v1 and what is there, and every interface's
    qdiscs and filters are as before (v0's qdisc stays: the undo takes back only what the setup
    made); nothing of ours is installed. The same again fails the same way."""
    tc(ns, "qdisc", "add", "dev", "v0", "clsact")
    qdisc, flt, msg = IN_THE_WAY[what]
    tc(ns, *qdisc)
    if flt:
        tc(ns, *flt)
    before = tc_state(ns)
    for _ in range(2):
        with pytest.raises(SetupError) as e:
            api.setup(ns, None, backend="ebpf")
        assert msg.format(idx=ifindex(ns, "v1")) in str(e.value)
        assert tc_state(ns) == before
        assert not installed(ns)


def test_a_failed_setup_puts_back_a_filter_of_ours_it_replaced(ns: str, ebpf_root: str) -> None:
    """A pod set up while only v0 forwards has our filters there; made stale (another slot in its
    classid, as a killed setup can leave them), the next setup replaces them; when that setup then
    fails on v1 (someone's filter at our priority), the stale filters are back as they were, not
    gone."""
    sysctl(ns, "net.ipv4.conf.all.forwarding", 0)
    for dev in ("v1", "p0", "p1"):
        sysctl(ns, f"net.ipv4.conf.{dev}.forwarding", 0)
    sysctl(ns, "net.ipv4.conf.v0.forwarding", 1)
    api.setup(ns, None, backend="ebpf")
    assert netkit.tc_filters(ns, "v0") == netkit.OUR_TC
    h = ebpf.host(ebpf_root)
    assert h is not None
    lib, ffi = NATIVE.lib, NATIVE.ffi
    made = ffi.new("struct rdr_tc_made *")

    def stale() -> int:
        rc = lib.rdr_tc_attach(socket.if_nametoindex("v0"), h.store.native.tc_prog_in, h.store.native.tc_prog_out,
                               99, made, ffi.NULL)
        lib.rdr_tc_keep(made)
        return int(rc)

    assert netkit.in_netns(ns, stale) == 0
    tc(ns, "qdisc", "add", "dev", "v1", "clsact")
    tc(ns, "filter", "add", "dev", "v1", "ingress", "prio", str(PRIO), "protocol", "all", "bpf", "bytecode",
       "1,6 0 0 0")
    before = tc_state(ns)
    assert ":63 rdr_tc_ingress" in before["v0"][1]  # (flowid <major>:63, 99)
    sysctl(ns, "net.ipv4.conf.v1.forwarding", 1)
    with pytest.raises(SetupError, match="interface v1 .* has a tc filter that is not ours"):
        api.setup(ns, None, backend="ebpf")
    assert tc_state(ns) == before
    assert installed(ns)


#: How our filters come off v0 and v1 while the pod is set up: teardown, or a config that no longer
#: forwards (its capture takes nothing inbound), or one that excludes them.
OFF = {
    "teardown": None,
    "no-inbound": RedirectConfig(inbound_ports=()),
    "excluded": RedirectConfig(exclude_interfaces=("v0", "v1", "p0", "p1")),
}


@pytest.mark.parametrize("off", sorted(OFF))
def test_ours_come_off_leaving_the_pods_own_clsact_qdiscs_and_taking_the_ones_we_made(ns: str, off: str) -> None:
    """The pod made clsact qdiscs of its own before setup: an empty one on v0, one with a filter of
    its own on v1. Setup puts ours on all four interfaces (making the qdiscs of p0 and p1); once
    ours come off (teardown, or a config change that drops the interfaces), every interface's
    qdiscs and filters are as before setup: the pod's qdiscs stay, with or without its filter, and
    the ones we made are gone. A teardown after a config change leaves them so too."""
    tc(ns, "qdisc", "add", "dev", "v0", "clsact")
    tc(ns, "qdisc", "add", "dev", "v1", "clsact")
    tc(ns, "filter", "add", "dev", "v1", "egress", "prio", "10", "protocol", "all", "bpf", "bytecode", "1,6 0 0 0")
    before = tc_state(ns)
    assert api.setup(ns, None, backend="ebpf").changed
    for dev in ("v0", "v1", "p0", "p1"):
        assert netkit.tc_filters(ns, dev)["ingress"] == ["rdr_tc_ingress"], dev
    cfg = OFF[off]
    if cfg is None:
        assert api.teardown(ns, backend="ebpf")
    else:
        assert api.setup(ns, cfg, backend="ebpf").changed
        assert api.check(ns, cfg, backend="ebpf").ok
        assert tc_state(ns) == before
        assert api.teardown(ns, backend="ebpf")
    assert tc_state(ns) == before


#: What a pod may put in a clsact qdisc we made: a filter at another priority, a chain of its own.
THEIRS_IN_OURS = {
    "filter": ("filter", "add", "dev", "p0", "egress", "prio", "10", "protocol", "all", "bpf", "bytecode", "1,6 0 0 0"),
    "chain": ("chain", "add", "dev", "p0", "ingress", "chain", "5"),
}


@pytest.mark.parametrize("what", sorted(THEIRS_IN_OURS))
def test_a_qdisc_we_made_stays_while_something_of_the_pods_is_in_it(ns: str, what: str) -> None:
    """After setup (which made p0's clsact qdisc) the pod puts something of its own in that qdisc:
    teardown takes our filters off and leaves the qdisc with what the pod put there."""
    api.setup(ns, None, backend="ebpf")
    assert netkit.tc_filters(ns, "p0") == netkit.OUR_TC
    tc(ns, *THEIRS_IN_OURS[what])
    assert api.teardown(ns, backend="ebpf")
    assert "clsact" in netkit.qdisc_kinds(ns, "p0")
    assert netkit.tc_filters(ns, "p0") == {"ingress": [], "egress": ["bpf"] if what == "filter" else []}
    assert ("chain 5" in tc(ns, "chain", "show", "dev", "p0", "ingress")) == (what == "chain")
    assert "clsact" not in netkit.qdisc_kinds(ns, "p1")


def test_a_filter_that_joins_ours_at_our_priority_is_reported_and_left_alone(ns: str) -> None:
    """After setup the pod puts a filter of its own at our priority, protocol and kind on v1's
    egress under another handle (the kernel puts it next to ours, in the same place). ``check``
    reports it; setup again (the same config, or another) fails naming it, leaving everything as it
    was; teardown takes ours off
    and leaves it, with the qdisc it is in."""
    api.setup(ns, None, backend="ebpf")
    tc(ns, "filter", "add", "dev", "v1", "egress", "prio", str(PRIO), "protocol", "all", "handle", "7", "bpf",
       "bytecode", "1,6 0 0 0")
    assert sorted(netkit.tc_filters(ns, "v1")["egress"]) == ["bpf", "rdr_tc_egress"]
    r = api.check(ns, None, backend="ebpf")
    assert not r.ok
    assert any("v1" in d and "not ours at our priority 49374" in d and "egress" in d for d in r.differences), r
    before = tc_state(ns)
    for cfg in (None, RedirectConfig(inbound_ports=(8000,))):  # (the same config, and a change)
        with pytest.raises(SetupError) as e:
            api.setup(ns, cfg, backend="ebpf")
        assert ("interface v1 (ifindex {}) has a tc filter that is not ours at our priority 49374 on its egress"
                " (kind 'bpf', protocol all, handle 0x7".format(ifindex(ns, "v1"))) in str(e.value)
        assert tc_state(ns) == before
    assert api.teardown(ns, backend="ebpf")
    assert netkit.tc_filters(ns, "v1") == {"ingress": [], "egress": ["bpf"]}
    assert netkit.tc_filters(ns, "v0") == {"ingress": [], "egress": []}
    assert "clsact" in netkit.qdisc_kinds(ns, "v1") and "clsact" not in netkit.qdisc_kinds(ns, "v0")


def many_veths(ns: str, pairs: int, clsact: bool = False) -> list[str]:
    """``pairs`` more veth pairs in ``ns`` (w<i>/x<i>), down; with ``clsact``, a clsact qdisc of the
    pod's own on each: the names."""
    names = [n for i in range(pairs) for n in (f"w{i}", f"x{i}")]
    cmds = [f"link add w{i} type veth peer name x{i}" for i in range(pairs)]
    subprocess.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n", text=True, check=True)
    if clsact:
        subprocess.run(["tc", "-n", ns, "-batch", "-"], input="".join(f"qdisc add dev {n} clsact\n" for n in names),
                       text=True, check=True)
    return names


def test_many_interfaces_that_do_not_forward_count_for_nothing(ns: str) -> None:
    """260 more interfaces (more than RDR_FWD_MAX, 256) that do not forward: setup, check and the
    same setup again work, both the fresh-pod call and the general path (a new config). Once they
    forward (IPv6's all.forwarding: every one of them), setup and check fail with a SetupError that
    names the limit, and the pod keeps its capture."""
    for key in ("net.ipv4.conf.all.forwarding", "net.ipv4.conf.default.forwarding"):
        sysctl(ns, key, 0)
    for dev in ("v0", "p0", "v1", "p1"):
        sysctl(ns, f"net.ipv4.conf.{dev}.forwarding", 0)
    many_veths(ns, 130)
    assert api.setup(ns, None, backend="ebpf").changed
    assert api.check(ns, None, backend="ebpf").ok
    assert not api.setup(ns, None, backend="ebpf").changed
    cfg = RedirectConfig(inbound_ports=(8000,))
    assert api.setup(ns, cfg, backend="ebpf").changed
    assert api.check(ns, cfg, backend="ebpf").ok
    sysctl(ns, "net.ipv6.conf.all.forwarding", 1)
    for call in (lambda: api.setup(ns, None, backend="ebpf"), lambda: api.check(ns, None, backend="ebpf")):
        with pytest.raises(SetupError, match="forwards on more than 256 interfaces"):
            call()
    assert installed(ns)


def test_a_fresh_pod_forwarding_on_too_many_interfaces_is_refused_naming_the_limit(ns: str) -> None:
    """More than 256 interfaces that forward (IPv4, each its own setting): a fresh pod's setup fails
    with a SetupError naming the limit, and nothing of ours is left."""
    sysctl(ns, "net.ipv4.conf.default.forwarding", 1)
    many_veths(ns, 130)
    with pytest.raises(SetupError, match="forwards on more than 256 interfaces"):
        api.setup(ns, None, backend="ebpf")
    assert not installed(ns)
    assert all(not f for d in tc_state(ns).values() for f in d[1:])


def test_a_pods_own_clsact_qdiscs_beyond_any_list_do_not_stop_its_teardown(ns: str) -> None:
    """A pod that forwards on v0 and v1 is set up; then it makes 260 clsact qdiscs of its own on
    interfaces that do not forward. Check, setup again and teardown work: ours go, its qdiscs stay."""
    for dev in ("p0", "p1"):
        sysctl(ns, f"net.ipv4.conf.{dev}.forwarding", 0)
    sysctl(ns, "net.ipv4.conf.default.forwarding", 0)
    api.setup(ns, None, backend="ebpf")
    theirs = many_veths(ns, 130, clsact=True)
    assert api.check(ns, None, backend="ebpf").ok
    assert not api.setup(ns, None, backend="ebpf").changed
    assert api.teardown(ns, backend="ebpf")
    state = tc_state(ns)
    for dev in ("v0", "v1"):
        assert "clsact" not in state[dev][0] and not state[dev][1] and not state[dev][2]
    assert all("clsact" in state[d][0] for d in theirs)


@pytest.mark.parametrize("off", ["no-inbound", "excluded"])
def test_filters_of_a_setup_killed_before_its_policy_go_with_the_next_setup_that_does_not_want_them(
        ns: str, off: str) -> None:
    """A fresh pod's setup killed once its filters are on but before its policy leaves them, with its
    entries and its link; the next setup, of a config that puts no filter there, takes them off
    (and the qdiscs they made), and check agrees: nothing waits for a teardown."""
    from tests.test_kill import killed_setup, subreaper

    before = tc_state(ns)
    with subreaper():
        killed_setup(ns, RedirectConfig(), "ebpf", 0.0, point="ebpf.before_policy")
    assert netkit.tc_filters(ns, "p0")["ingress"] == ["rdr_tc_ingress"]  # left by the killed setup
    cfg = OFF[off]
    assert api.setup(ns, cfg, backend="ebpf").changed
    res = api.check(ns, cfg, backend="ebpf")
    assert res.ok, res.differences
    assert tc_state(ns) == before
    assert api.teardown(ns, backend="ebpf")
    assert tc_state(ns) == before
