"""A fresh pod (nothing of ours in its netns yet) set up in one native call (``native/pod_setup.c``):
``setup_fresh``, what ``redirect.setup(..., backend="ebpf")`` tries first. The per-config template
of the entries is built once; the call backs off (nothing changed) to ``EbpfBackend.apply`` for a
pod that is not fresh.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from ...config import RedirectConfig
from ...errors import SetupError
from ...kernel import netns as _netns
from ...kernel.netns import NetnsRef
from ...plan.vocabulary import INBOUND_PASSTHROUGH_V6, Plan
from ..base import Installed
from .abi import CIDR_KEY, F_INBOUND, P_FLAGS, POLICY, PORT_KEY
from .entries import _config_entries, _unsupported
from .host import DEFAULT_ROOT, HostPrograms
from .lifetime import _host_cache, host
from .podnet import _plan_addresses
from .syscalls import _native

log = logging.getLogger("redirect.ebpf")

#: Per thread: ``call``, the ``struct rdr_pod_call`` its fresh-pod setups fill in turn.
_tls = threading.local()
#: The last fresh-pod setup's config, host handle and request: the next pod with the same config
#: object reuses them without look-ups while the handle is ok (a closed one is not; the native
#: call backs off if the environment names another root, and then this is forgotten).
_last_fresh: tuple[Any, Any, Any] = (None, None, None)


class FreshPodTemplate:
    """What ``cfg`` writes for any fresh pod, laid out for ``rdr_ebpf_pod_add`` (native/pod_setup.c):
    per family set ((4,) and (4, 6)), the policy and the port and CIDR keys with a zero netns
    cookie. Built once per config; the cffi buffers live as long as this object."""

    def __init__(self, cfg: RedirectConfig, plan: Plan) -> None:
        ffi = _native().ffi
        self.ipv6 = -1 if cfg.ipv6 is None else int(bool(cfg.ipv6))
        self.inbound_port = 0
        self.sets: list[tuple[Any, Any, int, Any, int, bool]] = []
        for families in ((4,), (4, 6)):
            policy, port_specs, cidr_specs = _config_entries(cfg, families)
            if POLICY.unpack(policy)[P_FLAGS] & F_INBOUND:
                self.inbound_port = cfg.inbound_port
            ports = b"".join(PORT_KEY.pack(0, kind, p, 0) for kind, p in port_specs)
            cidrs = b"".join(CIDR_KEY.pack(plen, kind, 0, raw) for plen, kind, raw in cidr_specs)
            bufs = [ffi.new(t, max(n, 1)) for t, n in (("struct pod_policy[]", 1), ("struct port_key[]",
                                                       len(port_specs)), ("struct cidr_key[]", len(cidr_specs)))]
            for buf, b in zip(bufs, (policy, ports, cidrs), strict=True):
                ffi.memmove(buf, b, len(b))
            v6_lo = any(a.family == 6 and a.dev == "lo" for a in _plan_addresses(plan, families, True))
            self.sets.append((bufs[0], bufs[1], len(port_specs), bufs[2], len(cidr_specs), v6_lo))


@functools.lru_cache(maxsize=64)
def fresh_pod_template(cfg: RedirectConfig) -> FreshPodTemplate | None:
    """The template for ``cfg`` (cached), or None when its pods need the general path (the plan
    adds an address other than ``::6`` on lo, ``exclude_interfaces`` or ``reroute_interfaces``). Raises
    ``BackendUnavailable`` as ``apply`` would."""
    from ...plan import build_plan

    _unsupported(cfg)
    if cfg.exclude_interfaces or cfg.reroute_interfaces:
        return None  # its entries depend on the pod's links and routes: the general path reads them
    if cfg.mode == "ambient":
        return None  # a policy route and a sysctl besides the entries: the general path sets them
    plan = build_plan(cfg)
    if any(not (a.family == 6 and a.dev == "lo" and a.cidr == INBOUND_PASSTHROUGH_V6) for a in plan.addresses):
        return None
    return FreshPodTemplate(cfg, plan)


def _detail(h: HostPrograms, cookie: int, host_ms: float, pod_ms: float, link_path: str,
            path: str = "general") -> dict[str, Any]:
    """``Installed.detail``; ``path``: "fresh" (one native call, ``setup_fresh``) or "general";
    ``host_ms`` the time to find (or load) the host programs, ``pod_ms`` the pod's own part.
    (No ``round()`` here: rounding a float to digits is slow next to the rest of a fresh pod's
    Python; the general path rounds its own.)"""
    return {"netns_cookie": cookie, "root": h.root, "compiled": h.compiled, "host_ms": host_ms, "pod_ms": pod_ms,
            "sk_lookup_link": link_path, "path": path}


def setup_fresh(cfg: RedirectConfig, netns: NetnsRef, name: str, lock_fd: int) -> Installed | None:
    """``EbpfBackend.apply`` for a pod with nothing of ours yet, on the default root (or
    ``REDIRECT_BPF_ROOT``), in one native call (native/pod_setup.c): what
    ``redirect.setup(..., backend="ebpf")`` tries first. From outside the netns, it opens
    ``netns``, takes its lock on ``lock_fd`` (the calling thread's own fd of
    the netns lock file, ``redirect.kernel.locks``), enters, sets the pod up and comes back.

    None when the pod is not fresh, the lock is held, or anything looks unusual (the namespace
    too: the general path reports it): nothing was changed and the caller takes the general
    path. Per pod this is the hot path, so it stays short: with the last pod's config, no look-up
    at all (not even of the environment, which the native call reads), one call."""
    global _last_fresh
    host_ms = 0.0
    cfg0, h, req = _last_fresh
    if cfg0 is not cfg or not h.ok:  # else the last pod's config and handle: its request (the native
        tmpl = fresh_pod_template(cfg)  # call checks the root is still the one the environment names)
        if tmpl is None:
            return None
        h = _host_cache.get(os.environ.get("REDIRECT_BPF_ROOT") or DEFAULT_ROOT)
        if h is None or not h.ok:  # else the native call asks the pin watch itself
            t0 = time.perf_counter()
            h = host()  # (the root and cgroup from the environment, as above)
            assert h is not None
            host_ms = round((time.perf_counter() - t0) * 1e3, 3)
        req = h.fresh_request(tmpl)
        _last_fresh = (cfg, h, req)
    nat = _native()
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
    cookie = c.cookie
    d = _detail(h, cookie, host_ms, c.wall_ns / 1e6, f"{h.pods_dir}/{cookie}-sk_lookup", "fresh")
    return Installed("ebpf", name, (4, 6) if c.v6 else (4,), True, d)
