"""The containerd kit: a containerd of the test's own and ``ctr run --cni`` in a bridge network.

A containerd of the test's own (temp ``root``/``state``/socket, CRI disabled) runs busybox
containers whose network comes from the reference plugins (bridge + host-local) chained with
ours. ``ctr`` (containerd 1.6) reads only /etc/cni/net.d and /opt/cni/bin
(``gocni.WithDefaultConf``, no env override), so it runs in a private mount namespace where the
test's dirs are bind-mounted over those two paths; the host's are untouched (created empty only
if missing, and removed again). Only a foreground ``ctr run`` calls CNI DEL (when the task
exits, with an empty ``CNI_NETNS``), so containers run under a foreground ``ctr run`` in the
background and are stopped by killing their task.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CNI_DIR = "/usr/lib/cni"
NEEDED = [shutil.which(t) for t in ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "busybox", "unshare")]
needs_containerd = pytest.mark.skipif(
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


@contextlib.contextmanager
def running_containerd() -> Iterator[Containerd]:
    """A containerd of its own (temp root, state and socket, CRI off), stopped with every task and
    shim of its own, and its temp dir removed, on the way out."""
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
        for pid in shims_of(ctd.sock):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for m in reversed(open("/proc/self/mounts").read().split("\n")):
            parts = m.split()
            if len(parts) > 1 and parts[1].startswith(base):
                subprocess.run(["umount", "-l", parts[1]], check=False)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def containerd() -> Iterator[Containerd]:
    with running_containerd() as ctd:
        yield ctd


def shims_of(sock: str) -> list[int]:
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
def mount_points(*paths: str) -> Iterator[None]:
    """``paths`` exist as directories to mount over; those created here are removed after."""
    made: list[str] = []
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts) + 1):
            d = os.path.join(*parts[:i])
            if not os.path.isdir(d):
                os.mkdir(d)
                made.append(d)
    try:
        yield
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)


def default_cni_dirs() -> contextlib.AbstractContextManager[None]:
    """/etc/cni/net.d and /opt/cni/bin exist as mount points; what we create is removed after."""
    return mount_points("/etc/cni/net.d", "/opt/cni/bin")


def busybox_rootfs(path: str) -> None:
    os.makedirs(os.path.join(path, "bin"))
    shutil.copy2(shutil.which("busybox") or "/bin/busybox", os.path.join(path, "bin", "busybox"))
    for applet in ("sh", "sleep", "nc"):
        os.symlink("busybox", os.path.join(path, "bin", applet))
    for d in ("proc", "sys", "dev", "tmp", "etc"):
        os.makedirs(os.path.join(path, d), exist_ok=True)


@dataclass
class BridgeNet:
    """A conf dir and a bin dir (the reference plugins linked in) with a bridge + host-local
    network ``name`` on ``prefix``.0/24, a busybox rootfs and an IPAM dir, under ``base``."""

    name: str
    net_d: str
    bin_d: str
    rootfs: str
    ipam: str
    bridge: str
    prefix: str  # "10.x.y": the subnet is prefix.0/24
    conflist: str

    @property
    def target(self) -> str:
        """An address inside the subnet where no one is: only capture can answer a connection to it."""
        return f"{self.prefix}.200"

    def leases(self) -> list[str]:
        return [n for n in os.listdir(os.path.join(self.ipam, self.name)) if n.startswith("10.")]


@contextlib.contextmanager
def bridge_net(base: str, name: str, second_octet: int) -> Iterator[BridgeNet]:
    """A :class:`BridgeNet` in ``base`` on ``10.<second_octet>.<random>.0/24``; its bridge is
    deleted on the way out."""
    net_d, bin_d, rootfs, ipam = (os.path.join(base, x) for x in ("net.d", "bin", "rootfs", "ipam"))
    os.makedirs(net_d)
    os.makedirs(bin_d)
    busybox_rootfs(rootfs)
    for plugin in ("bridge", "host-local", "loopback"):
        os.symlink(os.path.join(CNI_DIR, plugin), os.path.join(bin_d, plugin))
    prefix = f"10.{second_octet}.{int.from_bytes(os.urandom(1), 'big') % 200 + 20}"
    bridge = f"rdrtbr{os.urandom(3).hex()}"
    conflist = os.path.join(net_d, f"10-{name}.conflist")
    with open(conflist, "w") as f:
        # no gateway, no masquerade: nothing on the host changes beyond the bridge, removed below
        json.dump({"cniVersion": "1.0.0", "name": name, "plugins": [{
            "type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False,
            "ipam": {"type": "host-local", "subnet": f"{prefix}.0/24", "dataDir": ipam}}]}, f, indent=2)
    try:
        yield BridgeNet(name, net_d, bin_d, rootfs, ipam, bridge, prefix, conflist)
    finally:
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)


@contextlib.contextmanager
def ctr_run(containerd: Containerd, net: BridgeNet, cid: str,
            cmd: str = "/bin/sleep 60") -> Iterator[subprocess.Popen[bytes]]:
    """``ctr run --rm --cni`` of a busybox container ``cid`` running ``cmd``, with ``net``'s dirs
    bind-mounted over the CNI paths in a private mount namespace; killed on the way out if it is
    still running."""
    with default_cni_dirs():
        mounts = f"mount --bind {net.net_d} /etc/cni/net.d && mount --bind {net.bin_d} /opt/cni/bin"
        run = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"{mounts} && exec ctr -a {containerd.sock} run --rm --cni --rootfs {net.rootfs} {cid} {cmd}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield run
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(5)


def wait_task(containerd: Containerd, cid: str, run: subprocess.Popen[bytes], timeout: float = 20,
              ready: Callable[[], bool] = lambda: True) -> int:
    """The pid of ``cid``'s task once it runs (and ``ready()`` holds); fails with ``ctr``'s output
    if it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.poll() is None:
        pid = containerd.task_pid(cid)
        if pid is not None and ready():
            return pid
        time.sleep(0.05)
    out = run.stdout.read() if run.stdout and run.poll() is not None else b"no task"
    raise AssertionError(f"container {cid} did not start: {out!r}")
