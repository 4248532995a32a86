"""``python -m benches``: discover what can run, measure it, write results/ (JSON, Markdown, PNG)."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
from typing import Any

from . import agentmem, cnithin, nsutil, podcost, podstart, report
from .methods import Method, Unavailable, api_method, cli_method, cni_method, forwarding_method, reference_method

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("sidecar", "ambient")
ALIASES = ("auto",)
EXTRA_BACKENDS = ("ebpf",)

PROFILES: dict[str, dict[str, Any]] = {
    #           per-pod samples, scale levels, samples per level, memory pods, datapath rounds/seconds/max/bulk
    # pod_starts: pod starts through containerd per case.
    # exec_samples: pods per exec'd method (redirect init, redirect-cni), which cost a process start each.
    # focus: exec'd methods, scale and memory only for sidecar mode and the non-variant backends.
    "full": dict(samples=50, exec_samples=20, levels=[1, 10, 100, 1000], level_samples=20, mem_pods=100,
                 rounds=10, seconds=2.0, max_conns=200_000, bulk_seconds=1.0, focus=False, concurrent_pods=100,
                 pod_starts=10),
    "quick": dict(samples=15, exec_samples=4, levels=[1, 10, 100], level_samples=8, mem_pods=100,
                  rounds=5, seconds=0.5, max_conns=50_000, bulk_seconds=0.2, focus=True, concurrent_pods=100,
                  pod_starts=5),
    "tiny": dict(samples=3, exec_samples=2, levels=[1, 3], level_samples=2, mem_pods=3,
                 rounds=1, seconds=0.2, max_conns=2_000, bulk_seconds=0.1, focus=True, concurrent_pods=10,
                 pod_starts=1),
}
#: Variants of the iptables backend: in focused runs they get the in-process per-pod figure only.
VARIANTS = ("iptables-legacy", "iptables-nft")
#: How long ``--pause-at`` waits for a signal before the run goes on.
PAUSE_MAX_S = 600
PHASES = ("per_pod", "cli", "cni", "cni_thin", "cni_concurrent", "pod_start", "scale", "memory", "agent_memory",
          "datapath")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benches", description=__doc__)
    p.add_argument("--quick", action="store_true", help="under two minutes: fewer samples, N up to 100 "
                   "(the full run: N up to 1000, every mode through every entry point)")
    p.add_argument("--tiny", action="store_true", help="seconds; for the smoke test (numbers meaningless)")
    p.add_argument("--backends", help="comma list (default: redirect.backends.BACKENDS without the 'auto' alias, "
                   "plus ebpf)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of modes to try (default: %(default)s)")
    p.add_argument("--skip", default="", help=f"comma list of phases to skip: {', '.join(PHASES)}")
    p.add_argument("--pod-addresses", choices=nsutil.POD_ADDRESSES, default="none",
                   help="what each fresh pod netns has besides lo when setup runs: none (the default), v4 (an eth0 "
                   "with an IPv4 address), dual (IPv4 and IPv6; the sidecar plan then adds ::6 to lo too)")
    p.add_argument("--levels", help="comma list of N for the scale phase (overrides the profile)")
    p.add_argument("--samples", type=int, help="fresh pods per method (overrides the profile)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="output directory (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--pause-at", metavar="PHASE:N", help="stop once a phase whose name starts with PHASE (as the "
                   "progress bar names it, e.g. 'scale ebpf/sidecar') has done N steps, write OUT/paused and wait "
                   f"for a signal (at most {PAUSE_MAX_S} s): to interrupt a run at a known point")
    args = p.parse_args(argv)
    if args.pause_at is not None:
        phase, _, n = args.pause_at.rpartition(":")
        if not phase or not n.isdigit():
            p.error(f"--pause-at={args.pause_at!r}: expected PHASE:N")
        args.pause_at = (phase, int(n))
    return args


def _host() -> dict[str, Any]:
    """The hardware and software a run measures: CPU model and cores, kernel, Python, iptables."""
    ipt = subprocess.run(["iptables", "--version"], capture_output=True, text=True).stdout.strip()
    cpu = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu_model": cpu,
            "python": platform.python_version(), "iptables": ipt, "machine": platform.machine()}


def _command(argv: list[str] | None) -> str:
    """How this run was started: ``$REDIRECT_BENCH_COMMAND`` (``make bench`` sets it), else the
    module's command line."""
    args = sys.argv[1:] if argv is None else argv
    return os.environ.get("REDIRECT_BENCH_COMMAND") or " ".join(["python -m benches", *args])


class Bar:
    """The progress bar, and the run's phase: its name and the steps done in it. ``pause_at``
    (``(phase prefix, steps)``, ``--pause-at``) stops the run once a phase of that prefix has done
    that many steps: ``<out>/paused`` says where, and the run waits for a signal (at most
    ``PAUSE_MAX_S``), so a test can interrupt it at a known point, whatever the machine's speed."""

    def __init__(self, total: int, enabled: bool, pause_at: tuple[str, int] | None = None,
                 out: str = ".") -> None:
        self.bar: Any = None
        self.name, self.done = "", 0
        self.pause_at, self.out = pause_at, out
        if enabled:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)
        self.done += n
        if self.pause_at is not None and self.name.startswith(self.pause_at[0]) and self.done >= self.pause_at[1]:
            self.pause_at = None  # once
            self._pause()

    def _pause(self) -> None:
        os.makedirs(self.out, exist_ok=True)
        marker = os.path.join(self.out, "paused")
        with open(marker + ".tmp", "w") as f:
            f.write(f"{self.name}: {self.done}\n")
        os.replace(marker + ".tmp", marker)
        print(f"benches: paused in {self.name!r} after {self.done} steps (--pause-at); waiting for a signal",
              file=sys.stderr)
        deadline = time.monotonic() + PAUSE_MAX_S
        while time.monotonic() < deadline:  # a signal (SIGINT: KeyboardInterrupt) ends it
            time.sleep(0.05)

    def phase(self, name: str) -> None:
        self.name, self.done = name, 0
        if self.bar is not None:
            self.bar.set_description(name)

    def note(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(f"note: {msg}", file=sys.stderr)
        else:
            print(f"note: {msg}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def discover(backends: list[str], modes: list[str], skip: set[str], notes: list[str],
             skipped: dict[str, str], focus: bool) -> tuple[list[Method], list[Method], list[Method]]:
    """(reference + in-process methods, exec'd methods, api methods for scale/memory).

    Anything unavailable becomes a note; nothing here raises for a backend being written."""
    from redirect.errors import BackendUnavailable

    per_pod: list[Method] = []
    for kind in ("sidecar", "core", "ambient"):
        if kind == "ambient" and "ambient" not in modes:
            continue
        ref = reference_method(kind)
        podcost.warm_and_verify(ref)
        per_pod.append(ref)
    execd: list[Method] = []
    api: list[Method] = []
    for b in backends:
        if b == "ebpf":
            try:
                from redirect.backends import ebpf

                t0 = time.perf_counter()
                h = ebpf.host()
                if h is not None and getattr(h, "compiled", False):
                    notes.append(f"ebpf: host programs compiled, loaded and attached once in "
                                 f"{(time.perf_counter() - t0) * 1e3:.0f} ms (per host, not per pod; not timed below)")
            except Exception:  # noqa: BLE001 - the per-pod warm-up below records the error
                pass
        for mode in modes:
            m = api_method(b, mode)
            try:
                podcost.warm_and_verify(m)
            except BackendUnavailable as e:
                if mode == "sidecar":
                    skipped[b] = f"BackendUnavailable: {e}"
                    notes.append(f"backend {b}: skipped (BackendUnavailable: {e})")
                    break
                notes.append(f"{b} {mode}: skipped (BackendUnavailable: {e})")
                continue
            except Exception as e:  # noqa: BLE001 - a backend being written must not stop the bench
                msg = f"{type(e).__name__}: {e}"
                if mode == "sidecar":
                    skipped[b] = msg
                    notes.append(f"backend {b}: skipped (setup failed: {msg})")
                    break
                notes.append(f"{b} {mode}: skipped (not available yet: {msg})")
                continue
            per_pod.append(m)
            if b == "ebpf" and mode == "sidecar":  # its tc filters, where a pod forwards
                try:
                    fwd = forwarding_method(b)
                    podcost.warm_and_verify(fwd)
                    per_pod.append(fwd)
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{b} sidecar-forwarding: skipped ({type(e).__name__}: {e})")
            if focus and (b in VARIANTS or mode != "sidecar"):
                continue
            api.append(m)
            for kind, factory in (("cli", cli_method), ("cni", cni_method)):
                if kind in skip:
                    continue
                try:
                    other = factory(b, mode)
                    podcost.warm_and_verify(other)
                except Unavailable as e:
                    note = f"{kind}: skipped ({e})"
                    if note not in notes:
                        notes.append(note)
                    continue
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{kind} {b} {mode}: skipped ({type(e).__name__}: {e})")
                    continue
                execd.append(other)
            if mode == "sidecar" and "cni_thin" not in skip:
                # cheap enough to take the in-process methods' sample count
                try:
                    thin = cnithin.thin_method(b, mode)
                    podcost.warm_and_verify(thin)
                    per_pod.append(thin)
                except Unavailable as e:
                    if (note := f"cni_thin: skipped ({e})") not in notes:
                        notes.append(note)
                except Exception as e:  # noqa: BLE001
                    notes.append(f"cni_thin {b} {mode}: skipped ({type(e).__name__}: {e})")
    if focus:
        notes.append("focused run: redirect init / redirect-cni, scale and memory measured for sidecar mode and "
                     f"the non-variant backends only (not {', '.join(VARIANTS)}; a full run does all)")
    return per_pod, execd, api


def _scratch_bpf_root() -> str:
    """The eBPF backend's host programs go to a root of this run's own (unless REDIRECT_BPF_ROOT
    says where), removed at the end: a bench never touches the host's /sys/fs/bpf/redirect."""
    if os.environ.get("REDIRECT_BPF_ROOT"):
        return f"ebpf: host programs under REDIRECT_BPF_ROOT={os.environ['REDIRECT_BPF_ROOT']} (left loaded)"
    root = f"/sys/fs/bpf/rdrt-bench-{os.getpid()}"
    os.environ["REDIRECT_BPF_ROOT"] = root  # inherited by redirect init / redirect-cni

    def unload() -> None:
        from redirect.backends import ebpf
        from redirect.errors import SetupError

        try:
            ebpf.unload_host(root)
        except SetupError:  # pods still registered (an interrupted run): their namespaces are gone
            ebpf.force_unload_host(root)
        if os.path.exists(root):
            raise RuntimeError(f"BPF pins left under {root}")

    nsutil.at_cleanup(unload)
    return f"ebpf: host programs go to a scratch root {root}, removed at the end"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("benches: must run as root (namespaces, netfilter, BPF)", file=sys.stderr)
        return 1
    prof = dict(PROFILES["tiny" if args.tiny else "quick" if args.quick else "full"])
    if args.levels:
        prof["levels"] = [int(x) for x in args.levels.split(",") if x]
    if args.samples:
        prof["samples"] = args.samples
    prof["pod_addresses"] = nsutil.pod_addresses = args.pod_addresses
    skip = {s for s in args.skip.split(",") if s}
    from redirect.backends import BACKENDS

    # "auto" is an alias (it picks nftables or iptables): measured only when asked for by name.
    # eBPF is not in that tuple (get_backend still knows it): measured by default all the same.
    default = [b for b in BACKENDS if b not in ALIASES] + [b for b in EXTRA_BACKENDS if b not in BACKENDS]
    backends = [b for b in (args.backends.split(",") if args.backends else default) if b]
    # Failures are recorded in the results; the library's own warnings would only break the bar.
    logging.getLogger("redirect").setLevel(logging.CRITICAL)
    modes = [m for m in args.modes.split(",") if m]
    nsutil.install_handlers()
    t_start = time.time()
    notes: list[str] = []
    if "ebpf" in backends:
        notes.append(_scratch_bpf_root())
    skipped: dict[str, str] = {}
    res: dict[str, Any] = {"schema": "redirect-bench/1",
                           "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "profile": "tiny" if args.tiny else "quick" if args.quick else "full",
                           "quick": bool(args.quick or args.tiny), "command": _command(argv), "host": _host(),
                           "backends": backends,
                           "settings": prof, "notes": notes, "skipped_backends": skipped,
                           "per_pod": {}, "cni_concurrent": {}, "pod_start": {}, "scale": {}, "memory": {},
                           "agent_memory": {}, "datapath": {}}
    bar: Bar | None = None
    try:
        print("benches: discovering backends and entry points ...", file=sys.stderr)
        methods, execd, api = discover(backends, modes, skip, notes, skipped, prof["focus"])
        exec_samples = min(prof["exec_samples"], prof["samples"])
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        scale_methods = [methods[0], *api]
        thin_all = [m for m in methods if m.key.startswith("cni-thin/")]
        thin = thin_all if "cni_concurrent" not in skip else []
        sidecar_api = [m for m in api if m.mode == "sidecar"]
        levels = prof["levels"]
        total = (2 * (prof["samples"] * len(methods) + exec_samples * len(execd)) if "per_pod" not in skip else 0)
        total += (len(scale_methods) * (max(levels) - 1 + prof["level_samples"] * len(levels))
                  if "scale" not in skip else 0)
        total += len(scale_methods) * prof["mem_pods"] if "memory" not in skip else 0
        # The data path in ambient mode too, where eBPF has a target (0.95 of direct in both modes).
        ambient_dp = [m.backend for m in methods if m.key == "api/ebpf/ambient"]
        n_cases = 2 + len(sidecar_api) + len(ambient_dp)
        total += n_cases * (1 + prof["rounds"]) if "datapath" not in skip else 0
        total += len(thin)
        start_backends = [m.backend for m in thin_all]
        n_starts = len(podstart._cases(start_backends)) * prof["pod_starts"] if "pod_start" not in skip else 0
        total += n_starts
        # The agent's resident memory per default backend: eBPF's against iptables' (the reference).
        agent_backends = ([b for b in (agentmem.REFERENCE, *agentmem.TARGET_MIB) if b in backends and b not in skipped]
                          if "agent_memory" not in skip else [])
        total += len(agent_backends)
        bar = Bar(total, not args.no_progress, args.pause_at, args.out)
        failed: dict[str, str] = {}
        if "per_pod" not in skip:
            bar.phase("per-pod")
            res["per_pod"] = podcost.per_pod(methods, prof["samples"], bar, failed)
            if execd:
                bar.phase("per-pod (exec)")
                res["per_pod"].update(podcost.per_pod(execd, exec_samples, bar, failed))
            for k, why in failed.items():
                bar.note(f"{k}: {why}")
        for m in thin:
            bar.phase(f"{prof['concurrent_pods']} concurrent ADDs {m.backend}")
            try:
                res["cni_concurrent"][m.key] = cnithin.concurrent_adds(m, prof["concurrent_pods"])
            except Exception as e:  # noqa: BLE001
                bar.note(f"concurrent ADDs {m.key}: {e}")
                res["cni_concurrent"][m.key] = {"error": str(e)}
            bar(1)
        if n_starts:
            bar.phase("pod start through containerd")
            try:
                res["pod_start"] = podstart.run(start_backends, prof["pod_starts"], bar)
            except Exception as e:  # noqa: BLE001 - recorded; the run goes on
                bar.note(f"pod start through containerd: {e}")
                res["pod_start"] = {"error": str(e)}
        if "scale" not in skip:
            for m in scale_methods:
                bar.phase(f"scale {m.backend}/{m.mode}")
                try:
                    res["scale"][m.key] = podcost.scale(m, levels, prof["level_samples"], bar)
                except Exception as e:  # noqa: BLE001
                    bar.note(f"scale {m.key}: {e}")
                    res["scale"][m.key] = {"levels": {}, "error": str(e)}
        if "memory" not in skip:
            for m in scale_methods:
                bar.phase(f"memory {m.backend}/{m.mode}")
                try:
                    res["memory"][m.key] = podcost.memory(m, prof["mem_pods"], bar)
                except Exception as e:  # noqa: BLE001
                    bar.note(f"memory {m.key}: {e}")
                    res["memory"][m.key] = {"error": str(e)}
        if agent_backends:
            bar.phase("agent memory")
            res["agent_memory"] = agentmem.run(agent_backends, prof["mem_pods"], bar)
        if "datapath" not in skip:
            from . import datapath

            bar.phase("data path")
            res["datapath"] = datapath.run([m.backend for m in sidecar_api], prof["rounds"], prof["seconds"],
                                           prof["max_conns"], prof["bulk_seconds"], bar, notes, ambient_dp)
    except KeyboardInterrupt:
        print("\nbenches: interrupted; cleaning up (partial results are written)", file=sys.stderr)
        notes.append("interrupted: partial results")
    finally:
        if bar is not None:
            bar.close()
        nsutil.cleanup()
    res["elapsed_s"] = round(time.time() - t_start, 1)
    res["ratios"] = report.ratios(res)
    res["targets"] = report.targets(res, res["ratios"])
    write(res, args.out, plots=not args.no_plots)
    return 130 if "interrupted: partial results" in notes else 0


def write(res: dict[str, Any], outdir: str, plots: bool) -> None:
    os.makedirs(outdir, exist_ok=True)
    stamp = res["started"].replace(":", "").replace("-", "")
    files = [os.path.join(outdir, f"bench-{res['profile']}-{stamp}.json"), os.path.join(outdir, "latest.json")]
    for path in files:
        with open(path, "w") as f:
            json.dump(res, f, indent=1, sort_keys=False, default=str)
    md = report.markdown(res)
    with open(os.path.join(outdir, "summary.md"), "w") as f:
        f.write(md)
    made = []
    if plots:
        try:
            made = report.plots(res, outdir)
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the pictures
            print(f"benches: plots failed: {e}", file=sys.stderr)
    print(md)
    print(f"benches: wrote {', '.join(files + [os.path.join(outdir, 'summary.md')] + made)}", file=sys.stderr)
