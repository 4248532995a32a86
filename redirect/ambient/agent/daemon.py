"""``redirect-agent``: the node agent.

It serves the thin CNI plugin's requests (``cni`` messages, ``redirect.ambient.agent.cni_requests``:
sidecar and ambient pods, through the plugin's own code), and it enrols ambient pods for a
node proxy (like istio-cni's node agent for ztunnel). The CNI plugin sends a pod ``add``
event over the events socket, and the agent enrols the pod as a transaction whose commit
record is written last (``Agent.add``):

1. an *intent* record in the pod netns (``redirect.ambient.agent.identity``, ``phase: intent``);
2. the in-pod ambient routes and rules (``redirect.setup``);
3. the pod's IPs, owned by its uid, in the node's probe sets (``redirect.ambient.node``);
4. the pod's netns fd handed to every connected node proxy, and all their acks;
5. the *commit* record (``phase: enrolled``) replaces the intent; only then does the agent
   answer the plugin, which lets the pod start.

Any failure undoes every step and fails the ADD (fail closed). ``del`` tells the proxies,
removes the rules, the record and the pod's set entries.

Restart safety: the agent keeps nothing the kernel does not hold. At start it finds its pods
by reading the record in every namespace under ``/run/netns`` and ``/proc/*/ns/net`` that the
node's user namespace owns (deduplicated by inode, filtered by ``--node-name``, each record
validated like an event: ``redirect.ambient.agent.pods``). It adopts the pods with a commit record
and removes every piece of those with only an intent (an add cut short by a crash); it
re-installs rules that drifted, re-asserts the node's probe rules and pod sets (dropping
entries of uids it did not adopt), and sends each connecting proxy a full snapshot (a proxy
drops the pods not in it); while running it repeats the repairs every ``--resync-seconds``.
In-pod rules never depend on the agent's process, so a killed agent leaves every pod
captured. SIGTERM stops it and leaves redirection in place.

Parts: ``events`` (the events socket: idle clients never hold a worker), ``proxies`` (one node
proxy connection, its acks validated), ``discovery`` (the records found at start), ``pods`` (a
pod's fields, validated once for events and records), ``identity`` (the record), ``metrics``
(/healthz /readyz /metrics).

Wire formats: ``redirect.ambient.agent.protocol`` and docs/agent-protocol.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ... import api
from ...config import RedirectConfig, int_arg, seconds_arg
from ...errors import ConfigError, RedirectError, SetupError
from ...kernel import netns as _netns
from .. import node
from . import cni_requests, identity, protocol
from .discovery import Found, discover, same_inode
from .events import EventServer
from .logs import jlog, log
from .metrics import Metrics, serve_http
from .pods import ENROLLED, INTENT, BadPod, PodRecord, ambient_config, backend_of, ips_of, text, uid_of
from .proxies import ProxyConn, Waiter, proxy_name

#: Fault injection for the kill-point tests: ``REDIRECT_AGENT_FAULT=<point>`` makes the agent
#: SIGKILL itself when it reaches ``<point>`` (see ``FAULT_POINTS``), as a crash there would.
FAULT_ENV = "REDIRECT_AGENT_FAULT"
FAULT_POINTS = ("add.start", "add.intent", "add.rules", "add.node_set", "add.proxy_sent", "add.proxy_acked",
                "add.committed")



def fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        jlog(logging.CRITICAL, "fault point reached: the agent kills itself", point=point)
        for h in logging.getLogger("redirect").handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class EventError(Exception):
    """A pod event failed; ``reason`` is the metrics label and the reply's ``reason``."""

    def __init__(self, reason: str, msg: str) -> None:
        super().__init__(msg)
        self.reason = reason


# --- the agent -----------------------------------------------------------------------------


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
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.metrics = Metrics()
        self.lock = threading.Lock()  # pods, enrolling, proxies
        self.pods: dict[str, PodRecord] = {}  # committed
        self.enrolling: dict[str, PodRecord] = {}  # handed to the proxies, not committed yet
        self.claims: dict[int, str] = {}  # netns inode -> uid of the add working in it
        self.proxies: list[ProxyConn] = []
        self._uid_guard = threading.Lock()
        self._uid_locks: dict[str, threading.Lock] = {}
        self.ready = False
        self.stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._paths: list[str] = []
        self.events: EventServer | None = None
        self.http: Any = None
        try:
            base = {**opts.capture, "mode": "ambient"}
            self.base = RedirectConfig.from_dict(base)
        except ConfigError as e:
            raise ConfigError(f"capture.{e.field}", e.value, e.reason) from None

    # -- lifecycle

    def start(self) -> None:
        t0 = time.monotonic()
        events = self._bind(self.opts.events_socket)
        proxies = self._bind(self.opts.proxy_socket)
        self.http = serve_http(self.opts.http_host, self.opts.http_port, self.metrics, self._readiness,
                               idle_timeout=self.opts.idle_timeout, max_clients=self.opts.max_clients)
        jlog(logging.INFO, "http listening", host=self.opts.http_host, port=self.http.server_address[1])
        self.reconcile()
        threading.Thread(target=self._accept_proxies, args=(proxies,), name="agent-proxies", daemon=True).start()
        self.events = EventServer(events, self.handle, lambda reason: self.metrics.inc("failures", reason),
                                  workers=self.opts.workers, max_clients=self.opts.max_clients,
                                  idle_timeout=self.opts.idle_timeout,
                                  fd_handlers={"cni": lambda msg, fds: cni_requests.serve(self, msg, fds)})
        self.events.start()
        if self.opts.resync_seconds > 0:
            threading.Thread(target=self._resync_loop, name="agent-resync", daemon=True).start()
        threading.Thread(target=cni_requests.warm_up, args=(self.opts.backend,), name="agent-warm-up",
                         daemon=True).start()
        self.ready = True
        jlog(logging.INFO, "agent ready", node=self.opts.node_name, pods=len(self.pods),
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
        with self.lock:
            conns = list(self.proxies)
        for c in conns:
            c.close()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        if self.events is not None:
            self.events.stop()
        jlog(logging.INFO, "agent stopped; redirection left in place", pods=len(self.pods))

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        with self.lock:
            return self.ready, {"pods": len(self.pods), "proxies": sum(1 for c in self.proxies if c.serving)}

    def _uid_lock(self, uid: str) -> threading.Lock:
        with self._uid_guard:
            return self._uid_locks.setdefault(uid, threading.Lock())

    def _host(self) -> str | None:
        return self.opts.host_netns

    # -- restart safety

    def discover(self) -> Found:
        """Our pods, read from the kernel (``redirect.ambient.agent.discovery``)."""
        return discover(self.opts.node_name, self.opts.scan_proc)

    def reconcile(self) -> None:
        t0 = time.monotonic()
        host = self._host()
        if self.opts.host_rules:
            node.setup_node(host)
        found = self.discover()
        for pod in found.unfinished:
            self._undo(pod, "an enrolment cut short (no commit record): removed")
            self.metrics.inc("reconciled", "removed")
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.opts.workers) as ex:
            results = list(ex.map(self._fix_rules, found.enrolled.values()))
        for r in results:
            self.metrics.inc("reconciled", r)
        if self.opts.host_rules:
            for pod in found.enrolled.values():
                if pod.ips:
                    try:
                        node.add_pods(pod.ips, host, owner=pod.uid)
                    except Exception as e:  # noqa: BLE001 - one pod never stops the agent
                        jlog(logging.ERROR, "node set entries could not be added", pod=pod.uid, error=str(e))
            stale: dict[str, list[str]] = {}
            for ip, owner in node.list_pods(host).items():
                if owner and owner not in found.enrolled:
                    stale.setdefault(owner, []).append(ip)
            for owner, ips in stale.items():
                try:
                    node.remove_pods(ips, host, owner=owner)
                    jlog(logging.INFO, "removed node set entries of a pod that is gone", pod=owner, ips=ips)
                except Exception as e:  # noqa: BLE001
                    jlog(logging.ERROR, "stale node set entries could not be removed", pod=owner, error=str(e))
        with self.lock:
            self.pods = found.enrolled
            self.metrics.set("pods_enrolled", len(found.enrolled))
        jlog(logging.INFO, "reconciled", pods=len(found.enrolled), ms=round((time.monotonic() - t0) * 1e3, 1),
             removed=len(found.unfinished), ignored=found.ignored,
             **{r: results.count(r) for r in ("intact", "repaired", "failed")})

    def _undo(self, pod: PodRecord, why: str) -> None:
        """Remove every piece of ``pod`` the kernel may hold (rules, routes, node-set entries it
        owns, its record last), each step on its own so one failure does not stop the others."""
        steps: list[tuple[str, Callable[[], object]]] = [("rules", lambda: api.teardown(pod.netns))]  # any backend's
        if self.opts.host_rules and pod.ips:
            steps.append(("node set", lambda: node.remove_pods(pod.ips, self._host(), owner=pod.uid)))
        steps.append(("record", lambda: self._clear_record(pod)))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - report, keep undoing
                jlog(logging.ERROR, "undo step failed", pod=pod.uid, step=what, error=str(e))
        jlog(logging.WARNING, why, pod=pod.uid, netns=pod.netns)

    def _clear_record(self, pod: PodRecord) -> None:
        """Remove the record in ``pod``'s netns if it is this pod's (another pod's is never touched)."""
        if not same_inode(pod.netns, pod.inode):
            return
        rec = identity.scan(pod.netns)
        if rec is None or rec.get("uid") == pod.uid:
            identity.clear(pod.netns)

    def _fix_rules(self, pod: PodRecord) -> str:
        """Re-install the pod's rules if they differ from its recorded config: intact, repaired or failed."""
        try:
            if api.check(pod.netns, pod.config, pod.backend).ok:
                return "intact"
            api.setup(pod.netns, pod.config, pod.backend)
            jlog(logging.WARNING, "pod rules had drifted: re-installed", pod=pod.uid, netns=pod.netns)
            return "repaired"
        except Exception as e:  # noqa: BLE001 - one pod never stops the agent
            jlog(logging.ERROR, "pod rules could not be repaired", pod=pod.uid, netns=pod.netns, error=str(e))
            return "failed"

    def resync(self) -> dict[str, int]:
        """While running (every ``--resync-seconds``): the start's repairs for the pods enrolled now
        (drifted rules, node probe rules, node-set entries); a pod whose netns is gone without a
        ``del`` is dropped (proxies told, node-set entries removed). Counts by result."""
        counts: dict[str, int] = {}
        host = self._host()
        if self.opts.host_rules:
            try:
                if node.setup_node(host):
                    jlog(logging.WARNING, "node probe rules had drifted: re-installed")
            except RedirectError as e:
                jlog(logging.ERROR, "node probe rules could not be re-asserted", error=str(e))
        with self.lock:
            pods = list(self.pods.values())
        for pod in pods:
            if self.stopping.is_set():
                break
            with self._uid_lock(pod.uid):
                with self.lock:
                    if self.pods.get(pod.uid) is not pod:
                        continue  # added again or deleted meanwhile
                if not same_inode(pod.netns, pod.inode):
                    self._forget(pod)
                    r = "gone"
                else:
                    r = self._fix_rules(pod)
                    if self.opts.host_rules and pod.ips:
                        try:
                            node.add_pods(pod.ips, host, owner=pod.uid)
                        except RedirectError as e:
                            jlog(logging.ERROR, "node set entries could not be re-added", pod=pod.uid, error=str(e))
            counts[r] = counts.get(r, 0) + 1
            self.metrics.inc("resynced", r)
        return counts

    def _forget(self, pod: PodRecord) -> None:
        with self.lock:
            if self.pods.get(pod.uid) is pod:
                del self.pods[pod.uid]
            self.metrics.set("pods_enrolled", len(self.pods))
            waiters = [(c, c.enqueue({"type": "del", "uid": pod.uid})) for c in self.proxies]
        self._wait_all(waiters)
        if self.opts.host_rules and pod.ips:
            with contextlib.suppress(RedirectError):
                node.remove_pods(pod.ips, self._host(), owner=pod.uid)
        jlog(logging.WARNING, "pod netns is gone without a del: pod dropped", pod=pod.uid, netns=pod.netns)

    def _resync_loop(self) -> None:
        while not self.stopping.wait(self.opts.resync_seconds):
            try:
                counts = self.resync()
                if set(counts) - {"intact"}:
                    jlog(logging.INFO, "resynced", **counts)
            except Exception:  # noqa: BLE001 - the loop must go on
                log.exception("resync failed")

    # -- node proxies

    def _accept_proxies(self, lsock: socket.socket) -> None:
        n = 0
        while not self.stopping.is_set():
            try:
                s, _ = lsock.accept()
            except OSError:
                return
            n += 1
            threading.Thread(target=self._proxy_hello, args=(s, n), name="proxy-hello", daemon=True).start()

    def _proxy_hello(self, s: socket.socket, n: int) -> None:
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
        name = proxy_name(got[0], n)
        conn = ProxyConn(s, name, self._proxy_gone)
        with self.lock:
            self.proxies.append(conn)
            pods = list({**self.pods, **self.enrolling}.values())
            waiters = [conn.send_add(p) for p in pods]
            done = conn.enqueue({"type": "snapshot_done", "pods": sorted(p.uid for p in pods)})
            self.metrics.set("proxy_connections", len(self.proxies))
            self.metrics.add("proxy_connects_total", 1)
        jlog(logging.INFO, "node proxy connected: snapshot sent", proxy=name, pods=len(pods))
        if done.event.wait(self.opts.proxy_timeout + 0.05 * len(pods)) and done.ok:
            conn.synced.set()
            failed = [p.uid for p, w in zip(pods, waiters, strict=True) if not w.ok]
            jlog(logging.INFO if not failed else logging.ERROR, "node proxy synced", proxy=name, failed=failed)
        else:
            jlog(logging.ERROR, "node proxy did not ack the snapshot", proxy=name, error=done.error)

    def _proxy_gone(self, conn: ProxyConn) -> None:
        with self.lock:
            if conn in self.proxies:
                self.proxies.remove(conn)
            self.metrics.set("proxy_connections", len(self.proxies))
        jlog(logging.INFO, "node proxy disconnected", proxy=conn.name)

    def _wait_all(self, waiters: list[tuple[ProxyConn, Waiter]]) -> list[str]:
        """Errors of the proxies that did not ack in time (disconnects count as errors)."""
        deadline = time.monotonic() + self.opts.proxy_timeout
        errors = []
        for c, w in waiters:
            if not w.event.wait(max(deadline - time.monotonic(), 0)):
                errors.append(f"{c.name}: no ack within {self.opts.proxy_timeout} s")
            elif not w.ok:
                errors.append(f"{c.name}: {w.error}")
        return errors

    # -- events

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg["type"]
        t0 = time.perf_counter()
        try:
            if kind == "add":
                out = self.add(msg.get("pod"))
            elif kind == "del":
                out = self.delete(msg.get("pod"))
            elif kind == "check":
                out = self.check(msg.get("pod"))
            elif kind == "list":
                with self.lock:
                    out = {"pods": [p.for_proxy() for p in self.pods.values()]}
            elif kind == "status":
                ok, detail = self._readiness()
                out = {"ready": ok, **detail}
            else:
                raise EventError("bad_request", f"type={kind[:40]!r}: expected add, del, check, list or status")
        except BadPod as e:
            return self._failed(kind, msg, EventError("bad_request", str(e)))
        except EventError as e:
            return self._failed(kind, msg, e)
        except Exception as e:  # noqa: BLE001 - the plugin must always get an answer
            self.metrics.inc("failures", "internal")
            log.exception("%s failed", kind)
            return {"type": "result", "ok": False, "reason": "internal", "error": f"{type(e).__name__}: {e}"}
        if kind in ("add", "del"):
            self.metrics.inc("events", kind)
            if kind == "add" and out.get("enrolled"):
                self.metrics.observe_setup(time.perf_counter() - t0)
        return {"type": "result", "ok": True, "ms": round((time.perf_counter() - t0) * 1e3, 2), **out}

    def _failed(self, kind: str, msg: dict[str, Any], e: EventError) -> dict[str, Any]:
        self.metrics.inc("failures", e.reason)
        pod = msg.get("pod")
        uid = pod.get("uid") if isinstance(pod, dict) and isinstance(pod.get("uid"), str) else None
        jlog(logging.ERROR, f"{kind[:40]} failed", reason=e.reason, error=str(e), pod=uid[:128] if uid else None)
        return {"type": "result", "ok": False, "reason": e.reason, "error": str(e)}

    def _parse_pod(self, pod: Any) -> PodRecord:
        if not isinstance(pod, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(pod, "pod")
        path = text(pod, "netns", "pod", required=True, limit=4096)
        ips = ips_of(pod.get("ips") or [], "pod.ips")
        backend = backend_of(pod.get("backend"), "pod.backend", self.opts.backend)
        cfg = self._pod_config(pod)
        try:
            inode = _netns.netns_inode(path)
            host = _netns.host_netns_reason_of(path)  # (before anything is written there)
        except RedirectError as e:
            raise EventError("netns", str(e)) from None
        if host is not None:
            raise EventError("netns", f"pod.netns={path!r}: {host}: refused")
        return PodRecord(uid=uid, name=text(pod, "name", "pod"), namespace=text(pod, "namespace", "pod", limit=63),
                         netns=path, inode=inode, ips=ips, container_id=text(pod, "container_id", "pod", limit=128),
                         backend=backend, config=cfg, node=self.opts.node_name)

    def _pod_config(self, pod: dict[str, Any]) -> RedirectConfig:
        from ...istio.annotations import config_from_annotations

        try:
            if "config" in pod and pod["config"] is not None:
                return ambient_config(pod["config"], "pod.config")
            ann = pod.get("annotations") or {}
            if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
                raise EventError("bad_request", "pod.annotations: expected an object of strings")
            cfg = config_from_annotations(ann, self.base)
        except ConfigError as e:
            raise EventError("bad_annotation", str(e)) from None
        except BadPod as e:
            raise EventError("bad_annotation" if e.field.startswith("pod.config.") else "bad_request", str(e)) from None
        if cfg.mode != "ambient":
            raise EventError("bad_request", f"pod.config.mode={cfg.mode!r}: the agent enrols ambient pods only")
        return cfg

    def _claim(self, pod: PodRecord) -> None:
        """Claim ``pod``'s netns for this add, or refuse (``netns``) if another pod holds it: enrolled,
        being enrolled (claimed), or recorded there. Nothing is changed by a refusal."""
        with self.lock:
            other = self.claims.get(pod.inode)
            for p in (*self.pods.values(), *self.enrolling.values()):
                if other is None and p.uid != pod.uid and p.inode == pod.inode and same_inode(p.netns, p.inode):
                    other = p.uid
            if other is None or other == pod.uid:
                self.claims[pod.inode] = pod.uid
                other = None
        if other is None:
            rec = identity.scan(pod.netns)
            if rec is not None and isinstance(rec.get("uid"), str) and rec["uid"] != pod.uid:
                other = str(rec["uid"])[:128]
                self._release(pod)
        if other is not None:
            raise EventError("netns", f"pod.netns={pod.netns!r}: that netns is pod {other}'s; nothing was changed")

    def _release(self, pod: PodRecord) -> None:
        with self.lock:
            if self.claims.get(pod.inode) == pod.uid:
                del self.claims[pod.inode]

    def add(self, raw: Any) -> dict[str, Any]:
        """Enrol a pod, as a transaction whose commit record is written last.

        1. an *intent* record in the pod netns (what to remove if the agent dies before 5.);
        2. the in-pod routes and rules (``redirect.setup``);
        3. the pod's IPs in the node probe sets, owned by its uid;
        4. the netns handed to every connected node proxy, and all their acks;
        5. the *commit* record (``phase: enrolled``) replaces the intent: the pod is enrolled.

        A failure undoes every step (``_rollback``). A restarted agent adopts only pods with a
        commit record and removes the pieces of one that has only the intent.
        """
        pod = self._parse_pod(raw)
        with self._uid_lock(pod.uid):
            self._claim(pod)
            try:
                proxies = self._enrol(pod)
            finally:
                self._release(pod)
        jlog(logging.INFO, "pod enrolled", pod=pod.uid, name=pod.name, namespace=pod.namespace, netns=pod.netns,
             ips=list(pod.ips), proxies=proxies, backend=pod.backend)
        return {"enrolled": True, "pod": pod.uid, "proxies": proxies}

    def _enrol(self, pod: PodRecord) -> int:
        """The steps of ``add`` (under the pod's uid lock and netns claim); how many proxies acked."""
        with self.lock:
            if not self.proxies:
                raise EventError("no_proxy", "no node proxy is connected: the pod would have no proxy")
            cur = self.pods.get(pod.uid)
        try:
            fault("add.start")
            if cur is None or cur.inode != pod.inode:  # a repeated add keeps its commit record
                identity.write(pod.netns, pod.record(INTENT))
                fault("add.intent")
            api.setup(pod.netns, pod.config, pod.backend)
            fault("add.rules")
            if self.opts.host_rules and pod.ips:
                host = self._host()
                try:
                    node.add_pods(pod.ips, host, owner=pod.uid)
                except SetupError:  # the node sets went away since the start: put them back once
                    node.setup_node(host)
                    node.add_pods(pod.ips, host, owner=pod.uid)
                fault("add.node_set")
            with self.lock:
                self.enrolling[pod.uid] = pod  # in the snapshot of a proxy that connects now
                waiters = [(c, c.send_add(pod)) for c in self.proxies]
            fault("add.proxy_sent")
            if not waiters:
                raise EventError("no_proxy", "no node proxy is connected")
            errors = self._wait_all(waiters)
            if errors:
                raise EventError("proxy", "node proxy did not take the pod: " + "; ".join(errors))
            fault("add.proxy_acked")
            identity.write(pod.netns, pod.record(ENROLLED))
            fault("add.committed")
            with self.lock:
                self.enrolling.pop(pod.uid, None)
                self.pods[pod.uid] = pod
                self.metrics.set("pods_enrolled", len(self.pods))
            return len(waiters)
        except Exception as e:
            self._rollback(pod)
            if isinstance(e, EventError):
                raise
            if isinstance(e, RedirectError):
                raise EventError("setup", str(e)) from None
            raise

    def _rollback(self, pod: PodRecord) -> None:
        """Undo a failed add, whether or not the pod was enrolled before (the runtime retries or DELs)."""
        with self.lock:
            self.pods.pop(pod.uid, None)
            self.enrolling.pop(pod.uid, None)
            self.metrics.set("pods_enrolled", len(self.pods))
            conns = list(self.proxies)
        for c in conns:
            c.enqueue({"type": "del", "uid": pod.uid})
        self._undo(pod, "failed add rolled back")

    def check(self, raw: Any) -> dict[str, Any]:
        """Whether the pod is enrolled in that netns, its rules are as recorded, and a proxy has it."""
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(raw, "pod")
        path = text(raw, "netns", "pod", limit=4096)
        with self.lock:
            rec = self.pods.get(uid)
            proxies = sum(1 for c in self.proxies if c.synced.is_set() and c.serving)
        if rec is None:
            raise EventError("check", f"pod {uid} is not enrolled on this node")
        if path and not same_inode(path, rec.inode):
            raise EventError("check", f"pod {uid} is enrolled in another netns than {path}")
        try:
            res = api.check(rec.netns, rec.config, rec.backend)
        except RedirectError as e:
            raise EventError("check", str(e)) from None
        if not res.ok:
            raise EventError("check", f"pod {uid}: rules differ: " + "; ".join(res.differences))
        if not proxies:
            raise EventError("check", f"pod {uid}: no node proxy is connected")
        return {"pod": uid, "proxies": proxies}

    def delete(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = uid_of(raw, "pod", required=False)
        path = text(raw, "netns", "pod", limit=4096)
        cid = text(raw, "container_id", "pod", limit=128)
        if not uid and not cid:
            raise EventError("bad_request", "pod: a del needs uid or container_id")
        if not uid:
            with self.lock:
                uid = next((p.uid for p in self.pods.values() if p.container_id == cid), "")
            if not uid:
                return {"removed": False}
        with self._uid_lock(uid):
            target_inode = None
            if path and os.path.exists(path):
                with contextlib.suppress(RedirectError, OSError):
                    target_inode = _netns.netns_inode(path)
            with self.lock:
                rec = self.pods.get(uid)
                same = rec is not None and (target_inode is None or target_inode == rec.inode)
                waiters = []
                if same:
                    del self.pods[uid]
                    self.metrics.set("pods_enrolled", len(self.pods))
                    waiters = [(c, c.enqueue({"type": "del", "uid": uid})) for c in self.proxies]
            errors = self._wait_all(waiters)
            if errors:
                jlog(logging.WARNING, "node proxy did not ack a delete", pod=uid, errors=errors)
            netns_path = path if target_inode is not None else None
            if netns_path is None and same and rec is not None and same_inode(rec.netns, rec.inode):
                netns_path = rec.netns
            if netns_path is not None:
                backend = rec.backend if rec is not None else self.opts.backend
                found = identity.read(netns_path)
                if found is None or found.get("uid") == uid:
                    try:
                        api.teardown(netns_path, backend)
                        identity.clear(netns_path)
                    except RedirectError as e:
                        raise EventError("teardown", str(e)) from None
            if self.opts.host_rules:
                host = self._host()
                mine = [ip for ip, owner in node.list_pods(host).items() if owner == uid]
                if mine and (same or rec is None):
                    node.remove_pods(mine, host, owner=uid)
        jlog(logging.INFO, "pod removed", pod=uid, netns=path, known=rec is not None)
        return {"removed": rec is not None, "pod": uid}


# --- CLI -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redirect-agent",
        description="Node agent: serves the thin redirect-cni plugin's requests (sidecar and ambient pods), "
                    "enrols ambient pods (in-pod rules, node probe sets) and hands their network namespaces to "
                    "the node proxy. Restart-safe: state is read back from the kernel. SIGTERM stops it and "
                    "leaves redirection in place.")
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
    p.add_argument("--workers", type=int_arg(1, 1024), default=16,
                   help="pod events and CNI requests handled at once (%(default)s)")
    p.add_argument("--proxy-timeout", type=seconds_arg(0.001, 3600), default=5.0,
                   help="seconds to wait for the node proxy's ack of a pod (%(default)s)")
    p.add_argument("--capture", default="{}",
                   help="JSON object of RedirectConfig fields: the pods' base config before annotations")
    p.add_argument("--no-proc-scan", action="store_true", help="at start, look for pods under /run/netns only")
    p.add_argument("--resync-seconds", type=seconds_arg(0, 86400), default=30.0,
                   help="while running, repair drifted rules and drop pods whose netns is gone this often; "
                        "0 = only at start (%(default)s)")
    p.add_argument("--idle-timeout", type=seconds_arg(0.001, 3600), default=10.0,
                   help="seconds an events-socket or ops-port client may stay idle, and may take to read an "
                        "answer, before it is disconnected (%(default)s)")
    p.add_argument("--max-clients", type=int_arg(1, 65536), default=256,
                   help="open connections on the events socket, and on the ops port, at most; a new client "
                        "beyond that disconnects the one idle the longest (%(default)s)")
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
    if a.workers < 1 or a.workers > 256:
        raise ConfigError("--workers", a.workers, "expected 1..256")
    if not 0 <= a.http_port <= 65535:
        raise ConfigError("--http-port", a.http_port, "expected 0..65535")
    if a.resync_seconds < 0:
        raise ConfigError("--resync-seconds", a.resync_seconds, "expected 0 (off) or a positive number of seconds")
    if a.proxy_timeout <= 0:
        raise ConfigError("--proxy-timeout", a.proxy_timeout, "expected a positive number of seconds")
    if not 0 < a.idle_timeout <= 3600:
        raise ConfigError("--idle-timeout", a.idle_timeout, "expected seconds in (0, 3600]")
    if not 1 <= a.max_clients <= 65536:
        raise ConfigError("--max-clients", a.max_clients, "expected 1..65536")
    return Options(events_socket=a.events_socket, proxy_socket=a.proxy_socket, backend=a.backend,
                   node_name=a.node_name, host_rules=not a.no_host_rules, host_netns=a.host_netns,
                   http_host=a.http_host, http_port=a.http_port, workers=a.workers, proxy_timeout=a.proxy_timeout,
                   capture=capture, scan_proc=not a.no_proc_scan, resync_seconds=a.resync_seconds,
                   idle_timeout=a.idle_timeout, max_clients=a.max_clients)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from ... import logjson

    logjson.setup(json_lines=a.log_json, level=a.log_level)
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
