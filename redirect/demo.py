"""``make demo``: set up capture in a real pod namespace and show the captured connections.

It creates a pod netns and a peer netns joined by a veth pair (IPv4 and IPv6), starts
two servers in the peer, installs Istio-default sidecar capture in the pod (excluding
one outbound port so you can see the difference), runs the small transparent proxy
from ``redirect.demo_proxy`` in the pod as uid 1337, sends traffic as an app (uid
1000) and from the peer, and prints a table: where each connection was going, which
proxy port caught it, and which server answered. Then it removes everything.

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

PROXY_UID = 1337
APP_UID = 1000
OUT_EXCLUDED = 9090


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def demo_namespaces() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    pod, peer = f"rdr-demo-pod-{tag}", f"rdr-demo-peer-{tag}"
    try:
        _ip("netns", "add", pod)
        _ip("netns", "add", peer)
        _ip("link", "add", f"rdd{tag}", "type", "veth", "peer", "name", f"rdp{tag}")
        _ip("link", "set", f"rdd{tag}", "netns", pod)
        _ip("link", "set", f"rdp{tag}", "netns", peer)
        for ns, dev, v4, v6 in ((pod, f"rdd{tag}", "10.253.0.2/24", "fd00:253::2/64"),
                                (peer, f"rdp{tag}", "10.253.0.1/24", "fd00:253::1/64")):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "name", "eth0")
            _ip("-n", ns, "addr", "add", v4, "dev", "eth0")
            _ip("-n", ns, "addr", "add", v6, "dev", "eth0", "nodad")
            _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", pod, "route", "add", "default", "via", "10.253.0.1")
        _ip("-n", pod, "-6", "route", "add", "default", "via", "fd00:253::1")
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
                    with suppress(OSError):
                        c.recv(256)
                        c.sendall(f"{name}\n".encode())

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
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen(
        ["ip", "netns", "exec", ns, *_as_user(PROXY_UID), sys.executable, "-m", "redirect.demo_proxy",
         "--max-seconds", "60"],
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
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def run(backend: str) -> int:
    cfg = redirect.RedirectConfig(outbound_exclude_ports=(OUT_EXCLUDED,))
    print(f"redirect demo: backend={backend}, Istio sidecar defaults + outbound_exclude_ports={OUT_EXCLUDED}\n")
    with demo_namespaces() as (pod, peer):
        res = redirect.setup(pod, cfg, backend=backend)
        print(f"installed in netns {pod}: {res.backend}, {'+'.join(f'IPv{f}' for f in res.families)}; "
              f"check: {'ok' if redirect.check(pod, cfg, backend=backend).ok else 'DRIFT'}")
        proxy = _start_proxy(pod)
        rows: list[list[str]] = []
        try:
            with Servers(peer, {8080: "peer-web:8080", OUT_EXCLUDED: f"peer-db:{OUT_EXCLUDED}"}), \
                    Servers(pod, {8000: "pod-app:8000"}):
                cases = [
                    ("app (uid 1000) -> peer", pod, "10.253.0.1", 8080, APP_UID),
                    ("app (uid 1000) -> peer", pod, "fd00:253::1", 8080, APP_UID),
                    ("app (uid 1000) -> excluded port", pod, "10.253.0.1", OUT_EXCLUDED, APP_UID),
                    ("proxy (uid 1337) -> peer", pod, "10.253.0.1", 8080, PROXY_UID),
                    ("peer -> pod app port", peer, "10.253.0.2", 8000, None),
                    ("peer -> pod app port", peer, "fd00:253::2", 8000, None),
                ]
                answers = [_client(ns, host, port, uid) for _label, ns, host, port, uid in cases]
                time.sleep(0.3)
            proxy.stdin.write("quit\n")  # type: ignore[union-attr]
            proxy.stdin.flush()  # type: ignore[union-attr]
            out, _ = proxy.communicate(timeout=10)
            seen = [json.loads(x) for x in out.splitlines() if x.startswith("{") and "direction" in x]
            for (label, _ns, host, port, _uid), answer in zip(cases, answers, strict=True):
                dst = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                hit = next((s for s in seen if s["original_dst"] in (f"{host}:{port}",)), None)
                if hit is not None:
                    seen.remove(hit)
                caught = f"proxy :{hit['captured_on']} ({hit['direction']})" if hit else "not captured"
                rows.append([label, dst, caught, answer])
        finally:
            if proxy.poll() is None:
                proxy.kill()
                proxy.wait(5)
            redirect.teardown(pod, backend=backend)
        print()
        print(_table(rows, ["connection", "original destination", "captured by", "answered by"]))
        print(f"\nteardown: done; namespaces {pod} and {peer} removed.")
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
