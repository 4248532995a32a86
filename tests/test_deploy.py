"""``deploy/``: the node DaemonSet validates against the Kubernetes schemas (offline), and its
containers' command lines, read from the manifest and run as written, make a working node
under containerd.

There is no kubelet here, so the test does its part by hand: a netns stands for the node
(the DaemonSet has ``hostNetwork``), each container's command runs in it with the container's
environment (``$(VAR)`` expanded as the kubelet does) and exactly the credentials its security
context gives (user, group, capabilities, no_new_privs: ``tests.kit.secctx``, as containerd makes
them) inside a private mount namespace where its hostPath and ConfigMap volumes are bind-mounted
at their ``mountPath``s (the host paths
``/etc/cni/net.d``, ``/opt/cni/bin`` and ``/run/redirect`` are directories of the test's own;
``/run/netns``, ``/sys/fs/bpf`` and ``/run/xtables.lock`` are the machine's, as on a node). The
probes are the manifest's too. Then ``ctr run --cni`` starts a busybox container on that node:
the plugin the installer put in place hands it to the agent, the reference node proxy captures
its traffic, and the runtime's DEL removes it again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from redirect.ambient import node
from redirect.ambient.agent import client
from redirect.cni.install import THIN_BINARY, plugin_entry
from tests import netkit
from tests.ctrkit import (  # the containerd kit
    CNI_DIR,
    Containerd,
    busybox_rootfs,
    containerd,  # noqa: F401 - the fixture
    mount_points,
    needs_containerd,
    wait_task,
)
from tests.kit import kubelet, secctx

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30"
BIN = os.path.dirname(sys.executable)  # where the console scripts are, as on the image's PATH
#: hostPath volumes the test points at directories of its own (the rest are the machine's).
TEST_HOST_PATHS = ("/etc/cni/net.d", "/opt/cni/bin", "/run/redirect")


def objects() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return out


def the(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects() if o["kind"] == kind]
    return obj


def container(name: str) -> dict[str, Any]:
    (c,) = [c for c in the("DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def container_env(c: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment, with the manifest's ConfigMap (``tests.kit.kubelet.container_env``)."""
    cm = the("ConfigMap")
    return kubelet.container_env(c, fields, {cm["metadata"]["name"]: cm["data"]})


def argv_of(c: dict[str, Any], env: dict[str, str]) -> list[str]:
    command, args = kubelet.argv_of(c, env)
    return [*command, *args]


# --- offline: schemas and consistency -----------------------------------------------------------


def test_every_object_validates_against_the_kubernetes_schemas() -> None:
    objs = objects()
    assert {o["kind"] for o in objs} >= {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"}
    for o in objs:
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{o['kind']}/{o['metadata']['name']}: {e.message} at {list(e.path)}") from None


def test_the_daemonset_has_what_a_node_needs() -> None:
    spec = the("DaemonSet")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["hostPID"] is True
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths >= {"/etc/cni/net.d", "/opt/cni/bin", "/run/netns", "/sys/fs/bpf", "/run/redirect"}
    assert [c["name"] for c in spec["containers"]] == ["install-cni", "agent", "node-proxy"]
    assert argv_of(container("install-cni"), {})[:3] == ["redirect-cni", "install", "--watch"]
    agent = container("agent")
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for c in spec["containers"]:  # every executable logs JSON lines
        assert "--log-json" in argv_of(c, {}), c["name"]
    # the ConfigMap's plugin entry is one redirect-cni accepts
    from redirect.cni.netconf import PluginConf

    entry = json.loads(the("ConfigMap")["data"]["cni-plugin.json"])
    pc = PluginConf({"cniVersion": "1.0.0", "type": "redirect-cni", **entry})
    assert pc.mode == "ambient" and pc.agent_socket == argv_of(agent, {"NODE_NAME": "n"})[2]
    pc.base_config()


def test_the_image_recipe_provides_what_the_manifests_run() -> None:
    """The image the manifests and ``redirect inject`` name is the one ``deploy/build-image.sh`` builds
    (``redirect:<the package's version>``), and each container's executable is a console script of the
    wheel, on the image's PATH. (tests/test_cri.py builds the image and runs these containers from it.)"""
    from redirect.k8s import inject

    text = (DEPLOY / "build-image.sh").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = project["version"]
    assert "NAME=redirect:$version" in text
    venv = re.search(r"^VENV=(\S+)", text, re.M)
    path = re.search(r"^IMAGE_PATH=(\S+)", text, re.M)
    assert venv is not None and path is not None and "$VENV/bin" in path.group(1).split(":")
    image = f"redirect:{version}"
    images = {c["image"] for c in the("DaemonSet")["spec"]["template"]["spec"]["containers"]}
    assert images == {image} and inject.DEFAULT_IMAGE == image
    for c in the("DaemonSet")["spec"]["template"]["spec"]["containers"]:
        exe = argv_of(c, {})[0]
        assert exe in project["scripts"], f"{c['name']} runs {exe}, which the package does not install"


# --- on a node: the command lines as written, under containerd ------------------------------------


class NodeUnderTest:
    """The node netns, the host-path stand-ins and the DaemonSet's processes."""

    def __init__(self, base: str) -> None:
        self.base = Path(base)
        self.name = f"rdrt-dnode-{os.urandom(3).hex()}"
        netkit.create_netns(self.name)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        self.host = {p: self.base / ("host" + p.replace("/", "_")) for p in TEST_HOST_PATHS}
        for d in self.host.values():
            d.mkdir(parents=True)
        self.config_dir = self.base / "configmap"
        self.config_dir.mkdir()
        for key, value in the("ConfigMap")["data"].items():
            (self.config_dir / key).write_text(value)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def source_of(self, volume: dict[str, Any]) -> str:
        if "configMap" in volume:
            return str(self.config_dir)
        path = volume["hostPath"]["path"]
        return str(self.host.get(path, path))

    def binds(self, c: dict[str, Any] | None) -> list[tuple[str, str, bool]]:
        """(source, mountPath, read-only) for a container's volumes; None: the node's own view."""
        if c is None:
            return [(str(src), dst, False) for dst, src in self.host.items()]
        volumes = {v["name"]: v for v in the("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
        out = []
        for m in c.get("volumeMounts", []):
            src = self.source_of(volumes[m["name"]])
            if src != m["mountPath"]:
                out.append((src, m["mountPath"], bool(m.get("readOnly"))))
        return out

    def command(self, argv: list[str], binds: list[tuple[str, str, bool]],
                creds: secctx.Creds | None = None) -> list[str]:
        """``argv`` in the node's netns, in a mount namespace of its own with ``binds``, under
        ``creds`` (a container's security context; None: full root, as the runtime itself)."""
        steps = []
        for src, dst, ro in binds:
            steps.append(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}")
            if ro:
                steps.append(f"mount -o remount,bind,ro {shlex.quote(dst)}")
        return ["nsenter", f"--net=/run/netns/{self.name}", "--", "unshare", "--mount", "--propagation", "private",
                "sh", "-c", " && ".join([*steps, 'exec "$@"']), "sh", *(creds.setpriv() if creds else []), *argv]

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("ISTIO_", "REDIRECT_", "CNI_", "POD_"))}
        return {**keep, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}", **extra}

    def start(self, name: str) -> list[str]:
        c = container(name)
        cenv = container_env(c, {"spec.nodeName": self.name})
        argv = argv_of(c, cenv)
        creds = secctx.creds_of(c, the("DaemonSet")["spec"]["template"]["spec"])
        with open(self.base / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(self.command(argv, self.binds(c), creds), env=self.env(cenv),
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return argv

    def creds(self, name: str) -> secctx.Creds:
        """What the container's process runs with, read from the live process (the one setpriv
        exec'd: ``sh`` -> ``setpriv`` -> the command keep one pid)."""
        return secctx.read_status(self.procs[name].pid)

    def log(self, name: str) -> str:
        return (self.base / f"{name}.log").read_text()

    def probe(self, probe: dict[str, Any]) -> int:
        return kubelet.http_probe(self.name, probe, "127.0.0.1")  # (hostNetwork: the pod's IP is the node's)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        try:
            node.teardown_node(self.name)
        finally:
            netkit.remove_netns(self.name)


def json_lines(text: str) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert recs and all({"time", "level", "msg"} <= r.keys() for r in recs), text[-2000:]
    return recs


@needs_containerd
@pytest.mark.timeout(180)
def test_the_daemonsets_command_lines_run_a_node_that_captures_a_containerd_pod(
        containerd: Containerd) -> None:  # noqa: F811 - pytest's fixture by name
    mounts = ["/etc/redirect", *TEST_HOST_PATHS]
    with mount_points("/etc/cni/net.d", "/opt/cni/bin", *mounts):
        n = NodeUnderTest(containerd.base)
        run: subprocess.Popen[bytes] | None = None
        try:
            net_d, bin_d, run_d = (n.host[p] for p in TEST_HOST_PATHS)
            for plugin in ("bridge", "host-local", "loopback"):
                os.symlink(os.path.join(CNI_DIR, plugin), bin_d / plugin)
            r = int.from_bytes(os.urandom(1), "big") % 200 + 20
            (net_d / "10-rdrt-node.conflist").write_text(json.dumps({
                "cniVersion": "1.0.0", "name": "rdrt-node", "plugins": [{
                    "type": "bridge", "bridge": "rdrtbr0", "isGateway": False, "ipMasq": False,
                    "ipam": {"type": "host-local", "subnet": f"10.246.{r}.0/24",
                             "dataDir": str(n.base / "ipam")}}]}))
            for name in ("agent", "node-proxy", "install-cni"):
                n.start(name)
            deadline = time.monotonic() + 60
            # Ready, installed, and the node proxy connected (the agent's readiness does not wait
            # for one: a pod's ADD before it gets no_proxy).
            while not (n.probe(container("agent")["readinessProbe"]) == 200
                       and '"redirect-cni"' in (net_d / "10-rdrt-node.conflist").read_text()
                       and (bin_d / "redirect-cni").exists() and '"node proxy synced"' in n.log("agent")):
                for name, p in n.procs.items():
                    assert p.poll() is None, f"{name} exited: {n.log(name)[-3000:]}"
                assert time.monotonic() < deadline, {k: n.log(k)[-1500:] for k in n.procs}
                time.sleep(0.1)
            assert n.probe(container("agent")["livenessProbe"]) == 200
            pod_spec = the("DaemonSet")["spec"]["template"]["spec"]
            for name in n.procs:  # each runs with exactly what its security context grants
                assert n.creds(name) == secctx.creds_of(container(name), pod_spec), name
            assert n.creds("node-proxy").effective == {"SYS_ADMIN", "NET_ADMIN"}
            assert n.creds("install-cni").effective == {"CHOWN"}
            # the installer's files: the ConfigMap's entry as in force, the two executables
            (entry,) = [e for e in json.loads((net_d / "10-rdrt-node.conflist").read_text())["plugins"]
                        if e["type"] == "redirect-cni"]
            assert entry == plugin_entry(json.loads(the("ConfigMap")["data"]["cni-plugin.json"]))
            assert (bin_d / "redirect-cni").read_bytes() == open(THIN_BINARY, "rb").read()
            assert os.access(bin_d / "redirect-cni", os.X_OK) and os.access(bin_d / "redirect-cni-python", os.X_OK)

            cid = f"rdrt-{os.urandom(3).hex()}"
            rootfs = n.base / "rootfs"
            busybox_rootfs(str(rootfs))
            run = subprocess.Popen(
                n.command(["ctr", "-a", containerd.sock, "run", "--rm", "--cni", "--rootfs", str(rootfs), cid,
                           "/bin/sleep", "60"], n.binds(None)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            wait_task(containerd, cid, run, timeout=30)
            (pod,) = client.list_pods(str(run_d / "agent.sock"))  # enrolled before the task ran
            assert pod["uid"] == f"default-{cid}" and pod["ips"][0].startswith(f"10.246.{r}.")
            assert node.list_pods(n.name) == {ip: pod["uid"] for ip in pod["ips"]}  # the node's probe sets
            target = f"10.246.{r}.200"
            containerd.ctr("task", "exec", "--exec-id", "probe", cid, "/bin/busybox", "sh", "-c",
                           f"echo hi | /bin/busybox nc -w 1 {target} 8080", timeout=15)
            deadline = time.monotonic() + 10
            while not [e for e in json_lines(n.log("node-proxy")) if e.get("event") == "accept"]:
                assert time.monotonic() < deadline, n.log("node-proxy")[-2000:]
                time.sleep(0.05)
            (accept,) = [e for e in json_lines(n.log("node-proxy")) if e.get("event") == "accept"]
            assert accept["orig_dst"] == [target, 8080] and accept["pod"] == pod["uid"], accept

            containerd.ctr("task", "kill", "-s", "KILL", cid)
            run.wait(20)
            assert client.list_pods(str(run_d / "agent.sock")) == [] and node.list_pods(n.name) == {}
            cni_log = json_lines((run_d / "cni.log").read_text())  # the ConfigMap's logFile, as JSON lines
            assert {r.get("container_id") for r in cni_log} == {f"default-{cid}"}
            assert [r for r in cni_log if "ADD" in r["msg"]] and [r for r in cni_log if "DEL" in r["msg"]]
            for name in ("agent", "install-cni"):
                json_lines(n.log(name))
        finally:
            if run is not None and run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(5)
            n.close()
