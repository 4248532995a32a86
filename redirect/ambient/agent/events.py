"""The agent's events socket: many clients, a few workers, and nobody can hold them up.

One thread watches every client connection (``selectors``) and reads a request only when
one has arrived (``SOCK_SEQPACKET``: a message arrives whole or not at all), then hands it
to a bounded pool of workers; a connection has at most one request in flight. So an idle
client costs a file descriptor, never a worker:

- a connection idle for ``idle_timeout`` seconds is closed;
- at most ``max_clients`` connections are open; a new client beyond that closes the one
  idle the longest (only when every connection is busy with a request is a newcomer turned
  away), so a crowd of idle clients never starves a new one;
- a worker never waits for a client to take its reply: the reply is sent without blocking, and
  one that does not fit (a client that sends requests and never reads the answers) is left to
  this thread, which sends it once the client reads, or closes the connection if it has not
  within ``idle_timeout`` seconds; meanwhile that connection's next request is not read;
- a request that is not a message of the protocol (not JSON, nested too deep, wrong
  version) is answered ``bad_request``; a handler that raises is answered ``internal``.
"""

from __future__ import annotations

import array
import concurrent.futures
import contextlib
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import protocol
from .logs import jlog, log

Handler = Callable[[dict[str, Any]], dict[str, Any]]
#: A request type whose message carries fds, and whose reply does: (message, its fds) -> (reply,
#: the fds to send with it). It owns the fds it gets; the server closes the ones it returns.
FdHandler = Callable[[dict[str, Any], list[int]], tuple[dict[str, Any], list[int]]]



class _Reply:
    """A reply a client has not taken yet: its bytes, the fds sent with it (owned here until
    sent), and until when it may wait."""

    __slots__ = ("data", "fds", "deadline")

    def __init__(self, data: bytes, fds: list[int], deadline: float) -> None:
        self.data, self.fds, self.deadline = data, fds, deadline

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


class _Client:
    __slots__ = ("sock", "last", "busy", "pending")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.last = time.monotonic()
        self.busy = False
        self.pending: _Reply | None = None  # a reply waiting for the client to read (the loop's)


def _send_now(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send one message without blocking (``BlockingIOError`` if the client's queue is full)."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], anc, socket.MSG_DONTWAIT)


class EventServer:
    def __init__(self, lsock: socket.socket, handle: Handler, on_bad: Callable[[str], None], *,
                 workers: int, max_clients: int, idle_timeout: float,
                 fd_handlers: dict[str, FdHandler] | None = None) -> None:
        self.lsock = lsock
        self.handle = handle
        self.fd_handlers = dict(fd_handlers or {})
        self.on_bad = on_bad
        self.max_clients = max_clients
        self.idle_timeout = idle_timeout
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-ev")
        self.sel = selectors.DefaultSelector()
        self.clients: dict[int, _Client] = {}  # by fd; only the loop thread touches it
        #: (client, keep, a reply it has not taken yet) from the workers
        self._done: queue.Queue[tuple[_Client, bool, _Reply | None]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agent-events", daemon=True)

    def start(self) -> None:
        self.lsock.setblocking(False)
        self.sel.register(self.lsock, selectors.EVENT_READ, None)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._wake()
        self._thread.join(5)
        self.pool.shutdown(wait=True, cancel_futures=False)
        for c in list(self.clients.values()):
            if c.pending is not None:
                c.pending.close()
            c.sock.close()
        self.clients.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- the loop thread

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._turn()
            except Exception:  # noqa: BLE001 - the one thread that serves every client must go on
                log.exception("events socket: unexpected error (serving on)")
                time.sleep(0.1)

    def _turn(self) -> None:
        for key, _ in self.sel.select(timeout=min(self.idle_timeout / 2, 1.0)):
            if key.data is None:
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            elif key.data.pending is not None:
                self._writable(key.data)
            else:
                self._readable(key.data)
        self._returned()
        self._expire()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the listener was closed (stopping)
            if len(self.clients) >= self.max_clients and not self._evict():
                jlog(logging.WARNING, "events socket: every connection is busy; a new client was turned away",
                      clients=len(self.clients))
                s.close()
                continue
            s.setblocking(False)
            c = _Client(s)
            self.clients[s.fileno()] = c
            self.sel.register(s, selectors.EVENT_READ, c)

    def _evict(self) -> bool:
        """Close the client idle the longest; False if every client has a request in flight."""
        idle = [c for c in self.clients.values() if not c.busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.last)
        jlog(logging.INFO, "events socket: too many clients; closed the one idle the longest",
              idle_s=round(time.monotonic() - oldest.last, 1))
        self._close(oldest)
        return True

    def _close(self, c: _Client) -> None:
        self.clients.pop(c.sock.fileno(), None)
        if not c.busy:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(c.sock)
        if c.pending is not None:
            c.pending.close()
            c.pending = None
        c.sock.close()

    def _writable(self, c: _Client) -> None:
        """The client of a reply it had not taken can take more: send it, then read its next request."""
        reply = c.pending
        assert reply is not None
        try:
            _send_now(c.sock, reply.data, reply.fds)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        reply.close()
        c.pending = None
        c.last = time.monotonic()
        self.sel.modify(c.sock, selectors.EVENT_READ, c)

    def _readable(self, c: _Client) -> None:
        try:
            got: tuple[dict[str, Any], list[int]] | None | protocol.ProtocolError = protocol.recv(
                c.sock, max_fds=1 if self.fd_handlers else 0)
        except (BlockingIOError, InterruptedError):
            return
        except protocol.ProtocolError as e:
            got = e
        except OSError:
            got = None
        if got is None:
            self._close(c)
            return
        c.busy = True
        self.sel.unregister(c.sock)
        try:
            self.pool.submit(self._serve, c, got)
        except RuntimeError:  # the pool is shutting down
            c.busy = False
            self._close(c)

    def _returned(self) -> None:
        while True:
            try:
                c, keep, pending = self._done.get_nowait()
            except queue.Empty:
                return
            c.busy = False
            c.last = time.monotonic()
            if keep and not self.stopping.is_set() and self.clients.get(c.sock.fileno()) is c:
                c.pending = pending
                self.sel.register(c.sock, selectors.EVENT_WRITE if pending is not None else selectors.EVENT_READ, c)
            else:
                if pending is not None:
                    pending.close()
                self._close(c)

    def _expire(self) -> None:
        now = time.monotonic()
        deadline = now - self.idle_timeout
        for c in [c for c in self.clients.values()
                  if not c.busy and (c.pending.deadline < now if c.pending is not None else c.last < deadline)]:
            if c.pending is not None:
                jlog(logging.WARNING, "events socket: a client did not take its reply in time; disconnected",
                     idle_timeout_s=self.idle_timeout)
            self._close(c)

    # -- the workers

    def _serve(self, c: _Client, got: tuple[dict[str, Any], list[int]] | protocol.ProtocolError) -> None:
        keep = True
        out_fds: list[int] = []
        pending: _Reply | None = None
        try:
            if isinstance(got, protocol.ProtocolError):  # framing: answered, not counted as a pod failure
                reply = {"type": "result", "ok": False, "reason": "bad_request", "error": str(got)}
            else:
                try:
                    fd_handler = self.fd_handlers.get(got[0]["type"])
                    if fd_handler is not None:
                        reply, out_fds = fd_handler(*got)
                    else:
                        for fd in got[1]:
                            os.close(fd)
                        reply = self.handle(got[0])
                except Exception as e:  # noqa: BLE001 - the client always gets an answer
                    log.exception("event handler failed")
                    self.on_bad("internal")
                    reply = {"type": "result", "ok": False, "reason": "internal", "error": f"{type(e).__name__}: {e}"}
            try:
                data = protocol.encode(reply)
            except protocol.ProtocolError as e:  # a reply over the size limit: say so instead
                data = protocol.encode({"type": "result", "ok": False, "reason": "internal", "error": str(e)})
                for fd in out_fds:
                    os.close(fd)
                out_fds = []
            try:
                _send_now(c.sock, data, out_fds)
            except (BlockingIOError, InterruptedError):  # the client is not reading: the loop sends it
                pending, out_fds = _Reply(data, out_fds, time.monotonic() + self.idle_timeout), []
        except OSError:
            keep = False
        except Exception:  # noqa: BLE001 - never lose a connection's slot
            log.exception("events socket: reply failed")
            keep = False
        finally:
            for fd in out_fds:
                os.close(fd)
            self._done.put((c, keep, pending))
            self._wake()


__all__ = ["EventServer", "FdHandler"]
