"""A pod as the agent knows it, and the one validation of a pod's fields.

The same fields reach the agent two ways: in a CNI ``add`` event, and in the record it reads
back from its store on the node after a restart (``redirect.ambient.agent.store``). An event
comes from whoever can open the events socket; a record only root can write, and it is checked
all the same. Both go through the same checks (bounded sizes, printable text, a uid of the
protocol's form, real IP addresses, a known backend, a config that parses and is ambient), so a
record can never give the agent a pod an event could not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config import RedirectConfig, normalize_ip
from ...errors import ConfigError
from ..node import pod_ip_refusal
from . import protocol

_DEFAULT_CFG = RedirectConfig().to_dict()

#: What a pod may name as its backend (``redirect.backends.get_backend`` decides if it runs here).
BACKENDS = ("iptables", "iptables-legacy", "iptables-nft", "nftables", "ebpf", "auto")
MAX_IPS = 16  # a pod has one address per family, a few with extra networks

#: ``phase`` of a record: written before the first piece of an enrolment, and after the last.
INTENT = "intent"
ENROLLED = "enrolled"


class BadPod(ValueError):
    """A pod field is missing or malformed; the message names the field and (a bounded) value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        super().__init__(f"{field}={_short(value)}: {reason}")


def _short(value: object, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else f"<{type(value).__name__} of {len(value)}>"
    return text if len(text) <= limit else text[:limit] + "...'"


def text(pod: dict[str, Any], key: str, where: str, required: bool = False, limit: int = 253) -> str:
    value = pod.get(key, "")
    if value is None:
        value = ""
    if not isinstance(value, str) or len(value) > limit or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise BadPod(f"{where}.{key}", value, f"expected a string of at most {limit} printable chars")
    if required and not value:
        raise BadPod(f"{where}.{key}", value, "missing")
    return value


def uid_of(pod: dict[str, Any], where: str, required: bool = True) -> str:
    uid = text(pod, "uid", where, required=required, limit=128)
    if uid and not protocol.UID_RE.match(uid):
        raise BadPod(f"{where}.uid", uid, "expected letters, digits, '.', '_', ':' or '-'")
    return uid


def ips_of(value: Any, field: str) -> tuple[str, ...]:
    """Real IPv4/IPv6 addresses, normalized and deduplicated, at most ``MAX_IPS``."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_IPS:
        raise BadPod(field, value, f"expected a list of at most {MAX_IPS} IP addresses")
    out: list[str] = []
    for raw in value:
        ip = normalize_ip(raw) if isinstance(raw, str) and len(raw) <= 64 else None
        if ip is None:
            raise BadPod(field, raw, "not an IPv4 or IPv6 address")
        why = pod_ip_refusal(ip)
        if why is not None:
            raise BadPod(field, raw, f"{why}: not a pod's address (it would go in the node's probe sets)")
        if ip not in out:
            out.append(ip)
    return tuple(out)


def backend_of(value: Any, field: str, default: str) -> str:
    if value is None or value == "":
        return default
    if value not in BACKENDS:
        raise BadPod(field, value, "expected one of " + ", ".join(BACKENDS))
    return str(value)


def ambient_config(data: Any, field: str) -> RedirectConfig:
    """``RedirectConfig.from_dict(data)``, which must be an ambient config."""
    if not isinstance(data, dict):
        raise BadPod(field, data, "expected an object of RedirectConfig fields")
    try:
        cfg = RedirectConfig.from_dict(data)
    except ConfigError as e:
        raise BadPod(f"{field}.{e.field}", e.value, e.reason) from None
    if cfg.mode != "ambient":
        raise BadPod(f"{field}.mode", cfg.mode, "the agent enrols ambient pods only")
    return cfg


@dataclass
class PodRecord:
    uid: str
    name: str
    namespace: str
    netns: str
    inode: int
    cookie: int
    ips: tuple[str, ...]
    container_id: str
    backend: str
    config: RedirectConfig
    node: str

    @property
    def key(self) -> tuple[int, int]:
        """Its netns as the kernel names it: (inode, cookie)."""
        return self.inode, self.cookie

    def record(self, phase: str = ENROLLED) -> dict[str, Any]:
        """What the agent's store on the node holds of it (``store``): ``phase`` ``intent`` before
        the first piece of the enrolment is installed, ``enrolled`` (the commit record) after the last."""
        cfg = {k: v for k, v in self.config.to_dict().items() if k == "mode" or _DEFAULT_CFG.get(k) != v}
        return {"node": self.node, "uid": self.uid, "name": self.name, "namespace": self.namespace,
                "netns": self.netns, "netns_inode": self.inode, "netns_cookie": self.cookie, "ips": list(self.ips),
                "container_id": self.container_id, "backend": self.backend, "config": cfg, "phase": phase}

    def for_proxy(self) -> dict[str, Any]:
        return {"uid": self.uid, "name": self.name, "namespace": self.namespace, "ips": list(self.ips),
                "netns": self.netns, "netns_inode": self.inode}


def from_record(rec: dict[str, Any], netns: str, key: tuple[int, int], node: str) -> tuple[PodRecord, str]:
    """The pod a record of the netns ``key`` (found at ``netns``) describes, and its phase;
    ``BadPod`` if any field is not what the agent itself writes (the checks of an ``add`` event,
    plus ``node`` and ``phase``)."""
    where = "record"
    if rec.get("node") != node:
        raise BadPod(f"{where}.node", rec.get("node"), f"not this node ({node})")
    phase = rec.get("phase")
    if phase not in (INTENT, ENROLLED):
        raise BadPod(f"{where}.phase", phase, f"expected {INTENT!r} or {ENROLLED!r}")
    text(rec, "netns", where, limit=4096)
    pod = PodRecord(uid=uid_of(rec, where), name=text(rec, "name", where),
                    namespace=text(rec, "namespace", where, limit=63),
                    netns=netns, inode=key[0], cookie=key[1], ips=ips_of(rec.get("ips"), f"{where}.ips"),
                    container_id=text(rec, "container_id", where, limit=128),
                    backend=backend_of(rec.get("backend"), f"{where}.backend", "iptables"),
                    config=ambient_config(rec.get("config", {"mode": "ambient"}), f"{where}.config"), node=node)
    return pod, str(phase)


__all__ = ["PodRecord", "BadPod", "from_record", "text", "uid_of", "ips_of", "backend_of", "ambient_config",
           "BACKENDS", "MAX_IPS", "INTENT", "ENROLLED"]
