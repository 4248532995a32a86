"""``make demo``: set up capture in a real pod namespace and show the captured connections.

It creates a pod netns and a peer netns joined by a veth pair (IPv4 and IPv6), starts
two servers in the peer, installs Istio-default sidecar capture in the pod (excluding
one outbound port so you can see the difference), runs the small transparent proxy
from ``redirect.demo_proxy`` in the pod as uid 1337, sends traffic as an app (uid
1000) and from the peer. Next to it, an ambient pod: ambient rules, the same proxy as a
node proxy with SO_MARK 0x539 inside the pod netns, and its peer playing the node with
the kubelet-probe SNAT rules. It prints a table: where each connection was going,
which proxy port caught it, and which server answered (from which source). Then it
removes everything.

    python -m redirect.demo [--backend iptables|iptables-legacy|iptables-nft|nftables|ebpf|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import redirect
from redirect import netns
from redirect import node as node_rules

PROXY_UID = 1337
APP_UID = 1000
OUT_EXCLUDED = 9090
AMBIENT_MARK = 0x539


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def demo_namespaces(net: int) -> Iterator[tuple[str, str]]:
    """A pod netns and a peer netns joined by a veth: 10.<net>.0.2 / fd00:<net>::2 in the pod."""
    tag = uuid.uuid4().hex[:6]
    pod, peer = f"rdr-demo-pod-{tag}", f"rdr-demo-peer-{tag}"
    try:
        _ip("netns", "add", pod)
        _ip("netns", "add", peer)
        _ip("link", "add", f"rdd{tag}", "type", "veth", "peer", "name", f"rdp{tag}")
        _ip("link", "set", f"rdd{tag}", "netns", pod)
        _ip("link", "set", f"rdp{tag}", "netns", peer)
        for ns, dev, host in ((pod, f"rdd{tag}", 2), (peer, f"rdp{tag}", 1)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"10.{net}.0.{host}/24", "dev", "eth0")
            _ip("-n", ns, "addr", "add", f"fd00:{net}::{host}/64", "dev", "eth0", "nodad")
            _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", pod, "route", "add", "default", "via", f"10.{net}.0.1")
        _ip("-n", pod, "-6", "route", "add", "default", "via", f"fd00:{net}::1")
        yield pod, peer
    finally:
        for ns in (pod, peer):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


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


def _start_proxy(ns: str, ambient: bool = False) -> subprocess.Popen[str]:
    """The demo proxy in ``ns``: as uid 1337 (sidecar), or as root with SO_MARK 0x539 (ambient)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    who = ["--mark", hex(AMBIENT_MARK)] if ambient else []
    p = subprocess.Popen(
        ["ip", "netns", "exec", ns, *([] if ambient else _as_user(PROXY_UID)), sys.executable, "-m",
         "redirect.demo_proxy", "--max-seconds", "60", *who],
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


def _rows(pod_label: str, cases: list[Case], answers: list[str], seen: list[dict]) -> list[list[str]]:
    rows = []
    for (label, _ns, host, port, _uid), answer in zip(cases, answers, strict=True):
        dst = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        hit = next((s for s in seen if s["original_dst"] == f"{host}:{port}"), None)
        if hit is not None:
            seen.remove(hit)
        caught = f"proxy :{hit['captured_on']} ({hit['direction']})" if hit else "not captured"
        rows.append([pod_label, label, dst, caught, answer])
    return rows


def run(backend: str) -> int:
    sidecar = redirect.RedirectConfig(outbound_exclude_ports=(OUT_EXCLUDED,))
    ambient = redirect.RedirectConfig(mode="ambient")
    print(f"redirect demo: backend={backend}\n"
          f"  sidecar pod: Istio sidecar defaults + outbound_exclude_ports={OUT_EXCLUDED}, proxy as uid {PROXY_UID}\n"
          f"  ambient pod: Istio ambient defaults, node proxy in the pod netns with SO_MARK {AMBIENT_MARK:#x};\n"
          f"               its peer plays the node, with the kubelet-probe SNAT rules (redirect node setup)\n")
    rows: list[list[str]] = []
    with demo_namespaces(253) as (pod, peer), demo_namespaces(252) as (apod, node):
        proxies: list[subprocess.Popen[str]] = []
        try:
            # Proxies first: the eBPF backend hands the proxy's inbound listener to sk_lookup.
            proxy = _start_proxy(pod)
            proxies.append(proxy)
            aproxy = _start_proxy(apod, ambient=True)
            proxies.append(aproxy)
            with_ambient = True
            for ns, cfg in ((pod, sidecar), (apod, ambient)):
                try:
                    res = redirect.setup(ns, cfg, backend=backend)
                except redirect.BackendUnavailable as e:
                    if cfg.mode != "ambient":
                        raise
                    print(f"ambient pod skipped: {e}")
                    with_ambient = False
                    continue
                print(f"installed {cfg.mode} capture in netns {ns}: {res.backend}, "
                      f"{'+'.join(f'IPv{f}' for f in res.families)}; "
                      f"check: {'ok' if redirect.check(ns, cfg, backend=backend).ok else 'DRIFT'}")
            node_rules.setup_node(node)
            print(f"node rules in netns {node}: kubelet probes SNAT'd to {node_rules.PROBE_SNAT[4]} / "
                  f"{node_rules.PROBE_SNAT[6]}")
            side: list[Case] = [
                ("app (uid 1000) -> peer", pod, "10.253.0.1", 8080, APP_UID),
                ("app (uid 1000) -> peer", pod, "fd00:253::1", 8080, APP_UID),
                ("app (uid 1000) -> excluded port", pod, "10.253.0.1", OUT_EXCLUDED, APP_UID),
                ("proxy (uid 1337) -> peer", pod, "10.253.0.1", 8080, PROXY_UID),
                ("peer -> pod app port", peer, "10.253.0.2", 8000, None),
                ("peer -> pod app port", peer, "fd00:253::2", 8000, None),
            ]
            amb: list[Case] = [
                ("app -> peer", apod, "10.252.0.1", 8080, APP_UID),
                ("app -> peer", apod, "fd00:252::1", 8080, APP_UID),
                ("app -> peer (9090: all ports)", apod, "10.252.0.1", OUT_EXCLUDED, APP_UID),
                ("peer -> pod app port", node, "10.252.0.2", 8000, None),
                ("peer -> pod app port", node, "fd00:252::2", 8000, None),
                ("node (kubelet probe) -> app", node, "10.252.0.2", 8000, None),
            ]
            with Servers(peer, {8080: "peer-web:8080", OUT_EXCLUDED: f"peer-db:{OUT_EXCLUDED}"}), \
                    Servers(pod, {8000: "pod-app:8000"}), \
                    Servers(node, {8080: "peer-web:8080", OUT_EXCLUDED: f"peer-db:{OUT_EXCLUDED}"}), \
                    Servers(apod, {8000: "pod-app:8000"}):
                side_answers = [_client(ns, host, port, uid) for _label, ns, host, port, uid in side]
                if with_ambient:
                    # The node's connections are ordinary inbound until the pod's IP is in the probe set.
                    amb_answers = [_client(ns, host, port, uid) for _label, ns, host, port, uid in amb[:-1]]
                    node_rules.add_pods(["10.252.0.2", "fd00:252::2"], node, owner="demo-ambient-pod")
                    amb_answers.append(_client(node, "10.252.0.2", 8000, None))
                time.sleep(0.3)
            rows += _rows("sidecar", side, side_answers, _stop_proxy(proxy))
            if with_ambient:
                rows += _rows("ambient", amb, amb_answers, _stop_proxy(aproxy))
        finally:
            for p in proxies:
                _stop_proxy(p)
            with suppress(redirect.RedirectError):
                node_rules.teardown_node(node)
            redirect.teardown(pod, backend=backend)
            redirect.teardown(apod, backend=backend)
        print()
        print(_table(rows, ["pod", "connection", "original destination", "captured by", "answered by"]))
        print(f"\nteardown: done; namespaces {pod}, {peer}, {apod} and {node} removed.")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redirect.demo", description="redirect: a live capture demo")
    p.add_argument("--backend", default="iptables", help="iptables (default), nftables, ebpf, auto, ...")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("the demo needs root (it creates network namespaces)", file=sys.stderr)
        return 1
    try:
        return run(args.backend)
    except redirect.RedirectError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
