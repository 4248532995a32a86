"""A pod's netns is what the agent opened once, never what its path names later.

A path (a CNI_NETNS, an event's ``netns``, an adopted ``/proc/<pid>/ns/net``) can name another
network namespace from one moment to the next: a symlink swapped, a name deleted and made again,
a pid reused. The agent opens the netns once per operation, checks it is the pod's (inode and
cookie), and does everything through that fd (rules, the proxies' fds, check); a path that no
longer names the pod's netns is "gone or replaced", and nothing is done there. Real agents,
proxies, namespaces and rules; every loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import redirect
from redirect.ambient.agent import client, protocol
from redirect.kernel import netns as rnetns
from tests import netkit
from tests.netkit import Pod, repoint, swapping
from tests.test_agent import Node, read_log, records_of, wait_log

pytestmark = pytest.mark.timeout(180)

AMBIENT = redirect.RedirectConfig(mode="ambient")


def captured(pod: Pod) -> bool:
    return bool(redirect.show(pod.name)["installed"])


@contextlib.contextmanager
def snapshot_proxy(path: str, timeout: float = 10.0, listed: list[str] | None = None) -> Iterator[dict[str, int]]:
    """A node proxy that says hello and acks its snapshot: yields uid -> the inode of the netns fd
    each ``add`` carried (closed once looked at), once ``snapshot_done`` came; the uids the
    snapshot listed (``snapshot_pods`` and ``snapshot_done``) go to ``listed``."""
    got: dict[str, int] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as p:
        p.settimeout(timeout)
        p.connect(path)
        protocol.send(p, {"type": "hello", "proxy": "snapshot", "pid": os.getpid()})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = protocol.recv(p, max_fds=1)
            assert m is not None, "the agent closed the connection"
            msg, fds = m
            for fd in fds:
                got[msg["pod"]["uid"]] = os.fstat(fd).st_ino
                os.close(fd)
            protocol.send(p, {"type": "ack", "id": msg["id"], "ok": True})
            if listed is not None and msg["type"] in ("snapshot_pods", "snapshot_done"):
                listed += msg["pods"]
            if msg["type"] == "snapshot_done":
                break
        else:
            raise AssertionError(f"no snapshot_done within {timeout} s")
        yield got


def test_check_and_snapshots_never_act_on_what_the_path_names_now(
        test_node: Node, make_pod: Callable[..., Pod], tmp_path: Path) -> None:
    """Pod a is enrolled at a symlink, pod b at its own path; the symlink then names b, and a's
    rules are flushed. ``check`` of a says its netns is gone or replaced (not b's intact rules), a
    proxy connecting now is never given b's netns for a, and a del of a leaves b captured."""
    n = test_node
    n.start_agent("--resync-seconds", "0")
    n.start_proxy()
    a, b = make_pod(), make_pod()
    link = tmp_path / "ns-link"
    os.symlink(a.path, link)
    client.add_pod(n.events, uid="uid-a", netns=str(link), ips=[a.pod_ip4])
    client.add_pod(n.events, uid="uid-b", netns=b.path, ips=[b.pod_ip4])
    assert client.check_pod(n.events, uid="uid-a")["pod"] == "uid-a"
    repoint(link, b.path)
    redirect.teardown(a.name)  # a's rules are gone: a check must say so, whatever the link names
    for netns in ("", str(link)):
        with pytest.raises(client.AgentError) as ei:
            client.check_pod(n.events, uid="uid-a", netns=netns)
        assert ei.value.reason == "check" and "gone or replaced" in str(ei.value), ei.value
    ino_a, ino_b = os.stat(a.path).st_ino, os.stat(b.path).st_ino
    with snapshot_proxy(n.proxy_sock) as got:
        assert got.get("uid-b") == ino_b and got.get("uid-a") in (None, ino_a), (got, ino_a, ino_b)
    client.del_pod(n.events, uid="uid-a")
    assert captured(b) and redirect.check(b.name, AMBIENT).ok
    assert client.check_pod(n.events, uid="uid-b", netns=b.path)["pod"] == "uid-b"
    client.del_pod(n.events, uid="uid-b", netns=b.path)
    assert not captured(a) and not captured(b)


def test_a_netns_name_made_again_is_not_the_pods_netns(test_node: Node, make_pod: Callable[..., Pod]) -> None:
    """``ip netns del X; ip netns add X`` while the old netns lives on (here: pinned under another
    name too): the pod's path names a new netns. A proxy connecting then is not handed the new
    netns as the pod's, ``check`` says the pod's netns is gone or replaced, and nothing is
    installed in the new one."""
    n = test_node
    n.start_agent("--resync-seconds", "0")
    n.start_proxy()
    a = make_pod()
    name = f"hag-{os.urandom(3).hex()}"
    path = f"{rnetns.NETNS_RUN_DIR}/{name}"
    try:
        Path(path).touch()
        subprocess.run(["mount", "--bind", a.path, path], check=True)  # a second name of pod a's netns
        client.add_pod(n.events, uid="uid-x", netns=path, ips=[a.pod_ip4])
        old = os.stat(a.path).st_ino
        subprocess.run(["umount", "-l", path], check=True)
        os.unlink(path)
        subprocess.run(["ip", "netns", "add", name], check=True)
        new = os.stat(path).st_ino
        assert new != old
        with snapshot_proxy(n.proxy_sock) as got:
            assert got.get("uid-x") in (None, old), (got, old, new)
        with pytest.raises(client.AgentError, match="gone or replaced"):
            client.check_pod(n.events, uid="uid-x")
        assert not redirect.show(name)["installed"] and captured(a)
        client.del_pod(n.events, uid="uid-x", netns=a.path)
        assert not captured(a)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["umount", "-l", path], capture_output=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_adds_at_a_path_swapped_between_two_pods_act_on_one_netns_each(
        test_node: Node, make_pod: Callable[..., Pod], tmp_path: Path) -> None:
    """A symlink swapped between two pods' netns as fast as the test can while the same pod is
    added through it (at most 20 adds, at most 60 s): each add puts the rules, the record and the
    proxy's listeners in one and the same netns, never the rules in one and the record in the other."""
    n = test_node
    n.start_agent("--resync-seconds", "0")
    n.start_proxy()
    a, b = make_pod(), make_pod()
    by_inode = {os.stat(p.path).st_ino: p for p in (a, b)}
    link = tmp_path / "ns-link"
    deadline = time.monotonic() + 60
    with swapping(link, (a.path, b.path), pause=0.0005):
        for i in range(20):
            if time.monotonic() > deadline:
                break
            client.add_pod(n.events, uid="uid-r", netns=str(link), ips=["10.250.0.1"])
            key, phase = records_of(n.name)["uid-r"]
            assert phase == "enrolled"
            pod = by_inode[key[0]]
            other = b if pod is a else a
            assert captured(pod) and not captured(other), i
            added = [e for e in read_log(n.proxy_log) if e["event"] == "pod_added" and e.get("pod") == "uid-r"]
            assert added and added[-1]["netns_inode"] == key[0], (i, added[-1:], key)
            client.del_pod(n.events, uid="uid-r", netns=pod.path)
            assert not captured(pod) and "uid-r" not in records_of(n.name)
            removed = time.monotonic() + 10
            while len([e for e in read_log(n.proxy_log)
                       if e["event"] == "pod_removed" and e.get("pod") == "uid-r"]) < i + 1:
                assert time.monotonic() < removed, "the proxy did not drop the pod"
                time.sleep(0.02)
    assert not captured(a) and not captured(b)


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from redirect.cni import install as inst

    d = str(tmp_path_factory.mktemp("cni-bin"))
    inst.install_binary(d)
    return d


def test_a_sidecar_request_naming_an_ambient_pods_netns_is_refused(
        bin_dir: str, make_pod: Callable[..., Pod], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod x is enrolled (ambient, through the thin plugin). A sidecar ADD, CHECK or DEL naming x's
    netns, by its path or another one (a symlink), is refused with 7 naming CNI_NETNS, and x's
    capture is as it was; the ambient DEL of x itself still works, and so does a sidecar pod."""
    from redirect.cni.netconf import convert_result
    from tests.test_cni_thin import Thin, agent_node, netconf

    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent()
        n.start_proxy()
        thin = Thin(bin_dir, n)
        x, y = make_pod(), make_pod()
        prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": x.path}],
                "ips": [{"address": f"{x.pod_ip4}/24", "interface": 0}]}
        ambient = netconf(n.events, prev=prev, mode="ambient")
        sidecar = netconf(n.events, prev=prev, mode="sidecar")
        args_x = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=x;K8S_POD_UID=uid-x"
        args_y = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=y;K8S_POD_UID=uid-y"
        assert thin("ADD", ambient, x.path, args=args_x)[0] == 0
        link = tmp_path / "x-link"
        os.symlink(x.path, link)
        shown = redirect.show(x.name)
        for command in ("DEL", "ADD", "CHECK"):
            for path in (x.path, str(link)):
                rc, out = thin(command, sidecar, path, args=args_y, container="ctr-y")
                assert rc == 1 and out is not None and out["code"] == 7, (command, path, out)
                assert "CNI_NETNS" in out["msg"] and "uid-x" in out["msg"], out
                assert redirect.show(x.name) == shown
                assert thin("CHECK", ambient, x.path, args=args_x) == (0, None), (command, path)
        # a sidecar pod elsewhere is served as ever
        assert thin("ADD", sidecar, y.path, args=args_y, container="ctr-y") == (0, convert_result(prev, "1.0.0"))
        assert captured(y)
        assert thin("DEL", sidecar, y.path, args=args_y, container="ctr-y") == (0, None)
        assert not captured(y)
        assert thin("DEL", ambient, x.path, args=args_x) == (0, None)
        assert not captured(x) and client.list_pods(n.events) == []


# --- a pod known by a /proc/<pid>/ns/net path whose process exits ---------------------------------


def netns_process() -> subprocess.Popen[bytes]:
    """A process alone in a new netns (lo up), once it is there: its ``/proc/<pid>/ns/net`` is a
    pod's netns that has no name, as a runtime without ``/run/netns`` gives it."""
    proc = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", "ip link set lo up && exec sleep 600"])
    wait_comm(proc, "sleep")
    return proc


def wait_comm(proc: subprocess.Popen[bytes], comm: str, timeout: float = 10.0) -> None:
    """Until ``proc`` has exec'd ``comm`` (its namespaces are set by then); bounded."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != comm:
        assert time.monotonic() < deadline and proc.poll() is None, f"{proc.args} is not {comm}"
        time.sleep(0.01)


#: Runs argv[2:] as a child at the pid argv[1] (clone3 with set_tid), prints its pid (or "taken"
#: if another process has it), and waits for it.
_AT_PID = r"""
import ctypes, os, signal, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
tid = (ctypes.c_int * 1)(int(sys.argv[1]))
args = struct.pack("=11Q", 0, 0, 0, 0, signal.SIGCHLD, 0, 0, 0, ctypes.addressof(tid), 1, 0)
r = libc.syscall(435, ctypes.create_string_buffer(args, len(args)), ctypes.c_size_t(len(args)))
if r == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
if r < 0:
    print("taken" if ctypes.get_errno() == 17 else f"errno {ctypes.get_errno()}", flush=True)
    sys.exit(0)
print(r, flush=True)
os.waitpid(r, 0)
"""


@contextlib.contextmanager
def process_at_pid(pid: int, argv: list[str]) -> Iterator[bool]:
    """``argv`` run as a process of pid ``pid`` (a pid reused): yields True once it runs, False if
    another process has that pid already (then it too is a reuse of it); killed on the way out."""
    import sys

    helper = subprocess.Popen([sys.executable, "-c", _AT_PID, str(pid), *argv], stdout=subprocess.PIPE)
    try:
        assert helper.stdout is not None
        said = helper.stdout.readline().decode().strip()
        assert said in (str(pid), "taken"), said
        yield said == str(pid)
    finally:
        if helper.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        helper.wait(10)


def resyncs(agent: object) -> float:
    """Pods the agent's resync has looked at so far (every result)."""
    text = agent.get("/metrics")[1]  # type: ignore[attr-defined]
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("redirect_agent_resynced_total{"))


def test_a_snapshot_hands_out_a_pod_where_its_netns_is_and_lists_only_the_pods_it_handed_out(
        test_node: Node, make_pod: Callable[..., Pod]) -> None:
    """Three pods: b as it was; p enrolled by ``/proc/<pid>/ns/net`` whose process exited, its netns
    kept by another process; a whose netns went without a del (the running proxy's fd keeps it, with
    no path left). A proxy connecting now (no resync has run) is handed b and p, each with its own
    netns, and its snapshot lists those two only: never a, which it was not given; the agent logs
    why a was not handed out."""
    n = test_node
    agent = n.start_agent("--resync-seconds", "0")
    n.start_proxy()
    a, b = make_pod(), make_pod()
    procs = [netns_process()]
    try:
        path = f"/proc/{procs[0].pid}/ns/net"
        ino_p = os.stat(path).st_ino
        client.add_pod(n.events, uid="uid-a", netns=a.path, ips=[a.pod_ip4])
        client.add_pod(n.events, uid="uid-b", netns=b.path, ips=[b.pod_ip4])
        client.add_pod(n.events, uid="uid-p", netns=path, ips=["10.250.9.9"])
        procs.append(subprocess.Popen(["nsenter", f"--net={path}", "--", "sleep", "600"]))
        wait_comm(procs[1], "sleep")
        procs[0].kill()
        procs[0].wait(5)
        assert not os.path.exists(path)
        netkit.remove_netns(a.name)
        listed: list[str] = []
        with snapshot_proxy(n.proxy_sock, listed=listed) as got:
            assert got == {"uid-b": os.stat(b.path).st_ino, "uid-p": ino_p}, got
        assert sorted(listed) == ["uid-b", "uid-p"], listed
        e = wait_log(agent.log, lambda e: e.get("msg") == "pod not handed to node proxy: its netns is gone")
        assert e["pod"] == "uid-a" and e["netns"] == a.path, e
        synced = wait_log(agent.log, lambda e: e.get("msg") == "node proxy synced"
                          and str(e.get("proxy")).startswith("snapshot#"))
        assert synced["failed"] == ["uid-a"] and "does not exist" in synced["errors"]["uid-a"], synced
        assert client.del_pod(n.events, uid="uid-p", netns=f"/proc/{procs[1].pid}/ns/net")["removed"]
        assert client.del_pod(n.events, uid="uid-b", netns=b.path)["removed"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("kept_by", ["process", "name"])
def test_a_pod_adopted_by_its_process_is_found_by_its_netns_once_its_pid_is_reused(
        test_node: Node, kept_by: str) -> None:
    """A pod enrolled by ``/proc/<pid>/ns/net``; its netns lives on in another process, or under a
    name in /run/netns (a bind mount); the process exits and its pid goes to a process in another
    netns. The resync keeps the pod, known by the path where its netns is now (inode and cookie),
    with its rules: the proxies are not told it is gone, and nothing is done in the new process's
    netns. A del then removes it there."""
    n = test_node
    agent = n.start_agent("--resync-seconds", "0.1")
    n.start_proxy()
    first = netns_process()
    keeper: subprocess.Popen[bytes] | None = None
    name = f"rdrt-hag-{os.urandom(3).hex()}"
    pinned = f"{rnetns.NETNS_RUN_DIR}/{name}"
    try:
        pid, path = first.pid, f"/proc/{first.pid}/ns/net"
        ino = os.stat(path).st_ino
        assert client.add_pod(n.events, uid="uid-p", netns=path, ips=["10.250.9.9"])["enrolled"]
        if kept_by == "process":
            keeper = subprocess.Popen(["nsenter", f"--net={path}", "--", "sleep", "600"])
            wait_comm(keeper, "sleep")
            where = f"/proc/{keeper.pid}/ns/net"
        else:
            os.makedirs(rnetns.NETNS_RUN_DIR, exist_ok=True)
            Path(pinned).touch()
            subprocess.run(["mount", "--bind", path, pinned], check=True)
            where = pinned
        assert os.stat(where).st_ino == ino
        first.kill()
        first.wait(5)
        with process_at_pid(pid, ["unshare", "--net", "--", "sleep", "600"]) as ours:
            if ours:
                deadline = time.monotonic() + 10
                while os.stat(path).st_ino == ino or Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
                    assert time.monotonic() < deadline, "the new process did not get its netns"
                    time.sleep(0.01)
            # two passes from now (the second began after the pid was reused), or the pod dropped
            done = resyncs(agent)
            deadline = time.monotonic() + 30
            while resyncs(agent) < done + 2 and client.list_pods(n.events):
                assert time.monotonic() < deadline, agent.log.read_text()[-3000:]
                time.sleep(0.02)
            pods = client.list_pods(n.events)
            assert [(p["uid"], p["netns"], p["netns_inode"]) for p in pods] == [("uid-p", where, ino)], pods
            assert redirect.check(where, AMBIENT).ok
            if ours:
                assert not redirect.show(path)["installed"]  # the new process's netns: nothing of ours
            assert not [e for e in read_log(n.proxy_log) if e["event"] == "pod_removed"]
            e = wait_log(agent.log, lambda e: e.get("msg") == "pod netns found at another path")
            assert (e["pod"], e["netns"], e["was"]) == ("uid-p", where, path), e
            assert client.del_pod(n.events, uid="uid-p")["removed"]  # (no netns named: where it is now)
            assert not redirect.show(where)["installed"]
            assert "uid-p" not in records_of(n.name)
    finally:
        first.kill()
        first.wait(5)
        if keeper is not None:
            keeper.kill()
            keeper.wait(5)
        if kept_by == "name":
            subprocess.run(["umount", "-l", pinned], capture_output=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pinned)
