"""``redirect-agent``: the ambient node agent.

It enrols ambient pods for a node proxy (like istio-cni's node agent for ztunnel):

1. the CNI plugin sends a pod ``add`` event over the events socket;
2. the agent writes the pod's identity into its netns (``redirect.agent.identity``),
   installs the in-pod ambient rules (``redirect.setup``) and adds the pod's IPs,
   owned by its uid, to the node's probe sets (``redirect.node``);
3. it hands the pod's netns fd to every connected node proxy and waits for their
   acks; only then does it answer the plugin, which lets the pod start.

Any failure undoes what was done and fails the ADD (fail closed). ``del`` tells the
proxies, removes the rules, the identity and the pod's set entries.

Restart safety: the agent keeps nothing the kernel does not hold. At start it finds
its pods by reading the identity set in every namespace under ``/run/netns`` and
``/proc/*/ns/net`` (deduplicated by inode, filtered by ``--node-name``), re-installs
rules that drifted, re-asserts the node's probe rules and pod sets, and sends each
connecting proxy a full snapshot; while running it repeats the repairs every
``--resync-seconds``. In-pod rules never depend on the agent's process,
so a killed agent leaves every pod captured. SIGTERM stops it and leaves
redirection in place.

Wire formats: ``redirect.agent.protocol`` and docs/agent-protocol.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import api, node
from .. import netns as _netns
from ..config import RedirectConfig
from ..errors import ConfigError, RedirectError, SetupError
from . import identity, protocol
from .metrics import Metrics, serve_http

log = logging.getLogger("redirect.agent")

_DEFAULT_CFG = RedirectConfig().to_dict()


def jlog(level: int, msg: str, **fields: Any) -> None:
    """A structured log line: ``msg`` plus ``fields`` (keys of the JSON line, see ``redirect.logjson``)."""
    log.log(level, msg, extra={"fields": fields})


class EventError(Exception):
    """A pod event failed; ``reason`` is the metrics label and the reply's ``reason``."""

    def __init__(self, reason: str, msg: str) -> None:
        super().__init__(msg)
        self.reason = reason


# --- pods --------------------------------------------------------------------------------


@dataclass
class PodRecord:
    uid: str
    name: str
    namespace: str
    netns: str
    inode: int
    ips: tuple[str, ...]
    container_id: str
    backend: str
    config: RedirectConfig
    node: str

    def record(self) -> dict[str, Any]:
        """What is stored in the pod netns (``identity``)."""
        cfg = {k: v for k, v in self.config.to_dict().items() if k == "mode" or _DEFAULT_CFG.get(k) != v}
        return {"node": self.node, "uid": self.uid, "name": self.name, "namespace": self.namespace,
                "netns": self.netns, "ips": list(self.ips), "container_id": self.container_id,
                "backend": self.backend, "config": cfg}

    def for_proxy(self) -> dict[str, Any]:
        return {"uid": self.uid, "name": self.name, "namespace": self.namespace, "ips": list(self.ips),
                "netns": self.netns, "netns_inode": self.inode}

    @classmethod
    def from_record(cls, rec: dict[str, Any], netns: str, inode: int) -> PodRecord:
        return cls(uid=str(rec["uid"]), name=str(rec.get("name", "")), namespace=str(rec.get("namespace", "")),
                   netns=netns, inode=inode, ips=tuple(rec.get("ips") or ()),
                   container_id=str(rec.get("container_id", "")), backend=str(rec.get("backend", "iptables")),
                   config=RedirectConfig.from_dict(rec.get("config") or {"mode": "ambient"}),
                   node=str(rec.get("node", "")))


def _text(pod: dict[str, Any], key: str, required: bool = False, limit: int = 253) -> str:
    value = pod.get(key, "")
    if value is None:
        value = ""
    if not isinstance(value, str) or len(value) > limit or any(ord(c) < 32 for c in value):
        raise EventError("bad_request", f"pod.{key}={value!r}: expected a string of at most {limit} printable chars")
    if required and not value:
        raise EventError("bad_request", f"pod.{key}: missing")
    return value


# --- node proxies --------------------------------------------------------------------------


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

    def __init__(self, agent: Agent, sock: socket.socket, name: str) -> None:
        self.agent = agent
        self.sock = sock
        self.name = name
        self.q: queue.Queue[tuple[dict[str, Any], int | None] | None] = queue.Queue()
        self.pending: dict[int, Waiter] = {}
        self.lock = threading.Lock()
        self.alive = True
        self.synced = threading.Event()  # acked its first snapshot_done
        threading.Thread(target=self._writer, name=f"proxy-w:{name}", daemon=True).start()
        threading.Thread(target=self._reader, name=f"proxy-r:{name}", daemon=True).start()

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

    def send_add(self, pod: PodRecord) -> Waiter:
        try:
            fd = _netns.open_netns(pod.netns)
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
            except OSError as e:
                jlog(logging.WARNING, "sending to node proxy failed", proxy=self.name, error=str(e))
                self.close()
            finally:
                if fd is not None:
                    os.close(fd)

    def _reader(self) -> None:
        try:
            while True:
                got = protocol.recv(self.sock, max_fds=0)
                if got is None:
                    break
                msg, _ = got
                if msg["type"] != "ack":
                    continue
                with self.lock:
                    w = self.pending.pop(int(msg.get("id", -1)), None)
                if w is not None:
                    w.done(bool(msg.get("ok")), str(msg.get("error", "")))
        except (OSError, protocol.ProtocolError, ValueError) as e:
            jlog(logging.WARNING, "node proxy connection failed", proxy=self.name, error=str(e))
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
        self.agent._proxy_gone(self)
        self.sock.close()


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


class Agent:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.metrics = Metrics()
        self.lock = threading.Lock()  # pods + proxies
        self.pods: dict[str, PodRecord] = {}
        self.proxies: list[ProxyConn] = []
        self._uid_guard = threading.Lock()
        self._uid_locks: dict[str, threading.Lock] = {}
        self.ready = False
        self.stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._paths: list[str] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=opts.workers, thread_name_prefix="agent-ev")
        self._inflight = threading.BoundedSemaphore(opts.workers * 8)
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
        self.http = serve_http(self.opts.http_host, self.opts.http_port, self.metrics, self._readiness)
        jlog(logging.INFO, "http listening", host=self.opts.http_host, port=self.http.server_address[1])
        self.reconcile()
        threading.Thread(target=self._accept_proxies, args=(proxies,), name="agent-proxies", daemon=True).start()
        threading.Thread(target=self._accept_events, args=(events,), name="agent-events", daemon=True).start()
        if self.opts.resync_seconds > 0:
            threading.Thread(target=self._resync_loop, name="agent-resync", daemon=True).start()
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
        self._pool.shutdown(wait=True, cancel_futures=False)
        jlog(logging.INFO, "agent stopped; redirection left in place", pods=len(self.pods))

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        with self.lock:
            return self.ready, {"pods": len(self.pods), "proxies": len(self.proxies)}

    def _uid_lock(self, uid: str) -> threading.Lock:
        with self._uid_guard:
            return self._uid_locks.setdefault(uid, threading.Lock())

    def _host(self) -> str | None:
        return self.opts.host_netns

    # -- restart safety

    def discover(self) -> dict[str, PodRecord]:
        """Our pods, read from the kernel: the identity set in every namespace we can reach."""
        paths: list[str] = []
        with contextlib.suppress(FileNotFoundError):
            paths += [os.path.join(_netns.NETNS_RUN_DIR, n) for n in sorted(os.listdir(_netns.NETNS_RUN_DIR))]
        if self.opts.scan_proc:
            paths += [f"/proc/{p}/ns/net" for p in os.listdir("/proc") if p.isdigit()]
        by_inode: dict[tuple[int, int], list[str]] = {}
        for p in paths:
            try:
                st = os.stat(p)
            except OSError:
                continue
            by_inode.setdefault((st.st_dev, st.st_ino), []).append(p)

        def read(item: tuple[tuple[int, int], list[str]]) -> PodRecord | None:
            (_, ino), names = item
            try:
                rec = identity.scan(names[0])
            except (RedirectError, OSError):
                return None
            if rec is None or rec.get("node") != self.opts.node_name or not isinstance(rec.get("uid"), str):
                return None
            path = rec.get("netns") if isinstance(rec.get("netns"), str) else ""
            if not path or not _same_inode(path, ino):
                path = names[0]
            try:
                return PodRecord.from_record(rec, path, ino)
            except (ConfigError, KeyError, TypeError, ValueError) as e:
                jlog(logging.ERROR, "unreadable pod identity", netns=names[0], error=str(e))
                return None

        found: dict[str, PodRecord] = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="agent-scan") as ex:
            for pod in ex.map(read, by_inode.items()):
                if pod is not None:
                    found[pod.uid] = pod
        return found

    def reconcile(self) -> None:
        t0 = time.monotonic()
        if self.opts.host_rules:
            node.setup_node(self._host())
        found = self.discover()
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.opts.workers) as ex:
            results = list(ex.map(self._fix_rules, found.values()))
        for r in results:
            self.metrics.inc("reconciled", r)
        if self.opts.host_rules:
            host = self._host()
            for pod in found.values():
                if pod.ips:
                    node.add_pods(pod.ips, host, owner=pod.uid)
            stale: dict[str, list[str]] = {}
            for ip, owner in node.list_pods(host).items():
                if owner and owner not in found:
                    stale.setdefault(owner, []).append(ip)
            for owner, ips in stale.items():
                node.remove_pods(ips, host, owner=owner)
                jlog(logging.INFO, "removed node set entries of a pod that is gone", pod=owner, ips=ips)
        with self.lock:
            self.pods = found
            self.metrics.set("pods_enrolled", len(found))
        jlog(logging.INFO, "reconciled", pods=len(found), ms=round((time.monotonic() - t0) * 1e3, 1),
             **{r: results.count(r) for r in ("intact", "repaired", "failed")})

    def _fix_rules(self, pod: PodRecord) -> str:
        """Re-install the pod's rules if they differ from its recorded config: intact, repaired or failed."""
        try:
            if api.check(pod.netns, pod.config, pod.backend).ok:
                return "intact"
            api.setup(pod.netns, pod.config, pod.backend)
            jlog(logging.WARNING, "pod rules had drifted: re-installed", pod=pod.uid, netns=pod.netns)
            return "repaired"
        except RedirectError as e:
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
                if not _same_inode(pod.netns, pod.inode):
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
            with contextlib.suppress(OSError):
                protocol.send(s, {"type": "error", "error": str(e)})
            s.close()
            return
        name = f"{got[0].get('proxy', 'proxy')}#{n}"
        conn = ProxyConn(self, s, name)
        with self.lock:
            self.proxies.append(conn)
            pods = list(self.pods.values())
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

    def _accept_events(self, lsock: socket.socket) -> None:
        while not self.stopping.is_set():
            self._inflight.acquire()
            try:
                s, _ = lsock.accept()
            except OSError:
                self._inflight.release()
                return
            try:
                self._pool.submit(self._serve_client, s)
            except RuntimeError:  # shutting down
                self._inflight.release()
                s.close()
                return

    def _serve_client(self, s: socket.socket) -> None:
        try:
            s.settimeout(30.0)
            while True:
                try:
                    got = protocol.recv(s, max_fds=0)
                except protocol.ProtocolError as e:
                    protocol.send(s, {"type": "result", "ok": False, "reason": "bad_request", "error": str(e)})
                    continue
                if got is None:
                    return
                protocol.send(s, self.handle(got[0]))
        except OSError:
            pass
        finally:
            s.close()
            self._inflight.release()

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
                raise EventError("bad_request", f"type={kind!r}: expected add, del, check, list or status")
        except EventError as e:
            self.metrics.inc("failures", e.reason)
            jlog(logging.ERROR, f"{kind} failed", reason=e.reason, error=str(e),
                 pod=(msg.get("pod") or {}).get("uid") if isinstance(msg.get("pod"), dict) else None)
            return {"type": "result", "ok": False, "reason": e.reason, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - the plugin must always get an answer
            self.metrics.inc("failures", "internal")
            log.exception("%s failed", kind)
            return {"type": "result", "ok": False, "reason": "internal", "error": f"{type(e).__name__}: {e}"}
        if kind in ("add", "del"):
            self.metrics.inc("events", kind)
            if kind == "add" and out.get("enrolled"):
                self.metrics.observe_setup(time.perf_counter() - t0)
        return {"type": "result", "ok": True, "ms": round((time.perf_counter() - t0) * 1e3, 2), **out}

    def _parse_pod(self, pod: Any) -> PodRecord:
        if not isinstance(pod, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = _text(pod, "uid", required=True, limit=128)
        if not protocol.UID_RE.match(uid):
            raise EventError("bad_request", f"pod.uid={uid!r}: expected letters, digits, '.', '_', ':' or '-'")
        path = _text(pod, "netns", required=True, limit=4096)
        ips = pod.get("ips") or []
        try:
            parsed = tuple(ip for _, ip in node._parse_ips(ips, "pod.ips")) if ips else ()
        except ConfigError as e:
            raise EventError("bad_request", str(e)) from None
        backend = pod.get("backend") or self.opts.backend
        if not isinstance(backend, str):
            raise EventError("bad_request", f"pod.backend={backend!r}: expected a backend name")
        cfg = self._pod_config(pod)
        try:
            inode = _netns.netns_inode(path)
            host = _netns.host_netns_reason_of(path)  # (before anything is written there)
        except RedirectError as e:
            raise EventError("netns", str(e)) from None
        if host is not None:
            raise EventError("netns", f"pod.netns={path!r}: {host}: refused")
        return PodRecord(uid=uid, name=_text(pod, "name"), namespace=_text(pod, "namespace", limit=63),
                         netns=path, inode=inode, ips=parsed, container_id=_text(pod, "container_id", limit=128),
                         backend=backend, config=cfg, node=self.opts.node_name)

    def _pod_config(self, pod: dict[str, Any]) -> RedirectConfig:
        from ..annotations import config_from_annotations

        try:
            if isinstance(pod.get("config"), dict):
                cfg = RedirectConfig.from_dict(pod["config"])
            else:
                ann = pod.get("annotations") or {}
                if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in ann.items()):
                    raise EventError("bad_request", "pod.annotations: expected an object of strings")
                cfg = config_from_annotations(ann, self.base)
        except ConfigError as e:
            raise EventError("bad_annotation", str(e)) from None
        if cfg.mode != "ambient":
            raise EventError("bad_request", f"pod.config.mode={cfg.mode!r}: the agent enrols ambient pods only")
        return cfg

    def add(self, raw: Any) -> dict[str, Any]:
        pod = self._parse_pod(raw)
        with self._uid_lock(pod.uid):
            with self.lock:
                if not self.proxies:
                    raise EventError("no_proxy", "no node proxy is connected: the pod would have no proxy")
            host = self._host()
            added_ips: list[str] = []
            waiters: list[tuple[ProxyConn, Waiter]] = []
            try:
                identity.write(pod.netns, pod.record())
                api.setup(pod.netns, pod.config, pod.backend)
                if self.opts.host_rules and pod.ips:
                    try:
                        added_ips = node.add_pods(pod.ips, host, owner=pod.uid)
                    except SetupError:  # the node sets went away since the start: put them back once
                        node.setup_node(host)
                        added_ips = node.add_pods(pod.ips, host, owner=pod.uid)
                with self.lock:
                    self.pods[pod.uid] = pod
                    self.metrics.set("pods_enrolled", len(self.pods))
                    waiters = [(c, c.send_add(pod)) for c in self.proxies]
                if not waiters:
                    raise EventError("no_proxy", "no node proxy is connected")
                errors = self._wait_all(waiters)
                if errors:
                    raise EventError("proxy", "node proxy did not take the pod: " + "; ".join(errors))
            except Exception as e:
                self._rollback(pod, added_ips)
                if isinstance(e, EventError):
                    raise
                if isinstance(e, RedirectError):
                    raise EventError("setup", str(e)) from None
                raise
        jlog(logging.INFO, "pod enrolled", pod=pod.uid, name=pod.name, namespace=pod.namespace, netns=pod.netns,
             ips=list(pod.ips), proxies=len(waiters), backend=pod.backend)
        return {"enrolled": True, "pod": pod.uid, "proxies": len(waiters)}

    def _rollback(self, pod: PodRecord, added_ips: list[str]) -> None:
        """Undo a failed add, whether or not the pod was enrolled before (the runtime retries or DELs)."""
        with self.lock:
            if self.pods.get(pod.uid) is pod:
                del self.pods[pod.uid]
            self.metrics.set("pods_enrolled", len(self.pods))
            conns = list(self.proxies)
        for c in conns:
            c.enqueue({"type": "del", "uid": pod.uid})
        for step in (lambda: api.teardown(pod.netns, pod.backend), lambda: identity.clear(pod.netns),
                     lambda: node.remove_pods(added_ips, self._host(), owner=pod.uid) if added_ips else None):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - report, keep undoing
                jlog(logging.ERROR, "rollback step failed", pod=pod.uid, error=str(e))

    def check(self, raw: Any) -> dict[str, Any]:
        """Whether the pod is enrolled in that netns, its rules are as recorded, and a proxy has it."""
        if not isinstance(raw, dict):
            raise EventError("bad_request", "pod: expected an object")
        uid = _text(raw, "uid", required=True, limit=128)
        path = _text(raw, "netns", limit=4096)
        with self.lock:
            rec = self.pods.get(uid)
            proxies = sum(1 for c in self.proxies if c.synced.is_set())
        if rec is None:
            raise EventError("check", f"pod {uid} is not enrolled on this node")
        if path and not _same_inode(path, rec.inode):
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
        uid = _text(raw, "uid", limit=128)
        path = _text(raw, "netns", limit=4096)
        cid = _text(raw, "container_id", limit=128)
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
            if netns_path is None and same and rec is not None and _same_inode(rec.netns, rec.inode):
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


def _same_inode(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


# --- CLI -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redirect-agent",
        description="Ambient node agent: enrols pods sent by redirect-cni (in-pod rules, node probe sets) and "
                    "hands their network namespaces to the node proxy. Restart-safe: state is read back from "
                    "the kernel. SIGTERM stops it and leaves redirection in place.")
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
    p.add_argument("--http-port", type=int, default=15995, help="port of the ops server; 0 = any (%(default)s)")
    p.add_argument("--workers", type=int, default=16, help="pod events handled at once (%(default)s)")
    p.add_argument("--proxy-timeout", type=float, default=5.0,
                   help="seconds to wait for the node proxy's ack of a pod (%(default)s)")
    p.add_argument("--capture", default="{}",
                   help="JSON object of RedirectConfig fields: the pods' base config before annotations")
    p.add_argument("--no-proc-scan", action="store_true", help="at start, look for pods under /run/netns only")
    p.add_argument("--resync-seconds", type=float, default=30.0,
                   help="while running, repair drifted rules and drop pods whose netns is gone this often; "
                        "0 = only at start (%(default)s)")
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
    return Options(events_socket=a.events_socket, proxy_socket=a.proxy_socket, backend=a.backend,
                   node_name=a.node_name, host_rules=not a.no_host_rules, host_netns=a.host_netns,
                   http_host=a.http_host, http_port=a.http_port, workers=a.workers, proxy_timeout=a.proxy_timeout,
                   capture=capture, scan_proc=not a.no_proc_scan, resync_seconds=a.resync_seconds)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from .. import logjson

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
