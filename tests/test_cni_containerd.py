"""End to end: containerd + ``ctr run --cni`` with bridge + host-local, then redirect-cni.

A containerd of the test's own (temp ``root``/``state``/socket, CRI disabled) runs
a busybox container whose network comes from the reference plugins chained with
ours, installed by ``redirect-cni install`` into a conf dir of the test's own. No
node agent runs: the thin plugin falls back to the Python plugin (``agentDown:
inProcess``); tests/test_cni_thin.py runs the same through the agent.
``ctr`` (containerd 1.6) reads only /etc/cni/net.d and /opt/cni/bin
(``gocni.WithDefaultConf``, no env override), so it runs in a private mount
namespace where the test's dirs are bind-mounted over those two paths; the host's
are untouched (created empty only if missing, and removed again).

Only a foreground ``ctr run`` calls CNI DEL (when the task exits, with an empty
``CNI_NETNS``); ``ctr task delete`` in 1.6 does not, so the test runs ``ctr run``
in the background and kills the task.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from redirect.cni import install as inst
from tests.netkit import TcpListener

CNI_DIR = "/usr/lib/cni"
NEEDED = [shutil.which(t) for t in ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "busybox", "unshare")]
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or None in NEEDED or not os.path.exists(f"{CNI_DIR}/bridge"),
    reason="needs root, containerd, ctr, runc, busybox-static, util-linux unshare and containernetworking-plugins"
           " (scripts/bootstrap.sh installs them)",
)


class Containerd:
    def __init__(self, base: str) -> None:
        self.base = base
        self.sock = os.path.join(base, "ctd.sock")

    def ctr(self, *args: str, timeout: float = 20) -> str:
        p = subprocess.run(["ctr", "-a", self.sock, *args], capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def task_pid(self, cid: str) -> int | None:
        for line in self.ctr("task", "ls").splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[0] == cid and parts[2] == "RUNNING":
                return int(parts[1])
        return None


@pytest.fixture
def containerd() -> Iterator[Containerd]:
    base = tempfile.mkdtemp(prefix="rdrt-ctd-")
    cfg = os.path.join(base, "config.toml")
    with open(cfg, "w") as f:
        f.write(
            f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{base}/ctd.sock"\n[ttrpc]\n  address = "{base}/ctd.sock.ttrpc"\n'
        )
    log = open(os.path.join(base, "containerd.log"), "wb")
    proc = subprocess.Popen(["containerd", "--config", cfg], stdout=log, stderr=log, start_new_session=True)
    ctd = Containerd(base)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                ctd.ctr("version", timeout=2)
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"containerd did not start: see {base}/containerd.log")
            time.sleep(0.05)
        yield ctd
    finally:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            for line in ctd.ctr("task", "ls", timeout=5).splitlines()[1:]:
                cid = line.split()[0]
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    ctd.ctr("task", "kill", "-s", "KILL", cid, timeout=5)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        # shims outlive containerd by design; ours exit once their task is gone, but be sure
        for pid in _shims_of(ctd.sock):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for m in reversed(open("/proc/self/mounts").read().split("\n")):
            parts = m.split()
            if len(parts) > 1 and parts[1].startswith(base):
                subprocess.run(["umount", "-l", parts[1]], check=False)
        shutil.rmtree(base, ignore_errors=True)


def _shims_of(sock: str) -> list[int]:
    """Pids of containerd shims started for the containerd at ``sock`` (only those)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and sock.encode() in argv:
                out.append(int(d))
    return out


@contextlib.contextmanager
def default_cni_dirs() -> Iterator[None]:
    """/etc/cni/net.d and /opt/cni/bin exist as mount points; what we create is removed after."""
    made: list[str] = []
    for d in ("/etc/cni", "/etc/cni/net.d", "/opt/cni", "/opt/cni/bin"):
        if not os.path.isdir(d):
            os.mkdir(d)
            made.append(d)
    try:
        yield
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)


def busybox_rootfs(path: str) -> None:
    os.makedirs(os.path.join(path, "bin"))
    shutil.copy2(shutil.which("busybox") or "/bin/busybox", os.path.join(path, "bin", "busybox"))
    for applet in ("sh", "sleep", "nc"):
        os.symlink("busybox", os.path.join(path, "bin", applet))
    for d in ("proc", "sys", "dev", "tmp", "etc"):
        os.makedirs(os.path.join(path, d), exist_ok=True)


def test_container_started_by_containerd_is_captured_and_cleaned_up(containerd: Containerd) -> None:
    base = containerd.base
    net_d, bin_d, rootfs, ipam = (os.path.join(base, n) for n in ("net.d", "bin", "rootfs", "ipam"))
    os.makedirs(net_d)
    os.makedirs(bin_d)
    busybox_rootfs(rootfs)
    for plugin in ("bridge", "host-local", "loopback"):
        os.symlink(os.path.join(CNI_DIR, plugin), os.path.join(bin_d, plugin))
    r = random.randint(16, 250)
    subnet = f"10.244.{r}.0/24"
    bridge = f"rdrtbr{os.urandom(3).hex()}"
    primary = {"cniVersion": "1.0.0", "name": "rdrt-e2e", "plugins": [{
        # no gateway, no masquerade: nothing on the host changes beyond the bridge, removed below
        "type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False,
        "ipam": {"type": "host-local", "subnet": subnet, "dataDir": ipam},
    }]}
    conflist = os.path.join(net_d, "10-rdrt-e2e.conflist")
    with open(conflist, "w") as f:
        json.dump(primary, f, indent=2)
    original = open(conflist, "rb").read()
    log_file = os.path.join(base, "cni.log")
    # No node agent runs here: the thin plugin execs the Python one (tests/test_cni_thin.py has the agent)
    assert inst.install(net_d, bin_d, {"logFile": log_file, "logLevel": "info", "agentDown": "inProcess",
                                       "agentSocket": os.path.join(base, "no-agent.sock")}) == conflist

    cid = f"rdrt-{os.urandom(3).hex()}"
    target = f"10.244.{r}.200"  # inside the bridge subnet, no one there: only capture can answer
    run: subprocess.Popen[bytes] | None = None
    try:
        with default_cni_dirs():
            mounts = f"mount --bind {net_d} /etc/cni/net.d && mount --bind {bin_d} /opt/cni/bin"
            t0 = time.monotonic()
            run = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f"{mounts} && exec ctr -a {containerd.sock} run --rm --cni --rootfs {rootfs} {cid} /bin/sleep 60"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )
            pid = None
            while time.monotonic() - t0 < 20 and run.poll() is None:
                pid = containerd.task_pid(cid)
                if pid is not None and "ADD" in (open(log_file).read() if os.path.exists(log_file) else ""):
                    break
                time.sleep(0.05)
            assert pid is not None, f"container did not start: {run.stdout.read() if run.poll() is not None else ''}"
            started = time.monotonic() - t0
            with TcpListener(f"/proc/{pid}/ns/net", 15001, label="proxy") as proxy:
                containerd.ctr("task", "exec", "--exec-id", "probe", cid, "/bin/busybox", "sh", "-c",
                               f"echo from-container | /bin/busybox nc -w 2 {target} 8080", timeout=15)
                conns = proxy.wait_for(1, timeout=5)
            assert conns[0].line == "from-container"
            assert conns[0].orig_dst == (target, 8080)
            assert conns[0].peer[0].startswith(f"10.244.{r}.")
            leases = [n for n in os.listdir(os.path.join(ipam, "rdrt-e2e")) if n.startswith("10.")]
            assert len(leases) == 1

            containerd.ctr("task", "kill", "-s", "KILL", cid)
            run.wait(20)
            log = open(log_file).read()
            assert f"DEL container=default-{cid}" in log  # our DEL ran
            assert not [n for n in os.listdir(os.path.join(ipam, "rdrt-e2e")) if n.startswith("10.")]  # lease freed
            assert cid not in containerd.ctr("container", "ls")
            print(f"ctr run --cni to a running captured container: {started * 1e3:.0f} ms")
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(5)
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)
    inst.uninstall(net_d, bin_d)
    assert open(conflist, "rb").read() == original
    assert not os.path.exists(os.path.join(bin_d, "redirect-cni"))
    assert not os.path.exists(os.path.join(bin_d, "redirect-cni-python"))
