"""Probes of the test kit: connect or send from a netns as a uid, and find which listener answered."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import os
import platform
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from redirect.kernel import netns as rnetns
from redirect.relay import IP_TRANSPARENT, IPV6_TRANSPARENT, SO_MARK, SOL_IPV6
from tests.kit.listeners import Conn, Listener, addr_of, read_line
from tests.kit.pods import DEFAULT_TIMEOUT, Addr

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


def _bind(s: socket.socket, src: Addr) -> None:
    """Bind ``s`` to ``src``; a source the netns does not have is bound transparently, as a TPROXY
    proxy's socket connecting from the client's address is (``IP_TRANSPARENT``: root only)."""
    try:
        s.bind(src)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        if s.family == socket.AF_INET:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        else:
            s.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        s.bind(src)


def _sockaddr(ip: str, port: int, socktype: int) -> tuple[Any, ...]:
    """``(ip, port)``, or for a scoped IPv6 address (``fe80::1%eth0``) the full sockaddr with the
    scope's ifindex in this thread's netns (``connect`` itself ignores a ``%`` scope)."""
    if "%" not in ip:
        return ip, port
    return socket.getaddrinfo(ip, port, socket.AF_INET6, socktype, 0, socket.AI_NUMERICHOST)[0][4]


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
                _bind(s, srca)
            s.connect(_sockaddr(dst_ip, port, st))
            out["local"] = list(addr_of(s.getsockname()))
            if proto == "tcp":
                s.sendall(token.encode() + b"\n")
                out["label"] = read_line(s)
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


def connect_as(ns: rnetns.NetnsRef, dst: str, port: int, uid: int, src: str | None = None,
               timeout: float = 5.0) -> socket.socket:
    """A TCP connection made in ``ns`` by a task of ``uid`` (only its thread changes credentials),
    left open for the caller (who closes it)."""

    def go() -> dict[str, Any]:
        s = socket.socket(socket.AF_INET6 if ":" in dst else socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout)
        if src is not None:
            s.bind((src, 0))
        s.connect((dst, port))
        return {"sock": s}

    res = _in_thread_as(ns, uid, uid, timeout, go)
    assert "sock" in res, res
    return res["sock"]  # type: ignore[no-any-return]


def in_child(
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
        res = in_child(netns, uid, gid, timeout, _attempt, *args)
    else:
        res = _in_thread_as(netns, uid, gid, timeout, _attempt, *args)
    return ProbeResult(
        label=res.get("label"),
        error=res.get("error"),
        token=token,
        local=addr_of(res["local"]) if res.get("local") else None,
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

