"""Data path on loopback inside a pod namespace, measured by C programs (``fastpath/``).

Cases: ``direct`` (the app connects to the proxy at 127.0.0.1:15001: no capture, the physical
floor), ``reference`` (Istio's rules, see ``reference.py``) and each backend (sidecar mode; eBPF
in ambient mode too, ``ebpf/ambient``, where the proxy stands for the node proxy; and with
``sockmap=True``, ``ebpf/sockmap``, the app's connection paired with the proxy's): the app connects
to 192.0.2.2:8080 (the peer end of the pod's eth0, where nothing listens) and capture delivers
the connection to the proxy on 15001. The proxy starts before capture is set up, as in a pod (the
eBPF backend needs its listeners then); an inbound listener on 15006 is held for eBPF. The proxy
(``rdrt_echo``) echoes and never connects onward: the figure is the cost of reaching the proxy,
which is what capture changes. A captured case is checked first: one request must come back,
else nothing listens there and the case is reported as not captured. With eBPF, one more case,
``pairing-floor``, is ``direct`` with the least sockmap pairing the kernel allows and no capture
(``pairfloor.py``): what any pairing pays at connect; its ``sock_ops`` program is on the cgroup
during its own runs only, and what its programs did (ends joined, sends redirected) is recorded.

Four measures per case, the cases taking turns: ``crr`` (connect + 64-byte request/response +
close: the connection rate), ``rr`` (64-byte request/response on one established connection:
p50/p99 latency), ``rr1`` (the same with the client and the proxy on one CPU: the hop's own
latency, without the wake-up of a task on another CPU, which both ends pay in every case alike
and which on a virtual machine can be several times the hop) and ``bulk`` (one connection
streaming 128 KB writes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

import redirect
from redirect.kernel import podkit

from . import nsutil, pairfloor, reference
from .methods import config_for, listen_for

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "build")
POD_ADDR, PEER_ADDR = "192.0.2.1", "192.0.2.2"  # TEST-NET-1, only ever inside our namespaces
PROXY_PORT, APP_PORT = 15001, 8080


def build() -> dict[str, str]:
    """Compile the client and the echo proxy with gcc into benches/build/ (when sources changed)."""
    os.makedirs(BUILD, exist_ok=True)
    out = {}
    for name, src in (("rdrt_client", "client.c"), ("rdrt_echo", "echo.c")):
        exe, path = os.path.join(BUILD, name), os.path.join(HERE, "fastpath", src)
        if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(path):
            subprocess.run(["gcc", "-O2", "-Wall", "-o", exe, path], check=True, capture_output=True, timeout=120)
        out[name] = exe
    return out


def make_pod(listen: tuple[int, ...] = ()) -> tuple[str, str]:
    """A pod netns with eth0 192.0.2.1/24 whose veth peer (192.0.2.2) sits in a second netns.

    ``listen``: ports held open in the pod (see ``nsutil.create``)."""
    (pod,) = nsutil.create(1, "d", listen)
    (peer,) = nsutil.create(1, "d")
    podkit.connect_netns(pod, peer, podkit.Link("eth0", "eth0", POD_ADDR, PEER_ADDR))
    return pod, peer


def start_echo(exe: str, pod: str, lifetime_s: int) -> subprocess.Popen[bytes]:
    p = nsutil.track(subprocess.Popen(["ip", "netns", "exec", pod, exe, str(PROXY_PORT), str(lifetime_s)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 10)
    if not ready or b"ready" not in p.stdout.readline():
        nsutil.stop(p)
        raise RuntimeError("echo proxy did not start")
    try:  # `ip netns exec` execs it (no fork): the pid ``rr1`` pins is the echo's
        me = os.path.basename(os.readlink(f"/proc/{p.pid}/exe"))
    except OSError:
        me = ""
    if me != os.path.basename(exe):
        nsutil.stop(p)
        raise RuntimeError(f"echo proxy: pid {p.pid} runs {me!r}, not {os.path.basename(exe)}: it could not be pinned")
    return p


def client(exe: str, pod: str, mode: str, addr: str, limit: int, seconds: float, size: int,
           cpu: int | None = None) -> dict[str, Any]:
    """One run of the client in ``pod`` (``cpu``: pinned to that CPU, with ``taskset``)."""
    pin = [] if cpu is None else ["taskset", "-c", str(cpu)]
    r = nsutil.run_in(pod, [*pin, exe, mode, addr, str(APP_PORT if addr != "127.0.0.1" else PROXY_PORT), str(limit),
                            str(seconds), str(size)], timeout=seconds + 30)
    try:
        res: dict[str, Any] = json.loads(r.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"client {mode} to {addr}: exit {r.returncode}: {r.stderr.decode(errors='replace')[:200]}")
    if r.returncode != 0:
        raise RuntimeError(f"client {mode} to {addr}: {res}")
    return res


class Case:
    """``remove`` is given the pod and what ``install`` returned (None if it failed); ``addr``: where
    the app connects (the proxy itself, 127.0.0.1, when nothing is installed)."""

    def __init__(self, name: str, install: Callable[[str], Any] | None, listen: tuple[int, ...] = (),
                 remove: Callable[[str, Any], None] | None = None, addr: str = "") -> None:
        self.name, self.install, self.listen, self.remove = name, install, listen, remove
        self.installed = False
        self.handle: Any = None
        self.counts: dict[str, int] = {}
        self.pod = self.peer = ""
        self.echo: subprocess.Popen[bytes] | None = None
        self.addr = addr or ("127.0.0.1" if install is None else PEER_ADDR)
        self.crr: list[dict[str, Any]] = []
        self.rr: list[dict[str, Any]] = []
        self.rr1: list[dict[str, Any]] = []
        self.bulk: list[dict[str, Any]] = []

    def run(self, exe: str, mode: str, limit: int, seconds: float, size: int, cpu: int | None = None) -> dict[str, Any]:
        """One run of the client (``client``) against this case: the pairing floor's ``sock_ops``
        attached for that run only."""
        with self.handle.attached() if isinstance(self.handle, pairfloor.PairFloor) else contextlib.nullcontext():
            return client(exe, self.pod, mode, self.addr, limit, seconds, size, cpu)


def _install_reference(pod: str) -> None:
    from redirect.kernel import netns as rnetns

    with rnetns.enter(pod):
        reference.install_rules()  # (Istio's rules, without the per-pod sequence around them)


def _install_backend(backend: str, mode: str = "sidecar", sockmap: bool = False) -> Callable[[str], None]:
    def install(pod: str) -> None:
        cfg = config_for(mode)
        redirect.setup(pod, dataclasses.replace(cfg, sockmap=True) if sockmap else cfg, backend=backend)
    return install


def _remove_backend(backend: str) -> Callable[[str, Any], None]:
    def remove(pod: str, _installed: Any) -> None:
        redirect.teardown(pod, backend=backend)
    return remove


def _install_floor(pod: str) -> pairfloor.PairFloor:
    return pairfloor.PairFloor(pod, PROXY_PORT)


def _remove_floor(_pod: str, floor: pairfloor.PairFloor | None) -> None:
    if floor is not None:
        floor.close()


def run(backends: list[str], rounds: int, seconds: float, max_conns: int, bulk_seconds: float,
        progress: Callable[[int], None], notes: list[str], ambient: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """``backends`` in sidecar mode, and ``ambient`` in ambient mode (case ``<backend>/ambient``: the
    app's outbound goes to the proxy's port as a node proxy's would take it)."""
    exes = build()
    cases = [Case("direct", None), Case("reference", _install_reference)]
    # Teardown before the namespace goes: the eBPF backend's per-pod state is not in the netns.
    cases += [Case(b, _install_backend(b), listen_for(b, "sidecar"), _remove_backend(b)) for b in backends]
    cases += [Case(f"{b}/ambient", _install_backend(b, "ambient"), listen_for(b, "ambient"), _remove_backend(b))
              for b in ambient]
    if "ebpf" in backends:  # the app <-> proxy hop over a sockmap (sockmap=True)
        cases.append(Case("ebpf/sockmap", _install_backend("ebpf", sockmap=True), listen_for("ebpf", "sidecar"),
                          _remove_backend("ebpf")))
        # What any pairing pays at connect: direct, with the least pairing the kernel allows.
        cases.append(Case("pairing-floor", _install_floor, remove=_remove_floor, addr="127.0.0.1"))
    lifetime = int(rounds * len(cases) * (3 * seconds + bulk_seconds + 5) + 60)
    cpus = os.sched_getaffinity(0)
    cpu = max(cpus)  # where ``rr1`` runs: the last CPU this process may use
    results: dict[str, Any] = {"msg_bytes": 64, "rounds": rounds, "seconds_per_run": seconds,
                               "max_conns_per_run": max_conns, "bulk_seconds": bulk_seconds, "rr1_cpu": cpu,
                               "cases": {}}
    live: list[Case] = []
    try:
        for c in cases:
            try:
                c.pod, c.peer = make_pod(c.listen)
                # The proxy first, as in a pod (the eBPF backend looks up its listeners at setup).
                c.echo = start_echo(exes["rdrt_echo"], c.pod, lifetime)
                if c.install:
                    c.installed = True  # (a failed setup may leave part: teardown is idempotent)
                    c.handle = c.install(c.pod)
                c.run(exes["rdrt_client"], "crr", 1, 5, 64)  # captured, or it fails here
                live.append(c)
            except Exception as e:  # noqa: BLE001 - recorded, the others go on
                notes.append(f"data path {c.name}: skipped: {e}")
                results["cases"][c.name] = {"error": str(e)}
            progress(1)
        # Each round's connection-rate time goes in slices of ~0.25 s, the cases taking turns
        # slice by slice, each turn starting one case later: drift on a shared machine (over a
        # 2 s run, one case's rate moved 0.34-2.1x against the next one's) and any first-in-turn
        # advantage hit every case alike, and the ratios pair runs a fraction of a second apart.
        slices = max(1, round(seconds / 0.25))
        turn = 0
        for i in range(rounds):
            for _ in range(slices):
                for c in live[turn % len(live):] + live[:turn % len(live)] if live else []:
                    c.crr.append(c.run(exes["rdrt_client"], "crr", max(1, max_conns // slices), seconds / slices, 64))
                turn += 1
            order = live[i % len(live):] + live[:i % len(live)] if live else []  # (each round one case later)
            for c in order:
                c.rr.append(c.run(exes["rdrt_client"], "rr", 1_000_000, seconds, 64))
            for c in order:
                assert c.echo is not None
                os.sched_setaffinity(c.echo.pid, {cpu})
                try:
                    c.rr1.append(c.run(exes["rdrt_client"], "rr", 1_000_000, seconds, 64, cpu))
                finally:
                    os.sched_setaffinity(c.echo.pid, cpus)
            for c in order:
                c.bulk.append(c.run(exes["rdrt_client"], "bulk", 8 << 30, bulk_seconds, 1 << 17))
                progress(1)
    finally:
        for c in cases:
            if c.echo is not None:
                nsutil.stop(c.echo)
            if isinstance(c.handle, pairfloor.PairFloor):
                c.counts = c.handle.counts()
            if c.installed and c.remove is not None:
                try:
                    c.remove(c.pod, c.handle)
                except Exception as e:  # noqa: BLE001 - the namespace goes anyway; say so
                    notes.append(f"data path {c.name}: teardown failed: {e}")
            nsutil.delete([n for n in (c.pod, c.peer) if n])
    for c in live:
        med = lambda key, runs: round(statistics.median(r[key] for r in runs), 2)  # noqa: E731
        results["cases"][c.name] = {
            "target": f"{c.addr}:{APP_PORT if c.addr != '127.0.0.1' else PROXY_PORT}",
            "conn_per_s": med("conn_per_s", c.crr), "p50_us": med("p50_us", c.crr), "p99_us": med("p99_us", c.crr),
            "rr_p50_us": med("p50_us", c.rr), "rr_p99_us": med("p99_us", c.rr),
            "rr1_p50_us": med("p50_us", c.rr1), "rr1_p99_us": med("p99_us", c.rr1),
            "bulk_gbit_per_s": med("gbit_per_s", c.bulk),
            "runs": {"crr": c.crr, "rr": c.rr, "rr1": c.rr1, "bulk": c.bulk},
        }
        if c.counts:
            results["cases"][c.name]["pairing"] = c.counts
    return results

