"""Node side of ambient mode: kubelet probes reach ambient pods from a known source.

In-pod ambient rules accept TCP from the probe SNAT address (169.254.7.127,
fd16:9254:7127:1337:ffff:ffff:ffff:ffff) without sending it to the node proxy. On
the node, a probe from kubelet must therefore be SNAT'd to that address, while
traffic the node merely forwards (kube-proxy, load balancers) must not: Istio
(``cni/pkg/iptables`` ``AppendHostRules``) tells them apart with
``-m owner --socket-exists`` (only locally generated packets have a socket) and
limits the rule to ambient pods' IPs with an ipset. We do the same:

- ipsets ``rdr-inpod-probes-v4`` / ``rdr-inpod-probes-v6`` (``hash:ip`` with comments:
  each entry's comment names the pod that owns it);
- chain ``RDR_NODE_POSTRT`` in the nat table, jumped to first from ``POSTROUTING`` by a rule
  with our comment (``redirect: kubelet probes``); a chain of that name that no rule or jump
  of ours marks is someone else's: left alone, and ``setup_node`` refuses:
  ``-p tcp -m owner --socket-exists -m set --match-set rdr-inpod-probes-vN dst
  -j SNAT --to-source <probe address>``.

The rule and the jump are a small plan (``node_rules``: rules of ``redirect.plan``'s
vocabulary) that the iptables backend renders, as it renders a pod's.

Everything acts on the netns ``netns`` (default: the calling thread's). What is
installed is read back from the kernel, so ``setup_node`` re-asserts the rules at
any time: a missing or altered rule is restored, an intact one is not rewritten.
Pods are added and removed by IP; with ``owner`` (a pod UID), ``remove_pods`` only
removes entries that ``owner`` added, so a recycled IP that now belongs to another
pod keeps its entry.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..backends import iptables
from ..backends.base import CheckResult, is_owned_comment
from ..backends.iptables_rules import render_rule
from ..config import PROBE_SNAT, normalize_ip
from ..errors import ConfigError, SetupError
from ..kernel import netns as _netns
from ..plan.vocabulary import Family, InSet, Jump, Proto, Rule, Snat, SocketExists
from .ipset import run as _ipset

log = logging.getLogger("redirect.node")

CHAIN = "RDR_NODE_POSTRT"
SET_NAMES = {4: "rdr-inpod-probes-v4", 6: "rdr-inpod-probes-v6"}
_MAX_OWNER = 200  # ipset comments hold up to 255 bytes

_locks_guard = threading.Lock()
_locks: dict[int, threading.Lock] = {}


@dataclass(frozen=True)
class NodeConfig:
    """The node's probe SNAT addresses (Istio ``HOST_PROBE_SNAT_ADDRESS`` / ``_V6_``)."""

    probe_snat_ipv4: str = PROBE_SNAT[4]
    probe_snat_ipv6: str = PROBE_SNAT[6]
    #: IPv6 rule and set: True, False, or None = whenever the netns has IPv6.
    ipv6: bool | None = None

    def __post_init__(self) -> None:
        for fam, name in ((4, "probe_snat_ipv4"), (6, "probe_snat_ipv6")):
            value = getattr(self, name)
            a = normalize_ip(value, fam)
            if a is None:
                raise ConfigError(name, value, f"not an IPv{fam} address")
            object.__setattr__(self, name, a)
        if self.ipv6 not in (None, True, False):
            raise ConfigError("ipv6", self.ipv6, "expected true, false or None (auto)")

    def snat(self, family: int) -> str:
        return self.probe_snat_ipv4 if family == 4 else self.probe_snat_ipv6


# --- helpers ---------------------------------------------------------------------------


@contextlib.contextmanager
def _in(netns: _netns.NetnsRef | None) -> Iterator[None]:
    """Enter ``netns`` (None: stay) and hold the per-netns lock."""
    with contextlib.ExitStack() as stack:
        if netns is not None:
            stack.enter_context(_netns.enter(netns))
        inode = _netns.current_inode()
        with _locks_guard:
            lock = _locks.setdefault(inode, threading.Lock())
        stack.enter_context(lock)
        yield


def _families(cfg: NodeConfig) -> tuple[int, ...]:
    from ..kernel.routes import ipv6_enabled

    v6 = ipv6_enabled() if cfg.ipv6 is None else cfg.ipv6
    return (4, 6) if v6 else (4,)


def _set_exists(name: str) -> bool:
    return _ipset(["list", "-n", name], ok=(0, 1)).returncode == 0


def node_rules(fam: int, cfg: NodeConfig) -> tuple[Rule, Rule]:
    """The node's plan for one family: the rule of ``CHAIN`` (TCP made on this host, so not
    forwarded, to an ambient pod's address is SNAT'd to the probe address) and the jump into
    ``CHAIN`` from POSTROUTING."""
    family: Family = 6 if fam == 6 else 4
    snat = Rule((Proto("tcp"), SocketExists(), InSet(SET_NAMES[fam])), Snat(cfg.snat(fam)), family,
                "kubelet probes to ambient pods come from the probe address")
    return snat, Rule((), Jump(CHAIN), family, "kubelet probes")


def _desired_rule(fam: int, cfg: NodeConfig) -> str:
    """Our rule as ``iptables-save`` prints it."""
    return render_rule(CHAIN, node_rules(fam, cfg)[0])


#: Our jump from POSTROUTING, as iptables-save prints it (the same for every family and config).
#: A bare jump to our chain (_BARE_JUMP, the form installed before jumps carried our comment) is
#: ours too, and setup replaces it.
_JUMP = render_rule("POSTROUTING", node_rules(4, NodeConfig())[1], prefix="")
_BARE_JUMP = f"-A POSTROUTING -j {CHAIN}"


@dataclass(frozen=True)
class _NatState:
    chain: tuple[str, ...] | None  # our chain's rules, None if the chain does not exist (or is not ours)
    jumps: tuple[str, ...]  # our jumps from POSTROUTING into it
    #: Why a chain of our name here is someone else's (then ``chain`` is None and nothing is touched).
    foreign: str | None = None


def _read(variant: str, fam: int) -> _NatState:
    """Our chain and jumps in the nat table. The chain is ours when one of its rules carries our
    comment or one of our jumps (marked or bare) leads to it."""
    text = iptables.save(variant, fam, "nat")
    chain: list[str] | None = None
    jumps: list[str] = []
    others: list[str] = []
    for line in text.splitlines():
        if line.startswith(f":{CHAIN} "):
            chain = chain or []
        elif line.startswith(f"-A {CHAIN} "):
            chain = (chain or []) + [line]
        elif line.endswith(f"-j {CHAIN}"):
            (jumps if line in (_JUMP, _BARE_JUMP) else others).append(line)
    if chain is not None and not jumps and not any(is_owned_comment(c) for c in _comments(chain)):
        return _NatState(None, (), f"IPv{fam} nat chain {CHAIN} is not ours (no rule or jump of ours)")
    if chain is not None and others:
        return _NatState(None, (), f"IPv{fam} nat rules not ours jump to {CHAIN}: {others}")
    return _NatState(tuple(chain) if chain is not None else None, tuple(jumps))


def _comments(lines: Iterable[str]) -> list[str]:
    return [ln.split('--comment "', 1)[1].split('"', 1)[0] for ln in lines if '--comment "' in ln]


def _refuse_foreign(states: Iterable[_NatState]) -> None:
    foreign = [s.foreign for s in states if s.foreign]
    if foreign:
        raise SetupError(f"named like ours but not ours, so left alone and node setup refused: {'; '.join(foreign)};"
                         " rename or remove them")


def _payload(cur: _NatState, want_rule: str | None) -> str:
    """Restore payload turning ``cur`` into ours (``want_rule``) or into nothing (None)."""
    if cur.foreign:
        return ""
    lines = ["*nat"]
    if want_rule is not None:
        if cur.chain == (want_rule,) and cur.jumps == (_JUMP,):
            return ""
        lines += [f":{CHAIN} - [0:0]", want_rule]  # declaring flushes it
        if cur.jumps != (_JUMP,):
            lines += ["-D" + j[2:] for j in cur.jumps]
            lines.append(f"-I POSTROUTING 1 {_JUMP.split(' ', 2)[2]}")  # first: before any other SNAT
    else:
        if cur.chain is None and not cur.jumps:
            return ""
        lines += ["-D" + j[2:] for j in cur.jumps]
        if cur.chain is not None:
            lines += [f":{CHAIN} - [0:0]", f"-X {CHAIN}"]
    return "\n".join(lines + ["COMMIT"]) + "\n"


def pod_ip_refusal(ip: str) -> str | None:
    """Why ``ip`` (normalized) can't be a pod's address in the probe sets, or None: the node's own
    traffic to an address in them is SNAT'd (loopback would take kubelet's and etcd's with it)."""
    a = ipaddress.ip_address(ip)
    mapped = getattr(a, "ipv4_mapped", None)
    a = mapped if mapped is not None else a
    for test, what in (("is_loopback", "a loopback address"), ("is_unspecified", "the unspecified address"),
                       ("is_multicast", "a multicast address"), ("is_link_local", "a link-local address")):
        if getattr(a, test):
            return what
    if isinstance(a, ipaddress.IPv4Address) and a == ipaddress.IPv4Address("255.255.255.255"):
        return "the broadcast address"
    if str(a) in PROBE_SNAT.values():
        return "the node's probe SNAT address"
    return None


def _parse_ips(ips: Iterable[str], field: str = "ips") -> list[tuple[int, str]]:
    if isinstance(ips, str):
        ips = [ips]
    out: list[tuple[int, str]] = []
    for raw in ips:
        a = normalize_ip(raw)
        if a is None:
            raise ConfigError(field, raw, "not an IPv4 or IPv6 address")
        why = pod_ip_refusal(a)
        if why is not None:
            raise ConfigError(field, raw, f"{why}: not a pod's address")
        if (ip := (6 if ":" in a else 4, a)) not in out:
            out.append(ip)
    return out


def _refuse_own_addresses(parsed: list[tuple[int, str]], field: str = "ips") -> None:
    """``ConfigError`` if one of ``parsed`` is an address of the calling thread's netns (the node's):
    in the probe sets, the node's own traffic to it would be SNAT'd."""
    from ..kernel import netlink

    own = {normalize_ip(a) for _fam, _idx, a in netlink.addresses()}
    for _fam, ip in parsed:
        if ip in own:
            raise ConfigError(field, ip, "an address of the node's own network namespace: not a pod's address")


def _check_owner(owner: str | None) -> None:
    if owner is None:
        return
    if not isinstance(owner, str) or not owner or len(owner) > _MAX_OWNER or any(c in owner for c in "\"\n\\"):
        raise ConfigError("owner", owner, f"expected a non-empty name of at most {_MAX_OWNER} chars without quotes")


# --- public API ------------------------------------------------------------------------


def setup_node(netns: _netns.NetnsRef | None = None, config: NodeConfig | None = None) -> bool:
    """Install (or re-assert) the host probe rules and sets in ``netns``; True if anything changed.

    Atomic: on failure, the rules and sets are left as they were and ``SetupError`` is raised.
    """
    cfg = config or NodeConfig()
    with _in(netns):
        families = _families(cfg)
        variant = iptables.detect_variant()
        before = {fam: _read(variant, fam) for fam in (4, 6)}
        _refuse_foreign(before.values())
        created: list[str] = []
        done: list[int] = []
        changed = False
        try:
            for fam in families:
                if not _set_exists(SET_NAMES[fam]):
                    _ipset(["create", SET_NAMES[fam], "hash:ip", "family", "inet" if fam == 4 else "inet6",
                            "comment", "-exist"])
                    created.append(SET_NAMES[fam])
            for fam in (4, 6):
                want = _desired_rule(fam, cfg) if fam in families else None
                payload = _payload(before[fam], want)
                if payload:
                    iptables.restore(variant, fam, payload)
                    done.append(fam)
            changed = bool(created or done)
            # A family turned off: its set goes too (once nothing references it).
            for fam in (4, 6):
                if fam not in families and _set_exists(SET_NAMES[fam]):
                    _ipset(["destroy", SET_NAMES[fam]])
                    changed = True
        except Exception:
            for fam in reversed(done):
                try:
                    now = _read(variant, fam)
                    prev = before[fam].chain
                    want = prev[0] if prev else None
                    iptables.restore(variant, fam, _payload(now, want))
                except Exception as e:  # pragma: no cover - reported, not hidden
                    log.error("node rollback of IPv%d failed: %s", fam, e)
            for name in created:
                _ipset(["destroy", name], ok=(0, 1))
            raise
    log.info("node setup netns=%s changed=%s", _netns.describe(netns) if netns is not None else "(current)", changed)
    return changed


def teardown_node(netns: _netns.NetnsRef | None = None) -> bool:
    """Remove our host rules and sets from ``netns``; True if anything was removed."""
    with _in(netns):
        variant = iptables.detect_variant()
        removed = False
        for fam in (4, 6):
            payload = _payload(_read(variant, fam), None)
            if payload:
                iptables.restore(variant, fam, payload)
                removed = True
        for name in SET_NAMES.values():
            if _set_exists(name):
                _ipset(["destroy", name])
                removed = True
    return removed


def check_node(netns: _netns.NetnsRef | None = None, config: NodeConfig | None = None) -> CheckResult:
    """Whether the host rules and sets in ``netns`` are as ``setup_node`` makes them."""
    cfg = config or NodeConfig()
    diffs: list[str] = []
    with _in(netns):
        families = _families(cfg)
        variant = iptables.detect_variant()
        for fam in (4, 6):
            st = _read(variant, fam)
            if st.foreign:
                diffs.append(st.foreign)
            elif fam in families:
                want = _desired_rule(fam, cfg)
                if st.chain is None:
                    diffs.append(f"IPv{fam} nat: missing chain {CHAIN}")
                elif st.chain != (want,):
                    diffs.append(f"IPv{fam} nat: {CHAIN} is {list(st.chain)}, want [{want}]")
                if st.jumps != (_JUMP,):
                    diffs.append(f"IPv{fam} nat: jumps from POSTROUTING to {CHAIN} are {list(st.jumps)},"
                                 f" want [{_JUMP}]")
                if not _set_exists(SET_NAMES[fam]):
                    diffs.append(f"missing ipset {SET_NAMES[fam]}")
            elif st.chain is not None or st.jumps:
                diffs.append(f"IPv{fam} nat: unexpected {CHAIN} (IPv{fam} is off)")
    return CheckResult(not diffs, "node", tuple(diffs))


def _entries(name: str) -> dict[str, str | None]:
    """ip -> owner comment (None if the entry has none) of one of our sets."""
    out: dict[str, str | None] = {}
    p = _ipset(["list", name, "-output", "save"])
    for line in p.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3 and parts[0] == "add" and parts[1] == name:
            rest = parts[3] if len(parts) > 3 else ""
            owner = None
            if rest.startswith("comment "):
                owner = rest[len("comment "):].strip().strip('"')
            out[parts[2]] = owner
    return out


def list_pods(netns: _netns.NetnsRef | None = None) -> dict[str, str | None]:
    """The pod IPs in our sets, with the owner each was added with (or None)."""
    with _in(netns):
        out: dict[str, str | None] = {}
        for name in SET_NAMES.values():
            if _set_exists(name):
                out.update(_entries(name))
        return out


def _need_sets(fams: set[int]) -> None:
    for fam in sorted(fams):
        if not _set_exists(SET_NAMES[fam]):
            raise SetupError(f"ipset {SET_NAMES[fam]} does not exist: run `redirect node setup` (setup_node) first")


def add_pods(ips: Iterable[str], netns: _netns.NetnsRef | None = None, owner: str | None = None) -> list[str]:
    """Add pod IPs to the probe sets (one ``ipset restore``); returns those that were new or changed owner.

    Idempotent: an IP already present with the same owner is left alone; with a different
    owner it is taken over (the IP was recycled to this pod).
    """
    parsed = _parse_ips(ips)
    _check_owner(owner)
    with _in(netns):
        _refuse_own_addresses(parsed)
        _need_sets({fam for fam, _ in parsed})
        current = {fam: _entries(SET_NAMES[fam]) for fam in {f for f, _ in parsed}}
        todo = [(fam, ip) for fam, ip in parsed if ip not in current[fam] or current[fam][ip] != owner]
        if not todo:
            return []
        # ``add -exist`` on a present IP replaces its comment in place (no window without it).
        lines = [f"add {SET_NAMES[fam]} {ip}" + (f' comment "{owner}"' if owner else "") + " -exist"
                 for fam, ip in todo]
        _ipset(["restore"], "\n".join(lines) + "\n")
    return [ip for _, ip in todo]


def remove_pods(ips: Iterable[str], netns: _netns.NetnsRef | None = None, owner: str | None = None) -> list[str]:
    """Remove pod IPs from the probe sets; returns those removed.

    With ``owner``, an entry is only removed if it was added by ``owner``: a recycled IP
    that now belongs to another pod keeps its entry. Missing IPs are not an error.
    """
    parsed = _parse_ips(ips)
    _check_owner(owner)
    with _in(netns):
        fams = {fam for fam, _ in parsed if _set_exists(SET_NAMES[fam])}
        current = {fam: _entries(SET_NAMES[fam]) for fam in fams}
        todo = [(fam, ip) for fam, ip in parsed
                if fam in current and ip in current[fam] and (owner is None or current[fam][ip] == owner)]
        if todo:
            _ipset(["restore"], "".join(f"del {SET_NAMES[fam]} {ip} -exist\n" for fam, ip in todo))
    return [ip for _, ip in todo]


__all__ = ["NodeConfig", "setup_node", "teardown_node", "check_node", "add_pods", "remove_pods", "list_pods",
           "pod_ip_refusal",
           "CHAIN", "SET_NAMES"]
