"""The agent's two wire protocols: one JSON object per ``SOCK_SEQPACKET`` message.

Both sockets are unix ``SOCK_SEQPACKET``: the kernel keeps message boundaries, so a
message is exactly one UTF-8 JSON object (no length prefix, no delimiter) carrying
``"v": 1`` and a ``"type"``. File descriptors travel as ``SCM_RIGHTS`` ancillary data
of the message they belong to. See docs/agent-protocol.md for every message.

This module is imported by the CNI plugin on every ADD/DEL, so it stays small:
stdlib only.
"""

from __future__ import annotations

import array
import json
import os
import re
import socket
import time
from typing import Any

VERSION = 1
MAX_MESSAGE = 64 * 1024  # bytes; a pod's annotations are the only large part
DEFAULT_EVENTS_SOCKET = "/run/redirect/agent.sock"
DEFAULT_PROXY_SOCKET = "/run/redirect/nodeproxy.sock"

#: pod uid (ipset comments and our logs carry it, so: no quotes, no spaces)
UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class ProtocolError(Exception):
    """A peer sent something that is not a message of this protocol."""


def encode(msg: dict[str, Any], check: bool = True) -> bytes:
    data = json.dumps({"v": VERSION, **msg}, separators=(",", ":"), sort_keys=True).encode()
    if check and len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes is larger than the limit of {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"not a JSON message: {e}") from None
    except RecursionError:
        raise ProtocolError("not a message of this protocol: JSON nested too deep") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"v={msg.get('v')!r}: this side speaks version {VERSION}")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError("type: missing or not a string")
    return msg


def send(sock: socket.socket, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = encode(msg)
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def recv(sock: socket.socket, max_fds: int = 1) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the fds that came with it (the caller owns them); None at EOF."""
    fds = array.array("i")
    data, anc, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(max_fds * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    got = list(fds)
    if not data and not anc:
        return None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError("message or its file descriptors were truncated")
        return decode(data), got
    except ProtocolError:
        for fd in got:
            os.close(fd)
        raise


def request(path: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request to the agent's events socket and wait (at most ``timeout`` s) for its result.

    Raises ``OSError`` (incl. ``TimeoutError``) when the agent is not there or does not
    answer in time, ``ProtocolError`` when the answer is not ours.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        send(s, msg)
        s.settimeout(max(deadline - time.monotonic(), 0.001))
        got = recv(s, max_fds=0)
    if got is None:
        raise ConnectionResetError(f"the agent at {path} closed the connection without answering")
    return got[0]


__all__ = ["VERSION", "MAX_MESSAGE", "DEFAULT_EVENTS_SOCKET", "DEFAULT_PROXY_SOCKET", "UID_RE", "ProtocolError",
           "encode", "decode", "send", "recv", "request"]
