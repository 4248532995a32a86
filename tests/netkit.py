"""The kit every integration test uses: real namespaces, veths, listeners and probes.

Nothing here is mocked. A ``Pod`` is two fresh network namespaces (the pod and a
``-peer`` standing for "the rest of the network") joined by a veth pair with IPv4
and IPv6 addresses. Listeners run in background threads inside a namespace and
record what they saw (peer, local address, ``SO_ORIGINAL_DST``, first line); each
answers with its label, so a probe learns which listener it reached::

    with make_pod() as pod, TcpListener(pod.peer_name, 8080, label="app") as app:
        hit = landing(pod.name, pod.peer_ip4, 8080, app)
        assert hit.label == "app"
        assert hit.conn.local == (pod.peer_ip4, 8080)

Every socket operation has a timeout (2 s by default) and every namespace the kit
creates is removed on the way out, even when the body raises. Traffic only goes to
loopback or to addresses inside the namespaces the kit made.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import os
import platform
import random
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeVar

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from redirect import netns as rnetns
from redirect.relay import IP_TRANSPARENT, IPV6_TRANSPARENT, SO_MARK, SOL_IPV6, original_dst

T = TypeVar("T")
Addr = tuple[str, int]

NETNS_DIR = "/run/netns"
PREFIX = "rdrt-"
DEFAULT_TIMEOUT = 2.0

# More socket options the stdlib does not name (Linux uapi values); the proxies' ones are in redirect.relay.
IP_PKTINFO = 8
IP_RECVORIGDSTADDR = 20  # cmsg type IP_ORIGDSTADDR, same number
IPV6_RECVPKTINFO = 49
IPV6_PKTINFO = 50
IPV6_RECVORIGDSTADDR = 74  # cmsg type IPV6_ORIGDSTADDR, same number
IFA_F_NODAD = 0x02
SOL_IP = socket.IPPROTO_IP  # 0

# Names of namespaces this process created and has not removed yet (the leak check reads it).
_live: set[str] = set()
_live_lock = threading.Lock()
_used_subnets: set[tuple[int, int]] = set()


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError(
            "the redirect test kit needs root (it creates network namespaces, veths and"
            " netfilter state): run the tests as root, e.g. `sudo make test`"
        )


def live_namespaces() -> set[str]:
    """Names of the namespaces this process created and has not yet removed."""
    with _live_lock:
        return set(_live)


def existing_namespaces(prefix: str = PREFIX) -> set[str]:
    """Names under /run/netns starting with ``prefix`` (from any process)."""
    try:
        return {n for n in os.listdir(NETNS_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def create_netns(name: str) -> str:
    """Create /run/netns/<name> and remember it; returns the name."""
    require_root()
    pr_netns.create(name)
    with _live_lock:
        _live.add(name)
    return name


def remove_netns(name: str) -> None:
    """Remove /run/netns/<name> (its interfaces go with it); quiet if already gone."""
    try:
        pr_netns.remove(name)
    except FileNotFoundError:
        pass
    finally:
        with _live_lock:
            _live.discard(name)


def wait_link_detached(root: str, cookie: int, timeout: float = 15.0) -> None:
    """Until the kernel has cleaned a removed netns up (asynchronously) and detached the eBPF
    backend's link of the pod ``cookie`` under ``root``; fails the test after ``timeout`` s."""
    from redirect.backends import ebpf

    deadline = time.monotonic() + timeout
    while ebpf._link_target(ebpf._pod_link(root, cookie)) != 0:
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


def _iproute_in(ns: str) -> IPRoute:
    """An IPRoute whose netlink socket lives in ``ns`` (a socket keeps the netns it was made in)."""
    with rnetns.enter(ns):
        return IPRoute()


# --------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class Link:
    """One veth pair between a pod and its peer, with both ends' addresses."""

    pod_if: str
    peer_if: str
    pod_ip4: str
    peer_ip4: str
    pod_ip6: str
    peer_ip6: str
    prefix4: int = 24
    prefix6: int = 64

    @property
    def subnet4(self) -> str:
        return str(ipaddress.ip_network(f"{self.pod_ip4}/{self.prefix4}", strict=False))

    @property
    def subnet6(self) -> str:
        return str(ipaddress.ip_network(f"{self.pod_ip6}/{self.prefix6}", strict=False))


def _pick_subnet() -> tuple[int, int]:
    with _live_lock:
        while True:
            r, x = random.randint(16, 250), random.randint(0, 255)
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


def _add_link(pod_ipr: IPRoute, peer_ipr: IPRoute, peer_name: str, n: int, rx: tuple[int, int]) -> Link:
    link = link_for(n, rx)
    pod_ipr.link("add", ifname=link.pod_if, kind="veth", peer={"ifname": link.peer_if, "net_ns_fd": peer_name})
    for ipr, ifname, ip4, ip6 in (
        (pod_ipr, link.pod_if, link.pod_ip4, link.pod_ip6),
        (peer_ipr, link.peer_if, link.peer_ip4, link.peer_ip6),
    ):
        (idx,) = ipr.link_lookup(ifname=ifname)
        ipr.addr("add", index=idx, address=ip4, prefixlen=link.prefix4)
        ipr.addr("add", index=idx, address=ip6, prefixlen=link.prefix6, flags=IFA_F_NODAD)
        ipr.link("set", index=idx, state="up")
    # Wait (bounded) until both ends have carrier: a neighbour solicitation sent before
    # that is lost, and the first IPv6 connection would wait a 1 s retransmit.
    deadline = time.monotonic() + 3.0
    for ipr, ifname in ((pod_ipr, link.pod_if), (peer_ipr, link.peer_if)):
        (idx,) = ipr.link_lookup(ifname=ifname)
        while time.monotonic() < deadline and ipr.get_links(idx)[0].get_attr("IFLA_OPERSTATE") != "UP":
            time.sleep(0.005)
    return link


def _no_dad() -> None:
    """New interfaces in this netns skip duplicate address detection, link-local included.

    Otherwise the first IPv6 connection waits ~1 s: neighbour discovery needs a
    link-local source, which stays tentative until DAD finishes."""
    for scope in ("all", "default"):
        with open(f"/proc/sys/net/ipv6/conf/{scope}/accept_dad", "w") as f:
            f.write("0")


def _setup_pod(pod: Pod, subnets: list[tuple[int, int]]) -> None:
    for ns in (pod.name, pod.peer_name):
        in_netns(ns, _no_dad)
    pod_ipr = _iproute_in(pod.name)
    peer_ipr = _iproute_in(pod.peer_name)
    try:
        for ipr in (pod_ipr, peer_ipr):
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        for n, rx in enumerate(subnets):
            pod.links.append(_add_link(pod_ipr, peer_ipr, pod.peer_name, n, rx))
        m = pod.main
        pod_ipr.route("add", dst="0.0.0.0/0", gateway=m.peer_ip4)
        pod_ipr.route("add", dst="::/0", gateway=m.peer_ip6, family=socket.AF_INET6)
        # The peer routes everything back to the pod, so it can answer any source the pod uses.
        peer_ipr.route("add", dst="0.0.0.0/0", gateway=m.pod_ip4)
        peer_ipr.route("add", dst="::/0", gateway=m.pod_ip6, family=socket.AF_INET6)
    finally:
        pod_ipr.close()
        peer_ipr.close()


@contextlib.contextmanager
def make_pod(extra_iface: bool = False, name: str | None = None) -> Iterator[Pod]:
    """A pod netns ``rdrt-<random>`` and its peer ``rdrt-<random>-peer``; both removed on exit.

    The pod has ``eth0`` (10.R.x.2/24, fd00:R:x::2/64) to the peer's ``peer0``
    (10.R.x.1, fd00:R:x::1), ``lo`` up, and default routes (both families) via the
    peer. ``extra_iface=True`` adds ``eth1``/``peer1`` on a subnet of its own.
    """
    require_root()
    base = name or f"{PREFIX}{os.urandom(4).hex()}"
    pod = Pod(name=base, peer_name=f"{base}-peer")
    subnets = [_pick_subnet() for _ in range(2 if extra_iface else 1)]
    try:
        create_netns(pod.name)
        create_netns(pod.peer_name)
        _setup_pod(pod, subnets)
        yield pod
    finally:
        try:
            remove_netns(pod.name)
        finally:
            remove_netns(pod.peer_name)
            for rx in subnets:
                _release_subnet(rx)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Conn:
    """What a listener saw of one connection (TCP) or datagram (UDP)."""

    proto: Literal["tcp", "udp"]
    peer: Addr
    local: Addr
    orig_dst: Addr | None  # TCP: SO_ORIGINAL_DST (None if it failed); UDP: header dst (IP_ORIGDSTADDR)
    line: str | None  # first line received (without the newline), None if none came
    ifindex: int | None = None  # UDP: interface the datagram arrived on (IP_PKTINFO)
    at: float = 0.0  # time.monotonic() when it was recorded


def _sockaddr_in(raw: bytes) -> Addr:
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntop(socket.AF_INET, addr), port


def _sockaddr_in6(raw: bytes) -> Addr:
    port, addr = struct.unpack_from("!2xH4x16s", raw)
    return socket.inet_ntop(socket.AF_INET6, addr), port


def _addr2(a: Any) -> Addr:
    return str(a[0]), int(a[1])


def _read_line(sock: socket.socket, limit: int = 4096) -> str | None:
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        try:
            chunk = sock.recv(limit)
        except OSError:
            break
        if not chunk:
            break
        buf += chunk
    if not buf:
        return None
    return buf.split(b"\n", 1)[0].decode(errors="replace")


# --------------------------------------------------------------------------- listeners


def _socket_owned_by(owner: tuple[int, int] | None, af: int, kind: int) -> socket.socket:
    """A socket whose file credentials are ``owner``'s (what ``-m owner``/``meta skuid`` match).

    The kernel records the creating thread's fsuid/fsgid on the socket file; setfsuid and
    setfsgid change only the calling thread, and a root thread can change them back.
    """
    if owner is None:
        return socket.socket(af, kind)
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.setfsgid(owner[1])
    _libc.setfsuid(owner[0])
    try:
        return socket.socket(af, kind)
    finally:
        _libc.setfsuid(0)
        _libc.setfsgid(0)


class Listener:
    """Common part of TCP and UDP listeners: a thread in a netns that records ``Conn``s."""

    proto: Literal["tcp", "udp"]
    sock_type: int

    def __init__(
        self,
        netns: rnetns.NetnsRef,
        port: int,
        family: int = 4,
        host: str | None = None,
        transparent: bool = False,
        mark: int | None = None,
        label: str | None = None,
        owner: tuple[int, int] | None = None,
    ) -> None:
        if family not in (4, 6):
            raise ValueError(f"family={family!r}: must be 4 or 6")
        self.netns = netns
        self.family = family
        self.host = host or ("0.0.0.0" if family == 4 else "::")
        self.port = port  # the bound port once started (useful with port=0)
        self.transparent = transparent
        self.mark = mark
        # (uid, gid) owning the socket, as netfilter's owner match sees it (e.g. a proxy's 1337).
        self.owner = owner
        self.label = label or f"{self.proto}{family}-{rnetns.describe(netns)}-{port}"
        self.conns: list[Conn] = []
        self._cond = threading.Condition()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False

    # lifecycle ---------------------------------------------------------------
    def start(self) -> Self:
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._main, name=f"listener:{self.label}", daemon=True)
        self._thread.start()
        if not self._started.wait(DEFAULT_TIMEOUT * 2):
            self.close()
            raise TimeoutError(f"listener {self.label}: did not start")
        if self._start_error is not None:
            err = self._start_error
            self.close()
            raise err
        return self

    def close(self) -> None:
        self._stopping = True
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(DEFAULT_TIMEOUT * 2)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_socket(self) -> socket.socket:
        af = socket.AF_INET if self.family == 4 else socket.AF_INET6
        s = _socket_owned_by(self.owner, af, self.sock_type)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.family == 6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if self.transparent:
                if self.family == 4:
                    s.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
                else:
                    s.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
            if self.mark is not None:
                s.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
            self._configure(s)
            s.bind((self.host, self.port))
            if self.sock_type == socket.SOCK_STREAM:
                s.listen(128)
        except BaseException:
            s.close()
            raise
        return s

    def _configure(self, s: socket.socket) -> None:
        pass

    def _main(self) -> None:
        try:
            with rnetns.enter(self.netns):
                try:
                    self._sock = self._make_socket()
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"listener {self.label}: bind {self.host}:{self.port}"
                        f" in {rnetns.describe(self.netns)}: {e.strerror}",
                    ) from None
                self.port = self._sock.getsockname()[1]
                self._started.set()
                try:
                    self._serve(self._sock)
                finally:
                    self._sock.close()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._start_error = e
            self._started.set()

    def _wait_readable(self, s: socket.socket) -> bool:
        """Block until ``s`` is readable (True) or the listener is closing (False)."""
        while not self._stopping:
            r, _, _ = select.select([s.fileno(), self._wake_r], [], [], 1.0)
            if self._wake_r in r or self._stopping:
                return False
            if r:
                return True
        return False

    def _serve(self, s: socket.socket) -> None:
        raise NotImplementedError

    def _record(self, conn: Conn) -> None:
        with self._cond:
            self.conns.append(conn)
            self._cond.notify_all()

    # assertions --------------------------------------------------------------
    @property
    def last(self) -> Conn | None:
        with self._cond:
            return self.conns[-1] if self.conns else None

    def wait_for(self, n: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Conn]:
        """Wait until at least ``n`` conns are recorded; return them. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.conns) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"listener {self.label}: {len(self.conns)} conns after {timeout} s, wanted {n}")
                self._cond.wait(left)
            return list(self.conns)

    def conn_for(self, line: str) -> Conn | None:
        """The recorded conn whose first line was ``line`` (probes send unique tokens)."""
        with self._cond:
            for c in reversed(self.conns):
                if c.line == line:
                    return c
        return None

    def clear(self) -> None:
        with self._cond:
            self.conns.clear()

    def __repr__(self) -> str:
        where = f"{rnetns.describe(self.netns)} [{self.host}]:{self.port}"
        return f"<{type(self).__name__} {self.label} {where} conns={len(self.conns)}>"


class TcpListener(Listener):
    """Accepts TCP connections in ``netns``; records each, answers ``b"<label>\\n"``.

    ``transparent=True`` sets IP(V6)_TRANSPARENT (TPROXY delivery: the local address
    is the original destination); ``mark`` sets SO_MARK (ambient proxy sockets).
    """

    proto = "tcp"
    sock_type = socket.SOCK_STREAM

    def _serve(self, s: socket.socket) -> None:
        while self._wait_readable(s):
            try:
                c, peer = s.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(c, peer), daemon=True).start()

    def _handle(self, c: socket.socket, peer: Any) -> None:
        # Records before answering, so a client that got the answer finds the record.
        with c, contextlib.suppress(OSError):
            c.settimeout(DEFAULT_TIMEOUT)
            local = _addr2(c.getsockname())
            odst = original_dst(c)
            line = _read_line(c)
            self._record(Conn("tcp", _addr2(peer), local, odst, line, at=time.monotonic()))
            if line is not None:
                c.sendall(self.label.encode() + b"\n")


class UdpListener(Listener):
    """Receives UDP datagrams in ``netns``; records source, destination and interface; answers its label.

    The answer leaves from the address the datagram was sent to (IP_PKTINFO), so a
    connected client, and conntrack's reverse NAT, accept it. A transparent
    listener answers from the datagram's (original) destination address and port.
    """

    proto = "udp"
    sock_type = socket.SOCK_DGRAM

    def _configure(self, s: socket.socket) -> None:
        if self.family == 4:
            s.setsockopt(SOL_IP, IP_PKTINFO, 1)
            s.setsockopt(SOL_IP, IP_RECVORIGDSTADDR, 1)
        else:
            s.setsockopt(SOL_IPV6, IPV6_RECVPKTINFO, 1)
            s.setsockopt(SOL_IPV6, IPV6_RECVORIGDSTADDR, 1)

    def _serve(self, s: socket.socket) -> None:
        while self._wait_readable(s):
            try:
                data, anc, _flags, peer = s.recvmsg(4096, 1024)
            except OSError:
                continue
            ifindex: int | None = None
            dst_ip: str | None = None
            odst: Addr | None = None
            for level, typ, raw in anc:
                if level == SOL_IP and typ == IP_PKTINFO:
                    ifindex, _spec, addr = struct.unpack_from("i4s4s", raw)
                    dst_ip = socket.inet_ntop(socket.AF_INET, addr)
                elif level == SOL_IPV6 and typ == IPV6_PKTINFO:
                    addr, ifindex = struct.unpack_from("16si", raw)
                    dst_ip = socket.inet_ntop(socket.AF_INET6, addr)
                elif level == SOL_IP and typ == IP_RECVORIGDSTADDR:
                    odst = _sockaddr_in(raw)
                elif level == SOL_IPV6 and typ == IPV6_RECVORIGDSTADDR:
                    odst = _sockaddr_in6(raw)
            local = odst or (dst_ip or self.host, self.port)
            line = data.split(b"\n", 1)[0].decode(errors="replace") if data else None
            self._record(Conn("udp", _addr2(peer), local, odst, line, ifindex, time.monotonic()))
            with contextlib.suppress(OSError):
                self._reply(s, peer, local)

    def _reply(self, s: socket.socket, peer: Any, local: Addr) -> None:
        msg = self.label.encode() + b"\n"
        if self.transparent and local[1] != self.port:
            af = socket.AF_INET if self.family == 4 else socket.AF_INET6
            with socket.socket(af, socket.SOCK_DGRAM) as r:
                r.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self.family == 4:
                    r.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
                else:
                    r.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
                if self.mark is not None:
                    r.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
                r.bind(local)
                r.sendto(msg, peer)
            return
        if self.family == 4:
            cmsg = struct.pack("i4s4s", 0, socket.inet_pton(socket.AF_INET, local[0]), b"\0" * 4)
            s.sendmsg([msg], [(SOL_IP, IP_PKTINFO, cmsg)], 0, peer)
        else:
            cmsg = struct.pack("16si", socket.inet_pton(socket.AF_INET6, local[0]), 0)
            s.sendmsg([msg], [(SOL_IPV6, IPV6_PKTINFO, cmsg)], 0, peer)


# --------------------------------------------------------------------------- probes


@dataclass
class ProbeResult:
    """The outcome of one probe, as the client saw it."""

    label: str | None  # the line the listener answered, None if none
    error: str | None  # None, "refused", "timeout", "reset", "unreachable", "noreply" or an errno text
    token: str  # the unique line the probe sent (listeners record it as Conn.line)
    local: Addr | None = None  # the client socket's local address
    creds: tuple[int, ...] | None = None  # (ruid, euid, suid, rgid, egid, sgid) the client ran with
    groups: tuple[int, ...] | None = None
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return self.label is not None

    def seen_by(self, *listeners: Listener) -> tuple[Listener, Conn] | None:
        """The listener (and its record) that saw this probe, or None."""
        for lst in listeners:
            c = lst.conn_for(self.token)
            if c is not None:
                return lst, c
        return None


_tokens = itertools.count(1)


def _new_token(proto: str) -> str:
    return f"{proto}-probe-{os.getpid()}-{next(_tokens)}"


def _family_of(ip: str) -> int:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def _errname(e: OSError) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(e, ConnectionResetError):
        return "reset"
    if e.errno in (101, 113):  # ENETUNREACH, EHOSTUNREACH
        return "unreachable"
    return os.strerror(e.errno) if e.errno else repr(e)


def _src_addr(src: str | Addr | None) -> Addr | None:
    if src is None:
        return None
    if isinstance(src, str):
        return src, 0
    return src


def _attempt(
    proto: str, dst_ip: str, port: int, src: str | Addr | None, timeout: float, mark: int | None, token: str
) -> dict[str, Any]:
    """One probe from the current thread's netns and credentials; a JSON-able dict."""
    out: dict[str, Any] = {"label": None, "error": None, "local": None}
    out["creds"] = list(os.getresuid()) + list(os.getresgid())
    out["groups"] = os.getgroups()
    st = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    try:
        with socket.socket(_family_of(dst_ip), st) as s:
            s.settimeout(timeout)
            if mark is not None:
                s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
            srca = _src_addr(src)
            if srca is not None:
                s.bind(srca)
            s.connect((dst_ip, port))
            out["local"] = list(_addr2(s.getsockname()))
            if proto == "tcp":
                s.sendall(token.encode() + b"\n")
                out["label"] = _read_line(s)
            else:
                s.send(token.encode() + b"\n")
                data = s.recv(4096)
                out["label"] = data.split(b"\n", 1)[0].decode(errors="replace")
            if out["label"] is None:
                out["error"] = "noreply"
    except OSError as e:
        out["error"] = _errname(e)
    return out


# Raw syscall numbers: the kernel keeps credentials per thread, but glibc's set*id()
# change every thread of the process; the raw syscalls change only the caller.
_SYSCALLS = {
    "x86_64": {"setgroups": 116, "setresuid": 117, "setresgid": 119},
    "aarch64": {"setgroups": 159, "setresuid": 147, "setresgid": 149},
}
_libc: Any = None


def _raw_syscall(name: str, *args: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    nr = _SYSCALLS[platform.machine()][name]
    if _libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args}: {os.strerror(err)}")


def _in_thread_as(
    ns: rnetns.NetnsRef, uid: int | None, gid: int | None, timeout: float, fn: Callable[..., dict[str, Any]], *args: Any
) -> dict[str, Any]:
    """Run ``fn`` in a throwaway thread that entered ``ns`` and dropped to ``uid``/``gid``.

    Only that thread changes credentials (raw setresuid/setresgid/setgroups), so the
    sockets it opens belong to ``uid``/``gid`` for netfilter's owner match while the
    rest of the process stays root. The thread can't come back (no capabilities
    left), so it never tries: it exits after the probe.
    """
    from redirect._native import lib

    box: dict[str, Any] = {}
    nsfd = rnetns.open_netns(ns)

    def run() -> None:
        try:
            rc = lib.rdr_setns(nsfd, rnetns.CLONE_NEWNET)
            if rc < 0:
                raise OSError(-rc, f"setns: {os.strerror(-rc)}")
            if gid is not None:
                _raw_syscall("setgroups", 0, 0)
                _raw_syscall("setresgid", gid, gid, gid)
            if uid is not None:
                _raw_syscall("setresuid", uid, uid, uid)
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["result"] = {"label": None, "error": f"probe thread: {e!r}"}

    try:
        t = threading.Thread(target=run, name=f"probe-as-{uid}:{gid}", daemon=True)
        t.start()
        t.join(timeout + 2.0)
        if t.is_alive():
            return {"label": None, "error": "probe thread did not finish"}
    finally:
        os.close(nsfd)
    return box["result"]  # type: ignore[no-any-return]


def _in_child(
    ns: rnetns.NetnsRef, uid: int | None, gid: int | None, timeout: float, fn: Callable[..., dict[str, Any]], *args: Any
) -> dict[str, Any]:
    """Run ``fn`` in a forked child that entered ``ns`` and dropped to ``uid``/``gid``.

    The child only makes syscalls (setns, set*id, socket calls), reports one JSON
    document through a pipe and leaves with ``os._exit``: no locks of other threads
    are touched, which is what makes fork from a threaded process safe enough here.
    """
    from redirect._native import lib  # imported before fork, never in the child

    nsfd = rnetns.open_netns(ns)
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                os.close(r)
                if lib.rdr_setns(nsfd, rnetns.CLONE_NEWNET) < 0:
                    raise OSError("setns failed")
                if gid is not None:
                    os.setgroups([])
                    os.setresgid(gid, gid, gid)
                if uid is not None:
                    os.setresuid(uid, uid, uid)
                res = fn(*args)
                os.write(w, json.dumps(res).encode())
            except BaseException as e:  # noqa: BLE001
                with contextlib.suppress(BaseException):
                    os.write(w, json.dumps({"label": None, "error": f"child: {e!r}"}).encode())
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        w = -1
        buf = b""
        deadline = time.monotonic() + timeout + 2.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                break
            rd, _, _ = select.select([r], [], [], left)
            if not rd:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
        os.waitpid(pid, 0)
        if not buf:
            return {"label": None, "error": "child died without answering"}
        return json.loads(buf)  # type: ignore[no-any-return]
    finally:
        os.close(nsfd)
        os.close(r)
        if w >= 0:
            os.close(w)


def _probe(
    proto: str,
    netns: rnetns.NetnsRef,
    dst_ip: str,
    port: int,
    uid: int | None,
    gid: int | None,
    src: str | Addr | None,
    timeout: float,
    mark: int | None,
    fork: bool,
) -> ProbeResult:
    if mark is not None and uid not in (None, 0):
        raise ValueError("mark with a non-root uid: setting SO_MARK needs CAP_NET_ADMIN, which the uid drops")
    token = _new_token(proto)
    t0 = time.perf_counter()
    args = (proto, dst_ip, port, src, timeout, mark, token)
    if uid is None and gid is None:
        with rnetns.enter(netns):
            res = _attempt(*args)
    elif fork:
        res = _in_child(netns, uid, gid, timeout, _attempt, *args)
    else:
        res = _in_thread_as(netns, uid, gid, timeout, _attempt, *args)
    return ProbeResult(
        label=res.get("label"),
        error=res.get("error"),
        token=token,
        local=_addr2(res["local"]) if res.get("local") else None,
        creds=tuple(res["creds"]) if res.get("creds") else None,
        groups=tuple(res["groups"]) if res.get("groups") is not None else None,
        elapsed=time.perf_counter() - t0,
    )


def tcp_probe_detail(
    netns: rnetns.NetnsRef,
    dst_ip: str,
    port: int,
    uid: int | None = None,
    gid: int | None = None,
    src: str | Addr | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    mark: int | None = None,
    *,
    fork: bool = False,
) -> ProbeResult:
    """Connect from ``netns``, send a unique token line, read the answer.

    With ``uid``/``gid`` the probe runs in a throwaway thread holding those
    credentials (``fork=True``: in a forked child instead).
    """
    return _probe("tcp", netns, dst_ip, port, uid, gid, src, timeout, mark, fork)


def tcp_probe(
    netns: rnetns.NetnsRef,
    dst_ip: str,
    port: int,
    uid: int | None = None,
    gid: int | None = None,
    src: str | Addr | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    mark: int | None = None,
    *,
    fork: bool = False,
) -> str | None:
    """The label of the listener a TCP connection from ``netns`` reached, or None (refused/timeout/...)."""
    return tcp_probe_detail(netns, dst_ip, port, uid, gid, src, timeout, mark, fork=fork).label


def udp_probe_detail(
    netns: rnetns.NetnsRef,
    dst_ip: str,
    port: int,
    uid: int | None = None,
    gid: int | None = None,
    src: str | Addr | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    mark: int | None = None,
    *,
    fork: bool = False,
) -> ProbeResult:
    """Send one datagram from a connected UDP socket in ``netns`` and wait for the answer."""
    return _probe("udp", netns, dst_ip, port, uid, gid, src, timeout, mark, fork)


def udp_probe(
    netns: rnetns.NetnsRef,
    dst_ip: str,
    port: int,
    uid: int | None = None,
    gid: int | None = None,
    src: str | Addr | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    mark: int | None = None,
    *,
    fork: bool = False,
) -> str | None:
    """The label of the UDP listener that answered a datagram from ``netns``, or None."""
    return udp_probe_detail(netns, dst_ip, port, uid, gid, src, timeout, mark, fork=fork).label


# --------------------------------------------------------------------------- landing


@dataclass
class Landing:
    """Where a probe landed: the answer, and the record of the listener that saw it."""

    result: ProbeResult
    listener: Listener | None
    conn: Conn | None

    @property
    def label(self) -> str | None:
        return self.result.label

    @property
    def orig_dst(self) -> Addr | None:
        return self.conn.orig_dst if self.conn else None

    @property
    def local(self) -> Addr | None:
        """The address the listener's socket saw as its own (the destination under TPROXY)."""
        return self.conn.local if self.conn else None

    @property
    def peer(self) -> Addr | None:
        return self.conn.peer if self.conn else None


def landing(
    netns: rnetns.NetnsRef,
    dst_ip: str,
    port: int,
    *listeners: Listener,
    proto: Literal["tcp", "udp"] = "tcp",
    **kw: Any,
) -> Landing:
    """Probe ``dst_ip:port`` from ``netns`` and find which of ``listeners`` saw it.

    ``hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app)`` then
    ``assert hit.listener is proxy and hit.orig_dst == (pod.peer_ip4, 8080)``.
    Extra keywords go to the probe (``uid``, ``gid``, ``src``, ``timeout``, ``mark``).
    """
    fn = tcp_probe_detail if proto == "tcp" else udp_probe_detail
    res = fn(netns, dst_ip, port, **kw)
    seen = res.seen_by(*listeners)
    return Landing(res, seen[0] if seen else None, seen[1] if seen else None)
