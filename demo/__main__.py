"""``make demo``: set up capture in real pod namespaces and show the captured connections.

Sidecar: a pod netns and a peer netns joined by a veth pair (IPv4 and IPv6), servers in
the peer, Istio-default sidecar capture in the pod (one outbound port excluded so you
can see the difference), and the small transparent proxy from ``demo.proxy``
in the pod as uid 1337. Ambient: a pod whose peer netns is the node, running
``redirect-agent`` (node probe rules in the node netns) and the reference node proxy
``redirect-nodeproxy``; the pod is enrolled through the agent as the CNI plugin would,
and a remote netns sits behind the node. Traffic goes both ways as an app (uid 1000),
as the proxy, from the peer/remote and as a kubelet probe from the node; the table
shows where each connection was going, which proxy port caught it, and which server
answered (from which source). Then it removes everything (on ebpf, the host programs too:
they go to a bpffs root of the demo's own).

    python -m demo [--backend iptables|iptables-legacy|iptables-nft|nftables|ebpf|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import redirect
from redirect.ambient import node as node_rules
from redirect.kernel import netns, podkit

PROXY_UID = 1337
APP_UID = 1000
OUT_EXCLUDED = 9090
AMBIENT_MARK = 0x539


def _link(net: int, pod_if: str = "eth0", peer_if: str = "eth0") -> podkit.Link:
    """10.<net>.0.2 / fd00:<net>::2 on the pod's side, .1 / ::1 on the peer's."""
    return podkit.Link(pod_if, peer_if, f"10.{net}.0.2", f"10.{net}.0.1", f"fd00:{net}::2", f"fd00:{net}::1")


@contextmanager
def demo_namespaces(net: int) -> Iterator[tuple[str, str]]:
    """A pod netns and a peer netns joined by a veth: 10.<net>.0.2 / fd00:<net>::2 in the pod."""
    tag = f"{os.getpid()}-{net}"  # (the pid: whoever runs the demo can tell its namespaces from others')
    pod, peer = f"rdr-demo-pod-{tag}", f"rdr-demo-peer-{tag}"
    with podkit.make_pod(pod, peer, [_link(net)], peer_routes_back=False):
        yield pod, peer


@contextmanager
def remote_behind(node: str, net: int) -> Iterator[str]:
    """A netns routed through ``node`` (10.<net>.0.2 / fd00:<net>::2): a workload elsewhere."""
    remote = f"rdr-demo-remote-{os.getpid()}-{net}"
    with podkit.make_pod(remote, node, [_link(net, peer_if="eth1")], make_peer=False, peer_routes_back=False):
        for key in ("net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"):
            subprocess.run(["ip", "netns", "exec", node, "sysctl", "-qw", f"{key}=1"], check=True,
                           capture_output=True)
        yield remote


def _wait_json_line(path: str, pred: Callable[[dict], bool], proc: subprocess.Popen[bytes], what: str,
                    timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with suppress(FileNotFoundError), open(path) as f:
            for line in f:
                with suppress(ValueError):
                    if pred(json.loads(line)):
                        return
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}); see {path}")
        time.sleep(0.05)
    raise SystemExit(f"{what} not ready after {timeout} s; see {path}")


@contextmanager
def node_agent(node: str, backend: str, workdir: str) -> Iterator[tuple[str, str]]:
    """``redirect-agent`` for the node netns ``node`` and the reference ``redirect-nodeproxy``.

    Yields the agent's events socket and the node proxy's JSON log. Both are stopped with
    SIGTERM at the end (which leaves redirection in place: the demo deletes its pod first).
    """
    events, proxy_sock = f"{workdir}/agent.sock", f"{workdir}/nodeproxy.sock"
    agent_log, proxy_log = f"{workdir}/agent.log", f"{workdir}/nodeproxy.log"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(agent_log, "wb") as f:
            agent = subprocess.Popen(
                [sys.executable, "-m", "redirect.ambient.agent.daemon", "--events-socket", events, "--proxy-socket",
                 proxy_sock, "--host-netns", node, "--node-name", f"demo-{node}", "--backend", backend,
                 "--http-port", "0", "--no-proc-scan", "--resync-seconds", "0"],
                stdout=subprocess.DEVNULL, stderr=f, env=env)
        procs.append(agent)
        _wait_json_line(agent_log, lambda e: e.get("msg") == "agent ready", agent, "redirect-agent")
        proxy = subprocess.Popen([sys.executable, "-m", "redirect.ambient.nodeproxy", "--socket", proxy_sock,
                                  "--log-file", proxy_log, "--name", "demo"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        procs.append(proxy)
        _wait_json_line(proxy_log, lambda e: e.get("event") == "snapshot_done", proxy, "redirect-nodeproxy")
        yield events, proxy_log
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


class Servers:
    """Plain servers in a netns that answer each connection with their name."""

    def __init__(self, ns: str, ports: dict[int, str]) -> None:
        self.ns, self.ports = ns, ports
        self.stop = threading.Event()
        self.ready = threading.Barrier(len(ports) * 2 + 1, timeout=10)
        self.threads = [threading.Thread(target=self._serve, args=(fam, p, n), daemon=True)
                        for p, n in ports.items() for fam in (socket.AF_INET, socket.AF_INET6)]

    def _serve(self, fam: int, port: int, name: str) -> None:
        with netns.enter(self.ns):
            s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", port))
        s.listen(16)
        s.settimeout(0.3)
        self.ready.wait()
        with s:
            while not self.stop.is_set():
                try:
                    c, _ = s.accept()
                except TimeoutError:
                    continue
                with c:
                    c.settimeout(2)
                    src = c.getpeername()[0]
                    with suppress(OSError):
                        c.recv(256)
                        c.sendall(f"{name} (from {src})\n".encode())

    def __enter__(self) -> Servers:
        for t in self.threads:
            t.start()
        self.ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)


_CLIENT = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.create_connection((host, port), timeout=3)
    s.sendall(b"hello\n")
    print(s.recv(256).decode().strip() or "(no answer)")
except OSError as e:
    print(f"error: {e.strerror or e}")
"""


def _as_user(uid: int | None) -> list[str]:
    """Drop to ``uid`` (and the same gid) after ``ip netns exec`` entered the namespace."""
    return [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _client(ns: str, host: str, port: int, uid: int | None) -> str:
    """Connect from inside ``ns`` as ``uid``; the server's answer (or the error)."""
    cmd = ["ip", "netns", "exec", ns, *_as_user(uid), sys.executable, "-S", "-c", _CLIENT, host, str(port)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    return (p.stdout.strip() or p.stderr.strip() or "?").splitlines()[-1]


def _start_proxy(ns: str) -> subprocess.Popen[str]:
    """The demo proxy in ``ns``, as uid 1337."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen(
        ["ip", "netns", "exec", ns, *_as_user(PROXY_UID), sys.executable, "-m",
         "demo.proxy", "--max-seconds", "60"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    if '"ready"' not in line:
        p.kill()
        raise SystemExit(f"demo proxy did not start: {line!r}")
    return p


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


Case = tuple[str, str, str, int, "int | None"]  # label, client netns, host, port, uid


def _stop_proxy(proxy: subprocess.Popen[str]) -> list[dict]:
    """Stop the demo proxy; the connections it logged."""
    out = ""
    if proxy.poll() is None:
        with suppress(OSError, subprocess.TimeoutExpired):
            proxy.stdin.write("quit\n")  # type: ignore[union-attr]
            proxy.stdin.flush()  # type: ignore[union-attr]
            out, _ = proxy.communicate(timeout=10)
    if proxy.poll() is None:
        proxy.kill()
        proxy.wait(5)
    return [json.loads(x) for x in out.splitlines() if x.startswith("{") and "direction" in x]


def _answers(cases: list[Case]) -> list[str]:
    return [_client(ns, host, port, uid) for _label, ns, host, port, uid in cases]


def _caught(cases: list[Case], seen: list[dict], orig_of: Callable[[dict], str],
            where: Callable[[dict], str]) -> list[str]:
    """Per case, where a proxy caught it (``where`` of the proxy's record whose original
    destination, ``orig_of``, is the case's ``host:port``) or "not captured"; a record answers
    one case."""
    out = []
    for _label, _ns, host, port, _uid in cases:
        hit = next((x for x in seen if orig_of(x) == f"{host}:{port}"), None)
        if hit is not None:
            seen.remove(hit)
        out.append(where(hit) if hit is not None else "not captured")
    return out


def _rows(rows: list[list[str]], pod: str, cases: list[Case], caught: list[str], answers: list[str]) -> None:
    for (label, _ns, host, port, _uid), where, answer in zip(cases, caught, answers, strict=True):
        rows.append([pod, label, _dst(host, port), where, answer])


def _sidecar(backend: str, rows: list[list[str]]) -> None:
    cfg = redirect.RedirectConfig(outbound_exclude_ports=(OUT_EXCLUDED,))
    with demo_namespaces(253) as (pod, peer):
        # The proxy first: the eBPF backend hands its inbound listener to sk_lookup.
        proxy = _start_proxy(pod)
        try:
            res = redirect.setup(pod, cfg, backend=backend)
            print(f"sidecar pod {pod}: capture installed ({res.backend}, "
                  f"{'+'.join(f'IPv{f}' for f in res.families)}); "
                  f"check: {'ok' if redirect.check(pod, cfg, backend=backend).ok else 'DRIFT'}")
            cases: list[Case] = [
                ("app (uid 1000) -> peer", pod, "10.253.0.1", 8080, APP_UID),
                ("app (uid 1000) -> peer", pod, "fd00:253::1", 8080, APP_UID),
                ("app (uid 1000) -> excluded port", pod, "10.253.0.1", OUT_EXCLUDED, APP_UID),
                ("proxy (uid 1337) -> peer", pod, "10.253.0.1", 8080, PROXY_UID),
                ("peer -> pod app port", peer, "10.253.0.2", 8000, None),
                ("peer -> pod app port", peer, "fd00:253::2", 8000, None),
            ]
            with Servers(peer, {8080: "peer-web:8080", OUT_EXCLUDED: f"peer-db:{OUT_EXCLUDED}"}), \
                    Servers(pod, {8000: "pod-app:8000"}):
                answers = _answers(cases)
                time.sleep(0.3)
            seen = _stop_proxy(proxy)
            caught = _caught(cases, seen, lambda x: x["original_dst"],
                             lambda x: f"proxy :{x['captured_on']} ({x['direction']})")
            _rows(rows, "sidecar", cases, caught, answers)
        finally:
            _stop_proxy(proxy)
            redirect.teardown(pod, backend=backend)


def _ambient(backend: str, rows: list[list[str]]) -> None:
    from redirect.ambient.agent.client import AgentError, add_pod, del_pod

    cfg = redirect.RedirectConfig(mode="ambient")
    with demo_namespaces(252) as (pod, node), remote_behind(node, 251) as remote, \
            tempfile.TemporaryDirectory(prefix="rdr-demo-") as work, node_agent(node, backend, work) as (events, plog):
        try:
            add_pod(events, uid="demo-ambient-pod", netns=f"/run/netns/{pod}", name="app", namespace="demo",
                    ips=["10.252.0.2", "fd00:252::2"], config=cfg.to_dict(), backend=backend, timeout=20)
        except AgentError as e:
            print(f"ambient pod skipped: the agent refused it ({e.reason}): {e}")
            return
        try:
            print(f"ambient pod {pod}: enrolled by redirect-agent (in-pod rules, node probe set in {node}, "
                  f"netns handed to redirect-nodeproxy); check: "
                  f"{'ok' if redirect.check(pod, cfg, backend=backend).ok else 'DRIFT'}")
            cases: list[Case] = [
                ("app -> remote", pod, "10.251.0.2", 8080, APP_UID),
                ("app -> remote", pod, "fd00:251::2", 8080, APP_UID),
                ("app -> remote (9090: all ports)", pod, "10.251.0.2", OUT_EXCLUDED, APP_UID),
                ("remote -> pod app port", remote, "10.252.0.2", 8000, None),
                ("remote -> pod app port", remote, "fd00:252::2", 8000, None),
                ("node (kubelet probe) -> app", node, "10.252.0.2", 8000, None),
                ("node (kubelet probe) -> app", node, "fd00:252::2", 8000, None),
            ]
            with Servers(remote, {8080: "remote-web:8080", OUT_EXCLUDED: f"remote-db:{OUT_EXCLUDED}"}), \
                    Servers(pod, {8000: "pod-app:8000"}):
                answers = _answers(cases)
                time.sleep(0.3)
        finally:
            del_pod(events, uid="demo-ambient-pod", timeout=20)
        left = node_rules.list_pods(node)
        print(f"ambient pod deleted through the agent: in-pod rules "
              f"{'left behind!' if redirect.show(pod, backend=backend).get('installed') else 'removed'}, "
              f"node probe set {'still has ' + str(sorted(left)) if left else 'empty'}")
        with open(plog) as f:
            seen = [e for e in map(json.loads, f) if e.get("event") == "forward"]
        caught = _caught(cases, seen, lambda e: "{}:{}".format(*e.get("orig_dst") or ("", "")),
                         lambda e: f"node proxy :{_PORT_OF[e['kind']]} ({e['kind']})")
        _rows(rows, "ambient", cases, caught, answers)


_PORT_OF = {"outbound": 15001, "inbound": 15006, "tunnel": 15008}


def _dst(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run(backend: str) -> int:
    print(f"redirect demo: backend={backend}\n"
          f"  sidecar pod: Istio sidecar defaults + outbound_exclude_ports={OUT_EXCLUDED}; the demo proxy runs in\n"
          f"               the pod as uid {PROXY_UID}; its peer netns stands for the rest of the network\n"
          f"  ambient pod: Istio ambient defaults; its peer netns is the node, running redirect-agent and the\n"
          f"               reference node proxy (redirect-nodeproxy, SO_MARK {AMBIENT_MARK:#x}); a remote netns\n"
          f"               sits behind the node\n")
    rows: list[list[str]] = []
    _sidecar(backend, rows)
    _ambient(backend, rows)
    print()
    print(_table(rows, ["pod", "connection", "original destination", "captured by", "answered by"]))
    print("\nteardown: done; every namespace, rule and process of the demo removed.")
    return 0


@contextmanager
def own_bpf_root() -> Iterator[None]:
    """The eBPF backend's host programs go to a root of the demo's own, removed at the end, so a
    demo neither leaves programs attached nor touches the host's ``/sys/fs/bpf/redirect``.
    An explicit ``$REDIRECT_BPF_ROOT`` is used as it is (and left loaded)."""
    if os.environ.get("REDIRECT_BPF_ROOT"):
        yield
        return
    root = f"/sys/fs/bpf/rdr-demo-{os.getpid()}"
    os.environ["REDIRECT_BPF_ROOT"] = root  # inherited by redirect-agent
    try:
        yield
    finally:
        del os.environ["REDIRECT_BPF_ROOT"]
        if os.path.exists(root):
            from redirect.backends import ebpf

            ebpf.force_unload_host(root)  # the demo's pods are torn down by now; force covers a failed one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo", description="redirect: a live capture demo")
    p.add_argument("--backend", default="iptables", help="iptables (default), nftables, ebpf, auto, ...")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("the demo needs root (it creates network namespaces)", file=sys.stderr)
        return 1
    try:
        with own_bpf_root():
            return run(args.backend)
    except redirect.RedirectError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
