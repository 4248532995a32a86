"""What a config writes into the maps, packed in the ``redirect/bpf/abi.h`` layout, and how entries read.

The eBPF lowering of the config's intent (``redirect.plan.lower_ebpf``) gives typed entries;
``_intent_entries`` packs them once per intent, ``intent_entries`` (``pod_entries`` for a config) keys
them by a pod's netns cookie and adds the pod's own addresses (``lower_ebpf.pod_local``).
``_unsupported`` refuses the options this backend does not implement. The ``_fmt_*`` functions
turn entries into the text of ``check``, ``show`` and ``render``.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass

from ...config import RedirectConfig
from ...errors import BackendUnavailable, SetupError
from ...plan.intent import AmbientIntent, Intent, ambient_intent_of, intent_of
from ...plan.lower_ebpf import lower_ebpf, pod_interfaces, pod_local, pod_sources
from .abi import (
    CIDR_DNS4,
    CIDR_DNS6,
    CIDR_GID,
    CIDR_GROUP,
    CIDR_IF_EXCL,
    CIDR_IF_REROUTE,
    CIDR_KEY,
    CIDR_LOCAL4,
    CIDR_LOCAL6,
    CIDR_OUT_EXCL4,
    CIDR_OUT_EXCL6,
    CIDR_OUT_INCL4,
    CIDR_OUT_INCL6,
    CIDR_PREFIX_BASE,
    CIDR_PROBE4,
    CIDR_PROBE6,
    CIDR_UID,
    CIDR_VIA_EXCL4,
    CIDR_VIA_EXCL6,
    F_AMBIENT,
    F_DNS,
    F_DNS_ALL,
    F_EXCL_IF,
    F_FWMARK_ACCEPT_OURS,
    F_INBOUND,
    F_INBOUND_ALL,
    F_INCL_LOOPBACK,
    F_OUT_ALL,
    F_REROUTE,
    F_SOCKMAP,
    F_TPROXY,
    F_V6,
    GEN_BIT,
    GROUPS_ALL,
    GROUPS_EXCLUDE,
    GROUPS_ONLY,
    INV_CIDRS,
    INV_PORTS,
    P_FLAGS,
    P_INV_BASE,
    P_N_INV,
    P_SRC4,
    P_SRC6,
    POLICY,
    POLICY_LAYOUT,
    PORT_IN_EXCL,
    PORT_IN_INCL,
    PORT_KEY,
    PORT_OUT_EXCL,
    PORT_OUT_INCL,
    U64,
)


def _unsupported(cfg: RedirectConfig) -> None:
    def no(option: str, why: str) -> None:
        raise BackendUnavailable(f"backend=ebpf: {option} is not available with eBPF ({why}); use backend=iptables")

    if cfg.drop_invalid and cfg.mode == "sidecar":  # (ambient capture has no such rule on any backend)
        no("drop_invalid=True", "conntrack's INVALID verdict exists only for packets conntrack tracks, and it"
           " tracks none in a netns without netfilter rules that use it: bpf_skb_ct_lookup finds no entry there"
           " and BPF cannot run conntrack on a packet")
    if cfg.dns_effective and cfg.proxy_gids and not cfg.gid_hairpin_skips_dns:
        no("gid_hairpin_skips_dns=False", "the programs leave port 53 alone for proxy uids and gids alike")


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


def _policy_core(policy: bytes) -> bytes:
    """The policy without its bookkeeping (inventory, ``tcp_fwmark_accept``): what a config decides."""
    v = list(POLICY.unpack(policy))
    v[P_INV_BASE] = v[P_N_INV] = 0
    v[P_FLAGS] &= ~F_FWMARK_ACCEPT_OURS
    return POLICY.pack(*v)


def replies_by_mark(flags: int) -> bool:
    """Whether a pod with policy ``flags`` has a proxy's transparent connections to the app answered
    by the mark of their SYN (``redirect/bpf/sockopt.c``, ``local_connect``): inbound capture in ambient
    mode (the node proxy) or with TPROXY (a sidecar's ``original_src``). The app's side then takes
    the plan's policy route by that mark, which needs ``net.ipv4.tcp_fwmark_accept`` on in the pod."""
    return bool(flags & F_INBOUND and flags & (F_AMBIENT | F_TPROXY))


def _with_flag(policy: bytes, flag: int, on: bool) -> bytes:
    v = list(POLICY.unpack(policy))
    v[P_FLAGS] = v[P_FLAGS] | flag if on else v[P_FLAGS] & ~flag
    return POLICY.pack(*v)


def config_intent(cfg: RedirectConfig) -> Intent | AmbientIntent:
    """The intent of ``cfg``, sidecar or ambient."""
    return ambient_intent_of(cfg) if cfg.mode == "ambient" else intent_of(cfg)


def _with_inventory(policy: bytes, base: int, n: int) -> bytes:
    v = list(POLICY.unpack(policy))
    v[P_INV_BASE], v[P_N_INV] = base, n
    return POLICY.pack(*v)


_PORT_KIND = {"out_exclude": PORT_OUT_EXCL, "out_include": PORT_OUT_INCL, "in_include": PORT_IN_INCL,
              "in_exclude": PORT_IN_EXCL}
_CIDR_KIND = {"out_exclude4": CIDR_OUT_EXCL4, "out_include4": CIDR_OUT_INCL4, "dns4": CIDR_DNS4,
              "out_exclude6": CIDR_OUT_EXCL6, "out_include6": CIDR_OUT_INCL6, "dns6": CIDR_DNS6,
              "local4": CIDR_LOCAL4, "local6": CIDR_LOCAL6, "uid": CIDR_UID, "gid": CIDR_GID, "group": CIDR_GROUP,
              "iface_exclude": CIDR_IF_EXCL, "via_exclude4": CIDR_VIA_EXCL4, "via_exclude6": CIDR_VIA_EXCL6,
              "iface_reroute": CIDR_IF_REROUTE, "probe4": CIDR_PROBE4, "probe6": CIDR_PROBE6}


@functools.lru_cache(maxsize=256)
def _intent_entries(it: Intent | AmbientIntent, families: tuple[int, ...]) -> tuple[bytes, tuple[tuple[int, int], ...],
                                                                   tuple[tuple[int, int, bytes], ...]]:
    """What ``it`` writes, whatever the pod: the policy, (kind, port)s and (prefix, kind, addr)s.

    The eBPF lowering of the intent (``redirect.plan.lower_ebpf``), packed. Cached (intents are
    frozen): many pods share a config, and lowering is ~20 us of ``ipaddress``.
    """
    e = lower_ebpf(it, families)
    p = e.policy
    flags = sum(bit for on, bit in ((p.out_all, F_OUT_ALL), (p.dns, F_DNS), (p.dns_all, F_DNS_ALL),
                                     (p.incl_loopback, F_INCL_LOOPBACK), (p.inbound, F_INBOUND),
                                     (p.inbound_all, F_INBOUND_ALL), (p.v6, F_V6), (p.tproxy, F_TPROXY),
                                     (p.excl_if, F_EXCL_IF), (p.reroute_if, F_REROUTE), (p.ambient, F_AMBIENT),
                                     (p.sockmap, F_SOCKMAP)) if on)
    lo = ipaddress.ip_network(p.loopback4)
    groups_mode = {"all": GROUPS_ALL, "only": GROUPS_ONLY, "exclude": GROUPS_EXCLUDE}[p.groups_mode]
    policy = POLICY.pack(
        p.proxy_port, p.inbound_port, p.tunnel_port, p.dns_port, flags,
        lo.network_address.packed, lo.netmask.packed, p.n_uids, p.n_gids, 0, 0,
        *p.uid0, *p.gid0, groups_mode, p.n_groups, *p.group0, p.tproxy_mark, bytes(4), bytes(16), p.proxy_mark,
        p.mark_mask, p.conn_mark,
    )
    # (::6 on lo, which the plan adds for the proxy's passthrough to a pod with IPv6 of its own, is
    # one of the pod's addresses once there: pod_entries has it from the scan, or from apply.)
    return (policy, tuple(sorted((_PORT_KIND[k], port) for k, port in e.ports)),
            tuple(sorted((CIDR_PREFIX_BASE + plen, _CIDR_KIND[k], raw) for plen, k, raw in e.cidrs)))


def pod_entries(cfg: RedirectConfig, families: tuple[int, ...], cookie: int,
                local: tuple[tuple[int, str, int], ...] | list[tuple[int, str, int]] | None = None) -> PodEntries:
    """The map entries for ``cfg`` in the netns ``cookie`` whose own addresses are ``local``.

    ``local`` is (family, address, ifindex), as ``NetnsScan.local`` gives it. Called in the pod's
    netns: with ``exclude_interfaces`` or ``reroute_interfaces``, its links and main routing table
    are read here (``lower_ebpf.pod_interfaces``).
    """
    e = intent_entries(config_intent(cfg), families, cookie, local)
    if not cfg.reroute_interfaces and (not cfg.exclude_interfaces or cfg.mode == "ambient"):
        return e
    from .podnet import links_and_routes

    links, routes = links_and_routes()
    try:
        ifs = pod_interfaces(lower_ebpf(config_intent(cfg), families), families, links, routes)
    except ValueError as err:
        raise SetupError(f"backend=ebpf: {err}") from None
    extra = {CIDR_KEY.pack(CIDR_PREFIX_BASE + plen, _CIDR_KIND[k], cookie, raw) for plen, k, raw in ifs}
    return PodEntries(e.policy, e.ports, e.cidrs | extra)


def intent_entries(it: Intent | AmbientIntent, families: tuple[int, ...], cookie: int,
                   local: tuple[tuple[int, str, int], ...] | list[tuple[int, str, int]] | None = None) -> PodEntries:
    """``pod_entries`` of an intent: its lowering, the pod's own addresses as ``local`` CIDRs
    (``lower_ebpf.pod_local``: a connect to them leaves over lo, Istio's "-o lo" rules) and its
    sources in the policy (``lower_ebpf.pod_sources``)."""
    policy, port_specs, cidr_specs = _intent_entries(it, families)
    src = pod_sources(families, local or ())
    if src:
        v = list(POLICY.unpack(policy))
        v[P_SRC4] = _addr16(src[4])[:4] if 4 in src else bytes(4)
        v[P_SRC6] = _addr16(src[6]) if 6 in src else bytes(16)
        policy = POLICY.pack(*v)
    ports = frozenset(PORT_KEY.pack(cookie, kind, p, 0) for kind, p in port_specs)
    cidrs = {CIDR_KEY.pack(plen, kind, cookie, raw) for plen, kind, raw in cidr_specs}
    cidrs.update(CIDR_KEY.pack(CIDR_PREFIX_BASE + plen, _CIDR_KIND[k], cookie, raw)
                 for plen, k, raw in pod_local(families, local or ()))
    return PodEntries(policy, ports, frozenset(cidrs))


def local_key_templates(families: tuple[int, ...]) -> dict[int, bytes]:
    """Per family of ``families``, the ``cidrs`` key ``intent_entries`` gives one of a pod's own
    addresses (``lower_ebpf.pod_local``), with netns and address zero: the fresh-pod call
    (native/pod_setup.c) puts a pod's cookie and each address it finds in their fields."""
    zero = {4: "0.0.0.0", 6: "::"}
    return {f: CIDR_KEY.pack(CIDR_PREFIX_BASE + plen, _CIDR_KIND[k], 0, raw)
            for f in families for plen, k, raw in pod_local(families, ((f, zero[f], 0),))}


_PORT_KINDS = {PORT_OUT_EXCL: "outbound-exclude", PORT_OUT_INCL: "outbound-include",
               PORT_IN_INCL: "inbound-include", PORT_IN_EXCL: "inbound-exclude"}
_CIDR_KINDS = {CIDR_OUT_EXCL4: "outbound-exclude", CIDR_OUT_INCL4: "outbound-include", CIDR_DNS4: "dns-server",
               CIDR_OUT_EXCL6: "outbound-exclude", CIDR_OUT_INCL6: "outbound-include", CIDR_DNS6: "dns-server",
               CIDR_LOCAL4: "local", CIDR_LOCAL6: "local", CIDR_UID: "proxy-uid", CIDR_GID: "proxy-gid",
               CIDR_GROUP: "owner-group", CIDR_IF_EXCL: "excluded-interface", CIDR_VIA_EXCL4: "via-excluded-interface",
               CIDR_VIA_EXCL6: "via-excluded-interface", CIDR_IF_REROUTE: "reroute-interface",
               CIDR_PROBE4: "probe-source", CIDR_PROBE6: "probe-source"}


def _fmt_port(k: bytes) -> str:
    _c, kind, port, _ = PORT_KEY.unpack(k)
    return f"{_PORT_KINDS.get(kind, kind)} {port}"


def _fmt_cidr(k: bytes) -> str:
    plen, kind, _c, raw = CIDR_KEY.unpack(k)
    v6 = kind in (CIDR_OUT_EXCL6, CIDR_OUT_INCL6, CIDR_DNS6, CIDR_LOCAL6, CIDR_VIA_EXCL6, CIDR_PROBE6)
    if kind in (CIDR_IF_EXCL, CIDR_IF_REROUTE):
        return f"{_CIDR_KINDS[kind]} ifindex {int.from_bytes(raw[:4], 'big')}"
    if kind in (CIDR_UID, CIDR_GID, CIDR_GROUP):  # ids lo-hi of a prefix block
        lo = int.from_bytes(raw[:4], "big")
        return f"{_CIDR_KINDS[kind]} {lo}-{lo + (1 << (32 - (plen - 96))) - 1}"
    ip = ipaddress.ip_address(raw if v6 else raw[:4])
    return f"{_CIDR_KINDS.get(kind, kind)} {ip}/{plen - 96}"


def _fmt_policy(raw: bytes) -> str:
    v = POLICY.unpack(raw)
    flags = v[P_FLAGS]
    names = {F_OUT_ALL: "out_all", F_DNS: "dns", F_DNS_ALL: "dns_all", F_INCL_LOOPBACK: "incl_loopback",
             F_INBOUND: "inbound", F_INBOUND_ALL: "inbound_all", F_V6: "v6", F_TPROXY: "tproxy", F_EXCL_IF: "excl_if",
             F_REROUTE: "reroute_if", F_AMBIENT: "ambient", F_SOCKMAP: "sockmap"}
    on = [n for bit, n in names.items() if flags & bit]
    f = {name: v[i] for name, i in POLICY_LAYOUT.index.items()}

    def ids(name: str, n: str) -> str:  # the first range, and how many more are in the trie
        i = POLICY_LAYOUT.index[name]
        first = _fmt_ids(v[i : i + 2], min(f[n], 1))
        return first + (f"(+{f[n] - 1})" if f[n] > 1 else "")

    groups = f["groups_mode"]
    if flags & F_AMBIENT:
        return (f"proxy_port={f['proxy_port']} inbound_port={f['inbound_port']} tunnel_port={f['tunnel_port']}"
                f" dns_port={f['dns_port']} flags={'+'.join(on)} proxy_mark={f['proxy_mark']:#x}/{f['mark_mask']:#x}"
                f" conn_mark={f['conn_mark']:#x}")
    return (f"proxy_port={f['proxy_port']} inbound_port={f['inbound_port']} tunnel_port={f['tunnel_port']}"
            f" dns_port={f['dns_port']} flags={'+'.join(on) or '-'}"
            f" loopback={socket.inet_ntoa(f['lo4_addr'])}/{socket.inet_ntoa(f['lo4_mask'])}"
            f" uids={ids('uid0', 'n_uids')} gids={ids('gid0', 'n_gids')}"
            + ("" if groups == GROUPS_ALL else
               f" {'owner_groups' if groups == GROUPS_ONLY else 'owner_groups_exclude'}={ids('group0', 'n_groups')}")
            + _fmt_sources(v[P_SRC4], v[P_SRC6]))


def _fmt_sources(src4: bytes, src6: bytes) -> str:
    """The policy's sources (a pod's; none in a rendering), as `` sources=a,b``."""
    out = ([socket.inet_ntop(socket.AF_INET, src4)] if any(src4) else []) + \
        ([socket.inet_ntop(socket.AF_INET6, src6)] if any(src6) else [])
    return f" sources={','.join(out)}" if out else ""


def _fmt_ids(flat: tuple[int, ...], n: int) -> str:
    return ",".join(str(flat[2 * i]) if flat[2 * i] == flat[2 * i + 1] else f"{flat[2 * i]}-{flat[2 * i + 1]}"
                    for i in range(n)) or "-"

