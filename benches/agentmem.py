"""Resident memory of ``redirect-agent`` in steady state, per default backend (``--backend``).

For each backend an agent of its own is started as a node runs it (the thin plugin installed
next to it), waited for until ``/readyz`` says ready (its backend warmed up: for eBPF, the host
programs loaded and pinned by the short-lived loader process; an eBPF agent has a scratch pin
root of its own, so it is the one that has them loaded), then serves sidecar ADDs through the
thin plugin for fresh namespaces. Its memory is read from ``/proc/<pid>/status`` with those pods
set up (``VmRSS``: resident now; ``VmHWM``: its peak), and whether a compiler (bcc, LLVM, clang)
is mapped from ``/proc/<pid>/maps``. The pods are then deleted and the agent stopped.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from . import nsutil, report
from .cnithin import ThinAgent

TARGET_MIB = report.AGENT_RSS_MIB
REFERENCE = report.AGENT_REFERENCE
COMPILER = re.compile(r"libbcc|libLLVM|libclang")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _readyz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


def _status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of ``pid`` in MiB."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for ln in f:
            k, _, v = ln.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = round(int(v.split()[0]) / 1024, 1)
    return out


def _compiler(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return sorted({ln.split()[-1].rsplit("/", 1)[-1] for ln in f if COMPILER.search(ln)})


def one(backend: str, pods: int, ready_timeout: float = 180.0) -> dict[str, Any]:
    """An agent with ``--backend backend``: ready after how long, its memory with ``pods`` pods set up.
    An eBPF agent gets a pin root of its own, so it loads the host programs itself as the first
    agent on a node does (and its readiness waits for that)."""
    port = _free_port()
    env: dict[str, str] = {}
    if backend == "ebpf":
        env["REDIRECT_BPF_ROOT"] = root = f"/sys/fs/bpf/rdrt-bench-agent-{os.getpid()}"

        def unload() -> None:
            from redirect.backends import ebpf

            ebpf.force_unload_host(root)

        nsutil.at_cleanup(unload)
    t0 = time.perf_counter()
    agent = ThinAgent(backend, port, env)
    try:
        deadline = time.monotonic() + ready_timeout
        while (got := _readyz(port))[0] != 200:
            if agent.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {backend} agent was not ready after {ready_timeout:.0f} s: {got[1]}")
            time.sleep(0.05)
        ready_ms = (time.perf_counter() - t0) * 1e3
        names = nsutil.create(pods, "a")
        try:
            errors = 0
            for ns in names:
                rc, _ = agent.call("ADD", backend, "sidecar", ns)
                errors += rc != 0
            mem = _status(agent.proc.pid)
            compiler = _compiler(agent.proc.pid)
            for ns in names:
                agent.call("DEL", backend, "sidecar", ns)
        finally:
            nsutil.delete(names)
        return {"pods": pods, "add_errors": errors, "ready_ms": round(ready_ms, 1), "rss_mib": mem.get("VmRSS"),
                "peak_mib": mem.get("VmHWM"), "anon_mib": mem.get("RssAnon"), "file_mib": mem.get("RssFile"),
                "compiler_mapped": compiler}
    finally:
        nsutil.stop(agent.proc)
        if env:
            from redirect.backends import ebpf

            ebpf.force_unload_host(env["REDIRECT_BPF_ROOT"])


def run(backends: list[str], pods: int, bar: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in backends:
        try:
            out[b] = one(b, pods)
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            bar.note(f"agent memory {b}: {e}")
            out[b] = {"error": f"{type(e).__name__}: {e}"}
        bar(1)
    return out
