"""What no single pod or request may do to a long-lived process of ours: keep a pod's netns alive
after it is gone (a thread left inside it), or hold the agent's workers, its proxy socket or its
ops port (a FIFO named as a netns, clients that never read, never say hello, or send headers a
byte at a time). Real agents, real namespaces, real sockets; every wait is bounded and polled."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from redirect.ambient.agent import client, protocol
from tests import netkit
from tests.netkit import Pod
from tests.test_agent import Node, cni, fake_proxy_hello
from tests.test_cni_thin import PREV, Thin, agent_node, installed, netconf

pytestmark = pytest.mark.timeout(240)

BACKENDS = ["iptables", "nftables", "ebpf"]


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from redirect.cni import install as inst

    d = str(tmp_path_factory.mktemp("cni-bin"))
    inst.install_binary(d)
    return d


def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.05)


# --- no thread of ours stays in a pod's netns ------------------------------------------------


def threads_in(pid: int, inode: int) -> list[str]:
    """Names of the threads of ``pid`` whose netns is ``inode``."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}/task/{tid}/ns/net").st_ino == inode:
                out.append(Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip())
    return out


def fds_of(pid: int, inode: int) -> int:
    """How many fds of ``pid`` are that netns."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == f"net:[{inode}]"
    return n


def assert_freed_once_removed(pod: Pod) -> None:
    """Remove the pod's netns (its /run/netns pin): the kernel frees it, and its veth pair with it,
    so the peer's end goes too (what a kept netns leaves on a node's bridge)."""
    netkit.remove_netns(pod.name)

    def peer_end_gone() -> bool:
        p = subprocess.run(["ip", "-n", pod.peer_name, "link", "show", pod.peer_if], capture_output=True, text=True)
        return p.returncode != 0

    until(peer_end_gone, f"freed: {pod.name}'s veth peer {pod.peer_if} still exists, so its netns lives on")


SETUP_TEARDOWN = """
import json, os, sys
import redirect
ns, backend, mode = sys.argv[1:4]
ino = os.stat("/run/netns/" + ns).st_ino
cfg = redirect.RedirectConfig(mode=mode, inbound_ports=() if backend == "ebpf" else "*")
redirect.setup(ns, cfg, backend)
redirect.teardown(ns)
held = []
for t in os.listdir("/proc/self/task"):
    if os.stat(f"/proc/self/task/{t}/ns/net").st_ino == ino:
        held.append(open(f"/proc/self/task/{t}/comm").read().strip())
print(json.dumps({"held": held, "threads": len(os.listdir("/proc/self/task"))}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sidecar", "ambient"])
def test_setup_and_teardown_leave_no_thread_in_the_pod_netns_and_it_is_freed(
        make_pod: Callable[..., Pod], backend: str, mode: str, request: pytest.FixtureRequest) -> None:
    """``redirect.setup(ns); redirect.teardown(ns)`` in a fresh process: no thread of that process is
    in the pod's netns afterwards (a lazily started helper thread inherits the netns of the thread
    that starts it), and once the pod's pin goes, the kernel frees the netns while the process lives."""
    if backend == "ebpf":
        request.getfixturevalue("ebpf_root")
    pod = make_pod()
    inode = os.stat(pod.path).st_ino
    p = subprocess.Popen([sys.executable, "-c", SETUP_TEARDOWN, pod.name, backend, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, p.communicate(timeout=30)[1][-3000:]
        got = json.loads(line)
        assert got["held"] == [], got
        assert threads_in(p.pid, inode) == [] and fds_of(p.pid, inode) == 0
        assert_freed_once_removed(pod)
        assert p.poll() is None  # the process was alive all along
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_del_through_the_agent_leaves_nothing_of_ours_holding_the_pod_netns(
        bin_dir: str, make_pod: Callable[..., Pod], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        backend: str) -> None:
    """Sidecar pods through the thin plugin (``--no-host-rules``) and an ambient pod: after each
    DEL, no thread or fd of the agent is in the pod's netns, and removing its pin frees it while
    the agent runs on."""
    with agent_node(tmp_path, backend, monkeypatch) as n:
        agent = n.start_agent("--no-host-rules")
        thin = Thin(bin_dir, n)
        capture = {"inbound_ports": []} if backend == "ebpf" else {}
        for _ in range(2):  # the first pod of an agent process, and one after it
            pod = make_pod()
            inode = os.stat(pod.path).st_ino
            conf = netconf(n.events, backend=backend, capture=capture)
            assert thin("ADD", conf, pod.path) == (0, PREV)
            assert installed(pod, backend)
            assert thin("DEL", conf, pod.path) == (0, None)
            assert not installed(pod, backend)
            assert threads_in(agent.proc.pid, inode) == [] and fds_of(agent.proc.pid, inode) == 0
            assert_freed_once_removed(pod)
        n.start_proxy()
        pod = make_pod()
        inode = os.stat(pod.path).st_ino
        assert cni("ADD", pod, "uid-held", n.events, backend)[0] == 0
        assert cni("DEL", pod, "uid-held", n.events, backend)[0] == 0
        assert threads_in(agent.proc.pid, inode) == [] and fds_of(agent.proc.pid, inode) == 0
        assert n.proxy is not None
        until(lambda: fds_of(n.proxy.pid, inode) == 0, "the node proxy let go of the pod")  # type: ignore[union-attr]
        assert_freed_once_removed(pod)
        assert agent.proc.poll() is None


# --- one request, or one client, cannot stop the agent ---------------------------------------


def _unread_replies(sock: socket.socket) -> int:
    """Bytes of replies waiting in ``sock``'s receive queue (SIOCINQ sums a seqpacket socket's queue)."""
    import array
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return buf[0]


class Hoarder:
    """A client of the events socket that sends ``status`` requests as fast as the agent takes them
    and never reads a reply."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self.msg = json.dumps({"v": 1, "type": "status"}).encode()

    def top_up(self) -> int:
        """Send until the socket is full; how many requests went out (0: the agent takes none)."""
        n = 0
        while n < 10_000:
            try:
                self.sock.send(self.msg)
            except BlockingIOError:
                break
            n += 1
        return n


def test_clients_that_never_read_their_replies_hold_no_worker(
        bin_dir: str, make_pod: Callable[..., Pod], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 clients (twice the agent's 16 workers) send requests and never read the replies, until
    their answers fill their sockets and the agent reads no more of their requests. The workers are
    free all the while: a sidecar ADD, CHECK and DEL through the thin plugin and ``status`` are
    answered (the clients' connections would have to wait for ``--idle-timeout``, 120 s here)."""
    with agent_node(tmp_path, "iptables", monkeypatch) as n:
        n.start_agent("--idle-timeout", "120", "--no-host-rules")
        hoarders = [Hoarder(n.events) for _ in range(32)]
        try:
            quiet = 0
            deadline = time.monotonic() + 60
            while quiet < 3:  # the agent took none of their requests for three rounds running
                assert time.monotonic() < deadline, "the hoarders' requests were still being read after 60 s"
                quiet = quiet + 1 if sum(h.top_up() for h in hoarders) == 0 else 0
                time.sleep(0.2)
            assert all(_unread_replies(h.sock) > 0 for h in hoarders)
            pod = make_pod()
            thin = Thin(bin_dir, n)
            conf = netconf(n.events, agentTimeout=20)
            assert thin("ADD", conf, pod.path) == (0, PREV)
            assert thin("CHECK", conf, pod.path) == (0, None)
            assert thin("DEL", conf, pod.path) == (0, None)
            for _ in range(20):
                assert protocol.request(n.events, {"type": "status"}, 20)["ready"] is True
        finally:
            for h in hoarders:
                h.sock.close()


class SilentCrowd:
    """``count`` connections to a socket that never say a word, each opened again as soon as the
    agent closes it (on a thread, until ``close``; bounded in time)."""

    def __init__(self, path: str, count: int, max_seconds: float = 120.0) -> None:
        self.path, self.count, self.max_seconds = path, count, max_seconds
        self.stop = threading.Event()
        self.reconnects = 0
        self._t = threading.Thread(target=self._run, name="silent-crowd", daemon=True)

    def _connect(self) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(2)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        return s

    def _run(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        deadline = time.monotonic() + self.max_seconds
        live = 0
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                while live < self.count and not self.stop.is_set():
                    s = self._connect()
                    if s is None:
                        break
                    sel.register(s, selectors.EVENT_READ)
                    live += 1
                for key, _ in sel.select(timeout=0.05):  # closed by the agent (an error, then EOF)
                    s = key.fileobj
                    try:
                        data = s.recv(65536)  # type: ignore[union-attr]
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        s.close()  # type: ignore[union-attr]
                        live -= 1
                        self.reconnects += 1
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()

    def __enter__(self) -> SilentCrowd:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._t.join(10)


def test_silent_connections_to_the_proxy_socket_never_keep_the_node_proxy_out(
        tmp_path: Path, make_pod: Callable[..., Pod]) -> None:
    """100 connections to the proxy socket that never say hello, reopened as soon as they are
    closed: the node proxy still connects and gets its snapshot, and ambient ADDs succeed (no
    ``no_proxy``)."""
    n = Node(tmp_path)
    try:
        agent = n.start_agent()
        with SilentCrowd(n.proxy_sock, 100) as crowd:
            until(lambda: crowd.reconnects > 0, "the agent closing silent connections", 30)
            n.start_proxy()  # returns once the proxy got its snapshot
            for i in range(3):
                pod = make_pod()
                rc, out = cni("ADD", pod, f"uid-crowd{i}", n.events)
                assert rc == 0, out
                assert cni("DEL", pod, f"uid-crowd{i}", n.events)[0] == 0
        assert agent.proc.poll() is None and 'reason="no_proxy"' not in agent.get("/metrics")[1]
    finally:
        n.close()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``s`` within ``timeout`` seconds (what it sent before is read and dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if s.recv(65536) == b"":
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def test_the_ops_port_bounds_a_requests_time_size_and_lines(tmp_path: Path) -> None:
    """A client sending its request a byte at a time, each byte well within ``--idle-timeout``,
    is dropped once that time has passed since the request began; a header line over the size
    bound, or too many lines, are answered 431 and closed; the agent serves on."""
    n = Node(tmp_path)
    try:
        agent = n.start_agent("--idle-timeout", "3")
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as c:
            c.sendall(b"GET /healthz HTTP/1.0\r\nX-Drip: ")
            closed = False
            for _ in range(60):  # a byte a second: each read alone is within the timeout
                try:
                    c.sendall(b"x")
                except OSError:
                    closed = True
                    break
                if _closed_by_peer(c, 1.0):
                    closed = True
                    break
            assert closed, "a request dripping a byte a second was still open after 60 s (--idle-timeout 3)"
        for head in (b"GET /healthz HTTP/1.0\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
                     b"GET /healthz HTTP/1.0\r\n" + b"X-A: 1\r\n" * 80 + b"\r\n"):
            with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as c:
                with contextlib.suppress(OSError):
                    c.sendall(head)
                c.settimeout(5)
                got = b""
                with contextlib.suppress(OSError):
                    while chunk := c.recv(4096):
                        got += chunk
                assert got.startswith(b"HTTP/1.0 431 "), got[:200]
        assert agent.get("/healthz") == (200, "ok\n")
    finally:
        n.close()


def test_the_ops_port_buffers_little_for_many_connections_with_huge_headers(tmp_path: Path) -> None:
    """128 connections each sending header lines of 65 KB (up to 100 of them): the agent's memory
    grows by a small bound (it reads at most a few KB of a request), and it serves on."""
    n = Node(tmp_path)
    try:
        agent = n.start_agent("--idle-timeout", "60")
        assert agent.get("/healthz")[0] == 200
        before = _rss_kib(agent.proc.pid)
        payload = memoryview(b"GET /metrics HTTP/1.0\r\n" + (b"X-Big: " + b"h" * 65_000 + b"\r\n") * 100)
        conns: list[tuple[socket.socket, list[int]]] = []  # (socket, [bytes of the payload sent])
        try:
            for _ in range(128):
                s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
                s.setblocking(False)
                conns.append((s, [0]))
            peak = before
            stalled = 0
            deadline = time.monotonic() + 120
            while stalled < 10 and time.monotonic() < deadline:  # until no bytes are taken, 10 rounds running
                moved = 0
                for s, sent in conns:
                    while sent[0] < len(payload):
                        try:
                            k = s.send(payload[sent[0]:sent[0] + 65536])
                        except (BlockingIOError, InterruptedError):
                            break
                        except OSError:  # closed by the agent
                            sent[0] = len(payload)
                            break
                        sent[0] += k
                        moved += k
                stalled = stalled + 1 if moved == 0 else 0
                peak = max(peak, _rss_kib(agent.proc.pid))
                time.sleep(0.05)
            peak = max(peak, _rss_kib(agent.proc.pid))
            assert peak - before < 64 * 1024, f"the agent's memory grew from {before} KiB to {peak} KiB"
            assert agent.get("/healthz") == (200, "ok\n")
        finally:
            for s, _ in conns:
                s.close()
    finally:
        n.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fifo_named_as_the_netns_is_refused_at_once_and_holds_no_worker(
        bin_dir: str, make_pod: Callable[..., Pod], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        backend: str) -> None:
    """``CNI_NETNS`` naming a FIFO (opening one waits for a writer), and events-socket adds and dels
    naming one: each is answered at once, more of them at a time than the agent has workers, and
    the agent serves real pods afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from redirect.ambient.agent import client

    fifo = str(tmp_path / "netns-fifo")
    os.mkfifo(fifo)
    with agent_node(tmp_path, backend, monkeypatch) as n:
        n.start_agent("--workers", "2", "--no-host-rules")
        thin = Thin(bin_dir, n)
        capture = {"inbound_ports": []} if backend == "ebpf" else {}
        conf = netconf(n.events, backend=backend, capture=capture, agentTimeout=20)

        def add(_: int) -> tuple[int, dict[str, Any] | None]:
            return thin("ADD", conf, fifo)

        with ThreadPoolExecutor(6) as ex:
            for rc, out in ex.map(add, range(6)):
                assert rc == 1 and out is not None and out["code"] == 7, out
                assert f"{fifo} is a FIFO, not a network namespace" in out["msg"], out
        rc, out = thin("CHECK", conf, fifo)
        assert rc == 1 and out is not None and "a FIFO" in out["msg"], out
        assert thin("DEL", conf, fifo) == (0, None)  # nothing of ours can be in a FIFO
        with pytest.raises(client.AgentError, match="a FIFO, not a network namespace") as ei:
            client.add_pod(n.events, uid="uid-fifo", netns=fifo, timeout=20)
        assert ei.value.reason == "netns"
        assert client.del_pod(n.events, uid="uid-fifo", netns=fifo, timeout=20)["removed"] is False
        pod = make_pod()
        assert thin("ADD", conf, pod.path) == (0, PREV)
        assert thin("DEL", conf, pod.path) == (0, None)


# --- the agent's fds stay below FD_SETSIZE ----------------------------------------------------


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


FD_PAST_SETSIZE = """
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
if sys.argv[2] == "limited":
    from redirect.ambient.agent.daemon import limit_fds
    limit_fds()
import redirect
held = []
for _ in range(1100):
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
for fd in held[-8:]:  # room for libnftables' socket: past 1023 unless the limit kept every fd below
    os.close(fd)
redirect.setup(sys.argv[1], redirect.RedirectConfig(mode="ambient"), "nftables")
print("set up", max(held), flush=True)
"""


def test_the_agent_keeps_its_fds_below_fd_setsize_so_libnftables_never_aborts_it(
        pod: Pod, tmp_path: Path) -> None:
    """libnftables puts its netlink socket in a ``select()`` fd_set, and glibc aborts the process
    for an fd >= 1024. With the agent's limit (``limit_fds``) every fd it can open is below that:
    a process that opened 1100 files sets up nftables capture instead of dying with SIGABRT; and
    an agent started with a higher soft limit runs with 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) cannot show fds past 1024")
    p = subprocess.run([sys.executable, "-c", FD_PAST_SETSIZE, pod.name, "limited"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("set up 10"), (p.returncode, p.stdout, p.stderr[-2000:])
    assert int(p.stdout.split()[-1]) < 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard), hard))
    n = Node(tmp_path)
    try:
        agent = n.start_agent()
        assert _soft_nofile(agent.proc.pid) == 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        n.close()


def test_a_node_proxy_that_stops_acking_is_dropped_and_holds_no_fds(
        make_pod: Callable[..., Pod], tmp_path: Path) -> None:
    """A proxy says hello, acks its snapshot, then reads and acks nothing. The first add it misses
    fails (``proxy``) and the proxy is dropped, its queue and fds with it; the adds after it are
    enrolled through the proxy that serves, and the agent's open fds do not grow with them."""
    n = Node(tmp_path)
    try:
        agent = n.start_agent("--proxy-timeout", "1", "--resync-seconds", "0")
        n.start_proxy()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stuck:
            msg = fake_proxy_hello(stuck, n.proxy_sock, "stuck")
            protocol.send(stuck, {"type": "ack", "id": msg["id"], "ok": True})
            until(lambda: json.loads(agent.get("/readyz")[1])["proxies"] == 2, "two proxies")
            pods = [make_pod() for _ in range(6)]
            with pytest.raises(client.AgentError) as ei:
                client.add_pod(n.events, uid="uid-s0", netns=pods[0].path, ips=[pods[0].pod_ip4])
            assert ei.value.reason == "proxy" and "stuck" in str(ei.value), ei.value
            until(lambda: json.loads(agent.get("/readyz")[1])["proxies"] == 1, "the stuck proxy dropped", 10)
            base = _open_fds(agent.proc.pid)
            for i, p in enumerate(pods[1:], 1):
                assert client.add_pod(n.events, uid=f"uid-s{i}", netns=p.path, ips=[p.pod_ip4])["proxies"] == 1
            assert _open_fds(agent.proc.pid) <= base + 16  # (a worker's first pod opens its per-thread fds)
            for i, p in enumerate(pods):
                client.del_pod(n.events, uid=f"uid-s{i}", netns=p.path)
    finally:
        n.close()


def test_max_clients_and_workers_are_capped_and_the_ops_port_holds_few_connections(tmp_path: Path) -> None:
    """``--max-clients`` past 256 and ``--workers`` past 64 are refused (they could take the agent's fds
    past 1024); the ops port holds at most 32 connections whatever ``--max-clients`` says."""
    for flag, value in (("--max-clients", "2000"), ("--workers", "100")):
        p = subprocess.run([sys.executable, "-m", "redirect.ambient.agent.daemon", flag, value], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and flag in p.stderr, p.stderr[-1000:]
    n = Node(tmp_path)
    conns: list[socket.socket] = []
    try:
        agent = n.start_agent("--max-clients", "256")
        base = _open_fds(agent.proc.pid)
        for _ in range(200):
            conns.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
        assert agent.get("/healthz") == (200, "ok\n")
        until(lambda: _open_fds(agent.proc.pid) <= base + 40, f"at most 40 fds more than {base}", 10)
    finally:
        for c in conns:
            c.close()
        n.close()
