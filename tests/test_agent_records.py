"""What the agent accepts from the outside, without root: pod records read back from a netns,
node proxies' acks, and the framing of both sockets. (The same checks on live sockets and
namespaces: tests/test_agent.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from redirect.ambient.agent import identity, protocol
from redirect.ambient.agent.pods import BadPod, PodRecord, from_record
from redirect.ambient.agent.proxies import parse_ack, proxy_name
from redirect.config import RedirectConfig

NODE = "node-a"
GOOD: dict[str, Any] = {"node": NODE, "uid": "6b7c5d1e-0001", "name": "web-0", "namespace": "default",
                        "netns": "/run/netns/cni-1", "ips": ["10.244.1.7", "fd00::7"], "container_id": "3f9a",
                        "backend": "iptables", "config": {"mode": "ambient"}, "phase": "enrolled"}


def test_a_record_the_agent_writes_reads_back_as_the_same_pod() -> None:
    pod = PodRecord(uid="6b7c5d1e-0001", name="web-0", namespace="default", netns="/run/netns/cni-1", inode=7,
                    ips=("10.244.1.7", "fd00::7"), container_id="3f9a", backend="nftables",
                    config=RedirectConfig(mode="ambient", dns_capture=True), node=NODE)
    for phase in ("intent", "enrolled"):
        save = "\n".join(f'add {identity.SET} {i} comment "{c}"'
                         for i, c in enumerate(identity._chunks(pod.record(phase))))
        rec = identity.parse(save)
        assert rec is not None
        assert from_record(rec, "/run/netns/cni-1", 7, NODE) == (pod, phase)
    legacy = {k: v for k, v in GOOD.items() if k != "phase"}  # written before the intent record existed
    assert from_record(legacy, "/x", 1, NODE)[1] == "enrolled"


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
        from_record({**GOOD, **change}, "/run/netns/cni-1", 7, NODE)
    assert ei.value.field == field, ei.value
    assert len(str(ei.value)) < 300  # a bounded message, whatever the value


def test_ips_are_normalized_and_deduplicated() -> None:
    pod, _ = from_record({**GOOD, "ips": [" 10.0.0.1", "10.0.0.1", "FD00::7"]}, "/x", 1, NODE)
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
