"""``redirect-agent``: the node agent.

It serves the thin CNI plugin's requests (``cni`` messages, ``redirect.ambient.agent.cni_requests``:
sidecar and ambient pods, through the plugin's own code), and it enrols ambient pods for a
node proxy (like istio-cni's node agent for ztunnel). The CNI plugin sends a pod ``add``
event over the events socket, and the agent enrols the pod as a transaction whose commit
record is written last (``enroller.Enroller.add``):

1. an *intent* record in the agent's store on the node (``redirect.ambient.agent.store``,
   ``phase: intent``), keyed by the pod netns's inode and cookie;
2. the in-pod ambient routes and rules (``redirect.setup``);
3. the pod's IPs, owned by its uid, in the node's probe sets (``redirect.ambient.node``);
4. the pod's netns fd handed to every connected node proxy, and all their acks;
5. the *commit* record (``phase: enrolled``) replaces the intent; only then does the agent
   answer the plugin, which lets the pod start.

Any failure undoes every step and fails the ADD (fail closed). ``del`` tells the proxies,
removes the rules, the record and the pod's set entries.

Restart safety: what the agent must believe after a restart is on the node, where only root
writes: its records (``store``, under the run directory, ``0700``). At start it reads them,
finds each one's netns (at the path its add named, else by inode among ``/run/netns`` and
``/proc/*/ns/net``, taken only if its cookie is the record's; a record whose netns is gone is
removed), validates each record like an event (``redirect.ambient.agent.pods``) and keeps those
of its ``--node-name``. It adopts the pods with a commit record and removes every piece of those
with only an intent (an add cut short by a crash); it re-installs rules that drifted from the
recorded config, re-asserts the node's probe rules and pod sets (dropping entries of uids it did
not adopt), and sends each connecting proxy a full snapshot (a proxy drops the pods not in it);
while running it repeats the repairs every ``--resync-seconds`` (a pod whose netns left its path is
looked for as at start, and dropped only if it is found nowhere). Nothing inside a pod's netns is
believed: it is compared with the record and repaired. In-pod rules never depend on the agent's
process, so a killed agent leaves every pod captured. SIGTERM stops it and leaves redirection in
place.

Parts: ``enroller`` (the enrolment transaction, ``del``, ``check``), ``reconcile`` (the start's
read-back and the resync), ``hub`` (the node proxies: snapshots, hand-outs, acks), ``registry``
(the pods held, the lock that orders them against the proxies), ``ops`` (what is changed in the
kernel and the store), ``dispatch`` and ``events`` (the events socket's answers and its server),
``proxies`` (one node proxy connection, its acks validated), ``discovery`` (the records read back
at start), ``pods`` (a pod's fields, validated once for events and records), ``store`` (the
records), ``legacy`` (an earlier release's in-pod record), ``metrics`` (/healthz /readyz
/metrics), ``warmup`` (the default backend's warm-up; /readyz says ready only once that backend
is usable: for eBPF, its host programs loaded and pinned). This module wires them to the sockets
and holds the command line.

Wire formats: ``redirect.ambient.agent.protocol`` and docs/agent-protocol.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ...config import RedirectConfig, int_arg, seconds_arg
from ...errors import ConfigError, RedirectError
from ...version import VersionAction
from . import cni_requests, protocol, store
from .dispatch import Dispatcher
from .enroller import Enroller
from .events import EventServer
from .hub import ProxyHub
from .logs import jlog
from .metrics import Metrics, serve_http
from .ops import KernelOps
from .reconcile import Reconciler
from .registry import Registry
from .warmup import Warmup

#: Bounds on what the agent holds open, so that its fds stay well below ``FD_LIMIT`` (each worker a
#: few while it works in a pod's netns, each client one, each node proxy one and its queued netns
#: fds: ``proxies.MAX_QUEUED_FDS``, ``hub.MAX_PROXIES``, ``hub.MAX_HELLOS``).
MAX_WORKERS = 64
MAX_CLIENTS = 256
MAX_OPS_CLIENTS = 32
#: The agent's soft ``RLIMIT_NOFILE`` at most: an fd past ``FD_SETSIZE`` (1024) in libnftables'
#: ``select()`` makes glibc abort the process (Debian's libnftables 1.0.6), so an open that would
#: give one fails with EMFILE instead (a request fails; the agent goes on).
FD_LIMIT = 1024


def limit_fds(limit: int = FD_LIMIT) -> tuple[int, int]:
    """Lower this process's soft ``RLIMIT_NOFILE`` to ``limit`` if it is higher (the hard limit is
    left as it is); the soft limit before and after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = limit if soft == resource.RLIM_INFINITY or soft > limit else soft
    if new != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return soft, new


@dataclass
class Options:
    events_socket: str = protocol.DEFAULT_EVENTS_SOCKET
    proxy_socket: str = protocol.DEFAULT_PROXY_SOCKET
    backend: str = "iptables"
    node_name: str = field(default_factory=socket.gethostname)
    host_rules: bool = True
    host_netns: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 15995
    workers: int = 16
    proxy_timeout: float = 5.0
    capture: dict[str, Any] = field(default_factory=dict)
    scan_proc: bool = True
    resync_seconds: float = 30.0
    idle_timeout: float = 10.0
    max_clients: int = 256


class Agent:
    """The parts, wired: the events socket, the proxy socket, the ops server, the resync."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        try:
            base = RedirectConfig.from_dict({**opts.capture, "mode": "ambient"})
        except ConfigError as e:
            raise ConfigError(f"capture.{e.field}", e.value, e.reason) from None
        self.metrics = Metrics()
        self.registry = Registry(self.metrics)
        self.hub = ProxyHub(self.registry, self.metrics, opts.proxy_timeout, opts.scan_proc)
        self.enroller = Enroller(self.registry, self.hub, KernelOps(opts.host_netns, opts.node_name, opts.scan_proc),
                                 base=base, backend=opts.backend, node_name=opts.node_name,
                                 host_rules=opts.host_rules)
        self.reconciler = Reconciler(self.enroller, self.metrics, workers=opts.workers)
        self.dispatcher = Dispatcher(self.enroller, self.metrics, self._readiness)
        self.ready = False
        self.warmup = Warmup(opts.backend)  # the default backend's one-off costs; usable yet? (/readyz)
        self.stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._paths: list[str] = []
        self.events: EventServer | None = None
        self.http: Any = None

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One events-socket message (``dispatch``); never raises."""
        return self.dispatcher.handle(msg)

    def ambient_owner(self, key: tuple[int, int]) -> str | None:
        """The uid of the ambient pod whose netns ``key`` is: enrolled, being enrolled, or recorded in
        the store (a record that can't be read counts: fail closed); None if none."""
        reg = self.registry
        with reg.lock:
            for p in (*reg.pods.values(), *reg.enrolling.values()):
                if p.key == key:
                    return p.uid
            claimed = reg.claims.get(key[0])
        if claimed is not None:
            return claimed
        try:
            rec = store.read(key)
        except (RedirectError, OSError, ValueError) as e:
            return f"(unknown: its record can't be read: {str(e)[:200]})"
        return None if rec is None else str(rec.get("uid"))[:128]

    def start(self) -> None:
        t0 = time.monotonic()
        events = self._bind(self.opts.events_socket)
        proxies = self._bind(self.opts.proxy_socket)
        self.http = serve_http(self.opts.http_host, self.opts.http_port, self.metrics, self._readiness,
                               idle_timeout=self.opts.idle_timeout,
                               max_clients=min(self.opts.max_clients, MAX_OPS_CLIENTS))
        jlog(logging.INFO, "http listening", host=self.opts.http_host, port=self.http.server_address[1])
        self.reconciler.reconcile()
        threading.Thread(target=self.hub.accept, args=(proxies, self.stopping), name="agent-proxies",
                         daemon=True).start()
        cni = lambda msg, fds: cni_requests.serve(self.metrics, self.handle, msg, fds,  # noqa: E731
                                                  self.ambient_owner)
        self.events = EventServer(events, self.handle, lambda reason: self.metrics.inc("failures", reason),
                                  workers=self.opts.workers, max_clients=self.opts.max_clients,
                                  idle_timeout=self.opts.idle_timeout, fd_handlers={"cni": cni})
        self.events.start()
        if self.opts.resync_seconds > 0:
            threading.Thread(target=self.reconciler.loop, args=(self.opts.resync_seconds, self.stopping),
                             name="agent-resync", daemon=True).start()
        threading.Thread(target=self.warmup.run, args=(self.stopping,), name="agent-warm-up", daemon=True).start()
        self.ready = True
        jlog(logging.INFO, "agent ready", node=self.opts.node_name, pods=len(self.registry.pods),
             events_socket=self.opts.events_socket, proxy_socket=self.opts.proxy_socket,
             backend=self.opts.backend, start_ms=round((time.monotonic() - t0) * 1e3, 1))

    def _bind(self, path: str) -> socket.socket:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(path)
                except OSError:
                    os.unlink(path)  # stale: its agent is gone
                else:
                    raise RuntimeError(f"{path}: another agent is listening there")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(512)
        self._socks.append(s)
        self._paths.append(path)
        return s

    def stop(self) -> None:
        """Stop serving; every pod keeps its redirection (and the node proxies their listeners)."""
        self.stopping.set()
        self.ready = False
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for p in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self.hub.close_all()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        if self.events is not None:
            self.events.stop()
        jlog(logging.INFO, "agent stopped; redirection left in place", pods=len(self.registry.pods))

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: reconciled, accepting events, and the default backend usable (``warmup``)."""
        usable, backend = self.warmup.readiness()
        with self.registry.lock:
            return self.ready and usable, {"pods": len(self.registry.pods), "proxies": self.hub.serving_locked(),
                                           **backend}


# --- CLI -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redirect-agent",
        description="Node agent: serves the thin redirect-cni plugin's requests (sidecar and ambient pods), "
                    "enrols ambient pods (in-pod rules, node probe sets) and hands their network namespaces to "
                    "the node proxy. Restart-safe: its records of the pods are on the node (in the run directory, "
                    "root's alone) and read back at start. SIGTERM stops it and leaves redirection in place.")
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--events-socket", default=protocol.DEFAULT_EVENTS_SOCKET,
                   help="unix SOCK_SEQPACKET socket for pod events from the CNI plugin (default %(default)s)")
    p.add_argument("--proxy-socket", default=protocol.DEFAULT_PROXY_SOCKET,
                   help="unix SOCK_SEQPACKET socket node proxies connect to (default %(default)s)")
    p.add_argument("--backend", default="iptables",
                   help="backend for pods whose event names none: iptables (default), nftables, ...")
    p.add_argument("--node-name", default=socket.gethostname(),
                   help="this node's name; pods enrolled by another node name are not adopted (default: hostname)")
    p.add_argument("--host-netns", default=None,
                   help="netns of the node's probe rules and pod sets (default: the agent's own)")
    p.add_argument("--no-host-rules", action="store_true", help="do not manage the node's probe SNAT rules and sets")
    p.add_argument("--http-host", default="127.0.0.1", help="address of /healthz, /readyz, /metrics (%(default)s)")
    p.add_argument("--http-port", type=int_arg(0, 65535), default=15995,
                   help="port of the ops server; 0 = any (%(default)s)")
    p.add_argument("--workers", type=int_arg(1, MAX_WORKERS), default=16,
                   help=f"pod events and CNI requests handled at once, at most {MAX_WORKERS} (%(default)s)")
    p.add_argument("--proxy-timeout", type=seconds_arg(0.001, 3600), default=5.0,
                   help="seconds to wait for the node proxy's ack of a pod (%(default)s)")
    p.add_argument("--capture", default="{}",
                   help="JSON object of RedirectConfig fields: the pods' base config before annotations")
    p.add_argument("--no-proc-scan", action="store_true",
                   help="look for a pod's netns that left its path (at start, at a resync, for a node "
                        "proxy's snapshot) under /run/netns only (not /proc/*/ns/net)")
    p.add_argument("--resync-seconds", type=seconds_arg(0, 86400), default=30.0,
                   help="while running, repair drifted rules and drop pods whose netns is gone this often; "
                        "0 = only at start (%(default)s)")
    p.add_argument("--idle-timeout", type=seconds_arg(0.001, 3600), default=10.0,
                   help="seconds an events-socket client may stay idle, or take to read an answer, and an "
                        "ops-port connection may take for its whole request and answer, before it is "
                        "disconnected (%(default)s)")
    p.add_argument("--max-clients", type=int_arg(1, MAX_CLIENTS), default=256,
                   help=f"open connections on the events socket (at most {MAX_CLIENTS}), and on the ops port (at "
                        f"most {MAX_OPS_CLIENTS}), at most; a new client beyond that disconnects the one idle the "
                        "longest (%(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=True,
                   help="log one JSON object per line on stderr (time, level, logger, msg, the pod's fields); "
                        "--no-log-json: text (default: JSON)")
    return p


def options_from_args(a: argparse.Namespace) -> Options:
    try:
        capture = json.loads(a.capture)
    except ValueError as e:
        raise ConfigError("--capture", a.capture, f"not JSON: {e}") from None
    if not isinstance(capture, dict):
        raise ConfigError("--capture", a.capture, "expected a JSON object of RedirectConfig fields")
    if not 1 <= a.workers <= MAX_WORKERS:
        raise ConfigError("--workers", a.workers, f"expected 1..{MAX_WORKERS}")
    if not 0 <= a.http_port <= 65535:
        raise ConfigError("--http-port", a.http_port, "expected 0..65535")
    if a.resync_seconds < 0:
        raise ConfigError("--resync-seconds", a.resync_seconds, "expected 0 (off) or a positive number of seconds")
    if a.proxy_timeout <= 0:
        raise ConfigError("--proxy-timeout", a.proxy_timeout, "expected a positive number of seconds")
    if not 0 < a.idle_timeout <= 3600:
        raise ConfigError("--idle-timeout", a.idle_timeout, "expected seconds in (0, 3600]")
    if not 1 <= a.max_clients <= MAX_CLIENTS:
        raise ConfigError("--max-clients", a.max_clients, f"expected 1..{MAX_CLIENTS}")
    return Options(events_socket=a.events_socket, proxy_socket=a.proxy_socket, backend=a.backend,
                   node_name=a.node_name, host_rules=not a.no_host_rules, host_netns=a.host_netns,
                   http_host=a.http_host, http_port=a.http_port, workers=a.workers, proxy_timeout=a.proxy_timeout,
                   capture=capture, scan_proc=not a.no_proc_scan, resync_seconds=a.resync_seconds,
                   idle_timeout=a.idle_timeout, max_clients=a.max_clients)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from ... import logjson

    logjson.setup(json_lines=a.log_json, level=a.log_level)
    before, soft = limit_fds()
    if soft != before:
        jlog(logging.INFO, "open files limited", soft_limit=soft, was=before)
    try:
        agent = Agent(options_from_args(a))
    except ConfigError as e:
        print(f"redirect-agent: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        agent.start()
    except (RedirectError, RuntimeError, OSError) as e:
        jlog(logging.ERROR, "agent failed to start", error=str(e))
        agent.stop()
        return 1
    while not stop.wait(3600):
        pass
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
