"""A small transparent TCP proxy for the demo (and anyone who wants to see capture work).

It listens on the outbound and inbound capture ports inside the current netns, reads
each connection's original destination (``SO_ORIGINAL_DST`` / ``IP6T_SO_ORIGINAL_DST``,
or the local address for TPROXY listeners), connects onward to it and pipes bytes
both ways, printing one JSON line per connection on stdout. Run it as the proxy uid
(1337) so its own connections are not captured again; inbound connections are made
from 127.0.0.6 / ::6 as Istio's inbound passthrough does.

    python -m demo.proxy --outbound 15001 --inbound 15006 [--max-seconds 60]
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import threading
import time

from redirect.config import int_arg, seconds_arg
from redirect.relay import IP_TRANSPARENT, IPV6_TRANSPARENT, SOL_IPV6, original_dst, pump


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
        record["bytes"] = sum(pump(conn, up, idle_timeout=10, deadline=time.monotonic() + 10))
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
            s.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        else:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    except PermissionError:
        pass
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    s.listen(128)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.proxy", description=__doc__.splitlines()[0])
    p.add_argument("--outbound", type=int_arg(1, 65535), default=15001)
    p.add_argument("--inbound", type=int_arg(1, 65535), default=15006)
    p.add_argument("--max-seconds", type=seconds_arg(0, 86400), default=120,
                   help="exit after this long (bounded by design)")
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
