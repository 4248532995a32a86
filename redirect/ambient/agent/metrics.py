"""Prometheus text metrics and the agent's small localhost HTTP server (/healthz, /readyz, /metrics)."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

#: Setup latency buckets (seconds).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: The most the ops port reads of a request (its line and headers), and the most lines it may have.
MAX_REQUEST_HEAD = 8 * 1024
MAX_REQUEST_LINES = 64


class Metrics:
    """The agent's counters, gauges and one histogram; thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pods_enrolled = 0
        self.proxy_connections = 0
        self.proxy_connects_total = 0
        self.events: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.reconciled: dict[str, int] = {}
        self.resynced: dict[str, int] = {}
        self._hist = [0] * len(BUCKETS)
        self._count = 0
        self._sum = 0.0

    def observe_setup(self, seconds: float) -> None:
        with self._lock:
            self._count += 1
            self._sum += seconds
            for i, b in enumerate(BUCKETS):
                if seconds <= b:
                    self._hist[i] += 1

    def inc(self, table: str, key: str) -> None:
        with self._lock:
            d: dict[str, int] = getattr(self, table)
            d[key] = d.get(key, 0) + 1

    def set(self, name: str, value: int) -> None:
        with self._lock:
            setattr(self, name, value)

    def add(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def render(self) -> str:
        with self._lock:
            out = [
                "# HELP redirect_agent_pods_enrolled Ambient pods enrolled on this node.",
                "# TYPE redirect_agent_pods_enrolled gauge",
                f"redirect_agent_pods_enrolled {self.pods_enrolled}",
                "# HELP redirect_agent_proxy_connections Node proxies connected now.",
                "# TYPE redirect_agent_proxy_connections gauge",
                f"redirect_agent_proxy_connections {self.proxy_connections}",
                "# HELP redirect_agent_proxy_connects_total Node proxy connections accepted.",
                "# TYPE redirect_agent_proxy_connects_total counter",
                f"redirect_agent_proxy_connects_total {self.proxy_connects_total}",
                "# HELP redirect_agent_events_total Pod events handled, by type.",
                "# TYPE redirect_agent_events_total counter",
            ]
            out += [f'redirect_agent_events_total{{type="{k}"}} {v}' for k, v in sorted(self.events.items())]
            out += ["# HELP redirect_agent_failures_total Failed pod events, by reason.",
                    "# TYPE redirect_agent_failures_total counter"]
            out += [f'redirect_agent_failures_total{{reason="{k}"}} {v}' for k, v in sorted(self.failures.items())]
            out += ["# HELP redirect_agent_reconciled_total Pods found at start, by what reconciling did.",
                    "# TYPE redirect_agent_reconciled_total counter"]
            out += [f'redirect_agent_reconciled_total{{result="{k}"}} {v}' for k, v in sorted(self.reconciled.items())]
            out += ["# HELP redirect_agent_resynced_total Pods checked while running, by what resync did.",
                    "# TYPE redirect_agent_resynced_total counter"]
            out += [f'redirect_agent_resynced_total{{result="{k}"}} {v}' for k, v in sorted(self.resynced.items())]
            out += ["# HELP redirect_agent_setup_seconds Time to enrol a pod (rules + node set + proxy ack).",
                    "# TYPE redirect_agent_setup_seconds histogram"]
            out += [f'redirect_agent_setup_seconds_bucket{{le="{b}"}} {n}'
                    for b, n in zip(BUCKETS, self._hist, strict=True)]
            out += [f'redirect_agent_setup_seconds_bucket{{le="+Inf"}} {self._count}',
                    f"redirect_agent_setup_seconds_sum {self._sum:.6f}",
                    f"redirect_agent_setup_seconds_count {self._count}"]
        return "\n".join(out) + "\n"


class _Refused(Exception):
    """A request over the ops port's bounds (answered 431, then the connection is closed)."""


class _RequestHead(io.RawIOBase):
    """What a handler reads of its connection: at most ``MAX_REQUEST_HEAD`` bytes in at most
    ``MAX_REQUEST_LINES`` lines, all before ``deadline`` (``time.monotonic()``), however slowly
    they come (each read waits only for what is left of the time)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline
        self.taken = self.lines = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self.taken >= MAX_REQUEST_HEAD:
            raise _Refused(f"a request head of more than {MAX_REQUEST_HEAD} bytes")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no whole request in time")
        self.sock.settimeout(left)
        view = memoryview(buf)[: MAX_REQUEST_HEAD - self.taken]
        n = self.sock.recv_into(view)
        self.taken += n
        self.lines += view[:n].tobytes().count(b"\n")
        if self.lines > MAX_REQUEST_LINES:
            raise _Refused(f"a request of more than {MAX_REQUEST_LINES} lines")
        return n


class OpsServer(http.server.ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a bound on open connections: at ``max_clients``, a new
    connection closes the oldest one (so idle clients never starve a probe); with the
    handler's timeout, an idle connection holds its thread for ``idle_timeout`` at most."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler],
                 max_clients: int) -> None:
        super().__init__(addr, handler)
        self.max_clients = max_clients
        self._open: dict[socket.socket, None] = {}  # insertion order: oldest first
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            while len(self._open) >= self.max_clients:
                oldest = next(iter(self._open))
                del self._open[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its handler reads EOF and ends
            self._open[request] = None
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    @property
    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)


def serve_http(host: str, port: int, metrics: Metrics, ready: Callable[[], tuple[bool, dict[str, Any]]],
               idle_timeout: float = 10.0, max_clients: int = 256) -> OpsServer:
    """Start the ops server on ``host:port`` (0: any free port) in a daemon thread; returns it.

    One request per connection (HTTP/1.0); a connection that has not sent a whole request and
    taken its answer within ``idle_timeout`` seconds of its start is closed, however slowly its
    bytes come; a request head over ``MAX_REQUEST_HEAD`` bytes or ``MAX_REQUEST_LINES`` lines is
    answered 431 and closed (so a connection costs at most that much memory); at most
    ``max_clients`` are open at once."""

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = idle_timeout  # (the first read's; each is bounded by the deadline below)

        def setup(self) -> None:
            super().setup()
            self.deadline = time.monotonic() + idle_timeout
            self.rfile = io.BufferedReader(_RequestHead(self.connection, self.deadline))

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            except _Refused as e:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.settimeout(max(self.deadline - time.monotonic(), 0.001))
                    body = f"request refused: {e}\n".encode()
                    self.wfile.write(b"HTTP/1.0 431 Request Header Fields Too Large\r\nConnection: close\r\n"
                                     b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:  # the client went away, or took too long to read the answer
                self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._reply(200, "text/plain", "ok\n")
            elif path == "/readyz":
                ok, detail = ready()
                self._reply(200 if ok else 503, "application/json", json.dumps({"ready": ok, **detail}) + "\n")
            elif path == "/metrics":
                self._reply(200, "text/plain; version=0.0.4", metrics.render())
            else:
                self._reply(404, "text/plain", "not found: try /healthz, /readyz or /metrics\n")

        def _reply(self, code: int, ctype: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
            pass

    server = OpsServer((host, port), Handler, max_clients)
    threading.Thread(target=server.serve_forever, name="agent-http", daemon=True).start()
    return server


__all__ = ["Metrics", "OpsServer", "serve_http", "BUCKETS"]
