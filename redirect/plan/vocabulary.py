"""The plan's vocabulary: a ``Plan`` and the typed chains, rules, matches and actions it is made of.

A ``Plan`` says, per netfilter-style table and hook, which ordered rules to run
(matches + one action), which policy routes and local addresses come with them,
and for which address families; the iptables and nftables backends render it. A
sidecar plan (``redirect.plan.sidecar``) is the netfilter lowering of the config's
``Intent`` (``redirect.plan.intent``); the eBPF backend lowers the same intent to map
entries (``redirect.plan.lower_ebpf``), and is given the intent, not a plan. The ambient plan
(``redirect.plan.ambient``) and the node rules (``redirect.ambient.node``) are built with
the same vocabulary. Nothing here touches a kernel, so a plan is unit-testable without
root (``redirect.plan.evaluate`` interprets it), and each behaviour is written once
however many backends there are.

Chain names are logical (``"OUTBOUND"``); each backend adds its own prefix. A chain
with ``hook`` set is an entry point: the backend hooks it into that table's built-in
chain (iptables: one unconditional jump appended to ``PREROUTING``/``OUTPUT``;
nftables: a base chain at the table's priority).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal, Union

from ..config import IdSpec
from .intent import (
    DNS_PORT,
    FAMILIES,
    INBOUND_PASSTHROUGH_V4,
    INBOUND_PASSTHROUGH_V6,
    LOOPBACK_V6,
    Family,
    Intent,
    LocalAddress,
    PolicyRoute,
)

Table = Literal["raw", "mangle", "nat"]
Hook = Literal["prerouting", "output"]

OUTBOUND_MARK = 1338  # TPROXY: proxy-to-app over lo, so inbound does not capture it again
DNS_ZONE_PROXY = 1  # proxy <-> upstream resolver
DNS_ZONE_APP = 2  # app <-> proxy


# --- matches -------------------------------------------------------------------------


@dataclass(frozen=True)
class Proto:
    name: Literal["tcp", "udp"]


@dataclass(frozen=True)
class Addr:
    """Source or destination address in a CIDR (the rule's family follows from it)."""

    side: Literal["src", "dst"]
    cidr: str
    neg: bool = False


@dataclass(frozen=True)
class Port:
    """Source or destination port(s); needs a ``Proto`` in the same rule.

    Several ports mean "any of" (``neg``: "none of").
    """

    side: Literal["src", "dst"]
    ports: tuple[int, ...]
    neg: bool = False


@dataclass(frozen=True)
class Iface:
    side: Literal["in", "out"]
    name: str
    neg: bool = False


@dataclass(frozen=True)
class Owner:
    """Socket owner (only meaningful on locally generated traffic)."""

    kind: Literal["uid", "gid"]
    id: IdSpec
    neg: bool = False


@dataclass(frozen=True)
class Mark:
    value: int
    mask: int = 0xFFFFFFFF
    neg: bool = False


@dataclass(frozen=True)
class ConnMark:
    value: int
    mask: int = 0xFFFFFFFF
    neg: bool = False


@dataclass(frozen=True)
class CtState:
    states: tuple[Literal["INVALID", "NEW", "ESTABLISHED", "RELATED"], ...]


@dataclass(frozen=True)
class Socket:
    """A local socket exists for the packet (``transparent``: only IP_TRANSPARENT ones)."""

    transparent: bool = False
    nowildcard: bool = False


@dataclass(frozen=True)
class SocketExists:
    """The packet belongs to a local socket: made on this host, not forwarded (node rules)."""


@dataclass(frozen=True)
class InSet:
    """The packet's ``side`` address is in the ipset ``name`` (node rules)."""

    name: str
    side: Literal["src", "dst"] = "dst"


Match = Union[Proto, Addr, Port, Iface, Owner, Mark, ConnMark, CtState, Socket, SocketExists, InSet]


# --- actions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Redirect:
    """NAT to a local port; the proxy reads the original destination with SO_ORIGINAL_DST."""

    port: int


@dataclass(frozen=True)
class TProxy:
    """Deliver to a local transparent listener on ``port`` and mark the packet."""

    port: int
    mark: int
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class Return:
    """Stop evaluating this chain; back to the caller (and on to other rules of the hook)."""


@dataclass(frozen=True)
class Accept:
    """Accept the packet in this table's hook (skips later rules of that hook)."""


@dataclass(frozen=True)
class Drop:
    pass


@dataclass(frozen=True)
class Jump:
    chain: str


@dataclass(frozen=True)
class SetMark:
    value: int
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class SetConnMark:
    value: int
    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class SaveMark:
    """Copy the packet mark into the connmark (under ``mask``)."""

    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class RestoreMark:
    """Copy the connmark into the packet mark (under ``mask``)."""

    mask: int = 0xFFFFFFFF


@dataclass(frozen=True)
class CtZone:
    zone: int


@dataclass(frozen=True)
class Snat:
    """Rewrite the source address to ``address`` (nat POSTROUTING; node rules)."""

    address: str


Action = Union[Redirect, TProxy, Return, Accept, Drop, Jump, SetMark, SetConnMark, SaveMark, RestoreMark, CtZone,
               Snat]


# --- structure -----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    matches: tuple[Match, ...]
    action: Action
    #: None: both families; 4 or 6: only that one (set from address matches).
    family: Family | None = None
    #: Why the rule exists, for ``--dry-run``, ``show`` and review.
    comment: str = ""


@dataclass(frozen=True)
class Chain:
    table: Table
    name: str
    rules: tuple[Rule, ...]
    hook: Hook | None = None


@dataclass(frozen=True)
class Plan:
    mode: str
    chains: tuple[Chain, ...]
    routes: tuple[PolicyRoute, ...] = ()
    addresses: tuple[LocalAddress, ...] = ()
    #: Families the plan wants; ``None`` entries are resolved by the backend (auto IPv6).
    ipv6: bool | None = None

    def chains_for(self, family: Family) -> tuple[Chain, ...]:
        """The chains with only the rules of ``family``; empty non-hook chains are kept
        (they are jump targets), empty hook chains are dropped."""
        out = []
        for c in self.chains:
            rules = tuple(r for r in c.rules if r.family in (None, family))
            if c.hook is not None and not rules:
                continue
            out.append(Chain(c.table, c.name, rules, c.hook))
        return _prune(tuple(out))

    def routes_for(self, family: Family) -> tuple[PolicyRoute, ...]:
        return tuple(r for r in self.routes if r.family == family)

    def addresses_for(self, family: Family) -> tuple[LocalAddress, ...]:
        return tuple(a for a in self.addresses if a.family == family)

    def tables_for(self, family: Family) -> tuple[Table, ...]:
        return tuple(dict.fromkeys(c.table for c in self.chains_for(family)))


def _prune(chains: tuple[Chain, ...]) -> tuple[Chain, ...]:
    """Drop non-hook chains that nothing jumps to (per table), repeatedly."""
    while True:
        used = {
            (c.table, r.action.chain) for c in chains for r in c.rules if isinstance(r.action, Jump)
        }
        kept = tuple(c for c in chains if c.hook is not None or (c.table, c.name) in used)
        if len(kept) == len(chains):
            return kept
        chains = kept


def _family_of(cidr: str) -> Family:
    return 4 if ipaddress.ip_network(cidr).version == 4 else 6


class ChainBuilder:
    """Collects rules per (table, chain) in order of creation (the sidecar and ambient plans)."""

    def __init__(self) -> None:
        self._chains: dict[tuple[Table, str], list[Rule]] = {}
        self._hooks: dict[tuple[Table, str], Hook | None] = {}

    def chain(self, table: Table, name: str, hook: Hook | None = None) -> None:
        key = (table, name)
        if key not in self._chains:
            self._chains[key] = []
            self._hooks[key] = hook

    def add(
        self,
        table: Table,
        chain: str,
        matches: tuple[Match, ...] | list[Match],
        action: Action,
        comment: str = "",
        family: Family | None = None,
    ) -> None:
        self.chain(table, chain, _HOOKS.get(chain))
        for m in matches:
            if isinstance(m, Addr):
                fam = _family_of(m.cidr)
                if family is not None and family != fam:
                    raise AssertionError(f"rule mixes families: {matches}")
                family = fam
        self._chains[(table, chain)].append(Rule(tuple(matches), action, family, comment))

    def build(self) -> tuple[Chain, ...]:
        return tuple(
            Chain(t, n, tuple(rules), self._hooks[(t, n)]) for (t, n), rules in self._chains.items()
        )


#: Logical chain names that are hook entry points.
_HOOKS: dict[str, Hook] = {"PREROUTING": "prerouting", "OUTPUT": "output"}

TCP = Proto("tcp")
UDP = Proto("udp")


__all__ = [
    "Plan", "Chain", "Rule", "PolicyRoute", "LocalAddress", "ChainBuilder", "Intent",
    "Family", "FAMILIES", "DNS_PORT", "INBOUND_PASSTHROUGH_V4", "INBOUND_PASSTHROUGH_V6", "LOOPBACK_V6",
    "Proto", "Addr", "Port", "Iface", "Owner", "Mark", "ConnMark", "CtState", "Socket",
    "Redirect", "TProxy", "Return", "Accept", "Drop", "Jump", "SetMark", "SetConnMark",
    "SaveMark", "RestoreMark", "CtZone",
]
