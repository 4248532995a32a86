"""Ratios, targets (PASS/FAIL), the Markdown summary and the PNG plots."""

from __future__ import annotations

import os
import statistics
from typing import Any

from .podcost import REQUIRED_STEPS
from .reference import KEYS as REFERENCE_KEYS

#: The benchmark's targets. Setup: backend median / reference median. Connection rate: vs direct (eBPF)
#: or vs Istio's rules (netfilter backends). Scale: Nth pod's median setup / first pod's.
#: The eBPF backend's per-pod setup against the iptables backend's, in the same run.
EBPF_VS_IPTABLES = 1 / 50
SETUP_TARGETS = {"nftables": 1 / 5, "ebpf": 1 / 100, "iptables": 1.0, "iptables-legacy": 1.0, "iptables-nft": 1.0}
#: The modes each backend's setup target holds for (sidecar where not named), each against Istio's sequence.
SETUP_TARGET_MODES = {"ebpf": ("sidecar", "ambient")}
RATE_VS_DIRECT = {"ebpf": 0.95, "ebpf/ambient": 0.95, "ebpf/sockmap": 0.95}
#: ``ebpf/sockmap`` (the app <-> proxy hop over a sockmap) against plain loopback TCP (``direct``), in
#: the same run, each figure as (the runs it is read from, their field, its name, its goal):
#: 64-byte request/response p50 and p99 on an established connection, the client and the proxy on
#: one CPU (``rr1``: the hop's latency; at most), bulk throughput (at least); a goal of ``None``:
#: reported, not judged (``rr``: the same with both free to run on any CPU, where the wake-up of a
#: task on another CPU, the same for both cases, is most of the figure on a virtual machine).
SOCKMAP_VS_DIRECT: dict[str, tuple[str, str, str, tuple[str, float] | None]] = {
    "rr1_p50_us": ("rr1", "p50_us", "64 B request/response p50, one CPU", ("<=", 0.85)),
    "rr1_p99_us": ("rr1", "p99_us", "64 B request/response p99, one CPU", ("<=", 1.0)),
    "bulk_gbit_per_s": ("bulk", "gbit_per_s", "bulk throughput", (">=", 1.0)),
    "rr_p50_us": ("rr", "p50_us", "64 B request/response p50, any CPU", None),
    "rr_p99_us": ("rr", "p99_us", "64 B request/response p99, any CPU", None)}
#: The data path's case of the least sockmap pairing the kernel allows, no capture (benches/pairfloor.py).
FLOOR_CASE = "pairing-floor"
RATE_VS_REFERENCE = ("iptables", "iptables-legacy", "iptables-nft", "nftables")
RATE_NOISE = 0.03  # "no worse than Istio's rules" allows run-to-run noise of 3%
#: CNI ADD through the thin plugin and the agent (median, as the runtime sees it): at most this many
#: ms with eBPF, and at most this share of Istio's per-pod sequence measured in the same run
THIN_ADD_MS = {"ebpf": 3.0}
THIN_ADD_VS_REFERENCE = {"ebpf": 1 / 4, "nftables": 1 / 2}
#: redirect-agent's resident memory in steady state with this default backend, at most (MiB); the
#: agent with AGENT_REFERENCE is measured in the same run (benches/agentmem.py)
AGENT_RSS_MIB = {"ebpf": 60.0}
AGENT_REFERENCE = "iptables"
SCALE_TARGET = 1.2
SCALE_TARGET_N = 1000
#: Istio's per-pod sequences (benches/reference.py): an ambient pod's setup is against the ambient
#: one when it was measured, every other setup and every teardown against the sidecar one; the
#: sidecar one without its variant detection (``core``) is reported beside it.
REFERENCE_KEY, AMBIENT_REFERENCE_KEY, CORE_REFERENCE_KEY = (REFERENCE_KEYS[k] for k in ("sidecar", "ambient", "core"))


def reference_for(key: str, per_pod: dict[str, Any], phase: str = "setup") -> str:
    """The reference a per-pod method's ``phase`` is judged against: Istio's ambient sequence for an
    ambient pod's setup (if measured), else its sidecar one."""
    if phase == "setup" and key.endswith("/ambient") and not key.startswith("reference/") \
            and AMBIENT_REFERENCE_KEY in per_pod:
        return AMBIENT_REFERENCE_KEY
    return REFERENCE_KEY


def _median(d: dict[str, Any], key: str, phase: str = "setup") -> float | None:
    v = d.get(key, {}).get(phase, {}).get("median_ms")
    return float(v) if v else None


def _rate_ratio(case: dict[str, Any], base: dict[str, Any]) -> float | None:
    """Connection rate of ``case`` over ``base``: the median of the ratios of paired runs when both
    have them (the cases take turns slice by slice, so drift on a shared machine cancels), else
    the ratio of the medians."""
    a, b = case.get("runs", {}).get("crr", []), base.get("runs", {}).get("crr", [])
    if a and len(a) == len(b) and all(y.get("conn_per_s") for y in b):
        return round(statistics.median(x["conn_per_s"] / y["conn_per_s"] for x, y in zip(a, b, strict=True)), 4)
    if case.get("conn_per_s") and base.get("conn_per_s"):
        return round(case["conn_per_s"] / base["conn_per_s"], 4)
    return None


def _paired_ratio(case: dict[str, Any], base: dict[str, Any], runs: str, key: str) -> float | None:
    """The median of the ratios of ``key`` in the paired runs (``runs``: rr, rr1, bulk) of two cases."""
    a, b = case.get("runs", {}).get(runs, []), base.get("runs", {}).get(runs, [])
    if a and len(a) == len(b) and all(y.get(key) for y in b):
        return round(statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=True)), 4)
    return None


def ratios(res: dict[str, Any]) -> dict[str, Any]:
    per_pod = res.get("per_pod", {})
    out: dict[str, Any] = {"setup_vs_reference": {}, "teardown_vs_reference": {}, "conn_rate_vs_direct": {},
                           "conn_rate_vs_reference": {}, "nth_vs_first": {}, "sockmap_vs_direct": {},
                           "setup_vs_core": {}, "required_vs_reference": {}}
    core = _median(per_pod, CORE_REFERENCE_KEY)
    for phase in ("setup", "teardown"):
        for key in per_pod:
            v = _median(per_pod, key, phase)
            ref = _median(per_pod, reference_for(key, per_pod, phase), phase)
            if ref and v is not None and key != REFERENCE_KEY:
                out[f"{phase}_vs_reference"][key] = round(v / ref, 4)
            if phase == "setup" and core and v is not None and not key.startswith("reference/"):
                out["setup_vs_core"][key] = round(v / core, 4)
            need = per_pod[key].get("steps_us", {}).get("required")
            if phase == "setup" and ref and need is not None:
                out["required_vs_reference"][key] = round(need / 1e3 / ref, 4)
    cases = res.get("datapath", {}).get("cases", {})
    for name, c in cases.items():
        if "conn_per_s" not in c:
            continue
        if name != "direct" and (v := _rate_ratio(c, cases.get("direct", {}))) is not None:
            out["conn_rate_vs_direct"][name] = v
        if name not in ("direct", "reference", FLOOR_CASE) and \
                (v := _rate_ratio(c, cases.get("reference", {}))) is not None:
            out["conn_rate_vs_reference"][name] = v
    sm, direct, ebpf = cases.get("ebpf/sockmap", {}), cases.get("direct", {}), cases.get("ebpf", {})
    if "conn_per_s" in sm and "conn_per_s" in direct:
        for key, (runs, field, _, _) in SOCKMAP_VS_DIRECT.items():
            out["sockmap_vs_direct"][key] = _paired_ratio(sm, direct, runs, field)
        # What pairing costs at connect: the rate with sockmap against the same capture without.
        out["sockmap_vs_direct"]["conn_rate_vs_ebpf"] = _rate_ratio(sm, ebpf) if "conn_per_s" in ebpf else None
    # The kernel's floor for any pairing (no capture, the least program), when its programs did pair,
    # and what capture's own cost (eBPF without sockmap) and it leave together.
    floor = cases.get(FLOOR_CASE, {})
    if "conn_per_s" in floor and "conn_per_s" in direct and floor.get("pairing", {}).get("redirected"):
        f = out["sockmap_vs_direct"]["floor_conn_rate"] = _rate_ratio(floor, direct)
        e = out["conn_rate_vs_direct"].get("ebpf")
        out["sockmap_vs_direct"]["conn_rate_bound"] = round(f * e, 4) if f is not None and e is not None else None
    for key, sc in res.get("scale", {}).items():
        levels = sc.get("levels", {})
        if "1" not in levels or len(levels) < 2:
            continue
        top = max(levels, key=int)
        first, nth = levels["1"]["setup"].get("median_ms"), levels[top]["setup"].get("median_ms")
        if first and nth:
            d = out["nth_vs_first"][key] = {"n": int(top), "ratio": round(nth / first, 4)}
            # The machine's speed moved between the two levels by the ratio of their controls'
            # medians (a fixed CPU workload timed beside each sample): taken out of the ratio.
            c1, cn = (levels[n].get("control", {}).get("median_ms") for n in ("1", top))
            if c1 and cn:
                d.update(raw=d["ratio"], machine=round(cn / c1, 4), ratio=round(nth / first / (cn / c1), 4))
    return out


def targets(res: dict[str, Any], r: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    skipped = res.get("skipped_backends", {})
    per_pod = res.get("per_pod", {})

    def add(name: str, target: str, measured: float | None, ok: bool | None, why: str = "") -> None:
        status = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        rows.append({"name": name, "target": target, "measured": measured, "status": status, "note": why})

    for b, limit in SETUP_TARGETS.items():
        for mode in SETUP_TARGET_MODES.get(b, ("sidecar",)):
            key = f"api/{b}/{mode}"
            suffix = "" if mode == "sidecar" else f" ({mode})"
            name = f"{b}: per-pod setup vs reference{suffix}"
            if b in skipped or key not in r["setup_vs_reference"]:
                if b in skipped or b in ("nftables", "ebpf", "iptables"):
                    add(name, f"<= {limit:g}", None, None, skipped.get(b, "not measured in this run"))
                continue
            v = r["setup_vs_reference"][key]
            need = r.get("required_vs_reference", {}).get(key)
            why = "against istio-cni's ambient sequence" if reference_for(key, per_pod) == AMBIENT_REFERENCE_KEY else ""
            if v > limit and need is not None:
                why += f"{'; ' if why else ''}the steps no such setup can leave out take {_fmt(need)} (row below)"
            add(name, f"<= {limit:g}", v, v <= limit, why)
            if need is not None:
                add(f"{b}: per-pod setup's required steps alone vs reference{suffix}", "reported", need, None,
                    ", ".join(REQUIRED_STEPS) + ", timed inside the call")
            if (c := r.get("setup_vs_core", {}).get(key)) is not None:
                add(f"{b}: per-pod setup vs Istio's sidecar sequence without its variant detection{suffix}",
                    "reported", c, None, "the 6 execs of saves and restores alone")
    it_ms = _median(per_pod, "api/iptables/sidecar")
    for key, target in (("api/ebpf/sidecar", EBPF_VS_IPTABLES), ("api/ebpf/sidecar-forwarding", None)):
        ms = _median(per_pod, key)
        if ms is None or not it_ms:
            continue
        v = round(ms / it_ms, 4)
        add(f"{key}: per-pod setup vs api/iptables/sidecar", "reported" if target is None else f"<= 1/{1 / target:g}",
            v, None if target is None else v <= target,
            "" if target else "a pod that forwards, as Kubernetes pods do: its tc filters besides")
    for b, limit in THIN_ADD_VS_REFERENCE.items():
        key = f"cni-thin/{b}/sidecar"
        why = skipped.get(b, "" if key in per_pod else "not measured in this run")
        if b in THIN_ADD_MS:
            ms = _median(per_pod, key)
            add(f"{b}: CNI ADD (thin plugin + agent), p50 ms", f"<= {THIN_ADD_MS[b]:g}", ms,
                None if ms is None else ms <= THIN_ADD_MS[b], why)
        v = r["setup_vs_reference"].get(key)
        add(f"{b}: CNI ADD (thin plugin + agent) vs Istio's sequence", f"<= {limit:g}", v,
            None if v is None else v <= limit, why)
    for key, c in res.get("cni_concurrent", {}).items():
        n = c.get("pods")
        errs = None if "add" not in c else c["add"]["errors"] + c["add"].get("not_captured", 0)
        add(f"{key}: {n} concurrent ADDs, errors or uncaptured pods", "0", errs,
            None if errs is None else errs == 0,
            c.get("error", "") or f"p99 {_fmt(c['add'].get('p99_ms'))} ms, all done in {_fmt(c['add']['wall_ms'])} ms")
    sm = r.get("sockmap_vs_direct", {})
    for b, limit in RATE_VS_DIRECT.items():
        v = r["conn_rate_vs_direct"].get(b)
        why = skipped.get(b, "" if v is not None else "not measured in this run")
        if b == "ebpf/sockmap" and v is not None and v < limit and sm.get("floor_conn_rate") is not None:
            why = (f"capture alone {_fmt(r['conn_rate_vs_direct'].get('ebpf'))}, the least pairing alone "
                   f"{_fmt(sm['floor_conn_rate'])}: together about {_fmt(sm.get('conn_rate_bound'))} (rows below)")
        add(f"{b}: connection rate vs direct", f">= {limit:g}", v, None if v is None else v >= limit, why)
    for key, (_, _, what, goal) in SOCKMAP_VS_DIRECT.items():
        v = sm.get(key)
        name = f"ebpf/sockmap: {what} vs direct (plain loopback TCP)"
        why = "" if v is not None else skipped.get("ebpf", "not measured in this run")
        if goal is None:
            if v is not None:
                add(name, "reported", v, None, "the other CPU's wake-up, the same in both cases, is most of it")
            continue
        op, limit = goal
        add(name, f"{op} {limit:g}", v, None if v is None else (v <= limit if op == "<=" else v >= limit), why)
    if sm.get("conn_rate_vs_ebpf") is not None:
        add("ebpf/sockmap: connection rate vs ebpf without sockmap (what pairing costs at connect)", "reported",
            sm["conn_rate_vs_ebpf"], None)
    if sm.get("floor_conn_rate") is not None:
        add(f"{FLOOR_CASE}: connection rate vs direct (the least pairing the kernel allows, no capture)",
            "reported", sm["floor_conn_rate"], None, "both ends in a sockhash, every send redirected")
        add("ebpf/sockmap: what capture and the least pairing leave of direct's connection rate (their product)",
            "reported", sm.get("conn_rate_bound"), None, "ebpf's rate vs direct times pairing-floor's")
    for b in RATE_VS_REFERENCE:
        v = r["conn_rate_vs_reference"].get(b)
        if v is None and b not in skipped and b not in ("iptables", "nftables"):
            continue
        add(f"{b}: connection rate vs Istio's rules", f">= 1 (-{RATE_NOISE:.0%} noise)", v,
            None if v is None else v >= 1 - RATE_NOISE, skipped.get(b, "" if v is not None else "not measured"))
    am = res.get("agent_memory", {})
    ref_rss = am.get(AGENT_REFERENCE, {}).get("rss_mib")
    for b, limit in AGENT_RSS_MIB.items():
        a = am.get(b, {})
        v = a.get("rss_mib")
        why = skipped.get(b, a.get("error", "not measured in this run" if v is None else ""))
        if v is not None:
            why = (f"{AGENT_REFERENCE} agent {_fmt(ref_rss)} MiB in this run; peak {_fmt(a.get('peak_mib'))} MiB; "
                   f"compiler mapped: {', '.join(a.get('compiler_mapped', [])) or 'none'}")
        add(f"{b}: agent resident memory in steady state (MiB)", f"<= {limit:g}", v,
            None if v is None else v <= limit, why)
    for key, d in r["nth_vs_first"].items():
        if key.startswith("reference"):
            continue
        why = "" if d["n"] >= SCALE_TARGET_N else f"largest N measured is {d['n']} (--quick); the target is at N=1000"
        if "machine" in d:
            why = "; ".join(x for x in (why, f"{_fmt(d['raw'])} before taking out the machine's own change of"
                                        f" speed between the two ({_fmt(d['machine'])})") if x)
        add(f"{key}: pod {d['n']} setup vs pod 1", f"<= {SCALE_TARGET:g}", d["ratio"], d["ratio"] <= SCALE_TARGET, why)
    return rows


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}{unit}" if abs(x) < 100 else f"{x:,.0f}{unit}"
    return f"{x}{unit}"


STEPS_TITLE = "Where a fresh pod's eBPF setup goes (median µs of each step, per-pod phase)"
STEPS_TEXT = ("Each step of the fresh-pod call (`RDR_STEP_*` in native/redirect_native.h), timed inside the"
              " call; `call` is the whole call, `outside` the rest of the setup as timed above (the Python"
              " around the call). The last rows: the call alone against Istio's sequence for the same kind"
              " of pod (an ambient pod's: istio-cni's node agent's), and the steps no eBPF setup of such a pod"
              " can leave out (`benches/podcost.py`, `REQUIRED_STEPS`; each setup's sum of them, then the"
              " median) against the same. Medians of steps do not add up to the median of the whole.")


def step_rows(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The methods whose steps the per-pod phase recorded, and a row per step (its name, then its
    median for each method), with a last row of the call's median against the reference's setup."""
    per_pod = res.get("per_pod", {})
    stepped = {k: d["steps_us"] for k, d in per_pod.items() if d.get("steps_us")}
    if not stepped:
        return [], []
    keys = list(stepped)
    names = [n for n in stepped[keys[0]] if n not in ("n", "required")]
    rows = [[n] + [_fmt(stepped[k].get(n)) for k in keys] for n in names]
    refs = [_median(per_pod, reference_for(k, per_pod)) for k in keys]
    for what, field in (("call", "call"), (f"required ({', '.join(REQUIRED_STEPS)})", "required")):
        rows.append([f"{what} vs Istio's sequence"] + [
            _fmt(round(stepped[k][field] / 1e3 / ref, 4)) if ref and stepped[k].get(field) is not None else "-"
            for k, ref in zip(keys, refs, strict=True)])
    return keys, rows


def step_section(keys: list[str], rows: list[list[str]]) -> list[str]:
    """``step_rows``'s methods and rows as a markdown section (no lines when there are none): the
    summary's and the published page's."""
    if not keys:
        return []
    return (["", f"## {STEPS_TITLE}", "", STEPS_TEXT, "", "| step | " + " | ".join(keys) + " |",
             "|---|" + "---|" * len(keys)] + ["| " + " | ".join(r) + " |" for r in rows])


def markdown(res: dict[str, Any]) -> str:
    r, rows = res["ratios"], res["targets"]
    h = res.get("host", {})
    L = [f"# redirect benchmark ({res.get('profile', 'full')} run)", "",
         f"Host: kernel {h.get('kernel')}, {h.get('cpus')} CPUs, {h.get('iptables')}. "
         f"Ratios are against references measured in the same run. Elapsed {res.get('elapsed_s')} s.", "",
         "## Targets", "", "| target | wanted | measured | status | note |", "|---|---|---|---|---|"]
    for t in rows:
        L.append(f"| {t['name']} | {t['target']} | {_fmt(t['measured'])} | **{t['status']}** | {t['note']} |")
    addrs = res.get("settings", {}).get("pod_addresses", "none")
    L += ["", "## Per-pod setup and teardown (fresh namespaces)", "",
          "Each pod netns has lo" + {"none": " only", "v4": " and an eth0 with an IPv4 address",
                                     "dual": " and an eth0 with an IPv4 and an IPv6 address"}.get(addrs, f" ({addrs})")
          + " when setup runs (`--pod-addresses`).", "",
          "| method | how | setup min / median / p99 (ms) | vs ref | teardown min / median / p99 (ms) | vs ref |",
          "|---|---|---|---|---|---|"]
    for key, d in res.get("per_pod", {}).items():
        s, t = d["setup"], d["teardown"]
        one = 1.0 if key == REFERENCE_KEY else None
        how = d.get("how", "") + (f" ({d['error']})" if d.get("error") else "")
        L.append(f"| {key} | {how} | {_fmt(s.get('min_ms'))} / {_fmt(s.get('median_ms'))} / "
                 f"{_fmt(s.get('p99_ms'))} | {_fmt(r['setup_vs_reference'].get(key, one))}"
                 f" | {_fmt(t.get('min_ms'))} / {_fmt(t.get('median_ms'))} / {_fmt(t.get('p99_ms'))} | "
                 f"{_fmt(r['teardown_vs_reference'].get(key, one))} |")
    L += step_section(*step_rows(res))
    if res.get("cni_concurrent"):
        L += ["", "## CNI: pods started at once through the thin plugin and the agent", "",
              "Each ADD (then each DEL) exec'd at once over fresh namespaces, timed as the runtime sees it.", "",
              "| method | pods | ADD median / p99 (ms) | ADD errors | uncaptured | all ADDs done (ms) |"
              " DEL median / p99 (ms) | DEL errors |", "|---|---|---|---|---|---|---|---|"]
        for key, c in res["cni_concurrent"].items():
            if "error" in c:
                L.append(f"| {key} | - | {c['error']} | | | | | |")
                continue
            a, d = c["add"], c["del"]
            L.append(f"| {key} | {c['pods']} | {_fmt(a.get('median_ms'))} / {_fmt(a.get('p99_ms'))} | {a['errors']} | "
                     f"{a.get('not_captured')} | {_fmt(a['wall_ms'])} | {_fmt(d.get('median_ms'))} / "
                     f"{_fmt(d.get('p99_ms'))} | {d['errors']} |")
    ps = res.get("pod_start", {})
    if ps:
        L += ["", "## Pod start and stop through containerd (`ctr run --rm --cni` of a busybox container running "
              "`sleep 0`)", "",
              "Wall time of the whole run: CNI ADD, task start, exit, CNI DEL, container delete, in a bridge + "
              "host-local network alone and chained with our plugin (sidecar mode).", "",
              "| case | runs | median / p99 (ms) | added to a pod's start and stop (ms) | errors |",
              "|---|---|---|---|---|"]
        if "error" in ps:
            L.append(f"| - | - | {ps['error']} | | |")
        for name, c in ps.get("cases", {}).items():
            L.append(f"| {name} | {c.get('n')} | {_fmt(c.get('median_ms'))} / {_fmt(c.get('p99_ms'))} | "
                     f"{_fmt(c.get('added_ms'))} | {c.get('errors')}"
                     + (f" ({c['first_error']})" if c.get("first_error") else "") + " |")
    if res.get("scale"):
        levels = sorted({int(n) for sc in res["scale"].values() for n in sc.get("levels", {})})
        L += ["", "## Scale: median setup (ms) of the Nth pod while N-1 are live", "",
              "| method | " + " | ".join(f"N={n}" for n in levels) + " | Nth / first (the machine's change of speed"
              " taken out) |",
              "|---" * (len(levels) + 2) + "|"]
        for key, sc in res["scale"].items():
            cells = [_fmt(sc["levels"].get(str(n), {}).get("setup", {}).get("median_ms")) for n in levels]
            L.append(f"| {key} | " + " | ".join(cells) + f" | {_fmt(r['nth_vs_first'].get(key, {}).get('ratio'))} |")
    if res.get("memory"):
        L += ["", "## Memory per pod (capture only, KiB)", "",
              "kmem: kernel memory charged to the bench's memory cgroup (what the kernel accounts: rules, sets, "
              "BPF maps), and what teardown gave back. Slab .. MemAvailable: host-wide /proc/meminfo deltas, "
              "noisy on a shared host.", "",
              "| method | pods | kmem (freed by teardown) | Slab | SUnreclaim | Percpu | MemAvailable drop |"
              " rules (ipt-nft / ipt-legacy / nft) | bpf map entries (key+value bytes) |",
              "|---|---|---|---|---|---|---|---|---|"]
        for key, m in res["memory"].items():
            if "error" in m:
                L.append(f"| {key} | - | {m['error']} | | | | | | |")
                continue
            k, o = m["kib_per_pod"], m["kernel_objects_one_pod"]
            freed = m.get("kmem_freed_kib_per_pod")
            kmem = _fmt(m.get("kmem_kib_per_pod")) + (f" ({_fmt(freed)})" if freed is not None else "")
            L.append(f"| {key} | {m['pods']} | {kmem} | {_fmt(k.get('Slab'))} | {_fmt(k.get('SUnreclaim'))} | "
                     f"{_fmt(k.get('Percpu'))} | {_fmt(k.get('MemAvailable'))} | {o.get('iptables_nft_rules')} / "
                     f"{o.get('iptables_legacy_rules')} / {o.get('nft_rules_total')} | "
                     f"{_fmt(m.get('bpf_map_entries_per_pod'))}"
                     + (f" ({_fmt(m['bpf_map_bytes_per_pod'])} B)" if m.get("bpf_map_bytes_per_pod") else "") + " |")
    if res.get("agent_memory"):
        L += ["", "## redirect-agent's memory per default backend (steady state)", "",
              "Each agent started as on a node, waited for until /readyz said ready (its backend warmed up), "
              "then read from /proc with its pods set up through the thin plugin.", "",
              "| --backend | ready after (ms) | pods | RSS (MiB) | vs " + AGENT_REFERENCE + " | peak RSS (MiB) |"
              " anon / file (MiB) | compiler mapped |", "|---|---|---|---|---|---|---|---|"]
        am = res["agent_memory"]
        ref_rss = am.get(AGENT_REFERENCE, {}).get("rss_mib")
        for b, a in am.items():
            if "error" in a:
                L.append(f"| {b} | {a['error']} | | | | | | |")
                continue
            vs = round(a["rss_mib"] / ref_rss, 3) if ref_rss and a.get("rss_mib") else None
            L.append(f"| {b} | {_fmt(a.get('ready_ms'))} | {a.get('pods')} ({a.get('add_errors')} failed) | "
                     f"{_fmt(a.get('rss_mib'))} | {_fmt(vs)} | {_fmt(a.get('peak_mib'))} | "
                     f"{_fmt(a.get('anon_mib'))} / {_fmt(a.get('file_mib'))} | "
                     f"{', '.join(a.get('compiler_mapped', [])) or 'none'} |")
    dp = res.get("datapath", {})
    if dp.get("cases"):
        L += ["", f"## Data path (loopback in a pod netns; connect + {dp.get('msg_bytes')} B request/response + "
              "close; median of runs)", "",
              "The proxy listens on 15001 in the pod and echoes; it does not connect onward (the figure is "
              "the cost of reaching the proxy). Rate ratios are medians of the ratios of paired runs (the "
              "cases take turns in ~0.25 s slices, so each pair is a fraction of a second apart).", "",
              "`rr`: 64 B request/response on one established connection, the client and the proxy free to "
              "run on any CPU; `rr 1 CPU`: the same, both on one CPU.", "",
              "| case | target | conn/s | vs direct | vs Istio's rules | p50 (us) | p99 (us) | rr p50 (us) |"
              " rr p99 (us) | rr 1 CPU p50 (us) | rr 1 CPU p99 (us) | bulk (Gbit/s) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, c in dp["cases"].items():
            if "error" in c:
                L.append(f"| {name} | {c['error']} | | | | | | | | | | |")
                continue
            L.append(f"| {name} | {c.get('target', '')} | {_fmt(c.get('conn_per_s'))} | "
                     f"{_fmt(r['conn_rate_vs_direct'].get(name, 1.0 if name == 'direct' else None))} | "
                     f"{_fmt(r['conn_rate_vs_reference'].get(name, 1.0 if name == 'reference' else None))} | "
                     f"{_fmt(c.get('p50_us'))} | {_fmt(c.get('p99_us'))} | {_fmt(c.get('rr_p50_us'))} | "
                     f"{_fmt(c.get('rr_p99_us'))} | {_fmt(c.get('rr1_p50_us'))} | {_fmt(c.get('rr1_p99_us'))} | "
                     f"{_fmt(c.get('bulk_gbit_per_s'))} |")
    if res.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(L) + "\n"


def plots(res: dict[str, Any], outdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []
    per_pod = res.get("per_pod", {})
    if per_pod:
        keys = [k for k in per_pod if per_pod[k]["setup"].get("n")]
        med = [per_pod[k]["setup"]["median_ms"] for k in keys]
        p99 = [per_pod[k]["setup"]["p99_ms"] - per_pod[k]["setup"]["median_ms"] for k in keys]
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(keys) + 1.5))
        ax.barh(keys, med, xerr=[[0] * len(keys), p99], color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlabel("per-pod setup, ms (median, bar to p99; log scale)")
        ax.invert_yaxis()
        fig.tight_layout()
        made.append(os.path.join(outdir, "setup.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    if res.get("scale"):
        fig, ax = plt.subplots(figsize=(8, 5))
        for key, sc in res["scale"].items():
            ns = sorted(int(n) for n in sc["levels"])
            ax.plot(ns, [sc["levels"][str(n)]["setup"]["median_ms"] for n in ns], marker="o", label=key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (the Nth pod, while N-1 are live)")
        ax.set_ylabel("setup, ms (median)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(os.path.join(outdir, "scale.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    cases = {k: v for k, v in res.get("datapath", {}).get("cases", {}).items() if "conn_per_s" in v}
    if cases:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        names = list(cases)
        a1.bar(names, [cases[n]["conn_per_s"] for n in names], color="tab:green")
        a1.set_ylabel("connections per second")
        x = range(len(names))
        a2.bar([i - 0.2 for i in x], [cases[n]["p50_us"] for n in names], width=0.4, label="p50")
        a2.bar([i + 0.2 for i in x], [cases[n]["p99_us"] for n in names], width=0.4, label="p99")
        a2.set_xticks(list(x), names)
        a2.set_ylabel("connect + request/response, us")
        a2.legend()
        for a in (a1, a2):
            a.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        made.append(os.path.join(outdir, "datapath.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made
