"""The agent's parts without sockets or root: the enrolment transaction and its rollback, the
netns claim, ``del``, the proxy hub's snapshots and acks, the reconcile at start and the
resync, the events' answers. The kernel side is an in-memory ``Ops`` that records what is
done in which order; tests/test_agent.py runs the same parts on real namespaces, rules,
sets and sockets."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import pytest

from redirect.ambient.agent.discovery import Found
from redirect.ambient.agent.dispatch import Dispatcher
from redirect.ambient.agent.enroller import Enroller, EventError
from redirect.ambient.agent.hub import ProxyHub
from redirect.ambient.agent.metrics import Metrics
from redirect.ambient.agent.pods import ENROLLED, INTENT, PodRecord
from redirect.ambient.agent.proxies import Waiter
from redirect.ambient.agent.reconcile import Reconciler
from redirect.ambient.agent.registry import Registry
from redirect.backends.base import CheckResult
from redirect.config import RedirectConfig
from redirect.errors import NetnsError, SetupError

pytestmark = pytest.mark.noroot

NODE = "node-a"


def key(inode: int) -> tuple[int, int]:
    """The (inode, cookie) of the fake netns ``inode``."""
    return inode, 1000 + inode


class FakeFd(str):
    """A netns as ``FakeOps.open_netns`` opened it: the path it was opened at (what ``calls`` and
    ``rules`` name), bound to the netns that was there then (``key``), as an fd is."""

    key: tuple[int, int]


class FakeOps:
    """The kernel and the agent's store as the agent sees them, in memory: netns paths -> keys,
    records by netns key, installed rules, node-set entries (ip -> owner uid), netns holding an
    earlier release's in-pod record. ``calls`` lists every change in order."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[int, int]] = {}
        self.records: dict[tuple[int, int], dict[str, Any]] = {}
        self.legacy: set[str] = set()
        self.rules: dict[str, RedirectConfig] = {}
        self.rules_in: dict[tuple[int, int], RedirectConfig] = {}  # the same, by the netns they went to
        self.opened: list[FakeFd] = []  # open now
        self.on_intent: Any = None  # called when an intent record is written
        self.node: dict[str, str | None] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, Exception] = {}  # op name -> raised once
        self.found = Found()

    def netns(self, path: str, inode: int) -> str:
        self.keys[path] = key(inode)
        return path

    def _maybe_fail(self, op: str) -> None:
        e = self.fail.pop(op, None)
        if e is not None:
            raise e

    def netns_key(self, path: str) -> tuple[int, int]:
        if path not in self.keys:
            raise NetnsError(f"netns={path!r}: no such namespace")
        return self.keys[path]

    def open_netns(self, path: str, k: tuple[int, int] | None = None) -> tuple[FakeFd, tuple[int, int]]:
        got = self.netns_key(path)
        if k is not None and got != k:
            raise NetnsError(f"netns={path!r}: gone or replaced")
        ref = FakeFd(path)
        ref.key = got
        self.opened.append(ref)
        return ref, got

    def close_netns(self, ref: FakeFd) -> None:
        self.opened.remove(ref)

    def find_netns(self, path: str, k: tuple[int, int]) -> tuple[FakeFd, str]:
        """At ``path`` if that is still the netns ``k``, else at another path of it."""
        try:
            return self.open_netns(path, k)[0], path
        except NetnsError:
            where = next((p for p, got in self.keys.items() if got == k), None)
            if where is None:
                raise
            return self.open_netns(where, k)[0], where

    def host_netns_reason(self, ref: FakeFd) -> str | None:
        return "the host's network namespace" if ref == "/proc/1/ns/net" else None

    def same_netns(self, path: str, k: tuple[int, int]) -> bool:
        return self.keys.get(path) == k

    def read_record(self, k: tuple[int, int]) -> dict[str, Any] | None:
        return self.records.get(k)

    def write_record(self, k: tuple[int, int], record: dict[str, Any]) -> None:
        self.calls.append(("record", k, record["phase"]))
        self.records[k] = record
        if record["phase"] == INTENT and self.on_intent is not None:
            self.on_intent()

    def clear_record(self, k: tuple[int, int]) -> None:
        self.calls.append(("clear", k))
        self.records.pop(k, None)

    def clear_legacy(self, netns: str) -> bool:
        if netns not in self.legacy:
            return False
        self.calls.append(("legacy-", netns))
        self.legacy.discard(netns)
        return True

    def setup_rules(self, netns: FakeFd, cfg: RedirectConfig, backend: str) -> None:
        self._maybe_fail("setup_rules")
        self.calls.append(("setup", netns, backend))
        self.rules[netns] = cfg
        self.rules_in[netns.key] = cfg

    def check_rules(self, netns: FakeFd, cfg: RedirectConfig, backend: str) -> CheckResult:
        ok = self.rules.get(netns) == cfg
        return CheckResult(ok, "iptables", () if ok else ("rules differ",))

    def teardown_rules(self, netns: FakeFd, backend: str | None = None) -> None:
        self.calls.append(("teardown", netns))
        self.rules.pop(netns, None)
        self.rules_in.pop(netns.key, None)

    def setup_node(self) -> bool:
        self.calls.append(("setup_node",))
        return False

    def add_node_ips(self, ips: Iterable[str], owner: str) -> None:
        self._maybe_fail("add_node_ips")
        ips = list(ips)
        self.calls.append(("node+", tuple(ips), owner))
        self.node.update(dict.fromkeys(ips, owner))

    def remove_node_ips(self, ips: Iterable[str], owner: str) -> None:
        ips = list(ips)
        self.calls.append(("node-", tuple(ips), owner))
        for ip in ips:
            if self.node.get(ip) == owner:
                del self.node[ip]

    def node_ips(self) -> dict[str, str | None]:
        return dict(self.node)

    def discover(self) -> Found:
        return self.found


class FakePeer:
    """A node proxy: records what it is sent; acks each message as ``answer`` says (True: ok,
    a string: an error, None: never)."""

    def __init__(self, name: str = "ztunnel#1", answer: bool | str | None = True) -> None:
        self.name = name
        self.synced = threading.Event()
        self.answer = answer
        self.got: list[dict[str, Any]] = []
        self.netns_of: dict[str, tuple[int, int] | None] = {}  # uid -> the netns its last add was given
        self.closed = False

    @property
    def serving(self) -> bool:
        return not self.closed

    def enqueue(self, msg: dict[str, Any], fd: int | None = None) -> Waiter:
        self.got.append(msg)
        w = Waiter()
        if self.answer is True:
            w.done(True)
        elif isinstance(self.answer, str):
            w.done(False, self.answer)
        return w

    def send_add(self, pod: PodRecord, netns: Any = None) -> Waiter:
        self.netns_of[pod.uid] = netns.key if netns is not None else None
        return self.enqueue({"type": "add", "pod": pod.for_proxy()})

    def close(self, why: str = "closed") -> None:
        self.closed = True

    def kinds(self) -> list[tuple[str, str]]:
        return [(m["type"], m.get("uid") or m.get("pod", {}).get("uid", "")) for m in self.got]


class Parts:
    def __init__(self, timeout: float = 1.0, host_rules: bool = True) -> None:
        self.ops = FakeOps()
        self.metrics = Metrics()
        self.registry = Registry(self.metrics)
        self.hub = ProxyHub(self.registry, self.metrics, timeout)
        self.enroller = Enroller(self.registry, self.hub, self.ops, base=RedirectConfig(mode="ambient"),
                                 backend="iptables", node_name=NODE, host_rules=host_rules)
        self.reconciler = Reconciler(self.enroller, self.metrics, workers=2)
        self.dispatcher = Dispatcher(self.enroller, self.metrics, lambda: (True, {}))

    def peer(self, **kw: Any) -> FakePeer:
        p = FakePeer(**kw)
        self.hub.await_snapshot(p, *self.hub.attach(p))
        return p

    def event(self, uid: str, inode: int, **kw: Any) -> dict[str, Any]:
        path = self.ops.netns(f"/run/netns/{uid}", inode)
        return {"uid": uid, "name": f"web-{uid}", "namespace": "default", "netns": path, "ips": [f"10.1.0.{inode}"],
                "container_id": f"c-{uid}", **kw}


def test_an_add_writes_intent_rules_node_set_proxies_then_the_commit_record_last() -> None:
    t = Parts()
    peer = t.peer()
    out = t.enroller.add(t.event("a", 7))
    assert out == {"enrolled": True, "pod": "a", "proxies": 1}
    assert t.ops.calls == [("record", key(7), INTENT), ("setup", "/run/netns/a", "iptables"),
                           ("node+", ("10.1.0.7",), "a"), ("record", key(7), ENROLLED)]
    assert peer.kinds() == [("snapshot_done", ""), ("add", "a")]
    assert set(t.registry.pods) == {"a"} and not t.registry.enrolling and not t.registry.claims
    assert t.metrics.pods_enrolled == 1


def test_a_pod_no_proxy_takes_is_rolled_back_and_leaves_nothing() -> None:
    t = Parts()
    peer = t.peer(answer="no listener")
    with pytest.raises(EventError) as ei:
        t.enroller.add(t.event("a", 7))
    assert ei.value.reason == "proxy" and "ztunnel#1: no listener" in str(ei.value)
    assert t.ops.records == {} and t.ops.rules == {} and t.ops.node == {}
    assert t.ops.calls[-3:] == [("teardown", "/run/netns/a"), ("node-", ("10.1.0.7",), "a"), ("clear", key(7))]
    assert peer.kinds()[-1] == ("del", "a")  # the proxy drops what it may have opened
    assert not t.registry.pods and not t.registry.enrolling and not t.registry.claims


def test_a_proxy_that_never_acks_fails_the_add_after_the_timeout() -> None:
    t = Parts(timeout=0.05)
    t.peer(answer=None)
    with pytest.raises(EventError) as ei:
        t.enroller.add(t.event("a", 7))
    assert ei.value.reason == "proxy" and "no ack within 0.05 s" in str(ei.value)
    assert t.ops.records == {} and t.ops.rules == {}


def test_a_failed_setup_undoes_the_intent_and_names_the_error() -> None:
    t = Parts()
    t.peer()
    t.ops.fail["setup_rules"] = SetupError("iptables-restore: exit 1")
    with pytest.raises(EventError) as ei:
        t.enroller.add(t.event("a", 7))
    assert ei.value.reason == "setup" and "iptables-restore" in str(ei.value)
    assert t.ops.records == {} and t.ops.node == {} and not t.registry.pods


def test_without_a_proxy_nothing_is_touched() -> None:
    t = Parts()
    with pytest.raises(EventError) as ei:
        t.enroller.add(t.event("a", 7))
    assert ei.value.reason == "no_proxy" and t.ops.calls == []


def test_node_sets_that_went_away_are_put_back_once() -> None:
    t = Parts()
    t.peer()
    t.ops.fail["add_node_ips"] = SetupError("ipset: set does not exist")
    t.enroller.add(t.event("a", 7))
    assert [c[0] for c in t.ops.calls] == ["record", "setup", "setup_node", "node+", "record"]


def test_a_netns_held_by_another_pod_is_refused_with_nothing_changed() -> None:
    t = Parts()
    t.peer()
    t.enroller.add(t.event("a", 7))
    before = list(t.ops.calls)
    ev = t.event("b", 7)
    ev["netns"] = "/run/netns/a"  # the same netns, another pod
    with pytest.raises(EventError) as ei:
        t.enroller.add(ev)
    assert ei.value.reason == "netns" and "pod a's" in str(ei.value)
    # a record of another pod for the netns refuses too (an agent that restarted and lost it)
    t.ops.netns("/run/netns/c", 9)
    t.ops.records[key(9)] = {"uid": "x", "phase": "enrolled"}
    with pytest.raises(EventError) as ei:
        t.enroller.add(t.event("c", 9))
    assert "pod x's" in str(ei.value)
    assert t.ops.calls == before and set(t.registry.pods) == {"a"} and not t.registry.claims


def test_a_repeated_add_keeps_the_commit_record() -> None:
    t = Parts()
    t.peer()
    t.enroller.add(t.event("a", 7))
    t.ops.calls.clear()
    t.enroller.add(t.event("a", 7))
    assert [c[0] for c in t.ops.calls] == ["setup", "node+", "record"]  # no intent over the commit


def test_bad_events_name_the_field_and_change_nothing() -> None:
    t = Parts()
    t.peer()
    for ev, reason, text in [
        (None, "bad_request", "pod: expected an object"),
        ({"uid": "a"}, "bad_request", "netns"),
        ({**t.event("a", 7), "ips": ["10.1.0.300"]}, "bad_request", "10.1.0.300"),
        ({**t.event("a", 7), "annotations": {"traffic.sidecar.istio.io/excludeOutboundPorts": "x"}},
         "bad_annotation", "excludeOutboundPorts"),
        ({**t.event("a", 7), "netns": "/proc/1/ns/net"}, "netns", "refused"),
    ]:
        if isinstance(ev, dict) and ev.get("netns") == "/proc/1/ns/net":
            t.ops.keys["/proc/1/ns/net"] = key(1)
        reply = t.dispatcher.handle({"type": "add", "pod": ev})
        assert reply["ok"] is False and reply["reason"] == reason and text in reply["error"], reply
    assert t.ops.calls == [] and not t.registry.pods


def test_a_del_tells_the_proxies_and_removes_rules_record_and_node_entries() -> None:
    t = Parts()
    peer = t.peer()
    t.enroller.add(t.event("a", 7))
    t.ops.calls.clear()
    assert t.enroller.delete({"uid": "a", "netns": "/run/netns/a"}) == {"removed": True, "pod": "a"}
    assert peer.kinds()[-1] == ("del", "a")
    assert t.ops.calls == [("teardown", "/run/netns/a"), ("clear", key(7)), ("node-", ("10.1.0.7",), "a")]
    assert not t.registry.pods and t.ops.node == {}
    assert t.enroller.delete({"container_id": "c-unknown"}) == {"removed": False}


def test_check_needs_the_rules_as_recorded_and_a_synced_proxy() -> None:
    t = Parts()
    peer = t.peer()
    t.enroller.add(t.event("a", 7))
    assert t.enroller.check({"uid": "a", "netns": "/run/netns/a"}) == {"pod": "a", "proxies": 1}
    t.ops.rules["/run/netns/a"] = RedirectConfig(mode="ambient", dns_capture=True)
    with pytest.raises(EventError, match="rules differ"):
        t.enroller.check({"uid": "a"})
    t.ops.rules["/run/netns/a"] = t.registry.pods["a"].config
    peer.close()
    with pytest.raises(EventError, match="no node proxy"):
        t.enroller.check({"uid": "a"})


def test_a_proxy_connecting_mid_add_gets_the_pod_in_its_snapshot() -> None:
    t = Parts()
    t.peer()
    pod = t.enroller.parse_pod(t.event("a", 7))
    with t.registry.lock:
        t.hub.offer_locked(pod)  # handed out, not committed yet
    late = FakePeer("late#2")
    pods, waiters, done = t.hub.attach(late)
    assert [p.uid for p in pods] == ["a"] and t.hub.await_snapshot(late, pods, waiters, done)
    assert late.kinds() == [("add", "a"), ("snapshot_done", "")] and late.synced.is_set()
    t.hub.gone(late)
    assert late not in t.hub.conns and t.metrics.proxy_connections == 1


def test_reconcile_removes_unfinished_enrolments_repairs_rules_and_drops_stale_node_entries() -> None:
    t = Parts()
    ops = t.ops
    good = t.enroller.parse_pod(t.event("a", 7))
    drifted = t.enroller.parse_pod(t.event("b", 8))
    cut = t.enroller.parse_pod(t.event("c", 9))
    ops.rules[good.netns] = good.config
    ops.records[cut.key] = cut.record(INTENT)
    ops.node = {"10.1.0.9": "c", "10.9.9.9": "gone-pod"}
    ops.found = Found(enrolled={"a": good, "b": drifted}, unfinished=[cut])
    t.reconciler.reconcile()
    assert set(t.registry.pods) == {"a", "b"}
    assert ops.rules[drifted.netns] == drifted.config  # re-installed
    assert cut.key not in ops.records and cut.netns not in ops.rules
    assert ops.node == {"10.1.0.7": "a", "10.1.0.8": "b"}
    assert t.metrics.pods_enrolled == 2 and t.metrics.reconciled == {"intact": 1, "repaired": 1, "removed": 1}


def test_resync_drops_a_pod_whose_netns_is_gone_and_repairs_the_others() -> None:
    t = Parts()
    peer = t.peer()
    t.enroller.add(t.event("a", 7))
    t.enroller.add(t.event("b", 8))
    del t.ops.keys["/run/netns/a"]  # the netns went away without a del
    t.ops.rules.pop("/run/netns/b")  # someone flushed b's rules
    assert t.reconciler.resync() == {"gone": 1, "repaired": 1}
    assert set(t.registry.pods) == {"b"} and ("del", "a") in peer.kinds()
    assert "10.1.0.7" not in t.ops.node and t.ops.rules["/run/netns/b"] == t.registry.pods["b"].config
    assert key(7) not in t.ops.records and key(8) in t.ops.records  # the gone pod's record goes with it


def test_resync_finds_a_pod_whose_path_names_another_netns_by_its_netns_key() -> None:
    """A's path names another netns now (a pid reused), and a's netns has another path: the resync
    keeps a, known by that path from then on; the proxies are not told it is gone, and nothing is
    done in the netns its old path names."""
    t = Parts()
    peer = t.peer()
    t.enroller.add(t.event("a", 7))
    t.ops.netns("/proc/42/ns/net", 7)
    t.ops.keys["/run/netns/a"] = key(70)
    assert "gone" not in t.reconciler.resync()
    assert t.registry.pods["a"].netns == "/proc/42/ns/net" and ("del", "a") not in peer.kinds()
    assert key(70) not in t.ops.rules_in and key(7) in t.ops.records
    del t.ops.keys["/proc/42/ns/net"]  # and now it is gone for good
    assert t.reconciler.resync() == {"gone": 1} and not t.registry.pods and ("del", "a") in peer.kinds()


def test_what_a_pods_netns_holds_is_repaired_to_the_record_never_believed() -> None:
    """At start an adopted pod's netns loses an earlier release's in-pod record; a del and an undo
    remove one too; a del whose netns the agent recorded for another pod leaves it alone; an undo
    never tears down rules at a path that names another netns by now."""
    t = Parts()
    t.peer()
    good = t.enroller.parse_pod(t.event("a", 7))
    t.ops.rules[good.netns] = good.config
    t.ops.legacy = {good.netns}
    t.ops.found = Found(enrolled={"a": good})
    t.reconciler.reconcile()
    assert t.ops.legacy == set() and ("legacy-", good.netns) in t.ops.calls
    # a del of a pod the agent does not know, naming a netns recorded for another pod
    t.ops.netns("/run/netns/other", 9)
    t.ops.records[key(9)] = {"uid": "owner", "phase": "enrolled"}
    t.ops.rules["/run/netns/other"] = good.config
    t.ops.legacy.add("/run/netns/other")
    assert t.enroller.delete({"uid": "intruder", "netns": "/run/netns/other"}) == {"removed": False, "pod": "intruder"}
    assert key(9) in t.ops.records and "/run/netns/other" in t.ops.rules and "/run/netns/other" in t.ops.legacy
    # a del of the pod: its in-pod leftovers go with its rules and record
    t.ops.legacy.add(good.netns)
    t.ops.records[good.key] = good.record()
    assert t.enroller.delete({"uid": "a", "netns": good.netns})["removed"]
    assert good.netns not in t.ops.legacy and good.key not in t.ops.records and good.netns not in t.ops.rules
    # an undo of a pod whose path names another netns by now: only what is keyed by the pod goes
    cut = t.enroller.parse_pod(t.event("c", 11))
    t.ops.records[cut.key] = cut.record(INTENT)
    t.ops.netns(cut.netns, 12)  # the path was given to a new netns since
    t.ops.rules[cut.netns] = good.config
    t.enroller.undo(cut, "test")
    assert cut.key not in t.ops.records and t.ops.rules[cut.netns] == good.config


def test_a_del_after_the_netns_went_removes_the_record_of_the_pods_netns() -> None:
    t = Parts()
    t.peer()
    t.enroller.add(t.event("a", 7))
    del t.ops.keys["/run/netns/a"]
    assert t.enroller.delete({"uid": "a", "netns": "/run/netns/a"}) == {"removed": True, "pod": "a"}
    assert t.ops.records == {} and t.ops.node == {}


def test_the_events_answers() -> None:
    t = Parts()
    t.peer()
    assert t.dispatcher.handle({"type": "add", "pod": t.event("a", 7)})["ok"] is True
    listed = t.dispatcher.handle({"type": "list"})
    assert [p["uid"] for p in listed["pods"]] == ["a"] and listed["ok"] is True
    assert t.dispatcher.handle({"type": "status"})["ready"] is True
    bad = t.dispatcher.handle({"type": "frobnicate"})
    assert bad["ok"] is False and bad["reason"] == "bad_request" and "frobnicate" in bad["error"]
    t.ops.fail["setup_rules"] = RuntimeError("boom")
    internal = t.dispatcher.handle({"type": "add", "pod": t.event("b", 8)})
    assert internal == {"type": "result", "ok": False, "reason": "internal", "error": "RuntimeError: boom"}
    assert "b" not in t.registry.pods and key(8) not in t.ops.records
    assert t.metrics.failures == {"bad_request": 1, "internal": 1} and t.metrics.events == {"add": 1}


def test_silent_connections_to_the_proxy_socket_never_keep_a_proxy_out(tmp_path: Any) -> None:
    """Connections that never say hello hold no thread and wait ``MAX_HELLOS`` at a time (a newcomer
    closes the one waiting the longest, with an error); a proxy that says hello is served however
    many silent ones come before and after it."""
    import socket

    from redirect.ambient.agent import hub as hub_mod
    from redirect.ambient.agent import protocol

    metrics = Metrics()
    hub = ProxyHub(Registry(metrics), metrics, timeout=2.0)
    path = str(tmp_path / "proxy.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    lsock.bind(path)
    lsock.listen(512)
    stopping = threading.Event()
    t = threading.Thread(target=hub.accept, args=(lsock, stopping), daemon=True)
    t.start()

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.settimeout(5)
        s.connect(path)
        return s

    silent: list[socket.socket] = []
    try:
        threads = threading.active_count()
        silent = [connect() for _ in range(hub_mod.MAX_HELLOS)]
        silent.append(connect())  # one too many: the first is closed, told why
        got = protocol.recv(silent[0], max_fds=0)
        assert got is not None and got[0]["type"] == "error" and "waiting the longest" in got[0]["error"], got
        assert silent[0].recv(100) == b""
        silent += [connect() for _ in range(100)]
        proxy = connect()
        protocol.send(proxy, {"type": "hello", "proxy": "p1"})
        silent += [connect() for _ in range(100)]
        got = protocol.recv(proxy, max_fds=0)
        assert got is not None and got[0]["type"] == "snapshot_done", got
        silent.append(proxy)
        # the proxy's reader, writer and snapshot wait; nothing for the silent ones
        assert threading.active_count() <= threads + 3, threading.enumerate()
    finally:
        stopping.set()
        for s in silent:
            s.close()
        lsock.shutdown(socket.SHUT_RDWR)
        lsock.close()
        hub.close_all()
        t.join(5)
    assert not t.is_alive()


def test_an_add_acts_on_the_netns_it_opened_even_if_the_path_names_another_meanwhile() -> None:
    """The add's path names another netns from the intent record on: the rules and the proxies'
    netns are still the one opened (the record's), and every netns opened is closed again; a
    check or a resync then finds the pod's netns gone or replaced and touches nothing there."""
    t = Parts()
    peer = t.peer()
    ev = t.event("a", 7)
    t.ops.on_intent = lambda: t.ops.netns("/run/netns/a", 8)  # the path names netns 8 from now on
    t.enroller.add(ev)
    assert t.ops.rules_in == {key(7): t.registry.pods["a"].config} and peer.netns_of["a"] == key(7)
    assert set(t.ops.records) == {key(7)} and t.ops.opened == []
    with pytest.raises(EventError, match="gone or replaced"):
        t.enroller.check({"uid": "a"})
    t.ops.calls.clear()
    assert t.reconciler.resync() == {"gone": 1}
    assert not [c for c in t.ops.calls if c[0] in ("setup", "teardown")] and t.ops.opened == []


def test_a_snapshot_and_a_list_of_thousands_of_pods_fit_the_message_limit() -> None:
    """2,000 pods with 36-char uids: every snapshot message fits in 64 KiB (``snapshot_pods`` parts,
    then ``snapshot_done`` with ``chunked``), together they name every pod; ``list`` answers page by
    page, each page fits, and the pages hold every pod once. A small snapshot is one message, as ever."""
    from redirect.ambient.agent import protocol

    t = Parts()
    small = t.peer()
    assert small.got[-1] == {"type": "snapshot_done", "pods": []}
    uids = [f"{i:08d}-aaaa-bbbb-cccc-{i:012d}" for i in range(2000)]
    cfg = RedirectConfig(mode="ambient")
    with t.registry.lock:
        for i, uid in enumerate(uids):
            t.registry.pods[uid] = PodRecord(uid=uid, name=f"web-{i}", namespace="default",
                                             netns=f"/var/run/netns/cni-{uid}", inode=i + 10, cookie=i + 5000,
                                             ips=(f"10.2.{i // 250}.{i % 250}",), container_id="c" * 64,
                                             backend="iptables", config=cfg, node=NODE)
    peer = t.peer()
    snap = [m for m in peer.got if m["type"] in ("snapshot_pods", "snapshot_done")]
    assert all(len(protocol.encode({**m, "id": 1 << 40})) <= protocol.MAX_MESSAGE for m in snap)
    assert [m["type"] for m in snap][-1] == "snapshot_done" and snap[-1].get("chunked") is True
    assert sorted(u for m in snap for u in m["pods"]) == uids and peer.synced.is_set()
    seen: list[str] = []
    after = None
    for _ in range(1000):
        reply = t.dispatcher.handle({"type": "list", **({"after": after} if after else {})})
        assert reply["ok"] and len(protocol.encode(reply)) <= protocol.MAX_MESSAGE
        seen += [p["uid"] for p in reply["pods"]]
        after = reply.get("next")
        if after is None:
            break
    assert seen == uids


def test_the_node_proxy_keeps_every_pod_of_a_chunked_snapshot() -> None:
    """``snapshot_pods`` parts, then ``snapshot_done`` with ``chunked``: the proxy keeps the pods of
    every part and drops the others; a ``snapshot_done`` without ``chunked`` keeps its own list only."""
    import io
    import os
    import socket

    from redirect.ambient.agent import protocol
    from redirect.ambient.nodeproxy import JsonLog, NodeProxy, PodState

    proxy = NodeProxy("/nonexistent", JsonLog(io.StringIO()))
    agent, proxy.agent = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        def serve(uids: list[str]) -> None:
            for u in uids:
                proxy.pods[u] = PodState(u, "", "", 1, os.open("/dev/null", os.O_RDONLY))

        def send(msg: dict[str, Any]) -> dict[str, Any]:
            protocol.send(agent, msg)
            proxy._on_agent()
            got = protocol.recv(agent, max_fds=0)
            assert got is not None
            return got[0]

        serve(["a", "b", "c", "d"])
        assert send({"type": "snapshot_pods", "id": 1, "pods": ["a"]})["ok"]
        assert send({"type": "snapshot_pods", "id": 2, "pods": ["b"]})["ok"]
        assert send({"type": "snapshot_done", "id": 3, "pods": ["c"], "chunked": True})["ok"]
        assert set(proxy.pods) == {"a", "b", "c"}
        assert send({"type": "snapshot_done", "id": 4, "pods": ["c"]})["ok"]
        assert set(proxy.pods) == {"c"}
    finally:
        for u in list(proxy.pods):
            proxy.remove_pod(u, "test")
        agent.close()
        proxy.agent.close()


def test_the_uid_locks_do_not_grow_with_the_uids_seen() -> None:
    """120,000 dels of unique uids leave the lock table as it was (it used to keep a lock per uid)."""
    import tracemalloc

    t = Parts()
    t.enroller.delete({"uid": "warm-up"})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(120_000):
            t.enroller.delete({"uid": f"uid-{i:06d}-0123456789abcdef"})
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2 * 1024 * 1024, grown
    assert t.registry.uid_lock("a") is t.registry.uid_lock("a")


@pytest.mark.parametrize("ip", ["127.0.0.1", "::1", "0.0.0.0", "::", "224.0.0.1", "ff02::1", "169.254.1.1",
                                "fe80::1", "169.254.7.127", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
                                "::ffff:127.0.0.1", "255.255.255.255"])
def test_an_add_whose_ips_are_not_a_pods_is_refused_naming_the_field_and_value(ip: str) -> None:
    """Loopback, unspecified, multicast, link-local, broadcast and the probe SNAT addresses would go
    in the node's probe sets (the node's own traffic to them SNAT'd): refused, nothing changed."""
    t = Parts()
    t.peer()
    reply = t.dispatcher.handle({"type": "add", "pod": {**t.event("a", 7), "ips": ["10.1.0.7", ip]}})
    assert reply["ok"] is False and reply["reason"] == "bad_request", reply
    assert "pod.ips" in reply["error"] and ip in reply["error"], reply
    assert t.ops.calls == [] and t.ops.node == {} and not t.registry.pods
