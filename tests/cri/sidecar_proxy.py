"""A stand-in for a sidecar proxy (Envoy and its agent), the entrypoint of the CRI tests' proxy image.

The image is ours plus this file (``tests/crikit.py: derived_image``): it carries ``redirect``, as
a proxy image must for the ``redirect wait`` postStart hook that ``redirect inject
--hold-application`` writes. Standard library only; it runs as the injected proxy container's
user (1337) with no capabilities.

- 15001 (outbound) and 15006 (inbound): answers each connection with one line
  ``<listener> <original destination ip>:<port>`` (``SO_ORIGINAL_DST``), so the caller learns
  where its connection landed and where it was going;
- 15020 ``/healthz/ready`` (Istio's readiness URL): 503 until the file ``/tmp/ready`` exists, 200 after;
- every event is a JSON line on stdout (the container's log): ``{"event": "accept", ...}``,
  ``{"event": "ready-check", "status": ...}``.
"""

import http.server
import json
import os
import socket
import socketserver
import struct
import sys
import threading

SO_ORIGINAL_DST = 80
READY_FILE = "/tmp/ready"
_out = threading.Lock()


def emit(**event: object) -> None:
    with _out:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def original_dst(c: socket.socket) -> list[object] | None:
    try:
        raw = c.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port, addr = struct.unpack_from("!2xH4s", raw)
    return [socket.inet_ntoa(addr), port]


def serve(port: int, name: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, peer = s.accept()
        with c:
            c.settimeout(5)
            dst = original_dst(c)
            emit(event="accept", listener=name, peer=list(peer), orig_dst=dst)
            shown = f"{dst[0]}:{dst[1]}" if dst else "none"
            try:
                c.sendall(f"{name} {shown}\n".encode())
            except OSError:
                pass


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        status = 200 if self.path == "/healthz/ready" and os.path.exists(READY_FILE) else 503
        emit(event="ready-check", path=self.path, status=status)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    for port, name in ((15001, "outbound"), (15006, "inbound")):
        threading.Thread(target=serve, args=(port, name), daemon=True).start()
    emit(event="start", uid=os.getuid())
    Server(("0.0.0.0", 15020), Health).serve_forever()


if __name__ == "__main__":
    main()
