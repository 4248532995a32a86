"""Per-pod setup/teardown latency over fresh namespaces, at scale, and kernel memory per pod."""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import nsutil
from .methods import Method

Progress = Callable[[int], None]


def stats(samples_ms: Sequence[float]) -> dict[str, Any]:
    xs = sorted(samples_ms)
    if not xs:
        return {"n": 0}
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return {"n": len(xs), "min_ms": round(xs[0], 4), "median_ms": round(statistics.median(xs), 4),
            "p99_ms": round(p99, 4), "mean_ms": round(statistics.fmean(xs), 4),
            "samples_ms": [round(x, 4) for x in samples_ms]}


def _timed(fn: Callable[[str], None], ns: str) -> float:
    t0 = time.perf_counter_ns()
    fn(ns)
    return (time.perf_counter_ns() - t0) / 1e6


#: The fresh-pod call's steps that no eBPF setup of a pod of its kind can leave out, whoever writes it:
#: a handle on the netns (``open``; with our lock, a few microseconds), entering it (``enter``) and
#: coming back (``leave``): a policy route and a netns's sysctl can only be changed from inside; the
#: sk_lookup link, the one per-netns hook that hands inbound connections to a listener without
#: netfilter or tc (``link``), and one map write that tells the host programs about the pod
#: (``policy``); and an ambient pod's own two (0 in a sidecar pod): its policy rule and local route
#: of each family (``routes``, what Istio's node agent adds too) and ``tcp_fwmark_accept``
#: (``sysctl``: nothing else marks the app's side of a connection before its SYN-ACK leaves,
#: docs/kernel-facts.md). Left out, so the sum is a lower bound: the netlink socket the routes go
#: through and the address dump (``scan``), the listener look-up, the other map entries.
REQUIRED_STEPS = ("open", "enter", "sysctl", "routes", "link", "policy", "leave")


def step_medians(samples: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The median of each step over ``samples`` (step name -> microseconds, ``Method.steps``), in
    the steps' order, with ``n``, the number of setups they come from, and ``required``: the median
    of each sample's sum of ``REQUIRED_STEPS``."""
    out: dict[str, Any] = {"n": len(samples)}
    for name in samples[0]:
        out[name] = round(statistics.median(s.get(name, 0.0) for s in samples), 2)
    out["required"] = round(statistics.median(sum(s.get(n, 0.0) for n in REQUIRED_STEPS) for s in samples), 2)
    return out


def warm_and_verify(m: Method) -> None:
    """One untimed pod per method: imports, caches and first-link costs out of the way, and proof
    that the method really installs something (``verify``) and removes it."""
    (ns,) = nsutil.create(1, "w", m.listen)
    try:
        if m.prepare is not None:
            m.prepare(ns)
        m.setup(ns)
        m.verify(ns)
        m.teardown(ns)
    finally:
        nsutil.delete([ns])


def per_pod(methods: Sequence[Method], samples: int, progress: Progress,
            failed: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Setup then teardown of ``samples`` fresh pods per method, interleaved round-robin so that
    drift on a shared machine hits every method alike. The order is shuffled from round to round
    (seeded: the same orders in every run), so that each method follows every other one about
    equally often: a method that execs processes (the reference, iptables) leaves the caches cold
    for the one after it, and a fixed order would charge that to one method only."""
    out: dict[str, dict[str, Any]] = {}
    live = [m for m in methods if m.key not in failed]
    names = {m.key: nsutil.create(samples, "s") for m in live}
    for m in live:  # (not timed)
        if m.prepare is not None:
            for ns in names[m.key]:
                m.prepare(ns)
    setup_t: dict[str, list[float]] = {m.key: [] for m in live}
    down_t: dict[str, list[float]] = {m.key: [] for m in live}
    steps_t: dict[str, list[dict[str, float]]] = {m.key: [] for m in live}
    try:
        for phase, times in (("setup", setup_t), ("teardown", down_t)):
            for i in range(samples):
                order = list(live)
                random.Random(i).shuffle(order)
                for m in order:
                    if m.key in failed:
                        continue
                    fn = m.setup if phase == "setup" else m.teardown
                    try:
                        if phase == "setup":
                            nsutil.hold(names[m.key][i], m.listen)  # not timed: the proxy is up
                        times[m.key].append(_timed(fn, names[m.key][i]))
                        nsutil.release(names[m.key][i])
                        if phase == "setup" and m.steps is not None and (st := m.steps()) is not None:
                            st["outside"] = times[m.key][-1] * 1e3 - st["call"]  # (the caller's part: Python)
                            steps_t[m.key].append(st)
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        failed[m.key] = f"{phase} failed: {e}"
                progress(len(live))
    finally:
        for m in live:
            nsutil.delete(names[m.key])
    for m in live:
        out[m.key] = {"kind": m.kind, "backend": m.backend, "mode": m.mode, "how": m.note,
                      "setup": stats(setup_t[m.key]), "teardown": stats(down_t[m.key])}
        if steps_t[m.key]:
            out[m.key]["steps_us"] = step_medians(steps_t[m.key])
        if m.key in failed:
            out[m.key]["error"] = failed[m.key]
    return out


#: Untimed setups and teardowns of a method before its scale levels.
WARM_UP = 3

#: The fixed work ``control_ms`` times: hashing this many bytes (a fraction of a millisecond).
CONTROL_BYTES = 1 << 20
_CONTROL_DATA = bytes(CONTROL_BYTES)


def control_ms() -> float:
    """The time of a fixed amount of CPU work that no pod changes (one SHA-256 of ``CONTROL_BYTES``).

    Timed beside each scale sample: two levels are measured minutes apart, and a shared machine's
    speed can move in between (another tenant's load, a CPU's clock); the ratio of the two levels'
    medians of this is that move, which ``report`` takes out of the Nth pod's ratio to the first."""
    t0 = time.perf_counter_ns()
    hashlib.sha256(_CONTROL_DATA).digest()
    return (time.perf_counter_ns() - t0) / 1e6


def scale(m: Method, levels: Sequence[int], samples: int, progress: Progress) -> dict[str, Any]:
    """Setup/teardown of the Nth pod while N-1 pods with capture are live, for each N in ``levels``.

    The fill pods' own setup times are kept too (``fill_ms``: the k-th value is pod k+1's setup).
    Each level also times ``control_ms`` after each sample (``control``): the machine's speed then.
    ``WARM_UP`` setups and teardowns of the method come first, not timed: the first pods of a method
    pay for what the phases before it left cold (its programs' pages, caches), which would count
    against the first level only and flatter every other level's ratio to it.
    """
    live: list[str] = []
    fill_ms: list[float] = []
    res: dict[str, Any] = {"levels": {}, "fill_ms": fill_ms, "warm_up": WARM_UP}
    warm = nsutil.create(WARM_UP, "w")
    try:
        for ns in warm:
            nsutil.hold(ns, m.listen)
            m.setup(ns)
            nsutil.release(ns)
            m.teardown(ns)
    finally:
        nsutil.delete(warm)
    try:
        for n in sorted(levels):
            need = n - 1 - len(live)
            if need > 0:
                new = nsutil.create(need, "f")
                for ns in new:
                    nsutil.hold(ns, m.listen)
                    fill_ms.append(round(_timed(m.setup, ns), 4))
                    nsutil.release(ns)
                    live.append(ns)
                    progress(1)
            names = nsutil.create(samples, "n")
            st: list[float] = []
            td: list[float] = []
            ctl: list[float] = []
            try:
                for ns in names:
                    nsutil.hold(ns, m.listen)
                    st.append(_timed(m.setup, ns))
                    nsutil.release(ns)
                    td.append(_timed(m.teardown, ns))
                    ctl.append(control_ms())
                    progress(1)
            finally:
                nsutil.delete(names)
            res["levels"][str(n)] = {"live_pods": n - 1, "setup": stats(st), "teardown": stats(td),
                                     "control": stats(ctl)}
    finally:
        t0 = time.perf_counter()
        for ns in [] if m.cleanup_by_delete else live:
            try:
                m.teardown(ns)
            except Exception:  # noqa: BLE001 - the namespace goes anyway
                pass
        res["teardown_all_s"] = round(time.perf_counter() - t0, 3)
        nsutil.delete(live)
    return res


def kmem_source() -> str | None:
    """The file that counts kernel memory charged to this process's memory cgroup (read only):
    cgroup v1 ``memory.kmem.usage_in_bytes``, or v2 ``memory.stat`` (its ``kernel`` line)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, ctl, path in lines:
        if "memory" in ctl.split(","):
            p = f"/sys/fs/cgroup/memory{path}/memory.kmem.usage_in_bytes"
            if os.path.exists(p):
                return p
    for _, ctl, path in lines:
        if ctl == "":
            for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                p = f"{base}{path}/memory.stat"
                if os.path.exists(p):
                    return p
    return None


def _kmem(src: str | None) -> int | None:
    if src is None:
        return None
    try:
        with open(src) as f:
            text = f.read()
    except OSError:
        return None
    if src.endswith("usage_in_bytes"):
        return int(text)
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == "kernel":
            return int(v)
    return None


def _settled_kmem(src: str | None, max_s: float = 3.0) -> int | None:
    """The cgroup's kernel memory once it stops moving (namespaces deleted just before are freed
    by the kernel asynchronously, and would show as a negative cost): readings 100 ms apart
    within 16 KiB, for at most ``max_s``."""
    last = _kmem(src)
    deadline = time.monotonic() + max_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _kmem(src)
        if now is None or abs(now - last) < 16 << 10:
            return now
        last = now
    return last


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0])
    return out


def _count(argv: list[str], ns: str, needle: bytes) -> int | None:
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.count(needle) if r.returncode == 0 else None


def kernel_objects(ns: str) -> dict[str, int | None]:
    """What one pod's capture is made of, as the kernel reports it."""
    return {
        "iptables_nft_rules": sum(x or 0 for x in (_count(["iptables-nft-save"], ns, b"\n-A "),
                                                   _count(["ip6tables-nft-save"], ns, b"\n-A "))),
        "iptables_legacy_rules": sum(x or 0 for x in (_count(["iptables-legacy-save"], ns, b"\n-A "),
                                                      _count(["ip6tables-legacy-save"], ns, b"\n-A "))),
        "nft_rules_total": _count(["nft", "-j", "list", "ruleset"], ns, b'{"rule":'),
    }


def bpf_root() -> str:
    from redirect.backends import ebpf_root

    return ebpf_root()


def _bpf_maps(root: str | None = None) -> dict[str, int] | None:
    """Entries and their key+value bytes over our pinned maps (``<root>/maps``), where the eBPF
    backend keeps its per-pod state; None when nothing is pinned there."""
    d = os.path.join(root or bpf_root(), "maps")
    try:
        paths = sorted(os.path.join(d, n) for n in os.listdir(d))
    except OSError:
        return None
    entries = nbytes = 0
    for p in paths:
        show = subprocess.run(["bpftool", "-j", "map", "show", "pinned", p], capture_output=True, timeout=30)
        dump = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", p], capture_output=True, timeout=30)
        if show.returncode != 0 or dump.returncode != 0:
            continue
        try:
            info, n = json.loads(show.stdout), len(json.loads(dump.stdout or b"[]"))
        except ValueError:
            continue
        entries += n
        nbytes += n * (int(info.get("bytes_key", 0)) + int(info.get("bytes_value", 0)))
    return {"entries": entries, "bytes": nbytes}


def memory(m: Method, pods: int, progress: Progress) -> dict[str, Any]:
    """Kernel memory per pod for capture alone, over ``pods`` namespaces, measured after the
    (empty) namespaces exist, so the namespaces' own cost is excluded:

    - ``kmem_kib_per_pod``: kernel memory charged to this process's memory cgroup (rules, sets,
      BPF map memory, netlink buffers: what the kernel accounts; iptables-restore children are in
      the same cgroup); exact as long as nothing else in that cgroup allocates meanwhile, and
      ``kmem_freed_kib_per_pod`` is what teardown gave back;
    - ``kib_per_pod``: /proc/meminfo deltas, host-wide: noisy on a shared machine (other work
      allocates too), an order of magnitude at best.
    """
    src = kmem_source()
    names = nsutil.create(pods, "m", m.listen)
    k2 = None
    try:
        time.sleep(0.2)
        bpf0 = _bpf_maps()
        before, k0 = _meminfo(), _settled_kmem(src)
        for ns in names:
            m.setup(ns)
            progress(1)
        time.sleep(0.2)
        after, k1 = _meminfo(), _settled_kmem(src)
        bpf1 = _bpf_maps()
        objs = kernel_objects(names[0])
        if not m.cleanup_by_delete:
            for ns in names:
                m.teardown(ns)
            k2 = _settled_kmem(src)
    finally:
        nsutil.delete(names)
    per: dict[str, float] = {k: round((after[k] - before[k]) / pods, 2)
                             for k in ("Slab", "SUnreclaim", "Percpu") if k in after}
    per["MemAvailable"] = round((before["MemAvailable"] - after["MemAvailable"]) / pods, 2)
    bpf = None if bpf0 is None or bpf1 is None else {k: round((bpf1[k] - bpf0[k]) / pods, 2) for k in bpf0}
    kib = (lambda a, b: None if a is None or b is None else round((b - a) / pods / 1024, 2))  # noqa: E731
    return {"pods": pods, "kmem_source": src, "kmem_kib_per_pod": kib(k0, k1),
            "kmem_freed_kib_per_pod": kib(k2, k1), "kib_per_pod": per, "kernel_objects_one_pod": objs,
            "bpf_map_entries_per_pod": None if bpf is None else bpf["entries"],
            "bpf_map_bytes_per_pod": None if bpf is None else bpf["bytes"]}
