"""redirect-nodeproxy and the messages its agent sends: a malformed one costs an error ack, never
the proxy (no root: the fake agent below never hands it a pod to serve); a pod whose
``/proc/sys`` it cannot write is served, and the log says its handover may reset connections."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from redirect.ambient.agent import protocol
from redirect.ambient.nodeproxy import JsonLog, NodeProxy

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


@pytest.mark.noroot
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


# A fake agent hands the proxy the netns it runs in (a private one) and waits for its ack; the proxy
# runs with /proc/sys read-only when asked (as a runtime mounts it in an unprivileged container).
_SERVE_OWN_NETNS = """
import io, os, socket, sys, threading
from redirect.ambient.agent import protocol
from redirect.ambient.nodeproxy import JsonLog, NodeProxy
path = sys.argv[1]
lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
lsock.bind(path); lsock.listen(1); lsock.settimeout(20)
out = io.StringIO()
proxy = NodeProxy(path, JsonLog(out))
t = threading.Thread(target=proxy.run, daemon=True); t.start()
conn, _ = lsock.accept(); conn.settimeout(20)
assert protocol.recv(conn, max_fds=0)[0]["type"] == "hello"
nsfd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
protocol.send(conn, {"type": "add", "pod": {"uid": "p1", "name": "a", "namespace": "b"}, "id": 1}, fds=(nsfd,))
ack = protocol.recv(conn, max_fds=0)[0]
with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
    migrate = f.read().strip()
proxy.shutdown(); t.join(10)
print(ack["ok"], migrate)
sys.stdout.write(out.getvalue())
"""


@pytest.mark.parametrize("proc_sys", ["writable", "read-only"])
def test_a_pod_is_served_with_or_without_the_handover_sysctl_and_the_log_says_which(tmp_path: Path,
                                                                                    proc_sys: str) -> None:
    prep = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys" if proc_sys == "read-only" \
        else "true"
    p = subprocess.run(["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c",
                        f'{prep} && exec "$@"', "sh", sys.executable, "-c", _SERVE_OWN_NETNS,
                        str(tmp_path / "proxy.sock")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    first, *log = p.stdout.splitlines()
    events = [json.loads(line) for line in log]
    added = [e for e in events if e["event"] == "pod_added"]
    assert len(added) == 1 and added[0]["pod"] == "p1", events
    no_handover = [e for e in events if e["event"] == "no_handover"]
    if proc_sys == "writable":
        assert first == "True 1" and not no_handover, (first, events)
    else:
        assert first == "True 0", first
        assert len(no_handover) == 1 and no_handover[0]["level"] == "warning", events
        assert "tcp_migrate_req" in no_handover[0]["error"] and "Read-only" in no_handover[0]["error"], no_handover
