"""The thin CNI plugin (``native/cni_thin.c``) as a runtime calls it, served by a redirect-agent of
the run's own; and 100 concurrent ADDs through it.

The agent runs for the whole run on sockets in a temp dir (no node rules, no resync), with the
run's scratch eBPF root inherited; the plugin is installed by ``redirect.cni.install`` into a
bin dir next to them, with the Python plugin's launcher, as on a node.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from redirect.kernel import netns as rnetns

from . import nsutil, podcost
from .methods import Method, Unavailable, _verify_api, cni_conf

#: pods started at once in the concurrency phase (a node starting 100 pods; the profile may say fewer)
CONCURRENT_PODS = 100


class ThinAgent:
    """A redirect-agent process and the thin plugin installed next to it (started once per run)."""

    _instance: ThinAgent | None = None

    def __init__(self, backend: str = "iptables", http_port: int = 0, env: dict[str, str] | None = None) -> None:
        """``backend``: the agent's ``--backend`` (its default, which it warms up); ``http_port``: its
        ops port (0: any, not known here); ``env``: set in its environment."""
        from redirect.cni import install as inst

        self.dir = tempfile.mkdtemp(prefix="rdrt-bench-cni-")
        nsutil.at_cleanup(lambda: shutil.rmtree(self.dir, ignore_errors=True))
        self.bin = os.path.join(self.dir, "bin")
        try:
            inst.install_binary(self.bin)
        except inst.InstallError as e:
            raise Unavailable(str(e)) from None
        self.exe = os.path.join(self.bin, "redirect-cni")
        self.sock = os.path.join(self.dir, "agent.sock")
        self.log = os.path.join(self.dir, "agent.log")
        with open(self.log, "wb") as f:
            self.proc = nsutil.track(subprocess.Popen(
                [sys.executable, "-m", "redirect.ambient.agent.daemon", "--events-socket", self.sock,
                 "--proxy-socket", os.path.join(self.dir, "proxy.sock"), "--http-port", str(http_port),
                 "--backend", backend, "--no-host-rules",
                 "--no-proc-scan", "--resync-seconds", "0", "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=f, env={**os.environ, **(env or {})}))
        deadline = time.monotonic() + 60
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s, contextlib.suppress(OSError):
                s.connect(self.sock)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                nsutil.stop(self.proc)
                with open(self.log, errors="replace") as f:
                    raise Unavailable(f"redirect-agent did not start: {f.read()[-300:]}")
            time.sleep(0.05)

    @classmethod
    def get(cls) -> ThinAgent:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def call(self, command: str, backend: str, mode: str, ns: str) -> tuple[int, bytes]:
        nspath = rnetns.path_of(ns) or ns
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
               "CNI_CONTAINERID": os.path.basename(nspath), "CNI_NETNS": nspath, "CNI_IFNAME": "eth0",
               "CNI_PATH": self.bin, "CNI_ARGS": ""}
        conf = {**cni_conf(backend, mode, nspath), "agentSocket": self.sock}
        r = subprocess.run([self.exe], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=60)
        return r.returncode, r.stdout


def thin_method(backend: str, mode: str) -> Method:
    """CNI ADD/DEL through the thin plugin and the agent (sidecar mode: ambient pods need a node proxy)."""
    if mode != "sidecar":
        raise Unavailable("the thin plugin is measured for sidecar pods (an ambient ADD waits for a node proxy)")
    agent = ThinAgent.get()

    def call(command: str, ns: str) -> None:
        rc, out = agent.call(command, backend, mode, ns)
        if rc != 0:
            raise RuntimeError(f"thin redirect-cni {command}: exit {rc}: {out.decode(errors='replace')[:300]}")

    return Method(f"cni-thin/{backend}/{mode}", "cni", backend, mode, lambda ns: call("ADD", ns),
                  lambda ns: call("DEL", ns), _verify_api(backend, mode),
                  note="thin redirect-cni ADD/DEL (C) -> redirect-agent", listen=())


def concurrent_adds(m: Method, pods: int = CONCURRENT_PODS) -> dict[str, Any]:
    """``pods`` ADDs through the thin plugin at once over fresh namespaces (each timed as the runtime
    sees it, errors counted), every pod verified, then their DELs at once."""
    agent = ThinAgent.get()
    names = nsutil.create(pods, "c")
    out: dict[str, Any] = {"pods": pods}
    try:
        for phase in ("ADD", "DEL"):
            def one(ns: str, phase: str = phase) -> tuple[float, str]:
                t0 = time.perf_counter_ns()
                rc, stdout = agent.call(phase, m.backend, m.mode, ns)
                return (time.perf_counter_ns() - t0) / 1e6, "" if rc == 0 else stdout.decode(errors="replace")[:200]

            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(pods) as ex:
                got = list(ex.map(one, names))
            wall = (time.perf_counter() - t0) * 1e3
            errors = [e for _, e in got if e]
            out[phase.lower()] = {**podcost.stats([ms for ms, _ in got]), "errors": len(errors),
                                  "wall_ms": round(wall, 1), "first_error": errors[0] if errors else ""}
            if phase == "ADD":
                bad = 0
                for ns in names:
                    try:
                        m.verify(ns)
                    except Exception:  # noqa: BLE001 - counted
                        bad += 1
                out["add"]["not_captured"] = bad
    finally:
        nsutil.delete(names)
    return out
