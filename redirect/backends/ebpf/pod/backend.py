"""``EbpfBackend``: per pod apply, remove, check, show and render (the general path: any pod, any
state; a fresh pod is first tried in one native call, ``.fresh``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, BinaryIO

from ....errors import BackendUnavailable, RedirectError, SetupError
from ....kernel import netns as _netns
from ....kernel import routes as rt
from ....plan.intent import AnyIntent
from ....plan.lower_ebpf import CIDR_KIND
from ...base import CheckResult, Installed, fault_point
from ..abi import (
    CIDR_KEY,
    F_AMBIENT,
    F_FWMARK_ACCEPT_OURS,
    F_TPROXY,
    INV_CIDRS,
    INV_PORTS,
    LISTENER_INBOUND,
    LISTENER_OUTBOUND,
    P_FLAGS,
    P_INV_BASE,
    POLICY,
)
from ..host import (
    NATIVE,
    PROCESS,
    PodStore,
    detach_pinned,
    host_problems,
    pod_link,
    reading,
    resolve_cgroup,
    resolve_root,
)
from . import tc
from .entries import (
    fmt_cidr,
    fmt_policy,
    fmt_port,
    intent_entries,
    pod_entries,
    pod_keys,
    policy_core,
    policy_flags,
    refuse,
    replies_by_mark,
    with_flag,
)
from .fresh import detail
from .network import (
    LOOPBACK_IFINDEX,
    V6_ON_LO,
    NetnsScan,
    families_for,
    intent_addresses,
    listener_maybe,
    lo_v6,
    our_addresses,
    proxy_listeners,
    remove_our_addresses,
    scan_netns,
    unserved,
)
from .userns import in_host_ids_here

log = logging.getLogger("redirect.ebpf")


class EbpfBackend:
    """Sidecar and ambient capture with cgroup sock_addr/sockopt/sock_ops programs and sk_lookup."""

    name = "ebpf"

    def __init__(self, root: str | None = None, cgroup: str | None = None) -> None:
        self.root = resolve_root(root)
        self.cgroup = resolve_cgroup(cgroup)
        self._scan: NetnsScan | None = None

    def detect_families(self, it: AnyIntent) -> tuple[int, ...]:
        """The families ``it`` captures here (``redirect.setup``/``check`` ask the backend when it
        has this): IPv6 is on when the netns has an IPv6 address. Read in the dump that ``apply``
        and ``check`` need anyway (kept for them), so a pod costs no IPv6 sysctl read."""
        self._scan = scan_netns()
        return families_for(it, self._scan.v6_on)

    def _take_scan(self) -> NetnsScan:
        """The scan ``detect_families`` made, if it was of this thread's current netns; else a new one."""
        sc, self._scan = self._scan, None
        if sc is not None and sc.thread == threading.get_ident() and sc.inode == _netns.current_inode():
            return sc
        return scan_netns()

    # --- reading what is installed -----------------------------------------------
    def installed(self) -> bool:
        with reading(self.root) as h:
            return h is not None and h.store.policy(_netns.current_cookie()) is not None

    # --- apply / remove ------------------------------------------------------------
    def apply(self, it: AnyIntent, families: tuple[int, ...]) -> Installed:
        refuse(it)
        t0 = time.perf_counter()
        h = PROCESS.host(self.root, self.cgroup)
        assert h is not None
        store = h.store
        t_host = time.perf_counter()
        sc = self._take_scan()
        cookie, local = sc.cookie, sc.local
        old = store.read(cookie)
        plan_addrs = intent_addresses(it, families, sc.own_v6)
        # A config without the intent's addresses (or a pod without an IPv6 address of its own): ours
        # (::6) go at the end, so they are not the pod's own.
        dropping = (our_addresses() if not plan_addrs and (old.policy is not None or V6_ON_LO in local)
                    else ())
        if dropping:
            gone = {(a.family, a.cidr.split("/")[0]) for a in dropping}
            local = tuple(x for x in local if (x[0], x[1]) not in gone)
        # The intent's local addresses (::6 on lo for the proxy's inbound passthrough), as the
        # netfilter backends add them (the native writer adds it); read from the same listing, no
        # netlink dump per pod.
        on_lo = {(f, ip) for f, ip, idx in local if idx == LOOPBACK_IFINDEX}
        add_addrs = [a for a in plan_addrs if (a.family, a.cidr.split("/")[0]) not in on_lo]
        add_v6 = lo_v6(add_addrs)
        # Once added they are the pod's own, as what the scan found.
        local = (*local, *((a.family, a.cidr.split("/")[0], LOOPBACK_IFINDEX) for a in add_addrs))
        # Keyed as the live generation to compare; a change is written in the other one.
        old_base = POLICY.unpack(old.policy)[P_INV_BASE] if old.policy is not None else 1 << 31
        # Owner ids as the programs read them (a netns owned by a user namespace of its own: .userns).
        want = pod_entries(in_host_ids_here(it), families, pod_keys(cookie, old_base), local, store.memo)
        inbound = want.inbound
        # Every pod has one sk_lookup link (outbound-only ones too: it no-ops there). It is the
        # pod's tie to its netns: the kernel detaches it when the netns dies, which is how
        # collect_garbage() finds pods whose netns went without a teardown.
        pinned_target = store.link_target(cookie)  # None: no pin
        have_link = pinned_target == sc.inode and store.link_cookie(cookie) == cookie
        # Listeners the proxy opened before this setup (those opened later the sock_ops program
        # registers as they start listening): looked for only while a family has none.
        in_unserved = unserved(store, cookie, families) if old.policy is not None else families  # a new pod: none
        scan = inbound and listener_maybe(sc, it.inbound_port, in_unserved, store.tcp_diag())
        # With reroute_interfaces, the proxy's outbound listener too (registered here, in the
        # sockhash, before the policy that makes sk_lookup look for it).
        reroute = bool(it.reroute_interfaces)
        out_unserved = (unserved(store, cookie, families, LISTENER_OUTBOUND) if old.policy is not None else families
                        ) if reroute else ()
        oscan = reroute and listener_maybe(sc, it.proxy_port, out_unserved, store.tcp_diag())
        # Our tc filters on the interfaces the pod forwards on (what it forwards is captured as
        # netfilter's inbound capture takes it: redirect/bpf/tc_forward.c, .tc), with the pod's pool slot.
        want_tc = tc.wanted(want)
        # (Also when a write without a policy was interrupted, which may have left filters: its
        # entries or its link are there.)
        have_tc = (tc.ours() if want_tc or old.policy is not None or old.leftover_inv or pinned_target is not None
                   else {})
        progs_tc = store.tc_program_ids() if want_tc or have_tc else (0, 0)
        slot_now = store.link_slot(cookie) if have_link else None  # (None: a slot is claimed with the link)
        tc_attach = tc.to_attach(want_tc, have_tc, progs_tc, slot_now)
        tc_same = not tc_attach and set(have_tc) == want_tc
        # The intent's policy routes (ambient, TPROXY: the app's replies to a proxy's transparent
        # connections, by mark), as the netfilter backends add them, and tcp_fwmark_accept (see
        # _fwmark_state). Our routes are read for any config: a setup killed between them and the
        # policy leaves the routes of a config the policy does not name, which this one then adds
        # or removes.
        old_flags = POLICY.unpack(old.policy)[P_FLAGS] if old.policy is not None else 0
        rtx = _route_txn(it, families)
        fw_ours, fw_set = _fwmark_state(want.policy, old_flags)
        policy = with_flag(want.policy, F_FWMARK_ACCEPT_OURS, fw_ours)
        unchanged = (not scan and not oscan and old.policy is not None and policy_core(old.policy) == want.policy
                     and not add_addrs and not dropping
                     and not (old_flags ^ policy_flags(policy)) & F_FWMARK_ACCEPT_OURS
                     and fw_set is None and not rtx.changed
                     and all(old.entries[m] == w for m, w in want.by_map().items()) and have_link and tc_same)
        if unchanged:
            return Installed(self.name, "", families, False, _general_detail(store, cookie, t0, t_host))
        # The other generation: old and new inventories and keys never overlap, the old policy
        # reads none of the new entries, and the policy write switches to all of them at once.
        base = old_base ^ (1 << 31)
        want = dataclasses.replace(want.keyed(pod_keys(cookie, base)), policy=policy)
        if old.leftover_inv:
            store.drop_leftovers(old)
        listeners_cm: contextlib.AbstractContextManager[dict[int, int]] = (
            proxy_listeners(it.inbound_port) if scan else contextlib.nullcontext({})
        )
        out_cm: contextlib.AbstractContextManager[dict[int, int]] = (
            proxy_listeners(it.proxy_port) if oscan else contextlib.nullcontext({})
        )
        with listeners_cm as lfds, out_cm as ofds:
            registered: list[int] = []
            own_fd = None
            try:
                rtx.apply()  # before the policy: replies route back once capture is on
                for fam, fd in ofds.items():
                    if store.add_listener(cookie, fam, LISTENER_OUTBOUND, fd):
                        registered.append(fam)
                link_netns = -1
                if not have_link:
                    if pinned_target is not None:
                        store.drop_link(cookie)  # a detached, foreign or unreadable one
                    nsfd = _netns.current_fd()  # the fd redirect.setup entered the netns with
                    if nsfd is None:
                        nsfd = own_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                    link_netns = nsfd
                # The difference, in one native call that undoes itself on failure.
                store.write(cookie, want.to_write(), old, base, lfds, link_netns, sc.inode, tc_attach, slot_now,
                            add_v6, (rt.RT_PROTO, rt.IFA_F_NODAD))
            except BaseException as e:
                for fam in registered:
                    store.drop_listener(cookie, fam, LISTENER_OUTBOUND)
                with contextlib.suppress(OSError, RedirectError):
                    rtx.rollback()
                if isinstance(e, OSError):
                    raise SetupError(f"ebpf: setup failed and was undone: {e}") from e
                raise
            finally:
                if own_fd is not None:
                    os.close(own_fd)
        if set(have_tc) - want_tc:  # after the policy (filters of interfaces that no longer forward)
            tc.detach(set(have_tc) - want_tc)
        if not reroute:  # (the outbound listener's entries of an earlier config with reroute_interfaces)
            for fam in (4, 6):
                store.drop_listener(cookie, fam, LISTENER_OUTBOUND)
        # After the policy, which records whether the setting is ours to undo (a kill in between
        # leaves it recorded and not set: check reports it, the next setup sets it).
        if fw_set is not None:
            fw_set.write()
        rtx.finish()
        for ours in dropping:
            rt.remove_address(ours)
        d = _general_detail(store, cookie, t0, t_host)
        log.debug("ebpf apply cookie=%d pod=%.3f ms", cookie, d["pod_ms"])
        return Installed(self.name, "", families, True, d)

    def remove(self, keep_routes: bool = False) -> bool:
        """Delete this pod's policy, its inventoried entries, listeners and link: O(its entries).

        Per-socket state (original destinations) goes with the sockets, and is inert once the
        policy is gone: every program looks the pod up first.
        """
        cookie = _netns.current_cookie()
        # Our tc filters first: each names the pod's pool slot, which goes with its link below (a
        # slot claimed by another pod later must find no filter of this netns).
        try:
            had_tc = tc.detach_all() > 0
        except OSError as e:
            raise SetupError(f"ebpf: teardown failed, nothing removed: {e}") from e
        with reading(self.root) as h:
            if h is None:  # no pods map anywhere: no program of ours can capture; a link pin may be left
                link = pod_link(self.root, cookie)
                if os.path.exists(link):
                    detach_pinned(link)
                    return True
                return had_tc
            policy = h.store.policy(cookie)
            removed = h.store.remove(cookie) or had_tc
        flags = policy_flags(policy) if policy is not None else 0
        if flags & F_FWMARK_ACCEPT_OURS:
            set_fwmark_accept(0)
        if keep_routes:  # (another backend's capture uses them now)
            return removed
        if policy is None or flags & _ROUTED:
            # The policy routes (ambient; TPROXY), or what a setup killed before its policy left
            # (as the netfilter backends' remove, all of ours).
            return rt.remove_all_ours() or removed
        remove_our_addresses()
        return removed

    # --- check / show / render ----------------------------------------------------
    def check(self, it: AnyIntent, families: tuple[int, ...]) -> CheckResult:
        """Compare the maps, read back entry by entry, and the link with what ``it`` wants here."""
        refuse(it)
        with reading(self.root) as h:
            host_diffs = host_problems(self.root, self.cgroup, PROCESS.build_id(), h)
            if h is None:
                return CheckResult(False, self.name, (f"host programs are not pinned under {self.root}", *host_diffs))
            return self._check(h.store, host_diffs, it, families)

    def _check(self, store: PodStore, diffs: list[str], it: AnyIntent, families: tuple[int, ...]) -> CheckResult:
        sc = self._take_scan()
        cookie = sc.cookie
        st = store.read(cookie)
        live_base = POLICY.unpack(st.policy)[P_INV_BASE] if st.policy is not None else 0
        try:
            host_it = in_host_ids_here(it)
        except BackendUnavailable as e:  # (its maps unreadable: the rest is compared as the config says)
            diffs.append(str(e))
            host_it = it
        want = pod_entries(host_it, families, pod_keys(cookie, live_base), sc.local, store.memo)
        if st.policy is None:
            diffs.append(f"no policy entry for netns cookie {cookie}")
        elif policy_core(st.policy) != want.policy:
            diffs.append("policy entry differs: have " + fmt_policy(st.policy) + ", want " + fmt_policy(want.policy))
        fmt = {INV_PORTS: fmt_port, INV_CIDRS: fmt_cidr}
        what = {INV_PORTS: "port entry", INV_CIDRS: "CIDR entry"}
        for m, w in want.by_map().items():
            # Read back from the maps (not only our inventory): an entry deleted by hand is drift.
            live = st.entries[m] | {k for k in w if store.has_entry(m, k)}
            diffs += [f"missing {what[m]} {fmt[m](k)}" for k in sorted(w - live)]
            diffs += [f"extra {what[m]} {fmt[m](k)}" for k in sorted(live - w)]
        info = store.link_info(cookie, strict=True)
        if info is None:
            diffs.append("no sk_lookup link on this netns")
        else:
            if info["target"] != os.stat("/proc/thread-self/ns/net").st_ino:
                diffs.append("sk_lookup link is not attached to this netns (netns gone or detached)")
            if store.prog_cookie(info["prog_id"]) != cookie:
                diffs.append("sk_lookup link runs another program than this pod's")
        diffs += rt.differences(it, families)
        diffs += tc.differences(tc.wanted(want), tc.ours(), store.tc_program_ids(), store.link_slot(cookie))
        if replies_by_mark(policy_flags(want.policy)) and fwmark_accept() != 1:
            diffs.append("net.ipv4.tcp_fwmark_accept is 0 here: the app's replies to the proxy's transparent"
                         " connections need it (setup sets it)")
        return CheckResult(not diffs, self.name, tuple(diffs))

    def show(self) -> dict[str, Any]:
        with reading(self.root) as h:
            if h is None:
                return {"backend": self.name, "root": self.root, "host_programs": None, "installed": False}
            return self._show(h.store)

    def _show(self, store: PodStore) -> dict[str, Any]:
        cookie = _netns.current_cookie()
        st = store.read(cookie)
        link = store.link_path(cookie)
        listening, out_listening = ([f for f in (4, 6) if store.has_listener(cookie, f, kind)]
                                    for kind in (LISTENER_INBOUND, LISTENER_OUTBOUND))
        return {
            "backend": self.name, "root": self.root, "netns_cookie": cookie, "installed": st.policy is not None,
            "host_programs": store.program_ids(),
            "policy": fmt_policy(st.policy) if st.policy else None,
            "ports": sorted(fmt_port(k) for k in st.ports), "cidrs": sorted(fmt_cidr(k) for k in st.cidrs),
            "addresses": sorted(fmt_cidr(k).split(" ", 1)[1].rsplit("/", 1)[0] for k in st.cidrs
                                if CIDR_KEY.unpack(k)[1] in (CIDR_KIND["local4"], CIDR_KIND["local6"])),
            "inbound_listeners": [f"IPv{f}" for f in listening],
            "outbound_listeners": [f"IPv{f}" for f in out_listening],  # with reroute_interfaces
            "routes": rt.describe_ours()["routes"] if st.policy is None or policy_flags(st.policy) & _ROUTED else [],
            "sk_lookup_link": link if os.path.exists(link) else None,
            "tc_filters": tc.describe(tc.ours()),
            "missing_host_pins": PROCESS.missing_pins(self.root),
        }

    def render(self, it: AnyIntent, families: tuple[int, ...]) -> str:
        """What ``apply`` would write for ``it``: its eBPF lowering, as text (netns cookie shown as <netns>)."""
        refuse(it)
        e = intent_entries(it, families, 0)
        lines = [f"pods[<netns>] = {fmt_policy(e.policy)}"]
        lines += [f"ports[{fmt_port(k)}]" for k in sorted(e.ports)]
        lines += [f"cidrs[{fmt_cidr(k)}]" for k in sorted(e.cidrs)]
        lines.append("cidrs[local <each pod address>]")
        lines.append("sk_lookup link on the pod netns (its program holds the netns cookie)")
        if e.inbound:
            lines.append(f"listeners[<netns>, family] = proxy socket listening on {it.inbound_port}")
        if it.reroute_interfaces:
            lines.append(f"cidrs[reroute-interface <ifindex of each of {', '.join(it.reroute_interfaces)}>]")
            lines.append(f"listeners[<netns>, family, outbound] = proxy socket listening on {it.proxy_port}")
        if tc.takes_forwarded(e):
            lines.append("tc filters (ingress, egress; classid: the pod's pool slot + 1) on each interface the pod"
                         " forwards on, but excluded ones (forwarded TCP to the proxy, redirect/bpf/tc_forward.c)")
        lines += [f"IPv{r.family} rule fwmark {r.fwmark:#x}/{r.mask:#x} lookup {r.table}; route local default dev lo"
                  f" table {r.table}" for r in it.routes if r.family in families]
        lines += [f"address {a.cidr} on {a.dev} (in a pod with an IPv{a.family} address of its own)"
                  for a in it.local_addresses if a.family in families]
        if replies_by_mark(policy_flags(e.policy)):
            lines.append("sysctl net.ipv4.tcp_fwmark_accept = 1")
        return "\n".join(lines) + "\n"


#: Policy flags of the configs whose plans may have policy routes (ambient: always; TPROXY: with
#: inbound capture): their setup and teardown look for ours.
_ROUTED = F_AMBIENT | F_TPROXY


_FWMARK_ACCEPT = "net/ipv4/tcp_fwmark_accept"


def _fwmark_open(flags: int) -> BinaryIO:
    """``net.ipv4.tcp_fwmark_accept`` of the calling thread's netns, opened as the native setup opens
    it (``rdr_sysctl_open``: through a procfs instance of the thread's own where it may mount one, so
    the look-up's cost does not grow with the pods)."""
    fd = NATIVE.lib.rdr_sysctl_open(_FWMARK_ACCEPT.encode(), flags)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), f"/proc/sys/{_FWMARK_ACCEPT}")
    return open(fd, "r+b" if flags == os.O_RDWR else "rb", buffering=0)


def fwmark_accept() -> int:
    """``net.ipv4.tcp_fwmark_accept`` of the calling thread's netns."""
    with _fwmark_open(os.O_RDONLY) as f:
        return int(f.read().strip() or 0)


def set_fwmark_accept(value: int) -> None:
    with _fwmark_open(os.O_RDWR) as f:
        f.write(f"{value}\n".encode())


class _FwmarkWrite:
    """The value of ``net.ipv4.tcp_fwmark_accept`` to write after the policy, on the file read
    before it: one sysctl look-up per setup."""

    def __init__(self, f: BinaryIO, value: int) -> None:
        self.f, self.value = f, value

    def write(self) -> None:
        try:
            fault_point("ebpf.before_fwmark_accept")  # (the fresh-pod call has it too)
            os.pwrite(self.f.fileno(), f"{self.value}\n".encode(), 0)
        finally:
            self.f.close()


def _fwmark_state(want: bytes, old_flags: int) -> tuple[bool, _FwmarkWrite | None]:
    """Whether ``net.ipv4.tcp_fwmark_accept`` will be ours (set by us, to undo at teardown), and the
    write to make after the policy (None: none). A pod whose proxy's transparent connections are
    answered by mark (``replies_by_mark``) needs it on (the app's request socket takes the mark of
    the proxy's SYN, redirect/bpf/sockopt.c); it is ours if it was off before (or ours already), and turned
    off again when no longer needed."""
    need = replies_by_mark(policy_flags(want))
    ours_before = bool(old_flags & F_FWMARK_ACCEPT_OURS)
    if not need and not ours_before:
        return False, None
    f = _fwmark_open(os.O_RDWR)  # (closed by _FwmarkWrite.write, or below)
    try:
        now = int(f.read().strip() or 0)
    except BaseException:
        f.close()
        raise
    ours, value = (ours_before or now == 0, 1 if now != 1 else None) if need else (False, 0 if now != 0 else None)
    if value is None:
        f.close()
        return ours, None
    return ours, _FwmarkWrite(f, value)


def _route_txn(it: AnyIntent, families: tuple[int, ...]) -> rt.RouteTxn:
    """The intent's policy routes as a transaction; our addresses are left as they are (the backend
    manages ``::6`` itself)."""
    state = rt.read_ours()
    return rt.RouteTxn(tuple(r for r in it.routes if r.family in families), tuple(state.addresses), families, state)


def _general_detail(store: PodStore, cookie: int, t0: float, t_host: float) -> dict[str, Any]:
    """``fresh.detail`` of ``apply``, which started at ``t0`` and had the host programs at ``t_host``."""
    return detail(store, cookie, round((t_host - t0) * 1e3, 3), round((time.perf_counter() - t_host) * 1e3, 3))
