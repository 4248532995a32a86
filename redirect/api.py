"""The public entry points: ``setup``, ``teardown``, ``check``, ``show``, ``render``."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import netns as _netns
from .backends import get_backend
from .backends.base import CheckResult, Installed
from .backends.nftables import one_context as one_nft_context
from .config import RedirectConfig
from .errors import ConfigError, RedirectError, SetupError
from .plan import Plan, build_plan

#: Plans depend only on the (frozen, hashable) config, and pods of one platform share a few
#: configs: build each once per process.
_plan: functools._lru_cache_wrapper[Plan] = functools.lru_cache(maxsize=256)(build_plan)

log = logging.getLogger("redirect")

_locks_guard = threading.Lock()
_locks: dict[int, threading.Lock] = {}


def _lock_for(inode: int) -> threading.Lock:
    """An in-process lock per namespace, for when the lock file can't be opened."""
    lk = _locks.get(inode)
    if lk is not None:
        return lk
    with _locks_guard:
        return _locks.setdefault(inode, threading.Lock())


#: Threads and processes (the CNI plugin, the agent, ``redirect init``, a user's) take one byte
#: of this file, at the netns inode's offset, while they change that netns: no lock file per pod
#: to clean up. The lock is an OFD lock (``F_OFD_SETLK``), which belongs to an open file
#: description: each thread opens the file for itself, so one lock keeps out other threads and
#: other processes alike (and the POSIX record locks of older versions: the two kinds conflict).
NETNS_LOCK_FILE = "/run/lock/redirect-netns.lock"
LOCK_WAIT_S = 30.0
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid


class _LockFile:
    """One thread's own open of ``NETNS_LOCK_FILE``, closed with the thread's locals."""

    __slots__ = ("fd", "gen")

    def __init__(self, fd: int, gen: int) -> None:
        self.fd, self.gen = fd, gen

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            os.close(self.fd)


_tls = threading.local()
#: Bumped in a forked child: the child's threads open the file anew (a description shared with
#: the parent would share its locks, not contend for them).
_fork_gen = 0


def thread_lock_fd() -> int | None:
    """This thread's own fd of ``NETNS_LOCK_FILE`` (opened on first use); None if it can't be
    opened (then only threads of this process are kept apart, by ``_lock_for``)."""
    lf = getattr(_tls, "lock_file", None)
    if lf is not None and lf.gen == _fork_gen:
        return int(lf.fd)
    try:
        os.makedirs(os.path.dirname(NETNS_LOCK_FILE), exist_ok=True)
        fd = os.open(NETNS_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.debug("no netns lock file (%s: %s); this process's threads only are kept apart", NETNS_LOCK_FILE, e)
        return None
    _tls.lock_file = _LockFile(fd, _fork_gen)
    return fd


def _after_fork_in_child() -> None:
    # Locks other threads of the parent held at the fork would stay held here for ever.
    global _locks_guard, _fork_gen
    _locks_guard = threading.Lock()
    _locks.clear()
    _fork_gen += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _ofd_lock(fd: int, inode: int, kind: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, inode, 1, 0))


@contextlib.contextmanager
def netns_lock(inode: int, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the netns ``inode`` against other threads and processes that use this library.
    Waits at most ``wait_s`` for another holder, then raises ``SetupError``."""
    fd = thread_lock_fd()
    if fd is None:
        with _lock_for(inode):
            yield
        return
    deadline = time.monotonic() + wait_s
    pause = 0.0005
    while True:
        try:
            _ofd_lock(fd, inode, fcntl.F_WRLCK)
            break
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):  # held by another thread or process
                raise
        if time.monotonic() >= deadline:
            raise SetupError(f"netns inode {inode}: another thread or process has been changing it for over"
                             f" {wait_s:.0f} s (lock {NETNS_LOCK_FILE}, byte {inode})")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    try:
        yield
    finally:
        _ofd_lock(fd, inode, fcntl.F_UNLCK)


def _families(cfg: RedirectConfig) -> tuple[int, ...]:
    from .routes import ipv6_enabled

    if cfg.ipv6 is None:
        return (4, 6) if ipv6_enabled() else (4,)
    return (4, 6) if cfg.ipv6 else (4,)


def _families_for(impl: Any, cfg: RedirectConfig) -> tuple[int, ...]:
    """``_families``, or the backend's own answer when it has one (eBPF reads it in the netlink
    dump it makes anyway)."""
    detect = getattr(impl, "detect_families", None)
    return detect(cfg) if detect is not None else _families(cfg)


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


#: Backends with a one-call setup for pods with nothing of ours yet: ``fn(cfg, netns, name,
#: lock_fd) -> Installed | None`` (looked up once).
_FRESH: dict[str, Any] = {}


def _fresh_setup_of(backend: str) -> Any:
    fn = _FRESH.get(backend)
    if fn is None and backend == "ebpf":
        from .backends import ebpf

        fn = _FRESH[backend] = ebpf.setup_fresh
    return fn


def _setup_fresh(backend: str, cfg: RedirectConfig, netns: _netns.NetnsRef, name: str) -> Installed | None:
    """The backend's one-call setup of a pod with nothing of ours yet, if it has one (eBPF),
    under the same lock as the general path (taken by the call, on this thread's own fd of the
    lock file). None: take the general path (nothing changed)."""
    fresh = _fresh_setup_of(backend)
    if fresh is None:
        return None
    lock_fd = thread_lock_fd()
    if lock_fd is None:  # the call could not keep other threads out
        return None
    res: Installed | None = fresh(cfg, netns, name, lock_fd)
    return res


def setup(netns: _netns.NetnsRef, config: RedirectConfig | None = None, backend: str = "iptables") -> Installed:
    """Install redirection for ``config`` (Istio's injection defaults when None) in ``netns``.

    Atomic: on any failure the namespace is left as it was and ``SetupError`` is raised.
    Idempotent: the same config again changes nothing (``Installed.changed`` is False);
    a different config replaces ours. Serialized per netns with other threads and processes
    (``netns_lock``).
    """
    cfg = _config(config)
    name = _netns.describe(netns)
    t0 = time.perf_counter()
    res = fresh = _setup_fresh(backend, cfg, netns, name)
    if res is None:
        res = _setup_general(get_backend(backend, cfg), cfg, _plan(cfg), netns)
        res = Installed(res.backend, name, res.families, res.changed, res.detail)
    if log.isEnabledFor(logging.INFO):
        log.info(
            "setup netns=%s backend=%s mode=%s families=%s changed=%s in %.2f ms%s",
            name, res.backend, cfg.mode, "+".join(f"IPv{f}" for f in res.families), res.changed,
            (time.perf_counter() - t0) * 1e3, " (fresh pod: one native call)" if fresh is not None else "",
        )
    return res


def _setup_general(impl: Any, cfg: RedirectConfig, plan: Plan, netns: _netns.NetnsRef) -> Installed:
    """``setup`` inside the netns, under ``netns_lock``: any backend, any previous state."""
    with _netns.enter(netns), one_nft_context():
        with netns_lock(_netns.current_inode()):
            families = _families_for(impl, cfg)
            # Asked before apply: on a fresh pod listing the tables is cheap then, and costs a
            # refill of libnftables' cache of our new table after it (~0.3 ms of an nftables setup).
            other = _other_netfilter_installed(impl.name)
            res = impl.apply(plan, cfg, families)
            if other is not None and _retire_other_netfilter(impl.name, other):
                res = Installed(res.backend, res.netns, res.families, True, res.detail)
    return res


def _netfilter_kind(backend_name: str) -> str | None:
    if backend_name == "nftables":
        return "nftables"
    return "iptables" if backend_name.startswith("iptables") else None


def _other_netfilter_installed(backend_name: str) -> Any:
    """The other netfilter backend (iptables <-> nftables) if it has rules of ours here, else None."""
    mine = _netfilter_kind(backend_name)
    if mine is None:
        return None
    other = "iptables" if mine == "nftables" else "nftables"
    try:
        impl = get_backend(other, None)
        return impl if impl.installed() else None
    except RedirectError as e:
        log.error("could not tell whether %s rules of ours are installed: %s", other, e)
        return None


def _retire_other_netfilter(backend_name: str, impl: Any) -> bool:
    """Mixed hosts: once ``backend_name`` applied, remove our rules made by the other
    netfilter backend ``impl`` (as ``_other_netfilter_installed`` found it), keeping the
    routes both share. New rules first, old ones after: capture never lapses. True if
    anything was removed."""
    mine, other = _netfilter_kind(backend_name), impl.name
    try:
        log.info("switching backend: removing our %s rules now that %s ones are in", other, mine)
        return bool(impl.remove(keep_routes=True))
    except RedirectError as e:
        # Capture is in place (both rule sets do the same thing); the next setup retries.
        log.error("could not remove our old %s rules after switching to %s: %s", other, mine, e)
        return False


def teardown(netns: _netns.NetnsRef, backend: str = "iptables") -> bool:
    """Remove our redirection from ``netns`` (nothing else). True if anything was removed."""
    impl = get_backend(backend, None)
    name = _netns.describe(netns)
    with _netns.enter(netns), one_nft_context():
        with netns_lock(_netns.current_inode()):
            removed = impl.remove()
            if backend == "auto":  # whichever netfilter backend made them
                other = _other_netfilter_installed(impl.name)
                removed = (other is not None and _retire_other_netfilter(impl.name, other)) or removed
    log.info("teardown netns=%s backend=%s removed=%s", name, impl.name, removed)
    return removed


def check(netns: _netns.NetnsRef, config: RedirectConfig | None = None, backend: str = "iptables") -> CheckResult:
    """Whether what is installed in ``netns`` equals what ``config`` wants; the differences if not."""
    cfg = _config(config)
    plan = _plan(cfg)
    impl = get_backend(backend, cfg)
    with _netns.enter(netns), one_nft_context():
        return impl.check(plan, cfg, _families_for(impl, cfg))


def show(netns: _netns.NetnsRef, backend: str = "iptables") -> dict[str, Any]:
    """What of ours is installed in ``netns``, read from the kernel."""
    impl = get_backend(backend, None)
    with _netns.enter(netns):
        out = impl.show()
    out["netns"] = _netns.describe(netns)
    return out


def render(config: RedirectConfig | None = None, backend: str = "iptables", ipv6: bool = True) -> str:
    """What ``setup`` would install, as text, without touching any kernel (``--dry-run``)."""
    cfg = _config(config)
    impl = get_backend(backend, cfg)
    fams = (4, 6) if (cfg.ipv6 if cfg.ipv6 is not None else ipv6) else (4,)
    return impl.render(_plan(cfg), fams)
