"""The agent's events socket: many clients, a few workers, and nobody can hold them up.

One thread watches every client connection (``selectors``) and reads a request only when
one has arrived (``SOCK_SEQPACKET``: a message arrives whole or not at all), then hands it
to a bounded pool of workers; a connection has at most one request in flight. So an idle
client costs a file descriptor, never a worker:

- a connection idle for ``idle_timeout`` seconds is closed;
- at most ``max_clients`` connections are open; a new client beyond that closes the one
  idle the longest (only when every connection is busy with a request is a newcomer turned
  away), so a crowd of idle clients never starves a new one;
- a reply must be taken within ``idle_timeout`` seconds, or the connection is closed;
- a request that is not a message of the protocol (not JSON, nested too deep, wrong
  version) is answered ``bad_request``; a handler that raises is answered ``internal``.
"""

from __future__ import annotations

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



class _Client:
    __slots__ = ("sock", "last", "busy")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.last = time.monotonic()
        self.busy = False


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
        self._done: queue.Queue[tuple[_Client, bool]] = queue.Queue()  # (client, keep) from the workers
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
        c.sock.close()

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
                c, keep = self._done.get_nowait()
            except queue.Empty:
                return
            c.busy = False
            c.last = time.monotonic()
            if keep and not self.stopping.is_set() and self.clients.get(c.sock.fileno()) is c:
                c.sock.setblocking(False)
                self.sel.register(c.sock, selectors.EVENT_READ, c)
            else:
                self._close(c)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.idle_timeout
        for c in [c for c in self.clients.values() if not c.busy and c.last < deadline]:
            self._close(c)

    # -- the workers

    def _serve(self, c: _Client, got: tuple[dict[str, Any], list[int]] | protocol.ProtocolError) -> None:
        keep = True
        out_fds: list[int] = []
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
            c.sock.settimeout(self.idle_timeout)  # a reply not taken in time closes the connection
            try:
                protocol.send(c.sock, reply, tuple(out_fds))
            except protocol.ProtocolError as e:  # a reply over the size limit: say so instead
                protocol.send(c.sock, {"type": "result", "ok": False, "reason": "internal", "error": str(e)})
        except OSError:
            keep = False
        except Exception:  # noqa: BLE001 - never lose a connection's slot
            log.exception("events socket: reply failed")
            keep = False
        finally:
            for fd in out_fds:
                os.close(fd)
            self._done.put((c, keep))
            self._wake()


__all__ = ["EventServer", "FdHandler"]
