"""A whole pod start and stop through a real runtime: containerd's ``ctr run --rm --cni``.

A containerd of the run's own (``tests/ctrkit.py``: temp root, state and socket) runs a busybox
container that exits at once (``sleep 0``), in a bridge + host-local network (the reference plugins), either
alone or chained with ours: the thin plugin served by the run's redirect-agent (sidecar mode,
per backend) and the Python plugin (the thin binary's ``agentDown: inProcess`` fallback, as
with no agent running). Each sample is the wall time of one ``ctr run``: CNI ADD, task start,
exit, CNI DEL, container delete; the difference against the reference plugins alone is what our
plugin adds to a pod's start and stop as a runtime sees it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import podcost
from .methods import Unavailable

#: The case with the reference plugins alone: the other cases are compared with it.
BASELINE = "bridge only"


def _cases(backends: list[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """(name, our plugin's conflist entry or None) for each case; the agent's socket is filled in later."""
    cases: list[tuple[str, dict[str, Any] | None]] = [(BASELINE, None)]
    cases += [(f"thin plugin + agent, {b}", {"backend": b, "mode": "sidecar"}) for b in backends]
    if "iptables" in backends:
        cases.append(("Python plugin, iptables", {"backend": "iptables", "mode": "sidecar", "agentDown": "inProcess"}))
    return cases


def run(backends: list[str], samples: int, tick: Callable[[int], None]) -> dict[str, Any]:
    """``samples`` pod starts per case, with ``tick(1)`` after each; {case: stats} plus the
    difference of each case's median against the reference plugins alone."""
    try:
        from tests import ctrkit
    except ImportError as e:  # the kit lives with the tests; a checkout has both
        raise Unavailable(f"tests/ctrkit.py not importable: {e}") from None
    if None in ctrkit.NEEDED or not os.path.exists(f"{ctrkit.CNI_DIR}/bridge"):
        raise Unavailable("needs containerd, ctr, runc, busybox-static, unshare and containernetworking-plugins")
    from redirect.cni import install as inst

    from .cnithin import ThinAgent

    out: dict[str, Any] = {"samples": samples, "cases": {}}
    with ctrkit.running_containerd() as ctd:
        for name, entry in _cases(backends):
            base = tempfile.mkdtemp(prefix="case-", dir=ctd.base)
            try:
                with ctrkit.bridge_net(base, "rdrt-bench-pod", 247) as net:
                    if entry is not None:
                        sock = (os.path.join(base, "no-agent.sock") if entry.get("agentDown") == "inProcess"
                                else ThinAgent.get().sock)
                        inst.install(net.net_d, net.bin_d, {**entry, "agentSocket": sock})
                    times: list[float] = []
                    errors: list[str] = []
                    for i in range(samples):
                        cid = f"rdrt-b{os.getpid()}-{i}-{os.urandom(2).hex()}"
                        t0 = time.perf_counter()
                        with ctrkit.ctr_run(ctd, net, cid, "/bin/sleep 0") as p:
                            try:
                                p.wait(60)
                            except subprocess.TimeoutExpired:
                                pass
                        ms = (time.perf_counter() - t0) * 1e3
                        if p.returncode == 0:
                            times.append(ms)
                        else:
                            out_text = p.stdout.read().decode(errors="replace") if p.stdout else ""
                            errors.append(f"exit {p.returncode}: {' '.join(out_text.split())[-200:]}")
                        tick(1)
                    out["cases"][name] = {**podcost.stats(times), "errors": len(errors),
                                          "first_error": errors[0] if errors else ""}
            finally:
                shutil.rmtree(base, ignore_errors=True)
    base_ms = out["cases"].get(BASELINE, {}).get("median_ms")
    for d in out["cases"].values():
        if base_ms and d.get("median_ms"):
            d["added_ms"] = round(d["median_ms"] - base_ms, 2)
    return out
