"""The ambient node agent (redirect-agent) with the reference node proxy (redirect-nodeproxy).

Both run as real processes, as on a node: the agent on unix sockets in a temp dir,
the node's probe rules in a test netns standing for the node, the proxy opening its
marked listeners inside each pod netns it is handed. Pods come from the kit; traffic
is real, and each connection is matched to the proxy's JSON log (client address on
accept, upstream address on forward), so "captured by the proxy" is checked per
connection, not inferred.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import redirect
from redirect.ambient import node
from redirect.ambient.agent import client, legacy, protocol, store
from redirect.cni.netconf import convert_result
from redirect.kernel import netlink
from redirect.kernel import netns as rnetns
from tests import netkit
from tests.ctrkit import (  # the containerd kit
    Containerd,
    bridge_net,
    containerd,  # noqa: F401 - the fixture
    ctr_run,
    needs_containerd,
    wait_task,
)
from tests.netkit import Pod, TcpListener, in_netns, tcp_probe_detail

pytestmark = pytest.mark.timeout(120)

PLUGIN = os.path.join(os.path.dirname(sys.executable), "redirect-cni")
APP = 8080
#: The agent's backends for ambient pods; eBPF's host programs go to a scratch root of this module.
BACKENDS = ["iptables", "nftables", "ebpf"]


@pytest.fixture(autouse=True)
def _ebpf_root(request: pytest.FixtureRequest) -> None:
    """eBPF cases run with the host programs under a scratch root of this module (``ebpf_root``),
    which the agents started here inherit (``$REDIRECT_BPF_ROOT``)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "ebpf" in (callspec.params.get("backend"), callspec.params.get("backend_node")):
        request.getfixturevalue("ebpf_root")


# --- processes -----------------------------------------------------------------------------


def read_log(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def record_of(netns: str) -> dict[str, Any] | None:
    """The agent's record of ``netns`` (in its store on the node), or None."""
    return store.read(rnetns.netns_key(netns))


def records_of(node_name: str) -> dict[str, tuple[store.Key, str]]:
    """The records in the agent's store of the pods of ``node_name``: uid -> (netns key, phase)."""
    return {str(r["uid"]): (k, str(r["phase"])) for k, r in store.records()
            if isinstance(r, dict) and r.get("node") == node_name}


def wait_log(path: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 10.0,
             proc: subprocess.Popen[bytes] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in read_log(path):
            if pred(e):
                return e
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}: {path.read_text()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no matching log line in {path} after {timeout} s: {path.read_text()[-3000:]}")


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    events: str

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, line_start: str) -> float:
        for ln in self.get("/metrics")[1].splitlines():
            if ln.startswith(line_start + " "):
                return float(ln.split()[-1])
        raise AssertionError(f"no metric {line_start}")


class Node:
    """A test node: a netns for the node's probe rules, the agent's sockets, and its processes."""

    #: How the agent is started (a test of an installed package runs its console script).
    agent_command: tuple[str, ...] = (sys.executable, "-m", "redirect.ambient.agent.daemon")

    def __init__(self, tmp: Path, backend: str = "iptables") -> None:
        self.tmp = tmp
        self.backend = backend
        self.name = f"rdrt-node-{os.urandom(4).hex()}"
        self.ns = netkit.create_netns(self.name)
        self.events = str(tmp / "agent.sock")
        self.proxy_sock = str(tmp / "proxy.sock")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agent: Agent | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.proxy_log = tmp / "proxy.log"
        self._n = 0

    def start_agent(self, *extra: str, wait_ready: bool = True, env: dict[str, str] | None = None,
                    inside: bool = False) -> Agent:
        """``inside``: the agent runs in the node's netns (as a hostNetwork pod on a node: its own
        netns is the node's); else in this process's, with the node's sets in ``--host-netns``."""
        self._n += 1
        log = self.tmp / f"agent-{self._n}.log"
        enter = ["nsenter", f"--net={rnetns.path_of(self.ns)}", "--"] if inside else []
        with open(log, "wb") as f:
            p = subprocess.Popen([*enter, *self.agent_command, "--events-socket", self.events,
                                  "--proxy-socket", self.proxy_sock, "--http-port", "0", "--host-netns", self.ns,
                                  "--node-name", self.name, "--backend", self.backend, "--proxy-timeout", "5",
                                  *extra], stderr=f, stdout=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})})
        self.procs.append(p)
        port = int(wait_log(log, lambda e: e.get("msg") == "http listening", 15, p)["port"])
        if wait_ready:
            wait_log(log, lambda e: e.get("msg") == "agent ready", 30, p)
        self.agent = Agent(p, log, port, self.events)
        return self.agent

    def start_proxy(self) -> subprocess.Popen[bytes]:
        before = len([e for e in read_log(self.proxy_log) if e["event"] == "snapshot_done"])
        p = subprocess.Popen([sys.executable, "-m", "redirect.ambient.nodeproxy", "--socket", self.proxy_sock,
                              "--log-file", str(self.proxy_log), "--connect-timeout", "2"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        self.proxy = p
        deadline = time.monotonic() + 15
        while len([e for e in read_log(self.proxy_log) if e["event"] == "snapshot_done"]) <= before:
            assert p.poll() is None and time.monotonic() < deadline, self.proxy_log.read_text()[-2000:]
            time.sleep(0.02)
        return p

    def wait_synced(self, n_snapshots: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len([e for e in read_log(self.proxy_log) if e["event"] == "snapshot_done"]) < n_snapshots:
            assert time.monotonic() < deadline, self.proxy_log.read_text()[-2000:]
            time.sleep(0.02)

    def proxy_events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_log(self.proxy_log) if e["event"] == kind]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        try:
            node.teardown_node(self.ns)
        finally:
            netkit.remove_netns(self.name)
            for key, _ in records_of(self.name).values():  # (what a failed test left in the store)
                store.remove(key)


# --- CNI -----------------------------------------------------------------------------------


def cni(command: str, pod: Pod, uid: str, sock: str, backend: str = "iptables",
        timeout: float = 10) -> tuple[int, dict[str, Any] | None]:
    prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": pod.path}],
            "ips": [{"address": f"{pod.pod_ip4}/24", "interface": 0}, {"address": f"{pod.pod_ip6}/64", "interface": 0}]}
    conf = {"cniVersion": "1.0.0", "name": "rdrt-agent", "type": "redirect-cni", "mode": "ambient",
            "backend": backend, "agentSocket": sock, "agentTimeout": timeout,
            "prevResult": convert_result(prev, "1.0.0")}
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
           "CNI_CONTAINERID": f"ctr-{uid}", "CNI_NETNS": pod.path, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
           "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-{uid};K8S_POD_UID={uid}"}
    if "REDIRECT_BPF_ROOT" in os.environ:  # (the Python plugin's DEL, when no agent runs, looks there)
        env["REDIRECT_BPF_ROOT"] = os.environ["REDIRECT_BPF_ROOT"]
    p = subprocess.run([PLUGIN], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=60)
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else None)


def nothing_left(pod_ns: str, node_ns: str, uid: str, backend: str = "iptables") -> None:
    """No rules, routes, record or node-set entry of the pod remain (nor an earlier release's in-pod record)."""
    shown = redirect.show(pod_ns, backend=backend)
    assert not shown["installed"] and not shown["routes"], shown
    assert record_of(pod_ns) is None and uid not in records_of(node_ns)
    assert not legacy.exists(pod_ns)
    assert uid not in node.list_pods(node_ns).values()


# --- traffic and its attribution -----------------------------------------------------------


@dataclass
class Sent:
    pod: str
    kind: str  # "out" or "in"
    token: str
    ok: bool
    label: str | None
    local: tuple[str, int] | None
    error: str | None


def send(pod: Pod, kind: str, fam: int = 4, timeout: float = 2.0) -> Sent:
    if kind == "out":
        r = tcp_probe_detail(pod.name, pod.peer_ip(fam), APP, timeout=timeout)
    else:
        r = tcp_probe_detail(pod.peer_name, pod.pod_ip(fam), APP, timeout=timeout)
    return Sent(pod.name, kind, r.token, r.ok, r.label, r.local, r.error)


def assert_all_through_proxy(node_: Node, sent: list[Sent], servers: list[TcpListener]) -> None:
    """Every connection that reached a server came through the proxy (no uncaptured one)."""
    accepted = {tuple(e["src"]) for e in node_.proxy_events("accept")}
    forwarded = {tuple(e["upstream_local"]) for e in node_.proxy_events("forward")}
    for s in sent:
        seen = next((c for srv in servers if (c := srv.conn_for(s.token)) is not None), None)
        if seen is None:
            continue
        assert seen.peer in forwarded, f"{s} reached a server from {seen.peer}, not through the proxy"
        if s.kind == "out":
            assert s.local in accepted, f"{s}: the proxy never accepted its connection"


@contextlib.contextmanager
def servers_for(pods: list[Pod]) -> Iterator[list[TcpListener]]:
    with contextlib.ExitStack() as st:
        out = []
        for p in pods:
            for fam in (4, 6):
                out.append(st.enter_context(TcpListener(p.peer_name, APP, family=fam, label=f"server{fam}")))
                out.append(st.enter_context(TcpListener(p.name, APP, family=fam, label=f"app{fam}")))
        yield out


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_cni_add_enrols_the_pod_for_the_node_proxy_and_del_leaves_nothing(
        tmp_path: Path, make_pod: Callable[..., Pod], backend: str) -> None:
    n = Node(tmp_path, backend)
    try:
        n.start_agent()
        n.start_proxy()
        pods = [make_pod(), make_pod()]
        uids = [f"uid-{i}-{os.urandom(3).hex()}" for i in range(len(pods))]
        with servers_for(pods) as servers:
            for pod, uid in zip(pods, uids, strict=True):
                rc, out = cni("ADD", pod, uid, n.events, backend)
                assert rc == 0, out
                assert redirect.check(pod.name, redirect.RedirectConfig(mode="ambient"), backend=backend).ok
                assert record_of(pod.name)["uid"] == uid  # type: ignore[index]
                assert node.list_pods(n.ns)[pod.pod_ip4] == uid
            sent = []
            for pod in pods:
                for fam in (4, 6):
                    for kind, label in (("out", f"server{fam}"), ("in", f"app{fam}")):
                        s = send(pod, kind, fam)
                        assert s.label == label, s
                        sent.append(s)
            assert_all_through_proxy(n, sent, servers)
            assert {e["pod"] for e in n.proxy_events("forward")} == set(uids)
            inbound = [e for e in n.proxy_events("forward") if e["kind"] == "inbound"]
            assert {tuple(e["orig_dst"]) for e in inbound} == {(p.pod_ip(f), APP) for p in pods for f in (4, 6)}

            assert cni("CHECK", pods[0], uids[0], n.events, backend) == (0, None)
            rc, out = cni("CHECK", pods[0], "uid-unknown", n.events, backend)
            assert rc == 1 and out is not None and out["code"] == 104 and "not enrolled" in out["msg"], out
            # Drifted rules: CHECK says so; a repeated ADD repairs them.
            in_netns(pods[1].name, subprocess.run, TAMPER[backend], check=True)
            rc, out = cni("CHECK", pods[1], uids[1], n.events, backend)
            assert rc == 1 and out is not None and out["code"] == 104 and "rules differ" in out["msg"], out
            assert cni("ADD", pods[1], uids[1], n.events, backend)[0] == 0
            assert cni("CHECK", pods[1], uids[1], n.events, backend) == (0, None)

            # The tunnel port is not captured: a CONNECT there reaches the app through the proxy.
            def tunnel() -> bytes:
                with socket.create_connection((pods[0].pod_ip4, 15008), timeout=3) as c:
                    c.sendall(f"CONNECT {pods[0].pod_ip4}:{APP} HTTP/1.1\r\n\r\n".encode())
                    head = c.recv(64)
                    c.sendall(b"through-the-tunnel\n")
                    return head + c.recv(64)
            got = in_netns(pods[0].peer_name, tunnel)
            assert got.startswith(b"HTTP/1.1 200") and b"app4" in got, got

            # DEL: the proxy lets go, the rules, routes, record and node-set entries are gone.
            rc, out = cni("DEL", pods[0], uids[0], n.events, backend)
            assert rc == 0, out
            nothing_left(pods[0].name, n.ns, uids[0], backend)
            wait_log(n.proxy_log, lambda e: e["event"] == "pod_removed" and e["pod"] == uids[0], 5)
            s = send(pods[0], "out")
            assert s.ok and not any(e["src"] == list(s.local or ()) for e in n.proxy_events("accept"))
            # The other pod is untouched.
            assert send(pods[1], "out").ok and node.list_pods(n.ns)[pods[1].pod_ip4] == uids[1]
            assert cni("DEL", pods[0], uids[0], n.events, backend)[0] == 0  # idempotent
            assert cni("DEL", pods[1], uids[1], n.events, backend)[0] == 0
            nothing_left(pods[1].name, n.ns, uids[1], backend)
    finally:
        n.close()


def test_add_fails_closed_without_agent_proxy_or_answer(test_node: Node, pod: Pod, tmp_path: Path) -> None:
    # No agent at all.
    t0 = time.monotonic()
    rc, out = cni("ADD", pod, "uid-a", test_node.events)
    assert rc == 1 and out is not None and out["code"] == 11 and "unreachable" in out["msg"], out  # (try again)
    # An agent but no node proxy: refused, nothing left installed.
    test_node.start_agent()
    rc, out = cni("ADD", pod, "uid-a", test_node.events)
    assert rc == 1 and out is not None and out["code"] == 103 and "no_proxy" in out["msg"], out
    nothing_left(pod.name, test_node.ns, "uid-a")
    # Something that accepts and never answers: the ADD gives up after agentTimeout.
    mute = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(mute)
        s.listen(4)
        t0 = time.monotonic()
        rc, out = cni("ADD", pod, "uid-a", mute, timeout=1)
        assert rc == 1 and out is not None and out["code"] == 11 and "timeout" in out["msg"], out
        assert time.monotonic() - t0 < 5
    nothing_left(pod.name, test_node.ns, "uid-a")
    # The node proxy can't take the pod (its port is taken in the pod): refused, everything undone.
    test_node.start_proxy()
    with TcpListener(pod.name, 15001, label="squatter"):
        rc, out = cni("ADD", pod, "uid-a", test_node.events)
        assert rc == 1 and out is not None and out["code"] == 103 and "(proxy)" in out["msg"], out
        assert "15001" in out["msg"] or "Address already in use" in out["msg"], out
    nothing_left(pod.name, test_node.ns, "uid-a")
    wait_log(test_node.proxy_log, lambda e: e["event"] == "pod_failed" and e["pod"] == "uid-a", 5)
    assert client.list_pods(test_node.events) == []
    # Not our protocol: answered, not crashed on.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
        c.settimeout(5)
        c.connect(test_node.events)
        for raw in (b"not json", json.dumps({"v": 2, "type": "add"}).encode(), json.dumps({"v": 1}).encode()):
            c.send(raw)
            ans = json.loads(c.recv(65536))
            assert ans["ok"] is False and ans["reason"] == "bad_request", ans
        c.send(json.dumps({"v": 1, "type": "status"}).encode())
        assert json.loads(c.recv(65536))["ready"] is True
    # Bad events name the field and value.
    with pytest.raises(client.AgentError, match="pod.uid") as ei:
        client.add_pod(test_node.events, uid='bad"uid', netns=pod.path)
    assert ei.value.reason == "bad_request"
    with pytest.raises(client.AgentError, match="rdrt-no-such") as ei:
        client.add_pod(test_node.events, uid="u1", netns="/run/netns/rdrt-no-such")
    assert ei.value.reason == "netns"
    with pytest.raises(client.AgentError, match="pod.ips"):
        client.add_pod(test_node.events, uid="u1", netns=pod.path, ips=["10.0.0.300"])
    with pytest.raises(client.AgentError, match="larger than the limit") as ei:  # no config: can't shrink
        client.add_pod(test_node.events, uid="u1", netns=pod.path, annotations={"big": "x" * 70000})
    assert ei.value.reason == "protocol"
    # With the config resolved (what the CNI plugin sends), oversized annotations are left out.
    res = client.add_pod(test_node.events, uid="u-big", netns=pod.path, config={"mode": "ambient"},
                         annotations={"big": "x" * 70000})
    assert res["enrolled"]
    assert client.del_pod(test_node.events, uid="u-big", netns=pod.path)["removed"]
    nothing_left(pod.name, test_node.ns, "u-big")
    assert test_node.agent is not None
    assert test_node.agent.metric('redirect_agent_failures_total{reason="no_proxy"}') == 1
    assert test_node.agent.metric('redirect_agent_failures_total{reason="proxy"}') == 1
    assert test_node.agent.metric('redirect_agent_failures_total{reason="bad_request"}') == 2  # framing: not counted


class Traffic:
    """Background traffic (bounded in count and time): each pod's outbound and inbound, round robin."""

    def __init__(self, pods: list[Pod], max_probes: int = 20000, max_seconds: float = 90.0) -> None:
        self.pods = pods
        self.phase = "start"
        self.sent: list[tuple[str, Sent]] = []
        self._stop = threading.Event()
        self._limits = (max_probes, max_seconds)
        self._t = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self._limits[1]
        i = 0
        while not self._stop.is_set() and i < self._limits[0] and time.monotonic() < deadline:
            pod = self.pods[i % len(self.pods)]
            kind = "out" if (i // len(self.pods)) % 2 == 0 else "in"
            phase = self.phase
            self.sent.append((phase, send(pod, kind, timeout=3.0)))
            i += 1
            time.sleep(0.005)

    def __enter__(self) -> Traffic:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(10)

    def mark(self, phase: str, min_probes: int = 0, timeout: float = 10.0) -> None:
        """Start ``phase``; wait until the previous one had at least ``min_probes`` probes."""
        deadline = time.monotonic() + timeout
        while sum(1 for p, _ in self.sent if p == self.phase) < min_probes and time.monotonic() < deadline:
            time.sleep(0.01)
        self.phase = phase
        # The probe in flight now started under the old phase: let it finish there.
        n = len(self.sent)
        while len(self.sent) <= n and self._t.is_alive() and time.monotonic() < deadline + timeout:
            time.sleep(0.005)

    def of(self, *phases: str) -> list[Sent]:
        return [s for p, s in self.sent if p in phases]


TAMPER = {"iptables": ["iptables", "-t", "nat", "-F", "RDR_OUTPUT"],
          "nftables": ["nft", "flush", "chain", "inet", "rdr_redirect", "nat_OUTPUT"],
          # (its map entries are the host's: what drifts in the pod is its policy route)
          "ebpf": ["ip", "-4", "rule", "del", "fwmark", "0x111/0xfff", "lookup", "100"]}


@pytest.fixture
def backend_node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    n = Node(tmp_path, request.param)
    try:
        yield n
    finally:
        n.close()


@pytest.mark.parametrize("backend_node", BACKENDS, indirect=True)
def test_pods_stay_captured_across_agent_sigkills_and_proxy_restarts(
        backend_node: Node, make_pod: Callable[..., Pod]) -> None:
    n = backend_node
    backend = n.backend
    agent = n.start_agent()
    n.start_proxy()
    pods = [make_pod() for _ in range(4)]
    uids = [f"uid-r{i}-{os.urandom(3).hex()}" for i in range(len(pods))]
    for pod, uid in zip(pods, uids, strict=True):
        rc, out = cni("ADD", pod, uid, n.events, backend)
        assert rc == 0, out
    live, drifting = pods[:3], pods[3]
    amb = redirect.RedirectConfig(mode="ambient")
    with servers_for(pods) as servers, Traffic(live) as traffic:
        traffic.mark("steady", 0)
        for round_ in range(2):
            traffic.mark(f"kill{round_}", 20)
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(5)
            if round_ == 0:
                # While the agent is down: one pod's rules drift, its node-set entry goes, and a
                # pod that no longer exists still has an entry.
                in_netns(drifting.name, subprocess.run, TAMPER[backend], check=True)
                assert not redirect.check(drifting.name, amb, backend=backend).ok
                node.remove_pods([drifting.pod_ip4], n.ns)
                node.add_pods(["10.255.0.9"], n.ns, owner="uid-gone")
                in_netns(n.ns, subprocess.run, ["iptables", "-t", "nat", "-F", node.CHAIN], check=True)
                assert not node.check_node(n.ns).ok
            agent = n.start_agent()
            n.wait_synced(2 + round_)
            assert agent.get("/readyz")[0] == 200
        traffic.mark("restarted", 20)
        # Reconciled: the drifted rules are back, the node's probe rules too, and the node sets
        # hold exactly our pods.
        assert redirect.check(drifting.name, amb, backend=backend).ok
        assert node.check_node(n.ns).ok
        assert cni("CHECK", drifting, uids[3], n.events, backend) == (0, None)
        assert node.list_pods(n.ns) == {ip: uid for pod, uid in zip(pods, uids, strict=True)
                                        for ip in (pod.pod_ip4, pod.pod_ip6)}
        first = wait_log(n.tmp / "agent-2.log", lambda e: e.get("msg") == "reconciled")
        assert (first["pods"], first["intact"], first["repaired"], first["failed"]) == (4, 3, 1, 0), first
        # The second restart found every pod intact (what it logged, if not).
        assert agent.metric('redirect_agent_reconciled_total{result="intact"}') == 4, [
            e for e in read_log(agent.log) if e.get("level") != "info" or e.get("msg") == "reconciled"]
        assert agent.metric("redirect_agent_pods_enrolled") == 4
        # The node proxy: a new one takes over from the snapshot.
        assert n.proxy is not None
        traffic.mark("proxy-down", 20)
        n.proxy.send_signal(signal.SIGTERM)
        n.proxy.wait(10)
        n.start_proxy()  # returns once it has the snapshot (listeners open)
        traffic.mark("end", 0)
        # Handover: a new proxy starts beside the running one, then the old one stops.
        old = n.proxy
        traffic.mark("handover", 30)
        n.start_proxy()
        old.send_signal(signal.SIGTERM)
        assert old.wait(10) == 0
        traffic.mark("done", 30)
    # Every probe from before the first SIGKILL to after the last restart was captured and answered.
    steady = traffic.of("steady", "kill0", "kill1", "restarted")
    assert len(steady) >= 60
    bad = [s for s in steady if not s.ok]
    assert not bad, (f"{len(bad)} of {len(steady)} probes failed during agent restarts: {bad[:3]}; proxy saw: "
                     f"{[e for e in read_log(n.proxy_log) if e.get('src') == list(bad[0].local or ())]}")
    # While no proxy ran, nothing got through uncaptured (connections fail, closed); afterwards all flows.
    after = traffic.of("end", "handover")
    assert len(after) >= 60 and all(s.ok for s in after), [s for s in after if not s.ok][:3]
    assert_all_through_proxy(n, traffic.of("steady", "kill0", "kill1", "restarted", "proxy-down", "end",
                                           "handover", "done"), servers)
    print({p: (len(traffic.of(p)), sum(not s.ok for s in traffic.of(p))) for p in dict(traffic.sent)})
    # Across agent restarts the proxy never let go of a pod (listeners stayed open).
    added = [e["pod"] for e in n.proxy_events("pod_added")]
    assert sorted(added) == sorted(uids * 3), added  # once per proxy process
    assert not [e for e in n.proxy_events("pod_removed") if e.get("reason") != "proxy stopping"]
    # Deleting a pod leaves nothing of it behind.
    rc, out = cni("DEL", pods[0], uids[0], n.events, backend)
    assert rc == 0, out
    nothing_left(pods[0].name, n.ns, uids[0], backend)
    for pod, uid in zip(pods[1:], uids[1:], strict=True):
        assert cni("DEL", pod, uid, n.events, backend)[0] == 0
        nothing_left(pod.name, n.ns, uid, backend)
    assert node.list_pods(n.ns) == {}


@contextlib.contextmanager
def light_pods(count: int) -> Iterator[list[tuple[str, str, str]]]:
    """``count`` namespaces without a peer netns: lo plus eth0 with 10.77.<i>.2/24, whose veth peer
    stays in the same netns unaddressed (this kernel has no dummy links). Yields (name, ip, gateway).

    Real netns and real rules, just nobody behind eth0: outbound to the gateway is captured by
    the rules (the proxy's accept proves it) and the proxy's forward then goes nowhere."""
    names: list[str] = []
    try:
        out = []
        for i in range(count):
            name = netkit.create_netns(f"rdrt-light-{os.urandom(3).hex()}-{i}")
            names.append(name)
            with netkit.netlink_in(name) as nl:
                netlink.set_up(1, sock=nl)  # lo
                netlink.add_veth("eth0", "eth0p", sock=nl)
                netlink.set_up(netlink.link_index("eth0p", sock=nl), sock=nl)
                idx = netlink.link_index("eth0", sock=nl)
                netlink.addr("add", socket.AF_INET, idx, f"10.77.{i}.2", 24, 0, sock=nl)
                netlink.set_up(idx, sock=nl)
            out.append((name, f"10.77.{i}.2", f"10.77.{i}.1"))
        yield out
    finally:
        for name in names:
            netkit.remove_netns(name)


def _netns_fds(pid: int) -> int:
    """How many network namespaces process ``pid`` holds open by fd."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("net:[")
    return count


def _connect_once(ns: str, dst: str, port: int) -> tuple[str, int]:
    """Connect from ``ns`` and close at once: the proxy may accept after the client is gone, and
    still reads the original destination (netfilter's conntrack entry, eBPF's, live as long as
    the connection)."""
    from redirect.kernel import netns as rnetns

    with rnetns.enter(ns), socket.socket() as s:
        s.settimeout(3)
        s.connect((dst, port))
        return s.getsockname()  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend_node", BACKENDS, indirect=True)
def test_hundred_pods_at_once_ops_endpoints_and_graceful_stop(backend_node: Node) -> None:
    """100 concurrent adds (straight to the events socket; the CNI path is covered above): all
    enrolled, each in its own netns with its own record, no cross-talk; /healthz, /readyz,
    /metrics; SIGTERM leaves every pod captured; a restart finds all 100; 100 concurrent deletes."""
    n = backend_node
    agent = n.start_agent("--workers", "16")
    assert agent.get("/healthz") == (200, "ok\n")
    n.start_proxy()
    assert n.proxy is not None
    proxy_fds = _netns_fds(n.proxy.pid)
    count = 100
    with light_pods(count) as pods:
        uids = [f"uid-c{i}-{os.urandom(3).hex()}" for i in range(count)]
        results: list[Any] = [None] * count

        def add(i: int) -> None:
            try:
                results[i] = client.add_pod(n.events, uid=uids[i], netns=f"/run/netns/{pods[i][0]}",
                                            name=f"pod-{i}", namespace="load", ips=[pods[i][1]], timeout=60)
            except client.AgentError as e:
                results[i] = e

        t0 = time.monotonic()
        threads = [threading.Thread(target=add, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        add_s = time.monotonic() - t0
        failed = [(i, r) for i, r in enumerate(results) if not isinstance(r, dict) or not r.get("enrolled")]
        assert not failed, failed[:3]
        print(f"{count} concurrent adds: {add_s:.2f} s")

        inodes = {uids[i]: os.stat(f"/run/netns/{pods[i][0]}").st_ino for i in range(count)}
        listed = {p["uid"]: p["netns_inode"] for p in client.list_pods(n.events)}
        assert listed == inodes
        for i in range(count):
            rec = record_of(pods[i][0])
            assert rec is not None and rec["uid"] == uids[i] and rec["name"] == f"pod-{i}", rec
        assert {e["pod"]: e["netns_inode"] for e in n.proxy_events("pod_added")} == inodes
        assert node.list_pods(n.ns) == {pods[i][1]: uids[i] for i in range(count)}
        # No cross-talk: each netns's outbound lands on the proxy's listener of that pod.
        locals_ = [_connect_once(ns, gw, 80) for ns, _, gw in pods]
        for i, (ip, port) in enumerate(locals_):
            e = wait_log(n.proxy_log, lambda e, ip=ip, port=port: e["event"] == "accept" and e["src"] == [ip, port])
            assert e["pod"] == uids[i] and e["orig_dst"] == [pods[i][2], 80] and e["kind"] == "outbound", e

        # Ops.
        code, body = agent.get("/readyz")
        assert code == 200 and json.loads(body) == {"ready": True, "pods": count, "proxies": 1,
                                                   "backend": n.backend}
        assert agent.metric("redirect_agent_pods_enrolled") == count
        assert agent.metric("redirect_agent_proxy_connections") == 1
        assert agent.metric('redirect_agent_events_total{type="add"}') == count
        assert agent.metric("redirect_agent_setup_seconds_count") == count
        assert agent.metric('redirect_agent_setup_seconds_bucket{le="+Inf"}') == count
        assert agent.get("/nope")[0] == 404
        for line in agent.log.read_text().splitlines():
            rec = json.loads(line)  # structured: every line is one JSON object
            assert {"time", "level", "logger", "msg"} <= rec.keys(), rec

        # SIGTERM: the agent goes, the pods stay captured and served.
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(10) == 0
        assert not os.path.exists(n.events) and not os.path.exists(n.proxy_sock)
        amb = redirect.RedirectConfig(mode="ambient")
        for ns, _, _ in pods[:5]:
            assert redirect.check(ns, amb, backend=n.backend).ok
        ip, port = _connect_once(pods[7][0], pods[7][2], 80)
        assert wait_log(n.proxy_log, lambda e: e["event"] == "accept" and e["src"] == [ip, port])["pod"] == uids[7]

        # A restart finds all of them in the kernel.
        agent = n.start_agent()
        rec = wait_log(agent.log, lambda e: e.get("msg") == "reconciled")
        assert (rec["pods"], rec["intact"]) == (count, count), (rec, [
            e for e in read_log(agent.log) if str(e.get("msg", "")).startswith("pod rules")])
        print(f"restart found {count} pods in {rec['ms']} ms")
        n.wait_synced(2)

        # 100 deletes at once.
        dels: list[Any] = [None] * count

        def delete(i: int) -> None:
            try:
                dels[i] = client.del_pod(n.events, uid=uids[i], netns=f"/run/netns/{pods[i][0]}", timeout=60)
            except client.AgentError as e:
                dels[i] = e

        threads = [threading.Thread(target=delete, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(isinstance(d, dict) and d["removed"] for d in dels), [d for d in dels if not isinstance(d, dict)]
        assert node.list_pods(n.ns) == {}
        assert agent.metric("redirect_agent_pods_enrolled") == 0
        for i in range(0, count, 10):
            nothing_left(pods[i][0], n.ns, uids[i], n.backend)
        assert all(record_of(ns) is None for ns, _, _ in pods)
        assert len(n.proxy_events("pod_removed")) >= count
        # Nothing of the pods stays pinned: the proxy holds no more netns fds than before.
        deadline = time.monotonic() + 10
        while _netns_fds(n.proxy.pid) != proxy_fds and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _netns_fds(n.proxy.pid) == proxy_fds
        assert agent.proc.pid and _netns_fds(agent.proc.pid) == 0


def test_agent_refuses_bad_flags_and_a_second_agent_on_its_sockets(test_node: Node) -> None:
    def agent(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "redirect.ambient.agent.daemon",
                               "--events-socket", test_node.events, "--proxy-socket", test_node.proxy_sock,
                               "--http-port", "0", "--no-host-rules", "--no-proc-scan", *argv],
                              capture_output=True, text=True, timeout=30)

    p = agent("--capture", '{"proxy_port": 0}')
    assert p.returncode == 2 and "capture.proxy_port" in p.stderr and "0" in p.stderr, p.stderr
    p = agent("--capture", "[1]")
    assert p.returncode == 2 and "--capture" in p.stderr, p.stderr
    p = agent("--workers", "0")
    assert p.returncode == 2 and "--workers" in p.stderr, p.stderr
    test_node.start_agent()
    p = agent()
    assert p.returncode == 1 and "another agent is listening" in p.stderr, p.stderr
    assert os.path.exists(test_node.events)  # the running agent's socket is untouched
    assert test_node.agent is not None and test_node.agent.get("/healthz")[0] == 200


def test_a_pod_known_only_through_its_process_is_found_after_a_restart(test_node: Node) -> None:
    """No /run/netns entry: the netns exists because a process lives in it (/proc/<pid>/ns/net)."""
    n = test_node
    agent = n.start_agent()
    n.start_proxy()
    proc = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", "ip link set lo up && exec sleep 60"])
    try:
        path = f"/proc/{proc.pid}/ns/net"
        deadline = time.monotonic() + 5
        while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep":  # lo is up, netns made
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        res = client.add_pod(n.events, uid="uid-proc", netns=path, name="p", namespace="ns", ips=["10.250.9.9"])
        assert res["enrolled"]
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(5)
        agent = n.start_agent()
        rec = wait_log(agent.log, lambda e: e.get("msg") == "reconciled")
        assert (rec["pods"], rec["intact"]) == (1, 1), rec
        (pod,) = client.list_pods(n.events)
        assert pod["uid"] == "uid-proc" and pod["netns"] == path and pod["netns_inode"] == os.stat(path).st_ino
        assert node.list_pods(n.ns) == {"10.250.9.9": "uid-proc"}
        assert client.del_pod(n.events, uid="uid-proc", netns=path)["removed"]
        nothing_left(path, n.ns, "uid-proc")
    finally:
        proc.kill()
        proc.wait(5)


def test_resync_repairs_drift_while_running_and_drops_pods_whose_netns_went(
        test_node: Node, make_pod: Callable[..., Pod]) -> None:
    n = test_node
    agent = n.start_agent("--resync-seconds", "0.3")
    n.start_proxy()
    pods = [make_pod(), make_pod()]
    for i, pod in enumerate(pods):
        assert cni("ADD", pod, f"uid-s{i}", n.events)[0] == 0
    amb = redirect.RedirectConfig(mode="ambient")

    def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"not {what} after {timeout} s: {agent.log.read_text()[-2000:]}"
            time.sleep(0.05)

    in_netns(pods[0].name, subprocess.run, TAMPER["iptables"], check=True)
    node.remove_pods([pods[0].pod_ip6], n.ns)
    in_netns(n.ns, subprocess.run, ["ip6tables", "-t", "nat", "-F", node.CHAIN], check=True)
    until(lambda: redirect.check(pods[0].name, amb).ok, "pod rules repaired")
    until(lambda: node.check_node(n.ns).ok, "node probe rules repaired")
    until(lambda: node.list_pods(n.ns).get(pods[0].pod_ip6) == "uid-s0", "node-set entry back")
    assert agent.metric('redirect_agent_resynced_total{result="repaired"}') >= 1
    # The runtime lost the pod without a DEL: its netns goes away (the proxy's fd kept it alive).
    netkit.remove_netns(pods[1].name)
    until(lambda: [p["uid"] for p in client.list_pods(n.events)] == ["uid-s0"], "pod dropped")
    wait_log(n.proxy_log, lambda e: e["event"] == "pod_removed" and e["pod"] == "uid-s1", 5)
    # The agent drops the pod from its list, tells the proxies, then removes its node-set entries:
    # wait for the last of these.
    until(lambda: "uid-s1" not in node.list_pods(n.ns).values(), "node-set entries of the gone pod removed")
    gone = 'redirect_agent_resynced_total{result="gone"}'
    until(lambda: gone in agent.get("/metrics")[1] and agent.metric(gone) == 1, "resync counted it gone")
    # The node's sets are destroyed under the agent: the next ADD (or resync) puts them back.
    node.teardown_node(n.ns)
    assert cni("ADD", pods[0], "uid-s0", n.events)[0] == 0
    assert node.check_node(n.ns).ok and node.list_pods(n.ns)[pods[0].pod_ip4] == "uid-s0"
    assert cni("DEL", pods[0], "uid-s0", n.events)[0] == 0
    nothing_left(pods[0].name, n.ns, "uid-s0")


# --- a real runtime: containerd + ctr run --cni, through the agent ---------------------------------

@needs_containerd
def test_containerd_pod_enrolled_through_the_agent_and_cleaned_up(
        containerd: Containerd, test_node: Node) -> None:  # noqa: F811 - pytest's fixture by name
    """``ctr run --cni`` (bridge + host-local + redirect-cni in ambient mode with agentSocket): the
    container starts only once the agent enrolled it; its traffic goes through the node proxy;
    the runtime's DEL (empty CNI_NETNS) leaves nothing of it in the agent, proxy or node sets."""
    from redirect.cni import install as inst

    n = test_node
    n.start_agent()
    n.start_proxy()
    with bridge_net(containerd.base, "rdrt-amb", 245) as net:
        log_file = os.path.join(containerd.base, "cni.log")
        inst.install(net.net_d, net.bin_d, {"mode": "ambient", "agentSocket": n.events, "agentTimeout": 10,
                                            "logFile": log_file, "logLevel": "info"})
        cid = f"rdrt-{os.urandom(3).hex()}"
        uid = f"default-{cid}"  # ctr's CNI_CONTAINERID; no K8S_POD_UID outside Kubernetes
        try:
            with ctr_run(containerd, net, cid) as run:
                pid = wait_task(containerd, cid, run)
                (pod,) = client.list_pods(n.events)  # enrolled before the task ran
                assert pod["uid"] == uid and pod["netns_inode"] == os.stat(f"/proc/{pid}/ns/net").st_ino
                assert node.list_pods(n.ns) == {ip: uid for ip in pod["ips"]}
                assert pod["ips"][0].startswith(f"{net.prefix}.")
                containerd.ctr("task", "exec", "--exec-id", "probe", cid, "/bin/busybox", "sh", "-c",
                               f"echo hi | /bin/busybox nc -w 1 {net.target} 8080", timeout=15)
                e = wait_log(n.proxy_log, lambda e: e["event"] == "accept" and e["pod"] == uid)
                assert e["orig_dst"] == [net.target, 8080] and e["kind"] == "outbound", e
                containerd.ctr("task", "kill", "-s", "KILL", cid)
                run.wait(20)
                assert "removed by the node agent" in open(log_file).read()
                assert client.list_pods(n.events) == []
                assert node.list_pods(n.ns) == {}
                wait_log(n.proxy_log, lambda e: e["event"] == "pod_removed" and e["pod"] == uid, 5)
        finally:
            inst.uninstall(net.net_d, net.bin_d)


# --- the trust boundary: what a pod, an unprivileged user or a bad peer can write ----------------


def in_pod_record_text(rec: dict[str, Any]) -> str:
    """``ipset restore`` input for a record inside a netns as earlier releases wrote it (a
    ``rdr-pod-identity`` set whose entries' comments carry base64url JSON): what a forger writes."""
    import base64

    raw = json.dumps({"rv": 1, **rec}, separators=(",", ":"), sort_keys=True).encode()
    text = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    lines = [f"create {legacy.SET} bitmap:port range 0-63 comment"]
    lines += [f'add {legacy.SET} {i} comment "{text[o:o + 240]}"' for i, o in enumerate(range(0, len(text), 240))]
    return "\n".join(lines) + "\n"


class UserPod:
    """A network namespace a user namespace of ``nobody`` owns (``unshare -Urn`` as 65534), as a
    runtime makes a ``hostUsers: false`` pod's, held by a process inside (whose root has
    CAP_NET_ADMIN there and nowhere else). ``pin=True`` bind-mounts it under /run/netns as runtimes
    pin sandboxes (``path`` is then that pin, else ``/proc/<pid>/ns/net``). ``as_pod_root(script,
    stdin)`` runs a shell script as that root, in that netns."""

    def __init__(self, pin: bool) -> None:
        self.proc = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "unshare", "-Urn", "sh", "-c",
             "ip link set lo up && echo ready && exec sleep 300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n", self.proc.stderr.read() if self.proc.stderr else b""
        self.pid = self.proc.pid
        self.pin: str | None = None
        self.path = f"/proc/{self.pid}/ns/net"
        if pin:
            self.pin = f"{netkit.NETNS_DIR}/rdrt-userpod-{os.urandom(3).hex()}"
            Path(self.pin).touch()
            subprocess.run(["mount", "--bind", self.path, self.pin], check=True)
            self.path = self.pin

    def as_pod_root(self, script: str, stdin: str = "") -> None:
        """``script`` as the pod's root: in its user and network namespaces, as its uid 0."""
        p = subprocess.run(["nsenter", f"--target={self.pid}", "--user", "--net", "--", "sh", "-c", script],
                           input=stdin.encode(), capture_output=True, timeout=30)
        assert p.returncode == 0, p.stderr.decode()

    def stop_process(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)

    def close(self) -> None:
        self.stop_process()
        if self.pin is not None:
            subprocess.run(["umount", self.pin], check=False, capture_output=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pin)


@contextlib.contextmanager
def user_pods(*pins: bool) -> Iterator[list[UserPod]]:
    pods: list[UserPod] = []
    try:
        for pin in pins:
            pods.append(UserPod(pin))
        yield pods
    finally:
        for p in pods:
            p.close()


@contextlib.contextmanager
def server_behind_node(node_ns: str, ip: str, node_ip: str) -> Iterator[TcpListener]:
    """A netns holding ``ip`` with a listener on port 8080, reached from ``node_ns`` (which gets
    ``node_ip`` on the same /24) over a veth pair: somewhere the node's own TCP goes."""
    name = netkit.create_netns(f"rdrt-srv-{os.urandom(3).hex()}")
    try:
        for argv in (["ip", "-n", node_ns, "link", "add", "rdrt-srv0", "type", "veth", "peer", "name", "eth0",
                      "netns", name],
                     ["ip", "-n", node_ns, "addr", "add", f"{node_ip}/24", "dev", "rdrt-srv0"],
                     ["ip", "-n", node_ns, "link", "set", "rdrt-srv0", "up"],
                     ["ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "eth0"],
                     ["ip", "-n", name, "link", "set", "eth0", "up"],
                     ["ip", "-n", name, "link", "set", "lo", "up"]):
            subprocess.run(argv, check=True, capture_output=True)
        with TcpListener(name, APP, label="server") as srv:
            yield srv
    finally:
        netkit.remove_netns(name)  # (the node's end of the veth goes with it)


def test_a_record_forged_inside_a_netns_is_never_adopted_pinned_or_not(
        test_node: Node, make_pod: Callable[..., Pod]) -> None:
    """The attack on a node agent that believed records kept in pods' netns: ``nobody`` makes a
    netns of its own (``unshare -Urn``), writes a record there as the agent's earlier releases
    wrote theirs (this node, enrolled, addresses 192.0.2.88 and 198.51.100.1), and pins it under
    /run/netns as a runtime pins a ``hostUsers: false`` pod; another is left unpinned; a root-made
    netns gets one as a pod with NET_ADMIN could write it, and an enrolled pod gets one naming more
    addresses. A restarted agent adopts none of them and logs each: no pod is listed, no address
    enters the node's probe set, and the node's own TCP to 198.51.100.1 is answered as before (not
    SNATed to the probe address). The enrolled pod keeps its record (on the node) and loses the
    forged one. Its store is out of the pods' reach: neither ``nobody`` nor the root of its user
    namespace can list it or write a record there."""
    n = test_node
    agent = n.start_agent()
    n.start_proxy()
    real = make_pod()
    assert cni("ADD", real, "uid-real", n.events)[0] == 0
    sets_before = node.list_pods(n.ns)
    forged = {"node": n.name, "uid": "uid-forged", "name": "x", "namespace": "ns", "netns": "", "container_id": "c",
              "backend": "iptables", "config": {"mode": "ambient"}, "phase": "enrolled",
              "ips": ["192.0.2.88", "198.51.100.1"]}
    takeover = {**forged, "uid": "uid-real", "ips": [real.pod_ip4, "198.51.100.1"]}
    root_made = netkit.create_netns(f"rdrt-forged-{os.urandom(3).hex()}")
    try:
        in_netns(root_made, subprocess.run, ["ipset", "restore"], input=in_pod_record_text(forged).encode(),
                 check=True)
        in_netns(real.name, subprocess.run, ["ipset", "restore"], input=in_pod_record_text(takeover).encode(),
                 check=True)
        with user_pods(True, False) as (pinned, unpinned):
            pinned.as_pod_root("ipset restore", in_pod_record_text(forged))
            unpinned.as_pod_root("ipset restore", in_pod_record_text(takeover))
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(5)
            agent = n.start_agent()
            rec = wait_log(agent.log, lambda e: e.get("msg") == "reconciled")
            assert rec["pods"] == 1 and rec["ignored"] >= 3, rec
            ignored = "pod record ignored: a record inside a netns"
            why = {e["netns"] for e in read_log(agent.log) if e.get("msg", "").startswith(ignored)}
            assert {pinned.path, f"{netkit.NETNS_DIR}/{root_made}"} <= why, why
            assert unpinned.path in why or any(os.stat(p).st_ino == os.stat(unpinned.path).st_ino for p in why), why
            (pod,) = client.list_pods(n.events)
            assert pod["uid"] == "uid-real" and pod["ips"] == [real.pod_ip4, real.pod_ip6], pod
            assert node.list_pods(n.ns) == sets_before
            assert {"uid-real"} == set(records_of(n.name))
            # what the forger wrote is left where it is, but the enrolled pod's netns is repaired
            assert all(legacy.exists(p) for p in (pinned.path, unpinned.path, root_made))
            assert not legacy.exists(real.name)
            with server_behind_node(n.ns, "198.51.100.1", "198.51.100.2") as srv:
                r = tcp_probe_detail(n.ns, "198.51.100.1", APP, timeout=5)
                assert r.ok and r.label == "server", r
                seen = srv.conn_for(r.token)
                assert seen is not None and seen.peer[0] == "198.51.100.2", seen
            n.wait_synced(2)
            with servers_for([real]) as servers:
                s = send(real, "out")
                assert s.label == "server4", s
                assert_all_through_proxy(n, [s], servers)
            # the store: root's alone, out of reach of the pod's root and of nobody
            d = os.path.join(store.locks.run_dir_path(), store.DIR)
            st = os.stat(d)
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
            forged_file = os.path.join(d, store.name_of(rnetns.netns_key(pinned.path)))
            for who in (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"],
                        ["nsenter", f"--target={pinned.pid}", "--user", "--"]):
                for script in (f"ls {d}", f"echo '{{}}' > {forged_file}"):
                    p = subprocess.run([*who, "sh", "-c", script], capture_output=True, text=True, timeout=10)
                    assert p.returncode != 0 and "Permission denied" in p.stderr, (who, script, p.stderr)
            assert not os.path.exists(forged_file)
    finally:
        netkit.remove_netns(root_made)
    assert cni("DEL", real, "uid-real", n.events)[0] == 0
    nothing_left(real.name, n.ns, "uid-real")


def test_user_namespaced_pods_pinned_or_not_are_adopted_from_the_node_record_and_repaired(
        test_node: Node) -> None:
    """Pods whose netns a user namespace of ``nobody`` owns (``hostUsers: false``), one pinned under
    /run/netns and one known by its process only, are enrolled; their root then writes a record in
    each netns naming other addresses and flushes our rules. A restarted agent adopts both from its
    own records (their addresses, not the forged ones), re-installs the rules and removes the
    forged records. A pod whose netns has no path left (its process gone; the node proxy's fd
    still holds the netns) is found gone at the next start: its record, its node-set entry and the
    proxy's hold on it go."""
    n = test_node
    agent = n.start_agent()
    n.start_proxy()
    amb = redirect.RedirectConfig(mode="ambient")
    with user_pods(True, False) as (pinned, unpinned):
        ips = {"uid-pinned": "10.250.8.8", "uid-unpinned": "10.250.8.9"}
        for uid, p in (("uid-pinned", pinned), ("uid-unpinned", unpinned)):
            assert client.add_pod(n.events, uid=uid, netns=p.path, ips=[ips[uid]])["enrolled"]
            forged = {"node": n.name, "uid": uid, "name": "x", "namespace": "ns", "netns": p.path,
                      "container_id": "c", "backend": "iptables", "config": {"mode": "ambient"},
                      "phase": "enrolled", "ips": ["198.51.100.1"]}
            p.as_pod_root("ipset restore && iptables -t nat -F RDR_OUTPUT", in_pod_record_text(forged))
            assert legacy.exists(p.path) and not redirect.check(p.path, amb).ok
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(5)
        agent = n.start_agent()
        rec = wait_log(agent.log, lambda e: e.get("msg") == "reconciled")
        assert (rec["pods"], rec["repaired"], rec["failed"], rec["gone"]) == (2, 2, 0, 0), rec
        assert sorted(p["uid"] for p in client.list_pods(n.events)) == ["uid-pinned", "uid-unpinned"]
        assert node.list_pods(n.ns) == {ip: uid for uid, ip in ips.items()}
        for p in (pinned, unpinned):
            assert redirect.check(p.path, amb).ok and not legacy.exists(p.path)
        # The unpinned pod's process goes: its netns has no path left (the proxy's fd keeps it).
        n.wait_synced(2)
        unpinned_key = rnetns.netns_key(unpinned.path)
        unpinned.stop_process()
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(5)
        agent = n.start_agent()
        rec = wait_log(agent.log, lambda e: e.get("msg") == "reconciled")
        assert (rec["pods"], rec["gone"]) == (1, 1), rec
        assert [p["uid"] for p in client.list_pods(n.events)] == ["uid-pinned"]
        assert node.list_pods(n.ns) == {"10.250.8.8": "uid-pinned"}
        assert store.read(unpinned_key) is None and set(records_of(n.name)) == {"uid-pinned"}
        wait_log(n.proxy_log, lambda e: e["event"] == "pod_removed" and e["pod"] == "uid-unpinned", 10)
        assert client.del_pod(n.events, uid="uid-pinned", netns=pinned.path)["removed"]
        nothing_left(pinned.path, n.ns, "uid-pinned")


def test_a_record_is_taken_only_for_the_netns_it_names(test_node: Node) -> None:
    """A pod's netns pin is removed and a new netns pinned under the same name while the agent is
    down: the record is not taken for the new netns (its cookie is another), the old one has no
    path left, so the pod is gone and nothing is installed in the new netns. A pod enrolled by its
    process's path, pinned too, whose process went: found by its pin (inode and cookie)."""
    n = test_node
    agent = n.start_agent()
    n.start_proxy()
    name = netkit.create_netns(f"rdrt-reused-{os.urandom(3).hex()}")
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    holder = subprocess.Popen(["unshare", "--net", "--", "sh", "-c",
                               "ip link set lo up && echo ready && exec sleep 300"], stdout=subprocess.PIPE)
    pin = f"{netkit.NETNS_DIR}/rdrt-pinned-{os.urandom(3).hex()}"
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        by_proc = f"/proc/{holder.pid}/ns/net"
        assert client.add_pod(n.events, uid="uid-reused", netns=f"{netkit.NETNS_DIR}/{name}",
                              ips=["10.250.7.7"])["enrolled"]
        assert client.add_pod(n.events, uid="uid-byproc", netns=by_proc, ips=["10.250.7.8"])["enrolled"]
        byproc_key = rnetns.netns_key(by_proc)
        Path(pin).touch()
        subprocess.run(["mount", "--bind", by_proc, pin], check=True)
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(5)
        netkit.remove_netns(name)
        netkit.create_netns(name)  # the same name, another netns
        holder.kill()
        holder.wait(5)
        agent = n.start_agent()
        rec = wait_log(agent.log, lambda e: e.get("msg") == "reconciled")
        assert (rec["pods"], rec["gone"]) == (1, 1), rec
        (pod,) = client.list_pods(n.events)
        assert (pod["uid"], pod["netns"]) == ("uid-byproc", pin) and rnetns.netns_key(pin) == byproc_key
        shown = redirect.show(name, backend="iptables")
        assert not shown["installed"] and not shown["routes"], shown
        assert node.list_pods(n.ns) == {"10.250.7.8": "uid-byproc"}
        assert set(records_of(n.name)) == {"uid-byproc"}
        assert client.del_pod(n.events, uid="uid-byproc", netns=pin)["removed"]
        nothing_left(pin, n.ns, "uid-byproc")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(5)
        subprocess.run(["umount", pin], check=False, capture_output=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pin)
        netkit.remove_netns(name)


def test_an_agent_does_not_start_on_a_store_others_could_write(tmp_path: Path) -> None:
    """The run directory's ``agent-pods`` open to others (or a symlink): the agent refuses to
    start, naming it, and changes nothing there."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    for make, why in ((lambda d: (d.mkdir(), d.chmod(0o777)), "agent-pods: has mode 0777"),
                      (lambda d: d.symlink_to(other), "agent-pods: is a symlink or not a directory")):
        d = run / store.DIR
        make(d)
        p = subprocess.run([sys.executable, "-m", "redirect.ambient.agent.daemon", "--events-socket",
                            str(tmp_path / "a.sock"), "--proxy-socket", str(tmp_path / "p.sock"), "--http-port", "0",
                            "--no-host-rules", "--no-proc-scan"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "REDIRECT_RUN_DIR": str(run)})
        assert p.returncode == 1 and why in p.stderr and "agent failed to start" in p.stderr, p.stderr[-2000:]
        assert os.listdir(other) == []
        if d.is_symlink():
            d.unlink()
        else:
            d.rmdir()


def _idle_seqpackets(path: str, count: int) -> list[socket.socket]:
    out = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(path)
        out.append(s)
    return out


def _status(path: str, timeout: float = 3.0) -> dict[str, Any]:
    return protocol.request(path, {"type": "status"}, timeout)


def test_idle_clients_never_starve_the_events_socket(test_node: Node) -> None:
    n = test_node
    n.start_agent()  # 16 workers
    idle = _idle_seqpackets(n.events, 40)
    try:
        t0 = time.monotonic()
        assert _status(n.events)["ready"] is True
        assert time.monotonic() - t0 < 2
    finally:
        for s in idle:
            s.close()
    # Idle clients are disconnected after --idle-timeout; past --max-clients the one idle the
    # longest makes room for a newcomer.
    assert n.agent is not None
    n.agent.proc.send_signal(signal.SIGTERM)
    n.agent.proc.wait(10)
    n.start_agent("--idle-timeout", "1", "--max-clients", "8")
    idle = _idle_seqpackets(n.events, 20)
    try:
        for _ in range(3):
            assert _status(n.events)["ready"] is True
        time.sleep(1.6)
        for s in idle:
            s.settimeout(2)
            assert s.recv(100) == b""  # closed by the agent
        assert _status(n.events)["ready"] is True
    finally:
        for s in idle:
            s.close()


def test_deeply_nested_json_is_answered_bad_request(test_node: Node) -> None:
    test_node.start_agent()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
        c.settimeout(5)
        c.connect(test_node.events)
        c.send(b'{"v": 1, "type": "add", "pod": ' + b"[" * 30000 + b"]" * 30000 + b"}")
        ans = json.loads(c.recv(65536))
        assert ans["ok"] is False and ans["reason"] == "bad_request" and "deep" in ans["error"], ans
        c.send(json.dumps({"v": 1, "type": "status"}).encode())  # the connection still serves
        assert json.loads(c.recv(65536))["ready"] is True


def fake_proxy_hello(sock: socket.socket, path: str, name: str) -> dict[str, Any]:
    """``sock`` (a SEQPACKET socket) connected to the agent's proxy socket at ``path`` as a node
    proxy named ``name`` that said hello: the empty snapshot's ``snapshot_done``, not acked yet."""
    sock.settimeout(10)
    sock.connect(path)
    protocol.send(sock, {"type": "hello", "proxy": name, "pid": os.getpid()})
    msg, _ = protocol.recv(sock, max_fds=0) or ({}, [])
    assert msg["type"] == "snapshot_done", msg
    return msg


def test_a_malformed_ack_from_a_node_proxy_is_dropped_and_the_proxy_keeps_serving(
        test_node: Node, pod: Pod) -> None:
    """A proxy's ack with ``"id": [1]`` (and other wrong fields) is logged and dropped; the reader
    goes on, so the pod it acks next is enrolled, and /readyz counts only proxies that serve."""
    n = test_node
    agent = n.start_agent()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as p:
        msg = fake_proxy_hello(p, n.proxy_sock, "fake")
        for bad in ({"id": [1], "ok": True}, {"id": True, "ok": True}, {"id": msg["id"], "ok": "yes"},
                    {"id": -1, "ok": True}, {"id": msg["id"], "ok": True, "error": {"x": 1}}):
            protocol.send(p, {"type": "ack", **bad})
        protocol.send(p, {"type": "ack", "id": msg["id"], "ok": True})
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(res=client.add_pod(n.events, uid="uid-ack", netns=pod.path,
                                                                           ips=[pod.pod_ip4], timeout=20)))
        t.start()
        add, fds = protocol.recv(p, max_fds=1) or ({}, [])
        for fd in fds:
            os.close(fd)
        assert add["type"] == "add" and add["pod"]["uid"] == "uid-ack", add
        protocol.send(p, {"type": "ack", "id": add["id"], "ok": True})
        t.join(15)
        assert box.get("res", {}).get("enrolled"), box
        assert json.loads(agent.get("/readyz")[1])["proxies"] == 1
        bad_logged = [e for e in read_log(agent.log) if e.get("msg") == "bad ack from node proxy: dropped"]
        assert len(bad_logged) == 5, bad_logged
    deadline = time.monotonic() + 5
    while json.loads(agent.get("/readyz")[1])["proxies"] != 0:  # gone with its connection
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.del_pod(n.events, uid="uid-ack", netns=pod.path)["removed"]
    nothing_left(pod.name, n.ns, "uid-ack")


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_ops_port_bounds_its_connections_and_closes_idle_ones(test_node: Node) -> None:
    n = test_node
    agent = n.start_agent()  # --max-clients 256 by default
    before = _threads(agent.proc.pid)
    conns = []
    try:
        for _ in range(400):
            conns.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
        time.sleep(0.5)
        assert agent.get("/healthz") == (200, "ok\n")
        assert _threads(agent.proc.pid) < before + 270, (before, _threads(agent.proc.pid))
        # The oldest made room for the newer ones: closed by the agent.
        conns[0].settimeout(5)
        assert conns[0].recv(10) == b""
    finally:
        for c in conns:
            c.close()
    agent.proc.send_signal(signal.SIGTERM)
    agent.proc.wait(10)
    agent = n.start_agent("--idle-timeout", "1")
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as c:
        c.sendall(b"GET /healthz HTTP/1.0\r\n")  # never finished
        t0 = time.monotonic()
        c.settimeout(5)
        assert c.recv(100) == b"" and time.monotonic() - t0 < 3
    assert agent.get("/healthz") == (200, "ok\n")


def test_a_failed_add_naming_another_pods_netns_changes_nothing_of_that_pod(
        test_node: Node, pod: Pod) -> None:
    n = test_node
    n.start_agent()
    n.start_proxy()
    assert cni("ADD", pod, "uid-owner", n.events)[0] == 0
    before = (record_of(pod.name), node.list_pods(n.ns), redirect.show(pod.name))
    with pytest.raises(client.AgentError) as ei:
        client.add_pod(n.events, uid="uid-intruder", netns=pod.path, ips=["10.250.1.1"], backend="ebpf")
    assert (record_of(pod.name), node.list_pods(n.ns), redirect.show(pod.name)) == before
    assert ei.value.reason == "netns" and "uid-owner" in str(ei.value), ei.value
    assert [p["uid"] for p in client.list_pods(n.events)] == ["uid-owner"]
    assert cni("CHECK", pod, "uid-owner", n.events) == (0, None)
    assert not n.proxy_events("pod_removed")
    # The intruder's DEL reaching the plugin while the agent is down leaves the owner's pod alone.
    assert n.agent is not None
    n.agent.proc.send_signal(signal.SIGKILL)
    n.agent.proc.wait(5)
    in_netns(pod.name, subprocess.run, ["ipset", "restore"], check=True,  # an earlier release's in-pod record
             input=in_pod_record_text({"node": n.name, "uid": "uid-owner", "phase": "enrolled"}).encode())
    assert cni("DEL", pod, "uid-intruder", n.events, timeout=2)[0] == 0
    assert (record_of(pod.name), node.list_pods(n.ns), redirect.show(pod.name)) == before
    assert legacy.exists(pod.name)
    # The owner's DEL while the agent is down: the rules, the agent's record and the in-pod one go;
    # the restarted agent drops the node-set entries of the pod it no longer has a record of.
    assert cni("DEL", pod, "uid-owner", n.events, timeout=2)[0] == 0
    assert record_of(pod.name) is None and not legacy.exists(pod.name)
    assert not redirect.show(pod.name)["installed"]
    n.start_agent()
    assert client.list_pods(n.events) == []
    nothing_left(pod.name, n.ns, "uid-owner")
    # Adds of two pods naming one netns at once: one enrols it, the other is refused.
    n.wait_synced(2)
    results: dict[str, Any] = {}

    def add(uid: str) -> None:
        try:
            results[uid] = client.add_pod(n.events, uid=uid, netns=pod.path, ips=[pod.pod_ip4])
        except client.AgentError as e:
            results[uid] = e

    threads = [threading.Thread(target=add, args=(f"uid-race{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    (winner,) = [u for u, r in results.items() if isinstance(r, dict) and r["enrolled"]]
    assert all(r.reason == "netns" for u, r in results.items() if u != winner), results
    rec = record_of(pod.name)
    assert rec is not None and (rec["uid"], rec["phase"]) == (winner, "enrolled"), rec
    assert [p["uid"] for p in client.list_pods(n.events)] == [winner]
    assert node.list_pods(n.ns) == {pod.pod_ip4: winner}
    assert client.del_pod(n.events, uid=winner, netns=pod.path)["removed"]
    nothing_left(pod.name, n.ns, winner)


# --- enrolment is a transaction: a kill at any step leaves nothing once the runtime DELs ------------

#: (env, what the pod netns holds when the agent dies there): every step of an add, before and
#: after, per backend (inside ``redirect.setup`` the routes come first, then the rules).
_AGENT_POINTS_BEFORE = [
    ({"REDIRECT_AGENT_FAULT": "add.start"}, "nothing yet"),
    ({"REDIRECT_AGENT_FAULT": "add.intent"}, "the intent record"),
]
_AGENT_POINTS_AFTER = [
    ({"REDIRECT_AGENT_FAULT": "add.rules"}, "intent, routes, rules"),
    ({"REDIRECT_AGENT_FAULT": "add.node_set"}, "... and the node-set entries"),
    ({"REDIRECT_AGENT_FAULT": "add.proxy_sent"}, "... and the proxy's add on its way"),
    ({"REDIRECT_AGENT_FAULT": "add.proxy_acked"}, "... and the proxy's listeners"),
    ({"REDIRECT_AGENT_FAULT": "add.committed"}, "everything and the commit record, no answer"),
]
KILL_POINTS = {
    "iptables": [*_AGENT_POINTS_BEFORE,
                 ({"REDIRECT_FAULT": "iptables.before_restore_v6:kill"}, "intent, routes, no rules"),
                 ({"REDIRECT_FAULT": "iptables.before_restore_v4:kill"}, "intent, routes, IPv6 rules"),
                 *_AGENT_POINTS_AFTER],
    "nftables": [*_AGENT_POINTS_BEFORE,
                 ({"REDIRECT_FAULT": "nftables.before_transaction:kill"}, "intent, routes, no table"),
                 ({"REDIRECT_FAULT": "nftables.after_transaction:kill"}, "intent, routes, table"),
                 *_AGENT_POINTS_AFTER],
    "ebpf": [*_AGENT_POINTS_BEFORE,
             ({"REDIRECT_FAULT": "ebpf.before_entries:kill"}, "intent, routes, no map entries"),
             ({"REDIRECT_FAULT": "ebpf.before_policy:kill"}, "intent, routes, entries, no policy"),
             *_AGENT_POINTS_AFTER],
}


def pod_leftovers(pod: Pod, uid: str, node_: Node, ask_agent: bool = True) -> list[str]:
    """Whatever of an ambient pod remains anywhere: its netns (rules, policy routes, routes, sets,
    proxy listeners), the node's sets, the agent's list."""
    out = []
    for backend in ("iptables", "nftables", node_.backend):
        shown = redirect.show(pod.name, backend=backend)
        if shown["installed"] or shown["routes"] or shown["addresses"]:
            out.append(f"show {backend}: {shown}")
    fwmark = in_netns(pod.name, lambda: open("/proc/sys/net/ipv4/tcp_fwmark_accept").read().strip())
    if fwmark != "0":
        out.append(f"net.ipv4.tcp_fwmark_accept = {fwmark}")

    def cmd(*argv: str) -> str:  # ``ip route show table 100`` fails (2) while the table does not exist
        p = subprocess.run(list(argv), capture_output=True, text=True, check=False)
        assert p.returncode == 0 or "table does not exist" in p.stderr, (argv, p.stderr)
        return p.stdout

    for fam in ("-4", "-6"):
        rules = [ln for ln in in_netns(pod.name, cmd, "ip", fam, "rule").splitlines() if "lookup 100" in ln]
        routes = in_netns(pod.name, cmd, "ip", fam, "route", "show", "table", "100").strip()
        out += [f"ip {fam} rule: {r}" for r in rules] + ([f"ip {fam} route table 100: {routes}"] if routes else [])
    sets = in_netns(pod.name, cmd, "ipset", "list", "-n").split()
    out += [f"ipset {s}" for s in sets]
    listening = [ln for ln in in_netns(pod.name, cmd, "ss", "-Hltn").splitlines()
                 if any(f":{p} " in ln for p in (15001, 15006, 15008))]
    out += [f"listener {ln}" for ln in listening]
    entries = {ip: o for ip, o in node.list_pods(node_.ns).items() if o == uid or ip in (pod.pod_ip4, pod.pod_ip6)}
    out += [f"node set {ip} ({o})" for ip, o in entries.items()]
    if ask_agent:
        out += [f"agent lists {p['uid']}" for p in client.list_pods(node_.events) if p["uid"] == uid]
    return out


@pytest.mark.parametrize("backend_node", BACKENDS, indirect=True)
def test_an_add_killed_at_any_step_leaves_nothing_after_the_runtimes_del_and_a_restart(
        backend_node: Node, make_pod: Callable[..., Pod]) -> None:
    """SIGKILL the agent at every step of an ADD: the ADD fails (11, try again later); after the runtime's DEL
    (reaching the plugin while the agent is down, or the restarted agent) and the restart, nothing
    of the pod is left in its netns, the node's sets, the agent or the node proxy; a live pod's
    traffic flows through the proxy all along."""
    n = backend_node
    points = KILL_POINTS[n.backend]
    live, victim = make_pod(), make_pod()
    agent = n.start_agent()
    n.start_proxy()
    assert cni("ADD", live, "uid-live", n.events, n.backend)[0] == 0
    live_entries = node.list_pods(n.ns)
    agent.proc.send_signal(signal.SIGTERM)
    agent.proc.wait(10)
    # Each point twice: the runtime's DEL reaches the plugin while the agent is down, or the
    # agent that restarted meanwhile.
    cases = [(i, env, state, order) for i, (env, state) in enumerate(points) for order in ("down", "up")]
    agent = n.start_agent(env=cases[0][1])
    snapshots = 2
    n.wait_synced(snapshots)
    with servers_for([live]) as servers, Traffic([live], max_seconds=100) as traffic:
        traffic.mark("kills", 0)
        for k, (i, env, state, order) in enumerate(cases):
            uid = f"uid-k{k}"
            rc, out = cni("ADD", victim, uid, n.events, n.backend)
            assert rc == 1 and out is not None and out["code"] == 11 and "went away" in out["msg"], (env, out)
            assert agent.proc.wait(5) == -signal.SIGKILL, (env, agent.log.read_text()[-2000:])
            rec = record_of(victim.name)
            if i == 0:
                assert rec is None and not pod_leftovers(victim, uid, n, ask_agent=False), env
            else:  # there is something to clean up, and it says whether it was committed
                assert rec is not None and rec["phase"] == ("enrolled" if i == len(points) - 1 else "intent"), rec
            nxt = cases[k + 1][1] if k + 1 < len(cases) else {}
            if order == "down":
                rc, out = cni("DEL", victim, uid, n.events, n.backend, timeout=2)
                assert rc == 0, (env, out)
                agent = n.start_agent(env=nxt)
            else:
                agent = n.start_agent(env=nxt)
                rc, out = cni("DEL", victim, uid, n.events, n.backend)
                assert rc == 0, (env, out)
            snapshots += 1
            n.wait_synced(snapshots)
            left = pod_leftovers(victim, uid, n)
            assert not left, (env, state, order, left, agent.log.read_text()[-3000:])
            assert node.list_pods(n.ns) == live_entries, env
            assert [p["uid"] for p in client.list_pods(n.events)] == ["uid-live"], env
        traffic.mark("end", 10)
    probes = traffic.of("kills")
    assert len(probes) >= 30 and all(s.ok for s in probes), [s for s in probes if not s.ok][:3]
    assert_all_through_proxy(n, probes, servers)
    assert not [e for e in n.proxy_events("pod_removed") if e["pod"] == "uid-live"]
    # A victim the agent did enrol after all (a kill after its commit): gone too, and it can be
    # enrolled again now.
    assert cni("ADD", victim, "uid-again", n.events, n.backend)[0] == 0
    assert cni("DEL", victim, "uid-again", n.events, n.backend)[0] == 0
    assert not pod_leftovers(victim, "uid-again", n)
