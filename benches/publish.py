"""The benchmark figures as published: ``docs/benchmarks-results.md``, rendered from a results file.

``make bench`` runs the benchmark (``benches/results/latest.json``) and then this, so the figures in
the docs are always one run's, with the command and the hardware it ran on; nobody copies numbers by
hand. ``figures(res)`` picks what is published out of a results file; ``markdown(figures)`` writes it,
the figures themselves last, in a comment the page is checked against (``tests/test_benches.py``).

    .venv/bin/python -m benches.publish [RESULTS.json] [OUT.md]
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .report import AMBIENT_REFERENCE_KEY, CORE_REFERENCE_KEY, REFERENCE_KEY, _fmt, step_rows, step_section

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "latest.json")
DOC = os.path.join(os.path.dirname(HERE), "docs", "benchmarks-results.md")
MARK = "<!-- figures:"
BACKENDS = ("iptables", "nftables", "ebpf")

#: The rows of the figures table: (label, per-pod keys, the data path's case for each, or None).
ROWS: tuple[tuple[str, tuple[str, ...], tuple[str | None, ...]], ...] = (
    ("Istio's sidecar sequence (reference)", (REFERENCE_KEY,), ("reference",)),
    ("the same without its variant detection", (CORE_REFERENCE_KEY,), (None,)),
    ("Istio's ambient sequence (ambient pods' reference)", (AMBIENT_REFERENCE_KEY,), (None,)),
    ("iptables (API)", ("api/iptables/sidecar",), ("iptables",)),
    ("nftables (API)", ("api/nftables/sidecar",), ("nftables",)),
    ("eBPF (API)", ("api/ebpf/sidecar",), ("ebpf",)),
    ("eBPF (API), a pod that forwards (tc filters too)", ("api/ebpf/sidecar-forwarding",), (None,)),
    ("ambient pods (API): iptables / nftables / eBPF", tuple(f"api/{b}/ambient" for b in BACKENDS),
     (None, None, "ebpf/ambient")),
    ("CNI ADD, thin plugin + agent: iptables / nftables / eBPF", tuple(f"cni-thin/{b}/sidecar" for b in BACKENDS),
     (None, None, None)),
    ("CNI ADD, Python plugin: iptables / nftables / eBPF", tuple(f"cni/{b}/sidecar" for b in BACKENDS),
     (None, None, None)),
)


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def _memory(m: dict[str, Any] | None) -> str | None:
    if not m or m.get("kmem_kib_per_pod") is None:
        return None
    text = f"{_fmt(m['kmem_kib_per_pod'])} KiB"
    if m.get("bpf_map_entries_per_pod"):
        text += f" ({_fmt(m['bpf_map_entries_per_pod'])} map entries, {_fmt(m.get('bpf_map_bytes_per_pod'))} B)"
    return text


def figures(res: dict[str, Any], source: str = "") -> dict[str, Any]:
    """What is published of the results ``res`` (read from ``source``): cells as text, every number
    as the results file has it."""
    r = res.get("ratios", {})
    per_pod, scale = res.get("per_pod", {}), r.get("nth_vs_first", {})
    rows = []
    for label, keys, cases in ROWS:
        if not any(k in per_pod for k in keys):
            continue

        def cells(get: Any, keys: tuple[str, ...] = keys, cases: tuple[str | None, ...] = cases) -> str:
            return " / ".join(_fmt(get(k, c)) for k, c in zip(keys, cases, strict=True))

        rows.append([
            label,
            cells(lambda k, c: _get(per_pod, k, "setup", "median_ms")),
            cells(lambda k, c: 1 if k == REFERENCE_KEY else _get(r, "setup_vs_reference", k)),
            cells(lambda k, c: _get(per_pod, k, "teardown", "median_ms")),
            cells(lambda k, c: None if c is None else _get(r, "conn_rate_vs_direct", c)),
            cells(lambda k, c: _get(scale, k, "ratio")),
            " / ".join(_memory(_get(res, "memory", k)) or "-" for k in keys),
        ])
    n = max((d.get("n", 0) for d in scale.values()), default=0)
    h = res.get("host", {})
    am = res.get("agent_memory", {})
    agents = [f"`--backend {b}` {_fmt(a.get('rss_mib'))} MiB resident (peak {_fmt(a.get('peak_mib'))}, ready after"
              f" {_fmt(a.get('ready_ms'))} ms, compiler mapped: {', '.join(a.get('compiler_mapped', [])) or 'none'})"
              for b, a in am.items() if "rss_mib" in a]
    n_conc = next((c.get("pods") for c in res.get("cni_concurrent", {}).values() if "add" in c), 0)
    conc = [f"{k.split('/')[1]}: {c['add']['errors']} errors, {c['add'].get('not_captured')} uncaptured, p99"
            f" {_fmt(c['add'].get('p99_ms'))} ms" for k, c in res.get("cni_concurrent", {}).items() if "add" in c]
    starts = [f"{name}: {_fmt(c.get('median_ms'))} ms (adds {_fmt(c.get('added_ms'))})"
              for name, c in (_get(res, "pod_start", "cases") or {}).items() if "median_ms" in c]
    direct = _get(res, "datapath", "cases", "direct") or {}
    ebpf_vs_it = next((t["measured"] for t in res.get("targets", [])
                       if t["name"].startswith("api/ebpf/sidecar: per-pod setup vs")), None)
    return {
        "source": os.path.basename(source) if source else "",
        "profile": res.get("profile"), "command": res.get("command") or "python -m benches",
        "host": {"cpu": h.get("cpu_model", "?"), "cores": h.get("cpus"), "kernel": h.get("kernel"),
                 "machine": h.get("machine"), "iptables": h.get("iptables")},
        "pod_addresses": _get(res, "settings", "pod_addresses") or "none",
        "scale_n": n, "rows": rows,
        "targets": [[t["name"], t["target"], _fmt(t["measured"]), t["status"], t.get("note", "")]
                    for t in res.get("targets", [])],
        "agents": agents, "concurrent": conc, "concurrent_pods": n_conc, "pod_start": starts,
        "direct": (f"{_fmt(direct.get('conn_per_s'))} connections/s, p50 {_fmt(direct.get('p50_us'))} us, "
                   f"{_fmt(direct.get('bulk_gbit_per_s'))} Gbit/s bulk") if direct.get("conn_per_s") else "",
        "ebpf_vs_iptables": _fmt(ebpf_vs_it) if ebpf_vs_it is not None else "",
        "steps": dict(zip(("keys", "rows"), step_rows(res), strict=True)),
    }


def markdown(f: dict[str, Any]) -> str:
    """The page of figures ``f`` (``figures``), the figures themselves last (what it is checked against)."""
    h = f["host"]
    lines = [
        "# Benchmark results", "",
        "Written by `make bench` (`benches/publish.py`) from the results file of one run; do not edit it by",
        "hand (run the benchmark again). What is measured, how, and the targets are in",
        "[benchmarks.md](benchmarks.md). Absolute times vary with the machine; the ratios are what to compare.",
        "",
        f"- Run: `{f['command']}` ({f['profile']} profile)"
        + (f", results file `{f['source']}`" if f["source"] else ""),
        f"- Hardware: {h['cpu']}, {h['cores']} cores, {h['machine']}; kernel {h['kernel']}; {h['iptables']}",
        "- Pods: lo only when setup runs" if f["pod_addresses"] == "none" else
        f"- Pods: `--pod-addresses {f['pod_addresses']}` when setup runs",
        "", "## Per-pod figures (medians)", "",
        "| | setup (ms) | vs Istio's sequence (an ambient pod's: istio-cni's) | teardown (ms) | conn/s vs direct |"
        f" pod {f['scale_n']} vs pod 1 |"
        " kernel memory per pod |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in f["rows"]]
    if f["ebpf_vs_iptables"]:
        lines += ["", f"eBPF per-pod setup against the iptables backend's: {f['ebpf_vs_iptables']}."]
    if f["direct"]:
        lines += ["", f"Direct (no capture) in the data path: {f['direct']}."]
    for title, items in (("The agents' memory, serving sidecar pods through the thin plugin", f["agents"]),
                         (f"{f['concurrent_pods']} ADDs at once through the thin plugin", f["concurrent"]),
                         ("A pod's start and stop through containerd (`ctr run --rm --cni`)", f["pod_start"])):
        if items:
            lines += ["", f"{title}:", ""] + [f"- {x}" for x in items]
    steps = f.get("steps") or {}
    lines += step_section(steps.get("keys") or [], steps.get("rows") or [])
    lines += ["", "## Targets", "", "| target | wanted | measured | status | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(t[:3]) + f" | **{t[3]}** | {t[4]} |" for t in f["targets"]]
    lines += ["", f"{MARK} {json.dumps(f, sort_keys=True)} -->", ""]
    return "\n".join(lines)


def embedded(text: str) -> dict[str, Any] | None:
    """The figures a page of ``markdown`` was written from (None: none found)."""
    at = text.rfind(MARK)
    if at < 0:
        return None
    fig: dict[str, Any] = json.loads(text[at + len(MARK): text.index("-->", at)])
    return fig


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    src = args[0] if args else RESULTS
    out = args[1] if len(args) > 1 else DOC
    with open(src, encoding="utf-8") as fh:
        res = json.load(fh)
    text = markdown(figures(res, src))
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"benches.publish: wrote {out} from {src}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
