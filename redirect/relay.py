"""The forwarding core of our TCP proxies (``redirect.ambient.nodeproxy``, ``demo.proxy``).

A captured connection arrives at a proxy's listener; ``original_dst`` says where it was
going, the proxy connects there and ``pump`` copies bytes both ways until both sides
are done. The socket options the stdlib does not name are here too, once.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import time

# Linux uapi values the socket module does not name.
SO_ORIGINAL_DST = 80  # on SOL_IP; IP6T_SO_ORIGINAL_DST is the same number on SOL_IPV6
SO_MARK = 36
IP_TRANSPARENT = 19
IPV6_TRANSPARENT = 75
SOL_IPV6 = socket.IPPROTO_IPV6  # 41; the socket module has no SOL_IPV6

Addr = tuple[str, int]
_BUF = 65536


def original_dst(sock: socket.socket) -> Addr | None:
    """The pre-NAT destination of an accepted TCP connection (``SO_ORIGINAL_DST`` /
    ``IP6T_SO_ORIGINAL_DST``), or None when the kernel has none.

    The kernel answers from the connection's conntrack entry; without one (no NAT, or
    conntrack not active in the netns) the call fails and this returns None.
    """
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(SOL_IPV6, SO_ORIGINAL_DST, 28)
            port, addr = struct.unpack_from("!2xH4x16s", raw)
            return socket.inet_ntop(socket.AF_INET6, addr), port
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, addr = struct.unpack_from("!2xH4s", raw)
        return socket.inet_ntop(socket.AF_INET, addr), port
    except OSError:
        return None


def pump(a: socket.socket, b: socket.socket, idle_timeout: float, deadline: float | None = None) -> tuple[int, int]:
    """Copy bytes both ways until both sides have closed (a side's EOF is passed on as a
    half-close), nothing moved for ``idle_timeout`` seconds, or ``time.monotonic()`` passed
    ``deadline``. Returns (bytes a->b, bytes b->a). Leaves both sockets open, non-blocking."""
    counts = [0, 0]
    a.setblocking(False)
    b.setblocking(False)
    open_dirs = {0: (a, b), 1: (b, a)}
    sel = selectors.DefaultSelector()
    try:
        sel.register(a, selectors.EVENT_READ, 0)
        sel.register(b, selectors.EVENT_READ, 1)
        while open_dirs:
            wait = idle_timeout
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    break
            ready = sel.select(timeout=wait)
            if not ready:
                break
            for key, _ in ready:
                d = key.data
                src, dst = open_dirs[d]
                try:
                    data = src.recv(_BUF)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    dst.setblocking(True)
                    dst.settimeout(idle_timeout)
                    dst.sendall(data)
                    dst.setblocking(False)
                    counts[d] += len(data)
                else:
                    sel.unregister(src)
                    del open_dirs[d]
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
    finally:
        sel.close()
    return counts[0], counts[1]


__all__ = ["SO_ORIGINAL_DST", "SO_MARK", "IP_TRANSPARENT", "IPV6_TRANSPARENT", "SOL_IPV6", "original_dst", "pump"]
