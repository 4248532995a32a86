"""redirect-nodeproxy and the messages its agent sends: a malformed one costs an error ack, never
the proxy (no root: the fake agent below never hands it a pod to serve); a pod is served without
touching its sysctls, and a handover moves the connections queued on the old proxy's listeners
(where ``bpf()`` is refused, the log says a handover may reset them)."""

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

# Two proxies serve one pod (the netns they run in) in turn: a connection queued on the old one's
# listener (nobody accepts it), the new one added, the old one's listeners closed: does the
# connection reach the new one's listener, or is it reset? With "no-bpf", under a seccomp filter
# that refuses bpf() (as a runtime's profile may), before either proxy is made.
_HANDOVER = """
import ctypes, io, os, select, socket, struct, sys
if sys.argv[1] == "no-bpf":
    filt = [(0x20, 0, 0, 0), (0x15, 0, 1, 321), (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7FFF0000)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *f) for f in filt))
    fprog = ctypes.create_string_buffer(struct.pack("<H6xQ", len(filt), ctypes.addressof(code)))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, fprog, 0, 0) == 0, ctypes.get_errno()
from redirect.ambient.nodeproxy import JsonLog, NodeProxy
logs = [io.StringIO(), io.StringIO()]
old, new = (NodeProxy("/nonexistent", JsonLog(o)) for o in logs)
pod = {"uid": "p1", "name": "a", "namespace": "b"}
own = lambda: os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
assert old.add_pod(pod, own()) is None
c = socket.create_connection(("127.0.0.1", 15008), timeout=5)
assert new.add_pod(pod, own()) is None
old.remove_pod("p1", "handover")
(lst,) = [s for s, kind, _ in new.pods["p1"].listeners if kind == "tunnel" and s.family == socket.AF_INET]
if select.select([lst], [], [], 2)[0]:
    a, _ = lst.accept()
    a.settimeout(5)
    c.sendall(b"x")
    out = "moved" if a.recv(1) == b"x" else "garbled"
else:
    c.settimeout(2)
    try:
        out = f"left: {c.recv(1)!r}"
    except OSError as e:
        out = f"lost: {e.strerror}"
with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
    migrate = f.read().strip()
print(out + "|" + migrate)
for o in logs:
    sys.stdout.write(o.getvalue())
"""


def _in_own_netns(script: str, *args: str, read_only_proc_sys: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """``script`` run in a netns and mount namespace of its own (``/proc/sys`` read-only if asked,
    as a runtime mounts it in an unprivileged container): its first line, then its JSON log lines."""
    prep = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys" if read_only_proc_sys \
        else "true"
    p = subprocess.run(["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c",
                        f'ip link set lo up && {prep} && exec "$@"', "sh", sys.executable, "-c", script, *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    first, *log = p.stdout.splitlines()
    return first, [json.loads(line) for line in log]


@pytest.mark.parametrize("proc_sys", ["writable", "read-only"])
def test_a_pod_is_served_and_the_pods_sysctls_are_left_alone(tmp_path: Path, proc_sys: str) -> None:
    """Served through the agent protocol whether or not ``/proc/sys`` is writable, and the pod's
    ``net.ipv4.tcp_migrate_req`` is never touched (it would change the app's listeners too)."""
    first, events = _in_own_netns(_SERVE_OWN_NETNS, str(tmp_path / "proxy.sock"),
                                  read_only_proc_sys=proc_sys == "read-only")
    added = [e for e in events if e["event"] == "pod_added"]
    assert len(added) == 1 and added[0]["pod"] == "p1", events
    assert first == "True 0" and not [e for e in events if e["event"] == "no_handover"], (first, events)


@pytest.mark.parametrize("case", ["writable", "read-only", "no-bpf"])
def test_a_handover_moves_the_connections_queued_on_the_old_proxys_listener(case: str) -> None:
    """A new proxy beside the old one, then the old one's listeners closed: the connection queued on
    them reaches the new one's listener (their reuseport group's program moves it), with
    ``net.ipv4.tcp_migrate_req`` still 0 and a read-only ``/proc/sys`` alike. Where ``bpf()`` is
    refused, both proxies serve the pod, each logs ``no_handover`` saying why, and the queued
    connection is reset, as the log warns."""
    first, events = _in_own_netns(_HANDOVER, case, read_only_proc_sys=case != "writable")
    out, migrate = first.split("|")
    assert migrate == "0", first
    no_handover = [e for e in events if e["event"] == "no_handover"]
    assert len([e for e in events if e["event"] == "pod_added"]) == 2, events
    if case == "no-bpf":
        assert out == "lost: Connection reset by peer", first
        assert len(no_handover) == 2 and all(e["level"] == "warning" for e in no_handover), events
        assert "SK_REUSEPORT migration program: Operation not permitted" in no_handover[0]["error"], no_handover
    else:
        assert out == "moved" and not no_handover, (first, events)
