"""What the agent accepts from the outside, without root: pod records read back from its store,
node proxies' acks, and the framing of both sockets. (The same checks on live sockets and
namespaces: tests/test_agent.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from redirect.ambient.agent import protocol, store
from redirect.ambient.agent.pods import BadPod, PodRecord, from_record
from redirect.ambient.agent.proxies import parse_ack, proxy_name
from redirect.config import RedirectConfig
from redirect.errors import SetupError

NODE = "node-a"
GOOD: dict[str, Any] = {"node": NODE, "uid": "6b7c5d1e-0001", "name": "web-0", "namespace": "default",
                        "netns": "/run/netns/cni-1", "ips": ["10.244.1.7", "fd00::7"], "container_id": "3f9a",
                        "backend": "iptables", "config": {"mode": "ambient"}, "phase": "enrolled"}


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("REDIRECT_RUN_DIR", str(d))
    return d


def test_a_record_the_agent_writes_reads_back_as_the_same_pod(run_dir: Path) -> None:
    pod = PodRecord(uid="6b7c5d1e-0001", name="web-0", namespace="default", netns="/run/netns/cni-1", inode=7,
                    cookie=4096, ips=("10.244.1.7", "fd00::7"), container_id="3f9a", backend="nftables",
                    config=RedirectConfig(mode="ambient", dns_capture=True), node=NODE)
    for phase in ("intent", "enrolled"):
        store.write(pod.key, pod.record(phase))
        rec = store.read(pod.key)
        assert rec is not None and rec["boot"] == store.boot_id()
        assert from_record(rec, "/run/netns/cni-1", pod.key, NODE) == (pod, phase)
    assert [k for k, _ in store.records()] == [pod.key]
    d = run_dir / store.DIR
    assert (d.stat().st_mode & 0o777, (d / store.name_of(pod.key)).stat().st_mode & 0o777) == (0o700, 0o600)
    assert sorted(os.listdir(d)) == [store.name_of(pod.key)]  # no scratch file left
    assert store.remove(pod.key) and store.read(pod.key) is None and not store.remove(pod.key)
    with pytest.raises(BadPod, match="record.phase"):  # a record says whether its add committed
        from_record({k: v for k, v in GOOD.items() if k != "phase"}, "/x", (1, 2), NODE)


def test_the_store_takes_nothing_it_did_not_write(run_dir: Path) -> None:
    """A file under a record's name that is a symlink, open to others, not JSON, of another version,
    or naming another netns than its name says, is no record (each says why); a store directory
    others may enter is refused altogether."""
    d = run_dir / store.DIR
    store.write((5, 6), {**GOOD, "netns_inode": 5, "netns_cookie": 6})
    (d / store.name_of((1, 1))).symlink_to(d / store.name_of((5, 6)))
    for k, content, mode in (((2, 2), b"not json", 0o600), ((3, 3), json.dumps({"rv": 1}).encode(), 0o600),
                             ((4, 4), json.dumps({"rv": 2, "netns_inode": 9, "netns_cookie": 9}).encode(), 0o600),
                             ((7, 7), json.dumps({"rv": 2, "netns_inode": 7, "netns_cookie": 7}).encode(), 0o644)):
        p = d / store.name_of(k)
        p.write_bytes(content)
        p.chmod(mode)
    got = dict(store.records())
    assert isinstance(got.pop((5, 6)), dict)
    why = {k: str(v) for k, v in got.items()}
    assert all(isinstance(v, store.BadRecord) for v in got.values()), got
    assert "symlink" in why[(1, 1)] and "not a JSON record" in why[(2, 2)] and "version 2" in why[(3, 3)]
    assert "another netns" in why[(4, 4)] and "mode 0644" in why[(7, 7)], why
    d.chmod(0o755)
    with pytest.raises(SetupError, match="agent-pods: has mode 0755"):
        store.read((5, 6))


@pytest.mark.parametrize(("change", "field"), [
    ({"node": "node-b"}, "record.node"),
    ({"node": None}, "record.node"),
    ({"phase": "committed"}, "record.phase"),
    ({"uid": 'x" y'}, "record.uid"),
    ({"uid": ""}, "record.uid"),
    ({"uid": ["uid"]}, "record.uid"),
    ({"uid": "u" * 129}, "record.uid"),
    ({"name": "a\nforged log line"}, "record.name"),
    ({"name": "n" * 254}, "record.name"),
    ({"namespace": {"x": 1}}, "record.namespace"),
    ({"ips": ["not-an-ip"]}, "record.ips"),
    ({"ips": "10.0.0.1"}, "record.ips"),
    ({"ips": [10]}, "record.ips"),
    ({"ips": [f"10.0.0.{i}" for i in range(17)]}, "record.ips"),
    ({"backend": "bpf; rm -rf"}, "record.backend"),
    ({"config": {"mode": "sidecar"}}, "record.config.mode"),
    ({"config": {"mode": "ambient", "proxy_port": 0}}, "record.config.proxy_port"),
    ({"config": [1]}, "record.config"),
    ({"netns": 5}, "record.netns"),
    ({"container_id": "c" * 129}, "record.container_id"),
])
def test_every_field_of_a_record_is_checked_and_named(change: dict[str, Any], field: str) -> None:
    with pytest.raises(BadPod) as ei:
        from_record({**GOOD, **change}, "/run/netns/cni-1", (7, 4096), NODE)
    assert ei.value.field == field, ei.value
    assert len(str(ei.value)) < 300  # a bounded message, whatever the value


def test_ips_are_normalized_and_deduplicated() -> None:
    pod, _ = from_record({**GOOD, "ips": [" 10.0.0.1", "10.0.0.1", "FD00::7"]}, "/x", (1, 2), NODE)
    assert pod.ips == ("10.0.0.1", "fd00::7")


@pytest.mark.parametrize("ack", [
    {"id": [1], "ok": True}, {"id": True, "ok": True}, {"id": -1, "ok": True}, {"id": "1", "ok": True},
    {"id": 1.0, "ok": True}, {"ok": True}, {"id": 1, "ok": "yes"}, {"id": 1, "ok": 1}, {"id": 1},
    {"id": 1, "ok": False, "error": {"x": 1}},
])
def test_a_malformed_ack_is_refused_by_field(ack: dict[str, Any]) -> None:
    with pytest.raises(protocol.ProtocolError, match="ack (id|ok|error)"):
        parse_ack({"type": "ack", **ack})


def test_a_good_ack_and_its_bounded_error() -> None:
    assert parse_ack({"type": "ack", "id": 3, "ok": True}) == (3, True, "")
    assert parse_ack({"type": "ack", "id": 4, "ok": False, "error": "e" * 5000}) == (4, False, "e" * 1000)


def test_a_proxy_name_is_printable_and_bounded() -> None:
    assert proxy_name({"proxy": "ztunnel"}, 2) == "ztunnel#2"
    for bad in ("x" * 65, "a\nb", "", 5, None, ["p"]):
        assert proxy_name({"proxy": bad}, 1) == "proxy#1"


@pytest.mark.parametrize("data", [
    b"[" * 100000,
    b'{"v": 1, "type": "add", "pod": ' + b"[" * 50000 + b"]" * 50000 + b"}",
    b"\xff\xfe",
    b"not json",
    json.dumps([1]).encode(),
    json.dumps({"v": 2, "type": "add"}).encode(),
    json.dumps({"v": 1, "type": 5}).encode(),
])
def test_anything_but_a_message_of_the_protocol_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(data)
