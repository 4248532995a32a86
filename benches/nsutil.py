"""Bench namespaces: created in bulk with one ``ip -batch``, always deleted (finally + atexit + signals)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from collections.abc import Iterable

PREFIX = f"rdrt-b{os.getpid()}-"
_live: set[str] = set()
_lock = threading.Lock()
_counter = 0
_procs: list[subprocess.Popen[bytes]] = []


def _batch(lines: Iterable[str], check: bool = True) -> None:
    text = "".join(line + "\n" for line in lines)
    if not text:
        return
    r = subprocess.run(["ip", "-force", "-batch", "-"], input=text.encode(), capture_output=True, timeout=300)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip -batch failed: {r.stderr.decode(errors='replace').strip()[:400]}")


def new_names(n: int, tag: str = "p") -> list[str]:
    global _counter
    with _lock:
        names = [f"{PREFIX}{tag}{_counter + i}" for i in range(n)]
        _counter += n
    return names


def create(n: int, tag: str = "p") -> list[str]:
    """``n`` fresh network namespaces with ``lo`` up, as a runtime hands them to CNI (not timed)."""
    from pyroute2 import IPRoute

    from redirect import netns as rnetns

    names = new_names(n, tag)
    with _lock:
        _live.update(names)
    _batch(f"netns add {name}" for name in names)
    for name in names:
        with rnetns.enter(name):
            with IPRoute() as ipr:
                ipr.link("set", index=1, state="up")
    return names


def delete(names: Iterable[str]) -> None:
    names = list(names)
    with _lock:
        for n in names:
            _live.discard(n)
    _batch((f"netns delete {n}" for n in names), check=False)


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


def cleanup() -> None:
    """Stop our processes and delete every namespace this run created. Safe to call twice."""
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


def install_handlers() -> None:
    atexit.register(cleanup)

    def _on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)


def live_count() -> int:
    with _lock:
        return len(_live)
