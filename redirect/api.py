"""The public entry points: ``setup``, ``teardown``, ``check``, ``show``, ``render``.

A netns holds the capture of one backend at a time: ``setup`` with another backend than the
one installed puts the new capture in first and then removes the old (capture never lapses);
``teardown``, ``check`` and ``show`` without a backend act on whatever of ours is installed,
whichever backend put it there. ``setup`` and ``teardown`` refuse the host's own network namespace
unless ``allow_host_netns=True``. Every change of a netns holds its lock (``redirect.kernel.locks``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .backends import KINDS, choose_auto, ebpf_caps_refusal, ebpf_failed, ebpf_root, get_backend, kind_of
from .backends.base import Backend, CheckResult, Installed
from .backends.nftables import one_context as one_nft_context
from .config import RedirectConfig
from .errors import BackendUnavailable, ConfigError, HostNetnsError, RedirectError, SetupError
from .kernel import netns as _netns
from .kernel.locks import mark_netfilter, netns_lock, thread_lock_fd, unmark_netfilter
from .plan.intent import AnyIntent, intent_for

log = logging.getLogger("redirect")

#: The last config given and its intent: a caller setting up many pods passes one config object
#: again and again, and its intent (cached by config) is then found without hashing it.
_last_intent: tuple[RedirectConfig | None, AnyIntent | None] = (None, None)


def _intent(cfg: RedirectConfig) -> AnyIntent:
    """The intent of ``cfg``: what every backend is given (never the config)."""
    global _last_intent
    c, it = _last_intent
    if c is not cfg or it is None:
        it = intent_for(cfg)
        _last_intent = (cfg, it)
    return it


def _families(it: AnyIntent) -> tuple[int, ...]:
    from .kernel.routes import ipv6_enabled

    if it.ipv6 is None:
        return (4, 6) if ipv6_enabled() else (4,)
    return (4, 6) if it.ipv6 else (4,)


def _families_for(impl: Backend, it: AnyIntent) -> tuple[int, ...]:
    """``_families``, or the backend's own answer when it has one (eBPF reads it in the netlink
    dump it makes anyway)."""
    detect = getattr(impl, "detect_families", None)
    return detect(it) if detect is not None else _families(it)


_default_config: RedirectConfig | None = None  # frozen: one for every call that passes none


def _config(config: RedirectConfig | None) -> RedirectConfig:
    global _default_config
    if config is None:
        if _default_config is None:
            _default_config = RedirectConfig()
        return _default_config
    if not isinstance(config, RedirectConfig):
        raise ConfigError("config", type(config).__name__, "expected a RedirectConfig (or None for Istio's defaults)")
    return config


#: Backends with a one-call setup for pods with nothing of ours yet: ``fn(intent, netns, name,
#: lock_fd) -> Installed | None`` (looked up once; None: the backend has none).
_FRESH: dict[str, Any] = {}


def _fresh_setup_of(backend: str) -> Any:
    """The backend's one-call setup of a pod with nothing of ours yet, if it has one (eBPF). It
    takes the same lock as the general path (by the call, on this thread's own fd of the lock
    file, ``thread_lock_fd``), and backs off (None: take the general path, nothing changed) for
    anything but a fresh pod: capture of ours there, any netfilter table, the host's netns."""
    fn = None
    if backend == "ebpf":
        from .backends import ebpf

        fn = ebpf.setup_fresh
    if backend in KINDS:
        _FRESH[backend] = fn
    return fn


def setup(netns: _netns.NetnsRef, config: RedirectConfig | None = None, backend: str = "iptables", *,
          allow_host_netns: bool = False) -> Installed:
    """Install redirection for ``config`` (Istio's injection defaults when None) in ``netns``.

    Atomic: on any failure the namespace is left as it was and ``SetupError`` is raised.
    Idempotent: the same config again changes nothing (``Installed.changed`` is False);
    a different config replaces ours, and so does capture of another backend (the new one goes
    in first, then the old one is removed). Serialized per netns with other threads and
    processes (``redirect.kernel.locks.netns_lock``). The host's network namespace (the initial one,
    pid 1's, or the caller's own) is refused with ``HostNetnsError`` unless
    ``allow_host_netns``. ``backend="auto"``: eBPF when this host allows it and it supports every
    option of the config, else nftables, else iptables (``backends.choose_auto``; logged, and
    ``Installed.backend`` names it); when eBPF's programs then cannot be loaded or attached here
    (``BackendUnavailable``: no bpffs where the pins go, a verifier or compile error, a missing
    hook), nftables, else iptables, with the reason logged, and the process's later ``auto``
    choices skip eBPF.
    """
    cfg = config if type(config) is RedirectConfig else _config(config)
    c, it = _last_intent  # (_intent, without its call for the config of the last pod)
    if c is not cfg or it is None:
        it = _intent(cfg)
    name = _netns.describe(netns)
    info = log.isEnabledFor(logging.INFO)
    t0 = time.perf_counter() if info else 0.0
    if backend != "auto":
        res, fresh = _setup_with(backend, it, netns, name, allow_host_netns)
    else:
        backend = choose_auto(it)
        try:
            res, fresh = _setup_with(backend, it, netns, name, allow_host_netns)
        except BackendUnavailable as e:
            if backend != "ebpf":
                raise
            # The host probe allowed eBPF, but its programs could not be loaded or attached here
            # (bpffs, the verifier, a missing hook): nothing was installed; the next choice.
            backend = ebpf_failed(str(e))
            res, fresh = _setup_with(backend, it, netns, name, allow_host_netns)
    if info:
        log.info(
            "setup netns=%s backend=%s mode=%s families=%s changed=%s in %.2f ms%s",
            name, res.backend, cfg.mode, "+".join(f"IPv{f}" for f in res.families), res.changed,
            (time.perf_counter() - t0) * 1e3, " (fresh pod: one native call)" if fresh is not None else "",
        )
    return res


def _setup_with(backend: str, it: AnyIntent, netns: _netns.NetnsRef, name: str,
                allow_host_netns: bool) -> tuple[Installed, Installed | None]:
    """``setup`` with one backend: (what was installed, the same if the fresh-pod call did it)."""
    if backend == "ebpf" and (why := ebpf_caps_refusal()) is not None:
        raise BackendUnavailable(why)  # (before anything is touched, instead of an EPERM half-way)
    fn = _FRESH[backend] if backend in _FRESH else _fresh_setup_of(backend)
    res = fresh = None if fn is None else fn(it, netns, name, thread_lock_fd())
    if res is None:
        res = _setup_general(get_backend(backend, it), it, netns, name, allow_host_netns)
        res = Installed(res.backend, name, res.families, res.changed, res.detail)
    return res, fresh


def _refuse_host_netns(name: str, what: str = "setup") -> None:
    """``HostNetnsError`` if the netns the thread entered is the host's (``netns.host_netns_reason``):
    the one check of every entry point that changes a netns (``what``: setup or teardown)."""
    why = _netns.host_netns_reason()
    if why is not None:
        harm = ("capture there would take the node's own traffic" if what == "setup" else
                "removing capture there changes the node's own traffic")
        raise HostNetnsError(f"netns={name!r}: {why}; {harm}. {what.capitalize()} refused: name a pod's netns, or"
                             " pass --allow-host-netns (allow_host_netns=True) if the host is really meant")


def _setup_general(impl: Backend, it: AnyIntent, netns: _netns.NetnsRef, name: str,
                   allow_host_netns: bool) -> Installed:
    """``setup`` inside the netns, under ``netns_lock``: any backend, any previous state."""
    with _netns.enter(netns), one_nft_context():
        if not allow_host_netns:
            _refuse_host_netns(name)
        with netns_lock(_netns.current_inode(), name=name):
            families = _families_for(impl, it)
            # Asked before apply: on a fresh pod listing the tables is cheap then, and costs a
            # refill of libnftables' cache of our new table after it.
            others = _installed(skip=kind_of(impl.name), strict=False)
            if others:
                _refuse_switch_over_foreign(impl.name, others)
            if kind_of(impl.name) != "ebpf":  # (before it may hold any: see locks.mark_netfilter)
                mark_netfilter(_netns.current_inode(), _netns.current_cookie())
            res = impl.apply(it, families)
            if others and _retire(impl.name, others, it, families):
                res = Installed(res.backend, res.netns, res.families, True, res.detail)
    return res


def _refuse_switch_over_foreign(backend_name: str, olds: list[Backend]) -> None:
    """``SetupError`` before anything changes if capture of ours by another backend, which a
    switch to ``backend_name`` would remove, holds rules that are not ours (they go with it)."""
    for old in olds:
        ask = getattr(old, "foreign_in_ours", None)
        foreign = ask() if ask is not None else []
        if foreign:
            raise SetupError(f"{old.name}: our capture there holds what is not ours: {'; '.join(foreign)}. A switch to"
                             f" {backend_name} removes ours, and theirs would go with it: setup refused, nothing"
                             " changed; remove them, then run setup again")


def _netfilter_present() -> bool:
    """Whether the calling thread's netns has any netfilter table (else no netfilter capture of
    ours can be there); True when it can't tell."""
    from .native import load

    return bool(load().lib.rdr_netfilter_present() != 0)


def _candidates(skip: str | None) -> list[str]:
    """The kinds of capture that may be in the calling thread's netns (not ``skip``): a netfilter
    kind only if the netns has a netfilter table, eBPF only if its pin root exists."""
    nf: bool | None = None
    out = []
    for kind in KINDS:
        if kind == skip:
            continue
        if kind == "ebpf":
            if os.path.isdir(ebpf_root()):
                out.append(kind)
            continue
        if nf is None:
            nf = _netfilter_present()
        if nf:
            out.append(kind)
    return out


def _backend_of(kind: str) -> Backend | None:
    """The backend object for ``kind``, or None when it can't run here (then nothing of it can be
    installed: its own setup would have needed it)."""
    try:
        return get_backend(kind, None)
    except BackendUnavailable as e:
        log.debug("backend %s unavailable here (%s): none of its capture can be installed", kind, e)
        return None


def _installed(skip: str | None = None, strict: bool = True) -> list[Backend]:
    """The backends (objects, in ``KINDS`` order) with capture of ours in the calling thread's
    netns, ``skip``'s kind aside. ``strict``: an error telling raises; else it is logged and that
    kind is taken as not installed."""
    out = []
    for kind in _candidates(skip):
        impl = _backend_of(kind)
        if impl is None:
            continue
        try:
            if impl.installed():
                out.append(impl)
        except (RedirectError, OSError) as e:
            if strict:
                raise
            log.error("could not tell whether %s capture of ours is installed: %s", kind, e)
    return out


def _retire(backend_name: str, olds: list[Backend], it: AnyIntent, families: tuple[int, ...]) -> bool:
    """Once ``backend_name``'s capture is in, remove that of the backends ``olds`` (as
    ``_installed`` found them): new first, old after, so capture never lapses. Routes and
    addresses of ours are then what ``it`` wants (the new backend's apply made sure of those
    it wants; another backend's policy routes go). True if anything was removed."""
    from .kernel import routes as rt

    removed = False
    for old in olds:
        try:
            log.info("switching backend: removing our %s capture now that %s capture is in", old.name, backend_name)
            removed = bool(old.remove(keep_routes=True)) or removed
        except RedirectError as e:
            # Capture is in place (both do the same thing); the next setup retries.
            log.error("could not remove our old %s capture after switching to %s: %s", old.name, backend_name, e)
    if removed:
        try:
            rt.txn_for(it, families).finish()
        except (RedirectError, OSError) as e:  # (as above: capture is in place; the next setup retries)
            log.error("could not remove the old %s capture's routes after switching to %s: %s",
                      "+".join(o.name for o in olds), backend_name, e)
    return removed


def _any(backend: str | None) -> bool:
    """``backend`` means "whatever is installed" (None, or ``auto`` for teardown, check, show)."""
    return backend is None or backend == "auto"


def teardown(netns: _netns.NetnsRef, backend: str | None = None, *, allow_host_netns: bool = False) -> bool:
    """Remove our redirection from ``netns`` (nothing else). True if anything was removed.

    ``backend`` None (or ``auto``): all of ours, whichever backend installed it; a backend
    name: that backend's capture only. The host's network namespace is refused with
    ``HostNetnsError`` unless ``allow_host_netns``, as by ``setup``. Someone else's rules inside
    ours (``check`` names them) make it refuse with ``SetupError``, nothing changed."""
    name = _netns.describe(netns)
    with _netns.enter(netns), one_nft_context():
        if not allow_host_netns:
            _refuse_host_netns(name, "teardown")
        with netns_lock(_netns.current_inode(), name=name):
            if not _any(backend):
                impls = [get_backend(backend, None)]  # type: ignore[arg-type]
            else:  # each that may be here: its remove also takes leftovers of an interrupted setup
                impls = [impl for kind in _candidates(None) if (impl := _backend_of(kind)) is not None]
            removed = False
            for impl in impls:
                removed = bool(impl.remove()) or removed
            if _any(backend):
                from .kernel import routes as rt

                removed = rt.remove_all_ours() or removed  # routes of an interrupted setup, if any
                # Every backend's remove ran: no netfilter capture of ours is left. (Asking the
                # kernel instead would wait out the deferred destruction of what the commit just
                # deleted: docs/kernel-facts.md, libnftables contexts.)
                unmark_netfilter(_netns.current_inode())
    log.info("teardown netns=%s backend=%s removed=%s", name, backend or "any", removed)
    return removed


def check(netns: _netns.NetnsRef, config: RedirectConfig | None = None, backend: str | None = None) -> CheckResult:
    """Whether what is installed in ``netns`` equals what ``config`` wants; the differences if not.

    ``backend`` None (or ``auto``): compared with the backend whose capture is installed
    (nothing installed, or capture of two backends, is a difference); a backend name: with that
    backend's capture."""
    it = _intent(_config(config))
    with _netns.enter(netns), one_nft_context():
        if not _any(backend):
            impl = get_backend(backend, it)  # type: ignore[arg-type]
            return impl.check(it, _families_for(impl, it))
        found = _installed()
        if not found:
            return CheckResult(False, "none", ("no capture of ours is installed (by any backend)",))
        impl = get_backend(found[0].name, it)
        res: CheckResult = impl.check(it, _families_for(impl, it))
        extra = tuple(f"capture of the {o.name} backend is installed too (a setup replaces it, teardown removes it)"
                      for o in found[1:])
        return CheckResult(res.ok and not extra, res.backend, res.differences + extra)


def show(netns: _netns.NetnsRef, backend: str | None = None) -> dict[str, Any]:
    """What of ours is installed in ``netns``, read from the kernel.

    ``backend`` None (or ``auto``): found whichever backend installed it; ``backend`` names it
    (None if nothing), ``backends`` lists every one found (more than one only after an
    interrupted switch), with the first one's details at the top and the others' under
    ``also_installed``. A backend name: that backend's view."""
    with _netns.enter(netns), one_nft_context():
        if not _any(backend):
            out: dict[str, Any] = get_backend(backend, None).show()  # type: ignore[arg-type]
        else:
            found = _installed()
            out = found[0].show() if found else {"backend": None, "installed": False}
            if len(found) > 1:
                out["also_installed"] = {o.name: o.show() for o in found[1:]}
            out["backends"] = [o.name for o in found]
    out["netns"] = _netns.describe(netns)
    return out


def render(config: RedirectConfig | None = None, backend: str = "iptables", ipv6: bool = True) -> str:
    """What ``setup`` would install, as text, without touching any kernel (``--dry-run``)."""
    cfg = _config(config)
    it = _intent(cfg)
    impl = get_backend(backend, it)
    fams = (4, 6) if (cfg.ipv6 if cfg.ipv6 is not None else ipv6) else (4,)
    return impl.render(it, fams)
