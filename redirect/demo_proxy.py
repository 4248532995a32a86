"""A small transparent TCP proxy for the demo (and anyone who wants to see capture work).

It listens on the outbound and inbound capture ports inside the current netns, reads
each connection's original destination (``SO_ORIGINAL_DST`` / ``IP6T_SO_ORIGINAL_DST``,
or the local address for TPROXY listeners), connects onward to it and pipes bytes
both ways, printing one JSON line per connection on stdout. Run it as the proxy uid
(1337) so its own connections are not captured again; inbound connections are made
from 127.0.0.6 / ::6 as Istio's inbound passthrough does.

    python -m redirect.demo_proxy --outbound 15001 --inbound 15006 [--max-seconds 60]
"""

from __future__ import annotations

import argparse
import json
import select
import selectors
import socket
import struct
import sys
import threading
import time

SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
SOL_IPV6 = 41


def original_dst(sock: socket.socket) -> tuple[str, int] | None:
    """The pre-NAT destination of an accepted connection, or None without NAT."""
    try:
        if sock.family == socket.AF_INET:
            raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port, addr = struct.unpack("!2xH4s8x", raw)
            return socket.inet_ntop(socket.AF_INET, addr), port
        raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)
        port = struct.unpack("!H", raw[2:4])[0]
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    except OSError:
        return None


def _pipe(a: socket.socket, b: socket.socket, deadline: float) -> int:
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    total = 0
    open_ = 2
    try:
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                dst: socket.socket = key.data
                data = src.recv(65536)
                if not data:
                    sel.unregister(src)
                    open_ -= 1
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    continue
                dst.sendall(data)
                total += len(data)
    finally:
        sel.close()
    return total


def _handle(conn: socket.socket, peer: tuple, direction: str, listen_port: int, lock: threading.Lock) -> None:
    orig = original_dst(conn)
    if orig is None or orig[1] == listen_port:
        local = conn.getsockname()
        orig = (local[0], local[1])  # TPROXY: the local address is the original destination
    record = {"direction": direction, "client": f"{peer[0]}:{peer[1]}", "original_dst": f"{orig[0]}:{orig[1]}",
              "captured_on": listen_port}
    up = None
    try:
        up = socket.socket(conn.family, socket.SOCK_STREAM)
        up.settimeout(3)
        if direction == "inbound":
            up.bind(("127.0.0.6" if conn.family == socket.AF_INET else "::6", 0))
        up.connect(orig)
        up.settimeout(None)
        record["upstream"] = "connected"
        record["bytes"] = _pipe(conn, up, time.monotonic() + 10)
    except OSError as e:
        record["upstream"] = f"failed: {e.strerror or e}"
    finally:
        conn.close()
        if up is not None:
            up.close()
    with lock:
        print(json.dumps(record), flush=True)


def _serve(sock: socket.socket, direction: str, port: int, stop: threading.Event, lock: threading.Lock) -> None:
    sock.settimeout(0.5)
    while not stop.is_set():
        try:
            conn, peer = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=_handle, args=(conn, peer, direction, port, lock), daemon=True).start()


def _listener(family: int, port: int) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    # IP(V6)_TRANSPARENT lets TPROXY'd connections in; it needs CAP_NET_ADMIN, so it is
    # best effort (REDIRECT capture works without it).
    try:
        if family == socket.AF_INET6:
            s.setsockopt(SOL_IPV6, 75, 1)
        else:
            s.setsockopt(socket.SOL_IP, 19, 1)
    except PermissionError:
        pass
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    s.listen(128)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redirect.demo_proxy", description=__doc__.splitlines()[0])
    p.add_argument("--outbound", type=int, default=15001)
    p.add_argument("--inbound", type=int, default=15006)
    p.add_argument("--max-seconds", type=float, default=120, help="exit after this long (bounded by design)")
    args = p.parse_args(argv)
    stop = threading.Event()
    lock = threading.Lock()
    socks = []
    for port, direction in ((args.outbound, "outbound"), (args.inbound, "inbound")):
        for fam in (socket.AF_INET, socket.AF_INET6):
            try:
                s = _listener(fam, port)
            except OSError as e:
                print(json.dumps({"error": f"listen {port}: {e.strerror}"}), flush=True)
                continue
            socks.append(s)
            threading.Thread(target=_serve, args=(s, direction, port, stop, lock), daemon=True).start()
    print(json.dumps({"ready": True, "listeners": len(socks)}), flush=True)
    try:
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], 0.5)
            if ready:
                line = sys.stdin.readline()
                if line == "" or line.strip() == "quit":
                    break
    finally:
        stop.set()
        for s in socks:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
