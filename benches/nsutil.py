"""Bench namespaces: created in bulk (the pod kit's one ``ip -batch``), always deleted (finally + atexit + signals).

Every process the harness starts carries ``RDRT_BENCH_OWNER=<our pid>`` in its environment
(``OWNER_ENV``), so a test can tell that none outlived the run.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable

from redirect.kernel import netlink, podkit
from redirect.kernel import netns as rnetns

PREFIX = f"rdrt-b{os.getpid()}-"
_live: set[str] = set()
_lock = threading.Lock()
_counter = 0
_procs: list[subprocess.Popen[bytes]] = []
#: Listening sockets held in a namespace for a backend that needs its proxy up first (eBPF inbound).
_socks: dict[str, list[socket.socket]] = {}
OWNER_ENV = "RDRT_BENCH_OWNER"
#: What each new namespace gets besides lo (``--pod-addresses``): "none", "v4" (an ``eth0`` with
#: an IPv4 address) or "dual" (IPv4 and IPv6), as a CNI runtime hands a pod to a chained plugin.
POD_ADDRESSES = ("none", "v4", "dual")
pod_addresses = "none"
_addr_counter = itertools.count()
os.environ[OWNER_ENV] = str(os.getpid())  # inherited by every child: ip, iptables, redirect, rdrt_*


def new_names(n: int, tag: str = "p") -> list[str]:
    global _counter
    with _lock:
        names = [f"{PREFIX}{tag}{_counter + i}" for i in range(n)]
        _counter += n
    return names


def _listen(port: int) -> list[socket.socket]:
    """A TCP listener on ``port`` per family in the current netns (a proxy that is already up)."""
    out: list[socket.socket] = []
    for fam, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
            s.listen(16)
        except OSError:
            s.close()
            for o in out:
                o.close()
            raise
        out.append(s)
    return out


def create(n: int, tag: str = "p", listen: tuple[int, ...] = ()) -> list[str]:
    """``n`` fresh network namespaces with ``lo`` up, as a runtime hands them to CNI (not timed;
    the pod kit's bulk creation, ``redirect.kernel.podkit.create_netns_many``).

    ``listen``: ports on which a listener per family is held open in each namespace until it is
    deleted (the eBPF backend hands the proxy's inbound socket to sk_lookup at setup)."""
    names = new_names(n, tag)
    with _lock:
        _live.update(names)
    podkit.create_netns_many(names)
    for name in names:
        if pod_addresses != "none":
            with rnetns.enter(name):
                _give_addresses()
        if listen:
            hold(name, listen)
    return names


def _give_addresses() -> None:
    """``eth0`` (one end of a veth pair kept inside the namespace) with an address of its own,
    unique in the run (the eBPF backend registers pod addresses host-wide): from 10.200.0.0/13, and
    for "dual" also from fd00:4d0::/96."""
    i = next(_addr_counter)
    with netlink.NetlinkSocket() as nl:
        netlink.add_veth("eth0", "eth0-peer", sock=nl)
        idx = netlink.link_index("eth0", sock=nl)
        netlink.set_up(idx, sock=nl)
        netlink.addr("add", socket.AF_INET, idx, f"10.{200 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}", 32, 0, sock=nl)
        if pod_addresses == "dual":  # (IFA_F_NODAD: usable at once, as after DAD)
            netlink.addr("add", socket.AF_INET6, idx, f"fd00:4d0::{i >> 16:x}:{i & 0xFFFF:x}", 128, 0, 0x02, sock=nl)


def hold(name: str, ports: tuple[int, ...], entered: bool = False) -> None:
    """Hold a listener per family on each of ``ports`` in namespace ``name`` until ``release``."""
    if not ports:
        return
    if not entered:
        with rnetns.enter(name):
            return hold(name, ports, entered=True)
    socks = [s for port in ports for s in _listen(port)]
    with _lock:
        _socks.setdefault(name, []).extend(socks)


def release(name: str) -> None:
    """Close the listeners held in ``name`` (their job, being there at setup, is done): the eBPF
    backend finds the proxy's listener by scanning the caller's fds, so listeners of N-1 live pods
    held in this one process would make pod N's setup cost grow with N — a harness artefact."""
    with _lock:
        socks = _socks.pop(name, [])
    for sock in socks:
        sock.close()


def delete(names: Iterable[str]) -> None:
    names = list(names)
    with _lock:
        for n in names:
            _live.discard(n)
            for sock in _socks.pop(n, []):
                sock.close()
    podkit.remove_netns_many(names)


def run_in(name: str, argv: list[str], timeout: float = 30, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["ip", "netns", "exec", name, *argv], capture_output=True, timeout=timeout, **kw)  # type: ignore[call-overload, no-any-return]


def track(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """A process we started and must stop (by its pid) at exit."""
    _procs.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)
    if proc in _procs:
        _procs.remove(proc)


_hooks: list[Callable[[], None]] = []


def at_cleanup(fn: Callable[[], None]) -> None:
    """Run ``fn`` in ``cleanup``, after the namespaces are gone (e.g. unload scratch BPF pins)."""
    _hooks.append(fn)


def cleanup() -> None:
    """Stop our processes and delete every namespace this run created, then run the hooks.
    Safe to call twice."""
    for p in list(_procs):
        try:
            stop(p)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    with _lock:
        left = sorted(_live)
    if left:
        delete(left)
    # Belt and braces: anything with our prefix that escaped the registry.
    try:
        stray = [n.split()[0] for n in os.listdir("/run/netns") if n.startswith(PREFIX)]
    except OSError:
        stray = []
    if stray:
        delete(stray)
    while _hooks:
        fn = _hooks.pop()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - best effort at exit; say what was left
            print(f"benches: cleanup: {e}", file=sys.stderr)


def install_handlers() -> None:
    atexit.register(cleanup)

    def _on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    # Ctrl-C too, even when this process was started with SIGINT ignored (as a shell starts a
    # background job, and so everything under it): Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def live_count() -> int:
    with _lock:
        return len(_live)
