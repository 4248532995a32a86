"""Namespaces and pods of the test kit: made, entered, removed (the factory is ``redirect.kernel.podkit``)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redirect.kernel import netns as rnetns
from redirect.kernel import podkit
from redirect.kernel.podkit import NETNS_DIR, Link, live_namespaces, netlink_in, remove_netns

T = TypeVar("T")
Addr = tuple[str, int]

PREFIX = "rdrt-"
DEFAULT_TIMEOUT = 2.0

_live_lock = threading.Lock()
_used_subnets: set[tuple[int, int]] = set()


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError(
            "the redirect test kit needs root (it creates network namespaces, veths and"
            " netfilter state): run the tests as root, e.g. `sudo make test`"
        )


def existing_namespaces(prefix: str = PREFIX) -> set[str]:
    """Names under /run/netns starting with ``prefix`` (from any process)."""
    try:
        return {n for n in os.listdir(NETNS_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def create_netns(name: str) -> str:
    """Create /run/netns/<name> and remember it (``live_namespaces``); returns the name."""
    require_root()
    return podkit.create_netns(name)


def wait_link_detached(root: str, cookie: int, timeout: float = 15.0) -> None:
    """Until the kernel has cleaned a removed netns up (asynchronously) and detached the eBPF
    backend's link of the pod ``cookie`` under ``root``; fails the test after ``timeout`` s."""
    from redirect.backends.ebpf.host import pod_link, syscalls

    deadline = time.monotonic() + timeout
    while syscalls.link_target(pod_link(root, cookie)) != 0:
        assert time.monotonic() < deadline, f"link of netns cookie {cookie} still attached after {timeout} s"
        time.sleep(0.05)


def in_netns(ns: rnetns.NetnsRef, fn: Callable[..., T], *args: Any, timeout: float = 10.0, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a fresh thread inside ``ns``; return its result or re-raise."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with rnetns.enter(ns):
                box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name=f"in_netns:{rnetns.describe(ns)}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(
            f"in_netns({rnetns.describe(ns)!r}, {getattr(fn, '__name__', fn)}) still running after {timeout} s"
        )
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- pods


# Second octets of 10/8 that tests use for networks of their own (far hosts, services, addresses
# added inside a pod): a pod's subnet is never taken from them, so no test's address is a pod's.
TESTS_OWN_R = frozenset({77, 96, 201}) | frozenset(range(240, 256))
_POD_R = [r for r in range(16, 256) if r not in TESTS_OWN_R]


def _pick_subnet() -> tuple[int, int]:
    with _live_lock:
        while True:
            r, x = random.choice(_POD_R), random.randint(0, 255)
            if (r, x) not in _used_subnets:
                _used_subnets.add((r, x))
                return r, x


def _release_subnet(rx: tuple[int, int]) -> None:
    with _live_lock:
        _used_subnets.discard(rx)


@dataclass
class Pod:
    """A pod netns and its peer netns, joined by veth(s). See ``make_pod``."""

    name: str
    peer_name: str
    links: list[Link] = field(default_factory=list)

    @property
    def path(self) -> str:
        return os.path.join(NETNS_DIR, self.name)

    @property
    def peer_path(self) -> str:
        return os.path.join(NETNS_DIR, self.peer_name)

    @property
    def main(self) -> Link:
        return self.links[0]

    @property
    def extra(self) -> Link | None:
        """The second interface (``extra_iface=True``), or None."""
        return self.links[1] if len(self.links) > 1 else None

    @property
    def pod_if(self) -> str:
        return self.main.pod_if

    @property
    def peer_if(self) -> str:
        return self.main.peer_if

    @property
    def pod_ip4(self) -> str:
        return self.main.pod_ip4

    @property
    def peer_ip4(self) -> str:
        return self.main.peer_ip4

    @property
    def pod_ip6(self) -> str:
        return self.main.pod_ip6

    @property
    def peer_ip6(self) -> str:
        return self.main.peer_ip6

    def pod_ip(self, family: int) -> str:
        return self.pod_ip4 if family == 4 else self.pod_ip6

    def peer_ip(self, family: int) -> str:
        return self.peer_ip4 if family == 4 else self.peer_ip6

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``in_netns(pod.name, fn, ...)``."""
        return in_netns(self.name, fn, *args, **kwargs)

    def run_peer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return in_netns(self.peer_name, fn, *args, **kwargs)


def link_for(n: int, rx: tuple[int, int]) -> Link:
    """The names and addresses of a pod's ``eth<n>`` on subnet 10.R.x.0/24, fd00:R:x::/64."""
    r, x = rx
    return Link(
        pod_if=f"eth{n}",
        peer_if=f"peer{n}",
        pod_ip4=f"10.{r}.{x}.2",
        peer_ip4=f"10.{r}.{x}.1",
        # Canonical text (as the kernel and inet_ntop write it): fd00:16:0::1 is fd00:16::1.
        pod_ip6=str(ipaddress.IPv6Address(f"fd00:{r:x}:{x:x}::2")),
        peer_ip6=str(ipaddress.IPv6Address(f"fd00:{r:x}:{x:x}::1")),
    )


@contextlib.contextmanager
def make_pod(extra_iface: bool = False, name: str | None = None) -> Iterator[Pod]:
    """A pod netns ``rdrt-<random>`` and its peer ``rdrt-<random>-peer``; both removed on exit.

    The pod has ``eth0`` (10.R.x.2/24, fd00:R:x::2/64) to the peer's ``peer0``
    (10.R.x.1, fd00:R:x::1), ``lo`` up, and default routes (both families) via the
    peer, which routes everything back. ``extra_iface=True`` adds ``eth1``/``peer1`` on a
    subnet of its own.
    """
    require_root()
    base = name or f"{PREFIX}{os.urandom(4).hex()}"
    subnets = [_pick_subnet() for _ in range(2 if extra_iface else 1)]
    links = [link_for(n, rx) for n, rx in enumerate(subnets)]
    try:
        with podkit.make_pod(base, f"{base}-peer", links):
            _wait_link_local(base, [link.pod_if for link in links])
            yield Pod(name=base, peer_name=f"{base}-peer", links=links)
    finally:
        for rx in subnets:
            _release_subnet(rx)


def _wait_link_local(ns: str, ifaces: list[str], timeout: float = 5.0) -> None:
    """Until each of ``ifaces`` in ``ns`` has its IPv6 link-local address (and so its local
    routes): a veth gets it when its carrier comes, which may be after it is up, and a test that
    snapshots a new pod's addresses and routes must not see it arrive later."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["ip", "-n", ns, "-6", "-o", "addr", "show", "scope", "link"], capture_output=True,
                             text=True, check=True).stdout
        have = {line.split()[1] for line in out.splitlines() if " fe80::" in line}
        if set(ifaces) <= have:
            return
        assert time.monotonic() < deadline, f"{ns}: no IPv6 link-local address on {sorted(set(ifaces) - have)}"
        time.sleep(0.02)


def link_local(ns: str, dev: str) -> str:
    """The IPv6 link-local address of ``dev`` in ``ns`` (``make_pod`` waits until each pod interface
    has one)."""
    out = subprocess.run(["ip", "-n", ns, "-6", "-o", "addr", "show", "dev", dev, "scope", "link"],
                         capture_output=True, text=True, check=True).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if " fe80::" in line]
    assert found, f"{ns}: no IPv6 link-local address on {dev}"
    return found[0]


#: The subnets of a VM behind a pod (``vm_behind``), per family: (the pod's side, the VM, prefix).
VM_NET = {4: ("192.168.77.1", "192.168.77.2", 24), 6: ("fd77::1", "fd77::2", 64)}


@contextlib.contextmanager
def vm_behind(pod: Pod) -> Iterator[str]:
    """A VM netns (its name yielded) behind the pod's interface ``vm0`` (kube-virt style): its
    default routes go through the pod, which forwards (``ip_forward`` on), and the pod's peer
    routes the VM's subnets back to the pod. Removed on exit."""
    vm = create_netns(f"{pod.name}-vm")
    iface = "vm0"
    try:
        def ip(ns: str, *args: str) -> None:
            subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)

        ip(pod.name, "link", "add", iface, "type", "veth", "peer", "name", "eth0", "netns", vm)
        for fam, (here, there, plen) in VM_NET.items():
            extra = ("nodad",) if fam == 6 else ()
            ip(pod.name, f"-{fam}", "addr", "add", f"{here}/{plen}", "dev", iface, *extra)
            ip(vm, f"-{fam}", "addr", "add", f"{there}/{plen}", "dev", "eth0", *extra)
        for ns, dev in ((pod.name, iface), (vm, "eth0"), (vm, "lo")):
            ip(ns, "link", "set", dev, "up")
        for fam, (here, _there, plen) in VM_NET.items():
            ip(vm, f"-{fam}", "route", "add", "default", "via", here)
            net = ipaddress.ip_network(f"{here}/{plen}", strict=False)
            ip(pod.peer_name, f"-{fam}", "route", "add", str(net), "via", pod.pod_ip(fam))
        set_forwarding(pod.name, True)
        yield vm
    finally:
        remove_netns(vm)


def tc_filters(ns: str, dev: str) -> dict[str, list[str]]:
    """The tc filters on ``dev`` in ``ns`` by side ("ingress", "egress"): each one's bpf name
    (another kind's: its kind)."""
    out: dict[str, list[str]] = {}
    for side in ("ingress", "egress"):
        r = subprocess.run(["tc", "-n", ns, "-j", "filter", "show", "dev", dev, side], capture_output=True, text=True,
                           check=True)
        out[side] = [f["options"].get("bpf_name", f["kind"]) for f in json.loads(r.stdout or "[]") if "options" in f]
    return out


def qdisc_kinds(ns: str, dev: str) -> list[str]:
    """The kinds of the qdiscs on ``dev`` in ``ns``."""
    r = subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True)
    return [q["kind"] for q in json.loads(r.stdout or "[]")]


def set_forwarding(ns: str, on: bool) -> None:
    """IPv4 and IPv6 forwarding in ``ns`` (on every interface)."""
    for key in ("net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"):
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={int(on)}"], check=True)


#: Our filters' names on an interface where a pod forwards (eBPF backend).
OUR_TC = {"ingress": ["rdr_tc_ingress"], "egress": ["rdr_tc_egress"]}


def repoint(link: str | os.PathLike[str], target: str) -> None:
    """Make the symlink ``link`` name ``target``, atomically (a rename over it)."""
    tmp = os.fspath(link) + ".new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


@contextlib.contextmanager
def swapping(link: str | os.PathLike[str], targets: tuple[str, str], pause: float = 0.0) -> Iterator[None]:
    """The symlink ``link`` (made naming ``targets[0]``) swapped between the two targets by a thread,
    atomically, ``pause`` s apart, until the block ends."""
    repoint(link, targets[0])
    stop = threading.Event()

    def swap() -> None:
        flip = 0
        while not stop.is_set():
            flip ^= 1
            repoint(link, targets[flip])
            if pause:
                time.sleep(pause)

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


__all__ = ["T", "Addr", "NETNS_DIR", "PREFIX", "DEFAULT_TIMEOUT", "Link", "Pod", "require_root", "live_namespaces",
           "existing_namespaces", "create_netns", "remove_netns", "wait_link_detached", "in_netns", "netlink_in",
           "link_for", "make_pod", "vm_behind", "VM_NET", "tc_filters", "qdisc_kinds", "set_forwarding", "OUR_TC",
           "link_local", "repoint", "swapping"]
