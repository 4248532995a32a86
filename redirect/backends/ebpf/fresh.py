"""A fresh pod (nothing of ours in its netns yet) set up in one native call (``native/pod_setup.c``):
``setup_fresh``, what ``redirect.setup(..., backend="ebpf")`` tries first. It is the general path's
write (``rdr_ebpf_pod_write``) from an empty inventory, of the entries the lowering computed once
per config (``FreshPodTemplate``: ``entries.intent_entries``, as ``apply`` computes them), with the
pod's netns cookie and addresses put in their fields; the call backs off (nothing changed) to
``EbpfBackend.apply`` for a pod that is not fresh.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import threading
import time
from typing import Any

from ...errors import SetupError
from ...kernel import netns as _netns
from ...kernel.netns import NetnsRef
from ...plan.intent import AnyIntent, Intent
from ..base import Installed
from .entries import intent_entries, local_key_templates, refuse
from .host import DEFAULT_ROOT, HostPrograms
from .lifetime import _host_cache, host
from .podnet import LOOPBACK_IFINDEX, _intent_addresses, families_for
from .pool import refill
from .syscalls import _native, _native_module
from .tc import takes_forwarded

log = logging.getLogger("redirect.ebpf")

#: Per thread: ``call``, the ``struct rdr_pod_call`` its fresh-pod setups fill in turn.
_tls = threading.local()
#: The last fresh-pod setup's intent, host handle and request: the next pod with the same intent
#: object reuses them without look-ups while the handle is ok (a closed one is not; the native
#: call backs off if the environment names another root, and then this is forgotten).
_last_fresh: tuple[Any, Any, Any] = (None, None, None)


class FreshPodTemplate:
    """What intent ``it`` writes in any fresh pod, for ``rdr_ebpf_pod_add`` (native/pod_setup.c): per
    kind of pod (IPv6 on in its netns or not, an IPv6 address of its own or not: what decides its
    families and the intent's addresses), the ``struct rdr_pod_set``: the entries of
    ``entries.intent_entries`` with netns 0, the intent's address (``::6``) it adds with its key, and
    the key of one of the pod's own addresses per family (``local_key_templates``). Made once per
    intent; the cffi buffers live as long as this object."""

    def __init__(self, it: Intent) -> None:
        ffi = _native().ffi
        self.inbound_port = 0
        #: Its capture takes what a pod forwards: our tc filters on the interfaces a pod forwards on.
        self.tc_forwarded = False
        #: [v6_on][own_v6]: (policy, ports, cidrs) buffers, and the rest of the set.
        self.sets: list[list[tuple[Any, Any, int, Any, int, dict[int, bytes], bool, bytes | None]]] = []
        for v6_on in (False, True):
            row = []
            families = families_for(it, v6_on)
            for own_v6 in (False, True):
                adds = _intent_addresses(it, families, own_v6)
                e = intent_entries(it, families, 0,
                                   tuple((a.family, a.cidr.split("/")[0], LOOPBACK_IFINDEX) for a in adds))
                if e.inbound:
                    self.inbound_port = it.inbound_port
                self.tc_forwarded |= takes_forwarded(e)
                ports, cidrs = b"".join(sorted(e.ports)), b"".join(sorted(e.cidrs))
                bufs = [ffi.new(t, max(n, 1)) for t, n in (("struct pod_policy[]", 1), ("struct port_key[]",
                                                           len(e.ports)), ("struct cidr_key[]", len(e.cidrs)))]
                for buf, raw in zip(bufs, (e.policy, ports, cidrs), strict=True):
                    ffi.memmove(buf, raw, len(raw))
                add = ipaddress.ip_address(adds[0].cidr.split("/")[0]).packed if adds else None
                row.append((bufs[0], bufs[1], len(e.ports), bufs[2], len(e.cidrs), local_key_templates(families),
                            6 in families, add))
            self.sets.append(row)


@functools.lru_cache(maxsize=64)
def fresh_pod_template(it: AnyIntent) -> FreshPodTemplate | None:
    """The template for ``it`` (cached), or None when its pods need the general path (ambient; the
    intent adds an address other than one IPv6 /128 on lo, or policy routes; ``exclude_interfaces``
    or ``reroute_interfaces``). Raises ``BackendUnavailable`` as ``apply`` would."""
    refuse(it)
    if not isinstance(it, Intent):
        return None  # (ambient: policy routes and a sysctl besides the entries)
    if it.exclude_interfaces or it.reroute_interfaces:
        return None  # its entries depend on the pod's links and routes: the general path reads them
    if it.routes:  # (TPROXY) policy routes and a sysctl besides the entries: the general path sets them
        return None
    if len(it.local_addresses) > 1 or any(not (a.family == 6 and a.dev == "lo" and a.cidr.endswith("/128"))
                                          for a in it.local_addresses):
        return None
    return FreshPodTemplate(it)


def _detail(h: HostPrograms, cookie: int, host_ms: float, pod_ms: float, link_path: str,
            path: str = "general") -> dict[str, Any]:
    """``Installed.detail``; ``path``: "fresh" (one native call, ``setup_fresh``) or "general";
    ``host_ms`` the time to find (or load) the host programs, ``pod_ms`` the pod's own part.
    (No ``round()`` here: rounding a float to digits is slow next to the rest of a fresh pod's
    Python; the general path rounds its own.)"""
    return {"netns_cookie": cookie, "root": h.root, "compiled": h.compiled, "host_ms": host_ms, "pod_ms": pod_ms,
            "sk_lookup_link": link_path, "path": path}


def setup_fresh(it: AnyIntent, netns: NetnsRef, name: str, lock_fd: int) -> Installed | None:
    """``EbpfBackend.apply`` for a pod with nothing of ours yet, on the default root (or
    ``REDIRECT_BPF_ROOT``), in one native call (native/pod_setup.c): what
    ``redirect.setup(..., backend="ebpf")`` tries first. From outside the netns, it opens
    ``netns``, takes its lock on ``lock_fd`` (the calling thread's own fd of
    the netns lock file, ``redirect.kernel.locks``), enters, sets the pod up and comes back.

    None when the pod is not fresh, the lock is held, or anything looks unusual (the namespace
    too: the general path reports it): nothing was changed and the caller takes the general
    path. Per pod this is the hot path, so it stays short: with the last pod's intent, no look-up
    at all (not even of the environment, which the native call reads), one call."""
    global _last_fresh
    host_ms = 0.0
    it0, h, req = _last_fresh
    if it0 is not it or not h.ok:  # else the last pod's intent and handle: its request (the native
        tmpl = fresh_pod_template(it)  # call checks the root is still the one the environment names)
        if tmpl is None:
            return None
        h = _host_cache.get(os.environ.get("REDIRECT_BPF_ROOT") or DEFAULT_ROOT)
        if h is None or not h.ok:  # else the native call asks the pin watch itself
            t0 = time.perf_counter()
            h = host()  # (the root and cgroup from the environment, as above)
            assert h is not None
            host_ms = round((time.perf_counter() - t0) * 1e3, 3)
        req = h.fresh_request(tmpl)
        _last_fresh = (it, h, req)
    nat = _native_module
    c = _tls.__dict__.get("call")
    if c is None:
        c = _tls.call = nat.ffi.new("struct rdr_pod_call *")
    path = _netns.path_of(netns)
    lib = nat.lib
    rc = lib.rdr_ebpf_pod_add(req, c, nat.ffi.NULL if path is None else path.encode(),
                              -1 if path is not None else int(netns), h.watch if h.ok else -1,  # type: ignore[arg-type]
                              lock_fd)
    if rc != 0:
        if rc in (lib.RDR_POD_SLOW, lib.RDR_POD_BUSY, lib.RDR_POD_STALE):
            log.debug("ebpf: not a fresh pod, its lock is held, or the host pins changed: general path (%d)", rc)
            if rc == lib.RDR_POD_STALE:
                _last_fresh = (None, None, None)  # look the handle up again next time
            return None
        if rc == lib.RDR_POD_STRANDED:
            raise SystemError("could not return to the thread's own netns after an eBPF setup")
        if rc == lib.RDR_POD_FAULT:
            raise SetupError(f"injected fault at {os.environ.get('REDIRECT_FAULT')}")
        raise SetupError(f"ebpf: setup failed and was undone: {os.strerror(-rc)}")
    if c.pool_low:
        refill(h)  # it found no sk_lookup program queued free: the next batch, ahead of the next pods
    cookie = c.cookie
    d = _detail(h, cookie, host_ms, c.wall_ns / 1e6, f"{h.pods_dir}/{cookie}-sk_lookup", "fresh")
    return Installed("ebpf", name, (4, 6) if c.v6 else (4,), True, d)
