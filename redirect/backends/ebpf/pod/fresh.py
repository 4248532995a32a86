"""A fresh pod (nothing of ours in its netns yet) set up in one native call (``native/pod_setup.c``):
``setup_fresh``, what ``redirect.setup(..., backend="ebpf")`` tries first. It is the general path's
write (``rdr_ebpf_pod_write``) from an empty inventory, of the entries the lowering computed once
per intent (``FreshPodTemplate``: ``entries.intent_entries``, as ``apply`` computes them), with the
pod's netns cookie and addresses put in their fields; the call backs off (nothing changed) to
``EbpfBackend.apply`` for a pod that is not fresh.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from typing import Any

from ....errors import SetupError
from ....kernel import locks
from ....kernel import netns as _netns
from ....kernel import routes as rt
from ....kernel.netns import NetnsRef
from ....plan.intent import AnyIntent, Intent
from ...base import Installed, ebpf_root
from ..host import NATIVE, PROCESS, PodStore, setup_failed
from .entries import intent_entries, local_key_templates, policy_flags, refuse, remembered, replies_by_mark
from .network import LOOPBACK_IFINDEX, families_for, intent_addresses
from .tc import takes_forwarded
from .userns import owns_ids

log = logging.getLogger("redirect.ebpf")


class FreshPodTemplate:
    """What intent ``it`` writes in any fresh pod, for ``rdr_ebpf_pod_add`` (native/pod_setup.c): per
    kind of pod (IPv6 on in its netns or not, an IPv6 address of its own or not: what decides its
    families and the intent's addresses), the ``struct rdr_pod_set``: the entries of
    ``entries.intent_entries`` with netns 0, the intent's address (``::6``) it adds with its key, and
    the key of one of the pod's own addresses per family (``local_key_templates``). Made once per
    intent and handle (``PodStore.memo``); the cffi buffers live as long as this object, and so does
    ``calls``, each thread's ``struct rdr_pod_call``."""

    def __init__(self, it: AnyIntent, store: PodStore) -> None:
        ffi = NATIVE.ffi
        self.intent = it
        self.inbound_port = 0
        #: Its capture takes what a pod forwards: our tc filters on the interfaces a pod forwards on.
        self.tc_forwarded = False
        #: [v6_on][own_v6]: (policy, ports, cidrs) buffers, and the rest of the set.
        self.sets: list[list[tuple[Any, Any, int, Any, int, dict[int, bytes], bool, bytes | None]]] = []
        #: [v6_on]: the policy routes' ops (``rt.route_ops``), and whether the pod needs
        #: ``tcp_fwmark_accept`` on.
        self.routes: list[tuple[tuple[tuple[int, ...], ...], bool]] = []
        self.calls = threading.local()
        for v6_on in (False, True):
            row = []
            families = families_for(it, v6_on)
            ops = tuple(op for r in it.routes if r.family in families for op in rt.route_ops(r))
            fwmark = False
            for own_v6 in (False, True):
                adds = intent_addresses(it, families, own_v6)
                e = intent_entries(it, families, 0,
                                   tuple((a.family, a.cidr.split("/")[0], LOOPBACK_IFINDEX) for a in adds), store.memo)
                if e.inbound:
                    self.inbound_port = it.inbound_port
                self.tc_forwarded |= takes_forwarded(e)
                fwmark |= replies_by_mark(policy_flags(e.policy))
                ports, cidrs = b"".join(sorted(e.ports)), b"".join(sorted(e.cidrs))
                bufs = [ffi.new(t, max(n, 1)) for t, n in (("struct pod_policy[]", 1), ("struct port_key[]",
                                                           len(e.ports)), ("struct cidr_key[]", len(e.cidrs)))]
                for buf, raw in zip(bufs, (e.policy, ports, cidrs), strict=True):
                    ffi.memmove(buf, raw, len(raw))
                add = ipaddress.ip_address(adds[0].cidr.split("/")[0]).packed if adds else None
                row.append((bufs[0], bufs[1], len(e.ports), bufs[2], len(e.cidrs), local_key_templates(families),
                            6 in families, add))
            self.sets.append(row)
            self.routes.append((ops, fwmark))
        self.request = self._request(store)

    def _request(self, store: PodStore) -> Any:
        """The ``struct rdr_pod_req`` of this template on ``store``'s maps (shared by threads: the call
        never writes it)."""
        ffi = NATIVE.ffi
        r = ffi.new("struct rdr_pod_req *")
        r.host = store.native
        r.inbound_port = self.inbound_port
        r.tc_forwarded = self.tc_forwarded
        r.owner_ids = owns_ids(self.intent)  # (a netns of another user namespace: the general path translates)
        r.tcp_diag = store.tcp_diag()
        r.host_netns_ino = _netns.host_netns_inodes()
        r.nf_marks_fd, r.nf_marks_ready = locks.netfilter_marks()
        r.addr_proto, r.addr_flags = rt.RT_PROTO, rt.IFA_F_NODAD
        for i, row in enumerate(self.sets):
            for j, (policy, ports, n_ports, cidrs, n_cidrs, local, v6, add) in enumerate(row):
                st = r.sets[i][j]
                st.policy, st.ports, st.n_ports, st.cidrs, st.n_cidrs = policy, ports, n_ports, cidrs, n_cidrs
                for k, f in enumerate((4, 6)):
                    st.has_local[k] = f in local
                    if f in local:
                        ffi.memmove(ffi.addressof(st.local, k), local[f], len(local[f]))
                st.v6, st.n_add = v6, add is not None
                if add is not None:
                    ffi.memmove(st.add, add, 16)
                ops, st.fwmark_accept = self.routes[i]
                st.n_routes = len(ops)
                for k, op in enumerate(ops):
                    o = st.routes[k]
                    o.kind, o.add, o.family, o.proto, o.table, o.fwmark, o.mask, o.priority, o.oif = op
        r.n_ours_v6 = len(rt.PLAN_V6)
        for i, raw in enumerate(rt.PLAN_V6):
            ffi.memmove(r.ours_v6[i], raw, 16)
        return r


def fresh_pods(it: AnyIntent) -> bool:
    """Whether pods of ``it`` can be set up by the fresh-pod call: sidecar or ambient, with policy
    routes (ambient, TPROXY: the call adds them, and turns ``tcp_fwmark_accept`` on where the
    config needs it), but no ``exclude_interfaces`` or ``reroute_interfaces`` (their entries
    depend on the pod's links and routes, which the general path reads), no address but one IPv6
    /128 on lo. Raises ``BackendUnavailable`` as ``apply`` would."""
    refuse(it)
    return (not it.reroute_interfaces and not (isinstance(it, Intent) and it.exclude_interfaces)
            and 2 * len(it.routes) <= NATIVE.lib.RDR_POD_ROUTE_OPS_MAX and len(it.local_addresses) <= 1
            and all(a.family == 6 and a.dev == "lo" and a.cidr.endswith("/128") for a in it.local_addresses))


def fresh_pod_template(it: AnyIntent, store: PodStore) -> FreshPodTemplate:
    """The template for ``it`` (``fresh_pods``) on ``store``, kept in its memo."""
    return remembered(store.memo, ("fresh", it), lambda: FreshPodTemplate(it, store))


def detail(store: PodStore, cookie: int, host_ms: float, pod_ms: float, path: str = "general") -> dict[str, Any]:
    """``Installed.detail``; ``path``: "fresh" (one native call, ``setup_fresh``) or "general";
    ``host_ms`` the time to find (or load) the host programs, ``pod_ms`` the pod's own part.
    (No ``round()`` here: rounding a float to digits is slow next to the rest of a fresh pod's
    Python; the general path rounds its own.)"""
    return {"netns_cookie": cookie, "root": store.root, "compiled": store.compiled, "host_ms": host_ms,
            "pod_ms": pod_ms, "sk_lookup_link": store.link_path(cookie), "path": path}


def setup_fresh(it: AnyIntent, netns: NetnsRef, name: str, lock_fd: int) -> Installed | None:
    """``EbpfBackend.apply`` for a pod with nothing of ours yet, on the default root (or
    ``REDIRECT_BPF_ROOT``), in one native call (native/pod_setup.c): what
    ``redirect.setup(..., backend="ebpf")`` tries first. From outside the netns, it opens
    ``netns``, takes its lock on ``lock_fd`` (the calling thread's own fd of
    the netns lock file, ``redirect.kernel.locks``), enters, sets the pod up and comes back.

    None when the pod is not fresh, the lock is held, or anything looks unusual (the namespace
    too: the general path reports it): nothing was changed and the caller takes the general
    path. Per pod this is the hot path, so it stays short: with the handle the process used last
    and a template of the intent on it, no look-up at all (not even of the environment, which
    the native call reads), one call."""
    host_ms = 0.0
    h = PROCESS.last
    last = h.store.fresh_last if h is not None and h.store.ok else None
    if last is not None and last[0] is it:  # the last pod's intent and handle: the native call checks
        tmpl = last[1]  # that its root is still the one the environment names
    else:
        tmpl = h.store.memo.get(("fresh", it)) if h is not None and h.store.ok else None
    if tmpl is None:
        if not fresh_pods(it):
            return None
        h = PROCESS.cached(ebpf_root())
        if h is None or not h.store.ok:  # else the native call asks the pin watch itself
            t0 = time.perf_counter()
            h = PROCESS.host()  # (the root and cgroup from the environment, as above)
            assert h is not None
            host_ms = round((time.perf_counter() - t0) * 1e3, 3)
        tmpl = fresh_pod_template(it, h.store)
    assert h is not None
    store = h.store
    if last is None or last[1] is not tmpl:
        store.fresh_last = (it, tmpl)
    c = tmpl.calls.__dict__.get("call")
    if c is None:
        c = tmpl.calls.call = NATIVE.ffi.new("struct rdr_pod_call *")
    path = _netns.path_of(netns)
    lib = NATIVE.lib
    rc = lib.rdr_ebpf_pod_add(tmpl.request, c, NATIVE.ffi.NULL if path is None else path.encode(),
                              -1 if path is not None else int(netns),  # type: ignore[arg-type]
                              store.watch if store.ok else -1, lock_fd)
    if rc != 0:
        if rc in (lib.RDR_POD_SLOW, lib.RDR_POD_BUSY, lib.RDR_POD_STALE):
            log.debug("ebpf: not a fresh pod, its lock is held, or the host pins changed: general path (%d)", rc)
            if rc == lib.RDR_POD_STALE:
                PROCESS.last = None  # look the handle up again next time
            return None
        if rc == lib.RDR_POD_STRANDED:
            raise SystemError("could not return to the thread's own netns after an eBPF setup")
        if rc == lib.RDR_POD_FAULT:
            raise SetupError(f"injected fault at {os.environ.get('REDIRECT_FAULT')}")
        if rc == lib.RDR_POD_FWMARK:
            raise SetupError(f"ebpf: capture is in place, but net.ipv4.tcp_fwmark_accept could not be turned on:"
                             f" {os.strerror(-c.err)}; run setup again")
        raise SetupError(setup_failed(rc, c.tc_blame))
    if c.pool_low:
        store.refill()  # it found no sk_lookup program queued free: the next batch, ahead of the next pods
    cookie = c.cookie
    return Installed("ebpf", name, (4, 6) if c.v6 else (4,), True, detail(store, cookie, host_ms, c.wall_ns / 1e6,
                                                                          "fresh"))


def last_steps() -> dict[str, float] | None:
    """Where the calling thread's last fresh-pod call (``setup_fresh``, for the intent of the last
    fresh pod) spent its time: the microseconds of each of its steps by name (``RDR_STEP_*`` in
    native/redirect_native.h; a step not taken is 0), and ``call``, the whole call's. None before
    any such call. Nothing on a pod's path reads it: it is for the benchmark's breakdown."""
    h = PROCESS.last
    last = h.store.fresh_last if h is not None else None
    c = last[1].calls.__dict__.get("call") if last is not None else None
    if c is None or c.wall_ns == 0:
        return None
    lib, ffi = NATIVE.lib, NATIVE.ffi
    out = {ffi.string(lib.rdr_pod_step_names[i]).decode(): c.step_ns[i] / 1e3 for i in range(lib.RDR_STEPS)}
    out["call"] = c.wall_ns / 1e3
    return out


__all__ = ["FreshPodTemplate", "fresh_pods", "fresh_pod_template", "detail", "setup_fresh", "last_steps"]
