"""The CRI kit: a node of the test's own, with a containerd whose CRI plugin is on, spoken to over
the CRI gRPC API (``tests/cri/cri_api.proto``) as a kubelet speaks to it; images loaded from OCI
archives (the node image ``make image`` builds, a busybox image built here).

A node is a network namespace and a mount namespace of the test's own. containerd runs in both,
so everything it starts sees what a node's processes see: ``hostNetwork`` pods get the node's
netns (where the node agent's probe rules land, and the bridge of the pods' network), and the
node's ``/run``, ``/var/lib`` and ``/opt`` are its own: scratch directories bound over the
machine's inside that mount namespace only (``/run/netns``, where the CRI plugin pins pod
namespaces, ``/run/redirect`` with the agent's socket, ``/run/xtables.lock``, ``/var/lib/cni``, the
CNI plugins in ``/opt/cni/bin``; containerd's shim sockets under ``/run/containerd`` too), and so
is ``/sys/fs/bpf``, a scratch directory of the machine's bpffs. ``/etc`` is the machine's; the
node's CNI config dir is a scratch directory (the CRI plugin's ``conf_dir``), which the kubelet
(``tests.kit.kubelet``) binds where a hostPath volume names ``/etc/cni/net.d``. Mounts there are
shared, as on a systemd node, so ``HostToContainer`` propagation works. No path of the machine is
created or changed, and the mount namespace, with every pod netns pinned in it, goes when
containerd and its shims are gone. ``Node.view`` says where the test finds a node path.

The containerd has its own config, state, socket, runc root and cgroup parent
(``/rdrt-cri-<pid>-<tag>``, whose processes are killed and whose directories are removed on the
way out); its root (images) is kept in ``build/cri-node/`` from run to run, as a node keeps its
images (``image_store``). The CRI plugin's ``sandbox_image`` is the local busybox image; nothing
is pulled.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import netkit
from tests.ctrkit import CNI_DIR, shims_of

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "tests" / "cri" / "cri_api.proto"
SIDECAR_PROXY = ROOT / "tests" / "cri" / "sidecar_proxy.py"
IMAGE_ARCHIVE = ROOT / "build" / "redirect-image.tar"
CACHE = ROOT / "build" / "cri-node"
BUSYBOX = "rdrt-busybox:1"  # the sandbox ("pause") image and the apps' image
#: The node's own directories: scratch directories bound over these in its mount namespace.
NODE_DIRS = ("/run", "/var/lib", "/opt")
#: The node's CNI config dir: the CRI plugin's conf_dir, a scratch directory (/etc stays the machine's);
#: the kubelet binds it where a pod's hostPath volume names /etc/cni/net.d.
CNI_CONF = "/etc/cni/net.d"
BPFFS = "/sys/fs/bpf"
NEEDED = [shutil.which(t) for t in ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "busybox", "unshare",
                                    "nsenter", "mmdebstrap", "umoci")]
needs_cri = pytest.mark.skipif(
    os.geteuid() != 0 or None in NEEDED or not os.path.exists(f"{CNI_DIR}/bridge"),
    reason="needs root, containerd, runc, busybox-static, util-linux, mmdebstrap, umoci and the CNI reference"
           " plugins (scripts/bootstrap.sh installs them)")


def full_name(image: str) -> str:
    """An image reference as Kubernetes (and containerd's CRI) normalise it: ``redirect:0.1.0`` is
    ``docker.io/library/redirect:0.1.0``."""
    first, _, rest = image.partition("/")
    if not rest:
        return f"docker.io/library/{image}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{image}"
    return image


# --- the CRI API: stubs generated at test time ----------------------------------------------------


def stubs() -> tuple[ModuleType, ModuleType]:
    """``(cri_api_pb2, cri_api_pb2_grpc)``, generated from ``tests/cri/cri_api.proto`` by grpcio-tools
    into ``build/cri-stubs/<hash>/`` (once per proto and grpcio-tools version; never committed)."""
    if "cri_api_pb2_grpc" in sys.modules:
        return sys.modules["cri_api_pb2"], sys.modules["cri_api_pb2_grpc"]
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", "") or importlib.metadata.version("grpcio-tools")
    key = hashlib.sha256(PROTO.read_bytes() + version.encode()).hexdigest()[:16]
    out = ROOT / "build" / "cri-stubs" / key
    if not (out / "cri_api_pb2_grpc.py").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=out.parent))
        rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO} ({rc})")
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    mods = []
    for name in ("cri_api_pb2", "cri_api_pb2_grpc"):
        spec = importlib.util.spec_from_file_location(name, out / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # the grpc module imports the message module by this name
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


class Cri:
    """A CRI client: ``cri.runtime.<Rpc>(request)`` and ``cri.images.<Rpc>(request)`` over the runtime's
    unix socket; ``cri.pb`` makes the messages."""

    def __init__(self, sock: str) -> None:
        import grpc

        self.pb, rpc = stubs()
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        self.runtime = rpc.RuntimeServiceStub(self.channel)
        self.images = rpc.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()


def rpc_error(e: BaseException) -> str:
    """The message of a failed CRI call (what a kubelet puts in the pod's events)."""
    details = getattr(e, "details", None)
    return str(details() if callable(details) else e)


# --- images: OCI archives ---------------------------------------------------------------------


def node_image() -> Path:
    """``build/redirect-image.tar``, built by ``deploy/build-image.sh`` (what ``make image`` runs) unless
    it is up to date with the tree (the script decides, by the hash of what goes into the image)."""
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "deploy" / "build-image.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise AssertionError(f"make image failed:\n{p.stderr[-4000:]}")
    return IMAGE_ARCHIVE


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes | None = None, mode: int = 0o644,
             kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.mtime = kind, mode, link, 0
    info.size = len(data) if data is not None else 0
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _layer(files: dict[str, tuple[bytes | str | None, int]]) -> bytes:
    """An uncompressed layer tar: path -> (bytes for a file, str for a symlink target, None for a dir; mode)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (what, mode) in files.items():
            if what is None:
                _tar_add(tar, name, mode=mode, kind=tarfile.DIRTYPE)
            elif isinstance(what, str):
                _tar_add(tar, name, mode=0o777, kind=tarfile.SYMTYPE, link=what)
            else:
                _tar_add(tar, name, what, mode=mode)
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_archive(out: Path, image: str, config: dict[str, Any], layers: list[dict[str, Any]],
                   blobs: dict[str, bytes], base: tarfile.TarFile | None = None) -> None:
    """An OCI archive (image layout in a tar) of one image named ``image`` for containerd."""
    cfg = json.dumps(config).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": _digest(cfg), "size": len(cfg)},
                           "layers": layers}).encode()
    blobs = {**blobs, _digest(cfg): cfg, _digest(manifest): manifest}
    name = full_name(image)
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _digest(manifest),
        "size": len(manifest), "annotations": {"io.containerd.image.name": name,
                                               "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}]})
    with tarfile.open(out, "w") as tar:
        _tar_add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _tar_add(tar, "index.json", index.encode())
        if base is not None:
            for m in base.getmembers():
                if m.isfile() and m.name.lstrip("./").startswith("blobs/"):
                    tar.addfile(m, base.extractfile(m))
        for digest, data in blobs.items():
            _tar_add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)


def busybox_image(out: Path) -> Path:
    """An OCI archive of ``rdrt-busybox:1``: busybox-static with its applets, ``sleep`` forever by
    default (the pod sandbox's "pause" and the apps' image)."""
    files: dict[str, tuple[bytes | str | None, int]] = {
        d + "/": (None, 0o1777 if d == "tmp" else 0o755) for d in ("bin", "dev", "etc", "proc", "sys", "tmp")}
    files["bin/busybox"] = (Path(shutil.which("busybox") or "/bin/busybox").read_bytes(), 0o755)
    for applet in ("sh", "sleep", "nc", "echo", "cat", "ls", "id", "touch", "grep", "wc", "kill"):
        files[f"bin/{applet}"] = ("busybox", 0o777)
    files["etc/passwd"] = (b"root:x:0:0:root:/:/bin/sh\n", 0o644)
    files["etc/group"] = (b"root:x:0:\n", 0o644)
    layer = gzip.compress(_layer(files), mtime=0)
    raw = gzip.decompress(layer)
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sleep", "2147483647"]},
              "rootfs": {"type": "layers", "diff_ids": [_digest(raw)]}}
    _write_archive(out, BUSYBOX, config, [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                          "digest": _digest(layer), "size": len(layer)}], {_digest(layer): layer})
    return out


def derived_image(base_archive: Path, out: Path, image: str, files: dict[str, bytes], cmd: list[str]) -> Path:
    """An OCI archive of ``image``: the image of ``base_archive`` plus a layer with ``files``
    (path -> content, mode 0644) and ``cmd`` as its command."""
    with tarfile.open(base_archive) as base:
        def read(name: str) -> Any:
            f = base.extractfile(name)
            assert f is not None
            return json.load(f)

        (desc,) = read("index.json")["manifests"]
        manifest = read("blobs/sha256/" + desc["digest"].split(":", 1)[1])
        config = read("blobs/sha256/" + manifest["config"]["digest"].split(":", 1)[1])
        dirs = sorted({str(Path(p).parent) + "/" for p in files})
        layer_files: dict[str, tuple[bytes | str | None, int]] = {d: (None, 0o755) for d in dirs}
        layer_files.update({p: (data, 0o644) for p, data in files.items()})
        raw = _layer(layer_files)
        config = {**config, "config": {**config["config"], "Cmd": cmd, "Entrypoint": None},
                  "rootfs": {"type": "layers", "diff_ids": [*config["rootfs"]["diff_ids"], _digest(raw)]},
                  "history": [*config.get("history", []), {"created_by": f"test image: {image}"}]}
        layers = [*manifest["layers"], {"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                        "digest": _digest(raw), "size": len(raw)}]
        _write_archive(out, image, config, layers, {_digest(raw): raw}, base=base)
    return out


# --- the node ---------------------------------------------------------------------------------------


def _containerd_config(base: Path, root: Path, sock: str, cni_conf: str) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{base}/state"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
[{cri}]
  sandbox_image = "{full_name(BUSYBOX)}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # a pod's oom_score_adj no lower than containerd's own: lowering it needs CAP_SYS_RESOURCE,
  # which root may lack (it does on these test machines; runc then fails every sandbox)
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  Root = "{base}/runc"
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "/opt/cni/bin"
  conf_dir = "{cni_conf}"
  max_conf_num = 1
"""


class Node:
    """A node: its netns (``name``, under /run/netns), its view of the node paths (``view``), a
    containerd with CRI in both (``cri``, ``ctr``), and the pods' bridge network (``prefix``.0/24,
    the node at ``gateway``)."""

    def __init__(self, base: Path, root: Path) -> None:
        self.base = base
        self.root = root  # containerd's root: its images (and, while it runs, its containers)
        self.tag = f"rdrt-cri-{os.getpid()}-{os.urandom(3).hex()}"
        self.name = f"rdrt-crinode-{os.urandom(3).hex()}"
        self.ctd_dir = base / "containerd"
        self.sock = str(self.ctd_dir / "ctd.sock")
        self.scratch = {p: base / "node" / p.strip("/").replace("/", "_") for p in (*NODE_DIRS, CNI_CONF)}
        self.bpffs = f"{BPFFS}/{self.tag}"
        self.cgroup_parent = f"/{self.tag}"
        self.prefix = f"10.{int.from_bytes(os.urandom(1), 'big') % 50 + 200}.{int.from_bytes(os.urandom(1), 'big')}"
        self.gateway = f"{self.prefix}.1"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cri: Cri | None = None

    def host_path(self, path: str) -> str:
        """What the runtime binds for a hostPath volume ``path`` (the node's path; its CNI config dir
        is a scratch directory)."""
        return str(self.scratch[CNI_CONF] / path[len(CNI_CONF):].lstrip("/")) if self._under(path, CNI_CONF) \
            else path

    @staticmethod
    def _under(path: str, top: str) -> bool:
        return path == top or path.startswith(top.rstrip("/") + "/")

    def view(self, path: str) -> Path:
        """Where the test (outside the node's mount namespace) finds the node's ``path``."""
        for p, scratch in self.scratch.items():
            if self._under(path, p):
                return scratch / path[len(p):].lstrip("/")
        if self._under(path, BPFFS):
            return Path(self.bpffs) / path[len(BPFFS):].lstrip("/")
        return Path(path)

    @property
    def bpf_root(self) -> str:
        """The eBPF backend's default pin root (/sys/fs/bpf/redirect) of processes on the node, as the test sees it."""
        return str(self.view("/sys/fs/bpf/redirect"))

    def ctr(self, *args: str, timeout: float = 60) -> str:
        p = subprocess.run(["ctr", "-a", self.sock, "-n", "k8s.io", *args], capture_output=True, text=True,
                           timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def write_bridge_conflist(self) -> Path:
        """The node's CNI network: a bridge (the node at ``gateway``) with host-local addresses; what a
        node has before our DaemonSet adds its entry. Replaces whatever conflist is there."""
        net_d = self.view("/etc/cni/net.d")
        for f in net_d.iterdir():
            f.unlink()
        path = net_d / "10-rdrt.conflist"
        tmp = net_d / ".10-rdrt.conflist.tmp"
        tmp.write_text(json.dumps({"cniVersion": "1.0.0", "name": "rdrt-pods", "plugins": [{
            "type": "bridge", "bridge": "rdrtbr0", "isGateway": True, "ipMasq": False,
            "ipam": {"type": "host-local", "subnet": f"{self.prefix}.0/24",
                     "routes": [{"dst": "0.0.0.0/0"}]}}]}, indent=2))
        tmp.rename(path)
        return path

    def cni_config(self) -> str:
        """The network config the CRI plugin has loaded (its status), as JSON text."""
        assert self.cri is not None
        st = self.cri.runtime.Status(self.cri.pb.StatusRequest(verbose=True), timeout=10)
        return st.info.get("cniconfig", "")

    def wait_cni_loaded(self, needle: str, absent: str | None = None, timeout: float = 30) -> None:
        """Until the CRI plugin's loaded network config contains ``needle`` (and not ``absent``)."""
        deadline = time.monotonic() + timeout
        while needle not in (conf := self.cni_config()) or (absent is not None and absent in conf):
            assert time.monotonic() < deadline, f"the CRI plugin did not load {needle!r} (without {absent!r}): {conf}"
            time.sleep(0.1)

    def import_image(self, archive: Path, image: str, timeout: float = 180) -> str:
        """``ctr -n k8s.io images import`` (what an operator runs on a node), then until the CRI plugin
        knows the image; returns its id."""
        self.ctr("images", "import", str(archive), timeout=timeout)
        assert self.cri is not None
        deadline = time.monotonic() + 30
        while True:
            st = self.cri.images.ImageStatus(self.cri.pb.ImageStatusRequest(
                image=self.cri.pb.ImageSpec(image=full_name(image))), timeout=10)
            if st.image.id:
                return str(st.image.id)
            assert time.monotonic() < deadline, f"the CRI plugin does not see {image} after the import"
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return (self.ctd_dir / "containerd.log").read_text(errors="replace")
        except OSError:
            return ""

    # lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        netkit.create_netns(self.name)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        for scratch in self.scratch.values():
            scratch.mkdir(parents=True)
        self.view("/run/netns").mkdir()
        bin_d = self.view("/opt/cni/bin")
        bin_d.mkdir(parents=True)
        for plugin in ("bridge", "host-local", "loopback"):
            shutil.copy2(os.path.join(CNI_DIR, plugin), bin_d / plugin)
        os.mkdir(self.bpffs)
        self.write_bridge_conflist()
        self.ctd_dir.mkdir()
        cfg = self.ctd_dir / "config.toml"
        cfg.write_text(_containerd_config(self.ctd_dir, self.root, self.sock, self.host_path(CNI_CONF)))
        binds = [(str(self.scratch[p]), p) for p in NODE_DIRS] + [(self.bpffs, BPFFS)]
        script = " && ".join([*(f'mount --bind "{src}" "{dst}"' for src, dst in binds),
                              "mount --make-rshared /", f'exec containerd --config "{cfg}"'])
        with open(self.ctd_dir / "containerd.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.name}", "--", "unshare", "--mount", "--propagation", "private",
                 "sh", "-euc", script], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.cri = Cri(self.sock)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(Exception):
                st = self.cri.runtime.Status(self.cri.pb.StatusRequest(), timeout=2)
                if all(c.status for c in st.status.conditions) and st.status.conditions:
                    break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"containerd (CRI) did not get ready: {self.log()[-3000:]}")
            time.sleep(0.1)
        self.remove_pods()  # a kept root may hold the records of a run that was killed

    def remove_pods(self) -> list[str]:
        """Stop and remove every pod sandbox the runtime has; the errors, if any."""
        assert self.cri is not None
        pb, errors = self.cri.pb, []
        for sb in self.cri.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items:
            try:
                self.cri.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)
                self.cri.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)
            except Exception as e:  # noqa: BLE001 - the caller cleans up by force
                errors.append(f"sandbox {sb.metadata.name}: {rpc_error(e)}")
        return errors

    def close(self) -> None:
        """Everything goes: pods (through the CRI, then by force), containerd and its shims, the
        cgroups, the eBPF pins under the node's bpffs, the netns, the scratch dirs."""
        errors: list[str] = []
        if self.cri is not None:
            try:
                errors += self.remove_pods()
            except Exception as e:  # noqa: BLE001 - cleaned up by force below
                errors.append(rpc_error(e))
            self.cri.close()
        self._kill_cgroup()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            for pid in shims_of(self.sock):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._kill_cgroup()
        self._remove_cgroup()
        with contextlib.suppress(Exception):
            from redirect.backends import ebpf

            if os.path.exists(self.bpf_root):
                ebpf.force_unload_host(self.bpf_root)
        if os.path.isdir(self.bpffs):
            for dirpath, dirnames, filenames in os.walk(self.bpffs, topdown=False):
                for f in filenames:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(dirpath, f))
                for d in dirnames:
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(dirpath, d))
            with contextlib.suppress(OSError):
                os.rmdir(self.bpffs)
        netkit.remove_netns(self.name)
        shutil.rmtree(self.base, ignore_errors=True)
        if errors:
            print("crikit: " + "; ".join(errors), file=sys.stderr)

    def _cgroup_dirs(self) -> list[Path]:
        return [h / self.tag for h in Path("/sys/fs/cgroup").iterdir() if (h / self.tag).is_dir()]

    def _kill_cgroup(self) -> None:
        for top in self._cgroup_dirs():
            for dirpath, _, files in os.walk(top):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError):
                        for pid in Path(dirpath, "cgroup.procs").read_text().split():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), signal.SIGKILL)

    def _remove_cgroup(self) -> None:
        deadline = time.monotonic() + 10
        for top in self._cgroup_dirs():
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                while True:
                    try:
                        os.rmdir(dirpath)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:  # processes still leaving
                        if time.monotonic() > deadline:
                            print(f"crikit: cgroup {dirpath} still busy", file=sys.stderr)
                            break
                        time.sleep(0.05)


@contextlib.contextmanager
def running_node() -> Iterator[Node]:
    """A :class:`Node` with containerd (CRI) running and the busybox image imported; everything of
    it removed on the way out, but the image store (``image_store``)."""
    base = Path(tempfile.mkdtemp(prefix="rdrt-cri-"))
    with image_store(base) as root:
        node = Node(base, root)
        try:
            node.start()
            node.import_image(busybox_image(base / "busybox.tar"), BUSYBOX)
            yield node
        finally:
            node.close()


@contextlib.contextmanager
def image_store(base: Path) -> Iterator[Path]:
    """containerd's root: ``build/cri-node/root``, kept from run to run as a node keeps its images
    (importing an unchanged image then only reads the archive; nothing is unpacked again, and the
    unpacked image is not deleted at the end); ``base``/root, removed with ``base``, while another
    run holds that one."""
    CACHE.mkdir(parents=True, exist_ok=True)
    fd = os.open(CACHE / "lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield base / "root"
            return
        yield CACHE / "root"
    finally:
        os.close(fd)


def cri_log(path: Path) -> str:
    """The text of a container's CRI log file (``<time> <stream> <P|F> <text>`` lines; P lines are
    joined with the next)."""
    try:
        raw = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    out: list[str] = []
    part = ""
    for line in raw.splitlines():
        fields = line.split(" ", 3)
        if len(fields) < 3:
            continue
        text = fields[3] if len(fields) == 4 else ""
        if fields[2] == "P":
            part += text
        else:
            out.append(part + text)
            part = ""
    return "\n".join(out)


__all__ = ["BUSYBOX", "Cri", "IMAGE_ARCHIVE", "Node", "busybox_image", "cri_log", "derived_image", "full_name",
           "needs_cri", "node_image", "rpc_error", "running_node", "stubs", "SIDECAR_PROXY"]
