"""The benchmark harness runs end to end in a tiny mode, writes its schema, computes its ratios,
and leaves no namespace, process or BPF pin behind, even when interrupted. Nothing here asserts
a timing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benches import podstart, publish, report

ROOT = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the harness creates network namespaces: needs root")


def _ours(pid: int) -> list[str]:
    try:
        return [n for n in os.listdir("/run/netns") if n.startswith(f"rdrt-b{pid}-")]
    except FileNotFoundError:
        return []


def _procs(pid: int, name: str = "") -> list[int]:
    """Live processes the harness run ``pid`` started (it marks them with RDRT_BENCH_OWNER)."""
    mark, out = f"RDRT_BENCH_OWNER={pid}".encode(), []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == pid:
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read().split(b"\0")
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if mark in env and name in comm:
            out.append(int(p))
    return out


def _left_behind(pid: int) -> list[str]:
    left = [f"netns {n}" for n in _ours(pid)] + [f"process {p}" for p in _procs(pid)]
    root = f"/sys/fs/bpf/rdrt-bench-{pid}"
    return left + ([f"bpf pins {root}"] if os.path.exists(root) else [])


def _stop_and_sweep(proc: subprocess.Popen[bytes]) -> None:
    """After a failed test: the run stopped the way that cleans up (SIGTERM, bounded), only then
    killed, and whatever of it is still left removed (its namespaces, processes, BPF pins)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    for p in _procs(proc.pid):
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    for name in _ours(proc.pid):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    root = f"/sys/fs/bpf/rdrt-bench-{proc.pid}"
    if os.path.exists(root):
        from redirect.backends import ebpf

        ebpf.force_unload_host(root)


def _bench(out: Path, *extra: str, backends: str = "iptables") -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "REDIRECT_BPF_ROOT"}  # the run's own scratch root
    return subprocess.Popen(
        [sys.executable, "-m", "benches", "--tiny", "--backends", backends, "--samples", "2",
         "--no-progress", "--out", str(out), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )


@needs_root
def test_tiny_run_writes_json_markdown_plots_and_ratios(tmp_path: Path) -> None:
    proc = _bench(tmp_path, backends="iptables,ebpf")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert not _left_behind(proc.pid), "the harness left these behind"

    res = json.loads((tmp_path / "latest.json").read_text())
    assert res["schema"] == "redirect-bench/1"
    assert res["profile"] == "tiny"
    for key in ("host", "settings", "notes", "per_pod", "scale", "memory", "datapath", "ratios", "targets"):
        assert key in res, key
    assert list(tmp_path.glob("bench-tiny-*.json"))

    ref = res["per_pod"][report.REFERENCE_KEY]
    api = res["per_pod"]["api/iptables/sidecar"]
    for entry in (ref, api):
        for phase in ("setup", "teardown"):
            st = entry[phase]
            assert st["n"] == 2
            assert 0 < st["min_ms"] <= st["median_ms"] <= st["p99_ms"]

    r = res["ratios"]
    want = api["setup"]["median_ms"] / ref["setup"]["median_ms"]
    assert r["setup_vs_reference"]["api/iptables/sidecar"] == pytest.approx(want, rel=1e-3)
    assert "api/iptables/sidecar" in r["teardown_vs_reference"]
    cases = res["datapath"]["cases"]
    assert {"direct", "reference", "iptables"} <= set(cases), res["notes"]
    rounds = zip(cases["iptables"]["runs"]["crr"], cases["direct"]["runs"]["crr"], strict=True)
    assert r["conn_rate_vs_direct"]["iptables"] == pytest.approx(
        statistics.median(a["conn_per_s"] / b["conn_per_s"] for a, b in rounds), rel=1e-3)
    assert "iptables" in r["conn_rate_vs_reference"]
    assert "ebpf/ambient" in cases and "ebpf/ambient" in r["conn_rate_vs_direct"], res["notes"]
    # The pairing floor paired: both ends of every connection joined, the sends went to the peer.
    floor = cases[report.FLOOR_CASE]
    conns = sum(run["count"] for run in floor["runs"]["crr"])
    assert floor["pairing"]["joined"] >= 2 * conns > 0, floor["pairing"]
    assert floor["pairing"]["redirected"] >= 2 * conns, floor["pairing"]  # (each request and each reply)
    assert floor["pairing"]["no_peer"] * 100 <= floor["pairing"]["redirected"], floor["pairing"]
    assert r["sockmap_vs_direct"]["floor_conn_rate"] > 0
    for c in cases.values():  # request/response on any CPU, and on one
        assert len(c["runs"]["rr1"]) == len(c["runs"]["rr"]) > 0 and c["rr1_p50_us"] > 0, c
    assert r["nth_vs_first"]["api/iptables/sidecar"]["n"] == 3
    assert set(res["scale"]["api/iptables/sidecar"]["levels"]) == {"1", "3"}
    assert res["scale"]["api/iptables/sidecar"]["warm_up"] == 3  # untimed, before the first level
    # Beside each level's samples, the machine's speed (a fixed workload), taken out of the ratio.
    ctl = [lv["control"]["median_ms"] for lv in res["scale"]["api/iptables/sidecar"]["levels"].values()]
    assert len(ctl) == 2 and min(ctl) > 0, res["scale"]["api/iptables/sidecar"]["levels"]
    d = r["nth_vs_first"]["api/iptables/sidecar"]
    assert d["ratio"] == pytest.approx(d["raw"] / d["machine"], rel=1e-3)
    mem = res["memory"]["api/iptables/sidecar"]
    assert mem["kernel_objects_one_pod"]["iptables_nft_rules"] > 0
    assert mem["kmem_source"] is None or isinstance(mem["kmem_kib_per_pod"], float | int), mem
    assert "kmem_freed_kib_per_pod" in mem and "Slab" in mem["kib_per_pod"]

    # eBPF (being changed concurrently) is either measured or its error recorded, never a crash.
    if "api/ebpf/sidecar" in res["per_pod"]:
        e, mem = res["per_pod"]["api/ebpf/sidecar"], res["memory"]["api/ebpf/sidecar"]
        assert e.get("error") or (e["setup"]["n"] == 2 and "api/ebpf/sidecar" in r["setup_vs_reference"])
        assert mem.get("error") or mem["bpf_map_entries_per_pod"] > 0
        assert "ebpf" in cases, res["notes"]  # measured, or {"error": ...}
        if not e.get("error"):  # where its setups went, step by step (the fresh-pod call's own times)
            steps = e["steps_us"]
            assert steps["n"] == 2 and steps["call"] > 0 and steps["open"] > 0 and "outside" in steps, steps
            assert "## Where a fresh pod's eBPF setup goes" in (tmp_path / "summary.md").read_text()
    else:
        assert res["skipped_backends"]["ebpf"], res["notes"]
        ebpf_row = next(t for t in res["targets"] if t["name"] == "ebpf: per-pod setup vs reference")
        assert ebpf_row["status"] == "n/a" and ebpf_row["note"] == res["skipped_backends"]["ebpf"]

    # The thin CNI plugin through the run's own agent: timed per pod, and pods started at once
    # with every ADD answered and every pod captured (the tiny profile starts 10).
    thin = res["per_pod"]["cni-thin/iptables/sidecar"]
    assert thin["setup"]["n"] == 2 and thin["teardown"]["n"] == 2, thin
    assert "cni-thin/iptables/sidecar" in r["setup_vs_reference"]
    burst = res["cni_concurrent"]["cni-thin/iptables/sidecar"]
    assert burst["pods"] == 10 and burst["add"]["n"] == 10, burst
    assert (burst["add"]["errors"], burst["add"]["not_captured"], burst["del"]["errors"]) == (0, 0, 0), burst
    assert any(t["name"] == "cni-thin/iptables/sidecar: 10 concurrent ADDs, errors or uncaptured pods"
               and t["status"] == "PASS" for t in res["targets"]), res["targets"]
    assert "## CNI: pods started at once" in (tmp_path / "summary.md").read_text()

    # Whole pod starts through containerd: the reference plugins alone, then with ours.
    starts = res["pod_start"]["cases"]
    assert {podstart.BASELINE, "thin plugin + agent, iptables", "Python plugin, iptables"} <= set(starts), starts
    for name, c in starts.items():
        assert (c["n"], c["errors"]) == (1, 0), (name, c)
    assert starts[podstart.BASELINE]["added_ms"] == 0
    assert "## Pod start and stop through containerd" in (tmp_path / "summary.md").read_text()

    assert res["targets"] and {t["status"] for t in res["targets"]} <= {"PASS", "FAIL", "n/a"}
    assert any(t["name"].startswith("iptables: per-pod setup") for t in res["targets"])
    md = (tmp_path / "summary.md").read_text()
    assert "| target | wanted | measured | status | note |" in md and "api/iptables/sidecar" in md
    for png in ("setup.png", "scale.png", "datapath.png"):
        assert (tmp_path / png).stat().st_size > 1000

    # The results file says how it was run and on what; the published page is rendered from it.
    assert res["command"].startswith("python -m benches --tiny") and res["host"]["cpus"] == os.cpu_count()
    assert res["host"]["cpu_model"] != "?" and res["host"]["kernel"] == os.uname().release
    page = publish.markdown(publish.figures(res, str(tmp_path / "latest.json")))
    assert f"`{res['command']}` (tiny profile)" in page and res["host"]["cpu_model"] in page
    assert f"{os.cpu_count()} cores" in page and f"kernel {os.uname().release}" in page
    row = next(line for line in page.splitlines() if line.startswith("| iptables (API) |"))
    assert row.split(" | ")[1] == report._fmt(api["setup"]["median_ms"]), row
    assert publish.embedded(page) == publish.figures(res, str(tmp_path / "latest.json"))


@needs_root
def test_interrupt_deletes_every_namespace_and_writes_partial_results(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--skip", "cli,cni,datapath")
    deadline = time.monotonic() + 30
    while not _ours(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert _ours(proc.pid), "the harness never created a namespace"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), err.decode()[-2000:]
    assert not _left_behind(proc.pid), "left after Ctrl-C"
    assert json.loads((tmp_path / "latest.json").read_text())["schema"] == "redirect-bench/1"


@needs_root
def test_terminate_during_the_data_path_stops_the_proxies_and_deletes_the_pods(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--skip", "per_pod,cli,cni,scale,memory")
    deadline = time.monotonic() + 40
    while not _procs(proc.pid, "rdrt_echo") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert _procs(proc.pid, "rdrt_echo"), "the harness never started its echo proxy"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert not _left_behind(proc.pid), "left after SIGTERM"
    res = json.loads((tmp_path / "latest.json").read_text())
    assert "interrupted: partial results" in res["notes"]


@pytest.mark.noroot
def test_the_published_figures_are_a_rendering_of_one_results_file() -> None:
    """``docs/benchmarks-results.md`` is what ``benches.publish`` wrote from a results file (it says
    which run: command, hardware), unedited; ``docs/benchmarks.md`` holds no figures of a run."""
    page = (ROOT / "docs" / "benchmarks-results.md").read_text()
    fig = publish.embedded(page)
    assert fig is not None and page == publish.markdown(fig), "edited by hand: run `make bench` again"
    assert fig["command"].startswith(("make bench", "python -m benches")) and fig["host"]["cores"]
    assert fig["host"]["cpu"] and fig["host"]["kernel"] and fig["rows"]
    assert not re.search(r"\b20\d\d-\d\d-\d\d", page), "a date of a run in the published page"
    prose = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "benchmarks-results.md" in prose
    assert not [line for line in prose.splitlines() if line.startswith("|")], "a table of a run's figures in the prose"


def _synthetic(setup_ms: dict[str, float], rates: dict[str, float], nth: dict[str, tuple[float, float]]) -> dict:
    per_pod = {k: {"setup": {"median_ms": v}, "teardown": {"median_ms": v}} for k, v in setup_ms.items()}
    scale = {k: {"levels": {"1": {"setup": {"median_ms": a}}, "1000": {"setup": {"median_ms": b}}}}
             for k, (a, b) in nth.items()}
    return {"per_pod": per_pod, "scale": scale, "skipped_backends": {"ebpf": "BackendUnavailable: not built"},
            "datapath": {"cases": {k: {"conn_per_s": v} for k, v in rates.items()}}}


def test_targets_pass_and_fail_from_the_ratios_of_one_run() -> None:
    res = _synthetic(
        {report.REFERENCE_KEY: 10.0, "api/iptables/sidecar": 12.0, "api/nftables/sidecar": 1.5},
        {"direct": 1000.0, "reference": 700.0, "iptables": 690.0, "nftables": 600.0},
        {"api/iptables/sidecar": (10.0, 11.0), "api/nftables/sidecar": (1.0, 2.0)},
    )
    r = report.ratios(res)
    assert r["setup_vs_reference"]["api/nftables/sidecar"] == pytest.approx(0.15)
    assert r["conn_rate_vs_direct"]["reference"] == pytest.approx(0.7)
    assert r["conn_rate_vs_reference"]["nftables"] == pytest.approx(600 / 700, rel=1e-3)
    status = {t["name"]: t["status"] for t in report.targets(res, r)}
    assert status["iptables: per-pod setup vs reference"] == "FAIL"        # 1.2 > 1
    assert status["nftables: per-pod setup vs reference"] == "PASS"        # 0.15 <= 0.2
    assert status["ebpf: per-pod setup vs reference"] == "n/a"             # skipped, said why
    assert status["iptables: connection rate vs Istio's rules"] == "PASS"  # 0.986: within noise
    assert status["nftables: connection rate vs Istio's rules"] == "FAIL"  # 0.857
    assert status["api/iptables/sidecar: pod 1000 setup vs pod 1"] == "PASS"
    assert status["api/nftables/sidecar: pod 1000 setup vs pod 1"] == "FAIL"
    assert "| **FAIL** |" in report.markdown(dict(res, ratios=r, targets=report.targets(res, r)))
    # eBPF's setup target holds in ambient mode too (each mode's row against Istio's sequence), and
    # the 1000th pod's in every mode the scale phase measured.
    res = _synthetic({report.REFERENCE_KEY: 10.0, "api/ebpf/sidecar": 0.09, "api/ebpf/ambient": 0.12}, {},
                     {"api/ebpf/sidecar": (0.1, 0.11), "api/ebpf/ambient": (0.1, 0.13)})
    res["skipped_backends"] = {}
    r = report.ratios(res)
    status = {t["name"]: t["status"] for t in report.targets(res, r)}
    assert status["ebpf: per-pod setup vs reference"] == "PASS"            # 0.009 <= 0.01
    assert status["ebpf: per-pod setup vs reference (ambient)"] == "FAIL"  # 0.012
    assert status["api/ebpf/sidecar: pod 1000 setup vs pod 1"] == "PASS"   # 1.1
    assert status["api/ebpf/ambient: pod 1000 setup vs pod 1"] == "FAIL"   # 1.3
    # With Istio's ambient sequence measured, an ambient pod's setup is judged against it (its
    # teardown still against the sidecar cleanup), and Istio's sidecar sequence without its variant
    # detection is reported beside each eBPF row.
    res = _synthetic({report.REFERENCE_KEY: 50.0, report.AMBIENT_REFERENCE_KEY: 10.0, report.CORE_REFERENCE_KEY: 12.0,
                      "api/ebpf/sidecar": 0.3, "api/ebpf/ambient": 0.3}, {}, {})
    res["skipped_backends"] = {}
    r = report.ratios(res)
    assert r["setup_vs_reference"]["api/ebpf/sidecar"] == pytest.approx(0.006)
    assert r["setup_vs_reference"]["api/ebpf/ambient"] == pytest.approx(0.03)
    assert r["teardown_vs_reference"]["api/ebpf/ambient"] == pytest.approx(0.006)
    assert r["setup_vs_reference"][report.AMBIENT_REFERENCE_KEY] == pytest.approx(0.2)
    rows = {t["name"]: t for t in report.targets(res, r)}
    assert rows["ebpf: per-pod setup vs reference"]["status"] == "PASS"
    assert rows["ebpf: per-pod setup vs reference (ambient)"]["status"] == "FAIL"
    assert "ambient sequence" in rows["ebpf: per-pod setup vs reference (ambient)"]["note"]
    core = rows["ebpf: per-pod setup vs Istio's sidecar sequence without its variant detection"]
    assert core["status"] == "n/a" and core["measured"] == pytest.approx(0.025)


@needs_root
def test_ctrl_c_with_ebpf_pods_registered_removes_the_scratch_bpf_root(tmp_path: Path) -> None:
    """SIGINT while eBPF pods are registered in the run's scratch root: the run stops at a known
    point (``--pause-at``: after its third eBPF fill pod of the scale phase), however fast the
    machine gets there, and then is interrupted; nothing is left, and the partial results say so."""
    proc = _bench(tmp_path, "--skip", "per_pod,cli,cni,memory,datapath", "--levels", "1,300",
                  "--pause-at", "scale ebpf/sidecar:3", backends="ebpf")
    root = f"/sys/fs/bpf/rdrt-bench-{proc.pid}"
    marker = tmp_path / "paused"
    try:
        deadline = time.monotonic() + 300  # bounded: however loaded the machine, then a clear failure
        while not marker.exists():
            assert proc.poll() is None, f"the run ended without pausing: {proc.communicate()[1].decode()[-2000:]}"
            assert time.monotonic() < deadline, "the run did not reach its third eBPF fill pod in 300 s"
            time.sleep(0.05)
        assert marker.read_text() == "scale ebpf/sidecar: 3\n"
        # (its host programs' pins are the run's: not opened here, so nothing of this process holds them)
        assert os.path.isdir(root) and len([n for n in _ours(proc.pid) if "-f" in n]) >= 3, _ours(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err.decode()[-2000:]
        assert not _left_behind(proc.pid), "left after Ctrl-C"
    finally:
        _stop_and_sweep(proc)
    res = json.loads((tmp_path / "latest.json").read_text())
    assert "interrupted: partial results" in res["notes"], res["notes"]


def test_connection_rate_ratios_pair_the_rounds_so_drift_cancels() -> None:
    def case(*rates: float) -> dict:
        return {"conn_per_s": statistics.median(rates), "runs": {"crr": [{"conn_per_s": x} for x in rates]}}

    # The machine slows down round by round; in each round the backend runs at 0.9 of direct.
    res = {"datapath": {"cases": {"direct": case(1000, 500, 250), "reference": case(1000, 500, 250),
                                  "ebpf": case(900, 450, 225)}}}
    r = report.ratios(res)
    assert r["conn_rate_vs_direct"]["ebpf"] == pytest.approx(0.9)
    assert r["conn_rate_vs_reference"]["ebpf"] == pytest.approx(0.9)
    # Without rounds (or with a different count): the ratio of the medians.
    res["datapath"]["cases"]["ebpf"] = {"conn_per_s": 400.0}
    assert report.ratios(res)["conn_rate_vs_direct"]["ebpf"] == pytest.approx(0.8)


def test_sockmap_latency_is_judged_on_one_cpu_and_reported_on_any() -> None:
    def case(rr: float, rr1: float) -> dict:
        return {"conn_per_s": 1000.0, "runs": {"crr": [{"conn_per_s": 1000.0}], "bulk": [{"gbit_per_s": 2.0}],
                                               "rr": [{"p50_us": rr, "p99_us": 2 * rr}],
                                               "rr1": [{"p50_us": rr1, "p99_us": 2 * rr1}]}}

    res = {"datapath": {"cases": {"direct": case(50, 14), "ebpf": case(50, 14), "ebpf/sockmap": case(45, 8)}}}
    rows = {t["name"]: t for t in report.targets(res, report.ratios(res))}
    judged = rows["ebpf/sockmap: 64 B request/response p50, one CPU vs direct (plain loopback TCP)"]
    assert (judged["measured"], judged["status"]) == (pytest.approx(8 / 14, rel=1e-3), "PASS")
    shown = rows["ebpf/sockmap: 64 B request/response p50, any CPU vs direct (plain loopback TCP)"]
    assert (shown["measured"], shown["status"], shown["target"]) == (0.9, "n/a", "reported")
    res["datapath"]["cases"]["ebpf/sockmap"] = case(30, 13)  # fast on any CPU, slow on one: FAIL
    rows = {t["name"]: t for t in report.targets(res, report.ratios(res))}
    assert rows["ebpf/sockmap: 64 B request/response p50, one CPU vs direct (plain loopback TCP)"]["status"] == "FAIL"


@needs_root
@pytest.mark.parametrize("kind", ["v4", "dual"])
def test_pod_addresses_give_each_fresh_namespace_its_own(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pod-addresses``: each namespace the harness makes gets an eth0 with addresses no other
    namespace of the run has (the eBPF backend registers pod addresses host-wide)."""
    from benches import nsutil

    monkeypatch.setattr(nsutil, "pod_addresses", kind)
    names = nsutil.create(2, "t")
    try:
        seen = []
        for n in names:
            out = subprocess.run(["ip", "-n", n, "-o", "addr", "show", "dev", "eth0", "scope", "global"],
                                 capture_output=True, text=True, check=True).stdout
            addrs = [line.split()[3] for line in out.splitlines()]
            assert sorted(a.count(":") > 0 for a in addrs) == ([False] if kind == "v4" else [False, True]), out
            seen += addrs
        assert len(set(seen)) == len(seen)
    finally:
        nsutil.delete(names)
    assert not set(names) & set(os.listdir("/run/netns"))


@needs_root
def test_a_run_with_dual_stack_pods_says_so(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--pod-addresses", "dual", "--skip", "cli,cni,scale,memory,datapath",
                  backends="iptables,ebpf")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert not _left_behind(proc.pid), "the harness left these behind"
    res = json.loads((tmp_path / "latest.json").read_text())
    assert res["settings"]["pod_addresses"] == "dual"
    for key in ("api/iptables/sidecar", "api/ebpf/sidecar"):
        assert res["per_pod"][key]["setup"]["n"] == 2, res["per_pod"][key]
    assert "an IPv4 and an IPv6 address" in (tmp_path / "summary.md").read_text()


@needs_root
def test_echo_proxy_must_be_the_process_the_data_path_pins(tmp_path: Path) -> None:
    """``rr 1 CPU`` pins the echo proxy by the pid it started: a pid that runs something else (as a
    wrapper would, or an ``ip netns exec`` that forked) is refused and stopped, and the real one
    is accepted."""
    from benches import datapath, nsutil

    exe = datapath.build()["rdrt_echo"]
    wrapper = tmp_path / "rdrt_echo"
    wrapper.write_text("#!/bin/sh\necho ready\nexec sleep 30\n")  # (the pid then runs sleep)
    wrapper.chmod(0o755)
    (pod,) = nsutil.create(1, "e")
    try:
        with pytest.raises(RuntimeError, match="could not be pinned"):
            datapath.start_echo(str(wrapper), pod, 30)
        p = datapath.start_echo(exe, pod, 30)
        try:
            assert os.path.basename(os.readlink(f"/proc/{p.pid}/exe")) == "rdrt_echo"
        finally:
            nsutil.stop(p)
    finally:
        nsutil.delete([pod])


def test_the_nth_pods_ratio_takes_out_the_machines_own_change_of_speed() -> None:
    # Pod 1000 took 1.5 times pod 1, while the fixed workload timed beside the samples took 1.25
    # times as long as it did beside pod 1's: the machine was slower, the setup grew by 1.2.
    res = _synthetic({}, {}, {"api/iptables/sidecar": (10.0, 15.0), "api/nftables/sidecar": (2.0, 3.0)})
    levels = res["scale"]["api/iptables/sidecar"]["levels"]
    levels["1"]["control"], levels["1000"]["control"] = {"median_ms": 0.4}, {"median_ms": 0.5}
    r = report.ratios(res)
    d = r["nth_vs_first"]["api/iptables/sidecar"]
    assert (d["raw"], d["machine"], d["ratio"]) == (1.5, 1.25, 1.2)
    assert r["nth_vs_first"]["api/nftables/sidecar"] == {"n": 1000, "ratio": 1.5}  # no control measured
    rows = {t["name"]: t for t in report.targets(res, r)}
    row = rows["api/iptables/sidecar: pod 1000 setup vs pod 1"]
    assert row["status"] == "PASS" and "1.5 before taking out" in row["note"] and "(1.25)" in row["note"], row
    assert rows["api/nftables/sidecar: pod 1000 setup vs pod 1"]["status"] == "FAIL"


def test_the_pairing_floor_is_reported_only_when_its_programs_paired() -> None:
    def case(rate: float) -> dict:
        return {"conn_per_s": rate, "runs": {"crr": [{"conn_per_s": rate}]}}

    floor = dict(case(960.0), pairing={"joined": 20, "redirected": 20, "no_peer": 0})
    res = {"datapath": {"cases": {"direct": case(1000.0), "reference": case(1000.0), "ebpf": case(950.0),
                                  "ebpf/sockmap": case(900.0), report.FLOOR_CASE: floor}}}
    r = report.ratios(res)
    assert r["sockmap_vs_direct"]["floor_conn_rate"] == pytest.approx(0.96)
    assert r["sockmap_vs_direct"]["conn_rate_bound"] == pytest.approx(0.95 * 0.96, rel=1e-3)
    assert report.FLOOR_CASE not in r["conn_rate_vs_reference"]  # (it has no capture to compare)
    rows = {t["name"]: t for t in report.targets(res, r)}
    failed = rows["ebpf/sockmap: connection rate vs direct"]
    assert failed["status"] == "FAIL" and "the least pairing alone 0.96" in failed["note"], failed
    # Programs that paired nothing measured plain TCP: no floor, and no row claims one.
    floor["pairing"]["redirected"] = 0
    r = report.ratios(res)
    assert "floor_conn_rate" not in r["sockmap_vs_direct"]
    assert not [t for t in report.targets(res, r) if report.FLOOR_CASE in t["name"]]
