"""What an intent writes into the maps, packed in the ``redirect/bpf/abi.h`` layout, and how entries read.

The eBPF lowering of the intent (``redirect.plan.lower_ebpf``) gives typed entries; ``packed``
packs them (the policy by field name: ``pack_policy``), kept per intent in a handle's memo;
``intent_entries`` keys them by a pod's netns cookie and adds the pod's own addresses
(``lower_ebpf.pod_local``) and sources (``pod_sources``), ``pod_entries`` its interfaces too.
``refuse`` raises for what the intent's ``refusals`` say this backend cannot lower. The ``fmt_*``
functions turn entries into the text of ``check``, ``show`` and ``render``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ....errors import SetupError
from ....plan.intent import AnyIntent
from ....plan.lower_ebpf import (
    CIDR_KIND,
    CIDR_KIND_NAME,
    CIDR_SHAPE,
    KIND_DISPLAY,
    PORT_KIND,
    PORT_KIND_NAME,
    EbpfEntries,
    EbpfPolicy,
    LocalAddr,
    lower_ebpf,
    pod_interfaces,
    pod_local,
)
from ...base import refuse as refuse_for
from ..abi import (
    CIDR_KEY,
    CIDR_PREFIX_BASE,
    F_AMBIENT,
    F_FWMARK_ACCEPT_OURS,
    F_INBOUND,
    F_TPROXY,
    GEN_BIT,
    GROUPS_ALL,
    GROUPS_ONLY,
    INV_CIDRS,
    INV_PORTS,
    P_FLAGS,
    P_INV_BASE,
    P_LL6,
    P_N_INV,
    P_SRC4,
    P_SRC6,
    POLICY,
    POLICY_LAYOUT,
    PORT_KEY,
    U64,
    const,
    flag,
)
from ..host import NATIVE, PodWrite
from .network import links_and_routes


def refuse(it: AnyIntent) -> None:
    """``BackendUnavailable`` naming the first option of ``it`` this backend cannot lower
    (``redirect.backends.base.refuse``)."""
    refuse_for(it, "ebpf")


def _addr16(ip: str) -> bytes:
    return ipaddress.ip_address(ip).packed.ljust(16, b"\0")


@dataclass(frozen=True)
class PodEntries:
    """Everything one pod has in the maps (listeners, the inventory and the link aside).

    ``policy`` has its inventory fields zeroed (``apply`` fills them in).
    """

    policy: bytes
    ports: frozenset[bytes]
    cidrs: frozenset[bytes]

    @property
    def inbound(self) -> bool:
        return bool(POLICY.unpack(self.policy)[P_FLAGS] & F_INBOUND)

    def by_map(self) -> dict[int, frozenset[bytes]]:
        return {INV_PORTS: self.ports, INV_CIDRS: self.cidrs}

    def to_write(self) -> PodWrite:
        """These entries as ``PodStore.write`` takes them."""
        return PodWrite(self.by_map(), self.policy, self.inbound)

    def keyed(self, keys: int) -> PodEntries:
        """These entries keyed under ``keys`` (``pod_keys``: a generation of the pod) instead."""
        kv = U64.pack(keys)
        return PodEntries(self.policy, frozenset(kv + k[8:] for k in self.ports),
                          frozenset(k[:8] + kv + k[16:] for k in self.cidrs))


def pod_keys(cookie: int, inv_base: int) -> int:
    """The netns value a pod's ports/cidrs entries are keyed under in the generation whose
    inventory starts at ``inv_base`` (0 or 1 << 31): the cookie, with bit 63 set in the second
    (redirect/bpf/policy.h, pod_keys). A changed config is written in the generation the live policy does
    not read, and its policy write switches to all of it at once."""
    return cookie | GEN_BIT if inv_base >> 31 else cookie


def policy_core(policy: bytes) -> bytes:
    """The policy without its bookkeeping (inventory, ``tcp_fwmark_accept``): what a config decides."""
    v = list(POLICY.unpack(policy))
    v[P_INV_BASE] = v[P_N_INV] = 0
    v[P_FLAGS] &= ~F_FWMARK_ACCEPT_OURS
    return POLICY.pack(*v)


def policy_flags(policy: bytes) -> int:
    """The flags of a packed policy."""
    return int(POLICY.unpack(policy)[P_FLAGS])


def replies_by_mark(flags: int) -> bool:
    """Whether a pod with policy ``flags`` has a proxy's transparent connections to the app answered
    by the mark of their SYN (``redirect/bpf/sockopt.c``, ``local_connect``): inbound capture in ambient
    mode (the node proxy) or with TPROXY (a sidecar's ``original_src``). The app's side then takes
    the intent's policy route by that mark, which needs ``net.ipv4.tcp_fwmark_accept`` on in the pod."""
    return bool(flags & F_INBOUND and flags & (F_AMBIENT | F_TPROXY))


def with_flag(policy: bytes, bit: int, on: bool) -> bytes:
    v = list(POLICY.unpack(policy))
    v[P_FLAGS] = v[P_FLAGS] | bit if on else v[P_FLAGS] & ~bit
    return POLICY.pack(*v)


def pack_policy(p: EbpfPolicy) -> bytes:
    """``struct pod_policy`` of ``p``, field by name: a boolean is the flag ``RDR_F_<NAME>``,
    anything else the struct's field of its name (``loopback4``: ``lo4_addr``/``lo4_mask``;
    ``groups_mode``: ``RDR_GROUPS_<MODE>``; addresses: their bytes). A field the struct lacks is a
    ``KeyError`` naming it. Inventory and sources are zero (``apply`` and the pod's scan fill them)."""
    values: dict[str, Any] = {"flags": 0}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if isinstance(v, bool):
            values["flags"] |= flag(f.name) if v else 0
        elif f.name == "loopback4":
            lo = ipaddress.ip_network(v)
            values["lo4_addr"], values["lo4_mask"] = lo.network_address.packed, lo.netmask.packed
        elif f.name == "groups_mode":
            values[f.name] = const(f"RDR_GROUPS_{v.upper()}")
        elif isinstance(v, str):  # an address
            values[f.name] = ipaddress.ip_address(v).packed
        elif isinstance(v, tuple):  # an id range, a list of ports
            values[f.name] = v
        else:
            values[f.name] = v
    return POLICY_LAYOUT.pack(values)


#: A handle's memo (``PodStore.memo``) keeps at most this many values; all are forgotten when it is full.
MEMO_MAX = 512
_T = TypeVar("_T")
Memo = dict[Hashable, Any]


def remembered(memo: Memo | None, key: Hashable, make: Callable[[], _T]) -> _T:
    """The value ``memo`` keeps for ``key``, else ``make()``, then kept (intents are frozen, and many
    pods share a few); without a memo, ``make()``."""
    if memo is None:
        return make()
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= MEMO_MAX:
            memo.clear()
        hit = memo[key] = make()
    return hit  # type: ignore[no-any-return]


def lowered(it: AnyIntent, families: tuple[int, ...], memo: Memo | None = None) -> EbpfEntries:
    """``lower_ebpf(it, families)``, kept in ``memo`` (a handle's, ``PodStore.memo``) when given."""
    return remembered(memo, ("lowered", it, families), lambda: lower_ebpf(it, families))


Packed = tuple[bytes, tuple[tuple[int, int], ...], tuple[tuple[int, int, bytes], ...]]


def packed(it: AnyIntent, families: tuple[int, ...], memo: Memo | None = None) -> Packed:
    """What ``it`` writes, whatever the pod: the policy, (kind, port)s and (prefix, kind, addr)s: the
    eBPF lowering of the intent (``redirect.plan.lower_ebpf``), packed. Kept in ``memo`` when given:
    many pods share a config, and the lowering parses addresses with ``ipaddress``.
    """
    def pack() -> Packed:
        e = lowered(it, families, memo)
        # (::6 on lo, which the intent adds for the proxy's passthrough to a pod with IPv6 of its own, is
        # one of the pod's addresses once there: pod_entries has it from the scan, or from apply.)
        return (pack_policy(e.policy), tuple(sorted((PORT_KIND[k], port) for k, port in e.ports)),
                tuple(sorted((CIDR_PREFIX_BASE + plen, CIDR_KIND[k], raw) for plen, k, raw in e.cidrs)))

    return remembered(memo, ("packed", it, families), pack)


def pod_entries(it: AnyIntent, families: tuple[int, ...], cookie: int,
                local: tuple[LocalAddr, ...] | list[LocalAddr] | None = None, memo: Memo | None = None) -> PodEntries:
    """The map entries for ``it`` in the netns ``cookie`` whose own addresses are ``local``.

    ``local`` is (family, address, ifindex), as ``NetnsScan.local`` gives it. Called in the pod's
    netns: with ``exclude_interfaces`` (sidecar) or ``reroute_interfaces``, its links and main
    routing table are read here (``lower_ebpf.pod_interfaces``).
    """
    e = intent_entries(it, families, cookie, local, memo)
    low = lowered(it, families, memo)
    if not low.exclude_interfaces and not low.reroute_interfaces:
        return e
    links, routes = links_and_routes()
    try:
        ifs = pod_interfaces(low, families, links, routes)
    except ValueError as err:
        raise SetupError(f"backend=ebpf: {err}") from None
    extra = {CIDR_KEY.pack(CIDR_PREFIX_BASE + plen, CIDR_KIND[k], cookie, raw) for plen, k, raw in ifs}
    return PodEntries(e.policy, e.ports, e.cidrs | extra)


def pod_sources(families: tuple[int, ...], local: Iterable[LocalAddr]) -> dict[str, str]:
    """What the policy holds of the pod's addresses ``local``, by its field's name (``src4``,
    ``src6``, ``ll6``; one the pod has none for is left out). Per family, the source an unbound
    socket's connect gets for a destination off the pod: its first address of the family not on lo
    and not IPv6 link-local (the address of its one interface, in a pod with one; with several, the
    kernel's choice per route may be another); the connect and sendmsg hooks give it to a socket they
    send to the proxy. With IPv6 captured, its first IPv6 link-local address (``ll6``): one of its
    own, held by the policy in place of a local6 entry (``lower_ebpf.pod_local``). The choice is made
    by ``rdr_pod_sources`` (native/pod_setup.c), which the fresh-pod call makes too."""
    ffi, lib = NATIVE.ffi, NATIVE.lib
    addrs = [(f, ipaddress.ip_address(ip).packed, index) for f, ip, index in local if f in (4, 6)]
    a = ffi.new("struct rdr_scan_addr[]", max(1, len(addrs)))
    for i, (f, raw, index) in enumerate(addrs):
        a[i].family, a[i].ifindex, a[i].addr = f, index, raw.ljust(16, b"\0")
    src4, src6, ll6 = ffi.new("uint8_t[4]"), ffi.new("uint8_t[16]"), ffi.new("uint8_t[16]")
    lib.rdr_pod_sources(a, len(addrs), ffi.new("int[2]", [4 in families, 6 in families]), src4, src6, ll6)
    out: dict[str, str] = {}
    for name, buf, size in (("src4", src4, 4), ("src6", src6, 16), ("ll6", ll6, 16)):
        raw = bytes(ffi.buffer(buf, size))
        if any(raw):
            out[name] = str(ipaddress.ip_address(raw))
    return out


def intent_entries(it: AnyIntent, families: tuple[int, ...], cookie: int,
                   local: tuple[LocalAddr, ...] | list[LocalAddr] | None = None,
                   memo: Memo | None = None) -> PodEntries:
    """``pod_entries`` of an intent: its lowering, the pod's own addresses as ``local`` CIDRs
    (``lower_ebpf.pod_local``: a connect to them leaves over lo, Istio's "-o lo" rules) and its
    sources and link-local address in the policy (``pod_sources``)."""
    policy, port_specs, cidr_specs = packed(it, families, memo)
    held = pod_sources(families, local or ())
    if held:
        v = list(POLICY.unpack(policy))
        for i, name, size in ((P_SRC4, "src4", 4), (P_SRC6, "src6", 16), (P_LL6, "ll6", 16)):
            v[i] = _addr16(held[name])[:size] if name in held else bytes(size)
        policy = POLICY.pack(*v)
    ports = frozenset(PORT_KEY.pack(cookie, kind, p, 0) for kind, p in port_specs)
    cidrs = {CIDR_KEY.pack(plen, kind, cookie, raw) for plen, kind, raw in cidr_specs}
    cidrs.update(CIDR_KEY.pack(CIDR_PREFIX_BASE + plen, CIDR_KIND[k], cookie, raw)
                 for plen, k, raw in pod_local(families, local or (), held.get("ll6")))
    return PodEntries(policy, ports, frozenset(cidrs))


def local_key_templates(families: tuple[int, ...]) -> dict[int, bytes]:
    """Per family of ``families``, the ``cidrs`` key ``intent_entries`` gives one of a pod's own
    addresses (``lower_ebpf.pod_local``), with netns and address zero: the fresh-pod call
    (native/pod_setup.c) puts a pod's cookie and each address it finds in their fields."""
    zero = {4: "0.0.0.0", 6: "::"}
    return {f: CIDR_KEY.pack(CIDR_PREFIX_BASE + plen, CIDR_KIND[k], 0, raw)
            for f in families for plen, k, raw in pod_local(families, ((f, zero[f], 0),))}


def fmt_port(k: bytes) -> str:
    _c, kind, port, _ = PORT_KEY.unpack(k)
    name = PORT_KIND_NAME.get(kind)
    return f"{KIND_DISPLAY[name] if name else kind} {port}"


def fmt_cidr(k: bytes) -> str:
    plen, number, _c, raw = CIDR_KEY.unpack(k)
    kind = CIDR_KIND_NAME.get(number)
    if kind is None:
        return f"{number} {raw.hex()}/{plen - CIDR_PREFIX_BASE}"
    shape, name = CIDR_SHAPE[kind], KIND_DISPLAY[kind]
    if shape == "ifindex":
        return f"{name} ifindex {int.from_bytes(raw[:4], 'big')}"
    if shape == "id":  # ids lo-hi of a prefix block
        lo = int.from_bytes(raw[:4], "big")
        return f"{name} {lo}-{lo + (1 << (32 - (plen - CIDR_PREFIX_BASE))) - 1}"
    ip = ipaddress.ip_address(raw if shape == "addr6" else raw[:4])
    return f"{name} {ip}/{plen - CIDR_PREFIX_BASE}"


#: The policy's flags by name (``EbpfPolicy``'s booleans), as ``check`` and ``show`` print them.
_FLAG_NAMES = tuple((flag(f.name), f.name) for f in dataclasses.fields(EbpfPolicy) if f.type in (bool, "bool"))


def fmt_policy(raw: bytes) -> str:
    v = POLICY.unpack(raw)
    flags = v[P_FLAGS]
    on = [n for bit, n in _FLAG_NAMES if flags & bit]
    f = {name: v[i] for name, i in POLICY_LAYOUT.index.items()}

    def ids(name: str, n: str) -> str:  # the first range, and how many more are in the trie
        i = POLICY_LAYOUT.index[name]
        first = _fmt_ids(v[i : i + 2], min(f[n], 1))
        return first + (f"(+{f[n] - 1})" if f[n] > 1 else "")

    def skip(name: str) -> str:  # a hairpin's ports, each once
        i = POLICY_LAYOUT.index[name]
        return ",".join(str(p) for p in dict.fromkeys(v[i : i + POLICY_LAYOUT.count[name]]))

    route = f" route_mark={f['route_mark']:#x}/{f['route_mask']:#x}" if f["route_mask"] else ""
    groups = f["groups_mode"]
    if flags & F_AMBIENT:
        return (f"proxy_port={f['proxy_port']} inbound_port={f['inbound_port']} tunnel_port={f['tunnel_port']}"
                f" dns_port={f['dns_port']} flags={'+'.join(on)} proxy_mark={f['proxy_mark']:#x}/{f['mark_mask']:#x}"
                f" conn_mark={f['conn_mark']:#x} resolver_port={f['resolver_port']}{route}"
                + _fmt_sources(bytes(4), bytes(16), v[P_LL6]))
    return (f"proxy_port={f['proxy_port']} inbound_port={f['inbound_port']} tunnel_port={f['tunnel_port']}"
            f" dns_port={f['dns_port']} flags={'+'.join(on) or '-'}"
            f" loopback={socket.inet_ntoa(f['lo4_addr'])}/{socket.inet_ntoa(f['lo4_mask'])}"
            f" uids={ids('uid0', 'n_uids')} gids={ids('gid0', 'n_gids')}"
            + ("" if groups == GROUPS_ALL else
               f" {'owner_groups' if groups == GROUPS_ONLY else 'owner_groups_exclude'}={ids('group0', 'n_groups')}")
            + f" resolver_port={f['resolver_port']}"
            f" hairpin_skip=uid:{skip('hairpin_uid_skip')}/gid:{skip('hairpin_gid_skip')}"
            f" passthrough={socket.inet_ntop(socket.AF_INET, f['passthrough4'])},"
            f"{socket.inet_ntop(socket.AF_INET6, f['passthrough6'])}{route}"
            + _fmt_sources(v[P_SRC4], v[P_SRC6], v[P_LL6]))


def _fmt_sources(src4: bytes, src6: bytes, ll6: bytes) -> str:
    """The policy's sources and link-local address (a pod's; none in a rendering), as `` sources=a,b
    link-local=c``."""
    out = ([socket.inet_ntop(socket.AF_INET, src4)] if any(src4) else []) + \
        ([socket.inet_ntop(socket.AF_INET6, src6)] if any(src6) else [])
    return (f" sources={','.join(out)}" if out else "") + \
        (f" link-local={socket.inet_ntop(socket.AF_INET6, ll6)}" if any(ll6) else "")


def _fmt_ids(flat: tuple[int, ...], n: int) -> str:
    return ",".join(str(flat[2 * i]) if flat[2 * i] == flat[2 * i + 1] else f"{flat[2 * i]}-{flat[2 * i + 1]}"
                    for i in range(n)) or "-"

