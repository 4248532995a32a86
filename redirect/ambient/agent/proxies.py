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
import threading
from collections.abc import Callable
from typing import Any

from ...errors import RedirectError
from ...kernel import netns as _netns
from . import protocol
from .discovery import open_as
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


class ProxyConn:
    """One connected node proxy: an ordered send queue (writer thread) and an ack reader."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket, name: str, gone: Callable[[ProxyConn], None]) -> None:
        self.sock = sock
        self.name = name
        self._gone = gone
        self.q: queue.Queue[tuple[dict[str, Any], int | None] | None] = queue.Queue()
        self.pending: dict[int, Waiter] = {}
        self.lock = threading.Lock()
        self.alive = True
        self.synced = threading.Event()  # acked its first snapshot_done
        threading.Thread(target=self._writer, name=f"proxy-w:{name}", daemon=True).start()
        self._reader_thread = threading.Thread(target=self._reader, name=f"proxy-r:{name}", daemon=True)
        self._reader_thread.start()

    @property
    def serving(self) -> bool:
        """Connected, and its acks can arrive (the reader runs)."""
        return self.alive and self._reader_thread.is_alive()

    def enqueue(self, msg: dict[str, Any], fd: int | None = None) -> Waiter:
        w = Waiter()
        mid = next(self._ids)
        with self.lock:
            if not self.alive:
                if fd is not None:
                    os.close(fd)
                w.done(False, "proxy disconnected")
                return w
            self.pending[mid] = w
            self.q.put(({**msg, "id": mid}, fd))  # under the lock: never after close()'s None
        return w

    def send_add(self, pod: PodRecord, netns: _netns.NetnsRef | None = None) -> Waiter:
        """Hand ``pod`` to the proxy with an fd of its netns: a copy of ``netns`` (as the add opened
        it), else the netns at its path, if that is still the pod's (inode and cookie: a path can
        name another netns by now); if not, the add fails here and nothing is sent."""
        try:
            fd = _netns.open_netns(netns) if netns is not None else open_as(pod.netns, pod.key)[0]
        except RedirectError as e:
            w = Waiter()
            w.done(False, str(e))
            return w
        return self.enqueue({"type": "add", "pod": pod.for_proxy()}, fd)

    def _writer(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            msg, fd = item
            try:
                if self.alive:
                    protocol.send(self.sock, msg, (fd,) if fd is not None else ())
            except (OSError, protocol.ProtocolError) as e:
                jlog(logging.WARNING, "sending to node proxy failed", proxy=self.name, error=str(e))
                self.close()
            finally:
                if fd is not None:
                    os.close(fd)

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
                    w = self.pending.pop(mid, None)
                if w is not None:
                    w.done(ok, error)
        except OSError as e:
            jlog(logging.WARNING, "node proxy connection failed", proxy=self.name, error=str(e))
        except Exception:  # noqa: BLE001 - never leave a proxy counted whose acks can't arrive
            log.exception("node proxy reader failed: closing the connection (proxy %s)", self.name)
        self.close()

    def close(self) -> None:
        with self.lock:
            if not self.alive:
                return
            self.alive = False
            pending, self.pending = self.pending, {}
            self.q.put(None)  # the writer closes the fds of what is still queued, then stops
        for w in pending.values():
            w.done(False, "proxy disconnected")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._gone(self)
        self.sock.close()


__all__ = ["ProxyConn", "Waiter", "parse_ack", "proxy_name"]
