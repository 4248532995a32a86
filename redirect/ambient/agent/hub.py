"""The node proxies the agent hands pods to: who is connected, what each must be sent, the acks.

A proxy connects to the proxy socket and says ``hello``; it is sent a snapshot (every pod,
enrolled or being enrolled, then ``snapshot_done``) under the registry's lock, so a pod
handed out concurrently (``offer_locked``) reaches it exactly once either way. A pod whose
add could not be sent (its netns found nowhere) is left out of the snapshot's list too
(``ProxyConn``), so the proxy is never told of a pod it was not given. Acks are
awaited with one deadline for all proxies (``wait_all``). The connections themselves
(``ProxyConn``: ordered sends, validated acks) are ``proxies``'; the hub works on anything
with their interface (``Peer``), which is how it is unit-tested without sockets.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ...kernel.netns import NetnsRef
from . import protocol
from .logs import jlog
from .metrics import Metrics
from .pods import PodRecord
from .proxies import ProxyConn, Waiter, proxy_name
from .registry import Registry

#: Connections to the proxy socket that may be awaiting their hello at once; a newcomer beyond
#: them closes the one waiting the longest.
MAX_HELLOS = 32
#: Seconds a connection to the proxy socket has to say hello.
HELLO_S = 5.0
#: Node proxies connected at once, at most (two during a handover); a hello beyond them is refused.
MAX_PROXIES = 4


#: Uids in one snapshot message at most: 400 uids of the longest form (128 chars) fit in 64 KiB.
SNAPSHOT_CHUNK = 400


def snapshot_chunks(uids: list[str]) -> list[list[str]]:
    """The snapshot's uids in messages that fit the protocol's limit: one list (``snapshot_done``
    alone, as ever) when they fit in one, else ``SNAPSHOT_CHUNK`` at a time, the last one for
    ``snapshot_done`` (``chunked``) and the others for ``snapshot_pods`` messages before it."""
    if len(uids) <= SNAPSHOT_CHUNK:
        return [uids]
    return [uids[i:i + SNAPSHOT_CHUNK] for i in range(0, len(uids), SNAPSHOT_CHUNK)]


class Peer(Protocol):
    """One connected node proxy (``proxies.ProxyConn``)."""

    name: str
    synced: threading.Event

    @property
    def serving(self) -> bool: ...
    def enqueue(self, msg: dict[str, Any], fd: int | None = None) -> Waiter: ...
    def send_add(self, pod: PodRecord, netns: NetnsRef | None = None) -> Waiter: ...
    def close(self, why: str = "closed") -> None: ...


class ProxyHub:
    def __init__(self, registry: Registry, metrics: Metrics, timeout: float, scan_proc: bool = True) -> None:
        self.registry = registry
        self.metrics = metrics
        self.timeout = timeout  # seconds a proxy has to ack (a snapshot: a little more per pod)
        self.scan_proc = scan_proc  # a snapshot's add looks for a netns not at its path in /proc/*/ns/net too
        self.conns: list[Peer] = []  # under registry.lock

    # -- a proxy comes and goes

    def attach(self, conn: Peer) -> tuple[list[PodRecord], list[Waiter], Waiter]:
        """Add ``conn`` and send it the snapshot: (the pods sent, their waiters, ``snapshot_done``'s)."""
        reg = self.registry
        with reg.lock:
            self.conns.append(conn)
            pods = list({**reg.pods, **reg.enrolling}.values())
            waiters = [conn.send_add(p) for p in pods]
            *parts, last = snapshot_chunks(sorted(p.uid for p in pods))
            for part in parts:
                conn.enqueue({"type": "snapshot_pods", "pods": part})
            done = conn.enqueue({"type": "snapshot_done", "pods": last, **({"chunked": True} if parts else {})})
            self.metrics.set("proxy_connections", len(self.conns))
            self.metrics.add("proxy_connects_total", 1)
        jlog(logging.INFO, "node proxy connected: snapshot sent", proxy=conn.name, pods=len(pods))
        return pods, waiters, done

    def await_snapshot(self, conn: Peer, pods: Sequence[PodRecord], waiters: Sequence[Waiter], done: Waiter) -> bool:
        """Wait for the snapshot's acks; the proxy counts as synced (``check`` needs one) once it acked."""
        if done.event.wait(self.timeout + 0.05 * len(pods)) and done.ok:
            conn.synced.set()
            failed = {p.uid: w.error for p, w in zip(pods, waiters, strict=True) if not w.ok}
            jlog(logging.INFO if not failed else logging.ERROR, "node proxy synced", proxy=conn.name,
                 failed=sorted(failed), **({"errors": failed} if failed else {}))
            return True
        jlog(logging.ERROR, "node proxy did not ack the snapshot: dropped", proxy=conn.name, error=done.error)
        conn.close("it did not ack its snapshot")  # (it would never count as synced: make room)
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

    def offer_locked(self, pod: PodRecord, netns: NetnsRef | None = None) -> list[tuple[Peer, Waiter]]:
        """(Under registry.lock.) ``pod`` is being enrolled: in the snapshot of a proxy that connects
        from now on, and sent to every connected one (``netns``: the pod's netns as its add opened it)."""
        self.registry.enrolling[pod.uid] = pod
        return [(c, c.send_add(pod, netns)) for c in self.conns]

    def withdraw_locked(self, uid: str) -> list[tuple[Peer, Waiter]]:
        """(Under registry.lock.) Tell every connected proxy that ``uid`` is gone."""
        return [(c, c.enqueue({"type": "del", "uid": uid})) for c in self.conns]

    def wait_all(self, waiters: Sequence[tuple[Peer, Waiter]]) -> list[str]:
        """Errors of the proxies that did not ack in time (disconnects count as errors). A proxy that
        missed the deadline is dropped (its queue and the fds in it go): one that stopped reading
        or acking would otherwise hold a netns fd for every pod since."""
        deadline = time.monotonic() + self.timeout
        errors = []
        for c, w in waiters:
            if not w.event.wait(max(deadline - time.monotonic(), 0)):
                errors.append(f"{c.name}: no ack within {self.timeout} s")
                jlog(logging.WARNING, "node proxy missed an ack deadline: dropped", proxy=c.name,
                     seconds=self.timeout)
                c.close(f"no ack within {self.timeout:g} s")
            elif not w.ok:
                errors.append(f"{c.name}: {w.error}")
        return errors

    def serving_locked(self) -> int:
        return sum(1 for c in self.conns if c.serving)

    def synced_locked(self) -> int:
        return sum(1 for c in self.conns if c.synced.is_set() and c.serving)

    # -- the proxy socket

    def accept(self, lsock: socket.socket, stopping: threading.Event) -> None:
        """Accept proxies on ``lsock`` until it is closed or ``stopping``. One thread waits for the
        hello of every new connection: at most ``HELLO_S`` seconds each, at most ``MAX_HELLOS`` at
        once (a newcomer beyond them closes the one waiting the longest), and a hello already sent
        is read as the connection is accepted. So silent connections hold no thread and cannot
        keep out a proxy that says hello; a proxy that did is attached on a thread of its own."""
        lsock.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(lsock, selectors.EVENT_READ, None)
        waiting: dict[socket.socket, tuple[float, int]] = {}  # by age: (accepted at, connection number)
        n = 0
        dropped, logged_at = 0, 0.0  # silent connections closed, and when that was last logged
        try:
            while not stopping.is_set():
                try:
                    ready = sel.select(timeout=min(HELLO_S / 4, 0.5))
                except OSError:
                    return
                newcomers = False
                for key, _ in ready:  # hellos before newcomers: no newcomer evicts a hello that came
                    if key.data is None:
                        newcomers = True
                    elif key.fileobj in waiting and self._try_hello(key.fileobj, key.data):  # type: ignore[arg-type]
                        sel.unregister(key.fileobj)
                        del waiting[key.fileobj]  # type: ignore[arg-type]
                for _ in range(MAX_HELLOS // 2 if newcomers else 0):  # a bounded batch a turn
                    try:
                        s, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        return  # the listener was closed (stopping)
                    n += 1
                    s.setblocking(False)
                    if self._try_hello(s, n):
                        continue
                    if len(waiting) >= MAX_HELLOS:
                        oldest = next(iter(waiting))
                        sel.unregister(oldest)
                        del waiting[oldest]
                        self._refuse(oldest, f"{MAX_HELLOS} connections are waiting to say hello: "
                                             "the one waiting the longest is closed", log=False)
                        dropped += 1
                    waiting[s] = (time.monotonic(), n)
                    sel.register(s, selectors.EVENT_READ, n)
                expired = time.monotonic() - HELLO_S
                for s, (t, _) in list(waiting.items()):
                    if t >= expired:
                        break
                    sel.unregister(s)
                    del waiting[s]
                    self._refuse(s, f"no hello within {HELLO_S:g} s", log=False)
                    dropped += 1
                if dropped and time.monotonic() - logged_at >= 10:  # (a crowd of them: one line a while)
                    jlog(logging.WARNING, "node proxy socket: connections closed without a hello", count=dropped,
                         waiting=len(waiting))
                    dropped, logged_at = 0, time.monotonic()
        finally:
            for s in waiting:
                s.close()
            sel.close()

    def _try_hello(self, s: socket.socket, n: int) -> bool:
        """Read ``s``'s hello if it has come: False while it has not; else True, ``s`` being now a
        proxy's (attached on a thread of its own) or refused and closed."""
        try:
            got = protocol.recv(s, max_fds=0)
        except (BlockingIOError, InterruptedError):
            return False
        except protocol.ProtocolError as e:
            self._refuse(s, str(e))
            return True
        except OSError as e:
            self._refuse(s, str(e))
            return True
        if got is None:
            s.close()
            return True
        if got[0]["type"] != "hello":
            self._refuse(s, "expected a hello first")
            return True
        with self.registry.lock:
            full = len(self.conns) >= MAX_PROXIES
        if full:
            self._refuse(s, f"{MAX_PROXIES} node proxies are connected already")
            return True
        s.setblocking(True)
        conn = ProxyConn(s, proxy_name(got[0], n), self.gone, self.timeout, self.scan_proc)
        threading.Thread(target=lambda: self.await_snapshot(conn, *self.attach(conn)), name="proxy-sync",
                         daemon=True).start()
        return True

    @staticmethod
    def _refuse(s: socket.socket, why: str, log: bool = True) -> None:
        if log:
            jlog(logging.WARNING, "node proxy rejected", error=why)
        with contextlib.suppress(OSError, protocol.ProtocolError):
            protocol.send(s, {"type": "error", "error": why})
        s.close()
