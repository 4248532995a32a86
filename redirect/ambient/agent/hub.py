"""The node proxies the agent hands pods to: who is connected, what each must be sent, the acks.

A proxy connects to the proxy socket and says ``hello``; it is sent a snapshot (every pod,
enrolled or being enrolled, then ``snapshot_done``) under the registry's lock, so a pod
handed out concurrently (``offer_locked``) reaches it exactly once either way. Acks are
awaited with one deadline for all proxies (``wait_all``). The connections themselves
(``ProxyConn``: ordered sends, validated acks) are ``proxies``'; the hub works on anything
with their interface (``Peer``), which is how it is unit-tested without sockets.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from . import protocol
from .logs import jlog
from .metrics import Metrics
from .pods import PodRecord
from .proxies import ProxyConn, Waiter, proxy_name
from .registry import Registry

#: Connections to the proxy socket that may be awaiting their hello (5 s each) at once.
MAX_HELLOS = 32


class Peer(Protocol):
    """One connected node proxy (``proxies.ProxyConn``)."""

    name: str
    synced: threading.Event

    @property
    def serving(self) -> bool: ...
    def enqueue(self, msg: dict[str, Any], fd: int | None = None) -> Waiter: ...
    def send_add(self, pod: PodRecord) -> Waiter: ...
    def close(self) -> None: ...


class ProxyHub:
    def __init__(self, registry: Registry, metrics: Metrics, timeout: float) -> None:
        self.registry = registry
        self.metrics = metrics
        self.timeout = timeout  # seconds a proxy has to ack (a snapshot: a little more per pod)
        self.conns: list[Peer] = []  # under registry.lock
        self._hellos = threading.BoundedSemaphore(MAX_HELLOS)

    # -- a proxy comes and goes

    def attach(self, conn: Peer) -> tuple[list[PodRecord], list[Waiter], Waiter]:
        """Add ``conn`` and send it the snapshot: (the pods sent, their waiters, ``snapshot_done``'s)."""
        reg = self.registry
        with reg.lock:
            self.conns.append(conn)
            pods = list({**reg.pods, **reg.enrolling}.values())
            waiters = [conn.send_add(p) for p in pods]
            done = conn.enqueue({"type": "snapshot_done", "pods": sorted(p.uid for p in pods)})
            self.metrics.set("proxy_connections", len(self.conns))
            self.metrics.add("proxy_connects_total", 1)
        jlog(logging.INFO, "node proxy connected: snapshot sent", proxy=conn.name, pods=len(pods))
        return pods, waiters, done

    def await_snapshot(self, conn: Peer, pods: Sequence[PodRecord], waiters: Sequence[Waiter], done: Waiter) -> bool:
        """Wait for the snapshot's acks; the proxy counts as synced (``check`` needs one) once it acked."""
        if done.event.wait(self.timeout + 0.05 * len(pods)) and done.ok:
            conn.synced.set()
            failed = [p.uid for p, w in zip(pods, waiters, strict=True) if not w.ok]
            jlog(logging.INFO if not failed else logging.ERROR, "node proxy synced", proxy=conn.name, failed=failed)
            return True
        jlog(logging.ERROR, "node proxy did not ack the snapshot", proxy=conn.name, error=done.error)
        return False

    def gone(self, conn: Peer) -> None:
        with self.registry.lock:
            if conn in self.conns:
                self.conns.remove(conn)
            self.metrics.set("proxy_connections", len(self.conns))
        jlog(logging.INFO, "node proxy disconnected", proxy=conn.name)

    def close_all(self) -> None:
        with self.registry.lock:
            conns = list(self.conns)
        for c in conns:
            c.close()

    # -- pods handed out and taken back

    def offer_locked(self, pod: PodRecord) -> list[tuple[Peer, Waiter]]:
        """(Under registry.lock.) ``pod`` is being enrolled: in the snapshot of a proxy that connects
        from now on, and sent to every connected one."""
        self.registry.enrolling[pod.uid] = pod
        return [(c, c.send_add(pod)) for c in self.conns]

    def withdraw_locked(self, uid: str) -> list[tuple[Peer, Waiter]]:
        """(Under registry.lock.) Tell every connected proxy that ``uid`` is gone."""
        return [(c, c.enqueue({"type": "del", "uid": uid})) for c in self.conns]

    def wait_all(self, waiters: Sequence[tuple[Peer, Waiter]]) -> list[str]:
        """Errors of the proxies that did not ack in time (disconnects count as errors)."""
        deadline = time.monotonic() + self.timeout
        errors = []
        for c, w in waiters:
            if not w.event.wait(max(deadline - time.monotonic(), 0)):
                errors.append(f"{c.name}: no ack within {self.timeout} s")
            elif not w.ok:
                errors.append(f"{c.name}: {w.error}")
        return errors

    def serving_locked(self) -> int:
        return sum(1 for c in self.conns if c.serving)

    def synced_locked(self) -> int:
        return sum(1 for c in self.conns if c.synced.is_set() and c.serving)

    # -- the proxy socket

    def accept(self, lsock: socket.socket, stopping: threading.Event) -> None:
        """Accept proxies on ``lsock`` until it is closed (each hello on a thread of its own, at
        most ``MAX_HELLOS`` at once: a connection beyond them is refused at once)."""
        n = 0
        while not stopping.is_set():
            try:
                s, _ = lsock.accept()
            except OSError:
                return
            n += 1
            if not self._hellos.acquire(blocking=False):
                jlog(logging.WARNING, "node proxy rejected", error=f"{MAX_HELLOS} connections are saying hello")
                with contextlib.suppress(OSError, protocol.ProtocolError):
                    s.settimeout(0.5)
                    protocol.send(s, {"type": "error", "error": "too many connections saying hello: try again"})
                s.close()
                continue
            threading.Thread(target=self._hello, args=(s, n), name="proxy-hello", daemon=True).start()

    def _hello(self, s: socket.socket, n: int) -> None:
        try:
            self._await_hello(s, n)
        finally:
            self._hellos.release()

    def _await_hello(self, s: socket.socket, n: int) -> None:
        try:
            s.settimeout(5.0)
            got = protocol.recv(s, max_fds=0)
            if got is None or got[0]["type"] != "hello":
                raise protocol.ProtocolError("expected a hello first")
            s.settimeout(None)
        except (OSError, protocol.ProtocolError) as e:
            jlog(logging.WARNING, "node proxy rejected", error=str(e))
            with contextlib.suppress(OSError, protocol.ProtocolError):
                protocol.send(s, {"type": "error", "error": str(e)})
            s.close()
            return
        conn = ProxyConn(s, proxy_name(got[0], n), self.gone)
        self.await_snapshot(conn, *self.attach(conn))
