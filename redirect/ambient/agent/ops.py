"""What the agent changes in the kernel and on the node, in one place: a pod's rules, its record
in the agent's store, the node's probe sets, and the scan for records at start.

``KernelOps`` does it for real (``redirect.api``, ``store``, ``legacy``, ``redirect.ambient.node``,
``discovery``). The enrolment transaction and the reconcile take an ``Ops``, so that their
order, their rollback and their bookkeeping can also be unit-tested with an in-memory
stand-in (tests/test_agent_parts.py); the kernel tests (tests/test_agent.py) run them on
real namespaces, rules and sets.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

from ... import api
from ...backends.base import CheckResult
from ...config import RedirectConfig
from ...kernel import netns as _netns
from .. import node
from . import legacy, store
from .discovery import Found, discover, find, key_at, open_as

Key = store.Key
#: A pod's netns as opened once for one operation (``Ops.open_netns``): what the rules, the
#: in-pod record and the node proxies are given, never the path again.
NetnsRef = _netns.NetnsRef


class Ops(Protocol):
    # a pod's netns: opened once per operation (``key`` given: it must be that netns, else
    # ``NetnsError`` "gone or replaced"), and that open one is what every step below acts on
    def open_netns(self, path: str, key: Key | None = None) -> tuple[NetnsRef, Key]: ...
    def close_netns(self, ref: NetnsRef) -> None: ...
    # an enrolled pod's netns ``key`` opened where it is now: at ``path`` if that is still it, else
    # where the start would find it (``discovery.find``); (the open one, its path now)
    def find_netns(self, path: str, key: Key) -> tuple[NetnsRef, str]: ...
    def netns_key(self, path: str) -> Key: ...
    def host_netns_reason(self, ref: NetnsRef) -> str | None: ...
    def same_netns(self, path: str, key: Key) -> bool: ...
    # the pod's record (``store``, on the node), by its netns
    def read_record(self, key: Key) -> dict[str, Any] | None: ...
    def write_record(self, key: Key, record: dict[str, Any]) -> None: ...
    def clear_record(self, key: Key) -> None: ...
    # an earlier release's record inside the pod's netns (``legacy``): removed, never read
    def clear_legacy(self, netns: NetnsRef) -> bool: ...
    # the pod's rules (``redirect.api``), in a netns ``open_netns`` gave
    def setup_rules(self, netns: NetnsRef, cfg: RedirectConfig, backend: str) -> None: ...
    def check_rules(self, netns: NetnsRef, cfg: RedirectConfig, backend: str) -> CheckResult: ...
    def teardown_rules(self, netns: NetnsRef, backend: str | None = None) -> None: ...
    # the node's probe rules and sets (``redirect.ambient.node``), in the host netns
    def setup_node(self) -> bool: ...
    def add_node_ips(self, ips: Iterable[str], owner: str) -> None: ...
    def remove_node_ips(self, ips: Iterable[str], owner: str) -> None: ...
    def node_ips(self) -> dict[str, str | None]: ...
    # the records found at start (``discovery``)
    def discover(self) -> Found: ...


class KernelOps:
    """``Ops`` on the kernel; the node's sets live in ``host_netns`` (None: the agent's own)."""

    def __init__(self, host_netns: str | None, node_name: str, scan_proc: bool) -> None:
        self.host_netns = host_netns
        self.node_name = node_name
        self.scan_proc = scan_proc

    def open_netns(self, path: str, key: Key | None = None) -> tuple[NetnsRef, Key]:
        fd, got = open_as(path, key)
        return _netns.Fd(fd), got

    def close_netns(self, ref: NetnsRef) -> None:
        if isinstance(ref, _netns.Fd):
            os.close(ref)

    def find_netns(self, path: str, key: Key) -> tuple[NetnsRef, str]:
        fd, where = find(path, key, self.scan_proc)
        return _netns.Fd(fd), where

    def netns_key(self, path: str) -> Key:
        return _netns.netns_key(path)

    def host_netns_reason(self, ref: NetnsRef) -> str | None:
        return _netns.host_netns_reason_of(ref)

    def same_netns(self, path: str, key: Key) -> bool:
        return key_at(path) == key

    def read_record(self, key: Key) -> dict[str, Any] | None:
        return store.read(key)

    def write_record(self, key: Key, record: dict[str, Any]) -> None:
        store.write(key, record)

    def clear_record(self, key: Key) -> None:
        store.remove(key)

    def clear_legacy(self, netns: NetnsRef) -> bool:
        return legacy.clear(netns)

    def setup_rules(self, netns: NetnsRef, cfg: RedirectConfig, backend: str) -> None:
        api.setup(netns, cfg, backend)

    def check_rules(self, netns: NetnsRef, cfg: RedirectConfig, backend: str) -> CheckResult:
        return api.check(netns, cfg, backend)

    def teardown_rules(self, netns: NetnsRef, backend: str | None = None) -> None:
        api.teardown(netns, backend)

    def setup_node(self) -> bool:
        return node.setup_node(self.host_netns)

    def add_node_ips(self, ips: Iterable[str], owner: str) -> None:
        node.add_pods(ips, self.host_netns, owner=owner)

    def remove_node_ips(self, ips: Iterable[str], owner: str) -> None:
        node.remove_pods(ips, self.host_netns, owner=owner)

    def node_ips(self) -> dict[str, str | None]:
        return node.list_pods(self.host_netns)

    def discover(self) -> Found:
        return discover(self.node_name, self.scan_proc)
