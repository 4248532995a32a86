"""Listeners of the test kit: threads in a netns that record what reached them (``Conn``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Self

from redirect.kernel import netns as rnetns
from redirect.relay import IP_TRANSPARENT, IPV6_TRANSPARENT, SO_MARK, SOL_IPV6, original_dst
from tests.kit.pods import DEFAULT_TIMEOUT, Addr

# More socket options the stdlib does not name (Linux uapi values); the proxies' ones are in redirect.relay.
IP_PKTINFO = 8
IP_RECVORIGDSTADDR = 20  # cmsg type IP_ORIGDSTADDR, same number
IPV6_RECVPKTINFO = 49
IPV6_PKTINFO = 50
IPV6_RECVORIGDSTADDR = 74  # cmsg type IPV6_ORIGDSTADDR, same number
SOL_IP = socket.IPPROTO_IP  # 0


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


def addr_of(a: Any) -> Addr:
    return str(a[0]), int(a[1])


def read_line(sock: socket.socket, limit: int = 4096) -> str | None:
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


_libc: Any = None  # the C library, loaded on first use


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

    def _transparent_and_mark(self, s: socket.socket) -> None:
        """The listener's own socket options, also on a reply socket bound to a foreign address."""
        if self.transparent:
            if self.family == 4:
                s.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
            else:
                s.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        if self.mark is not None:
            s.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)

    def _make_socket(self) -> socket.socket:
        af = socket.AF_INET if self.family == 4 else socket.AF_INET6
        s = _socket_owned_by(self.owner, af, self.sock_type)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.family == 6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self._transparent_and_mark(s)
            self._configure(s)
            if "%" in self.host:  # a scoped IPv6 address (fe80::1%eth0): bind ignores a "%" scope
                s.bind(socket.getaddrinfo(self.host, self.port, af, self.sock_type, 0, socket.AI_NUMERICHOST)[0][4])
            else:
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
            local = addr_of(c.getsockname())
            odst = original_dst(c)
            line = read_line(c)
            self._record(Conn("tcp", addr_of(peer), local, odst, line, at=time.monotonic()))
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
            self._record(Conn("udp", addr_of(peer), local, odst, line, ifindex, time.monotonic()))
            with contextlib.suppress(OSError):
                self._reply(s, peer, local)

    def _reply(self, s: socket.socket, peer: Any, local: Addr) -> None:
        msg = self.label.encode() + b"\n"
        if self.transparent and local[1] != self.port:
            af = socket.AF_INET if self.family == 4 else socket.AF_INET6
            with socket.socket(af, socket.SOCK_DGRAM) as r:
                r.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._transparent_and_mark(r)
                r.bind(local)
                r.sendto(msg, peer)
            return
        if self.family == 4:
            cmsg = struct.pack("i4s4s", 0, socket.inet_pton(socket.AF_INET, local[0]), b"\0" * 4)
            s.sendmsg([msg], [(SOL_IP, IP_PKTINFO, cmsg)], 0, peer)
        else:
            cmsg = struct.pack("16si", socket.inet_pton(socket.AF_INET6, local[0]), 0)
            s.sendmsg([msg], [(SOL_IPV6, IPV6_PKTINFO, cmsg)], 0, peer)


