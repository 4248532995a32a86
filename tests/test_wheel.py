"""The package as a user gets it: ``make wheel``'s build, installed with pip into a fresh venv.

The wheel is built as ``make wheel`` builds it (``python -m build``: the sdist, then the wheel from
the sdist, each in an isolated environment), once per state of the sources (kept under
``build/test-wheel/<digest>``; a fresh clone builds it), and installed into a venv made outside the
source tree on Debian's Python with its site packages (bcc, libnftables). Everything then runs
from that venv's console scripts, in another directory, without the tree on ``sys.path``: a
sidecar setup on each backend with a captured connection, ``redirect-cni install`` and an ADD and
DEL through the installed thin plugin served by the installed agent, the version flags. A venv
without Debian's site packages, and an install with a piece taken out, show that what is missing
is named with how to get it, never as a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netkit import Pod, TcpListener, landing
from tests.test_agent import Node
from tests.test_cni_thin import PREV, run_plugin

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SCRIPTS = ("redirect", "redirect-cni", "redirect-agent", "redirect-nodeproxy")
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
APP_UID = 1000


def sources_digest() -> str:
    """A digest of what the sdist is made of (not of what a build left in the tree)."""
    h = hashlib.sha256()
    files = [ROOT / n for n in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")]
    files += sorted(p for p in (ROOT / "native").iterdir() if p.is_file())
    files += sorted(p for p in (ROOT / "redirect").rglob("*")
                    if p.suffix in (".py", ".c", ".h") or p.name == "py.typed")
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The wheel of these sources, as ``make wheel`` builds it (built here unless already built)."""
    cache = ROOT / "build" / "test-wheel"
    here = cache / sources_digest()
    found = sorted(here.glob("redirect-*.whl"))
    if not found:
        tmp = cache / f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        p = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp), str(ROOT)], cwd=ROOT,
                           capture_output=True, text=True, timeout=540)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        for old in cache.iterdir():  # one wheel kept: that of the sources now
            if old != tmp:
                shutil.rmtree(old, ignore_errors=True)
        tmp.rename(here)
        found = sorted(here.glob("redirect-*.whl"))
    assert len(found) == 1, found
    return found[0]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a process run from a venv: nothing that points Python at the tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV") and not k.startswith("REDIRECT_")}
    return {**env, **extra}


class Venv:
    """A venv on Debian's Python, outside the source tree, with the wheel installed by pip."""

    def __init__(self, path: Path, wheel: Path, system_site: bool = True) -> None:
        self.path = path
        self.cwd = path.parent  # not the source tree
        argv = ["/usr/bin/python3", "-m", "venv", *(["--system-site-packages"] if system_site else []), str(path)]
        subprocess.run(argv, check=True, timeout=120)
        p = self.run("pip", "install", "-q", "--disable-pip-version-check", str(wheel), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]

    @property
    def package(self) -> Path:
        return self.path / SITE / "redirect"

    def exe(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def run(self, name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.exe(name), *args], cwd=self.cwd, env=clean_env(**(env or {})),
                              capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    d = tmp_path_factory.mktemp("wheel-venv")
    assert ROOT not in d.parents
    try:
        yield Venv(d / "venv", wheel)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def elf_interpreter(path: Path) -> bool:
    """Whether the ELF executable at ``path`` names a program interpreter (is dynamically linked)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path}: not a 64-bit ELF file"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return any(struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum))  # PT_INTERP


def test_the_wheel_holds_the_whole_product_and_runs_outside_the_tree(wheel: Path, venv: Venv) -> None:
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name == f"redirect-{VERSION}-{py}-{py}-linux_{platform.machine()}.whl"  # tagged for its binaries
    p = venv.run("python", "-c", "import json, sys, redirect, redirect._native as n; "
                                 "print(json.dumps([redirect.__file__, n.__file__, sys.path, redirect.__version__]))")
    assert p.returncode == 0, p.stderr
    init, native, path, version = json.loads(p.stdout)
    assert Path(init) == venv.package / "__init__.py" and Path(native).parent == venv.package
    entries = [Path(e or venv.cwd).resolve() for e in path]  # ("" is the cwd)
    assert not [e for e in entries if e == ROOT or ROOT in e.parents], path
    assert version == VERSION
    for n in ("policy.h", "sock_addr.c", "sockopt.c", "sk_lookup.c", "tc_forward.c", "abi.h", "redirect.h"):
        assert (venv.package / "bpf" / n).is_file(), n
    thin = venv.package / "cni" / "redirect-cni-thin"
    assert os.access(thin, os.X_OK) and not elf_interpreter(thin)  # static: it runs on the node as it is
    for name in SCRIPTS:
        p = venv.run(name, "--version")
        assert (p.returncode, p.stdout) == (0, f"{name} {VERSION}\n"), p.stderr
    p = subprocess.run([str(thin), "--version"], capture_output=True, text=True, env={}, timeout=10)
    assert p.returncode == 0 and p.stdout.startswith(f"redirect-cni {VERSION} (thin plugin)\n"), p


@pytest.mark.parametrize("backend", ["iptables", "nftables", "ebpf"])
def test_sidecar_setup_captures_on_every_backend(venv: Venv, pod: Pod, backend: str) -> None:
    root = f"/sys/fs/bpf/rdrt-wheel-{os.getpid()}"
    env = {"REDIRECT_BPF_ROOT": root} if backend == "ebpf" else {}
    try:
        with TcpListener(pod.name, 15001, label="proxy") as proxy, TcpListener(pod.peer_name, 8080,
                                                                               label="app") as app:
            p = venv.run("redirect", "setup", pod.name, "--backend", backend, "--json", env=env)
            assert p.returncode == 0, p.stderr
            assert json.loads(p.stdout)["backend"] == backend
            hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID)
            assert hit.label == "proxy" and hit.orig_dst == (pod.peer_ip4, 8080), hit.result
            p = venv.run("redirect", "teardown", pod.name, env=env)
            assert p.returncode == 0, p.stderr
            assert landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID).label == "app"
    finally:
        if backend == "ebpf":
            from redirect.backends import ebpf

            ebpf.force_unload_host(root)
            assert not os.path.exists(root)


def test_cni_install_and_an_add_through_the_installed_thin_plugin_and_agent(
        venv: Venv, make_pod: Callable[..., Pod], tmp_path: Path) -> None:
    conf_dir, bin_dir = tmp_path / "net.d", tmp_path / "bin"
    conf_dir.mkdir()
    primary = conf_dir / "10-rdrt.conflist"
    original = json.dumps({"cniVersion": "1.0.0", "name": "rdrt-wheel", "plugins": [{"type": "bridge"}]}, indent=2)
    primary.write_text(original)
    n = Node(tmp_path, "iptables")
    n.agent_command = (venv.exe("redirect-agent"),)
    try:
        p = venv.run("redirect-cni", "install", "--conf-dir", str(conf_dir), "--bin-dir", str(bin_dir),
                     "--plugin-config", json.dumps({"agentSocket": n.events}))
        assert p.returncode == 0, p.stderr
        assert (bin_dir / "redirect-cni").read_bytes() == (venv.package / "cni" / "redirect-cni-thin").read_bytes()
        shebang = (bin_dir / "redirect-cni-python").read_text().splitlines()[0]  # the venv's Python
        assert shebang.startswith(f"#!{venv.path / 'bin'}/python") and shebang.endswith(" -I"), shebang
        conflist = json.loads(primary.read_text())
        entry = conflist["plugins"][-1]
        assert entry["type"] == "redirect-cni" and entry["agentSocket"] == n.events
        thin = str(bin_dir / "redirect-cni")
        want = {"cniVersion": "1.0.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]}
        assert run_plugin(thin, "VERSION", {"cniVersion": "1.0.0"}) == (0, want)
        assert run_plugin(str(bin_dir / "redirect-cni-python"), "VERSION", {"cniVersion": "1.0.0"}) == (0, want)

        agent = n.start_agent()
        maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()
        assert str(venv.package / "_native") in maps  # the agent runs the installed package
        pod = make_pod()
        # What the runtime hands our plugin: the list's name and version, our entry, the result so far.
        conf = {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **entry, "prevResult": PREV}
        with TcpListener(pod.name, 15001, label="proxy") as proxy, TcpListener(pod.peer_name, 8080,
                                                                               label="app") as app:
            assert landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID).label == "app"
            assert run_plugin(thin, "ADD", conf, pod.path) == (0, PREV)
            hit = landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID)
            assert hit.label == "proxy" and hit.orig_dst == (pod.peer_ip4, 8080), hit.result
            assert run_plugin(thin, "DEL", conf, pod.path) == (0, None)
            assert landing(pod.name, pod.peer_ip4, 8080, proxy, app, uid=APP_UID).label == "app"
        assert agent.metric('redirect_agent_events_total{type="cni_add"}') == 1
        p = venv.run("redirect-cni", "uninstall", "--conf-dir", str(conf_dir), "--bin-dir", str(bin_dir))
        assert p.returncode == 0, p.stderr
        assert primary.read_text() == original and not list(bin_dir.iterdir())
    finally:
        n.close()


def failed_clearly(p: subprocess.CompletedProcess[str], *words: str) -> None:
    """``p`` failed with one short message naming ``words``, and no traceback."""
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and all(w in p.stderr for w in words), p.stderr


def test_missing_pieces_are_named_with_how_to_get_them(wheel: Path, venv: Venv, pod: Pod,
                                                         tmp_path: Path) -> None:
    # A venv made without Debian's site packages: no bcc, no libnftables binding.
    bare = Venv(tmp_path / "bare", wheel, system_site=False)
    failed_clearly(bare.run("redirect", "setup", pod.name, "--backend", "ebpf"), "python3-bpfcc",
                   "--system-site-packages")
    failed_clearly(bare.run("redirect", "setup", pod.name, "--backend", "nftables"), "python3-nftables")
    # iptables needs neither, and finds its rules again without libnftables to list them with.
    assert bare.run("redirect", "setup", pod.name).returncode == 0
    shown = json.loads(bare.run("redirect", "show", pod.name, "--json").stdout)
    assert shown["installed"] and shown["backend"] == "iptables", shown
    p = bare.run("redirect", "teardown", pod.name)
    assert p.returncode == 0 and "removed" in p.stdout, (p.stdout, p.stderr)
    assert not json.loads(bare.run("redirect", "show", pod.name, "--json").stdout)["installed"]

    # The pieces the package build makes, taken out of an install.
    (bare.package / "cni" / "redirect-cni-thin").unlink()
    failed_clearly(bare.run("redirect-cni", "install", "--conf-dir", str(tmp_path / "net.d"), "--bin-dir",
                            str(tmp_path / "bin"), "--standalone", "rdrt.conflist"),
                   "thin CNI plugin is missing", "pip")
    assert not (tmp_path / "bin" / "redirect-cni").exists()
    for so in bare.package.glob("_native*.so"):
        so.unlink()
    failed_clearly(bare.run("redirect", "setup", pod.name), "redirect._native", "are missing", "pip install")
    p = bare.run("redirect-agent", "--events-socket", str(tmp_path / "a.sock"), "--proxy-socket",
                 str(tmp_path / "p.sock"), "--http-port", "0", "--host-netns", pod.path, "--no-log-json")
    failed_clearly(p, "agent failed to start", "redirect._native", "are missing")

    # The BPF sources, taken out of the venv with bcc (put back after).
    root = f"/sys/fs/bpf/rdrt-wheel-{os.getpid()}"
    bpf, aside = venv.package / "bpf", venv.package / "bpf.aside"
    bpf.rename(aside)
    try:
        failed_clearly(venv.run("redirect", "setup", pod.name, "--backend", "ebpf", env={"REDIRECT_BPF_ROOT": root}),
                       "BPF sources are missing", str(bpf))
    finally:
        aside.rename(bpf)
        assert not os.path.exists(root)
    shown = json.loads(venv.run("redirect", "show", pod.name, "--json").stdout)
    assert not shown["installed"], shown  # nothing was installed by any of the failures
