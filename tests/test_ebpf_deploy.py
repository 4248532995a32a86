"""The eBPF backend as a node runs it: no kernel headers on the node, no compiler kept in a
long-lived process, and an agent that says ready only once its host programs are pinned.

Each test loads the host programs under a scratch root of its own (``/sys/fs/bpf/rdrt-...``),
removed at the end even on failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from redirect import api
from redirect.backends import ebpf
from redirect.backends.ebpf.host.launch import run_loader
from redirect.backends.ebpf.host.pins import host_lock
from redirect.config import RedirectConfig
from tests.kit import bpfroot
from tests.netkit import Pod, TcpListener, landing
from tests.test_agent import Node, cni

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP_UID = 1000
OUT_ONLY = RedirectConfig(inbound_ports=())
#: Libraries of a compiler: bcc's and the LLVM/clang it links.
COMPILER = re.compile(r"libbcc|libLLVM|libclang")


@pytest.fixture
def scratch_root(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with bpfroot.scratch_root(monkeypatch, f"deploy-{request.node.name[5:25].replace('_', '-')}") as root:
        yield root


def compiler_libs(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return sorted({ln.split()[-1] for ln in f if COMPILER.search(ln)})


HIDDEN = ("/lib/modules", "/usr/src")


def test_setup_from_the_cli_captures_with_the_nodes_kernel_headers_hidden(pod: Pod, scratch_root: str) -> None:
    """A node without kernel headers: in a mount namespace of its own with empty tmpfs over
    /lib/modules and /usr/src (those of them the node has), ``redirect setup NS --backend ebpf``
    compiles the host programs (against the headers the package carries), and the pod's
    connection is captured."""
    assert not os.path.exists(scratch_root)
    # (a directory the node does not have at all is as hidden as can be: nothing to mount over)
    hide = [f"{{ [ ! -e {d} ] || mount -t tmpfs rdrt-hidden {d}; }}" for d in HIDDEN]
    empty = [f'{{ [ -z "$(ls -A {d} 2>/dev/null)" ] || {{ echo "{d} not hidden" >&2; exit 99; }}; }}' for d in HIDDEN]
    script = " && ".join([*hide, *empty, 'exec "$@"'])
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                        sys.executable, "-m", "redirect.cli", "setup", pod.name, "--backend", "ebpf",
                        "--set", "inbound_ports=", "--json"],
                       capture_output=True, text=True, timeout=180, check=False, cwd=REPO)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["detail"]["compiled"] is True, r.stdout
        assert not ebpf.missing_pins(scratch_root)
        proxy = TcpListener(pod.name, 15001, label="proxy").start()
        app = TcpListener(pod.peer_name, 8080, label="app").start()
        try:
            hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID)
            assert hit.listener is proxy and hit.orig_dst == (pod.peer_ip4, 8080), hit.result
        finally:
            proxy.close()
            app.close()
    finally:
        api.teardown(pod.name, backend="ebpf")


LIBRARY_SETUP = r"""
import json, sys
sys.path.insert(0, {repo!r})
from redirect import api
from redirect.backends import ebpf
from redirect.config import RedirectConfig
res = api.setup({ns!r}, RedirectConfig(inbound_ports=()), backend="ebpf")
with open("/proc/self/maps") as f:
    libs = sorted({{ln.split()[-1] for ln in f if any(k in ln for k in ("libbcc", "libLLVM", "libclang"))}})
print(json.dumps({{"compiled": res.detail["compiled"], "libs": libs, "bcc": "bcc" in sys.modules}}))
"""


def test_a_library_setup_that_loads_the_host_programs_keeps_no_compiler_mapped(pod: Pod, scratch_root: str) -> None:
    """``redirect.setup(..., backend="ebpf")`` in a user's process with no pins yet: the programs are
    compiled and loaded by a short-lived loader process; the user's process never maps bcc or LLVM."""
    r = subprocess.run([sys.executable, "-c", LIBRARY_SETUP.format(repo=REPO, ns=pod.name)],
                       capture_output=True, text=True, timeout=180, check=False)
    try:
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out == {"compiled": True, "libs": [], "bcc": False}, out
        assert not ebpf.missing_pins(scratch_root)
        proxy = TcpListener(pod.name, 15001, label="proxy").start()
        app = TcpListener(pod.peer_name, 8080, label="app").start()
        try:
            assert landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID).listener is proxy
        finally:
            proxy.close()
            app.close()
    finally:
        api.teardown(pod.name, backend="ebpf")


def test_a_loader_that_fails_leaves_nothing_pinned_and_says_why(scratch_root: str, tmp_path: Path) -> None:
    """The loader's failure comes back to the caller as the error it raised (here: no cgroup v2 where
    the programs would be attached), and nothing is left pinned."""
    from redirect.errors import BackendUnavailable

    with host_lock(scratch_root) as lock_fd, pytest.raises(BackendUnavailable, match="cgroup v2 not mounted at"):
        run_loader(scratch_root, str(tmp_path), lock_fd)
    assert not os.path.exists(scratch_root)


def _readyz(agent: object) -> tuple[int, dict[str, object]]:
    code, body = agent.get("/readyz")  # type: ignore[attr-defined]
    return code, json.loads(body)


def test_the_ebpf_agent_is_ready_once_its_host_programs_are_pinned_and_keeps_no_compiler(
        tmp_path: Path, pod: Pod, scratch_root: str) -> None:
    """While the host programs are not loaded (the warm-up waits for the host lock, held here) the
    agent serves /healthz but /readyz says 503 and why; once they are pinned, 200. After it served an
    eBPF ADD the agent has no bcc or LLVM mapped. Pins removed later make it not ready again."""
    n = Node(tmp_path, "ebpf")
    try:
        with host_lock(scratch_root):
            agent = n.start_agent()
            assert agent.get("/healthz")[0] == 200
            for _ in range(3):
                code, body = _readyz(agent)
                assert code == 503 and body["backend"] == "ebpf" and body["backend_error"] == "warming up", body
        deadline = time.monotonic() + 120
        while (ready := _readyz(agent))[0] != 200:
            assert time.monotonic() < deadline, f"not ready 120 s after the host lock was released: {ready}"
            assert agent.proc.poll() is None
            time.sleep(0.05)
        assert ready[1]["backend"] == "ebpf" and not ebpf.missing_pins(scratch_root), ready
        n.start_proxy()
        uid = f"uid-deploy-{os.urandom(3).hex()}"
        rc, out = cni("ADD", pod, uid, n.events, "ebpf")
        assert rc == 0, out
        assert api.check(pod.name, RedirectConfig(mode="ambient"), backend="ebpf").ok
        assert compiler_libs(agent.proc.pid) == []
        assert cni("DEL", pod, uid, n.events, "ebpf")[0] == 0
        ebpf.unload_host(scratch_root)
        code, body = _readyz(agent)
        assert code == 503 and "host pins missing" in str(body["backend_error"]), body
    finally:
        n.close()


def test_an_agent_whose_ebpf_backend_cannot_load_is_not_ready_and_says_why(tmp_path: Path, scratch_root: str) -> None:
    n = Node(tmp_path, "ebpf")
    try:
        agent = n.start_agent(env={"REDIRECT_BPF_CGROUP": str(tmp_path)})  # not a cgroup v2 mount
        deadline = time.monotonic() + 60
        while (got := _readyz(agent))[1].get("backend_error") == "warming up":
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        code, body = got
        assert code == 503 and "cgroup v2 not mounted at" in str(body["backend_error"]), body
        assert agent.get("/healthz")[0] == 200
        assert not os.path.exists(scratch_root)
    finally:
        n.close()
