"""``redirect-nodeproxy``: a reference node proxy for the ambient node agent (like a tiny ztunnel).

It connects to the agent's proxy socket (``redirect-agent --proxy-socket``), says
hello, and for every pod the agent hands over (its netns fd arrives with
``SCM_RIGHTS``) opens listeners *inside the pod netns*, marked ``SO_MARK 0x539``
so the pod's rules never capture them, on:

- 15001 outbound: the pod's outbound TCP, REDIRECT'd; the original destination
  comes from ``SO_ORIGINAL_DST`` / ``IP6T_SO_ORIGINAL_DST``;
- 15006 inbound: TCP to the pod, REDIRECT'd; the original destination is the pod's
  own address and port;
- 15008 tunnel: a plaintext ``CONNECT host:port`` (HTTP/1.1) tunnel to the pod: the
  place where a real ztunnel terminates HBONE (mTLS); here without TLS.

Each connection is forwarded to its original destination from a marked socket made
in the pod netns (so it is not captured again: for inbound, it reaches the app over
``lo``), and logged as JSON lines (``accept``, ``forward``, ``close``). Inbound is
forwarded from the pod's own address, so the app sees the pod IP as the source; a real
ztunnel keeps the client's address (a transparent socket, which the ambient rules'
connmark route supports) but that can clash in conntrack with the client's own tuple
when the ports coincide, so this reference proxy does not. Listeners
exist for IPv4 and, where the pod has it, IPv6.

Handoff: acks each ``add`` once its listeners are open; ``del`` closes them; after
a (re)connect the agent sends a snapshot and ``snapshot_done`` listing every pod,
and pods not in it are dropped. When the agent goes away the proxy keeps serving
every pod it has and reconnects (backoff up to 1 s). Connections are bounded
(``--max-conns``; over it, new ones are closed at once) and each relay has an idle
timeout.

There is no DNS listener (15053): pods enrolled with ``dns_capture`` need a node proxy
that has one.

Handover: listeners use ``SO_REUSEPORT``, so a new proxy can start beside the old one, and
each carries a BPF program of type ``SK_REUSEPORT_SELECT_OR_MIGRATE`` that selects nothing
(``rdr_reuseport_migrate_prog``: the kernel picks a listener by hash as without it), so when
the old one gets SIGTERM (it closes its listeners, then lets relayed connections finish for at
most ``--drain-timeout``) the connections queued on its listeners move to the new one's instead
of being reset: no connection is lost. The program needs CAP_BPF or CAP_SYS_ADMIN (the proxy
has the latter for setns) and nothing of the pod's: not ``net.ipv4.tcp_migrate_req``, which
would change every reuseport group of the pod, the app's too, and which a runtime's read-only
``/proc/sys`` keeps from being set. Where the program can't be had (a seccomp profile that
refuses ``bpf()``), the proxy serves the pod all the same and logs ``no_handover`` with the
reason: a handover there may reset the connections still queued on the old proxy's listeners.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from .. import logjson, native
from ..config import int_arg, seconds_arg
from ..errors import NotBuilt
from ..kernel import netns as _netns
from ..relay import SO_MARK, original_dst, pump
from ..version import VersionAction
from .agent import protocol

MARK = 0x539
PORTS = {"outbound": 15001, "inbound": 15006, "tunnel": 15008}


#: Events logged at level warning (the rest are info).
WARNING_EVENTS = frozenset({"agent_disconnected", "bad_message", "pod_failed", "no_ipv6_listener", "accept_failed",
                            "no_original_dst", "rejected", "bad_tunnel_request", "upstream_failed", "relay_error",
                            "no_handover"})


class JsonLog:
    """Thread-safe event log, one line per event: JSON in ``redirect.logjson``'s format (``msg`` and
    ``event`` are the event's name, then its fields), or, with ``json_lines=False``, text."""

    def __init__(self, out: TextIO, json_lines: bool = True) -> None:
        self.out = out
        self.json_lines = json_lines
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        level = "warning" if event in WARNING_EVENTS else "info"
        if self.json_lines:
            line = logjson.json_line(level, "redirect.nodeproxy", event, fields={"event": event, **fields})
        else:
            line = f"{logjson.timestamp(time.time())} {level.upper()} redirect.nodeproxy: {event} " + \
                " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in fields.items())
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()


@dataclass
class PodState:
    uid: str
    name: str
    namespace: str
    inode: int
    nsfd: int
    listeners: list[tuple[socket.socket, str, int]] = field(default_factory=list)


def _addr(a: Any) -> list[Any]:
    return [a[0], a[1]]


def _read_connect(c: socket.socket, limit: int = 8192) -> tuple[str, int] | None:
    """Read ``CONNECT host:port HTTP/1.1`` and headers; the target, or None."""
    buf = b""
    while b"\r\n\r\n" not in buf and len(buf) < limit:
        chunk = c.recv(limit - len(buf))
        if not chunk:
            return None
        buf += chunk
    first = buf.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(first) != 3 or first[0] != "CONNECT":
        return None
    host, _, port = first[1].rpartition(":")
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        return None


_MAX_POD_FIELD = 253  # a Kubernetes name or namespace at most


def _malformed(msg: dict[str, Any]) -> str | None:
    """What is wrong with an agent message's fields (None: nothing): a pod's uid as the agent's
    protocol defines it, its name and namespace short strings, a snapshot's pods a list of uids.
    The agent is trusted, but a bad message must cost an error ack, never the proxy."""
    kind = msg["type"]

    def uid_problem(v: object, where: str) -> str | None:
        ok = isinstance(v, str) and protocol.UID_RE.fullmatch(v) is not None
        return None if ok else f"{where}: not a pod uid: {str(v)[:64]!r}"

    if kind == "add":
        pod = msg.get("pod")
        if not isinstance(pod, dict):
            return "pod: expected an object"
        for f in ("name", "namespace"):
            v = pod.get(f, "")
            if not isinstance(v, str) or len(v) > _MAX_POD_FIELD:
                return f"pod.{f}: expected a string of at most {_MAX_POD_FIELD} characters"
        return uid_problem(pod.get("uid"), "pod.uid")
    if kind == "del":
        return uid_problem(msg.get("uid"), "uid")
    if kind in ("snapshot_done", "snapshot_pods"):
        pods = msg.get("pods", [])
        if not isinstance(pods, list):
            return "pods: expected a list of pod uids"
        return next((p for p in (uid_problem(u, "pods") for u in pods) if p), None)
    return None


#: Uids of one snapshot the proxy collects at most (``snapshot_pods`` parts before ``snapshot_done``).
_MAX_SNAPSHOT = 1_000_000

#: setsockopt(SOL_SOCKET) option that gives a socket's reuseport group a BPF program (asm-generic/socket.h).
SO_ATTACH_REUSEPORT_EBPF = 52


def _migrate_prog() -> tuple[int, str | None]:
    """The program that makes a closing listener's queued connections move to another listener of
    its reuseport group (``rdr_reuseport_migrate_prog``, native/redirect_native.c): (its fd, None),
    or (-1, why it could not be had)."""
    try:
        fd = int(native.load().lib.rdr_reuseport_migrate_prog())
    except NotBuilt as e:
        return -1, str(e)
    if fd < 0:
        return -1, f"loading the SK_REUSEPORT migration program: {os.strerror(-fd)}"
    return fd, None


class NodeProxy:
    def __init__(self, socket_path: str, log: JsonLog, name: str = "redirect-nodeproxy", max_conns: int = 1024,
                 connect_timeout: float = 5.0, idle_timeout: float = 300.0, mark: int = MARK) -> None:
        self.socket_path = socket_path
        self.log = log
        self.name = name
        self.mark = mark
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.sel = selectors.DefaultSelector()
        self.pods: dict[str, PodState] = {}
        self._snapshot: set[str] = set()  # uids of the snapshot parts (snapshot_pods) so far
        self.agent: socket.socket | None = None
        self.slots = threading.BoundedSemaphore(max_conns)
        self.active = 0
        self._active_lock = threading.Lock()
        self.drain_timeout = 5.0
        self.stop = threading.Event()
        #: Attached to every listener: a handover moves their queued connections (``_migrate_prog``).
        self._migrate_fd, self._no_migrate = _migrate_prog()
        self._wr, self._ww = os.pipe()
        self.sel.register(self._wr, selectors.EVENT_READ, ("wake", None))

    # -- agent connection

    def _connect_agent(self) -> bool:
        self._snapshot = set()  # (a new connection, a new snapshot)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(2.0)
            s.connect(self.socket_path)
            protocol.send(s, {"type": "hello", "proxy": self.name, "pid": os.getpid()})
            s.settimeout(None)
        except OSError:
            s.close()
            return False
        self.agent = s
        self.sel.register(s, selectors.EVENT_READ, ("agent", None))
        self.log("agent_connected", socket=self.socket_path, pods=len(self.pods))
        return True

    def _drop_agent(self, why: str) -> None:
        if self.agent is not None:
            self.sel.unregister(self.agent)
            self.agent.close()
            self.agent = None
            self.log("agent_disconnected", reason=why, pods=len(self.pods))

    def _ack(self, mid: Any, ok: bool = True, error: str = "") -> None:
        if self.agent is None:
            return
        msg: dict[str, Any] = {"type": "ack", "id": mid, "ok": ok}
        if error:
            msg["error"] = error
        try:
            protocol.send(self.agent, msg)
        except OSError as e:
            self._drop_agent(f"send failed: {e}")

    def _on_agent(self) -> None:
        assert self.agent is not None
        try:
            got = protocol.recv(self.agent, max_fds=4)
        except protocol.ProtocolError as e:
            self.log("bad_message", error=str(e))
            return
        except OSError as e:
            self._drop_agent(str(e))
            return
        if got is None:
            self._drop_agent("agent closed the connection")
            return
        msg, fds = got
        mid = msg.get("id")
        kind = msg["type"]
        try:
            bad = _malformed(msg)
            if bad is not None:
                self.log("bad_message", type=kind, error=bad)
                self._ack(mid, False, bad)
            elif kind == "add":
                if len(fds) != 1:
                    self._ack(mid, False, f"add needs exactly one netns fd, got {len(fds)}")
                    return
                err = self.add_pod(msg["pod"], fds.pop())
                self._ack(mid, err is None, err or "")
            elif kind == "del":
                self.remove_pod(msg["uid"], "deleted")
                self._ack(mid)
            elif kind == "snapshot_pods":  # a part of a snapshot too large for one message
                if len(self._snapshot) + len(msg["pods"]) > _MAX_SNAPSHOT:
                    self._ack(mid, False, f"a snapshot of more than {_MAX_SNAPSHOT} pods")
                else:
                    self._snapshot.update(msg["pods"])
                    self._ack(mid)
            elif kind == "snapshot_done":
                keep = set(msg["pods"]) | (self._snapshot if msg.get("chunked") is True else set())
                self._snapshot = set()
                for uid in [u for u in self.pods if u not in keep]:
                    self.remove_pod(uid, "not in the agent's snapshot")
                self.log("snapshot_done", pods=sorted(self.pods))
                self._ack(mid)
            else:
                self._ack(mid, False, f"unknown message type {kind!r}")
        finally:
            for fd in fds:
                os.close(fd)

    # -- pods

    def add_pod(self, pod: dict[str, Any], nsfd: int) -> str | None:
        """Open the pod's listeners (takes ``nsfd``); None, or an error text."""
        uid = pod["uid"]
        inode = os.fstat(nsfd).st_ino
        cur = self.pods.get(uid)
        if cur is not None and cur.inode == inode:
            os.close(nsfd)
            return None  # already serving it (a snapshot after a reconnect)
        if cur is not None:
            self.remove_pod(uid, "replaced by a new netns")
        st = PodState(uid, str(pod.get("name", "")), str(pod.get("namespace", "")), inode, nsfd)
        try:
            no_handover: list[str] = [self._no_migrate] if self._no_migrate else []
            with _netns.enter(_netns.Fd(nsfd)):
                for kind, port in PORTS.items():
                    for fam in (socket.AF_INET, socket.AF_INET6):
                        try:
                            st.listeners.append((self._listen(fam, port, no_handover), kind, port))
                        except OSError as e:
                            if fam == socket.AF_INET:
                                raise
                            self.log("no_ipv6_listener", pod=uid, port=port, error=str(e))
        except (OSError, _netns.NetnsError) as e:
            for s, _, _ in st.listeners:
                s.close()
            os.close(nsfd)
            self.log("pod_failed", pod=uid, error=str(e))
            return f"listeners in pod {uid}: {e}"
        for s, kind, _ in st.listeners:
            self.sel.register(s, selectors.EVENT_READ, ("listener", (st, kind)))
        self.pods[uid] = st
        if no_handover:
            self.log("no_handover", pod=uid, error=no_handover[0])
        self.log("pod_added", pod=uid, name=st.name, namespace=st.namespace, netns_inode=inode,
                 listeners=[f"{'v6' if s.family == socket.AF_INET6 else 'v4'}:{p}" for s, _, p in st.listeners])
        return None

    def _listen(self, fam: int, port: int, no_handover: list[str]) -> socket.socket:
        """A listener of the pod's on ``port``; why its queued connections would not move to a new
        proxy's listener at a handover goes to ``no_handover`` (its reuseport group's program could
        not be attached)."""
        s = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # A new proxy opens its listeners beside the old one's (handover), and ...
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(("0.0.0.0" if fam == socket.AF_INET else "::", port))
            s.listen(256)
            s.setblocking(False)
        except OSError:
            s.close()
            raise
        if self._migrate_fd >= 0:
            try:
                s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, self._migrate_fd)
            except OSError as e:
                no_handover.append(f"attaching the SK_REUSEPORT migration program: {e.strerror or e}")
        return s

    def remove_pod(self, uid: str, why: str) -> None:
        st = self.pods.pop(uid, None)
        if st is None:
            return
        for s, _, _ in st.listeners:
            self.sel.unregister(s)
            s.close()
        os.close(st.nsfd)
        self.log("pod_removed", pod=uid, reason=why)

    # -- connections

    def _on_accept(self, lsock: socket.socket, st: PodState, kind: str) -> None:
        try:
            c, peer = lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.log("accept_failed", pod=st.uid, error=str(e))
            return
        c.setblocking(True)
        dst = original_dst(c) if kind != "tunnel" else None
        local = c.getsockname()
        if kind != "tunnel" and (dst is None or (dst[1] in PORTS.values() and dst[0] == local[0])):
            self.log("no_original_dst", pod=st.uid, kind=kind, src=_addr(peer))
            c.close()
            return
        if not self.slots.acquire(blocking=False):
            self.log("rejected", pod=st.uid, kind=kind, src=_addr(peer), reason="--max-conns reached")
            c.close()
            return
        self.log("accept", pod=st.uid, kind=kind, src=_addr(peer), local=_addr(local),
                 orig_dst=list(dst) if dst else None)
        nsfd = os.dup(st.nsfd)
        with self._active_lock:
            self.active += 1
        threading.Thread(target=self._relay, args=(c, peer, dst, kind, st.uid, nsfd), name=f"relay:{st.uid}",
                         daemon=True).start()

    def _relay(self, c: socket.socket, peer: Any, dst: tuple[str, int] | None, kind: str, uid: str,
               nsfd: int) -> None:
        up: socket.socket | None = None
        sent = (0, 0)
        try:
            c.settimeout(self.connect_timeout)
            if kind == "tunnel":
                dst = _read_connect(c)
                if dst is None:
                    c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                    self.log("bad_tunnel_request", pod=uid, src=_addr(peer))
                    return
            assert dst is not None
            fam = socket.AF_INET6 if ":" in dst[0] else socket.AF_INET
            with _netns.enter(_netns.Fd(nsfd)):
                up = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            os.close(nsfd)
            nsfd = -1
            up.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
            up.settimeout(self.connect_timeout)
            try:
                up.connect(dst)
            except OSError as e:
                self.log("upstream_failed", pod=uid, kind=kind, src=_addr(peer), orig_dst=list(dst), error=str(e))
                if kind == "tunnel":
                    c.sendall(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
                return
            self.log("forward", pod=uid, kind=kind, src=_addr(peer), orig_dst=list(dst),
                     upstream_local=_addr(up.getsockname()))
            if kind == "tunnel":
                c.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
            sent = pump(c, up, self.idle_timeout)
        except (OSError, _netns.NetnsError) as e:
            self.log("relay_error", pod=uid, kind=kind, src=_addr(peer), error=str(e))
        finally:
            if nsfd >= 0:
                os.close(nsfd)
            if up is not None:
                up.close()
            c.close()
            self.slots.release()
            with self._active_lock:
                self.active -= 1
            self.log("close", pod=uid, kind=kind, src=_addr(peer), bytes_out=sent[0], bytes_in=sent[1])

    # -- main loop

    def run(self) -> None:
        backoff = 0.1
        next_try = 0.0
        self.log("started", socket=self.socket_path, pid=os.getpid())
        while not self.stop.is_set():
            if self.agent is None and time.monotonic() >= next_try:
                if self._connect_agent():
                    backoff = 0.1
                else:
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, 1.0)
            for key, _ in self.sel.select(timeout=0.2):
                what, data = key.data
                if what == "agent":
                    self._on_agent()
                elif what == "listener":
                    st, kind = data
                    self._on_accept(key.fileobj, st, kind)  # type: ignore[arg-type]
                else:
                    os.read(self._wr, 64)
        # Listeners first (their queued connections migrate to a proxy that took over), then
        # let the connections being relayed finish, for at most drain_timeout.
        for uid in list(self.pods):
            self.remove_pod(uid, "proxy stopping")
        self._drop_agent("proxy stopping")
        deadline = time.monotonic() + self.drain_timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._migrate_fd >= 0:
            os.close(self._migrate_fd)  # (the listeners' groups hold the program while they last)
            self._migrate_fd = -1
        self.log("stopped", unfinished=self.active)

    def shutdown(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            os.write(self._ww, b"x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="redirect-nodeproxy",
        description="Reference node proxy for redirect-agent: takes pod netns fds from the agent, opens marked "
                    "listeners on 15001/15006/15008 inside each pod, forwards captured connections to their "
                    "original destination, logs them as JSON lines.")
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--socket", default=protocol.DEFAULT_PROXY_SOCKET,
                   help="the agent's proxy socket (default %(default)s)")
    p.add_argument("--name", default="redirect-nodeproxy", help="name sent in hello (logs)")
    p.add_argument("--log-file", default=None, help="the log (default: stderr)")
    p.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=True,
                   help="one JSON object per line (time, level, logger, msg, event and its fields); "
                        "--no-log-json: text (default: JSON)")
    p.add_argument("--max-conns", type=int_arg(1, 1_000_000), default=1024,
                   help="connections relayed at once (%(default)s)")
    p.add_argument("--connect-timeout", type=seconds_arg(0.001, 3600), default=5.0,
                   help="upstream connect timeout, s (%(default)s)")
    p.add_argument("--idle-timeout", type=seconds_arg(0.001, 86400), default=300.0,
                   help="relay idle timeout, s (%(default)s)")
    p.add_argument("--drain-timeout", type=seconds_arg(0, 3600), default=5.0,
                   help="on SIGTERM, wait this long for relayed connections to finish, s (%(default)s)")
    a = p.parse_args(argv)
    if a.max_conns < 1:
        p.error(f"--max-conns={a.max_conns}: expected at least 1")
    out: TextIO = open(a.log_file, "a", encoding="utf-8") if a.log_file else sys.stderr  # noqa: SIM115
    proxy = NodeProxy(a.socket, JsonLog(out, a.log_json), a.name, a.max_conns, a.connect_timeout, a.idle_timeout)
    proxy.drain_timeout = a.drain_timeout
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proxy.shutdown())
    try:
        proxy.run()
    finally:
        if out is not sys.stderr:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
