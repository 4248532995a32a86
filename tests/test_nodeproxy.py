"""redirect-nodeproxy and the messages its agent sends: a malformed one costs an error ack, never
the proxy (no root: the fake agent below never hands it a pod to serve)."""

from __future__ import annotations

import io
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from redirect.ambient.agent import protocol
from redirect.ambient.nodeproxy import JsonLog, NodeProxy

pytestmark = pytest.mark.noroot

MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"type": "add", "pod": "p1"}, "pod: expected an object"),
    ({"type": "add", "pod": {"uid": "../x"}}, "pod.uid: not a pod uid"),
    ({"type": "add", "pod": {"uid": ["p1"]}}, "pod.uid: not a pod uid"),
    ({"type": "add", "pod": {"uid": "p1", "name": {"a": 1}}}, "pod.name: expected a string"),
    ({"type": "add", "pod": {"uid": "p1", "namespace": "n" * 300}}, "pod.namespace: expected a string"),
    ({"type": "del", "uid": [1]}, "uid: not a pod uid"),
    ({"type": "del"}, "uid: not a pod uid"),
    ({"type": "snapshot_done", "pods": {"p1": 1}}, "pods: expected a list"),
    ({"type": "snapshot_done", "pods": [["p1"]]}, "pods: not a pod uid"),
]


def test_a_malformed_agent_message_is_answered_with_an_error_and_the_proxy_goes_on(tmp_path: Path) -> None:
    path = str(tmp_path / "proxy.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    lsock.bind(path)
    lsock.listen(1)
    lsock.settimeout(10)
    out = io.StringIO()
    proxy = NodeProxy(path, JsonLog(out))
    t = threading.Thread(target=proxy.run, daemon=True)
    t.start()
    conn = None
    try:
        conn, _ = lsock.accept()
        conn.settimeout(10)
        hello = protocol.recv(conn, max_fds=0)
        assert hello is not None and hello[0]["type"] == "hello"
        nsfd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)  # an add's netns fd, never entered
        try:
            for i, (msg, error) in enumerate(MALFORMED):
                protocol.send(conn, {**msg, "id": i}, fds=(nsfd,) if msg["type"] == "add" else ())
                got = protocol.recv(conn, max_fds=0)
                assert got is not None, f"the proxy closed the connection on {msg}"
                ack = got[0]
                assert (ack["type"], ack["id"], ack["ok"]) == ("ack", i, False), ack
                assert error in ack["error"], ack
        finally:
            os.close(nsfd)
        # Still serving the agent: a good message is acked.
        protocol.send(conn, {"type": "snapshot_done", "pods": [], "id": "last"})
        got = protocol.recv(conn, max_fds=0)
        assert got is not None and got[0]["id"] == "last" and got[0]["ok"] is True
        assert t.is_alive()
        assert '"bad_message"' in out.getvalue()
    finally:
        proxy.shutdown()
        t.join(10)
        if conn is not None:
            conn.close()
        lsock.close()
    assert not t.is_alive()
