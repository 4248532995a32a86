"""The README's demo command works and shows what it claims: each connection caught where it should be."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the demo creates network namespaces: needs root")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `python -m demo` runs from the repo root

EXPECTED = [
    ("sidecar", "app (uid 1000) -> peer", "proxy :15001 (outbound)", "peer-web:8080"),
    ("sidecar", "app (uid 1000) -> excluded port", "not captured", "peer-db:9090"),
    ("sidecar", "proxy (uid 1337) -> peer", "not captured", "peer-web:8080"),
    ("sidecar", "peer -> pod app port", "proxy :15006 (inbound)", "pod-app:8000 (from 127.0.0.6)"),
    ("sidecar", "peer -> pod app port", "proxy :15006 (inbound)", "pod-app:8000 (from ::6)"),
    ("ambient", "app -> remote", "node proxy :15001 (outbound)", "remote-web:8080 (from fd00:252::2)"),
    ("ambient", "app -> remote (9090: all ports)", "node proxy :15001 (outbound)", "remote-db:9090"),
    ("ambient", "remote -> pod app port", "node proxy :15006 (inbound)", "pod-app:8000 (from 10.252.0.2)"),
    ("ambient", "remote -> pod app port", "node proxy :15006 (inbound)", "pod-app:8000 (from fd00:252::2)"),
    ("ambient", "node (kubelet probe) -> app", "not captured", "pod-app:8000 (from 169.254.7.127)"),
    ("ambient", "node (kubelet probe) -> app", "not captured", "pod-app:8000 (from fd16:9254:7127:1337:"),
]


@pytest.mark.parametrize("backend", ["iptables", "nftables", "ebpf"])
def test_demo_shows_sidecar_and_ambient_capture_through_the_agent(backend: str) -> None:
    """Every row on every backend. On eBPF the host programs go to the demo's own bpffs root, which
    is gone afterwards (nothing stays attached to the root cgroup)."""
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    pins_before = set(os.listdir("/sys/fs/bpf"))
    env = {k: v for k, v in os.environ.items() if k != "REDIRECT_BPF_ROOT"}
    proc = subprocess.Popen([sys.executable, "-m", "demo", "--backend", backend], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in p.stdout.splitlines() if re.match(r"(sidecar|ambient)  ", ln)]
    assert len(rows) == 13, p.stdout
    assert "in-pod rules removed, node probe set empty" in p.stdout, p.stdout
    for pod, label, caught, answer in EXPECTED:
        assert any(r[0] == pod and r[1] == label and r[3] == caught and r[4].startswith(answer) for r in rows), (
            f"no row {pod} | {label} | {caught} | {answer}\n{p.stdout}")
    assert not any("error" in r[4] for r in rows), p.stdout
    left = (set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()) - before
    assert not {n for n in left if n.startswith("rdr-demo-") and f"-{proc.pid}-" in n}, left  # (its own: pid in name)
    pins = set(os.listdir("/sys/fs/bpf")) - pins_before
    assert not {n for n in pins if n.startswith("rdr-demo-")}, f"the demo left pins in /sys/fs/bpf: {sorted(pins)}"
