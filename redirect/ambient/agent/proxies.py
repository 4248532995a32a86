"""One connected node proxy, as the agent sees it: an ordered send queue and an ack reader.

What a proxy sends is checked field by field (``ack``: an integer ``id``, a boolean ``ok``,
a bounded ``error``); a message that is not right is logged and dropped, never trusted and
never allowed to end the reader. If the reader stops for any reason the connection is
closed and the proxy leaves the agent's list, so a proxy is counted only while its acks can
still arrive (``serving``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from ...errors import RedirectError
from ...kernel import netns as _netns
from . import protocol
from .discovery import find
from .logs import jlog, log
from .pods import PodRecord

MAX_ERROR = 1000  # chars of a proxy's error text kept (logs, the ADD's answer)



def proxy_name(hello: dict[str, Any], n: int) -> str:
    """A printable, bounded name for the proxy that said ``hello`` (for logs)."""
    name = hello.get("proxy")
    if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
        name = "proxy"
    return f"{name}#{n}"


def parse_ack(msg: dict[str, Any]) -> tuple[int, bool, str]:
    """``(id, ok, error)`` of an ``ack``; ``ProtocolError`` naming the field if one is malformed."""
    mid = msg.get("id")
    if type(mid) is not int or mid < 0:
        raise protocol.ProtocolError(f"ack id={str(mid)[:40]!r}: expected a non-negative integer")
    ok = msg.get("ok")
    if type(ok) is not bool:
        raise protocol.ProtocolError(f"ack ok={str(ok)[:40]!r}: expected true or false")
    error = msg.get("error", "")
    if not isinstance(error, str):
        raise protocol.ProtocolError("ack error: expected a string")
    return mid, ok, error[:MAX_ERROR]


class Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False
        self.error = ""

    def done(self, ok: bool, error: str = "") -> None:
        self.ok, self.error = ok, error
        self.event.set()


#: Messages sent to one proxy and not acked yet, at most: the writer sends the next one only once
#: an ack makes room (waiting at most the proxy timeout, else the proxy is dropped).
WINDOW = 32
#: Netns fds held for one proxy's queue at most (a pod's add hands over a copy of its own); past
#: that, an add queued for it opens the pod's netns when it is sent, checked by inode and cookie.
MAX_QUEUED_FDS = 8


class ProxyConn:
    """One connected node proxy: an ordered send queue (writer thread) and an ack reader.

    Bounded whatever the proxy does: at most ``WINDOW`` messages are out unacked, at most
    ``MAX_QUEUED_FDS`` netns fds wait in the queue (a snapshot's netns are opened one at a time,
    as each ``add`` is sent), and a proxy that takes no message for ``timeout`` seconds (its
    socket full) or acks none for ``timeout`` seconds while the window is full is dropped, its
    queued fds closed: a proxy that stops reading never holds the agent's fds or memory."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket, name: str, gone: Callable[[ProxyConn], None],
                 timeout: float = 5.0, scan_proc: bool = True) -> None:
        self.sock = sock
        self.name = name
        self.timeout = timeout
        self.scan_proc = scan_proc  # where a queued add looks for a pod's netns not at its path (``find``)
        self._gone = gone
        # (message, the pod whose netns goes with it, a netns fd already open for it)
        self.q: queue.Queue[tuple[dict[str, Any], PodRecord | None, int | None] | None] = queue.Queue()
        self.pending: dict[int, Waiter] = {}  # queued or sent, not acked
        self.unacked: set[int] = set()  # sent, not acked
        self.fds_queued = 0
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # an ack came, or the connection closed
        self.alive = True
        self.why = ""  # why it was closed
        self.synced = threading.Event()  # acked its first snapshot_done
        #: (writer only) uids whose last add was not sent (their netns could not be opened): a
        #: snapshot's list leaves them out, as the proxy was never given them
        self.not_sent: set[str] = set()
        # a send that blocks this long fails (the proxy does not read): the connection is dropped
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(timeout), int((timeout % 1) * 1e6) or (0 if timeout >= 1 else 1)))
        threading.Thread(target=self._writer, name=f"proxy-w:{name}", daemon=True).start()
        self._reader_thread = threading.Thread(target=self._reader, name=f"proxy-r:{name}", daemon=True)
        self._reader_thread.start()

    @property
    def serving(self) -> bool:
        """Connected, and its acks can arrive (the reader runs)."""
        return self.alive and self._reader_thread.is_alive()

    def enqueue(self, msg: dict[str, Any], fd: int | None = None, pod: PodRecord | None = None) -> Waiter:
        """Queue ``msg`` (with ``fd``, which this takes, or ``pod``'s netns opened when it is sent)."""
        w = Waiter()
        mid = next(self._ids)
        with self.lock:
            if not self.alive:
                if fd is not None:
                    os.close(fd)
                w.done(False, f"proxy disconnected: {self.why}")
                return w
            self.pending[mid] = w
            if fd is not None:
                self.fds_queued += 1
            self.q.put(({**msg, "id": mid}, pod, fd))  # under the lock: never after close()'s None
        return w

    def send_add(self, pod: PodRecord, netns: _netns.NetnsRef | None = None) -> Waiter:
        """Hand ``pod`` to the proxy with an fd of its netns: a copy of ``netns`` (as the add opened
        it) while few fds are queued, else the pod's netns opened when the message is sent, at its
        path if that is still the pod's netns (inode and cookie: a path can name another netns by
        now), else where the start would find it (``discovery.find``); if it is found nowhere, that
        add fails, nothing is sent, and a snapshot's list sent after it leaves the pod out."""
        fd = None
        with self.lock:
            room = self.alive and self.fds_queued < MAX_QUEUED_FDS
        if netns is not None and room:
            try:
                fd = _netns.open_netns(netns)
            except RedirectError as e:
                w = Waiter()
                w.done(False, str(e))
                return w
        return self.enqueue({"type": "add", "pod": pod.for_proxy()}, fd, pod)

    def _writer(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            msg, pod, fd = item
            if fd is not None:
                with self.lock:
                    self.fds_queued -= 1
            try:
                if not self._window():
                    continue
                if pod is not None and fd is None:
                    try:
                        fd = find(pod.netns, pod.key, self.scan_proc)[0]
                    except RedirectError as e:
                        self.not_sent.add(pod.uid)
                        jlog(logging.WARNING, "pod not handed to node proxy: its netns is gone", proxy=self.name,
                             pod=pod.uid, netns=pod.netns, error=str(e))
                        with self.lock:
                            w = self.pending.pop(msg["id"], None)
                        if w is not None:
                            w.done(False, str(e))
                        continue
                if msg["type"] == "add":
                    self.not_sent.discard(msg["pod"]["uid"])
                elif msg["type"] in ("snapshot_pods", "snapshot_done") and self.not_sent:
                    msg = {**msg, "pods": [u for u in msg["pods"] if u not in self.not_sent]}
                with self.lock:
                    self.unacked.add(msg["id"])
                protocol.send(self.sock, msg, (fd,) if fd is not None else ())
            except (OSError, protocol.ProtocolError) as e:
                why = (f"it took no message for {self.timeout:g} s" if isinstance(e, BlockingIOError | TimeoutError)
                       else str(e))
                jlog(logging.WARNING, "sending to node proxy failed: dropped", proxy=self.name, error=why)
                self.close(f"sending failed: {why}")
            finally:
                if fd is not None:
                    os.close(fd)

    def _window(self) -> bool:
        """Wait until fewer than ``WINDOW`` messages are out unacked: True; False if the connection
        closed, or no ack came within the timeout (then it is closed: the proxy is stuck)."""
        with self.lock:
            if not self.alive:
                return False
            if len(self.unacked) < WINDOW:
                return True
            self.room.wait_for(lambda: not self.alive or len(self.unacked) < WINDOW, self.timeout)
            if not self.alive:
                return False
            if len(self.unacked) < WINDOW:
                return True
        jlog(logging.WARNING, "node proxy acks nothing: dropped", proxy=self.name, unacked=WINDOW,
             seconds=self.timeout)
        self.close(f"no ack within {self.timeout:g} s")
        return False

    def _reader(self) -> None:
        try:
            while True:
                try:
                    got = protocol.recv(self.sock, max_fds=0)
                except protocol.ProtocolError as e:
                    jlog(logging.WARNING, "bad message from node proxy: dropped", proxy=self.name, error=str(e))
                    continue
                if got is None:
                    break
                msg, _ = got
                if msg["type"] != "ack":
                    continue
                try:
                    mid, ok, error = parse_ack(msg)
                except protocol.ProtocolError as e:
                    jlog(logging.WARNING, "bad ack from node proxy: dropped", proxy=self.name, error=str(e))
                    continue
                with self.lock:
                    w = self.pending.pop(mid, None) if mid in self.unacked else None
                    self.unacked.discard(mid)
                    self.room.notify_all()
                if w is not None:
                    w.done(ok, error)
        except OSError as e:
            jlog(logging.WARNING, "node proxy connection failed", proxy=self.name, error=str(e))
        except Exception:  # noqa: BLE001 - never leave a proxy counted whose acks can't arrive
            log.exception("node proxy reader failed: closing the connection (proxy %s)", self.name)
        self.close("its connection ended")

    def close(self, why: str = "closed") -> None:
        with self.lock:
            if not self.alive:
                return
            self.alive = False
            self.why = why
            pending, self.pending = self.pending, {}
            self.unacked.clear()
            self.room.notify_all()
            self.q.put(None)  # the writer closes the fds of what is still queued, then stops
        for w in pending.values():
            w.done(False, f"proxy disconnected: {why}")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._gone(self)
        self.sock.close()
        self._drain()

    def _drain(self) -> None:
        """Close the fds still queued (the writer may be gone already, or never get to them)."""
        while True:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self.q.put(None)  # (for the writer, if it still runs)
                return
            if item[2] is not None:
                with contextlib.suppress(OSError):
                    os.close(item[2])
                with self.lock:
                    self.fds_queued -= 1


__all__ = ["ProxyConn", "Waiter", "parse_ack", "proxy_name"]
